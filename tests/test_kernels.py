"""xattn's AVX2 matrix-vector kernel: built on first use, equal to torch's products within rounding for fp32 and
int8 weights at any shape (tails included), and optional: without it the formats fall back to torch's kernels."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from xattn import kernels


def _can_build() -> bool:
    return shutil.which("g++") is not None and kernels._cpu_has_avx2_fma()


pytestmark = pytest.mark.skipif(not _can_build(), reason="needs g++ and an x86-64 CPU with AVX2 + FMA")


def test_the_kernel_builds_and_loads_here():
    assert kernels.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 13, 32])
@pytest.mark.parametrize("k,n", [(32, 37), (768, 2304), (3072, 768), (20, 13), (8, 1), (40, 9)])
def test_fp32_and_int8_products_equal_torch_within_rounding(rows, k, n):
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    fp32 = kernels.matvec(x, kernels.panels(weight), n, bias)
    assert fp32.shape == (rows, n) and torch.allclose(fp32.double(), expected, atol=1e-3, rtol=1e-4)
    # each product is one FMA chain in k order, whatever the rows beside it: row by row gives the same bits
    assert torch.equal(torch.cat([kernels.matvec(x[i:i + 1], kernels.panels(weight), n, bias) for i in range(rows)]),
                       fp32)
    # int8: the same product with x rounded to 8 bits per row (as the kernel does) is exact in int32
    scales = weight.abs().amax(dim=1) / 127
    quantized = (weight / scales[:, None]).round().to(torch.int8)
    x_scales = x.abs().amax(dim=1, keepdim=True) / 127
    x_rounded = (x / x_scales).round()
    expected = (x_rounded.double() @ quantized.double().t()) * x_scales.double() * scales.double() + bias.double()
    int8 = kernels.matvec_int8(x, kernels.int8_blocks(quantized), n, scales, bias).double()
    assert torch.allclose(int8, expected, atol=1e-4, rtol=1e-5)
    exact = torch.nn.functional.linear(x.double(), quantized.double() * scales.double()[:, None], bias.double())
    error = (int8 - exact).abs().max()
    assert error < 0.02 * exact.abs().max()  # and close to the unquantized activations' result


def test_leading_dimensions_are_kept_and_bad_input_is_refused():
    x = torch.randn(2, 3, 16)
    weight = torch.randn(5, 16)
    out = kernels.matvec(x, kernels.panels(weight), 5)
    assert out.shape == (2, 3, 5) and torch.allclose(out, x @ weight.t(), atol=1e-5)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.matvec(torch.randn(1, 15), kernels.panels(weight), 5)
    with pytest.raises(RuntimeError, match="panels"):
        kernels.matvec(torch.randn(1, 16), weight, 5)  # an [N, K] weight, not its panels
    with pytest.raises(RuntimeError, match="panels"):
        kernels.matvec(torch.randn(1, 16), kernels.panels(weight), 17)  # more columns than the panels hold
    with pytest.raises(RuntimeError, match="int8"):
        kernels.matvec_int8(torch.randn(1, 16), weight, 5, torch.ones(5))
    blocks = kernels.int8_blocks(torch.ones(5, 16, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.matvec_int8(torch.randn(1, 40), blocks, 5, torch.ones(5))  # K past the blocks' 32 columns
    with pytest.raises(RuntimeError, match="scale"):
        kernels.matvec_int8(torch.randn(1, 16), blocks, 5, torch.ones(4))


def test_without_the_kernel_the_formats_fall_back_and_give_the_same_tokens(tmp_path):
    script = f"""
import torch, sys, xattn
sys.path.insert(0, {os.path.dirname(__file__)!r})
from conftest import tiny_captioner
from xattn import kernels
model = tiny_captioner(seed=51)
pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
out = xattn.from_hf(model, weights="packed").generate(pixel_values=pixels, max_new_tokens=8, min_new_tokens=8)
assert torch.equal(out, model.generate(pixel_values=pixels, max_new_tokens=8, min_new_tokens=8))
print(kernels.available())
"""
    env = dict(os.environ, XATTN_NO_KERNELS="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_fresh_cache_directory_gets_a_new_build(tmp_path):
    code = "from xattn import kernels; print(kernels.available(), kernels._build())"
    env = dict(os.environ, XATTN_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    ok, path = done.stdout.split()
    assert ok == "True" and path.startswith(str(tmp_path)) and os.path.exists(path)
