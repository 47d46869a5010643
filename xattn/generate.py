"""Generation over a GPT2CrossAttentionDecoder and its static cache: greedy, sampling, beam search, streaming.

Keyword names and meanings follow transformers' `generate`; the token streams are the same (see tests/).
Prefill once, then one short loop: decode_step, then a strategy (GreedyDecoder, SamplingDecoder, BeamSearchDecoder)
that runs the logit filters (logit_filters.py) and chooses, until every row stops.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import CrossAttentionCache
from .logit_filters import MinNewTokens, build_filters
from .logprobs import ChosenLogprobs

# (tokens [B], cache) -> logits [B, V]: one decode step at the cache's position, which it advances
DecodeStep = Callable[[torch.Tensor, CrossAttentionCache], torch.Tensor]
# (tokens [B], cache, forbidden ids [F]) -> the next greedy tokens [B]: a decode step and its argmax
GreedyStep = Callable[[torch.Tensor, CrossAttentionCache, torch.Tensor], torch.Tensor]

_NEG = -1.0e9  # the "impossible" score transformers' beam search uses (not -inf: it stays comparable)


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int  # tokens generated after the prompt, at most
    min_new_tokens: int = 0  # EOS is forbidden before this many new tokens
    do_sample: bool = False  # sample from the distribution instead of taking the argmax
    temperature: float = 1.0  # sampling only: logits / temperature
    top_k: int | None = 50  # sampling only: keep the k most likely tokens (None or 0: all)
    top_p: float = 1.0  # sampling only: keep the smallest set whose probability reaches top_p
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence (CTRL-style)
    num_beams: int = 1  # beam search when > 1
    length_penalty: float = 1.0  # beam only: score = logprob / length ** length_penalty
    early_stopping: bool | str = False  # beam only: True, False or "never", as in transformers
    num_return_sequences: int = 1  # sequences per input (best beams, or independent samples)
    eos_token_id: tuple[int, ...] = ()  # generation stops on any of these
    pad_token_id: int | None = None  # fills rows that have stopped
    generator: torch.Generator | None = field(default=None, compare=False)  # sampling RNG (global if None)

    def __post_init__(self):
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        _check(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
               f"min_new_tokens must be an int >= 0, got {self.min_new_tokens!r}")
        _check(self.temperature > 0 and math.isfinite(self.temperature),
               f"temperature must be a positive number, got {self.temperature!r}; use do_sample=False for greedy")
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 0),
               f"top_k must be an int >= 0 (0 or None disables it), got {self.top_k!r}")
        _check(0.0 <= self.top_p <= 1.0, f"top_p must be in [0, 1], got {self.top_p!r}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(isinstance(self.num_beams, int) and self.num_beams >= 1,
               f"num_beams must be an int >= 1, got {self.num_beams!r}")
        _check(isinstance(self.num_return_sequences, int) and self.num_return_sequences >= 1,
               f"num_return_sequences must be an int >= 1, got {self.num_return_sequences!r}")
        _check(self.early_stopping in (True, False, "never"),
               f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_beams > 1:
            _check(self.num_return_sequences <= self.num_beams,
                   f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams})")
            _check(not self.do_sample, "beam sampling is not supported: pass do_sample=False with num_beams > 1, "
                                       "or num_beams=1 with do_sample=True")
        elif not self.do_sample:
            _check(self.num_return_sequences == 1,
                   "greedy search returns one sequence per input: pass num_beams >= num_return_sequences "
                   "or do_sample=True")

    @classmethod
    def from_kwargs(cls, generation_config, prompt_length: int, **kwargs) -> GenerationOptions:
        """transformers-style generate() kwargs over a model's generation_config over transformers' defaults."""
        unknown = set(kwargs) - _KWARGS
        if unknown:
            raise ValueError(f"unsupported generate() arguments: {sorted(unknown)}; supported: {sorted(_KWARGS)}")

        def pick(name, default=None):
            value = kwargs.get(name)
            if value is None and generation_config is not None:
                value = getattr(generation_config, name, None)
            return default if value is None else value

        eos = pick("eos_token_id")  # None means "not given", as in transformers; [] means no EOS
        eos = () if eos is None else tuple(_int("eos_token_id", e) for e in (eos if isinstance(eos, (list, tuple))
                                                                              else [eos]))
        pad = pick("pad_token_id")
        if pad is None and eos:
            pad = eos[0]  # as transformers: stopped rows are filled with EOS
        if kwargs.get("max_new_tokens") is not None:
            max_new = _int("max_new_tokens", kwargs["max_new_tokens"])
        elif kwargs.get("max_length") is None and getattr(generation_config, "max_new_tokens", None) is not None:
            max_new = generation_config.max_new_tokens
        else:
            max_new = _int("max_length", pick("max_length", 20)) - prompt_length
        if max_new < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new!r} (prompt length {prompt_length}); "
                             "pass max_new_tokens >= 1")
        top_k = pick("top_k", 50)
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=max(_int("min_new_tokens", pick("min_new_tokens", 0)),
                               _int("min_length", pick("min_length", 0)) - prompt_length, 0),
            do_sample=_bool("do_sample", pick("do_sample", False)),
            temperature=_float("temperature", pick("temperature", 1.0)),
            top_k=None if top_k is None else _int("top_k", top_k),
            top_p=_float("top_p", pick("top_p", 1.0)),
            repetition_penalty=_float("repetition_penalty", pick("repetition_penalty", 1.0)),
            num_beams=_int("num_beams", pick("num_beams", 1)),
            length_penalty=_float("length_penalty", pick("length_penalty", 1.0)),
            early_stopping=pick("early_stopping", False),
            num_return_sequences=_int("num_return_sequences", pick("num_return_sequences", 1)),
            eos_token_id=eos,
            pad_token_id=None if pad is None else _int("pad_token_id", pad),
            generator=kwargs.get("generator"),
        )

    @property
    def group_size(self) -> int:
        """Decoding rows per input: beams, or independent samples."""
        return self.num_beams if self.num_beams > 1 else self.num_return_sequences


_KWARGS = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "num_beams", "length_penalty", "early_stopping", "num_return_sequences", "eos_token_id",
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "generator",
}


def _int(name: str, value) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ---- greedy and sampling ----------------------------------------------------------------------------------
class GreedyDecoder:
    """One token per row and step (whisper's TokenDecoder); rows that emitted EOS get pad_token_id afterwards."""

    def __init__(self, opts: GenerationOptions, prompt_length: int, rows: int, device: torch.device):
        self.eos = torch.tensor(opts.eos_token_id, dtype=torch.long, device=device)  # [E]
        self.min_length = MinNewTokens(prompt_length, opts.min_new_tokens, self.eos)  # also tells the fused argmax
        self.filters = build_filters(opts, self.min_length)
        self.pad = opts.pad_token_id
        self.generator = opts.generator
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)  # [B]

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.argmax(scores, dim=-1)

    def update(self, sequences: torch.Tensor, logits: torch.Tensor | None, chosen: torch.Tensor | None = None):
        """sequences [B, cur], logits [B, V] (or tokens [B] already chosen by a fused argmax) -> (tokens [B], done).

        done is False or a bool tensor, read after the tokens are yielded."""
        if chosen is None:
            scores = logits.float()
            for f in self.filters:
                scores = f.apply(scores, sequences)
            chosen = self.choose(scores)
        if not self.eos.numel():
            return chosen, False
        tokens = torch.where(self.unfinished, chosen, self.pad)
        self.unfinished &= ~torch.isin(tokens, self.eos)
        return tokens, ~self.unfinished.any()


class SamplingDecoder(GreedyDecoder):
    """Draws each token from the filtered distribution, with opts.generator (transformers' draws from its RNG)."""

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)


def sample_stream(
    step: DecodeStep, cache: CrossAttentionCache, sequences: torch.Tensor, prompt_length: int, logits: torch.Tensor,
    opts: GenerationOptions, greedy_step: GreedyStep | None = None, logprobs: ChosenLogprobs | None = None,
) -> Iterator[torch.Tensor]:
    """Greedy or sampled tokens, one [B] tensor per step, written into sequences [B, prompt + max_new].

    logits: [B, V] from the prefill. Rows that emitted EOS get pad_token_id afterwards; the stream ends
    when every row has stopped or max_new_tokens are out. Each step writes at the cache's own position (after
    any prefix of embeddings the prefill wrote, which has no token ids). greedy_step: used instead of step where
    the choice is a plain argmax (greedy, no filter but min-length): it returns the tokens, not the logits.
    logprobs: filled with each chosen token's log-probability where every step gives logits.
    """
    decoder = (SamplingDecoder if opts.do_sample else GreedyDecoder)(
        opts, prompt_length, sequences.shape[0], sequences.device)
    # the fused argmax takes the min-length rule as forbidden ids; any other filter needs the full scores
    fused_argmax = (greedy_step is not None and not opts.do_sample
                    and all(f is decoder.min_length for f in decoder.filters))
    chosen = None  # the greedy_step's tokens for this step
    if logprobs is not None and fused_argmax and opts.max_new_tokens > 1:
        logprobs.complete = False
    for i in range(opts.max_new_tokens):
        cur = prompt_length + i
        own = logits.float().log_softmax(-1) if logprobs is not None and chosen is None else None
        tokens, done = decoder.update(sequences[:, :cur], logits, chosen)
        sequences[:, cur] = tokens
        if own is not None:
            logprobs.add(own, tokens)
        yield tokens
        if done or i + 1 == opts.max_new_tokens:
            return
        if fused_argmax:
            chosen = greedy_step(tokens, cache, decoder.min_length.forbidden(i + 1))
        else:
            logits = step(tokens, cache)


# ---- beam search ------------------------------------------------------------------------------------------
class BeamSearchDecoder:
    """transformers' beam search scoring, stopping and tie-breaking, over [B, beams] rows.

    Keeps the running beams and, per input, the beams best finished hypotheses; update() takes one step's logits
    and says which rows go on with which tokens, finalize() returns the best hypotheses.
    """

    def __init__(self, opts: GenerationOptions, prompt: torch.Tensor):
        k, device = opts.num_beams, prompt.device
        self.opts, self.k, self.batch = opts, k, prompt.shape[0] // k
        self.prompt_length = self.length = prompt.shape[1]  # length: tokens per beam so far, prompt included
        self.max_length = self.prompt_length + opts.max_new_tokens
        self.eos = torch.tensor(opts.eos_token_id, dtype=torch.long, device=device)  # [E]
        self.filters = build_filters(opts, MinNewTokens(self.prompt_length, opts.min_new_tokens, self.eos))
        self.keep = max(2, 1 + len(opts.eos_token_id)) * k  # candidates per input: k stay alive after some hit EOS
        self.top_k_mask = torch.arange(self.keep, device=device) < k  # only the k best candidates may finish
        self.row_offset = torch.arange(self.batch, device=device)[:, None] * k
        # transformers' `pad or eos[0]`: a pad id of 0 also falls back to eos
        fill = opts.pad_token_id or (opts.eos_token_id[0] if opts.eos_token_id else -1)
        self.running = torch.full((self.batch, k, self.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, :self.prompt_length] = prompt.view(self.batch, k, self.prompt_length)
        self.running_scores = torch.zeros(self.batch, k, device=device)
        self.running_scores[:, 1:] = _NEG  # the first step expands one beam per input, not k copies
        self.finished_seqs = self.running.clone()
        self.finished_scores = torch.full((self.batch, k), _NEG, device=device)
        self.finished_lengths = torch.zeros(self.batch, k, dtype=torch.long, device=device)  # generated tokens
        self.is_finished = torch.zeros(self.batch, k, dtype=torch.bool, device=device)
        self.improvable = torch.ones(self.batch, 1, dtype=torch.bool, device=device)  # can a running beam still win

    def update(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logits [B * beams, V] -> (source rows [B * beams] of the cache to keep, their next tokens [B * beams]),
        or None when the search is over."""
        cand_scores, cand_index, cand_seqs, hits = self._candidates(logits)
        source_rows = self._advance(cand_scores, cand_index // logits.shape[-1], cand_seqs, hits)
        self._finish(cand_scores, cand_seqs, hits)
        self.length += 1
        if self._search_over(hits):
            return None
        return source_rows, self.running[:, :, self.length - 1].reshape(-1)

    def _candidates(self, logits: torch.Tensor):
        """The keep best one-token extensions per input: scores, flat indices, sequences and whether they stop."""
        cur, vocab = self.length, logits.shape[-1]
        log_probs = F.log_softmax(logits.float(), dim=-1)
        for f in self.filters:
            log_probs = f.apply(log_probs, self.running[:, :, :cur].reshape(self.batch * self.k, cur))
        totals = log_probs.view(self.batch, self.k, vocab) + self.running_scores[:, :, None]
        cand_scores, cand_index = top_candidates(totals, self.keep)  # [B, keep], index into [k * V]
        cand_seqs = torch.take_along_dim(self.running, (cand_index // vocab)[:, :, None], dim=1)
        cand_seqs[:, :, cur] = cand_index % vocab
        hits = torch.full_like(cand_scores, cur + 1 >= self.max_length, dtype=torch.bool)
        hits |= torch.isin(cand_seqs[:, :, cur], self.eos)
        return cand_scores, cand_index, cand_seqs, hits

    def _advance(self, cand_scores, cand_beam, cand_seqs, hits) -> torch.Tensor:
        """The k best candidates that did not stop become the running beams; returns their source rows."""
        alive_scores = cand_scores + hits.to(torch.float32) * _NEG
        alive = torch.topk(alive_scores, self.k)[1]
        self.running = torch.take_along_dim(cand_seqs, alive[:, :, None], dim=1)
        self.running_scores = torch.take_along_dim(alive_scores, alive, dim=1)
        return (torch.take_along_dim(cand_beam, alive, dim=1) + self.row_offset).view(-1)

    def _finish(self, cand_scores, cand_seqs, hits) -> None:
        """Candidates that stopped join the finished set if they beat its worst."""
        just_finished = hits & self.top_k_mask[None, :]
        generated = self.length + 1 - self.prompt_length
        normed = cand_scores / (generated**self.opts.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.opts.early_stopping is True)
        normed = normed + full.to(torch.float32) * _NEG
        normed = normed + (~self.improvable).to(torch.float32) * _NEG
        normed = normed + (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, normed), dim=1)
        best = torch.topk(merged_scores, self.k)[1]
        self.finished_seqs = torch.take_along_dim(torch.cat((self.finished_seqs, cand_seqs), 1), best[:, :, None], 1)
        self.finished_scores = torch.take_along_dim(merged_scores, best, dim=1)
        lengths = torch.cat((self.finished_lengths, torch.full_like(hits, generated, dtype=torch.long)), 1)
        self.finished_lengths = torch.take_along_dim(lengths, best, dim=1)
        self.is_finished = torch.take_along_dim(torch.cat((self.is_finished, just_finished), 1), best, dim=1)

    def _search_over(self, hits: torch.Tensor) -> bool:
        """No running beam can beat the finished ones any more, or every candidate stopped."""
        opts = self.opts
        if opts.early_stopping == "never" and opts.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_length
        else:
            best_length = self.length - self.prompt_length
        best_running = self.running_scores[:, :1] / (best_length**opts.length_penalty)
        worst_finished = torch.where(self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], _NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        all_full = bool(torch.all(self.is_finished)) and opts.early_stopping is True
        return not bool(torch.any(self.improvable)) or all_full or bool(torch.all(hits))

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequences [B * num_return_sequences, P + L], scores [B * num_return_sequences]), best first."""
        n = self.opts.num_return_sequences
        lengths = self.finished_lengths[:, :n].reshape(-1)
        sequences = self.finished_seqs[:, :n].reshape(self.batch * n, self.max_length)
        return sequences[:, : self.prompt_length + int(lengths.max())], self.finished_scores[:, :n].reshape(-1)


def top_candidates(totals: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(totals.view(B, -1), keep) for totals [B, beams, V], found through each beam's keep + 1 best first
    (beams * B small top-ks, which torch spreads over its threads, where one over beams * V runs on one).

    Where the keep + 1 best of those are strictly decreasing, every value outside them is below the keep-th (a beam's
    own keep + 1-th bounds the rest of its row), so the keep best are torch.topk's exactly, values and indices; with
    equal values or NaN among them it is torch.topk over all, whose choice among equals is its own."""
    b, beams, vocab = totals.shape
    flat = totals.view(b, beams * vocab)
    if keep + 1 > vocab:
        return torch.topk(flat, keep)
    values, index = torch.topk(totals, keep + 1)  # [B, beams, keep + 1]
    index = index + torch.arange(beams, device=totals.device)[:, None] * vocab  # into [beams * V]
    best, at = torch.topk(values.view(b, -1), keep + 1)
    if not bool((best[:, :-1] > best[:, 1:]).all()):
        return torch.topk(flat, keep)
    return best[:, :keep], torch.take_along_dim(index.view(b, -1), at[:, :keep], dim=1)


def beam_search(
    step: DecodeStep, cache: CrossAttentionCache, prompt: torch.Tensor, logits: torch.Tensor, opts: GenerationOptions,
    reorder: Callable[[CrossAttentionCache, torch.Tensor], None] = CrossAttentionCache.reorder,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search with transformers' scoring, stopping and tie-breaking.

    prompt: [B * beams, P] (each input's beams consecutive); logits: [B * beams, V] from the prefill.
    The cache's cross K/V stay one copy per input; only self-attention K/V are reordered, by
    reorder(cache, source_rows) (a decoder's own: GPT2CrossAttentionDecoder.reorder).
    Returns (sequences [B * num_return_sequences, P + L], scores [B * num_return_sequences]).
    """
    beams = BeamSearchDecoder(opts, prompt)
    while (chosen := beams.update(logits)) is not None:
        source_rows, tokens = chosen
        reorder(cache, source_rows)
        logits = step(tokens, cache)
    return beams.finalize()
