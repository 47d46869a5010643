"""torch's private operators that the fast paths call, in one place: oneDNN's fp32 linear and fbgemm's dynamic int8
linear. They are tested on the torch in constraints.txt (TESTED_TORCH). On another torch each family is
probed once on a small product against F.linear; where it is missing or wrong, a public equivalent does the same
math (slower), with one warning saying so."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

TESTED_TORCH = "2.13"


@functools.cache
def onednn_available() -> bool:
    def probe():
        weight, x = _probe_inputs()
        plain = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        strided = torch.ops.mkldnn._linear_pointwise(x, weight.t().contiguous().t(), None, "none", [], "")
        expected = F.linear(x, weight)
        return torch.allclose(plain, expected, atol=1e-4) and torch.allclose(strided, expected, atol=1e-4)

    return _probe("oneDNN's linear (torch.ops.mkldnn)", probe)


@functools.cache
def fbgemm_available() -> bool:
    def probe():
        weight, x = _probe_inputs()
        quantized = quantize(weight)
        packed = torch.ops.quantized.linear_prepack(quantized, None)
        out = torch.ops.quantized.linear_dynamic(x, packed, True)
        expected = F.linear(x, quantized.dequantize())  # off by the activations' 7-bit rounding only
        return bool((out - expected).abs().max() <= 0.05 * expected.abs().max())

    return _probe("fbgemm's dynamic int8 linear (torch.ops.quantized)", probe)


def _probe_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(24, 16, generator=generator), torch.randn(3, 16, generator=generator)


def _probe(name: str, probe) -> bool:
    try:
        works = bool(probe())
    except (AttributeError, RuntimeError, NotImplementedError):
        works = False
    if not works:
        warnings.warn(f"{name} is not usable on torch {torch.__version__} (xattn is tested on {TESTED_TORCH}); "
                      "using F.linear instead (same math, slower)", stacklevel=3)
    return works


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for an fp32 weight [out, in], contiguous or its transpose (a Conv1D's [in, out] seen as
    [out, in]): oneDNN reads either in place, about twice as fast as torch's addmm at 64-600 rows on AVX2."""
    if onednn_available():
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    """fp32 weight [out, in] -> (its int8 copy, symmetric with one scale per output channel, as a quantized tensor;
    what linear_int8 reads: see prepack_quantized)."""
    quantized = quantize(weight.detach().float())
    return quantized, prepack_quantized(quantized, bias)


def prepack_quantized(quantized: torch.Tensor, bias: torch.Tensor | None):
    """What linear_int8 reads for a quantized weight: fbgemm's prepacked linear with the bias inside (a copy of the
    weight in fbgemm's layout), or the dequantized weight and bias."""
    if not fbgemm_available():
        return quantized.dequantize(), bias
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack(quantized, bias)


def quantized_weight(int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The quantized tensor of an int8 weight [out, in] and its per-channel scales (as quantize made them)."""
    zero_points = torch.zeros(int8.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._make_per_channel_quantized_tensor(int8, scales.double(), zero_points, 0)


def linear_int8(x: torch.Tensor, packed) -> torch.Tensor:
    """Dynamic int8 linear: activations quantized per tensor (7 bits, as torch's dynamic quantization on x86)."""
    if fbgemm_available():
        return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)
    weight, bias = packed
    return F.linear(x, weight, bias)


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weight [out, in] -> int8, symmetric, one scale per output channel (a float32 value held as float64)."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's kernels remain
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
