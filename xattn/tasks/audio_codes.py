"""Discrete audio codes for the TTS: log-mel frames <-> nearest centroids of a codebook learned with k-means,
and codes -> waveform through librosa (mel inversion + Griffin-Lim).

Like Tortoise's mel codes, one code stands for a short stretch of spectrogram (here one 20 ms frame); the
GPT-2 decoder generates them, the codebook turns them back into a spectrogram and Griffin-Lim into sound.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 1024
HOP = 320  # 20 ms: 50 codes per second
N_MELS = 80
FLOOR = 1e-5  # log-mel floor (silence)
CHUNK = 50  # codes vocoded together (1 s): streaming yields audio in these pieces
CODEBOOK_FILE = "codebook.npz"


def log_mel(waveform: np.ndarray) -> np.ndarray:
    """[samples] at SAMPLE_RATE -> [frames, N_MELS] natural-log power mel spectrogram (librosa's mel filters and
    framing: centred, zero-padded Hann windows; the STFT itself is torch's, which is faster)."""
    import torch

    spectrum = torch.stft(torch.from_numpy(np.asarray(waveform, dtype=np.float32)), N_FFT, hop_length=HOP,
                          window=torch.hann_window(N_FFT), center=True, pad_mode="constant", return_complex=True)
    power = spectrum.abs().pow(2).numpy()  # [1 + N_FFT/2, frames]
    mel = _mel_filters() @ power
    return np.log(np.maximum(mel, FLOOR)).T.astype(np.float32)


def mel_to_waveform(frames: np.ndarray, n_iter: int = 32) -> np.ndarray:
    """[frames, N_MELS] log-mel -> [(frames - 1) * HOP] samples (centred frames): librosa's mel inversion, then
    Griffin-Lim from a fixed seed (deterministic)."""
    import librosa

    power = np.exp(frames.T.astype(np.float64))
    magnitude = librosa.feature.inverse.mel_to_stft(power, sr=SAMPLE_RATE, n_fft=N_FFT, power=2.0)
    audio = librosa.griffinlim(magnitude, n_iter=n_iter, hop_length=HOP, n_fft=N_FFT, random_state=0)
    return audio.astype(np.float32)


@functools.cache
def _mel_filters() -> np.ndarray:
    import librosa

    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=N_MELS)  # [N_MELS, 1 + N_FFT/2]


class Codebook:
    """K centroids of log-mel frames; code k means "the frame looks like centroid k"."""

    def __init__(self, centroids: np.ndarray):
        self.centroids = np.asarray(centroids, dtype=np.float32)  # [K, N_MELS]

    @property
    def size(self) -> int:
        return len(self.centroids)

    @classmethod
    def fit(cls, frames: np.ndarray, size: int = 256, seed: int = 0) -> Codebook:
        """k-means (scikit-learn's mini-batch k-means) over [N, N_MELS] log-mel frames."""
        from sklearn.cluster import MiniBatchKMeans

        kmeans = MiniBatchKMeans(n_clusters=size, random_state=seed, batch_size=4096, n_init=3, max_iter=200)
        kmeans.fit(frames)
        return cls(kmeans.cluster_centers_)

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """[T, N_MELS] -> [T] codes (nearest centroid, squared euclidean)."""
        distance = ((frames[:, None, :] - self.centroids[None]) ** 2).sum(-1)
        return distance.argmin(1)

    def decode(self, codes) -> np.ndarray:
        return self.centroids[np.asarray(codes, dtype=np.int64)]

    def vocode(self, codes) -> np.ndarray:
        """Codes -> waveform, CHUNK codes at a time, so a stream of chunks concatenates to exactly this."""
        codes = np.asarray(codes, dtype=np.int64)
        pieces = [mel_to_waveform(self.decode(codes[i : i + CHUNK])) for i in range(0, len(codes), CHUNK)]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        np.savez(os.path.join(directory, CODEBOOK_FILE), centroids=self.centroids)
        with open(os.path.join(directory, "codes_config.json"), "w") as f:
            json.dump({"sample_rate": SAMPLE_RATE, "n_fft": N_FFT, "hop_length": HOP, "n_mels": N_MELS,
                       "codebook_size": self.size, "chunk": CHUNK}, f, indent=1)

    @classmethod
    def from_pretrained(cls, directory: str) -> Codebook:
        path = os.path.join(directory, CODEBOOK_FILE)
        if not os.path.exists(path):
            raise ValueError(f"{directory}: no {CODEBOOK_FILE} (not a TTS checkpoint?)")
        try:
            with np.load(path, allow_pickle=False) as data:
                centroids = data["centroids"]
        except Exception as error:  # a corrupt .npz raises zipfile, KeyError, ValueError or OSError errors
            raise ValueError(f"{path}: not a readable codebook ({type(error).__name__}: {error})") from None
        if centroids.ndim != 2 or centroids.shape[1] != N_MELS or not np.issubdtype(centroids.dtype, np.floating) \
                or not np.isfinite(centroids).all() or len(centroids) < 1:
            raise ValueError(f"{path}: the codebook must be finite floats of shape [codes, {N_MELS}], got "
                             f"{centroids.dtype} {centroids.shape}")
        return cls(centroids)


def spectrogram_figure(frames: np.ndarray, title: str = ""):
    """[frames, mels] log-mel as a matplotlib figure (time across, frequency up); a long title wraps to the
    figure's width instead of running off its edges."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(4.0, len(frames) / 40)
    lines = textwrap.wrap(title, width=int(width * 11)) if title else []  # ~11 characters per inch at 10 pt
    fig, ax = plt.subplots(figsize=(width, 3 + 0.18 * max(0, len(lines) - 1)))
    ax.imshow(frames.T, origin="lower", aspect="auto", cmap="magma")
    ax.set_xlabel("frame (20 ms)")
    ax.set_ylabel("mel bin")
    ax.set_title("\n".join(lines), fontsize=10)
    fig.tight_layout()
    return fig


def draw_spectrogram(frames: np.ndarray, path: str, title: str = "") -> None:
    """[frames, mels] log-mel as a PNG."""
    import matplotlib.pyplot as plt

    from ..files import save_figure

    fig = spectrogram_figure(frames, title)
    save_figure(fig, path, dpi=100)
    plt.close(fig)
