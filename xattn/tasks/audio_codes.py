"""Discrete audio codes for the TTS: log-mel frames <-> nearest centroids of a codebook learned with k-means,
and codes -> waveform: each centroid's magnitude spectrum (librosa's mel inversion, once per codebook), then
Griffin-Lim chunk by chunk, each chunk's phase carried on from the one before.

Like Tortoise's mel codes, one code stands for a short stretch of spectrogram (here one 20 ms frame); the
GPT-2 decoder generates them, the codebook turns them back into a spectrogram and Griffin-Lim into sound.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 1024
HOP = 320  # 20 ms: 50 codes per second
N_MELS = 80
FLOOR = 1e-5  # log-mel floor (silence)
CHUNK = 50  # codes vocoded together (1 s): streaming yields audio in these pieces
CONTEXT = 8  # frames before a chunk resynthesized with it, their phase held at the previous chunk's
LOOKAHEAD = 4  # codes after a chunk synthesized with it (streaming waits for them), so its end is no edge
FADE = 2 * HOP  # samples over which a chunk fades in from the previous chunk's look-ahead audio
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


def griffin_lim(magnitude: np.ndarray, angles: np.ndarray, held: int = 0, n_iter: int = 32,
               momentum: float = 0.99) -> tuple[np.ndarray, np.ndarray]:
    """Fast Griffin-Lim (librosa's momentum form) on [1 + N_FFT/2, frames] magnitudes from the unit phases
    `angles`; the first `held` frames keep their given phase throughout (librosa cannot hold a phase, which is
    what joins streamed chunks). Returns [frames * HOP] samples (centred frames) and the final phases."""
    import torch

    window = torch.hann_window(N_FFT, dtype=torch.float64)
    length = magnitude.shape[1] * HOP
    magnitude = torch.from_numpy(magnitude)
    angles = torch.from_numpy(angles).clone()
    fixed = angles[:, :held].clone()
    previous = torch.zeros_like(angles)

    def inverse(phases):
        return torch.istft(magnitude * phases, N_FFT, hop_length=HOP, window=window, center=True, length=length)

    for _ in range(n_iter):
        rebuilt = torch.stft(inverse(angles), N_FFT, hop_length=HOP, window=window, center=True,
                             pad_mode="constant", return_complex=True)[:, : angles.shape[1]]
        angles = rebuilt - previous * (momentum / (1 + momentum))
        angles = angles / (angles.abs() + 1e-16)
        angles[:, :held] = fixed
        previous = rebuilt
    return inverse(angles).numpy().astype(np.float32), angles.numpy()


@functools.cache
def _mel_filters() -> np.ndarray:
    import librosa

    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=N_MELS)  # [N_MELS, 1 + N_FFT/2]


class Codebook:
    """K centroids of log-mel frames; code k means "the frame looks like centroid k"."""

    def __init__(self, centroids: np.ndarray, magnitudes: np.ndarray | None = None):
        self.centroids = np.asarray(centroids, dtype=np.float32)  # [K, N_MELS]
        if magnitudes is not None:  # saved with the checkpoint: no mel inversion at start-up
            self.__dict__["magnitudes"] = np.asarray(magnitudes, dtype=np.float64)

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

    @functools.cached_property
    def magnitudes(self) -> np.ndarray:
        """[K, 1 + N_FFT/2] linear magnitude spectrum of each centroid: librosa's mel inversion (non-negative
        least squares), solved once per codebook rather than for every frame spoken."""
        import librosa

        power = np.exp(self.centroids.T.astype(np.float64))
        blocks = [librosa.feature.inverse.mel_to_stft(power[:, i : i + 64], sr=SAMPLE_RATE, n_fft=N_FFT, power=2.0)
                  for i in range(0, power.shape[1], 64)]  # librosa's solver converges far faster on small blocks
        return np.concatenate(blocks, axis=1).T

    def vocode(self, codes) -> np.ndarray:
        """Codes -> [len(codes) * HOP] samples: the concatenated pieces of vocode_stream()."""
        pieces = list(self.vocode_stream(np.asarray(codes, dtype=np.int64).tolist()))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def vocode_stream(self, codes: Iterable[int]) -> Iterator[np.ndarray]:
        """Audio of exactly CHUNK * HOP samples per CHUNK codes (the last piece: what is left), each yielded as
        soon as LOOKAHEAD more codes exist or the codes end. A chunk is synthesized with CONTEXT frames before it
        (their phase held at what the previous chunk gave them) and LOOKAHEAD after it, and fades in over FADE
        samples from the previous chunk's look-ahead audio, so chunks join without a click."""
        seen: list[int] = []
        start, carried = 0, None
        for code in codes:
            seen.append(int(code))
            if len(seen) >= start + CHUNK + LOOKAHEAD:
                piece, carried = self._chunk(seen, start, start + CHUNK, carried)
                yield piece
                start += CHUNK
        while start < len(seen):
            end = min(start + CHUNK, len(seen))
            piece, carried = self._chunk(seen, start, end, carried)
            yield piece
            start = end

    def _chunk(self, codes: list[int], start: int, end: int, carried):
        first = start - CONTEXT if carried is not None else start
        last = min(len(codes), end + LOOKAHEAD)
        magnitude = self.magnitudes[np.asarray(codes[first:last], dtype=np.int64)].T
        rng = np.random.default_rng(start)  # the same phase guess whether streamed or not
        angles = np.exp(2j * np.pi * rng.random(magnitude.shape))
        held = 0
        if carried is not None:
            angles[:, :CONTEXT], held = carried[0], CONTEXT
        audio, phases = griffin_lim(magnitude, angles, held=held)
        piece = audio[(start - first) * HOP : (end - first) * HOP].copy()
        if carried is not None:
            fade = min(len(carried[1]), len(piece))
            ramp = (np.arange(fade, dtype=np.float32) + 0.5) / fade
            piece[:fade] = carried[1][:fade] * (1 - ramp) + piece[:fade] * ramp
        after = (end - first) * HOP
        return piece, (phases[:, end - first - CONTEXT : end - first], audio[after : after + FADE])

    def save_pretrained(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        np.savez(os.path.join(directory, CODEBOOK_FILE), centroids=self.centroids,
                 magnitudes=self.magnitudes.astype(np.float32))
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
                magnitudes = data["magnitudes"] if "magnitudes" in data.files else None
        except Exception as error:  # a corrupt .npz raises zipfile, KeyError, ValueError or OSError errors
            raise ValueError(f"{path}: not a readable codebook ({type(error).__name__}: {error})") from None
        if centroids.ndim != 2 or centroids.shape[1] != N_MELS or not np.issubdtype(centroids.dtype, np.floating) \
                or not np.isfinite(centroids).all() or len(centroids) < 1:
            raise ValueError(f"{path}: the codebook must be finite floats of shape [codes, {N_MELS}], got "
                             f"{centroids.dtype} {centroids.shape}")
        if magnitudes is not None and (magnitudes.shape != (len(centroids), 1 + N_FFT // 2)
                                       or not np.issubdtype(magnitudes.dtype, np.floating)
                                       or not np.isfinite(magnitudes).all() or (magnitudes < 0).any()):
            raise ValueError(f"{path}: the magnitudes must be finite non-negative floats of shape "
                             f"[{len(centroids)}, {1 + N_FFT // 2}], got {magnitudes.dtype} {magnitudes.shape}")
        return cls(centroids, magnitudes)


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
