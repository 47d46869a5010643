"""Tortoise's autoregressive stage (tortoise-tts 3.0.0 `UnifiedVoice.inference_speech`) decoded by xattn.

    from xattn.integrations import tortoise
    with tortoise.importable():                 # transformers >= 4.5x no longer has what tortoise-tts imports
        from tortoise.api import TextToSpeech   # or: from tortoise.models.autoregressive import UnifiedVoice
    tts = TextToSpeech(...)
    tortoise.enable(tts)                        # or enable(tts.autoregressive); disable() undoes it
    tortoise.enable(tts, weights="packed")      # or so, in another weight format (see enable())

tortoise-tts 3.0.0 pins transformers 4.31: on 4.57 and 5.x it does not import (`LogitsWarper` and, on 5.x,
`transformers.utils.model_parallel_utils` are gone; `torchaudio` is imported at module level), and its
GPT2InferenceModel has no `generate` (transformers' PreTrainedModel no longer includes GenerationMixin).
`importable()` supplies those names for the import only; enable() replaces `inference_speech` on the instance, so
the candidates `TextToSpeech.tts()` ranks come from xattn, and everything else (conditioning, CLVP, diffusion,
vocoder) stays tortoise's. The codes are those of tortoise's decoding with transformers' processors, in its
order (repetition penalty, then temperature, top-k 50 by default, top-p), candidates drawn together from the
global RNG; with `kv_cache=True` tortoise's cached steps read the audio position one past the token's (its
forward takes it from the attention mask's length), and xattn reads the same positions.
Typical sampling and `input_tokens` continuations are not supported (a clear error).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator

import torch

from ..tasks.tts_adapter import PrefixConditionedGPT2
from . import torchaudio_stand_in

PROMPT_TOKEN = 1  # the id tortoise's inference_speech fills the prefix positions of generate()'s input with


@contextlib.contextmanager
def importable() -> Iterator[None]:
    """Import tortoise-tts inside this block on transformers 4.57 or 5.x.

    For the block only: `transformers.LogitsWarper` (tortoise's TypicalLogitsWarper subclasses it; transformers'
    LogitsProcessor, which replaced it, takes its place), `transformers.utils.model_parallel_utils` (used only by
    GPT2InferenceModel.parallelize(), whose functions here raise) and torchaudio where it is not installed
    (xattn.integrations.torchaudio_stand_in). The installed packages are not edited.
    """
    import transformers.processing_utils  # noqa: F401

    # processing_utils' first import runs transformers/__init__.py again (direct_transformers_import), which puts a
    # new lazy module in sys.modules["transformers"]: done first, the name is set on the module that stays there
    transformers = sys.modules["transformers"]
    added_warper = not hasattr(transformers, "LogitsWarper")
    if added_warper:
        transformers.LogitsWarper = transformers.LogitsProcessor
    parallel = "transformers.utils.model_parallel_utils"
    added_parallel = parallel not in sys.modules and not _has_module(parallel)
    if added_parallel:
        sys.modules[parallel] = _model_parallel_stand_in(parallel)
    try:
        with torchaudio_stand_in():
            yield
    finally:
        if added_warper:
            del transformers.LogitsWarper
        if added_parallel:
            sys.modules.pop(parallel, None)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _model_parallel_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "xattn's stand-in: transformers >= 5 removed model parallelism")

    def unsupported(*args, **kwargs):
        raise RuntimeError("GPT2InferenceModel.parallelize() needs transformers' model_parallel_utils, removed in "
                           "transformers 5; put the model on one device")

    module.get_device_map = module.assert_device_map = unsupported
    return module


def _unified_voice(model):
    voice = getattr(model, "autoregressive", model)  # a TextToSpeech, or the UnifiedVoice itself
    if not hasattr(voice, "inference_speech"):
        raise ValueError(f"expected tortoise's TextToSpeech or UnifiedVoice, got {type(model).__name__}")
    if getattr(voice, "inference_model", None) is None:
        raise ValueError("the UnifiedVoice is not ready for inference: call post_init_gpt2_config() first "
                         "(TextToSpeech does it when it loads the model)")
    return voice


def enable(model, weights: str = "exact") -> None:
    """Route the UnifiedVoice's `inference_speech` through xattn (model: TextToSpeech or UnifiedVoice, its
    inference model set up by post_init_gpt2_config, which TextToSpeech calls).

    weights: the GPT's weight format, as `xattn.load(..., weights=)` takes it: "exact" (its own tensors),
    "packed" (fp32 copies: logits differ by rounding only), "bf16" or "int8" (faster, codes may differ); CPU only
    but for "exact". Copies are made here, once: enable() again after changing the weights."""
    voice = _unified_voice(model)
    adapter = decoder(voice, weights)
    # shadows the method on this instance
    voice.inference_speech = functools.partial(inference_speech, voice, adapter=adapter)


def disable(model) -> None:
    """Undo enable(): tortoise's own inference_speech again."""
    getattr(model, "autoregressive", model).__dict__.pop("inference_speech", None)


def is_enabled(model) -> bool:
    return "inference_speech" in getattr(model, "autoregressive", model).__dict__


def decoder(voice, weights: str = "exact") -> PrefixConditionedGPT2:
    """xattn's decoder over a UnifiedVoice's own weights (with weights="exact", nothing copied), reading positions
    as its inference model does."""
    table = voice.mel_pos_embedding.emb
    if getattr(voice.inference_model, "kv_cache", False):  # step t > 0 reads position t + 1 (see the docstring)
        def position_embedding(positions: torch.Tensor) -> torch.Tensor:
            return table(positions + (positions > 0).long())
    else:
        position_embedding = table
    return PrefixConditionedGPT2(voice.gpt, voice.mel_embedding, position_embedding, voice.mel_head,
                                 final_norm=voice.final_norm, prompt_token=PROMPT_TOKEN, weights=weights)


def inference_speech(voice, speech_conditioning_latent: torch.Tensor, text_inputs: torch.Tensor,
                     input_tokens: torch.Tensor | None = None, num_return_sequences: int = 1,
                     max_generate_length: int | None = None, typical_sampling: bool = False, typical_mass: float = 0.9,
                     *, adapter: PrefixConditionedGPT2 | None = None, **hf_generate_kwargs) -> torch.Tensor:
    """`UnifiedVoice.inference_speech`: audio codes [batch * num_return_sequences, T], stop-token padded.
    adapter: the decoder enable() built (default: decoder(voice), exact)."""
    if input_tokens is not None:
        raise ValueError("xattn's Tortoise decoding does not continue input_tokens: pass input_tokens=None")
    if typical_sampling:
        raise ValueError("xattn's Tortoise decoding does not do typical sampling: pass typical_sampling=False")
    voice.compute_embeddings(speech_conditioning_latent, text_inputs)  # tortoise's prefix, kept on inference_model
    max_new = voice.max_mel_tokens - 1 if max_generate_length is None else max_generate_length
    kwargs = {k: v for k, v in hf_generate_kwargs.items() if k not in ("output_attentions", "output_hidden_states")}
    if kwargs.get("num_beams", 1) > 1 and kwargs.get("do_sample"):
        raise ValueError("xattn does not do beam sampling: with num_beams > 1 pass do_sample=False")
    codes = (adapter or decoder(voice)).generate(voice.inference_model.cached_mel_emb,
                                                 start_token=voice.start_mel_token, stop_token=voice.stop_mel_token,
                                                 max_new_tokens=max_new, num_return_sequences=num_return_sequences,
                                                 **kwargs)
    return codes.sequences
