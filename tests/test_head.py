"""Greedy tokens through the int8-screened LM head (xattn/head.py, kernels/screen.cpp): always the argmax of the packed
head's own fp32 product, near-ties, exact ties, forbidden ids and NaN included; generate gives transformers' tokens
with it, and it runs where it is meant to (few rows, packed weights, greedy without a repetition penalty)."""

import pytest
import torch
from torch import nn

import xattn
from conftest import count_calls, tiny_captioner
from xattn.fast import kernels
from xattn.fast.formats import PackedLinear
from xattn.fast.greedy_head import GreedyHead
from xattn.fast.limits import LIMITS

pytestmark = pytest.mark.kernels  # skipped when the test runs, where they cannot be built (conftest.py)

NONE = torch.zeros(0, dtype=torch.long)


def _head(weight, bias=None):
    packed = PackedLinear(weight, bias)
    return packed, GreedyHead(packed)


def _full_argmax(packed, x, forbidden=NONE):
    return packed(x).index_fill(1, forbidden, float("-inf")).argmax(dim=-1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_tokens_are_the_full_products_argmax_on_gpt2_shaped_heads(rows):
    generator = torch.Generator().manual_seed(rows)
    packed, screened = _head(torch.randn(5003, 768, generator=generator) * 0.02,
                             torch.randn(5003, generator=generator) * 0.1)
    for trial in range(20):
        x = torch.nn.functional.layer_norm(torch.randn(rows, 768, generator=generator) * 3, (768,))
        forbidden = torch.tensor([trial, 4000]) if trial % 2 else NONE
        assert torch.equal(screened(x, forbidden), _full_argmax(packed, x, forbidden))


def test_near_ties_below_the_int8_error_still_give_the_fp32_argmax():
    """Rivals of the best token a few 1e-4 below or above it, far inside the int8 copy's error (~1e-2): the int8 pass
    alone picks wrongly in some trials (checked), the screened head never does."""
    generator = torch.Generator().manual_seed(5)
    int8_wrong = 0
    for trial in range(40):
        weight = torch.randn(997, 256, generator=generator) * 0.05
        x = torch.randn(1, 256, generator=generator)
        best = int((x @ weight.t()).argmax())
        for rival in torch.randperm(997, generator=generator)[:6].tolist():
            direction = torch.randn(256, generator=generator)
            weight[rival] = weight[best] + direction * (1e-4 * (trial % 3 - 1)) / direction.norm()
        packed, screened = _head(weight)
        expected = _full_argmax(packed, x)
        assert torch.equal(screened(x, NONE), expected)
        approx = kernels.matvec_int8(x, screened.screen, 997, screened.scales, None)
        int8_wrong += int(approx.argmax() != expected[0])
    assert int8_wrong > 0  # the test reaches cases that the bound, not the int8 pass, gets right


def test_exact_ties_go_to_the_lowest_id_and_forbidden_ids_are_skipped():
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(6))
    weight[[17, 90, 250]] = weight[5] * 3  # four tokens, one score: three of them the best
    x = weight[5:6].clone()
    packed, screened = _head(weight)
    assert int(screened(x, NONE)) == int(_full_argmax(packed, x)) == 17
    assert int(screened(x, torch.tensor([17]))) == int(_full_argmax(packed, x, torch.tensor([17]))) == 90


def test_nan_activations_give_what_torch_argmax_gives():
    packed, screened = _head(torch.randn(50, 32, generator=torch.Generator().manual_seed(7)))
    x = torch.full((2, 32), float("nan"))
    for forbidden in (NONE, torch.tensor([0, 1])):
        assert torch.equal(screened(x, forbidden), _full_argmax(packed, x, forbidden))


def test_bad_input_is_refused():
    _, screened = _head(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        screened(torch.randn(1, 32), torch.tensor([40]))
    with pytest.raises(RuntimeError, match="x's K"):
        screened(torch.randn(1, 31), NONE)


def test_generate_with_the_screened_head_gives_transformers_tokens(monkeypatch):
    calls = count_calls(monkeypatch, kernels, "greedy_tokens")
    model = tiny_captioner(seed=61)
    engine = xattn.from_hf(model, weights="packed")
    for rows in (1, 3, LIMITS.greedy_head_rows + 2):
        pixels = torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(rows))
        for kwargs in (dict(max_new_tokens=10, min_new_tokens=6), dict(max_new_tokens=10)):
            calls.clear()
            assert torch.equal(engine.generate(pixel_values=pixels, **kwargs), model.generate(pixel_values=pixels,
                                                                                             **kwargs))
            assert bool(calls) == (rows <= LIMITS.greedy_head_rows)  # few rows only
    calls.clear()
    kwargs = dict(max_new_tokens=8, repetition_penalty=1.3)  # the penalty needs every logit: the full head runs
    assert torch.equal(engine.generate(pixel_values=pixels[:1], **kwargs),
                       model.generate(pixel_values=pixels[:1], **kwargs))
    assert not calls


def test_only_the_packed_format_builds_one():
    model = tiny_captioner(seed=62)
    assert xattn.from_hf(model, weights="packed").decoder.greedy_head is not None
    for kind in ("exact", "bf16", "int8"):
        assert xattn.from_hf(model, weights=kind).decoder.greedy_head is None
    assert GreedyHead.build(nn.Identity()) is None
