"""The LM head's cross-entropy a few rows at a time, for training with gradient checkpointing.

transformers' encoder-decoder models compute the loss from the whole logits tensor [tokens, vocab] (GPT-2: 50257
floats a token), and autograd keeps it, its log-softmax and, in backward, their gradients: with the layers
checkpointed these are the largest activations left. Here the model's forward runs with its LM head standing aside
(the decoder's final hidden states come out instead of logits), and the loss is summed over chunks of rows, each
chunk's logits recomputed in backward (torch.utils.checkpoint): at most one chunk's logits exist at a time. The
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
from torch.utils.checkpoint import checkpoint

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


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    logits = nn.functional.linear(hidden, weight, bias)
    return nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor,
                          chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """mean over non-ignored labels of cross_entropy(head(hidden), labels), chunk_rows rows at a time."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, labels.numel(), chunk_rows):
        rows = slice(start, start + chunk_rows)
        total = total + checkpoint(_chunk_loss_sum, hidden[rows], head.weight, head.bias, labels[rows],
                                   use_reentrant=False)
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
