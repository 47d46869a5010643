"""Speech transcription: the digit recognizer's architecture, its training batches, word error rate and the
Transcriber (any SpeechEncoderDecoder checkpoint, decoding through the xattn engine, fed exactly what
transformers' ASR pipeline feeds the model)."""

from __future__ import annotations

import functools
import math
import os
import random
import warnings
import zlib
from collections.abc import Callable

import numpy as np
import torch

from . import SHIPPED_MODELS
from .audio import input_features, load_audio
from .confidence import Confidence
from .encoder_decoder import new_encoder_decoder


def new_digit_recognizer(tokenizer):
    """A small SpeechEncoderDecoderModel (Wav2Vec2-BERT conformer encoder over log-mel features + GPT-2 with
    cross-attention), random weights, and its feature extractor. Sized to train on 2 CPU cores in under an hour."""
    from transformers import (
        SeamlessM4TFeatureExtractor,
        SpeechEncoderDecoderConfig,
        SpeechEncoderDecoderModel,
        Wav2Vec2BertConfig,
    )

    # 80 log-mel bins every 10 ms, four frames stacked: 320 features at 25 frames/s. The conformer's depthwise
    # convolution is causal and masked, so a padded batch equals its rows alone.
    encoder = Wav2Vec2BertConfig(hidden_size=144, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384,
                                 feature_projection_input_dim=320, conv_depthwise_kernel_size=15,
                                 position_embeddings_type="rotary", layerdrop=0.0, conformer_conv_dropout=0.0,
                                 mask_time_prob=0.05, mask_time_length=4, mask_time_min_masks=1)
    model = new_encoder_decoder(SpeechEncoderDecoderModel, SpeechEncoderDecoderConfig, encoder, tokenizer,
                                n_positions=32, n_layer=2, max_new_tokens=16)
    features = SeamlessM4TFeatureExtractor(feature_size=80, num_mel_bins=80, sampling_rate=16_000, stride=4)
    return model, features


class SpeechBatches:
    """Examples {"path": audio file, "text": transcript} -> model kwargs with labels (padding ignored). An empty
    transcript (a file without speech) is labelled with the end token alone.

    Each file's features are computed once and kept (epochs after the first only pad them): a padded batch of
    kept features equals the feature extractor run on the whole batch, since padding is zeros after the
    per-utterance normalisation.

    augment(waveform, sampling_rate, rng) -> waveform (xattn.datasets.augment_audio.corrupt) corrupts every clip
    afresh each time it is used, before the feature extractor; then the waveforms are kept instead of the
    features. Each clip's rng is seeded from python's global random (seeded from --seed and saved in every
    checkpoint by xattn.train) and the clip's file_name."""

    def __init__(self, feature_extractor, tokenizer,
                 augment: Callable[[np.ndarray, int, np.random.Generator], np.ndarray] | None = None):
        self.feature_extractor, self.tokenizer, self.augment = feature_extractor, tokenizer, augment
        self._features: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._waveforms: dict[str, np.ndarray] = {}

    def features(self, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The file's encoder input ([frames, features] or [samples]) and its attention mask."""
        found = self._features.get(path)
        if found is None:
            found = self._features[path] = self._encode(self.waveform(path))
        return found

    def waveform(self, path: str) -> np.ndarray:
        """The file at the extractor's rate (kept only when augmenting: otherwise its features are)."""
        found = self._waveforms.get(path)
        if found is None:
            found = load_audio(path, self.feature_extractor.sampling_rate)
            if self.augment is not None:
                self._waveforms[path] = found
        return found

    def _encode(self, waveform: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = input_features(self.feature_extractor, [waveform])
        name = "input_features" if "input_features" in inputs else "input_values"
        return inputs[name][0], inputs["attention_mask"][0]

    def _corrupted(self, example: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # one draw from python's random per example: training seeds it and --resume restores it, so a resumed run
        # corrupts alike; the file name keeps torchrun's processes (seeded alike) from corrupting alike
        name = example.get("file_name", example["path"])
        rng = np.random.default_rng([random.getrandbits(64), zlib.crc32(name.encode())])
        rate = self.feature_extractor.sampling_rate
        return self._encode(self.augment(self.waveform(example["path"]), rate, rng))

    def __call__(self, examples: list[dict]) -> dict:
        eos = self.tokenizer.eos_token
        encoded = self.tokenizer([e["text"] + eos for e in examples], padding=True, return_tensors="pt")
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        if self.augment is None:
            rows, masks = zip(*(self.features(e["path"]) for e in examples))
        else:
            rows, masks = zip(*(self._corrupted(e) for e in examples))
        padded = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(list(masks), batch_first=True)
        name = "input_features" if padded.ndim == 3 else "input_values"
        return {name: padded, "attention_mask": mask, "labels": labels}


def word_errors(truth: str, guess: str) -> int:
    """Word-level edit distance (substitutions + insertions + deletions)."""
    a, b = truth.split(), guess.split()
    row = list(range(len(b) + 1))
    for i, word in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != other))
    return row[-1]


def transcription_scores(truths: list[str], guesses: list[str]) -> dict:
    """Word error rate (errors / reference words) and exact-match rate."""
    errors = sum(word_errors(t, g) for t, g in zip(truths, guesses))
    words = sum(len(t.split()) for t in truths)
    exact = sum(t == g for t, g in zip(truths, guesses))
    return {"wer": errors / max(words, 1), "exact_match": exact / max(len(truths), 1)}


@torch.no_grad()
def transcription_accuracy(engine, feature_extractor, tokenizer, rows, limit: int | None = None, batch_size: int = 32,
                           progress: bool = False) -> dict:
    """WER and exact match of greedy transcripts (decoded by the xattn engine) of rows {"path", "text"}."""
    from tqdm import tqdm

    n = len(rows) if limit is None else min(limit, len(rows))
    truths, guesses = [], []
    for start in tqdm(range(0, n, batch_size), desc="evaluating", disable=not progress):
        batch = [rows[i] for i in range(start, min(start + batch_size, n))]
        waveforms = [load_audio(r["path"], feature_extractor.sampling_rate) for r in batch]
        out = engine.generate(**input_features(feature_extractor, waveforms))
        guesses += [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]
        truths += [r["text"] for r in batch]
    return transcription_scores(truths, guesses)


DEFAULT_MODEL = os.path.join(SHIPPED_MODELS, "digit-recognizer")
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".aiff", ".aif")


class Transcriber:
    """A SpeechEncoderDecoder checkpoint (directory or hub id) with its tokenizer and feature extractor, decoding
    through the xattn engine. Audio longer than `max_seconds` is refused (the model never heard longer audio).

    Features are transformers' ASR pipeline's (`pipeline_features`), so a transcript is the one
    `pipeline("automatic-speech-recognition")` gives. `pad_to_stride=True` instead pads each clip to whole stacks
    of frames, as the training batches do, for an extractor that stacks frames (SeamlessM4T, Wav2Vec2-BERT):
    transformers' own call drops the last frames that do not fill a stack."""

    def __init__(self, model: str | None = None, max_seconds: float = 20.0, compile: bool = False,
                 allow_pickle: bool = False, weights: str = "exact", pad_to_stride: bool = False,
                 revision: str | None = None, encoder_weights: str | None = None):
        from ..hf.hub import resolve_checkpoint
        from ..hf.loading import load, load_feature_extractor, load_tokenizer

        path = DEFAULT_MODEL if model is None else resolve_checkpoint(model, revision, allow_pickle)
        if model is None and not os.path.isdir(path):
            raise ValueError(f"the shipped recognizer is not at {path}; pass --model with a checkpoint")
        # with encoder_weights, the decoder's copies are made once, with the encoder's (XattnModel.with_weights)
        self.engine = load(path, allow_pickle=allow_pickle, weights="exact" if encoder_weights else weights)
        if getattr(self.engine.encoder, "main_input_name", None) not in ("input_values", "input_features"):
            raise ValueError(f"{path} is not a speech model (no speech encoder)")
        if encoder_weights:
            self.engine = self.engine.with_weights(weights, encoder_weights)
        self.tokenizer = load_tokenizer(path)
        _check_feature_extractor(path)  # before transformers builds it: a mel filter bank is allocated at once
        self.feature_extractor = load_feature_extractor(path)
        self.sampling_rate = self.feature_extractor.sampling_rate
        self.confidence = Confidence.from_pretrained(path)
        if pad_to_stride and not getattr(self.feature_extractor, "stride", None):
            raise ValueError(f"pad_to_stride applies to feature extractors that stack frames (a `stride`); {path}'s "
                             f"{type(self.feature_extractor).__name__} does not: leave it off")
        self.pad_to_stride = pad_to_stride
        if not math.isfinite(max_seconds) or max_seconds <= 0:
            raise ValueError(f"max_seconds must be a positive number, got {max_seconds}")
        self.max_seconds = max_seconds
        if compile:
            self.engine.compile()

    def load(self, path: str) -> np.ndarray:
        """The file as the model hears it; ValueError if it is longer than max_seconds (checked from the header
        where the format allows) or shorter than the model's first encoder frame."""
        waveform = load_audio(path, self.sampling_rate, max_seconds=self.max_seconds)
        if len(waveform) < self.sampling_rate and len(waveform) < self.min_samples:  # a second is always enough
            rate = self.sampling_rate
            raise ValueError(f"{path}: {len(waveform) / rate * 1000:.1f} ms of audio, too short for this model "
                             f"(at least {self.min_samples / rate * 1000:.1f} ms)")
        return waveform

    @functools.cached_property
    def min_samples(self) -> int:
        """The shortest audio this model takes; found on the first clip under a second, not at start-up."""
        return shortest_input(self.engine, self.features, self.sampling_rate)

    def features(self, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """The encoder's inputs for waveforms at the model's sample rate, padded into one batch, with an attention
        mask; a row's features never depend on the rest of the batch."""
        if self.pad_to_stride:
            return input_features(self.feature_extractor, waveforms)
        return pipeline_features(self.feature_extractor, waveforms)

    @torch.no_grad()
    def transcribe(self, waveforms: list[np.ndarray], **generate_kwargs) -> list[str]:
        """Transcripts of waveforms at the model's sample rate, padded into one batch (each row stops on its own)."""
        out = self.engine.generate(**self.features(waveforms), **generate_kwargs)
        return [text.strip() for text in self.tokenizer.batch_decode(out, skip_special_tokens=True)]

    @torch.no_grad()
    def transcribe_results(self, waveforms: list[np.ndarray], **generate_kwargs) -> list[dict]:
        """{"text", "avg_logprob", "low_confidence"[, "low_confidence_reason"]} per transcript (tasks/confidence)."""
        out = self.engine.generate(**self.features(waveforms), return_dict_in_generate=True, **generate_kwargs)
        texts = [text.strip() for text in self.tokenizer.batch_decode(out.sequences, skip_special_tokens=True)]
        return self.confidence.results(texts, out.avg_logprob.tolist(), "text")

    def encoder_inputs(self, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
        return self.features(waveforms)


def pipeline_features(feature_extractor, waveforms: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The encoder's inputs as transformers' ASR pipeline makes them from arrays at the model's rate (4.57 and 5.x):
    each waveform through the feature extractor alone, in the pipeline's own call, then the rows padded on the
    extractor's padding side as the pipeline's batching pads them (features with its padding value, masks with 0).
    One call on the whole batch would not do: an extractor that stacks frames cuts the batch's padded length, not
    each row's, to whole stacks, so a row's last frames would depend on its neighbours."""
    values, masks = [], []
    for waveform in waveforms:
        inputs = feature_extractor(waveform, sampling_rate=feature_extractor.sampling_rate, return_tensors="pt",
                                   return_attention_mask=True)
        name = "input_features" if "input_features" in inputs else "input_values"
        values.append(inputs[name][0])  # [frames, features] or [samples]
        mask = inputs.get("attention_mask")  # [frames] or [samples]; an extractor without one masks nothing
        masks.append(torch.ones(values[-1].shape[0], dtype=torch.long) if mask is None else mask[0])
    left = getattr(feature_extractor, "padding_side", "right") == "left"
    padding_value = getattr(feature_extractor, "padding_value", 0.0)
    return {name: _pad_rows(values, padding_value, left), "attention_mask": _pad_rows(masks, 0, left)}


def _pad_rows(rows: list[torch.Tensor], value: float, left: bool) -> torch.Tensor:
    """[length_i, ...] rows -> [B, max length, ...], filled with `value` on the left or right."""
    length = max(row.shape[0] for row in rows)
    out = torch.full((len(rows), length, *rows[0].shape[1:]), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        if left:
            out[i, length - row.shape[0]:] = row
        else:
            out[i, : row.shape[0]] = row
    return out


@torch.no_grad()
def shortest_input(engine, features: Callable[[list[np.ndarray]], dict], sampling_rate: int) -> int:
    """The fewest samples for which `features` (waveforms -> the encoder's inputs) and the encoder give at least one
    unmasked, finite encoder position (found by bisection): anything shorter fails inside the model or gives NaN."""
    def works(samples: int) -> bool:
        noise = np.random.default_rng(0).standard_normal(samples).astype(np.float32)  # silence normalises to 0/0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the extractors' own warnings about too few frames
                hidden, mask = engine.encode(**features([noise]))
        except (RuntimeError, ValueError, IndexError):
            return False
        return hidden.shape[1] > 0 and (mask is None or bool(mask.any())) and bool(hidden.isfinite().all())

    low, high = 0, sampling_rate  # works(high): a second of audio is enough for any encoder
    if not works(high):
        return 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if works(middle) else (middle, high)
    return high


def audio_files(paths: list[str]) -> list[str]:
    """Files as given, folders expanded to their audio files (sorted)."""
    from ..jobs import input_files

    return input_files(paths, AUDIO_EXTENSIONS)



MAX_FEATURES = 4096  # mel bins / feature size a feature extractor may ask for (Whisper: 128): past it, a damaged config


def _check_feature_extractor(path: str) -> None:
    """preprocessor_config.json asking for absurd rates or sizes (read as JSON: transformers would allocate a filter
    bank of that size on loading, or gigabytes per file later, blamed on the audio) is refused in one line."""
    import json

    from .audio import MAX_RATE

    file = os.path.join(path, "preprocessor_config.json")
    try:
        with open(file) as f:
            values = json.load(f)
    except (OSError, ValueError, RecursionError):
        return  # load_feature_extractor says what is wrong with it
    if not isinstance(values, dict):
        return
    rate = values.get("sampling_rate")
    if rate is not None and (not isinstance(rate, int) or not 1 <= rate <= MAX_RATE):
        raise ValueError(f"{file}: sampling_rate={rate!r}; a rate is 1 Hz-{MAX_RATE // 1000} kHz")
    for name in ("feature_size", "num_mel_bins", "n_fft", "win_length", "frame_length"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_FEATURES):
            raise ValueError(f"{file}: {name}={value!r}; at most {MAX_FEATURES}")
    stride = values.get("stride")
    if stride is not None and (not isinstance(stride, int) or stride < 1):
        raise ValueError(f"{file}: stride={stride!r}; a stride is 1 or more")
