"""Speech as real files bring it, made on the fly from clean training clips: silence before and after, a noise
floor, additive white noise, the 8 kHz telephone band and gain.

espeak-ng writes clean, tightly cut, full-band speech at one loudness; real recordings start and end with
silence, carry noise, may come through a telephone and are louder or quieter. Training with `--augment` draws a
fresh `Corruption` of each clip at every step (`corrupt`), so no two epochs hear a clip alike;
recipes/eval_recognizer_conditions.py builds its test conditions from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TELEPHONE_RATE = 8_000  # telephone audio: nothing above 4 kHz survives

# what `draw_corruption` draws (a quarter of the clips stay clean; the rest get each kind with its probability)
CLEAN_SHARE = 0.25
PADDING = (0.7, 0.0, 1.0)  # (probability, shortest, longest): seconds of silence before, and again after
FLOOR = (0.4, -60.0, -40.0)  # (probability, dBFS range): a faint noise floor under the whole clip
NOISE = (0.5, 10.0, 40.0)  # (probability, SNR range in dB): white noise relative to the speech's power
TELEPHONE = 0.3  # probability of the 8 kHz band
GAIN = (0.5, -20.0, 6.0)  # (probability, dB range), then clipped to [-1, 1]


@dataclass(frozen=True)
class Corruption:
    """What happens to one clip, in this order; the default changes nothing."""
    lead_seconds: float = 0.0  # digital zeros added before the speech
    trail_seconds: float = 0.0  # and after it
    floor_dbfs: float | None = None  # white noise of this RMS (dB below full scale) under the whole padded clip
    snr_db: float | None = None  # white noise this many dB below the clip's own power (as given, before padding)
    telephone: bool = False  # down to 8 kHz and back up: the band above 4 kHz is gone
    gain_db: float = 0.0  # louder or quieter, clipped to [-1, 1]


def draw_corruption(rng: np.random.Generator) -> Corruption:
    """A random corruption: clean with probability CLEAN_SHARE, else each kind with its own probability."""
    if rng.random() < CLEAN_SHARE:
        return Corruption()
    lead = trail = 0.0
    if rng.random() < PADDING[0]:
        lead, trail = rng.uniform(PADDING[1], PADDING[2], size=2)
    floor = rng.uniform(*FLOOR[1:]) if rng.random() < FLOOR[0] else None
    snr = rng.uniform(*NOISE[1:]) if rng.random() < NOISE[0] else None
    telephone = bool(rng.random() < TELEPHONE)
    gain = rng.uniform(*GAIN[1:]) if rng.random() < GAIN[0] else 0.0
    return Corruption(float(lead), float(trail), None if floor is None else float(floor),
                      None if snr is None else float(snr), telephone, float(gain))


def corrupt(waveform: np.ndarray, sampling_rate: int, rng: np.random.Generator) -> np.ndarray:
    """A freshly corrupted copy of a mono float32 clip [samples] at `sampling_rate` (training's `--augment`)."""
    return apply_corruption(waveform, sampling_rate, draw_corruption(rng), rng)


def apply_corruption(waveform: np.ndarray, sampling_rate: int, corruption: Corruption,
                     rng: np.random.Generator) -> np.ndarray:
    """The clip [samples] with `corruption` applied (noise drawn from rng), mono float32 [samples']."""
    if corruption == Corruption():
        return waveform
    speech_power = float(np.mean(np.square(waveform, dtype=np.float64)))
    out = pad_silence(waveform, sampling_rate, corruption.lead_seconds, corruption.trail_seconds)
    if corruption.floor_dbfs is not None:
        out = out + white_noise(len(out), corruption.floor_dbfs, rng)
    if corruption.snr_db is not None and speech_power > 0:  # a silent clip has no level to be below
        out = out + white_noise(len(out), 10 * np.log10(speech_power) - corruption.snr_db, rng)
    if corruption.telephone:
        out = telephone_band(out, sampling_rate)
    if corruption.gain_db:
        out = out * np.float32(10 ** (corruption.gain_db / 20))
    return np.clip(out, -1.0, 1.0).astype(np.float32, copy=False)


def pad_silence(waveform: np.ndarray, sampling_rate: int, lead_seconds: float, trail_seconds: float) -> np.ndarray:
    """Digital zeros before and after [samples]."""
    lead, trail = round(lead_seconds * sampling_rate), round(trail_seconds * sampling_rate)
    if not lead and not trail:
        return waveform
    return np.concatenate([np.zeros(lead, np.float32), waveform.astype(np.float32, copy=False),
                           np.zeros(trail, np.float32)])


def white_noise(length: int, rms_dbfs: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian white noise [length] of RMS `rms_dbfs` dB relative to full scale (0 dBFS: RMS 1), float32."""
    return rng.standard_normal(length, dtype=np.float32) * np.float32(10 ** (rms_dbfs / 20))


def telephone_band(waveform: np.ndarray, sampling_rate: int) -> np.ndarray:
    """The clip resampled to 8 kHz and back (scipy's polyphase filter, as xattn's loader resamples), cut or padded
    back to its own length: what a telephone-band recording sounds like at the model's rate."""
    from ..tasks.audio import to_mono

    if sampling_rate <= TELEPHONE_RATE:
        return waveform
    narrow = to_mono(to_mono(waveform, sampling_rate, TELEPHONE_RATE), TELEPHONE_RATE, sampling_rate)
    if len(narrow) >= len(waveform):
        return narrow[: len(waveform)]
    return np.concatenate([narrow, np.zeros(len(waveform) - len(narrow), np.float32)])
