"""A decode step through all of the decoder's blocks in one call of xattn's kernel (xattn/kernels/layers.cpp).

Used by the "packed" and "int8" weight formats at up to 64 rows, where the ~30 small torch ops per block (layer
norms, attention, residuals) would add ~3 ms of dispatch to a step that is otherwise its weights' products. The same
math as the decoder's own blocks, in another order of summation: logits differ by rounding only.
"""

from __future__ import annotations

import copy

import torch

from ..cache import CrossAttentionCache
from . import formats, kernels, registry, torch_ops
from .formats import Int8Linear, PackedLinear
from .limits import LIMITS

KINDS = ("packed", "int8")  # the formats whose copies the kernel reads
_ORDER = ("qkv", "attn_out", "cross_q", "cross_out", "mlp_in", "mlp_out")


class FusedLayers:
    """The blocks' layer norms stacked [L, 3, D] and their projections' copies, in the kernel's order."""

    def __init__(self, transformer, projections: list[dict], scalings: list[float], kind: str):
        self.handle = registry.register(self)  # how the compiled graph's opaque op finds this object
        blocks = list(transformer.h)
        self.has_cross = all("cross_q" in proj for proj in projections)
        norms = []
        for block in blocks:
            cross = block.ln_cross_attn if self.has_cross else block.ln_1  # unused slot without cross-attention
            norms.append([block.ln_1, cross, block.ln_2])
        self.norm_weight = torch.stack([torch.stack([n.weight.detach() for n in row]) for row in norms]).contiguous()
        self.norm_bias = torch.stack([torch.stack([n.bias.detach() for n in row]) for row in norms]).contiguous()
        self.eps = float(blocks[0].ln_1.eps)
        self.scalings = [float(s) for s in scalings]
        self._lists = {cross: self._weights(projections, cross) for cross in {False, self.has_cross}}
        self.independent = False  # every row independent of the others at any row count (see rowwise)

    def rowwise(self) -> FusedLayers:
        """This step at any number of rows with xattn's own products only: fbgemm's int8 products quantize all rows
        with one scale, so a row's result would depend on the rows beside it (in-flight batching needs it not to)."""
        twin = copy.copy(self)
        twin.handle, twin.independent = registry.register(twin), True
        return twin

    @staticmethod
    def _weights(projections, cross: bool):
        names = _ORDER if cross else tuple(n for n in _ORDER if not n.startswith("cross"))
        copies = [proj[name] for proj in projections for name in names]
        weights = [c.kernel_weight for c in copies]
        int8 = [c for c in copies if isinstance(c, Int8Linear)]
        biases = [c.bias for c in copies]
        whole = len(int8) == len(copies) and torch_ops.fbgemm_available()
        return weights, [c.scales for c in int8], biases, int8 if whole else []  # fbgemm's, for larger steps

    @classmethod
    def build(cls, transformer, projections, scalings, kind: str, activation: str) -> FusedLayers | None:
        """The fused step where it applies (kernels built, fp32 model, GPT-2's tanh GELU, copies with kernel
        weights and biases, fp32 widths in whole panels, one eps); None otherwise."""
        if kind not in KINDS or not kernels.available() or activation not in ("gelu_new", "gelu_pytorch_tanh"):
            return None
        if transformer.ln_f.weight.dtype != torch.float32:
            return None
        copies = [c for proj in projections for c in proj.values()]
        if not all(isinstance(c, (PackedLinear, Int8Linear)) and c.kernel_weight is not None and c.bias is not None
                   for c in copies):
            return None
        if any(isinstance(c, PackedLinear) and c.out_features % kernels.PANEL for c in copies):
            return None  # the kernel takes a weight's shape from its whole panels or blocks
        if any(isinstance(c, Int8Linear) and (c.out_features % 8 or c.kernel_weight.shape[1] * 32 != c.in_features)
               for c in copies):
            return None
        if len({float(block.ln_1.eps) for block in transformer.h}) != 1:
            return None
        return cls(transformer, projections, scalings, kind)

    def applies(self, rows: int, cache: CrossAttentionCache) -> bool:
        return (self.independent or rows <= LIMITS.fused_rows) and (not cache.has_cross or self.has_cross)

    def __call__(self, hidden: torch.Tensor, cache: CrossAttentionCache, position: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] at position ([] or one per row, [B]) -> [B, D] after every block; writes the step's K/V into
        the cache."""
        args = (hidden, cache.keys, cache.values, cache.cross_keys, cache.cross_values, cache.cross_mask,
                cache.enc_index, position)
        if torch.compiler.is_compiling():  # one opaque op: the compiler cannot trace fbgemm's packed weights
            return torch.ops.xattn.fused_layers(*args, self.handle)
        return self.run(*args)

    def run(self, hidden, keys, values, cross_keys, cross_values, cross_mask, enc_index, position) -> torch.Tensor:
        weights, scales, biases, int8 = self._lists[cross_keys is not None]
        fbgemm = (int8 and not self.independent and hidden.shape[0] >= LIMITS.fused_fbgemm_rows
                  and not formats.int8_kernel_everywhere())
        packed = [c.packed for c in int8] if fbgemm else []  # fbgemm's copies, made on the first such step
        return kernels.decoder_layers(
            hidden, self.norm_weight, self.norm_bias, weights, scales, biases, packed, keys, values, cross_keys,
            cross_values, cross_mask, enc_index, position, self.scalings, self.eps,
        )


@torch.library.custom_op("xattn::fused_layers", mutates_args=("keys", "values"))
def _fused_layers(hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cross_keys: torch.Tensor | None,
                  cross_values: torch.Tensor | None, cross_mask: torch.Tensor | None, enc_index: torch.Tensor | None,
                  position: torch.Tensor, handle: int) -> torch.Tensor:
    return registry.lookup(handle).run(hidden, keys, values, cross_keys, cross_values, cross_mask, enc_index, position)


@_fused_layers.register_fake
def _(hidden, keys, values, cross_keys, cross_values, cross_mask, enc_index, position, handle):
    return hidden.new_empty(hidden.shape)
