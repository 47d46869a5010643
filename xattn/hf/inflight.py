"""In-flight batching over an XattnModel: `model.inflight(max_rows)` is xattn.inflight's Scheduler with the model's
encoder and avg_logprob scoring; `model.request(...)` turns generate()'s own arguments for one input into a request
for it, checked as generate checks them."""

from __future__ import annotations

from functools import partial

import torch

from ..generate import GenerationOptions
from ..inflight import Request, Scheduler
from .model import XattnModel, _check_tensor
from .scores import average_logprobs


def scheduler(model: XattnModel, max_rows: int = 16, encode_together: bool = True) -> Scheduler:
    return Scheduler(model.decoder, max_rows, encode=partial(_encode, model),
                     score=partial(average_logprobs, model.decoder), encode_together=encode_together)


def request(model: XattnModel, inputs: torch.Tensor | None = None, **kwargs) -> Request:
    kwargs = dict(kwargs)
    prompt, encoder_inputs, cache_in = model._take_inputs(inputs, kwargs)
    if cache_in is not None:
        raise ValueError("an in-flight request starts from its input: pass no cache")
    encoder = model._encoder_args(encoder_inputs, kwargs)
    if not encoder.inputs and encoder.states is None and model.is_encoder_decoder:
        raise ValueError(f"pass {model._main_input_name()} (or encoder_hidden_states) to generate from")
    given = [t for t in [*encoder.inputs.values(), encoder.states, prompt] if t is not None]
    if any(t.shape[0] != 1 for t in given):
        raise ValueError("an in-flight request is one input: pass a batch of one (a request per input)")
    prompt = model._prompt(prompt, 1, kwargs)
    opts = GenerationOptions.from_kwargs(model.generation_config, prompt.shape[1], **kwargs)
    model._check_ids(prompt, opts)
    model._check_room(prompt.shape[1], opts)
    if encoder.inputs:
        (name, values), = encoder.inputs.items()
        _check_tensor(name, values, model.decoder)
        mask = encoder.attention_mask
        # inputs of one shape are encoded in one call where the encoder computes each row on its own: the model's
        # own, or xattn's ViT kernel on AMX tiles (rows_independent); one in another format may quantize or block
        # rows together, so it encodes each alone
        own = model.hf_model is not None and model.encoder is getattr(model.hf_model, "encoder", None)
        together = own or getattr(model.encoder, "rows_independent", False)
        key = (name, tuple(values.shape), None if mask is None else tuple(mask.shape)) if together else None
        return Request(opts, prompt[0], encoder_input=(name, values, mask), encoder_key=key)
    mask = encoder.states_mask
    return Request(opts, prompt[0], encoder_hidden_states=None if encoder.states is None else encoder.states[0],
                   encoder_attention_mask=None if mask is None else mask[0])


def _encode(model: XattnModel, inputs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One encoder call over (name, values [1, ...], attention_mask [1, ...] or None) inputs of one shape."""
    masks = [mask for _, _, mask in inputs]
    return model.encode(None if masks[0] is None else torch.cat(masks),
                        **{inputs[0][0]: torch.cat([values for _, values, _ in inputs])})
