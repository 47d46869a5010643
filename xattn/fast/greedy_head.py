"""Greedy tokens from an fp32 LM head at about a quarter of its bytes (xattn/kernels/screen.cpp).

A greedy decode step needs only the argmax of the head's product, yet the head is the largest single weight a step
reads (GPT-2: 50257 x 768, 154 MB of a 552 MB step). The packed head reads the model's own fp32 weight in place;
GreedyHead keeps an int8 copy of it (39 MB more memory) and,
per token, the norms that bound how far an int8 score can be from the fp32 one; the kernel reads the int8 copy,
then computes in fp32 only the few tokens whose bound reaches the best one's. The token it returns is the argmax of
the "packed" format's own fp32 head product, each candidate summed in the same order (a test compares them).
"""

from __future__ import annotations

import torch

from . import kernels
from .formats import PackedLinear
from .limits import LIMITS


class GreedyHead:
    """argmax over a PackedLinear head's fp32 product, read mostly through an int8 copy."""

    def __init__(self, head: PackedLinear):
        self.weight, self.bias = head.weight, head.bias  # what the packed head's own product reads, in place
        exact = self.weight.double()  # [V, D]
        scales = (exact.abs().amax(dim=1) / 127).clamp_min(1e-12).float()
        quantized = torch.round(exact / scales.double()[:, None]).clamp(-127, 127)
        approx = quantized * scales.double()[:, None]  # what the int8 product multiplies out to
        err2 = (exact - approx).norm(dim=1)
        l1 = approx.abs().sum(dim=1)
        norm = torch.maximum(exact.norm(dim=1), approx.norm(dim=1))
        self.screen = kernels.int8_blocks(quantized.to(torch.int8))
        self.scales = scales
        self.bounds = (torch.stack([err2, l1, norm]) * (1 + 1e-6)).float().contiguous()  # rounded up

    @classmethod
    def build(cls, head) -> GreedyHead | None:
        """For a packed head that xattn's kernel reads in place; None for any other head."""
        if not isinstance(head, PackedLinear) or not head.in_place:
            return None
        return cls(head)

    def applies(self, rows: int) -> bool:
        return rows <= LIMITS.greedy_head_rows  # above, the int8 pass costs about what it saves

    def __call__(self, hidden: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] (after the final layer norm), forbidden token ids [F] -> tokens [B]."""
        return kernels.greedy_tokens(hidden.contiguous(), self.weight, self.bias, self.screen, self.scales,
                                     self.bounds, forbidden)
