"""Generation over a GPT2CrossAttentionDecoder and its static cache: greedy, sampling, beam search, streaming.

Keyword names and meanings follow transformers' `generate`; the token streams are the same (see tests/).
Prefill once, then one short loop: decode_step, then a strategy (GreedyDecoder, SamplingDecoder, BeamSearchDecoder)
that runs the logit filters (logit_filters.py) and chooses, until every row stops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .cache import CrossAttentionCache
from .generation_options import GenerationOptions
from .logit_filters import MinNewTokens, build_filters
from .logprobs import ChosenLogprobs

# (tokens [B], cache) -> logits [B, V]: one decode step at the cache's position, which it advances
DecodeStep = Callable[[torch.Tensor, CrossAttentionCache], torch.Tensor]
# (tokens [B], cache, forbidden ids [F]) -> the next greedy tokens [B]: a decode step and its argmax
GreedyStep = Callable[[torch.Tensor, CrossAttentionCache, torch.Tensor], torch.Tensor]

# scores [B, V] -> the index of each row's largest value [B], as torch.argmax(scores, dim=-1)
Argmax = Callable[[torch.Tensor], torch.Tensor]

# (log_probs [B * beams, V], running scores [B, beams], keep) -> the keep best per input of log_probs + each beam's
# score, as torch.topk over [B, beams * V] gives them (values, indices [B, keep]), or None to leave them to torch.topk
BeamCandidates = Callable[[torch.Tensor, torch.Tensor, int], "tuple[torch.Tensor, torch.Tensor] | None"]

_NEG = -1.0e9  # the "impossible" score transformers' beam search uses (not -inf: it stays comparable)


# ---- greedy and sampling ----------------------------------------------------------------------------------
class GreedyDecoder:
    """One token per row and step (whisper's TokenDecoder); rows that emitted EOS get pad_token_id afterwards."""

    def __init__(self, opts: GenerationOptions, prompt_length: int, rows: int, device: torch.device,
                 argmax: Argmax | None = None):
        self.argmax = argmax or (lambda scores: torch.argmax(scores, dim=-1))  # a kernel's, where DecoderSteps has one
        self.eos = torch.tensor(opts.eos_token_id, dtype=torch.long, device=device)  # [E]
        self.min_length = MinNewTokens(prompt_length, opts.min_new_tokens, self.eos)  # also tells the fused argmax
        self.filters = build_filters(opts, self.min_length)
        self.pad = opts.pad_token_id
        self.generator = opts.generator
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)  # [B]

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        return self.argmax(scores)

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
    argmax: Argmax | None = None,
) -> Iterator[torch.Tensor]:
    """Greedy or sampled tokens, one [B] tensor per step, written into sequences [B, prompt + max_new].

    logits: [B, V] from the prefill. Rows that emitted EOS get pad_token_id afterwards; the stream ends
    when every row has stopped or max_new_tokens are out. Each step writes at the cache's own position (after
    any prefix of embeddings the prefill wrote, which has no token ids). greedy_step: used instead of step where
    the choice is a plain argmax (greedy, no filter but min-length): it returns the tokens, not the logits.
    logprobs: filled with each chosen token's log-probability where every step gives logits. argmax: the greedy
    choice (DecoderSteps.argmax_rows; None: torch.argmax).
    """
    decoder = (SamplingDecoder if opts.do_sample else GreedyDecoder)(
        opts, prompt_length, sequences.shape[0], sequences.device, argmax)
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

    def __init__(self, opts: GenerationOptions, prompt: torch.Tensor, candidates: BeamCandidates | None = None):
        k, device = opts.num_beams, prompt.device
        self.opts, self.k, self.batch = opts, k, prompt.shape[0] // k
        self.candidates = candidates  # a faster search for the best candidates (a decoder's), else torch's topk
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
        log_probs = F.log_softmax(logits.float(), dim=-1)  # a new tensor: the filters may write it in place
        for f in self.filters:
            log_probs = f.apply_(log_probs, self.running[:, :, :cur].reshape(self.batch * self.k, cur))
        found = None if self.candidates is None else self.candidates(log_probs, self.running_scores, self.keep)
        if found is None:
            totals = log_probs.view(self.batch, self.k, vocab) + self.running_scores[:, :, None]
            found = top_candidates(totals, self.keep)
        cand_scores, cand_index = found  # [B, keep], index into [k * V]
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
    candidates: BeamCandidates | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search with transformers' scoring, stopping and tie-breaking.

    prompt: [B * beams, P] (each input's beams consecutive); logits: [B * beams, V] from the prefill.
    The cache's cross K/V stay one copy per input; only self-attention K/V are reordered, by
    reorder(cache, source_rows) (a decoder's own: GPT2CrossAttentionDecoder.reorder). candidates: a decoder's
    search for each step's best candidates (DecoderSteps.beam_candidates), else torch's topk.
    Returns (sequences [B * num_return_sequences, P + L], scores [B * num_return_sequences]).
    """
    beams = BeamSearchDecoder(opts, prompt, candidates)
    while (chosen := beams.update(logits)) is not None:
        source_rows, tokens = chosen
        reorder(cache, source_rows)
        logits = step(tokens, cache)
    return beams.finalize()
