"""Weight formats for the decoder's projections: what a decode step streams from memory.

A decode step reads every projection weight once per token (qkv, attention out, cross-attention query and
out, MLP in and out per layer, then the LM head): at small batch it is bound by memory bandwidth, so the
format of those weights sets its speed.

- "exact": transformers' own tensors and ops (Conv1D's addmm, the head's linear); bit-identical logits.
- "packed": at most one fp32 copy: at up to LIMITS.packed_kernel_rows activation rows through xattn's own AVX2 kernel
  (xattn.fast.kernels; Conv1D weights copied into its 16-column panels, the LM head read in place), above that through
  oneDNN's linear reading transformers' own tensors in place (its prepacked copy was no faster there); the same values
  summed in another order, so logits differ by rounding only. Greedy steps
  read the LM head through an int8 copy first and pick the same token (xattn/fast/greedy_head.py).
- "bf16": bfloat16 copies (half the bytes); activations are cast to bf16 for the product, results to fp32.
- "int8": an int8 copy with one scale per output channel, activations quantized per call by xattn's byte-product
  kernel (8-bit, symmetric per row). Where the CPU has AVX-512 VNNI that kernel takes every row count (see
  int8_kernel_everywhere); on AVX2 alone, above LIMITS.int8_kernel_rows rows fbgemm's dynamic linear (7-bit per tensor)
  is faster, and its own copy is made the first time it is needed. Where the fused step runs, the cache keeps the
  cross-attention K/V in float16 (DecoderSteps.cross_kv_dtype): at many rows, each reading its own input's K/V, those
  reads outweigh the weights' (16 ViT-B inputs: 232 MB a step in float32).

Decode steps of "packed" and "int8" at up to LIMITS.fused_rows rows run every block in one kernel call
(xattn/fast/fused.py), with xattn's products there (int8 on AVX2 alone from LIMITS.fused_fbgemm_rows rows: fbgemm's,
called from the kernel). torch's private operators (oneDNN's, fbgemm's) are reached through xattn/fast/torch_ops.py.

Copies are made once, when the decoder is built: later changes to the transformers weights are not seen by them
(build the decoder again after fine-tuning).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..steps import ExactConv1D, ExactModule
from . import kernels, registry, torch_ops
from .limits import LIMITS

KINDS = ("exact", "packed", "bf16", "int8")


class _Copy:
    """A projection holding its own copy of the weights. Where xattn's kernel applies (`direct`), it is called
    as it is, compiled or not: a plain op over plain tensors. Otherwise, under torch.compile, the projection is
    one opaque custom op (`xattn::projection`, which finds it by handle): the compiler cannot trace oneDNN's
    packed tensors or fbgemm's packed parameters, but compiles everything around them."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.handle = registry.register(self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.direct(x)
        if out is not None:
            return out
        if torch.compiler.is_compiling():
            return torch.ops.xattn.projection(x, self.handle)
        return self.forward(x)

    def direct(self, x: torch.Tensor) -> torch.Tensor | None:
        """xattn's kernel, where it applies to x (few rows, kernels built); None otherwise."""
        return None

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        """xattn's kernel at any number of rows, where the copy has one (each row's result independent of the rows
        beside it); the library kernels otherwise."""
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The library kernels' product (oneDNN, torch, fbgemm)."""
        raise NotImplementedError


@torch.library.custom_op("xattn::projection", mutates_args=())
def _projection(x: torch.Tensor, handle: int) -> torch.Tensor:
    return registry.lookup(handle).forward(x)


@_projection.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], registry.lookup(handle).out_features)


def int8_kernel_everywhere() -> bool:
    """xattn's int8 kernel at every row count of a decode step, no fbgemm copy: with AVX-512 VNNI it is faster than
    fbgemm's up to ~8 rows and ~1.2x slower from 32 on (AVX2's sign-and-multiply kernel is 1.0-3x slower there, so
    AVX2 alone keeps fbgemm for 5+ rows); read per call, because tests switch the kernel (kernels.int8_kernel)."""
    return kernels.int8_kernel_is_vnni()


def _small(x: torch.Tensor, kernel_weight: torch.Tensor | None, rows: int) -> bool:
    return kernel_weight is not None and x.numel() <= rows * x.shape[-1]


class PackedLinear(_Copy):
    """fp32 weight [out, in] for xattn's kernel (few rows) and oneDNN's linear (more), with at most one copy: a
    Conv1D's weight (seen transposed) is copied into the kernel's 16-column panels; a contiguous fp32 weight (an
    nn.Linear's, such as a tied LM head) is read in place by both, the kernel summing each output as a dot product
    (`in_place`). oneDNN reads the weight given, a view of the model's own tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight)
        self.weight = weight.detach().float()  # no copy of an fp32 tensor
        self.in_place = self.weight.is_contiguous() and kernels.available()
        self.kernel_weight = None
        if kernels.available() and not self.in_place:
            self.kernel_weight = kernels.panels(self.weight.contiguous())
        self.bias = None if bias is None else bias.detach().float().clone()

    def direct(self, x: torch.Tensor) -> torch.Tensor | None:
        kernel = self.in_place or self.kernel_weight is not None
        return self.rowwise(x) if kernel and x.numel() <= LIMITS.packed_kernel_rows * x.shape[-1] else None

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            return kernels.matvec_rows(x, self.weight, self.bias)
        if self.kernel_weight is None:
            return self.forward(x)
        return kernels.matvec(x, self.kernel_weight, self.out_features, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ops.linear_fp32(x, self.weight, self.bias)


class BF16Linear(_Copy):
    """bfloat16 weight [out, in]; the bias is added in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight)
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).float()
        return out if self.bias is None else out.add_(self.bias)

    def into_heads(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """As a cross K/V projection: keys, values [n, H, S, hd] = the heads of x [n, S, D] projected, written in one
        pass with the bias added in fp32 (kernels.cross_heads: the same values as the generic path's widening,
        bias and strided copies, which cost twice the product); False where the kernels are not built."""
        if not kernels.available():
            return False
        bias = self.bias if self.bias is not None else torch.zeros(self.out_features)
        n, positions, _ = x.shape
        # the product into a buffer this thread keeps (F.linear's same bits): a fresh [n, S, 2D] result on every
        # layer costs as much again in page faults as the product itself
        kv = _scratch(n * positions, self.out_features)
        torch.mm(x.to(torch.bfloat16).reshape(n * positions, -1), self.weight.t(), out=kv)
        kernels.cross_heads(kv.view(n, positions, -1), bias, keys, values)
        return True


_scratches = threading.local()


def _scratch(rows: int, width: int) -> torch.Tensor:
    """A [rows, width] bfloat16 tensor this thread keeps for the next call of the same size (cross K/V projections:
    one per layer, then the next batch's)."""
    held = getattr(_scratches, "tensor", None)
    if held is None or held.shape != (rows, width):
        _scratches.tensor = None  # the old one freed first
        held = _scratches.tensor = torch.empty(rows, width, dtype=torch.bfloat16)
    return held


class Int8Linear(_Copy):
    """int8 weight [out, in], symmetric with one scale per output channel: xattn's kernel at few rows (at every row
    count with AVX-512 VNNI), fbgemm's dynamic linear above (7-bit activation range, as torch's dynamic quantization
    does on x86). fbgemm reads its own copy in its own layout, made when a product first needs it: a decoder that
    never runs more rows than the kernel takes (any decoder with VNNI; batch 1 and in-flight serving without it)
    holds one int8 copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bulk: bool = False):
        super().__init__(weight)
        # bulk: run on many rows at once (an encoder's layers, the cross K/V projection over encoder positions),
        # where fbgemm's products are faster than the VNNI kernel's by more than a second copy costs
        self.bulk = bulk
        self.bias = None if bias is None else bias.detach().float().clone()
        quantized = torch_ops.quantize(weight.detach().float())
        self.scales = quantized.q_per_channel_scales().float()  # float32 values: exact either way
        self.kernel_weight = kernels.int8_blocks(quantized.int_repr()) if kernels.available() else None
        self._packed = None if self.kernel_weight is not None else torch_ops.prepack_quantized(quantized, self.bias)
        self._lock = threading.Lock()

    @property
    def packed(self):
        """fbgemm's prepacked copy (made on first use, from the kernel's blocks)."""
        if self._packed is None:
            with self._lock:
                if self._packed is None:
                    int8 = kernels.unblock_int8(self.kernel_weight, self.out_features, self.in_features)
                    quantized = torch_ops.quantized_weight(int8, self.scales)
                    self._packed = torch_ops.prepack_quantized(quantized, self.bias)
        return self._packed

    def direct(self, x: torch.Tensor) -> torch.Tensor | None:
        if _small(x, self.kernel_weight, LIMITS.int8_kernel_rows):
            return self.rowwise(x)
        if self.kernel_weight is not None and int8_kernel_everywhere() and (
                not self.bulk or _small(x, self.kernel_weight, LIMITS.fused_rows)):
            return self.rowwise(x)
        return None

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is None:
            return self.forward(x)
        return kernels.matvec_int8(x, self.kernel_weight, self.out_features, self.scales, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ops.linear_int8(x, self.packed)


def _copy(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, bulk: bool = False):
    """Format kind's copy of a weight [out, in]; bulk: one that runs on many rows at once (see Int8Linear)."""
    if kind == "int8":
        return Int8Linear(weight, bias, bulk=bulk)
    return {"packed": PackedLinear, "bf16": BF16Linear}[kind](weight, bias)


def independent_rows(kind: str) -> int | None:
    """Rows up to which a format's products compute each row independently of the others (None: at any count,
    as torch's own are taken to): int8 above LIMITS.int8_kernel_rows rows goes to fbgemm, which quantizes all of its
    rows with one scale (without the kernels, from one row); packed above LIMITS.packed_kernel_rows to oneDNN, whose
    sums run in another order."""
    if kind == "int8":
        if int8_kernel_everywhere():  # as "packed": the fused step and the blocks above it sum in other orders
            return LIMITS.fused_rows
        return min(LIMITS.int8_kernel_rows, LIMITS.fused_fbgemm_rows - 1) if kernels.available() else 1
    if kind == "packed" and kernels.available():
        return min(LIMITS.packed_kernel_rows, LIMITS.fused_rows)
    return None


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"weights={kind!r}: choose one of {', '.join(KINDS)}")
    return kind


def conv1d(conv: nn.Module, kind: str, bulk: bool = False):
    """A projection over a transformers Conv1D (weight [in, out]); bulk: one that runs on many rows at once (see
    Int8Linear)."""
    if kind == "exact":
        return ExactConv1D(conv)  # the core's own
    return _copy(kind, conv.weight.t(), conv.bias, bulk)


def linear(module: nn.Module, kind: str):
    """A projection over an nn.Linear (weight [out, in]); other modules are only run as they are."""
    if kind == "exact" or not isinstance(module, nn.Linear):
        return ExactModule(module)
    return _copy(kind, module.weight, module.bias)


class ConvertedLinear(nn.Module):
    """Stands in for an nn.Linear with a copy of its weights in another format (inference only)."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.in_features, self.out_features, self.kind = linear.in_features, linear.out_features, kind
        self.projection = _copy(kind, linear.weight, linear.bias, bulk=True)  # an encoder's layers: many rows a call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind}"


def convert_linears(module: nn.Module, kind: str) -> nn.Module:
    """A copy of module (e.g. a ViT encoder) whose nn.Linear layers hold their weights in format kind; the
    original is left as it is."""
    import copy

    check_kind(kind)
    module = copy.deepcopy(module)
    if kind == "exact":
        return module
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, ConvertedLinear(child, kind))
    return module
