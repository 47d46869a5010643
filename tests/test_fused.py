"""The fused decode step (every block in one kernel call, xattn/fused.py): the same logits and cache as the
decoder's own blocks in every cache layout (beams sharing cross K/V, gathered rows, padded encoder positions, no
cross-attention), transformers' tokens through generate, and the blocks again above its row limit."""

import pytest
import torch

import xattn
from conftest import count_calls, tiny_captioner, tiny_gpt2
from xattn.decoder import GPT2CrossAttentionDecoder, advancing
from xattn.fast import accelerate, kernels
from xattn.fast.limits import LIMITS

pytestmark = pytest.mark.kernels  # skipped when the test runs, where they cannot be built (conftest.py)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused kernel's calls, so a test knows which path ran."""
    return count_calls(monkeypatch, kernels, "decoder_layers")


def _caches(decoder, rows, states=None, mask=None, select=None):
    """Two identical caches (one per path), optionally with rows gathered from a larger one."""
    caches = []
    for _ in range(2):
        cache = decoder.new_cache(rows, 24, states, mask)
        if select is not None:
            cache = cache.select_rows(torch.tensor(select))
        caches.append(cache)
    return caches


def _run_both(decoder, caches, steps=6, seed=0):
    fused = decoder.fused
    generator = torch.Generator().manual_seed(seed)
    rows = caches[0].batch_size
    for _ in range(steps):
        ids = torch.randint(3, 99, (rows,), generator=generator)
        with_fused = decoder.decode_step(ids, caches[0])
        decoder.fused = None
        try:
            with_blocks = decoder.decode_step(ids, caches[1])
        finally:
            decoder.fused = fused
        yield with_fused, with_blocks


def _layouts():
    states = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, 11:] = False
    return {
        "one row per input": dict(rows=2, states=states),
        "beams share cross K/V": dict(rows=8, states=states),
        "gathered rows": dict(rows=4, states=states, select=[3, 0, 2]),
        "padded encoder positions": dict(rows=4, states=states, mask=mask),
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_fused_step_equals_the_blocks_in_every_cache_layout(layout, fused_calls):
    decoder = xattn.from_hf(tiny_captioner(seed=61), weights="packed").decoder
    assert decoder.fused is not None
    caches = _caches(decoder, **_layouts()[layout])
    for with_fused, with_blocks in _run_both(decoder, caches):
        assert torch.allclose(with_fused, with_blocks, atol=1e-5, rtol=1e-5)
    assert fused_calls and len(fused_calls) == 6
    assert torch.allclose(caches[0].keys, caches[1].keys, atol=1e-5)
    assert torch.allclose(caches[0].values, caches[1].values, atol=1e-5)


def test_fused_step_without_cross_attention():
    model = tiny_gpt2(seed=62, add_cross_attention=False)
    decoder = accelerate(GPT2CrossAttentionDecoder(model.transformer, model.lm_head), "packed")
    assert decoder.fused is not None and not decoder.fused.has_cross
    caches = _caches(decoder, rows=3)
    for with_fused, with_blocks in _run_both(decoder, caches):
        assert torch.allclose(with_fused, with_blocks, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 8, 20])  # AVX2: xattn's int8 products up to 4 rows, fbgemm's from 5
def test_fused_int8_step_stays_close_to_the_blocks(rows, fused_calls, int8_kernel):
    decoder = xattn.from_hf(tiny_captioner(seed=63), weights="int8").decoder
    states = torch.randn(rows // 4 or 1, 17, 32, generator=torch.Generator().manual_seed(3))
    caches = _caches(decoder, rows=rows, states=states)
    for with_fused, with_blocks in _run_both(decoder, caches):
        error = (with_fused - with_blocks).abs().max() / with_blocks.abs().max()
        assert error < 0.02
    assert fused_calls == [rows] * 6


@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("width,heads", [(32, 4), (96, 8)])  # head dims 8 and 12 (a tail past 8 lanes)
def test_int8_steps_keep_cross_kv_in_float16_and_read_them_exactly(layout, width, heads, fused_calls):
    """The same step over float32 cross K/V holding the float16 values gives the same bits: float16 -> float32 is
    exact, so the kernel's float16 reads change nothing but the bytes read."""
    decoder = xattn.from_hf(tiny_captioner(seed=66, n_embd=width, n_head=heads, encoder_hidden=32),
                            weights="int8").decoder
    args = _layouts()[layout]
    args["states"] = torch.randn(2, 17, width, generator=torch.Generator().manual_seed(9))  # the decoder's width
    half, wide = _caches(decoder, **args)
    assert half.cross_keys.dtype == half.cross_values.dtype == torch.float16
    wide.set_cross(wide.cross_keys.float(), wide.cross_values.float(), wide.cross_mask)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(3, 99, (half.batch_size,), generator=generator)
        assert torch.equal(decoder.decode_step(ids, half), decoder.decode_step(ids, wide))
    assert len(fused_calls) == 8
    assert torch.equal(half.keys, wide.keys) and torch.equal(half.values, wide.values)


def test_a_step_of_many_rows_gives_each_row_the_bits_it_gets_alone():
    """23 rows x an MLP of 400: the GELU's 9200 values are shared between the threads (split mid-row, a scalar tail
    at the end), and each row still gets what it gets alone, where the GELU runs in one call."""
    decoder = xattn.from_hf(tiny_captioner(seed=68, n_embd=96, n_head=8, n_inner=400, encoder_hidden=96),
                            weights="packed").decoder
    rows = 23
    states = torch.randn(rows, 17, 96, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(3, 99, (rows,), generator=torch.Generator().manual_seed(5))
    cache = decoder.new_cache(rows, 8, states)
    together = decoder.decode_step(ids, cache)
    for row in range(rows):  # the same cross K/V (their projection over 23 inputs is not row by row)
        own = decoder.new_cache(1, 8)
        own.set_cross(cache.cross_keys[:, row:row + 1], cache.cross_values[:, row:row + 1], None)
        assert torch.equal(together[row:row + 1], decoder.decode_step(ids[row:row + 1], own)), f"row {row}"


def test_cross_kv_too_large_for_float16_stay_float32_and_interop_hands_out_float32():
    decoder = xattn.from_hf(tiny_captioner(seed=67), weights="int8").decoder
    states = torch.randn(1, 17, 32, generator=torch.Generator().manual_seed(2))
    cache = decoder.new_cache(2, 8, states)
    assert cache.cross_keys.dtype == torch.float16
    legacy = cache.to_legacy(cross=True)
    assert legacy[0][2].dtype == legacy[0][3].dtype == torch.float32
    assert torch.equal(legacy[0][2][0], cache.cross_keys[0, 0].float())
    big = states.clone()
    big[0, 3] *= 1e8  # a position whose K/V pass float16's largest finite value
    keys, values = decoder.cross_key_values(big)
    assert keys.dtype == values.dtype == torch.float32 and values.abs().max() > 65504
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    exact = xattn.from_hf(tiny_captioner(seed=67), weights="packed").decoder
    assert exact.new_cache(2, 8, states).cross_keys.dtype == torch.float32  # packed: transformers' tokens, fp32


def test_generate_with_the_fused_step_gives_transformers_tokens(fused_calls):
    model = tiny_captioner(seed=64)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    packed = xattn.from_hf(model, weights="packed")
    for kwargs in (dict(max_new_tokens=10, min_new_tokens=10), dict(max_new_tokens=10, num_beams=4)):
        expected = model.generate(pixel_values=pixels, **kwargs)
        assert torch.equal(packed.generate(pixel_values=pixels, **kwargs), expected)
    assert set(fused_calls) == {2, 8}  # greedy: 2 rows; beams: 2 x 4 rows, all fused


def test_above_the_row_limit_the_blocks_run(fused_calls):
    model = tiny_captioner(seed=65)
    rows = LIMITS.fused_rows + 1
    pixels = torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6)
    out = xattn.from_hf(model, weights="packed").generate(pixel_values=pixels, **kwargs)
    assert torch.equal(out, model.generate(pixel_values=pixels, **kwargs))
    assert fused_calls == []


def test_bad_input_to_the_kernel_is_refused():
    decoder = xattn.from_hf(tiny_captioner(seed=66), weights="packed").decoder
    cache = decoder.new_cache(1, 8, torch.randn(1, 17, 32))
    fused = decoder.fused
    weights, scales, biases, packed = fused._lists[True]
    args = (fused.norm_weight, fused.norm_bias)
    rest = (cache.keys, cache.values, cache.cross_keys, cache.cross_values, None, None)
    hidden = torch.randn(1, 32)
    with pytest.raises(RuntimeError, match="expected 12 weights"):
        kernels.decoder_layers(hidden, *args, weights[:-1], scales, biases, packed, *rest, torch.tensor(0),
                               fused.scalings, 1e-5)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.decoder_layers(hidden, *args, weights, scales, biases, packed, *rest, torch.tensor(8),
                               fused.scalings, 1e-5)
    with pytest.raises(RuntimeError, match="rows or width"):
        kernels.decoder_layers(torch.randn(2, 32), *args, weights, scales, biases, packed, *rest, torch.tensor(0),
                               fused.scalings, 1e-5)


def test_compiled_int8_step_equals_the_eager_step(fused_calls, int8_kernel):
    """From 5 rows the int8 step calls fbgemm from the kernel (AVX2 alone); compiled, it runs as one opaque op that
    does the same, so compiling changes only the rounding of what the compiler generates around it (final norm,
    head)."""
    torch._dynamo.reset()
    decoder = xattn.from_hf(tiny_captioner(seed=67), weights="int8").decoder
    states = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(9))
    caches = [decoder.new_cache(8, 16, states) for _ in range(2)]
    compiled = advancing(torch.compile(decoder.step_logits, fullgraph=True))
    generator = torch.Generator().manual_seed(10)
    for _ in range(4):
        ids = torch.randint(3, 99, (8,), generator=generator)
        assert torch.allclose(compiled(ids, caches[1]), decoder.decode_step(ids, caches[0]), atol=1e-5)
    assert torch.allclose(caches[0].keys, caches[1].keys, atol=1e-6)
    assert fused_calls.count(8) == 8  # eager and compiled steps both ran the fused kernel


@pytest.mark.parametrize("weights", ["packed", "int8"])
def test_a_one_token_prefill_is_the_fused_step_and_longer_prompts_are_not(weights, fused_calls):
    """A captioner's start token goes through the fused step (each weight read once), with the K/V and logits the
    blocks give; a longer prompt, or one asked for every position's logits, runs through the blocks."""
    decoder = xattn.from_hf(tiny_captioner(seed=69), weights=weights).decoder
    states = torch.randn(3, 17, 32, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(3, 99, (3, 1), generator=torch.Generator().manual_seed(7))
    fused, blocks = decoder.new_cache(3, 8, states), decoder.new_cache(3, 8, states)
    one = decoder.prefill(fused, input_ids=ids)
    assert len(fused_calls) == 1 and fused.length == 1
    every = decoder.prefill(blocks, input_ids=ids, all_logits=True)
    assert len(fused_calls) == 1 and blocks.length == 1 and every.shape == (3, 1, one.shape[-1])
    tolerance = 1e-4 if weights == "packed" else 0.05  # int8: the blocks quantize their rows in other groups
    torch.testing.assert_close(one, every[:, 0], rtol=tolerance, atol=tolerance * one.abs().max().item())
    torch.testing.assert_close(fused.keys[:, :, :, :1], blocks.keys[:, :, :, :1], rtol=tolerance, atol=tolerance)
    decoder.prefill(decoder.new_cache(3, 8, states), input_ids=ids.repeat(1, 2))
    assert len(fused_calls) == 1  # two tokens: the blocks
