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

from ..decoder import GPT2CrossAttentionDecoder
from ..generate import GenerationOptions, sample_stream


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
    """

    def __init__(self, gpt2: nn.Module, token_embedding: Callable, position_embedding: Callable, head: Callable,
                 final_norm: Callable | None = None):
        self.gpt2, self.token_embedding, self.position_embedding = gpt2, token_embedding, position_embedding
        self.head, self.final_norm = head, final_norm

    def _decoder(self, prefix_length: int) -> GPT2CrossAttentionDecoder:
        def embed(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [B, T] at cache positions [T]
            return self.token_embedding(ids) + self.position_embedding(positions - prefix_length)

        return GPT2CrossAttentionDecoder(self.gpt2, embed=embed)  # no head: steps return ln_f hidden states

    def _latent(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.final_norm is None else self.final_norm(hidden)

    @torch.no_grad()
    def stream(self, prefix_embeds: torch.Tensor, *, start_token: int, stop_token: int | None = None,
               max_new_tokens: int = 500, encoder_hidden_states: torch.Tensor | None = None,
               encoder_attention_mask: torch.Tensor | None = None, **generate_kwargs) -> Iterator[AudioTokens]:
        """Yield every step's audio tokens and latents as they are made (greedy or sampling).

        prefix_embeds: [B, P, D], the same length P for every row. generate_kwargs: do_sample, temperature,
        top_k, top_p, repetition_penalty (over the audio tokens, start included), num_return_sequences
        (candidates from one prefill: the prefix is run once and its K/V copied per candidate), generator,
        min_new_tokens. Rows that emitted stop_token continue with stop_token until all have stopped.
        """
        if prefix_embeds.ndim != 3 or prefix_embeds.shape[-1] != self.gpt2.config.n_embd:
            raise ValueError(f"prefix_embeds must be [batch, prefix, {self.gpt2.config.n_embd}], got "
                             f"{tuple(prefix_embeds.shape)}")
        if generate_kwargs.get("num_beams", 1) != 1:
            raise ValueError("audio tokens are sampled or greedy: num_beams must be 1")
        opts = GenerationOptions.from_kwargs(None, 1, max_new_tokens=max_new_tokens, eos_token_id=stop_token,
                                             **generate_kwargs)
        batch, prefix_length, _ = prefix_embeds.shape
        decoder = self._decoder(prefix_length)
        cache = decoder.new_cache(batch, prefix_length + 1 + opts.max_new_tokens, encoder_hidden_states,
                                  encoder_attention_mask)
        decoder.prefill(cache, inputs_embeds=prefix_embeds)
        start = torch.full((batch, 1), start_token, dtype=torch.long, device=prefix_embeds.device)
        hidden = decoder.prefill(cache, input_ids=start)  # [B, D]
        group = opts.num_return_sequences
        if group > 1:  # candidates share the prefill
            cache, hidden = cache.expand(group), hidden.repeat_interleave(group, dim=0)
        latest = [hidden]

        def step(tokens, cache):
            latest[0] = decoder.decode_step(tokens, cache)
            return self.head(self._latent(latest[0]))

        sequences = start.new_full((batch * group, 1 + opts.max_new_tokens), opts.pad_token_id or 0)
        sequences[:, 0] = start_token
        logits = self.head(self._latent(hidden))
        for tokens in sample_stream(step, cache, sequences, 1, logits, opts):  # after the prefix, in the cache
            yield AudioTokens(tokens, self._latent(latest[0]))  # latest[0] produced these tokens

    def generate(self, prefix_embeds: torch.Tensor, **kwargs) -> AudioCodes:
        """All audio tokens and latents at once; the same keywords as `stream`."""
        steps = list(self.stream(prefix_embeds, **kwargs))
        if not steps:
            raise ValueError("nothing was generated")
        sequences = torch.stack([s.tokens for s in steps], dim=1)
        latents = torch.stack([s.latents for s in steps], dim=1)
        stop = kwargs.get("stop_token")
        lengths = torch.full((sequences.shape[0],), sequences.shape[1], dtype=torch.long)
        if stop is not None:
            hit = sequences == stop
            first = torch.where(hit.any(1), hit.float().argmax(1) + 1, lengths)
            lengths = first
        return AudioCodes(sequences, latents, lengths)
