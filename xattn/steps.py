"""How a decoder computes its products, as data the core runs and never inspects: transformers' own tensors and
ops ("exact", built here), or copies in another format with fast paths (built by xattn.fast.accelerate)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .cache import CrossAttentionCache, RowCopy

Projection = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]


class FusedStep(Protocol):
    """A whole decode step through every block in one call (xattn.fast builds one)."""

    def applies(self, rows: int, cache: CrossAttentionCache) -> bool: ...

    def __call__(self, hidden: torch.Tensor, cache: CrossAttentionCache, position: torch.Tensor) -> torch.Tensor: ...


class GreedyArgmax(Protocol):
    """The argmax of the LM head's product without computing all of it (xattn.fast builds one)."""

    def applies(self, rows: int) -> bool: ...

    def __call__(self, hidden: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DecoderSteps:
    """How the decoder computes its products: transformers' own ("exact", built here) or copies in another format
    with optional fast paths (xattn.fast.accelerate). The core only calls these; it never sees a format."""

    name: str  # the weight format, for messages and bookkeeping ("exact", "packed", ...)
    cross_name: str  # the format of the cross-attention K/V projection
    projections: list[dict[str, Projection]]  # per block: qkv, attn_out, mlp_in, mlp_out (+ cross_q, cross_out)
    cross_kv: list[Projection]  # per block with cross-attention: encoder states [.., D] -> K and V [.., 2D]
    lm_head: Projection | None  # the LM head's projection (None: steps return hidden states)
    attention: Callable = F.scaled_dot_product_attention  # (q, k, v, attn_mask=, scale=) -> out
    tanh_gelu: bool = False  # GELU as one tanh-approximation op instead of the module's own activation
    cross_rows: Callable[[int], int] | None = None  # encoder positions -> rows projected to cross K/V at a time
    # (None: the whole batch at once)
    fused: FusedStep | None = field(default=None, repr=False)  # a whole decode step in one call, where it applies
    greedy_head: GreedyArgmax | None = field(default=None, repr=False)  # greedy tokens without the full head
    # a step computes each row independently of the rows beside it up to this many rows (None: at any count), so a
    # request decoded among others gets what it gets alone; above it a product quantizes the rows together (int8)
    independent_rows: int | None = None
    # these steps with every row independent at any count (None: they are already, or cannot be): what in-flight
    # batching runs rows of different requests through (xattn/inflight.py)
    rowwise: DecoderSteps | None = field(default=None, repr=False)
    # encoder states -> the dtype their cross K/V are kept in, or None for the states' own (None: always their own):
    # what the fused step reads at every step, so a narrower one reads fewer bytes where many rows read their own
    cross_kv_dtype: Callable[[torch.Tensor], torch.dtype | None] | None = field(default=None, repr=False)
    # beam search's reorder of the cache's self K/V in one call (xattn.fast's kernel; None: torch's index ops)
    reorder_rows: RowCopy | None = field(default=None, repr=False)
    # beam search's best candidates per step in one call, torch.topk's exactly (xattn.fast's kernel; None, or None
    # returned: torch's topk): generate.BeamCandidates
    beam_candidates: Callable | None = field(default=None, repr=False)
    # greedy search's choice, torch.argmax's indices (xattn.fast's kernel for fp32 rows; None: torch.argmax):
    # generate.Argmax
    argmax_rows: Callable | None = field(default=None, repr=False)


class ExactConv1D:
    """transformers' Conv1D (weight [in, out]): the same addmm it runs, so results match bit for bit."""

    def __init__(self, conv: nn.Module):
        self.conv = conv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.conv.bias, x.reshape(-1, x.shape[-1]), self.conv.weight)
        return out.view(*x.shape[:-1], out.shape[-1])


class ExactModule:
    """Any module called as is (the LM head: nn.Linear)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def block_convs(block: nn.Module) -> dict[str, nn.Module]:
    """A GPT-2 block's per-step Conv1D projections by name."""
    convs = {"qkv": block.attn.c_attn, "attn_out": block.attn.c_proj, "mlp_in": block.mlp.c_fc,
             "mlp_out": block.mlp.c_proj}
    if hasattr(block, "crossattention"):
        convs.update(cross_q=block.crossattention.q_attn, cross_out=block.crossattention.c_proj)
    return convs


def exact_steps(transformer: nn.Module, lm_head: nn.Module | None) -> DecoderSteps:
    """transformers' own tensors and ops: logits bit-identical to its forward."""
    return DecoderSteps(
        name="exact", cross_name="exact",
        projections=[{name: ExactConv1D(conv) for name, conv in block_convs(block).items()} for block in transformer.h],
        cross_kv=[ExactConv1D(block.crossattention.c_attn) for block in transformer.h
                  if hasattr(block, "crossattention")],
        lm_head=None if lm_head is None else ExactModule(lm_head),
    )
