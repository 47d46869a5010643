"""Loading checkpoints through transformers without ever running code shipped with them.

A checkpoint can ask transformers to import its own Python files (`auto_map` in config.json,
tokenizer_config.json, preprocessor_config.json, ...). Every loader xattn calls goes through here: the JSON
files of a checkpoint are read first and a request for custom code is refused with one line naming the file,
before transformers sees the folder (a hub id is resolved to its cache folder first, xattn.hf.hub, and checked
the same way); every transformers loader also gets trust_remote_code=False (never the interactive "[y/N]"
prompt). `load` = resolve + these checks + from_pretrained + from_hf.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .model import XattnModel

# the files in which transformers looks for `auto_map` (custom classes) or a custom model_type
CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
                "feature_extractor_config.json", "image_processor_config.json", "video_preprocessor_config.json",
                "generation_config.json")
SUPPORTED_MODEL_TYPES = ("vision-encoder-decoder", "speech-encoder-decoder", "encoder-decoder", "gpt2")


def refuse_custom_code(path: str) -> None:
    """ValueError naming the file if a local checkpoint folder asks for code of its own (or is unreadable)."""
    if not os.path.isdir(path):
        return
    for name in CONFIG_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"{file}: not a readable JSON file ({_first_line(error)})") from None
        try:
            custom = _has_key(content, "auto_map")
        except RecursionError:  # parsed, but nested too deep to walk
            raise ValueError(f"{file}: nested too deeply to be a checkpoint's settings") from None
        if custom:
            raise ValueError(f"{file}: the checkpoint asks to run its own Python code (auto_map); xattn never "
                             "runs code shipped with a checkpoint")


def checkpoint_model_type(path: str) -> str:
    """config.json's model_type of a local checkpoint, read as JSON (transformers would import a custom type's
    code to build its config); ValueError for a missing or unsupported one."""
    refuse_custom_code(path)
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no config.json (not a transformers checkpoint)")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{file}: model_type {model_type!r} is not supported; xattn loads "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    return model_type


def load_config(path: str):
    from transformers import AutoConfig

    if os.path.isdir(path):
        checkpoint_model_type(path)
    return _call("configuration", AutoConfig.from_pretrained, path)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return _call("tokenizer", AutoTokenizer.from_pretrained, path)


def load_image_processor(path: str):
    from transformers import AutoImageProcessor

    return _call("image processor (preprocessor_config.json)", AutoImageProcessor.from_pretrained, path)


def load_feature_extractor(path: str):
    from transformers import AutoFeatureExtractor

    return _call("feature extractor (preprocessor_config.json)", AutoFeatureExtractor.from_pretrained, path)


MAX_LAYERS = 1000  # past any real model (GPT-2 XL: 48); transformers builds what config.json asks before any weight


def load_model(model_class, path: str, **kwargs):
    """model_class.from_pretrained(path, trust_remote_code=False, **kwargs); safetensors only unless the caller
    says otherwise, in float32 unless the caller gives a dtype (hub checkpoints saved in fp16/bf16 run as the
    CLI's float32 inputs do). Corrupt weights files, weights that leave some of the model's tensors unset (which
    transformers would fill with random values) and absurd layer counts are one-line errors naming the checkpoint."""
    import torch

    kwargs.setdefault("use_safetensors", True)
    kwargs.setdefault("dtype" if _transformers_major() >= 5 else "torch_dtype", torch.float32)
    _refuse_absurd_depth(path)
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its table of missing keys: refused below in one line instead
    try:
        model, info = _call("weights", model_class.from_pretrained, path, output_loading_info=True, **kwargs)
    except ValueError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise ValueError(f"{path}: its weights' shapes do not match config.json (a damaged config.json, or another "
                         "model's weights)") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = list(info.get("missing_keys") or []) + [str(m[0] if isinstance(m, tuple) else m)
                                                      for m in info.get("mismatched_keys") or []]
    if missing:
        raise ValueError(f"{path}: its weights do not set {len(missing)} of the model's tensors (first: {missing[0]}); "
                         "the weights file and config.json do not match (a truncated or foreign checkpoint?)")
    _refuse_tokens_outside_the_vocabulary(model, path)
    return model


def _refuse_tokens_outside_the_vocabulary(model, path: str) -> None:
    """The ids generation starts and stops with, and pads finished rows with (fed back as their next input), must be
    rows of the output embeddings (else an IndexError mid-way)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return
    vocab = head.weight.shape[0]
    for where in (model.config, getattr(model, "generation_config", None)):
        for name in ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(where, name, None)
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(token, int) and not 0 <= token < vocab:
                    raise ValueError(f"{path}: {name}={token} is outside the model's vocabulary (0..{vocab - 1})")


def _refuse_absurd_depth(path: str) -> None:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return
    try:
        with open(config) as f:
            values = json.load(f)
    except (OSError, ValueError, RecursionError):
        return  # load_config's own error says what is wrong with it
    for key, value in _items(values):
        if key in ("n_layer", "num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers") and \
                isinstance(value, int) and value > MAX_LAYERS:
            raise ValueError(f"{path}: config.json asks for {key}={value}; at most {MAX_LAYERS} (a damaged config?)")


def _items(value):
    """(key, value) of every dict nested in value (a config and its encoder/decoder sub-configs)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key, inner
            yield from _items(inner)


def _call(what: str, loader, path: str, **kwargs):
    refuse_custom_code(path)
    try:
        return loader(path, trust_remote_code=False, **kwargs)
    except (ValueError, OSError, KeyError, TypeError, RuntimeError, AttributeError, ArithmeticError,
            IndexError) as error:  # a size of 0 divides by zero, an id past a table indexes out of it
        reason = _first_line(error)
        if not isinstance(error, ValueError):
            reason = f"{type(error).__name__}: {reason}"
        raise ValueError(f"{path}: cannot load the checkpoint's {what} ({reason}){_pickle_hint(what, path, kwargs)}") \
            from None
    except Exception as error:  # safetensors' SafetensorError for a corrupt weights file, and the like
        if type(error).__module__.split(".")[0] not in ("safetensors", "tokenizers", "json", "huggingface_hub"):
            raise
        raise ValueError(f"{path}: cannot load the checkpoint's {what} ({type(error).__name__}: "
                         f"{_first_line(error)})") from None


def _pickle_hint(what: str, path: str, kwargs: dict) -> str:
    if what == "weights" and kwargs.get("use_safetensors") and os.path.isdir(path) and any(
            f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path)):
        return "; it holds pickle-based weights only: pass allow_pickle=True (--allow-pickle) if you trust it"
    return ""


def _has_key(value, key: str) -> bool:
    if isinstance(value, dict):
        return key in value or any(_has_key(v, key) for v in value.values())
    if isinstance(value, list):
        return any(_has_key(v, key) for v in value)
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def load(path_or_id: str, *, revision: str | None = None, dtype: torch.dtype | None = None,
         device: str | torch.device = "cpu", allow_pickle: bool = False, weights: str = "exact",
         **from_pretrained_kwargs) -> XattnModel:
    """from_pretrained + from_hf, from a local folder or a hub id (xattn.hf.hub: the Hugging Face cache, or the hub
    unless HF_HUB_OFFLINE is set). Weights load from safetensors; pickle-based weights (pytorch_model.bin) only
    with allow_pickle=True, and then through torch.load(weights_only=True). Never remote code: a checkpoint that
    asks for its own code is refused (refuse_custom_code above)."""
    from .hub import resolve_checkpoint
    from .model import from_hf

    if from_pretrained_kwargs.pop("trust_remote_code", False):
        raise ValueError("trust_remote_code=True is not supported: xattn never runs code shipped with a checkpoint")
    from_pretrained_kwargs["use_safetensors"] = not allow_pickle or None  # None: safetensors first, else .bin
    path = resolve_checkpoint(path_or_id, revision, allow_pickle)
    model_class = _model_class(load_config(path))
    if dtype is not None:
        from_pretrained_kwargs["dtype" if _transformers_major() >= 5 else "torch_dtype"] = dtype
    model = load_model(model_class, path, **from_pretrained_kwargs)
    return from_hf(model.to(device), weights=weights)


def _model_class(config):
    import transformers

    names = {
        "vision-encoder-decoder": "VisionEncoderDecoderModel",
        "speech-encoder-decoder": "SpeechEncoderDecoderModel",
        "gpt2": "GPT2LMHeadModel",
    }
    if config.model_type not in names:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; xattn loads {sorted(names)} checkpoints"
        )
    return getattr(transformers, names[config.model_type])


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])
