"""Audio files -> mono float32 waveforms at the model's sample rate -> the model's own input features.

Reading is soundfile's (wav, flac, ogg, mp3, ...; no torchaudio or torchcodec), resampling is scipy's
polyphase filter, features are the checkpoint's transformers feature extractor.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import numpy as np
import torch


def load_audio(path: str, sampling_rate: int = 16_000, max_seconds: float | None = None) -> np.ndarray:
    """Any soundfile-readable file, any sample rate and channel count, as mono float32 at `sampling_rate`.
    ValueError naming the file for a missing, unreadable, empty or non-finite file, and for one longer than
    max_seconds (checked from the header before reading, where the format gives the length)."""
    import soundfile

    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    if max_seconds is not None:
        with _readable(path):
            info = soundfile.info(path)
        if info.samplerate > 0:
            _refuse_longer(path, info.frames / info.samplerate, max_seconds)
    with _readable(path):
        samples, rate = soundfile.read(path, dtype="float32", always_2d=True)  # [frames, channels]
    if max_seconds is not None:  # formats whose header had no length
        _refuse_longer(path, len(samples) / rate, max_seconds)
    try:
        return to_mono(samples, rate, sampling_rate)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


@contextlib.contextmanager
def _readable(path: str) -> Iterator[None]:
    """soundfile's errors for a bad file (LibsndfileError, RuntimeError, TypeError, ValueError...) as one line."""
    try:
        yield
    except Exception as error:
        raise ValueError(f"{path}: not a readable audio file ({type(error).__name__}: {error})") from None


def _refuse_longer(path: str, seconds: float, max_seconds: float) -> None:
    if seconds > max_seconds:
        raise ValueError(f"{path}: {seconds:.1f} s of audio; this model transcribes at most {max_seconds:g} s (split "
                         "it, or raise --max-seconds)")


def to_mono(samples: np.ndarray, rate: int, sampling_rate: int = 16_000) -> np.ndarray:
    """[frames] or [frames, channels] at `rate` -> mono float32 [frames'] at `sampling_rate`."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if samples.ndim != 1:
        raise ValueError(f"audio must be [frames] or [frames, channels], got shape {samples.shape}")
    if samples.size == 0:
        raise ValueError("the audio has no samples")
    if not np.isfinite(samples).all():
        raise ValueError("the audio contains NaN or infinite samples")
    if rate != sampling_rate:
        from scipy.signal import resample_poly

        g = math.gcd(int(rate), int(sampling_rate))
        samples = resample_poly(samples, sampling_rate // g, int(rate) // g).astype(np.float32)
    return samples


def input_features(feature_extractor, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Waveforms (at the extractor's rate) -> the encoder's inputs, padded, with an attention mask."""
    extra = {}
    if getattr(feature_extractor, "stride", None):  # frames stacked `stride` at a time (SeamlessM4T, w2v-BERT):
        extra["pad_to_multiple_of"] = feature_extractor.stride  # no frame dropped, so a row's frames never
        # depend on the rest of the batch
    features = feature_extractor(waveforms, sampling_rate=feature_extractor.sampling_rate, padding=True,
                                 return_attention_mask=True, return_tensors="pt", **extra)
    return {k: v for k, v in features.items() if k in ("input_values", "input_features", "attention_mask")}
