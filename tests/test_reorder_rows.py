"""Beam reorders through xattn's kernel (kernels.reorder_rows): every mapping moves exactly the rows and positions
torch's index ops move, in a whole cache or a range of its rows, any dtype; bad arguments are refused before anything
is written; and beam search through the fast formats runs it and gives the tokens it gave without it."""

import pytest
import torch

from conftest import fast_engine_and_pixels
from xattn.cache import CrossAttentionCache
from xattn.fast import kernels

pytestmark = pytest.mark.kernels

L, B, H, T, HD = 3, 5, 2, 7, 4


def _cache(dtype=torch.float32, rows=B):
    generator = torch.Generator().manual_seed(rows)
    cache = CrossAttentionCache.allocate(L, rows, H, T, HD, dtype=dtype)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    return cache


def _expected(tensor, index, valid):
    """Row i takes row index[i]'s positions [0, valid); everything else as it was (written out one row at a time)."""
    out = tensor.clone()
    for i, source in enumerate(index.tolist()):
        out[:, i, :, :valid] = tensor[:, source, :, :valid]
    return out


MAPPINGS = {
    "identity": [0, 1, 2, 3, 4],
    "swap": [1, 0, 2, 3, 4],
    "cycle": [1, 2, 3, 4, 0],
    "one source for all": [3, 3, 3, 3, 3],
    "beams": [0, 0, 1, 4, 2],
    "reversed": [4, 3, 2, 1, 0],
    "chain": [0, 0, 1, 2, 3],  # each row reads the one its reader overwrites next
    "two cycles": [1, 0, 3, 4, 2],
    "cycle with readers": [1, 2, 0, 0, 2],  # rows outside a cycle read rows on it
}


@pytest.mark.parametrize("mapping", MAPPINGS.values(), ids=MAPPINGS.keys())
@pytest.mark.parametrize("valid", [0, 1, 4, T])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_moves_what_torchs_index_ops_move(mapping, valid, dtype):
    index = torch.tensor(mapping)
    with_kernel, with_torch = _cache(dtype), _cache(dtype)
    with_kernel.length = with_torch.length = valid
    keys, values = _expected(with_kernel.keys, index, valid), _expected(with_kernel.values, index, valid)
    with_kernel.reorder(index, kernels.reorder_rows)
    with_torch.reorder(index)
    for cache in (with_kernel, with_torch):
        assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


def test_a_range_of_a_larger_caches_rows_is_reordered_in_place_and_the_rest_untouched():
    whole = _cache(rows=9)
    before = whole.keys.clone(), whole.values.clone()
    rows = whole.rows(2, 7, length=5)
    index = torch.tensor([4, 0, 0, 2, 1])
    rows.reorder(index, kernels.reorder_rows)
    for now, then in zip((whole.keys, whole.values), before):
        expected = then.clone()
        expected[:, 2:7] = _expected(then[:, 2:7], index, 5)
        assert torch.equal(now, expected)


def _args():
    cache = _cache()
    return dict(keys=cache.keys, values=cache.values, index=torch.tensor([1, 0, 2, 3, 4]), valid=4)


REFUSALS = {
    "index past the rows": (dict(index=torch.tensor([0, 1, 2, 3, B])), r"index\[4\] = 5 is outside the 5 cache rows"),
    "negative index": (dict(index=torch.tensor([-1, 1, 2, 3, 4])), r"index\[0\] = -1 is outside"),
    "one index short": (dict(index=torch.tensor([0, 1, 2, 3])), r"index: expected one source row per cache row"),
    "int32 index": (dict(index=torch.tensor([1, 0, 2, 3, 4], dtype=torch.int32)), r"index: expected a CPU int64"),
    "valid past the cache": (dict(valid=T + 1), r"valid: expected a number of positions in \[0, 7\], got 8"),
    "negative valid": (dict(valid=-1), r"valid: expected .* got -1"),
    "values of another shape": (dict(values=torch.zeros(L, B, H, T - 1, HD)), r"values \(keys' shape\)"),
    "values of another dtype": (dict(values=torch.zeros(L, B, H, T, HD, dtype=torch.float64)),
                                r"values \(keys' shape\): expected a CPU float32"),
    "keys [B, H, T, hd]": (dict(keys=torch.zeros(B, H, T, HD)), r"keys \[L, B, H, T_max, hd\]: expected .* 5 dim"),
    "positions strided": (dict(keys=torch.zeros(L, B, H, HD, T).transpose(3, 4)),
                          r"keys \[L, B, H, T_max, hd\]: expected a contiguous cache or a range of its rows"),
}


@pytest.mark.parametrize("change,message", REFUSALS.values(), ids=REFUSALS.keys())
def test_bad_arguments_are_refused_before_anything_is_written(change, message):
    args = _args()
    kernels.reorder_rows(**args)  # valid as built
    args = _args()
    args.update(change)
    before = [t.clone() for t in (args["keys"], args["values"])]
    with pytest.raises(RuntimeError, match=message):
        kernels.reorder_rows(**args)
    assert all(torch.equal(now, then) for now, then in zip((args["keys"], args["values"]), before))


def test_keys_and_values_of_one_storage_are_refused():
    keys = torch.zeros(L, B, H, T, HD)
    with pytest.raises(RuntimeError, match="keys and values must be separate tensors"):
        kernels.reorder_rows(keys, keys, torch.tensor([1, 0, 2, 3, 4]), 3)


@pytest.mark.parametrize("weights", ["packed", "int8"])
def test_beam_search_in_a_fast_format_reorders_through_the_kernel_with_the_same_tokens(weights, monkeypatch):
    engine, pixels = fast_engine_and_pixels(weights)
    steps = engine.decoder.steps
    calls = []

    def counted(*args):
        calls.append(args[2].clone())
        return kernels.reorder_rows(*args)

    kwargs = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, num_return_sequences=2)
    monkeypatch.setattr(steps, "reorder_rows", counted)
    through_kernel = engine.generate(pixel_values=pixels, **kwargs)
    assert len(calls) == 9 and any(not torch.equal(c, torch.arange(6)) for c in calls)  # rows really moved
    monkeypatch.setattr(steps, "reorder_rows", None)
    assert torch.equal(engine.generate(pixel_values=pixels, **kwargs), through_kernel)
