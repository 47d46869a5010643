"""coqui-tts XTTS with its GPT decoded by xattn.

    from xattn.integrations import torchaudio_stand_in, xtts
    with torchaudio_stand_in():            # only where torchaudio is not installed
        from TTS.tts.models.xtts import Xtts
    model = Xtts.init_from_config(config); model.load_checkpoint(config, checkpoint_dir=..., eval=True)
    xtts.enable(model)                     # model.inference() / inference_stream() now decode through xattn
    xtts.enable(model, weights="int8")     # or so, in another weight format (see enable())
    xtts.disable(model)                    # back to coqui's own decoding

Only the audio-token decoding changes (`GPT.generate`, behind `inference()`, and `GPT.get_generator`, behind
`inference_stream()`): coqui's own code still builds the prefix (conditioning latents + text embeddings,
`GPT.compute_embeddings`), recomputes the latents of `inference()` from the codes, and runs the HiFi-GAN decoder.
It works on transformers 5.x, where coqui-tts 0.28's own GPT2InferenceModel receives the cache under a name it
does not read, and gives the tokens coqui's decoding gives on transformers 4.57 (tests/test_integration_xtts.py):
- generate(): transformers' greedy, sampling and beam search over the ids `[1] * P + [start]` coqui passes, so the
  repetition penalty also covers audio token 1 (PrefixConditionedGPT2's prompt_token);
- the stream: coqui's `sample_stream` always draws with torch.multinomial, with the temperature/top-k/top-p
  filters only when do_sample=True; xattn draws the same way from the same filtered distribution, one draw per
  step from the global RNG, as coqui does.
Beam search (num_beams > 1, do_sample=False): coqui's own fails with XTTS v2's real config on 4.57 too, as
transformers 4.57's beam search reshapes the scores by the GPT2Config's vocab_size, which coqui sets to max_mel_tokens
(608), not the 1026 audio tokens of XTTS v2's config.json (1024 codes, start 1024, stop 1025; the 8194 = 8192 + 2
of coqui-tts 0.28's XttsArgs and GPT are only their defaults); xattn's does not read that vocab_size (tested at a
tiny config with the same mismatch). Call enable() after loading a checkpoint: `load_checkpoint` builds a new
`model.gpt`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from ..tasks.tts_adapter import PrefixConditionedGPT2

PROMPT_TOKEN = 1  # the id coqui's GPT.compute_embeddings fills the prefix positions of generate()'s input with
_PATCHED = ("generate", "get_generator")  # GPT methods enable() shadows on the instance
_IGNORED = ("output_attentions", "output_hidden_states", "return_dict_in_generate")  # what coqui itself passes


def _xtts(model):
    """The Xtts itself, or the one inside coqui's `TTS.api.TTS` (its synthesizer's tts_model)."""
    return getattr(getattr(model, "synthesizer", None), "tts_model", model)


def enable(model, weights: str = "exact") -> None:
    """Route `model.inference()` and `model.inference_stream()`'s GPT decoding through xattn (model: a coqui-tts
    `Xtts` put in inference mode by `load_checkpoint(eval=True)` or `model.eval()`, or a `TTS.api.TTS` holding
    one).

    weights: the GPT's weight format, as `xattn.load(..., weights=)` takes it: "exact" (its own tensors: coqui's
    codes), "packed" (fp32 copies: logits differ by rounding only), "bf16" or "int8" (faster, codes may differ);
    CPU only but for "exact". Copies are made here, once: enable() again after changing the weights."""
    gpt = getattr(_xtts(model), "gpt", None)
    if gpt is None or not hasattr(gpt, "gpt_inference"):
        raise ValueError("model.gpt is not ready for inference: load the checkpoint with eval=True, or call "
                         "model.eval(), before xattn.integrations.xtts.enable(model)")
    adapter = decoder(gpt, weights)
    gpt.generate = functools.partial(generate, gpt, adapter=adapter)  # instance attributes shadow GPT's methods
    gpt.get_generator = functools.partial(get_generator, gpt, adapter=adapter)


def disable(model) -> None:
    """Undo enable(): coqui's own decoding again."""
    for name in _PATCHED:
        _xtts(model).gpt.__dict__.pop(name, None)


def is_enabled(model) -> bool:
    return all(name in _xtts(model).gpt.__dict__ for name in _PATCHED)


def decoder(gpt, weights: str = "exact") -> PrefixConditionedGPT2:
    """xattn's decoder over a coqui-tts XTTS `GPT` module's own weights (with weights="exact", nothing copied)."""
    return PrefixConditionedGPT2(gpt.gpt, gpt.mel_embedding, gpt.mel_pos_embedding.emb, gpt.mel_head,
                                 final_norm=gpt.final_norm, prompt_token=PROMPT_TOKEN, weights=weights)


def generate(gpt, cond_latents: torch.Tensor, text_inputs: torch.Tensor, *,
             adapter: PrefixConditionedGPT2 | None = None, **hf_generate_kwargs) -> torch.Tensor:
    """`GPT.generate`: audio codes [rows, T] (stop-token padded), from coqui's prefix and transformers-style
    keywords (do_sample, temperature, top_k, top_p, repetition_penalty, num_beams, length_penalty,
    num_return_sequences, ...). adapter: the decoder enable() built (default: decoder(gpt), exact)."""
    if hf_generate_kwargs.get("return_dict_in_generate"):
        raise ValueError("return_dict_in_generate is not supported by xattn's XTTS decoding: it returns the codes")
    fake_inputs = gpt.compute_embeddings(cond_latents, text_inputs)  # coqui's own prefix, kept on gpt_inference
    kwargs = _options(gpt, fake_inputs, hf_generate_kwargs)
    if kwargs.get("num_beams", 1) > 1 and kwargs.get("do_sample"):
        raise ValueError("xattn does not do beam sampling: with num_beams > 1 pass do_sample=False")
    return (adapter or decoder(gpt)).generate(gpt.gpt_inference.cached_prefix_emb, **kwargs).sequences


def get_generator(gpt, fake_inputs: torch.Tensor, *, adapter: PrefixConditionedGPT2 | None = None,
                  **hf_generate_kwargs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`GPT.get_generator`: yields (tokens [rows], latents [rows, D]) per step, drawn as coqui's stream draws them:
    always by sampling, filtered by temperature/top-k/top-p only when do_sample=True."""
    kwargs = _options(gpt, fake_inputs, hf_generate_kwargs)
    if kwargs.pop("num_beams", 1) != 1:
        raise ValueError("streaming decodes one sequence: pass num_beams=1")
    if not kwargs.get("do_sample", False):  # coqui's stream samples anyway, from the unfiltered distribution
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    for step in (adapter or decoder(gpt)).stream(gpt.gpt_inference.cached_prefix_emb, **kwargs):
        yield step.tokens, step.latents


def _options(gpt, fake_inputs: torch.Tensor, hf_generate_kwargs: dict) -> dict:
    """coqui's generate() call as PrefixConditionedGPT2 keywords: its start/stop tokens and length limit."""
    kwargs = {k: v for k, v in hf_generate_kwargs.items() if k not in _IGNORED}
    max_length = kwargs.pop("max_length", None)
    if kwargs.get("max_new_tokens") is None:  # coqui: max_length = max_gen_mel_tokens + the fake prompt
        kwargs["max_new_tokens"] = gpt.max_gen_mel_tokens if max_length is None else max_length - fake_inputs.shape[1]
    return dict(kwargs, start_token=gpt.start_audio_token, stop_token=gpt.stop_audio_token)
