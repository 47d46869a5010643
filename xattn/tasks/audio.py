"""Audio files -> mono float32 waveforms at the model's sample rate -> the model's own input features.

Reading is soundfile's (wav, flac, ogg, mp3, ...; no torchaudio or torchcodec), resampling is scipy's (polyphase
filter, or FFT for rates without a small common ratio), features are the checkpoint's transformers feature
extractor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import torch

MAX_RATE = 768_000  # the fastest rate any recorder writes (DXD is 705.6 kHz); a faster header is a lie
_UNKNOWN_LENGTH = 2**63 - 1  # libsndfile's frame count when the header gives none (a streamed FLAC's 0)
_READ_SAMPLES = 1 << 20  # samples per read of a file whose length is unknown or large: memory follows the data
_MAX_FACTOR = 1000  # resample_poly's filter has ~20 * max(up, down) taps: past this, FFT resampling instead
_MAX_PEAK = 1e6  # 120 dB over full scale: louder float audio is scaled to a peak of 1 (see to_mono)


def load_audio(path: str, sampling_rate: int = 16_000, max_seconds: float | None = None) -> np.ndarray:
    """Any soundfile-readable file, any sample rate (1 Hz to 768 kHz) and channel count, as mono float32 at
    `sampling_rate`. ValueError naming the file for a missing, non-regular, unreadable, empty or non-finite file,
    a sample rate out of range, and one longer than max_seconds (checked from the header before reading, where the
    header gives the length; else the read stops just past max_seconds)."""
    from ..files import check_input

    check_input(path)  # a FIFO is never opened (opening one blocks)
    try:
        rate, samples = _read_file(path, max_seconds)
        return to_mono(samples, rate, sampling_rate)
    except MemoryError:  # a file that decodes or resamples past the memory there is: still one line, never a 500
        raise ValueError(f"{path}: too large to load in memory (MemoryError)") from None
    except _Refused:
        raise
    except ValueError as error:  # to_mono's
        raise ValueError(f"{path}: {error}") from None


class _Refused(ValueError):
    """load_audio's own message, already naming the file."""


def _read_file(path: str, max_seconds: float | None) -> tuple[int, np.ndarray]:
    """(rate, samples [frames, channels] float32), the rate and the length checked from the header first."""
    import soundfile

    with _readable(path):
        sound = soundfile.SoundFile(path)
    with sound:
        rate, frames = sound.samplerate, sound.frames
        if not 1 <= rate <= MAX_RATE:
            raise _Refused(f"{path}: {_rate_outside(rate)}")
        known = 0 <= frames < _UNKNOWN_LENGTH
        if not known:  # soundfile seeks back to tell() + frames read after each read (a libsndfile 1.0.25
            sound.seekable = lambda: False  # workaround), which fails without a length: read it as a stream
        if max_seconds is not None and known and frames / rate > max_seconds:
            raise _Refused(f"{path}: {frames / rate:.1f} s of audio; {_at_most(max_seconds)}")
        limit = None if max_seconds is None else math.floor(max_seconds * rate)
        with _readable(path):
            samples = _read(sound, limit)
    if limit is not None and len(samples) > limit:  # a header without the length, or lying about it
        said = f"its header said {frames / rate:.1f} s" if known else "length not in its header"
        raise _Refused(f"{path}: over {max_seconds:g} s of audio ({said}); {_at_most(max_seconds)}")
    return rate, samples


def _at_most(max_seconds: float) -> str:
    return f"this model transcribes at most {max_seconds:g} s (split it, or raise --max-seconds)"


def _rate_outside(rate) -> str:
    return f"sample rate {rate} Hz is outside 1 Hz-{MAX_RATE // 1000} kHz"


def _read(sound, limit: int | None) -> np.ndarray:
    """The file's samples [frames, channels] float32, read a block at a time until its end or past `limit` frames
    (an unknown or lying length never allocates more than the data read)."""
    block = max(1, _READ_SAMPLES // max(sound.channels, 1))
    blocks, total = [], 0
    while limit is None or total <= limit:
        data = sound.read(block, dtype="float32", always_2d=True)
        if not len(data):
            break
        blocks.append(data)
        total += len(data)
    if not blocks:
        return np.zeros((0, sound.channels), np.float32)
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


@contextlib.contextmanager
def _readable(path: str) -> Iterator[None]:
    """soundfile's errors for a bad file (LibsndfileError, RuntimeError, TypeError, ValueError...) as one line."""
    try:
        yield
    except MemoryError:
        raise
    except Exception as error:
        raise _Refused(f"{path}: not a readable audio file ({type(error).__name__}: {error})") from None


def to_mono(samples: np.ndarray, rate: int, sampling_rate: int = 16_000) -> np.ndarray:
    """[frames] or [frames, channels] at `rate` (1 Hz to 768 kHz) -> mono float32 [frames'] at `sampling_rate`.

    Mixed and resampled in float64, so float files with samples near float32's largest value cannot overflow;
    audio louder than 1e6 (120 dB over full scale, so no recording) is first scaled to a peak of 1, as the model's
    input must stay finite in float32: recognisers normalise loudness, so they hear the same audio. Resampling is
    scipy's polyphase filter where the rates' reduced ratio up/down is small (every common rate: 44.1 kHz is
    160/441), else FFT resampling, whose cost does not grow with the ratio (a coprime rate such as 44,101 Hz)."""
    samples = np.asarray(samples)
    if samples.ndim not in (1, 2):
        raise ValueError(f"audio must be [frames] or [frames, channels], got shape {samples.shape}")
    if samples.size == 0:
        raise ValueError("the audio has no samples")
    if not 1 <= rate <= MAX_RATE:
        raise ValueError(_rate_outside(rate))
    samples = samples.astype(np.float64)
    if not np.isfinite(samples).all():
        raise ValueError("the audio contains NaN or infinite samples")
    peak = np.abs(samples).max()
    if peak > _MAX_PEAK:
        samples /= peak
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    rate, sampling_rate = int(rate), int(sampling_rate)
    if rate != sampling_rate:
        g = math.gcd(rate, sampling_rate)
        up, down = sampling_rate // g, rate // g
        if max(up, down) <= _MAX_FACTOR:
            from scipy.signal import resample_poly

            samples = resample_poly(samples, up, down)
        else:
            from scipy.signal import resample

            samples = resample(samples, -(-len(samples) * up // down))  # resample_poly's length
    if not np.isfinite(samples).all():  # unreachable for finite float input at most _MAX_PEAK: a guard
        raise ValueError("the audio's samples overflow when mixed or resampled")
    return samples.astype(np.float32)


def input_features(feature_extractor, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Waveforms (at the extractor's rate) -> the encoder's inputs, padded, with an attention mask."""
    extra = {}
    if getattr(feature_extractor, "stride", None):  # frames stacked `stride` at a time (SeamlessM4T, w2v-BERT):
        extra["pad_to_multiple_of"] = feature_extractor.stride  # no frame dropped, so a row's frames never
        # depend on the rest of the batch
    features = feature_extractor(waveforms, sampling_rate=feature_extractor.sampling_rate, padding=True,
                                 return_attention_mask=True, return_tensors="pt", **extra)
    return {k: v for k, v in features.items() if k in ("input_values", "input_features", "attention_mask")}
