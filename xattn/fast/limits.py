"""Where one product beats another, in activation rows: one object, so that the thresholds are read and changed in
one place (measured on a 2-core AVX2 machine with `xattn bench`; the README's Performance section has the runs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    packed_kernel_rows: int = 64  # "packed": xattn's fp32 kernel up to this many rows, oneDNN's prepacked above
    int8_kernel_rows: int = 3  # "int8" on AVX2 alone: xattn's byte-product kernel up to this many rows, fbgemm's
    # above (with AVX-512 VNNI xattn's kernel takes every row count: formats.int8_kernel_everywhere)
    fused_rows: int = 64  # "packed"/"int8" decode steps up to this many rows run every block in one kernel call
    fused_fbgemm_rows: int = 5  # the int8 fused step calls fbgemm's products from this many rows (AVX2 alone)
    greedy_head_rows: int = 4  # greedy steps up to this many rows read the LM head through its int8 screen


LIMITS = Limits()
