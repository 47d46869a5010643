"""A bfloat16 cross K/V projection's output into the cache's heads (kernels.cross_heads): the values torch's widening,
bias and strided copies give, in float16 and float32 caches, at head sizes with and without a vector tail; the
decoder's cross K/V through it equal to the generic path's; bad arguments refused before anything is written."""

import pytest
import torch

import xattn
from conftest import tiny_captioner
from xattn.fast import formats, kernels
from xattn.fast.formats import BF16Linear

pytestmark = pytest.mark.kernels


def _torch_heads(kv, bias, heads, dtype):
    n, positions, width = kv.shape
    k, v = (kv.float() + bias).view(n, positions, 2, heads, width // (2 * heads)).permute(2, 0, 3, 1, 4)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,positions,heads,hd", [(1, 197, 12, 64), (3, 17, 4, 12), (2, 5, 3, 4), (16, 9, 2, 8)])
def test_heads_equal_torchs_passes(dtype, n, positions, heads, hd):
    generator = torch.Generator().manual_seed(n * 100 + hd)
    kv = (torch.randn(n, positions, 2 * heads * hd, generator=generator) * 40).bfloat16()
    kv[0, 0, 0] = 70000.0  # past float16's range: inf in both
    bias = torch.randn(2 * heads * hd, generator=generator)
    keys, values = (torch.full((n, heads, positions, hd), float("nan"), dtype=dtype) for _ in range(2))
    kernels.cross_heads(kv, bias, keys, values)
    want_keys, want_values = _torch_heads(kv, bias, heads, dtype)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@pytest.mark.parametrize("decoder_weights", ["int8", "packed"])  # float16 cross K/V (the fused int8 step), float32
def test_cross_key_values_through_the_kernel_equal_the_generic_path(decoder_weights, monkeypatch):
    engine = xattn.from_hf(tiny_captioner(seed=3)).with_weights(decoder_weights, encoder_weights="bf16")
    states = torch.randn(5, 17, 32, generator=torch.Generator().manual_seed(4))
    assert all(isinstance(p, BF16Linear) for p in engine.decoder.steps.cross_kv)
    keys, values = engine.decoder.cross_key_values(states)
    monkeypatch.setattr(BF16Linear, "into_heads", lambda *args: False)
    want_keys, want_values = engine.decoder.cross_key_values(states)
    assert keys.dtype == want_keys.dtype == (torch.float16 if decoder_weights == "int8" else torch.float32)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_the_projection_runs_into_one_buffer_per_thread_kept_for_the_next_batch_of_its_size(monkeypatch):
    engine = xattn.from_hf(tiny_captioner(seed=3)).with_weights("int8", encoder_weights="bf16")
    states = torch.randn(5, 17, 32, generator=torch.Generator().manual_seed(4))
    first = engine.decoder.cross_key_values(states)
    held = formats._scratches.tensor
    assert held.shape == (5 * 17, 64) and held.dtype == torch.bfloat16
    again = engine.decoder.cross_key_values(states)
    assert formats._scratches.tensor is held  # the same size: the same buffer
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    fewer = engine.decoder.cross_key_values(states[:2])
    assert formats._scratches.tensor.shape == (2 * 17, 64)  # another size: replaced
    monkeypatch.setattr(BF16Linear, "into_heads", lambda *args: False)
    assert all(torch.equal(a, b) for a, b in zip(fewer, engine.decoder.cross_key_values(states[:2])))


def _args():
    return dict(kv=torch.randn(2, 5, 24).bfloat16(), bias=torch.randn(24), keys=torch.empty(2, 3, 5, 4),
                values=torch.empty(2, 3, 5, 4))


@pytest.mark.parametrize("name,bad,message", [
    ("kv", lambda: torch.randn(2, 5, 24), r"kv \[n, S, 2D\]: expected a contiguous CPU bfloat16"),
    ("kv", lambda: torch.randn(2, 5, 20).bfloat16(), r"kv \[n, S, 2D\] \(n, S, H, hd from keys\)"),
    ("bias", lambda: torch.randn(12), r"bias \[2D\]"),
    ("keys", lambda: torch.empty(2, 5, 3, 4).transpose(1, 2), r"keys \[n, H, S, hd\]: expected a contiguous"),
    ("keys", lambda: torch.empty(2, 3, 5, 4, dtype=torch.float64), r"float16 or float32"),
    ("values", lambda: torch.empty(2, 3, 5, 4, dtype=torch.float16), r"values \(keys' shape and dtype\)"),
])
def test_bad_arguments_are_refused_by_name(name, bad, message):
    args = _args()
    kernels.cross_heads(**args)  # valid as built
    args[name] = bad()
    with pytest.raises(RuntimeError, match=message):
        kernels.cross_heads(**args)
