"""A beam step's candidates through xattn's kernel (kernels.beam_candidates): wherever it answers, its values and
indices are torch.topk's over log_probs + each beam's score, bit for bit; it declines exactly where torch.topk would
choose among equals or meet a NaN; bad arguments are refused; and beam search runs it with the tokens it gave
without it."""

import math

import pytest
import torch

from conftest import fast_engine_and_pixels
from xattn.fast import kernels
from xattn.generate import BeamSearchDecoder, GenerationOptions
from xattn.logit_filters import MinNewTokens

pytestmark = pytest.mark.kernels


def _inputs(batch, beams, vocab, seed, kind="distinct"):
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(batch * beams, vocab, generator=generator).log_softmax(-1)
    scores = torch.randn(batch, beams, generator=generator) * 3
    if kind == "coarse":  # many equal values, some among the best
        log_probs, scores = (log_probs * 2).round() / 2, scores.round()
    elif kind == "masked":  # filters leave few finite tokens: -inf ties at the boundary
        log_probs[:, 2:] = -math.inf
    elif kind == "nan":
        log_probs[-1, vocab // 2] = math.nan
    elif kind == "first step":  # beams past the first start at -1e9 (beam search's "impossible")
        scores[:, 1:] = -1e9
    elif kind == "equal beams":  # the two best beams alike: each of their values twice among the best
        log_probs.view(batch, beams, vocab)[:, 1] = log_probs.view(batch, beams, vocab)[:, 0]
        scores[:, :2] = 20.0
    return log_probs, scores


def _torch(log_probs, scores, keep):
    """What beam search asks torch for: the add, then topk over each input's beams * V."""
    batch, beams = scores.shape
    totals = (log_probs.view(batch, beams, -1) + scores[:, :, None]).view(batch, -1)
    return totals, torch.topk(totals, keep)


@pytest.mark.parametrize("batch, beams, vocab, keep", [
    (1, 4, 50257, 8), (8, 4, 50257, 8), (3, 1, 50, 2), (2, 5, 17, 10), (1, 3, 9, 8), (4, 2, 1000, 4), (1, 6, 37, 18),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distinct_values_give_torch_topks_values_and_indices(batch, beams, vocab, keep, seed):
    log_probs, scores = _inputs(batch, beams, vocab, seed)
    found = kernels.beam_candidates(log_probs, scores, keep)
    _, (values, index) = _torch(log_probs, scores, keep)
    assert found is not None
    assert torch.equal(found[0], values) and torch.equal(found[1], index)


@pytest.mark.parametrize("kind", ["coarse", "masked", "nan", "first step", "equal beams"])
@pytest.mark.parametrize("keep", [1, 2, 8, 40])
def test_it_declines_exactly_where_torch_would_choose_among_equals(kind, keep):
    log_probs, scores = _inputs(3, 4, 50, seed=keep, kind=kind)
    found = kernels.beam_candidates(log_probs, scores, keep)
    totals, (values, index) = _torch(log_probs, scores, keep)
    best = torch.topk(totals, keep + 1)[0]
    ambiguous = bool(totals.isnan().any()) or not bool((best[:, :-1] > best[:, 1:]).all())
    assert (found is None) == ambiguous
    if found is not None:
        assert torch.equal(found[0], values) and torch.equal(found[1], index)
    if kind in ("nan", "equal beams") or (kind == "masked" and keep + 1 > 9):  # cases that must reach torch
        assert found is None  # (masked: 8 finite values, then equal -infs)


def test_keep_past_a_rows_values_is_left_to_torch():
    log_probs, scores = _inputs(2, 3, 5, seed=0)
    assert kernels.beam_candidates(log_probs, scores, 5) is None
    assert kernels.beam_candidates(log_probs, scores, 4) is not None


BAD = {
    "log_probs float64": (lambda lp, sc, k: (lp.double(), sc, k), "log_probs"),
    "log_probs 3-d": (lambda lp, sc, k: (lp[None], sc, k), "log_probs"),
    "scores int": (lambda lp, sc, k: (lp, sc.long(), k), "scores"),
    "a row short": (lambda lp, sc, k: (lp[:-1], sc, k), "one row per beam"),
    "keep 0": (lambda lp, sc, k: (lp, sc, 0), "keep"),
    "keep negative": (lambda lp, sc, k: (lp, sc, -3), "keep"),
}


@pytest.mark.parametrize("change", list(BAD))
def test_bad_arguments_are_refused_with_a_message_naming_them(change):
    log_probs, scores = _inputs(2, 3, 20, seed=0)
    alter, message = BAD[change]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.xattn_kernels.beam_candidates(*alter(log_probs, scores, 4))


def test_the_min_length_filter_in_place_equals_its_copy_and_writes_only_the_forbidden_ids():
    eos = torch.tensor([3, 7])
    rule = MinNewTokens(prompt_length=1, min_new_tokens=4, eos=eos)
    scores = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    sequences = torch.zeros(4, 2, dtype=torch.long)  # one new token: EOS forbidden
    expected = rule.apply(scores, sequences)
    assert torch.isinf(expected[:, eos]).all() and not torch.isinf(scores).any()  # apply leaves its input
    written = rule.apply_(scores, sequences)
    assert written.data_ptr() == scores.data_ptr() and torch.equal(written, expected)
    later = torch.zeros(4, 5, dtype=torch.long)  # four new tokens: nothing forbidden
    assert torch.equal(rule.apply_(torch.ones(4, 10), later), torch.ones(4, 10))


def test_beam_search_decoder_with_the_kernel_follows_the_same_beams_step_by_step():
    opts = GenerationOptions(max_new_tokens=12, min_new_tokens=3, num_beams=4, eos_token_id=(5,), pad_token_id=5,
                             num_return_sequences=2, length_penalty=0.7)
    prompt = torch.full((2 * 4, 1), 5)
    plain, fast = BeamSearchDecoder(opts, prompt), BeamSearchDecoder(opts, prompt, kernels.beam_candidates)
    generator = torch.Generator().manual_seed(3)
    for _ in range(12):
        logits = torch.randn(8, 40, generator=generator) * 2
        logits[:, 5] += 1.5  # EOS often among the best: beams finish along the way
        a, b = plain.update(logits), fast.update(logits)
        assert (a is None) == (b is None)
        if a is None:
            break
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for x, y in zip(plain.finalize(), fast.finalize()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("weights", ["packed", "int8"])
def test_beam_search_in_a_fast_format_takes_its_candidates_from_the_kernel_with_the_same_tokens(weights,
                                                                                               monkeypatch):
    engine, pixels = fast_engine_and_pixels(weights)
    steps = engine.decoder.steps
    answered = []

    def counted(*args):
        found = kernels.beam_candidates(*args)
        answered.append(found is not None)
        return found

    kwargs = dict(max_new_tokens=10, min_new_tokens=4, num_beams=3, num_return_sequences=2)
    monkeypatch.setattr(steps, "beam_candidates", counted)
    through_kernel = engine.generate(pixel_values=pixels, **kwargs)
    assert len(answered) >= 9 and sum(answered) >= 8  # it ran every step and answered (nearly) all of them
    monkeypatch.setattr(steps, "beam_candidates", None)
    assert torch.equal(engine.generate(pixel_values=pixels, **kwargs), through_kernel)
