"""The LM head's cross-entropy a few rows at a time, for training with gradient checkpointing.

transformers' encoder-decoder models compute the loss from the whole logits tensor [tokens, vocab] (GPT-2: 50257
floats a token), and autograd keeps it, its log-softmax and, in backward, their gradients: with the layers
checkpointed these are the largest activations left. Here the model's forward runs with its LM head standing aside
(the decoder's final hidden states come out instead of logits), and the loss is summed over chunks of rows, each
chunk's logits made again in backward by the loss's own autograd function: at most one chunk's logits exist at a
time, and the head's weight gradient goes into its .grad chunk by chunk rather than waiting in autograd. The
loss is the model's own (the mean over labels that are not -100), its gradients equal within float rounding.

`full_loss` is the same loss without chunks, from the model's logits. The training loop uses it rather than the
model's `.loss`: VisionEncoderDecoderModel of transformers 4.50-4.57 shifts the labels twice (its loss_function is
ForCausalLMLoss, which shifts again; transformers #40111, fixed after 4.57 by #40863), so a captioner fine-tuned
there would learn to predict the token after next.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.function import once_differentiable

IGNORE = -100  # transformers' (and CrossEntropyLoss's) ignored label
CHUNK_ROWS = 256  # label rows per chunk: 256 x 50257 fp32 logits is 49 MB


def takes_shifted_labels(model: nn.Module) -> bool:
    """An encoder-decoder model of transformers' that makes decoder_input_ids by shifting labels right."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False) and hasattr(model, "decoder")
                and getattr(config, "decoder_start_token_id", None) is not None
                and getattr(config, "pad_token_id", None) is not None)


def applies(model: nn.Module, distributed: bool = False) -> bool:
    """An encoder-decoder model of transformers' (VisionEncoderDecoderModel, SpeechEncoderDecoderModel,
    EncoderDecoderModel) whose decoder has an nn.Linear LM head and takes decoder_input_ids from shifted labels.
    Under DDP only with the head tied to the input embeddings: DDP expects every weight's gradient from its
    forward, and a head used only outside it would not be averaged."""
    head = getattr(getattr(model, "decoder", None), "lm_head", None)
    if not (takes_shifted_labels(model) and isinstance(head, nn.Linear)):
        return False
    return not distributed or head.weight is model.decoder.get_input_embeddings().weight


class _HiddenOut(nn.Module):
    """Stands in for the LM head during a forward: returns its input (the decoder's final hidden states)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def _head_aside(model: nn.Module):
    decoder = model.decoder
    head = decoder.lm_head
    decoder.lm_head = _HiddenOut()
    try:
        yield head
    finally:
        decoder.lm_head = head


def shift_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """decoder_input_ids from labels as transformers' encoder-decoder models make them: the start token first,
    each label moved one right, ignored labels as padding."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == IGNORE, pad_token_id)


class _LinearCrossEntropy(torch.autograd.Function):
    """The sum over rows of cross_entropy(hidden @ weight.T + bias, labels), logits made chunk_rows rows at a time
    in forward and made again in backward, so at most one chunk's logits exist at a time.

    The weight's gradient is added into `weight.grad` chunk by chunk, as `.backward()` would leave it, instead of
    going back through autograd: GPT-2's LM head is tied to the input embeddings, and autograd holds a tied weight's
    first gradient (vocab x hidden: 147 MB for GPT-2 small) in a buffer until the embedding's arrives, at the very
    end of backward, through every layer's recomputation. So this loss is for `.backward()` (the training loop), not
    for `torch.autograd.grad`, and tensor hooks on the weight do not see its share."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_rows):
        cast = _autocast_dtype(hidden.device.type)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.numel(), chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = _logits(hidden[rows], weight, bias, cast)
            total += nn.functional.cross_entropy(logits, labels[rows], ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk_rows, ctx.cast = chunk_rows, cast
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, labels = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None
        # a leaf (an nn.Parameter) takes its share in .grad at once; anything else gets it back through autograd
        into = None
        if wants_weight:
            if weight.is_leaf and weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            into = weight.grad if weight.is_leaf else torch.zeros_like(weight)
        for start in range(0, labels.numel(), ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            chunk, targets = hidden[rows], labels[rows]
            grad = _logits(chunk, weight, bias, ctx.cast)
            grad.sub_(grad.logsumexp(-1, keepdim=True)).exp_()  # softmax, in place: one chunk-sized tensor
            kept = targets != IGNORE
            grad[kept.nonzero().squeeze(1), targets[kept]] -= 1
            grad[~kept] = 0
            grad.mul_(grad_total)
            dtype = ctx.cast or weight.dtype
            if wants_hidden:
                grad_hidden[rows] = grad.to(dtype) @ weight.to(dtype)
            if into is not None:
                if dtype == into.dtype and chunk.dtype == into.dtype:
                    into.addmm_(grad.t(), chunk)
                else:
                    into.add_(grad.to(dtype).t() @ chunk.to(dtype))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        grad_weight = into if into is not None and not weight.is_leaf else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on this device, None when it is off: backward runs without the
    forward's autocast state, so the forward's is kept for it."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            cast: torch.dtype | None) -> torch.Tensor:
    if cast is not None:  # as autocast's linear would: inputs cast, the product in that dtype
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    with torch.autocast(hidden.device.type, enabled=False):
        return nn.functional.linear(hidden, weight, bias).float()


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor,
                          chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """mean over non-ignored labels of cross_entropy(head(hidden), labels), chunk_rows rows at a time (see
    _LinearCrossEntropy: the head's weight gradient goes into its .grad during backward)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = _LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk_rows)
    return total / (labels != IGNORE).sum()  # 0/0 = nan when every label is ignored, as CrossEntropyLoss gives


def _decoder_input_ids(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    config = getattr(model, "module", model).config  # through a DDP wrapper
    return shift_right(labels, config.pad_token_id, config.decoder_start_token_id)


def full_loss(model: nn.Module, labels: torch.Tensor, **inputs) -> torch.Tensor:
    """The mean cross-entropy of the model's logits against `labels` (not -100), decoder_input_ids made from the
    labels shifted right: the loss of transformers 5.x. `model` may be a DDP wrapper."""
    logits = model(**inputs, decoder_input_ids=_decoder_input_ids(model, labels)).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=IGNORE)


def loss(model: nn.Module, labels: torch.Tensor, chunk_rows: int = CHUNK_ROWS, **inputs) -> torch.Tensor:
    """full_loss computed with chunked_cross_entropy; `model` may be a DDP wrapper around the encoder-decoder model
    (its forward runs, so its gradient hooks do)."""
    decoder_input_ids = _decoder_input_ids(model, labels)
    with _head_aside(getattr(model, "module", model)) as head:
        hidden = model(**inputs, decoder_input_ids=decoder_input_ids).logits
    return chunked_cross_entropy(hidden, head, labels, chunk_rows)
