"""The fast paths: weight formats for the decoder's projections, the fused decode step, the int8-screened greedy
head, the ViT encoder kernel, and xattn's C++ kernels with their build. The core (cache, decoder, generate) never
imports this package; it is entered through `accelerate` (a decoder) and `accelerate_encoder` (an encoder)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..decoder import GPT2CrossAttentionDecoder, plain_attention
from ..steps import DecoderSteps, block_convs
from . import formats, kernels
from .fused import FusedLayers
from .greedy_head import GreedyHead

KINDS = formats.KINDS
# copies project a few encoder rows at a time to cross K/V: outputs that small (4 MB) are served again from malloc's
# heap, where a whole batch's (19 MB a layer for 16 ViT-B images) is mapped and faulted in anew each time
_CROSS_BLOCK_FLOATS = 1 << 20


def accelerate(decoder: GPT2CrossAttentionDecoder, weights: str, cross_weights: str = "exact"
               ) -> GPT2CrossAttentionDecoder:
    """The same decoder (the same transformers modules) with its per-step projections in format `weights` ("exact",
    "packed", "bf16", "int8"; see xattn.fast.formats), the cross-attention K/V projection in `cross_weights`, and
    the fast paths the format allows (the fused step, the greedy head)."""
    steps = decoder_steps(decoder, weights, cross_weights)
    release_freed_memory()
    return GPT2CrossAttentionDecoder(decoder.transformer, decoder.lm_head, embed=decoder.embed_fn,
                                     head=decoder.output_fn, steps=steps)


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Making copies frees
    as much again in temporaries (fp32 views, quantized tensors), which glibc keeps mapped once its mmap threshold
    has risen: without this the process holds about a copy more than it uses."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def decoder_steps(decoder: GPT2CrossAttentionDecoder, weights: str, cross_weights: str = "exact") -> DecoderSteps:
    transformer, config = decoder.transformer, decoder.transformer.config
    for name, kind in (("weights", weights), ("cross_weights", cross_weights)):
        formats.check_kind(kind)
        if kind != "exact" and transformer.ln_f.weight.device.type != "cpu":
            device = transformer.ln_f.weight.device
            raise ValueError(f"{name}={kind!r} runs on CPU only; use {name}='exact' on {device}")
    projections = [{name: formats.conv1d(conv, weights) for name, conv in block_convs(block).items()}
                   for block in transformer.h]
    lm_head = None if decoder.lm_head is None else formats.linear(decoder.lm_head, weights)
    copies = weights != "exact"
    fused = FusedLayers.build(transformer, projections, decoder.scalings, weights, config.activation_function)
    steps = DecoderSteps(
        name=weights, cross_name=cross_weights, projections=projections,
        cross_kv=[formats.conv1d(block.crossattention.c_attn, cross_weights, bulk=True) for block in transformer.h
                  if hasattr(block, "crossattention")],
        lm_head=lm_head,
        # a decode step's query is one row: SDPA's kernel costs more than three plain ops
        attention=plain_attention if copies else DecoderSteps.attention,
        tanh_gelu=copies and config.activation_function in ("gelu_new", "gelu_pytorch_tanh"),
        # bfloat16 products run on AMX where the CPU has it, faster on the whole batch than on blocks in cache
        cross_rows=None if cross_weights in ("exact", "bf16") else _cross_rows(decoder),
        fused=fused,
        # int8 steps read cross K/V as float16 where the fused step runs (it converts them exactly as it reads)
        cross_kv_dtype=_float16_cross_kv(transformer) if weights == "int8" and fused is not None else None,
        greedy_head=None if decoder.output_fn is not None else GreedyHead.build(lm_head),
        independent_rows=formats.independent_rows(weights),
        reorder_rows=kernels.reorder_rows if kernels.available() else None,
        beam_candidates=kernels.beam_candidates if kernels.available() else None,
        argmax_rows=_argmax_rows if kernels.available() else None,
    )
    steps.rowwise = _rowwise(steps)
    return steps


def _argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """torch.argmax(scores, dim=-1): the kernel's for 2-d fp32 CPU rows, torch's for anything else."""
    if scores.dim() == 2 and scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.shape[1] > 0:
        return kernels.argmax_rows(scores.contiguous())
    return torch.argmax(scores, dim=-1)


def _float16_cross_kv(transformer: nn.Module):
    """Encoder states -> float16 for their cross K/V, or None (their own dtype) where a bound on the values reaches
    half of float16's largest: max|x| x the largest column sum of |W| + max|b| over the blocks' cross K/V projections
    (transformers' own weights; the half leaves room for rounding and an int8 copy's quantization)."""
    convs = [block.crossattention.c_attn for block in transformer.h if hasattr(block, "crossattention")]
    if not convs:
        return None
    column = max(float(c.weight.detach().abs().sum(0).max()) for c in convs)
    bias = max(float(c.bias.detach().abs().max()) for c in convs)
    limit = torch.finfo(torch.float16).max / 2

    def dtype_for(states: torch.Tensor) -> torch.dtype | None:
        largest = float(states.detach().abs().amax()) if states.numel() else 0.0
        return torch.float16 if largest * column + bias < limit else None  # False for inf and nan

    return dtype_for


def _rowwise(steps: DecoderSteps) -> DecoderSteps | None:
    """The steps with every product through xattn's kernels at any row count (each row independent of the others),
    the same copies read; None where the steps are row-independent already, or without the kernels."""
    if steps.independent_rows is None or not kernels.available():
        return None

    def rowwise(projection):
        return projection.rowwise if hasattr(projection, "rowwise") else projection

    return dataclasses.replace(
        steps, projections=[{name: rowwise(p) for name, p in proj.items()} for proj in steps.projections],
        lm_head=None if steps.lm_head is None else rowwise(steps.lm_head),
        fused=None if steps.fused is None else steps.fused.rowwise(), greedy_head=None, independent_rows=None,
        rowwise=None)


def _cross_rows(decoder: GPT2CrossAttentionDecoder):
    """Encoder rows per cross K/V projection: as many as fit _CROSS_BLOCK_FLOATS outputs, at least one."""
    return lambda positions: max(1, _CROSS_BLOCK_FLOATS // (positions * 2 * decoder.hidden_size))


def accelerate_encoder(encoder: nn.Module, kind: str) -> nn.Module:
    """The encoder with its products in format `kind`: a transformers ViTModel through xattn's kernel (xattn.fast.vit)
    where it applies, otherwise a copy with its nn.Linear layers converted."""
    from . import vit

    formats.check_kind(kind)
    if kind == "exact":
        return encoder
    converted = vit.ViTEncoder(encoder, kind) if vit.supports(encoder, kind) else formats.convert_linears(encoder, kind)
    release_freed_memory()
    return converted
