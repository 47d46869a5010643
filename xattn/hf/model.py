"""Entry points: `from_hf(model)` wraps a transformers model, `load(path)` = from_pretrained + from_hf.

An `XattnModel` runs the model's own encoder (ViT, a speech encoder, or none when the caller supplies
`encoder_hidden_states`), then decodes with xattn's GPT-2 decoder, static cache and search loops.
`generate()` takes transformers' keyword names and returns the same tensor layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CrossAttentionCache
from ..decoder import GPT2CrossAttentionDecoder, advancing
from ..generate import GenerationOptions, beam_search, sample_stream

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

        Cache lengths are rounded up to a multiple of cache_bucket so that runs of different lengths reuse
        one compiled graph (the extra positions are masked out).
        """
        compile_kwargs.setdefault("fullgraph", True)
        compile_kwargs.setdefault("dynamic", False)
        self._decode_step = advancing(torch.compile(self.decoder.step_logits, **compile_kwargs))
        if self._greedy_step is not None:
            self._greedy_step = advancing(torch.compile(self.decoder.step_greedy, **compile_kwargs))
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
        mask = None
        if attention_mask is not None:
            if hasattr(self.encoder, "_get_feature_vector_attention_mask"):
                mask = self.encoder._get_feature_vector_attention_mask(hidden.shape[1], attention_mask)
            elif attention_mask.shape[1] == hidden.shape[1]:
                mask = attention_mask
            else:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[1]} input frames but the encoder output has "
                    f"{hidden.shape[1]} positions and the encoder cannot map one to the other; pass "
                    "encoder_hidden_states with an encoder_attention_mask instead"
                )
        return hidden, mask

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, *args, return_dict_in_generate: bool = False, **kwargs):
        """Like transformers' generate: sequences [B * num_return_sequences, prompt + new], prompt included.

        With return_dict_in_generate=True: a GenerateOutput with the sequences, the beam scores (beam search)
        and the cache the run ended with.
        """
        plan = self._plan(*args, **kwargs)
        scores = None
        if plan.opts.num_beams > 1:
            sequences, scores = beam_search(self._decode_step, plan.cache, plan.prompt, plan.logits, plan.opts)
        else:
            steps = sample_stream(self._decode_step, plan.cache, plan.sequences, plan.prompt_length, plan.logits,
                                  plan.opts, greedy_step=self._greedy_step)
            generated = sum(1 for _ in steps)
            sequences = plan.sequences[:, : plan.prompt_length + generated]
        if return_dict_in_generate:
            return GenerateOutput(sequences=sequences, sequences_scores=scores, cache=plan.cache)
        return sequences

    def stream(self, *args, **kwargs) -> Iterator[torch.Tensor]:
        """Yield each step's new tokens [B * num_return_sequences] as they are produced (greedy or sampling)."""
        plan = self._plan(*args, **kwargs)
        if plan.opts.num_beams > 1:
            raise ValueError("streaming needs num_beams=1: beam search only knows its best sequence at the end")
        yield from sample_stream(
            self._decode_step, plan.cache, plan.sequences, plan.prompt_length, plan.logits, plan.opts,
            greedy_step=self._greedy_step,
        )

    def _plan(self, inputs: torch.Tensor | None = None, **kwargs) -> _Plan:
        """Check the inputs, run the encoder, fill the cache and prefill the prompt."""
        kwargs = dict(kwargs)
        prompt, encoder_inputs, cache_in = self._take_inputs(inputs, kwargs)
        states, states_mask = self._encoder_states(encoder_inputs, kwargs, cache_in)
        if cache_in is not None and prompt is None:
            raise ValueError("with a cache, pass decoder_input_ids: the sequence so far plus at least one new token")
        batch = states.shape[0] if states is not None else prompt.shape[0] if prompt is not None else 1
        prompt = self._prompt(prompt, batch, kwargs)
        if prompt.shape[0] != batch:
            raise ValueError(f"batch sizes differ: {batch} encoder rows but {prompt.shape[0]} decoder prompts; "
                             "pass one prompt row per input")
        opts = GenerationOptions.from_kwargs(self.generation_config, prompt.shape[1], **kwargs)
        prompt_length = prompt.shape[1]
        max_length = prompt_length + opts.max_new_tokens
        if self.decoder.embed_fn is None and max_length > self.decoder.max_positions:
            raise ValueError(
                f"prompt ({prompt_length}) + max_new_tokens ({opts.max_new_tokens}) = {max_length} exceeds the "
                f"decoder's n_positions ({self.decoder.max_positions}); lower max_new_tokens to at most "
                f"{self.decoder.max_positions - prompt_length}"
            )
        cache, logits = self._prefilled(cache_in, prompt, max_length, states, states_mask)
        group = opts.group_size
        if group > 1:  # beams / candidates share the prefill: copy its K/V, never the cross K/V
            cache = cache.expand(group)
            logits = logits.repeat_interleave(group, dim=0)
            prompt = prompt.repeat_interleave(group, dim=0)
        sequences = prompt.new_full((prompt.shape[0], max_length), opts.pad_token_id or 0)
        sequences[:, :prompt_length] = prompt
        return _Plan(opts, cache, prompt, sequences, prompt_length, logits)

    def _encoder_states(self, encoder_inputs: dict, kwargs: dict, cache_in) -> tuple:
        """(encoder_hidden_states, encoder_attention_mask) from the encoder inputs or as given; (None, None) when
        a given cache already holds what the decoder attends to."""
        attention_mask = kwargs.pop("attention_mask", None)
        states = kwargs.pop("encoder_hidden_states", None)
        states_mask = kwargs.pop("encoder_attention_mask", None)
        if len(encoder_inputs) + (states is not None) > 1:
            given = sorted(encoder_inputs) + (["encoder_hidden_states"] if states is not None else [])
            raise ValueError(f"pass one encoder input, got {given}")
        if encoder_inputs:
            return self.encode(attention_mask, **encoder_inputs)
        if states is not None:
            self._check_encoder_states(states, states_mask)
        elif self.is_encoder_decoder and cache_in is None:
            raise ValueError(f"pass {self._main_input_name()} (or encoder_hidden_states) to generate from")
        return states, states_mask

    def _prefilled(self, cache_in, prompt, max_length: int, states, states_mask) -> tuple:
        """(the cache, the prompt's last logits [B, V]): a given cache extended by the prompt's new tokens, or a
        new one (its length rounded up to the compile bucket) with the whole prompt."""
        batch, prompt_length = prompt.shape
        if cache_in is not None:
            cache = _adopt_cache(cache_in, max_length)
            if cache.batch_size != batch:
                raise ValueError(f"the given cache holds {cache.batch_size} rows but the prompt has {batch}")
            if prompt_length <= cache.length:
                raise ValueError("the prompt must extend past the cached positions by at least one token")
            return cache, self.decoder.prefill(cache, input_ids=prompt[:, cache.length:])
        bucket = self._cache_bucket
        cache_length = min(-(-max_length // bucket) * bucket, max(self.decoder.max_positions, max_length))
        cache = self.decoder.new_cache(batch, cache_length, states, states_mask)
        return cache, self.decoder.prefill(cache, input_ids=prompt)

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

    def _main_input_name(self) -> str:
        return getattr(self.encoder, "main_input_name", "pixel_values")


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B * num_return_sequences, prompt + new]
    sequences_scores: torch.Tensor | None  # beam search: length-normalised log-probability of each sequence
    cache: CrossAttentionCache  # the cache as generation left it (beam search: the running beams)


@dataclass
class _Plan:
    """What a generation run starts from."""

    opts: GenerationOptions  # the run's options, checked
    cache: CrossAttentionCache  # filled: cross K/V and the prompt's self K/V (copied per beam / candidate)
    prompt: torch.Tensor  # [B * group, P]
    sequences: torch.Tensor  # [B * group, P + max_new_tokens]: the prompt, then pad until tokens are written
    prompt_length: int  # P
    logits: torch.Tensor  # [B * group, V]: the prompt's last position


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


def load(path_or_id: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         allow_pickle: bool = False, weights: str = "exact", **from_pretrained_kwargs) -> XattnModel:
    """from_pretrained + from_hf. Weights load from safetensors; pickle-based weights (pytorch_model.bin) only
    with allow_pickle=True, and then through torch.load(weights_only=True). Never remote code: a checkpoint that
    asks for its own code is refused (xattn.hf)."""
    from .loading import load_config, load_model

    if from_pretrained_kwargs.pop("trust_remote_code", False):
        raise ValueError("trust_remote_code=True is not supported: xattn never runs code shipped with a checkpoint")
    from_pretrained_kwargs["use_safetensors"] = not allow_pickle or None  # None: safetensors first, else .bin
    looks_local = os.path.sep in path_or_id or path_or_id.startswith(".") or os.path.exists(path_or_id)
    if looks_local and not os.path.isdir(path_or_id):
        raise ValueError(f"{path_or_id}: no such checkpoint directory")
    model_class = _model_class(load_config(path_or_id))
    if dtype is not None:
        from_pretrained_kwargs["dtype" if _transformers_major() >= 5 else "torch_dtype"] = dtype
    model = load_model(model_class, path_or_id, **from_pretrained_kwargs)
    return from_hf(model.to(device), weights=weights)


def _model_class(config):
    import transformers

    names = {
        "vision-encoder-decoder": "VisionEncoderDecoderModel",
        "speech-encoder-decoder": "SpeechEncoderDecoderModel",
        "gpt2": "GPT2LMHeadModel",
    }
    if config.model_type not in names:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; xattn loads {sorted(names)} checkpoints"
        )
    return getattr(transformers, names[config.model_type])


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])
