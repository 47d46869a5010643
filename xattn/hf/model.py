"""Entry points: `from_hf(model)` wraps a transformers model, `load(path)` = from_pretrained + from_hf.

An `XattnModel` runs the model's own encoder (ViT, a speech encoder, or none when the caller supplies
`encoder_hidden_states`), then decodes with xattn's GPT-2 decoder, static cache and search loops.
`generate()` takes transformers' keyword names and returns the same tensor layout.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CrossAttentionCache
from ..decoder import GPT2CrossAttentionDecoder, advancing
from ..generate import GenerationOptions, beam_search, sample_stream
from ..logprobs import ChosenLogprobs
from .scores import average_logprobs

_ENCODER_INPUTS = ("pixel_values", "input_features", "input_values")


class XattnModel:
    """A transformers encoder-decoder (or GPT-2 decoder) driven by xattn's engine."""

    def __init__(
        self,
        decoder: GPT2CrossAttentionDecoder,
        *,
        encoder: nn.Module | None = None,
        enc_to_dec_proj: nn.Module | None = None,
        generation_config=None,
        hf_model: nn.Module | None = None,
    ):
        self.decoder = decoder
        self.encoder = encoder
        self.enc_to_dec_proj = enc_to_dec_proj
        self.generation_config = generation_config
        self.hf_model = hf_model
        self.is_encoder_decoder = encoder is not None
        self._decode_step = decoder.decode_step
        # greedy steps that pick the token inside the step (the packed format's head reads int8 first: head.py)
        self._greedy_step = decoder.decode_greedy if decoder.greedy_head is not None else None
        self._cache_bucket = 1  # cache lengths are rounded up to a multiple of this (compiled: fewer shapes)

    # ---- compilation --------------------------------------------------------------------------------------
    def compile(self, cache_bucket: int = 64, **compile_kwargs) -> XattnModel:
        """Compile the one-token decode step with torch.compile(fullgraph=True); prefill stays eager.

        The first shape compiles as it is (B=1 stays a static graph); a size that then changes (rows, encoder rows
        or positions, cache length) becomes symbolic in one more graph that every later size reuses (torch's
        automatic dynamic shapes). Cache lengths are rounded up to a multiple of cache_bucket (the extra positions
        are masked out). Where torch's recompile limit is reached all the same, the step runs eagerly, with a warning.
        """
        compile_kwargs.setdefault("fullgraph", True)
        self._decode_step = advancing(_compiled(self.decoder.step_logits, compile_kwargs))
        if self._greedy_step is not None:
            self._greedy_step = advancing(_compiled(self.decoder.step_greedy, compile_kwargs, forbidden_last=True))
        self._cache_bucket = cache_bucket
        return self

    def with_weights(self, weights: str, encoder_weights: str | None = None) -> XattnModel:
        """The same model with the decoder's projections in another format ("exact", "packed", "bf16",
        "int8"; see xattn.fast.formats). The encoder is shared, unless encoder_weights names a format: then its
        linear layers and the decoder's cross-attention K/V projection are copied into that format (a batch's
        encoder pass is bound by compute, and int8 products are faster). A ViT encoder in "packed" or "int8" then
        runs through xattn's kernel (xattn.fast.vit); other encoders keep their modules, with converted linears."""
        from ..fast import accelerate, accelerate_encoder

        cross_weights = encoder_weights or "exact"
        encoder = self.encoder
        if encoder is not None:
            encoder = accelerate_encoder(encoder, cross_weights)
        return XattnModel(accelerate(self.decoder, weights, cross_weights), encoder=encoder,
                          enc_to_dec_proj=self.enc_to_dec_proj, generation_config=self.generation_config,
                          hf_model=self.hf_model)

    # ---- encoder ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(
        self, attention_mask: torch.Tensor | None = None, **encoder_inputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the encoder: (encoder_hidden_states [B, S, D], encoder_attention_mask [B, S] or None)."""
        if self.encoder is None:
            raise ValueError("this model has no encoder: pass encoder_hidden_states (+ encoder_attention_mask)")
        (name, inputs), = encoder_inputs.items()
        _check_tensor(name, inputs, self.decoder)
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        hidden = self.encoder(inputs, **kwargs)[0]
        if self.enc_to_dec_proj is not None:
            hidden = self.enc_to_dec_proj(hidden)
        return hidden, None if attention_mask is None else self._encoder_mask(attention_mask, hidden.shape[1])

    def _encoder_mask(self, attention_mask: torch.Tensor, positions: int) -> torch.Tensor:
        """attention_mask over the encoder's input frames -> [B, positions] over its output."""
        if hasattr(self.encoder, "_get_feature_vector_attention_mask"):
            return self.encoder._get_feature_vector_attention_mask(positions, attention_mask)
        if attention_mask.shape[1] == positions:
            return attention_mask
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} input frames but the encoder output has {positions} "
            "positions and the encoder cannot map one to the other; pass encoder_hidden_states with an "
            "encoder_attention_mask instead"
        )

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, *args, return_dict_in_generate: bool = False, **kwargs):
        """Like transformers' generate: sequences [B * num_return_sequences, prompt + new], prompt included.

        With return_dict_in_generate=True: a GenerateOutput with the sequences, the beam scores (beam search),
        each sequence's average token log-probability (xattn.hf.scores) and the cache the run ended with.
        """
        plan = self._plan(*args, **kwargs)
        scores = None
        if plan.opts.num_beams > 1:
            sequences, scores = beam_search(self._decode_step, plan.cache, plan.prompt, plan.logits, plan.opts,
                                            reorder=self.decoder.reorder,
                                            candidates=self.decoder.steps.beam_candidates)
        else:
            logprobs = ChosenLogprobs(plan.sequences.shape[0], plan.opts.max_new_tokens, plan.sequences.device) \
                if return_dict_in_generate else None
            steps = sample_stream(self._decode_step, plan.cache, plan.sequences, plan.prompt_length, plan.logits,
                                  plan.opts, greedy_step=self._greedy_step, logprobs=logprobs,
                                  argmax=self.decoder.steps.argmax_rows)
            generated = sum(1 for _ in steps)
            sequences = plan.sequences[:, : plan.prompt_length + generated]
        if return_dict_in_generate:
            eos = list(plan.opts.eos_token_id)
            if scores is None and logprobs.complete:  # added up as the tokens were chosen
                avg_logprob = logprobs.average(sequences[:, plan.prompt_length:], eos)
            else:  # beams, or the fused greedy argmax: replayed
                avg_logprob = average_logprobs(self.decoder, plan.cache, sequences, plan.prompt_length, eos)
            return GenerateOutput(sequences=sequences, sequences_scores=scores, cache=plan.cache,
                                  avg_logprob=avg_logprob)
        return sequences

    def stream(self, *args, **kwargs) -> Iterator[torch.Tensor]:
        """Yield each step's new tokens [B * num_return_sequences] as they are produced (greedy or sampling)."""
        plan = self._plan(*args, **kwargs)
        if plan.opts.num_beams > 1:
            raise ValueError("streaming needs num_beams=1: beam search only knows its best sequence at the end")
        yield from sample_stream(
            self._decode_step, plan.cache, plan.sequences, plan.prompt_length, plan.logits, plan.opts,
            greedy_step=self._greedy_step, argmax=self.decoder.steps.argmax_rows,
        )

    def inflight(self, max_rows: int = 16, encode_together: bool = True):
        """An in-flight batching scheduler over this model (xattn/inflight.py), max_rows decoding rows: requests
        built by request() join its decode batch while it runs; each gets the tokens generate() gives it alone.
        encode_together=False encodes each newcomer alone (slower; bit for bit its lone encoder output)."""
        from .inflight import scheduler

        return scheduler(self, max_rows, encode_together)

    def request(self, *args, **kwargs):
        """generate()'s arguments for one input (a batch of one) as an in-flight request, checked now."""
        from .inflight import request

        return request(self, *args, **kwargs)

    def _plan(self, inputs: torch.Tensor | None = None, **kwargs) -> _Plan:
        """Check the inputs, run the encoder, fill the cache and prefill the prompt."""
        kwargs = dict(kwargs)
        prompt, encoder_inputs, cache_in = self._take_inputs(inputs, kwargs)
        encoder = self._encoder_args(encoder_inputs, kwargs)
        if hasattr(cache_in, "get_seq_length") and not int(cache_in.get_seq_length()):
            cache_in = None  # an empty transformers cache (DynamicCache()): nothing to continue from
        if cache_in is not None and prompt is None:
            raise ValueError("with a cache, pass decoder_input_ids: the sequence so far plus at least one new token")
        states, states_mask = self._encoder_states(encoder) if cache_in is None else (None, None)
        batch = states.shape[0] if states is not None else prompt.shape[0] if prompt is not None else 1
        prompt = self._prompt(prompt, batch, kwargs)
        if prompt.shape[0] != batch:
            raise ValueError(f"batch sizes differ: {batch} encoder rows but {prompt.shape[0]} decoder prompts; "
                             "pass one prompt row per input")
        opts = GenerationOptions.from_kwargs(self.generation_config, prompt.shape[1], **kwargs)
        self._check_ids(prompt, opts)
        prompt_length = prompt.shape[1]
        max_length = prompt_length + opts.max_new_tokens
        positions = max_length - 1  # the last token is never fed back: it needs no position
        self._check_room(prompt_length, opts)
        self._check_memory(batch * opts.group_size, positions)
        if cache_in is not None:
            cache = self._given_cache(cache_in, prompt, positions, encoder)
            logits = self.decoder.prefill(cache, input_ids=prompt[:, cache.length:])
        else:
            bucket = self._cache_bucket  # rounded up: fewer shapes for a compiled step (the extra positions are masked)
            cache_length = min(-(-positions // bucket) * bucket, max(self.decoder.max_positions, positions))
            cache = self.decoder.new_cache(batch, cache_length, states, states_mask)
            logits = self.decoder.prefill(cache, input_ids=prompt)
        group = opts.group_size
        if group > 1:  # beams / candidates share the prefill: copy its K/V, never the cross K/V
            cache = cache.expand(group)
            logits = logits.repeat_interleave(group, dim=0)
            prompt = prompt.repeat_interleave(group, dim=0)
        sequences = prompt.new_full((prompt.shape[0], max_length), opts.pad_token_id or 0)
        sequences[:, :prompt_length] = prompt
        return _Plan(opts, cache, prompt, sequences, prompt_length, logits)

    def _check_memory(self, rows: int, positions: int) -> None:
        """Refuse, before allocating it, a generation whose cache and logits alone would not fit this machine's
        memory (num_beams=10**9 in a generation_config.json, or --num-beams 1e8, would allocate until killed)."""
        decoder = self.decoder
        per_row = 2 * decoder.num_layers * decoder.num_heads * decoder.head_dim * positions  # self K/V
        per_row += getattr(self.decoder.lm_head, "out_features", 0) * 2  # a step's logits and their scores
        needed = rows * per_row * torch.finfo(decoder.dtype).bits // 8
        total = physical_memory()
        if total and needed > total:
            raise ValueError(f"this generation needs {rows} decoding rows (inputs x beams or sequences) x {positions} "
                             f"positions: {needed / 2**30:.1f} GB of cache alone, more than this machine's "
                             f"{total / 2**30:.0f} GB; use fewer beams or sequences, fewer inputs at once or fewer "
                             "new tokens")

    def _check_room(self, prompt_length: int, opts: GenerationOptions) -> None:
        """Refuse a prompt + max_new_tokens past n_positions + 1 (the last token is never fed back)."""
        max_length = prompt_length + opts.max_new_tokens
        if self.decoder.embed_fn is None and max_length - 1 > self.decoder.max_positions:
            raise ValueError(
                f"prompt ({prompt_length}) + max_new_tokens ({opts.max_new_tokens}) = {max_length} exceeds the "
                f"decoder's n_positions ({self.decoder.max_positions}) + 1; lower max_new_tokens to at most "
                f"{self.decoder.max_positions + 1 - prompt_length}"
            )

    def _encoder_args(self, encoder_inputs: dict, kwargs: dict) -> _EncoderArgs:
        """Pop and check what the call gives for the encoder side; nothing runs yet."""
        args = _EncoderArgs(encoder_inputs, kwargs.pop("attention_mask", None),
                            kwargs.pop("encoder_hidden_states", None), kwargs.pop("encoder_attention_mask", None))
        if len(encoder_inputs) + (args.states is not None) > 1:
            given = sorted(encoder_inputs) + (["encoder_hidden_states"] if args.states is not None else [])
            raise ValueError(f"pass one encoder input, got {given}")
        if args.states is not None:
            self._check_encoder_states(args.states, args.states_mask)
        return args

    def _encoder_states(self, args: _EncoderArgs) -> tuple:
        """(encoder_hidden_states, encoder_attention_mask): the encoder's output, or as given."""
        if args.inputs:
            return self.encode(args.attention_mask, **args.inputs)
        if args.states is None and self.is_encoder_decoder:
            raise ValueError(f"pass {self._main_input_name()} (or encoder_hidden_states) to generate from")
        return args.states, args.states_mask

    def _given_cache(self, cache_in, prompt: torch.Tensor, positions: int, args: _EncoderArgs) -> CrossAttentionCache:
        """The given cache as an xattn cache with room for `positions`, its cross K/V computed from the encoder
        inputs where it has none, and the encoder mask given with it applied (the encoder runs only when needed)."""
        cache = _adopt_cache(cache_in, positions)
        batch = prompt.shape[0]
        if cache.batch_size != batch:
            raise ValueError(f"the given cache holds {cache.batch_size} rows but the prompt has {batch}")
        if prompt.shape[1] <= cache.length:
            raise ValueError("the prompt must extend past the cached positions by at least one token")
        if cache.has_cross:
            mask = args.states_mask
            if mask is None and args.attention_mask is not None and self.is_encoder_decoder:
                mask = self._encoder_mask(args.attention_mask, cache.cross_keys.shape[3])
            if mask is not None:
                cache.set_row_mask(mask)
        elif args.inputs or args.states is not None:
            states, mask = self._encoder_states(args)
            if states.shape[0] != batch:
                raise ValueError(f"batch sizes differ: {states.shape[0]} encoder rows but {batch} cache rows")
            cache.set_cross(*self.decoder.cross_key_values(states), mask)
        elif self.is_encoder_decoder:
            raise ValueError(f"the given cache holds no cross-attention K/V: pass {self._main_input_name()} (or "
                             "encoder_hidden_states) with it, to compute them from")
        return cache

    def _take_inputs(self, inputs, kwargs) -> tuple[torch.Tensor | None, dict, object]:
        """Pop (prompt, encoder inputs, given cache) from transformers-style arguments."""
        prompt = kwargs.pop("decoder_input_ids", None)
        if prompt is None:
            prompt = kwargs.pop("input_ids", None)
        encoder_inputs = {name: kwargs.pop(name) for name in _ENCODER_INPUTS if name in kwargs}
        if inputs is not None:
            if self.is_encoder_decoder:
                encoder_inputs[self._main_input_name()] = inputs
            else:
                prompt = inputs
        kwargs.pop("use_cache", None)
        decoder_mask = kwargs.pop("decoder_attention_mask", None)
        if not self.is_encoder_decoder and decoder_mask is None:  # a GPT-2 alone: attention_mask is the prompt's
            decoder_mask = kwargs.pop("attention_mask", None)
        if decoder_mask is not None and not bool(decoder_mask.all()):
            raise ValueError("padded decoder prompts are not supported: give every row the same prompt length")
        # transformers renamed past_key_values to cache (5.24); accept both
        legacy_name, new_name = kwargs.pop("past_key_values", None), kwargs.pop("cache", None)
        if legacy_name is not None and new_name is not None:
            raise ValueError("pass the cache once: either cache= or past_key_values=, not both")
        return prompt, encoder_inputs, new_name if new_name is not None else legacy_name

    def _check_encoder_states(self, states: torch.Tensor, mask: torch.Tensor | None) -> None:
        _check_tensor("encoder_hidden_states", states, self.decoder, ndim=3)
        if not self.decoder.has_cross_attention:
            raise ValueError(
                "encoder_hidden_states were given but this GPT-2 decoder has no cross-attention layers "
                "(config.add_cross_attention=False); drop them or load a model built with add_cross_attention=True"
            )
        if states.shape[-1] != self.decoder.hidden_size:
            raise ValueError(f"encoder_hidden_states has hidden size {states.shape[-1]} but the decoder's "
                             f"cross-attention expects {self.decoder.hidden_size}")
        if mask is not None and mask.shape != states.shape[:2]:
            raise ValueError(f"encoder_attention_mask has shape {tuple(mask.shape)}, expected "
                             f"{tuple(states.shape[:2])} (batch, encoder positions)")

    def _prompt(self, prompt: torch.Tensor | None, batch: int, kwargs) -> torch.Tensor:
        """The decoder prompt; like transformers, an encoder-decoder prompt starts with decoder_start_token_id."""
        cfg = self.generation_config
        names = ("decoder_start_token_id", "bos_token_id") if self.is_encoder_decoder else ("bos_token_id",)
        start = next((v for v in (kwargs.get(n, getattr(cfg, n, None)) for n in names) if v is not None), None)
        if prompt is not None:
            _check_tensor("decoder_input_ids", prompt, self.decoder, ndim=2, integer=True)
            if self.is_encoder_decoder and start is not None and bool((prompt[:, 0] != start).all()):
                prompt = torch.cat([prompt.new_full((prompt.shape[0], 1), int(start)), prompt], dim=1)
            return prompt
        if start is None:
            raise ValueError(f"no prompt given and the model has no {names[0]}: pass decoder_input_ids")
        return torch.full((batch, 1), int(start), dtype=torch.long, device=self.decoder.device)

    def _check_ids(self, prompt: torch.Tensor, opts) -> None:
        """The prompt (start token included) and the padding of stopped rows are fed to the token embedding: ids
        past it would stop generation with an IndexError on the way."""
        vocab = self.decoder.transformer.wte.num_embeddings if self.decoder.embed_fn is None else None
        if vocab is None:
            return
        if prompt.numel() and not bool(((prompt >= 0) & (prompt < vocab)).all()):
            bad = prompt[(prompt < 0) | (prompt >= vocab)][0].item()
            raise ValueError(f"the decoder prompt holds token id {bad}, outside the vocabulary (0..{vocab - 1}): "
                             "check decoder_input_ids and decoder_start_token_id")
        if opts.pad_token_id is not None and not 0 <= opts.pad_token_id < vocab:
            raise ValueError(f"pad_token_id={opts.pad_token_id} is outside the vocabulary (0..{vocab - 1})")

    def _main_input_name(self) -> str:
        return getattr(self.encoder, "main_input_name", "pixel_values")


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B * num_return_sequences, prompt + new]
    sequences_scores: torch.Tensor | None  # beam search: length-normalised log-probability of each sequence
    cache: CrossAttentionCache  # the cache as generation left it (beam search: the running beams)
    avg_logprob: torch.Tensor  # [B * num_return_sequences] mean log-probability of the generated tokens (to EOS)


@dataclass
class _EncoderArgs:
    """What a generate() call gives for the encoder side."""

    inputs: dict  # {pixel_values | input_features | input_values: tensor}, or empty
    attention_mask: torch.Tensor | None  # over the encoder inputs' frames
    states: torch.Tensor | None  # encoder_hidden_states [B, S, D], given instead of inputs
    states_mask: torch.Tensor | None  # encoder_attention_mask [B, S]


@dataclass
class _Plan:
    """What a generation run starts from."""

    opts: GenerationOptions  # the run's options, checked
    cache: CrossAttentionCache  # filled: cross K/V and the prompt's self K/V (copied per beam / candidate)
    prompt: torch.Tensor  # [B * group, P]
    sequences: torch.Tensor  # [B * group, P + max_new_tokens]: the prompt, then pad until tokens are written
    prompt_length: int  # P
    logits: torch.Tensor  # [B * group, V]: the prompt's last position


def _compiled(step: Callable, compile_kwargs: dict, forbidden_last: bool = False) -> Callable:
    """torch.compile(step), run eagerly instead of failing where torch's recompile limit is reached.

    forbidden_last: the last argument is a greedy step's forbidden ids (none, or the EOS ids while min_new_tokens
    holds); its length is left unbacked, so that every length, 0 included, runs the same graph."""
    compiled = torch.compile(step, **compile_kwargs)

    def run(*args):
        if forbidden_last:
            torch._dynamo.decorators.mark_unbacked(args[-1], 0)
        try:
            return compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn("torch.compile reached its recompile limit for xattn's decode step; this shape runs eagerly "
                          "(torch._dynamo.config.recompile_limit raises the limit)", stacklevel=2)
            return step(*args)

    return run


def _adopt_cache(cache_in, max_length: int) -> CrossAttentionCache:
    """Accept an xattn cache, a transformers EncoderDecoderCache/DynamicCache, or legacy tuples."""
    if isinstance(cache_in, CrossAttentionCache):
        if cache_in.max_length < max_length:
            raise ValueError(f"the given cache has room for {cache_in.max_length} positions, {max_length} needed")
        return cache_in
    if hasattr(cache_in, "layers") or hasattr(cache_in, "self_attention_cache"):
        return CrossAttentionCache.from_hf(cache_in, max_length)
    return CrossAttentionCache.from_legacy(cache_in, max_length)


def _check_tensor(name: str, tensor, decoder: GPT2CrossAttentionDecoder, ndim: int | None = None,
                  integer: bool = False) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.device != decoder.device:
        raise ValueError(f"{name} is on {tensor.device} but the model is on {decoder.device}; "
                         f"move it with .to('{decoder.device}')")
    if integer:
        if tensor.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must hold integer token ids (torch.long), got {tensor.dtype}")
    elif tensor.dtype != decoder.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype} but the model runs in {decoder.dtype}; "
                         f"convert it with .to({decoder.dtype})")


# ---- construction -------------------------------------------------------------------------------------------
def from_hf(model: nn.Module, lm_head: nn.Module | None = None, weights: str = "exact") -> XattnModel:
    """Wrap a transformers VisionEncoderDecoderModel, SpeechEncoderDecoderModel, GPT2LMHeadModel or
    GPT2Model (+ lm_head). With weights="exact" no weight is copied; "packed", "bf16" and "int8" copy the
    decoder's projections into that format (see xattn.fast.formats)."""
    model.eval()
    generation_config = getattr(model, "generation_config", None)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "decoder") and hasattr(model, "encoder"):
        gpt2 = model.decoder
        transformer, head = _gpt2_parts(gpt2, lm_head)
        proj = getattr(model, "enc_to_dec_proj", None)
        return XattnModel(
            _decoder(transformer, head, weights), encoder=model.encoder,
            enc_to_dec_proj=proj, generation_config=generation_config, hf_model=model,
        )
    transformer, head = _gpt2_parts(model, lm_head)
    return XattnModel(_decoder(transformer, head, weights), generation_config=generation_config, hf_model=model)


def _decoder(transformer: nn.Module, head: nn.Module | None, weights: str) -> GPT2CrossAttentionDecoder:
    decoder = GPT2CrossAttentionDecoder(transformer, head)
    if weights == "exact":
        return decoder
    from ..fast import accelerate

    return accelerate(decoder, weights)


def _gpt2_parts(model: nn.Module, lm_head: nn.Module | None):
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):
        return model.transformer, lm_head if lm_head is not None else model.lm_head
    if hasattr(model, "h") and hasattr(model, "wpe"):
        return model, lm_head
    raise ValueError(
        f"{type(model).__name__} is not a GPT-2 decoder; xattn runs GPT2LMHeadModel / GPT2Model decoders "
        "(alone or inside VisionEncoderDecoderModel / SpeechEncoderDecoderModel)"
    )


def physical_memory() -> int:
    """This machine's memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
