"""Logit filters: each rewrites next-token scores [B, V] given the sequences so far [B, T].

Each one gives what transformers' processor of the same meaning gives (tests/test_generate_strategies.py compares
them one by one); generate.py builds the list from GenerationOptions in transformers' order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .generate import GenerationOptions


class LogitFilter:
    """whisper's interface: apply(scores [B, V], sequences [B, T]) -> new scores; the input is left unchanged."""

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """apply(), free to write scores in place: for a caller that owns them (beam search's log-probabilities)."""
        return self.apply(scores, sequences)


@dataclass
class RepetitionPenalty(LogitFilter):
    penalty: float  # > 1 discourages tokens already in the sequence (CTRL-style: divides positive, multiplies negative)

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        seen = torch.gather(scores, 1, sequences)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return scores.scatter(1, sequences, seen)


@dataclass(eq=False)  # tensors inside: compare by identity
class MinNewTokens(LogitFilter):
    prompt_length: int  # tokens in sequences before the first generated one
    min_new_tokens: int  # EOS is forbidden while fewer than this many tokens are generated
    eos: torch.Tensor  # [E] long, the EOS ids (may be empty)
    none: torch.Tensor = field(init=False)  # [0] long: nothing forbidden

    def __post_init__(self):
        self.none = self.eos.new_zeros(0)

    def forbidden(self, new_tokens: int) -> torch.Tensor:
        """The ids [F] that may not follow new_tokens generated tokens; a fused argmax takes the rule this way."""
        return self.eos if new_tokens < self.min_new_tokens else self.none

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        ids = self.forbidden(sequences.shape[-1] - self.prompt_length)
        return scores.index_fill(1, ids, -math.inf) if ids.numel() else scores

    def apply_(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        ids = self.forbidden(sequences.shape[-1] - self.prompt_length)
        return scores.index_fill_(1, ids, -math.inf) if ids.numel() else scores


@dataclass
class Temperature(LogitFilter):
    temperature: float  # > 1 flattens the distribution, < 1 sharpens it

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


@dataclass
class TopK(LogitFilter):
    top_k: int  # keep the k highest scores (ties with the k-th kept too)

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(scores, min(self.top_k, scores.shape[-1]))[0][..., -1, None]
        return scores.masked_fill(scores < kth, -math.inf)


@dataclass
class TopP(LogitFilter):
    top_p: float  # keep the smallest set of most likely tokens whose probability reaches top_p

    def apply(self, scores: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - self.top_p)
        drop_sorted[..., -1:] = False  # always keep the most likely token
        return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), -math.inf)


def build_filters(opts: GenerationOptions, min_length: MinNewTokens) -> list[LogitFilter]:
    """transformers' processor order: penalties, min-length, then (sampling only) temperature, top-k, top-p."""
    filters: list[LogitFilter] = []
    if opts.repetition_penalty != 1.0:
        filters.append(RepetitionPenalty(opts.repetition_penalty))
    if opts.min_new_tokens and opts.eos_token_id:
        filters.append(min_length)
    if opts.do_sample and opts.temperature != 1.0:
        filters.append(Temperature(opts.temperature))
    if opts.do_sample and opts.top_k:
        filters.append(TopK(opts.top_k))
    if opts.do_sample and opts.top_p < 1.0:
        filters.append(TopP(opts.top_p))
    return filters
