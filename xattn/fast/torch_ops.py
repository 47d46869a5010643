"""torch's private operators that the fast paths call, in one place: oneDNN's prepacked fp32 linear and fbgemm's
dynamic int8 linear. They are tested on the torch in constraints.txt (TESTED_TORCH). On another torch each family is
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
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.allclose(out, F.linear(x, weight), atol=1e-4)

    return _probe("oneDNN's prepacked linear (torch.ops.mkldnn)", probe)


@functools.cache
def fbgemm_available() -> bool:
    def probe():
        weight, x = _probe_inputs()
        quantized = _quantize(weight)
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


def pack_fp32(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weight [out, in] in the layout linear_fp32 reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1) if onednn_available() else weight


def linear_fp32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if onednn_available():
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, packed, bias)


def prepack_int8(weight: torch.Tensor, bias: torch.Tensor | None):
    """fp32 weight [out, in] -> (its int8 copy, symmetric with one scale per output channel, as a quantized tensor;
    what linear_int8 reads: fbgemm's prepacked linear with the bias inside, or the dequantized weight and bias)."""
    quantized = _quantize(weight.detach().float())
    if not fbgemm_available():
        return quantized, (quantized.dequantize(), bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantized, torch.ops.quantized.linear_prepack(quantized, bias)


def linear_int8(x: torch.Tensor, packed) -> torch.Tensor:
    """Dynamic int8 linear: activations quantized per tensor (7 bits, as torch's dynamic quantization on x86)."""
    if fbgemm_available():
        return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)
    weight, bias = packed
    return F.linear(x, weight, bias)


def _quantize(weight: torch.Tensor) -> torch.Tensor:
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's kernels remain
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
