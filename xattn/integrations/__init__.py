"""Other projects' GPT-2 TTS pipelines decoding through xattn: coqui-tts XTTS (`xtts`) and Tortoise (`tortoise`).

Each integration takes the user's model object as the pipeline loads it and replaces only its autoregressive
decoding (`enable(model)` / `disable(model)`); conditioning, text processing and vocoders stay the pipeline's own.

`torchaudio_stand_in()` lets those packages import where torchaudio is not installed (on a CPU torch, PyPI's
torchaudio wheel is CUDA-linked and breaks `import transformers`): coqui-tts and tortoise-tts import it at module
level, but their GPT decoding never calls it.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch
from torch import nn


class _MelSpectrogram(nn.Module):
    """Stands in for torchaudio.transforms.MelSpectrogram where coqui-tts builds one inside a model (the HiFi-GAN
    decoder's speaker encoder): it holds the same buffers, so a real checkpoint still loads with strict=True, and
    refuses to run (computing a speaker embedding from audio needs the real torchaudio)."""

    def __init__(self, sample_rate: int = 16000, n_fft: int = 400, win_length: int | None = None, n_mels: int = 128,
                 **_):
        super().__init__()
        self.spectrogram, self.mel_scale = nn.Module(), nn.Module()
        self.spectrogram.register_buffer("window", torch.zeros(win_length or n_fft))  # torchaudio's buffer names
        self.mel_scale.register_buffer("fb", torch.zeros(n_fft // 2 + 1, n_mels))

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(_MISSING.format(what="torchaudio.transforms.MelSpectrogram"))


_MISSING = ("{what} needs torchaudio, which is not installed: xattn.integrations supplied a stand-in only so that "
            "the package imports (its GPT decoding does not use torchaudio). Install torchaudio to compute "
            "conditioning from audio, or pass precomputed conditioning latents and speaker embeddings.")


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"xattn's stand-in for {name} (not installed); see xattn.integrations")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() answers, as for a real package

    def missing(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise AttributeError(_MISSING.format(what=f"{name}.{attribute}"))

    module.__getattr__ = missing
    if name == "torchaudio":
        module.transforms = types.SimpleNamespace(MelSpectrogram=_MelSpectrogram)
    return module


@contextlib.contextmanager
def torchaudio_stand_in() -> Iterator[None]:
    """Import coqui-tts or tortoise-tts inside this block where torchaudio is missing:

        with torchaudio_stand_in():
            from TTS.tts.models.xtts import Xtts

    Where torchaudio (or torchcodec, which coqui-tts' top-level import demands on torch >= 2.9 for audio file
    reading) is not installed, a stand-in module sits in sys.modules for the duration of the block only: the
    modules imported inside keep a reference to it, nothing imported later sees it. The stand-in has just what
    those packages touch while building a model (torchaudio.transforms.MelSpectrogram, see _MelSpectrogram);
    anything else raises an error that says torchaudio is needed. Where they are installed, nothing changes.
    """
    from transformers.utils import import_utils  # settle transformers' own "is torchaudio there" answer first

    for check in ("is_torchaudio_available", "is_torchcodec_available"):
        if hasattr(import_utils, check):
            getattr(import_utils, check)()
    added = [name for name in ("torchaudio", "torchcodec")
             if name not in sys.modules and importlib.util.find_spec(name) is None]
    for name in added:
        sys.modules[name] = _stand_in(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)
