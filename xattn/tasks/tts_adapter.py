"""Tortoise-style text-to-speech decoding.

`PrefixConditionedGPT2` runs existing prefix-conditioned GPT-2 TTS decoders (Tortoise's UnifiedVoice, XTTS's
GPT2InferenceModel) through xattn's static cache and generation loop, taking their modules as they are:
a transformers `GPT2Model` whose `wte` is unused and whose `wpe` returns zeros, the caller's prefix
embeddings (conditioning latents + text embeddings), and their own audio-token embedding, position embedding,
final norm and head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CrossAttentionCache
from ..decoder import GPT2CrossAttentionDecoder
from ..generate import GenerationOptions, beam_search, sample_stream
from ..steps import DecoderSteps


@dataclass
class AudioTokens:
    """One generation step: the new audio token of every row and the hidden state that produced it."""

    tokens: torch.Tensor  # [rows]; rows = batch * num_return_sequences, each input's candidates consecutive
    latents: torch.Tensor  # [rows, D]: final-norm hidden state at the position that predicted `tokens`


@dataclass
class AudioCodes:
    sequences: torch.Tensor  # [rows, new tokens]: generated audio tokens (start token excluded), stop-padded
    latents: torch.Tensor  # [rows, new tokens, D]: the hidden state that produced each token
    lengths: torch.Tensor  # [rows]: tokens up to and including the stop token (or all, if it never stopped)


class PrefixConditionedGPT2:
    """A prefix-conditioned GPT-2 audio-token decoder, decoded by xattn.

    gpt2: the transformers `GPT2Model` (its wte/wpe are never called).
    token_embedding: audio token ids [B, T] -> [B, T, D] (Tortoise: `mel_embedding`).
    position_embedding: audio positions [T] -> [T, D], position 0 = the start token (Tortoise:
        `mel_pos_embedding.emb`; XTTS: `mel_pos_embedding.emb`).
    head: [.., D] -> logits over audio tokens (Tortoise: `mel_head`).
    final_norm: applied before the head and to the streamed latents (Tortoise/XTTS: `final_norm`); None if
        `head` already includes it.
    prompt_token: the id at every prefix position of the token sequence the pipeline's own generate() sees, or
        None. XTTS and Tortoise call transformers' generate on `[1] * P + [start]` (the prefix embeddings stand
        in for the ones), so their repetition penalty also divides the score of audio token 1 from the first step
        on; with prompt_token=1 xattn's does the same (one copy stands for all P: the penalty is per id), and
        min_length counts those P + 1 ids as transformers' does.
    weights: the format of the GPT's projections, as `xattn.load(..., weights=)` takes it: "exact" (its own
        tensors, nothing copied), "packed", "bf16" or "int8" (copies made here, once: build the adapter again after
        changing the weights; see xattn.fast.formats). The audio head and the embeddings stay the caller's own.
    """

    def __init__(self, gpt2: nn.Module, token_embedding: Callable, position_embedding: Callable, head: Callable,
                 final_norm: Callable | None = None, prompt_token: int | None = None, weights: str = "exact"):
        self.gpt2, self.token_embedding, self.position_embedding = gpt2, token_embedding, position_embedding
        self.head, self.final_norm, self.prompt_token = head, final_norm, prompt_token
        self.weights = weights
        self._steps = None if weights == "exact" else _steps(gpt2, weights)  # None: transformers' own products

    def _decoder(self, prefix_length: int) -> GPT2CrossAttentionDecoder:
        def embed(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [B, T] at cache positions [T]
            return self.token_embedding(ids) + self.position_embedding(positions - prefix_length)

        # no head: steps return ln_f hidden states
        return GPT2CrossAttentionDecoder(self.gpt2, embed=embed, steps=self._steps)

    def _latent(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.final_norm is None else self.final_norm(hidden)

    def _prompt(self, rows: int, start_token: int, device: torch.device) -> torch.Tensor:
        """[rows, 1 or 2]: the token ids before the first generated one, as the penalties see them."""
        ids = [start_token] if self.prompt_token is None else [self.prompt_token, start_token]
        return torch.tensor(ids, dtype=torch.long, device=device).expand(rows, -1).clone()

    def _options(self, prefix_embeds: torch.Tensor, max_new_tokens: int, stop_token: int | None,
                 generate_kwargs: dict) -> GenerationOptions:
        if not isinstance(prefix_embeds, torch.Tensor):
            raise ValueError(f"prefix_embeds must be a tensor, got {type(prefix_embeds).__name__}")
        if prefix_embeds.ndim != 3 or prefix_embeds.shape[-1] != self.gpt2.config.n_embd:
            raise ValueError(f"prefix_embeds must be [batch, prefix, {self.gpt2.config.n_embd}], got "
                             f"{tuple(prefix_embeds.shape)}")
        if prefix_embeds.shape[0] == 0 or prefix_embeds.shape[1] == 0:
            raise ValueError(f"prefix_embeds is empty ({tuple(prefix_embeds.shape)}): the conditioning needs at "
                             "least one input and one prefix position")
        dtype = next(self.gpt2.parameters()).dtype
        if prefix_embeds.dtype != dtype:
            raise ValueError(f"prefix_embeds is {str(prefix_embeds.dtype).removeprefix('torch.')}, the model is "
                             f"{str(dtype).removeprefix('torch.')}: pass prefix_embeds.to({dtype})")
        # the prompt as the pipeline's generate() counts it (min_length): [start], or [prompt_token] * P + [start]
        prompt_length = 1 if self.prompt_token is None else prefix_embeds.shape[1] + 1
        return GenerationOptions.from_kwargs(None, prompt_length, max_new_tokens=max_new_tokens,
                                             eos_token_id=stop_token, **generate_kwargs)

    def _prefill(self, prefix_embeds: torch.Tensor, start_token: int, max_new_tokens: int, group: int,
                 encoder_hidden_states: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None
                 ) -> tuple[GPT2CrossAttentionDecoder, CrossAttentionCache, torch.Tensor]:
        """Run the prefix and the start token once per input; returns the decoder, a cache of batch * group rows
        and their hidden states [batch * group, D] (candidates and beams share the prefill: K/V copied)."""
        batch, prefix_length, _ = prefix_embeds.shape
        decoder = self._decoder(prefix_length)
        cache = decoder.new_cache(batch, prefix_length + 1 + max_new_tokens, encoder_hidden_states,
                                  encoder_attention_mask)
        decoder.prefill(cache, inputs_embeds=prefix_embeds)
        start = torch.full((batch, 1), start_token, dtype=torch.long, device=prefix_embeds.device)
        hidden = decoder.prefill(cache, input_ids=start)  # [B, D]
        if group > 1:
            cache, hidden = cache.expand(group), hidden.repeat_interleave(group, dim=0)
        return decoder, cache, hidden

    @torch.no_grad()
    def stream(self, prefix_embeds: torch.Tensor, *, start_token: int, stop_token: int | None = None,
               max_new_tokens: int = 500, encoder_hidden_states: torch.Tensor | None = None,
               encoder_attention_mask: torch.Tensor | None = None, **generate_kwargs) -> Iterator[AudioTokens]:
        """Yield every step's audio tokens and latents as they are made (greedy or sampling).

        prefix_embeds: [B, P, D], the same length P for every row. generate_kwargs: do_sample, temperature,
        top_k, top_p, repetition_penalty (over the audio tokens, start and prompt_token included),
        num_return_sequences (candidates from one prefill: the prefix is run once and its K/V copied per
        candidate), generator, min_new_tokens. Rows that emitted stop_token continue with stop_token until all
        have stopped. Beam search (num_beams > 1) is not a stream: use generate().
        """
        if generate_kwargs.get("num_beams", 1) != 1:
            raise ValueError("stream() yields greedy or sampled tokens: pass num_beams=1, or call generate() "
                             "for beam search")
        opts = self._options(prefix_embeds, max_new_tokens, stop_token, generate_kwargs)
        decoder, cache, hidden = self._prefill(prefix_embeds, start_token, opts.max_new_tokens,
                                               opts.num_return_sequences, encoder_hidden_states,
                                               encoder_attention_mask)
        latest = [hidden]

        def step(tokens, cache):
            latest[0] = decoder.decode_step(tokens, cache)
            return self.head(self._latent(latest[0]))

        prompt = self._prompt(hidden.shape[0], start_token, hidden.device)
        sequences = prompt.new_full((prompt.shape[0], prompt.shape[1] + opts.max_new_tokens), opts.pad_token_id or 0)
        sequences[:, : prompt.shape[1]] = prompt
        logits = self.head(self._latent(hidden))
        for tokens in sample_stream(step, cache, sequences, prompt.shape[1], logits, opts):
            yield AudioTokens(tokens, self._latent(latest[0]))  # latest[0] produced these tokens

    @torch.no_grad()
    def generate(self, prefix_embeds: torch.Tensor, **kwargs) -> AudioCodes:
        """All audio tokens and latents at once; the same keywords as `stream`, and beam search (num_beams,
        length_penalty, early_stopping, num_return_sequences <= num_beams best beams, best first)."""
        if kwargs.get("num_beams", 1) != 1:
            return self._beam_search(prefix_embeds, **kwargs)
        steps = list(self.stream(prefix_embeds, **kwargs))
        sequences = torch.stack([s.tokens for s in steps], dim=1)
        latents = torch.stack([s.latents for s in steps], dim=1)
        return AudioCodes(sequences, latents, _lengths(sequences, kwargs.get("stop_token")))

    def _beam_search(self, prefix_embeds: torch.Tensor, *, start_token: int, stop_token: int | None = None,
                     max_new_tokens: int = 500, encoder_hidden_states: torch.Tensor | None = None,
                     encoder_attention_mask: torch.Tensor | None = None, **generate_kwargs) -> AudioCodes:
        opts = self._options(prefix_embeds, max_new_tokens, stop_token, generate_kwargs)
        cross = dict(encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask)
        decoder, cache, hidden = self._prefill(prefix_embeds, start_token, opts.max_new_tokens, opts.num_beams,
                                               **cross)

        def step(tokens, cache):
            return self.head(self._latent(decoder.decode_step(tokens, cache)))

        prompt = self._prompt(hidden.shape[0], start_token, hidden.device)
        sequences, _ = beam_search(step, cache, prompt, self.head(self._latent(hidden)), opts,
                                   reorder=decoder.reorder, candidates=decoder.steps.beam_candidates)
        sequences = sequences[:, prompt.shape[1]:]
        # the beams were reordered on the way: their latents come from one teacher-forced pass over the winners
        rows = opts.num_return_sequences
        decoder, cache, hidden = self._prefill(prefix_embeds, start_token, sequences.shape[1], rows, **cross)
        hidden = hidden[:, None]  # [rows, 1, D]
        if sequences.shape[1] > 1:  # the hidden states after each token but the last: [rows, L, D] in all
            hidden = torch.cat([hidden, decoder.prefill(cache, input_ids=sequences[:, :-1], all_logits=True)], 1)
        latents = self._latent(hidden)
        return AudioCodes(sequences, latents, _lengths(sequences, stop_token))


def _steps(gpt2: nn.Module, weights: str) -> DecoderSteps:
    """The GPT's per-step projections in format `weights` (checked there: a ValueError naming the formats)."""
    from ..fast import decoder_steps

    return decoder_steps(GPT2CrossAttentionDecoder(gpt2), weights)


def _lengths(sequences: torch.Tensor, stop: int | None) -> torch.Tensor:
    """[rows]: tokens up to and including the first stop token (all of them if it never stopped)."""
    lengths = torch.full((sequences.shape[0],), sequences.shape[1], dtype=torch.long, device=sequences.device)
    if stop is None:
        return lengths
    hit = sequences == stop
    return torch.where(hit.any(1), hit.float().argmax(1) + 1, lengths)
