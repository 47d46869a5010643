"""Generation over a GPT2CrossAttentionDecoder and its static cache: greedy, sampling, beam search, streaming.

Keyword names and meanings follow transformers' `generate`; the token streams are the same (see tests/).
One loop per strategy: prefill once, then decode_step + logits processors + choose, until every row stops.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import CrossAttentionCache

DecodeStep = Callable[[torch.Tensor, CrossAttentionCache, torch.Tensor], torch.Tensor]
# (tokens [B], cache, position, forbidden ids [F]) -> the next greedy tokens [B]: a decode step and its argmax
GreedyStep = Callable[[torch.Tensor, CrossAttentionCache, torch.Tensor, torch.Tensor], torch.Tensor]

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


# ---- logits processors: (sequences [B, cur], scores [B, V], new_tokens) -> scores ----------------------------
def repetition_penalty(sequences: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    seen = torch.gather(scores, 1, sequences)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(1, sequences, seen)


def forbid_tokens(scores: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
    scores = scores.clone()
    scores[:, list(token_ids)] = -math.inf
    return scores


def top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, -math.inf)


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[..., -1:] = False  # always keep the most likely token
    return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), -math.inf)


def process_scores(sequences: torch.Tensor, scores: torch.Tensor, new_tokens: int, opts: GenerationOptions):
    """transformers' processor order: penalties, min-length, then (sampling only) temperature, top-k, top-p."""
    if opts.repetition_penalty != 1.0:
        scores = repetition_penalty(sequences, scores, opts.repetition_penalty)
    if new_tokens < opts.min_new_tokens and opts.eos_token_id:
        scores = forbid_tokens(scores, opts.eos_token_id)
    if opts.do_sample:
        if opts.temperature != 1.0:
            scores = scores / opts.temperature
        if opts.top_k:
            scores = top_k_filter(scores, opts.top_k)
        if opts.top_p < 1.0:
            scores = top_p_filter(scores, opts.top_p)
    return scores


# ---- greedy and sampling -------------------------------------------------------------------------------------
def sample_stream(
    step: DecodeStep,
    cache: CrossAttentionCache,
    sequences: torch.Tensor,
    prompt_length: int,
    logits: torch.Tensor,
    opts: GenerationOptions,
    position_offset: int = 0,
    greedy_step: GreedyStep | None = None,
) -> Iterator[torch.Tensor]:
    """Greedy or sampled tokens, one [B] tensor per step, written into sequences [B, prompt + max_new].

    logits: [B, V] from the prefill. Rows that emitted EOS get pad_token_id afterwards; the stream ends
    when every row has stopped or max_new_tokens are out. position_offset: cache positions before
    sequences[:, 0] (a prefix of embeddings that has no token ids). greedy_step: used instead of step where
    the choice is a plain argmax (greedy, no repetition penalty): it returns the tokens, not the logits.
    """
    rows = sequences.shape[0]
    device = sequences.device
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(opts.eos_token_id, device=device) if opts.eos_token_id else None
    plain_argmax = greedy_step is not None and not opts.do_sample and opts.repetition_penalty == 1.0
    no_ids = torch.zeros(0, dtype=torch.long, device=device)
    chosen = None  # the greedy_step's tokens for this step
    for i in range(opts.max_new_tokens):
        cur = prompt_length + i
        if chosen is not None:
            tokens = chosen
        else:
            scores = process_scores(sequences[:, :cur], logits.float(), i, opts)
            if opts.do_sample:
                probs = F.softmax(scores, dim=-1)
                tokens = torch.multinomial(probs, num_samples=1, generator=opts.generator).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
        if eos is not None:
            tokens = torch.where(unfinished, tokens, opts.pad_token_id)
        sequences[:, cur] = tokens
        yield tokens
        if eos is not None:
            unfinished &= ~torch.isin(tokens, eos)
            if not bool(unfinished.any()):
                return
        if i + 1 < opts.max_new_tokens:
            position = torch.tensor(position_offset + cur, device=device)
            if plain_argmax:  # the forbidden ids are process_scores' min-length rule for the next step
                forbidden = eos if eos is not None and i + 1 < opts.min_new_tokens else no_ids
                chosen = greedy_step(tokens, cache, position, forbidden)
            else:
                logits = step(tokens, cache, position)
            cache.length = position_offset + cur + 1


# ---- beam search ------------------------------------------------------------------------------------------
def beam_search(
    step: DecodeStep,
    cache: CrossAttentionCache,
    prompt: torch.Tensor,
    logits: torch.Tensor,
    opts: GenerationOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search with transformers' scoring, stopping and tie-breaking.

    prompt: [B * beams, P] (each input's beams consecutive); logits: [B * beams, V] from the prefill.
    The cache's cross K/V stay one copy per input; only self-attention K/V are reordered.
    Returns (sequences [B * num_return_sequences, P + L], scores [B * num_return_sequences]).
    """
    k = opts.num_beams
    batch = prompt.shape[0] // k
    prompt_length = prompt.shape[1]
    max_length = prompt_length + opts.max_new_tokens
    device = prompt.device
    n_eos = len(opts.eos_token_id)
    eos = torch.tensor(opts.eos_token_id, device=device) if n_eos else None
    keep = max(2, 1 + n_eos) * k  # candidates per input: enough that k stay alive after some hit EOS
    top_k_mask = torch.arange(keep, device=device) < k  # only the k best candidates may finish a beam

    if opts.pad_token_id:  # transformers' `pad or eos[0]`: a pad id of 0 also falls back to eos
        fill = opts.pad_token_id
    else:
        fill = opts.eos_token_id[0] if n_eos else -1
    running = torch.full((batch, k, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :prompt_length] = prompt.view(batch, k, prompt_length)
    finished_seqs = running.clone()
    running_scores = torch.zeros(batch, k, device=device)
    running_scores[:, 1:] = _NEG
    finished_scores = torch.full((batch, k), _NEG, device=device)
    finished_lengths = torch.zeros(batch, k, dtype=torch.long, device=device)  # generated tokens per hypothesis
    is_finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
    improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
    row_offset = torch.arange(batch, device=device)[:, None] * k

    cur = prompt_length
    while True:
        log_probs = F.log_softmax(logits.float(), dim=-1)
        log_probs = process_scores(running[:, :, :cur].reshape(batch * k, cur), log_probs, cur - prompt_length, opts)
        vocab = log_probs.shape[-1]
        totals = (log_probs.view(batch, k, vocab) + running_scores[:, :, None]).view(batch, k * vocab)

        cand_scores, cand_index = torch.topk(totals, keep)  # (batch, keep)
        cand_beam = cand_index // vocab
        cand_seqs = torch.take_along_dim(running, cand_beam[:, :, None], dim=1)
        cand_seqs[:, :, cur] = cand_index % vocab
        hits = torch.full_like(cand_scores, cur + 1 >= max_length, dtype=torch.bool)
        if eos is not None:
            hits |= torch.isin(cand_seqs[:, :, cur], eos)

        # beams that go on: the k best candidates that did not stop
        alive_scores = cand_scores + hits.to(torch.float32) * _NEG
        alive = torch.topk(alive_scores, k)[1]
        running = torch.take_along_dim(cand_seqs, alive[:, :, None], dim=1)
        running_scores = torch.take_along_dim(alive_scores, alive, dim=1)
        source_rows = (torch.take_along_dim(cand_beam, alive, dim=1) + row_offset).view(-1)

        # hypotheses that stopped join the finished set if they beat its worst
        just_finished = hits & top_k_mask[None, :]
        normed = cand_scores / ((cur + 1 - prompt_length) ** opts.length_penalty)
        full = torch.all(is_finished, dim=-1, keepdim=True) & (opts.early_stopping is True)
        normed = normed + full.to(torch.float32) * _NEG
        normed = normed + (~improvable).to(torch.float32) * _NEG
        normed = normed + (~just_finished) * _NEG
        merged_scores = torch.cat((finished_scores, normed), dim=1)
        best = torch.topk(merged_scores, k)[1]
        finished_seqs = torch.take_along_dim(torch.cat((finished_seqs, cand_seqs), 1), best[:, :, None], dim=1)
        finished_scores = torch.take_along_dim(merged_scores, best, dim=1)
        new_lengths = torch.full_like(cand_index, cur + 1 - prompt_length)
        finished_lengths = torch.take_along_dim(torch.cat((finished_lengths, new_lengths), 1), best, dim=1)
        is_finished = torch.take_along_dim(torch.cat((is_finished, just_finished), 1), best, dim=1)

        cur += 1
        if opts.early_stopping == "never" and opts.length_penalty > 0.0:
            best_length = max_length - prompt_length
        else:
            best_length = cur - prompt_length
        best_running = running_scores[:, :1] / (best_length**opts.length_penalty)
        worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], _NEG)
        improvable = improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        all_full = bool(torch.all(is_finished)) and opts.early_stopping is True
        if not bool(torch.any(improvable)) or all_full or bool(torch.all(hits)):
            break

        cache.reorder(source_rows)
        tokens = running[:, :, cur - 1].reshape(-1)
        logits = step(tokens, cache, torch.tensor(cur - 1, device=device))
        cache.length = cur

    n = opts.num_return_sequences
    lengths = finished_lengths[:, :n].reshape(-1)
    sequences = finished_seqs[:, :n].reshape(batch * n, max_length)
    return sequences[:, : prompt_length + int(lengths.max())], finished_scores[:, :n].reshape(-1)
