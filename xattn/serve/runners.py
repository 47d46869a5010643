"""The task APIs behind the endpoints: an upload is read with the CLI's own loader (the same hostile-input checks,
the same one-line messages, the upload's name where the CLI names its file), and batches run through the same
batched calls as `xattn caption` / `xattn transcribe` (Captioner.caption_results, Transcriber.transcribe_results),
or, for captioning with in-flight batching, one request at a time into the engine's running decode batch
(CaptionRequests); speech runs Speaker.stream, one request at a time, stopping between chunks when its client
leaves."""

from __future__ import annotations

import base64
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .options import Generation


class Uploads:
    """A private folder for uploads: each one is written to a file there (the CLI's loaders read files), read and
    removed at once."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="xattn-serve-")

    def load(self, data, filename: str | None, extensions: tuple[str, ...], loader: Callable[[str], Any]):
        """loader(path) on the upload's bytes (a file object); a ValueError's message names `filename`."""
        name = display_name(filename)
        ext = os.path.splitext(name)[1].lower()
        path = os.path.join(self.folder, uuid.uuid4().hex + (ext if ext in extensions else ""))
        try:
            with open(path, "wb") as out:
                shutil.copyfileobj(data, out, 1 << 20)
            return loader(path)
        except ValueError as error:
            raise ValueError(str(error).replace(path, name)) from None
        finally:
            if os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- captioning -------------------------------------------------------------------------------------------------
@dataclass
class CaptionItem:
    pixels: Any  # [3, H, W], Captioner.load's
    image: Any = None  # the decoded image, only when an attention map is asked for


def caption_batch(captioner, metrics=None) -> Callable[[Any, list[CaptionItem]], list[dict]]:
    """batch(key, items) for the Batcher: key = (Generation, attention_map, ...); one record per item
    {"text", "avg_logprob", "low_confidence"[, "low_confidence_reason"][, "results"][, "attention_map_png"]}."""

    def batch(key, items: list[CaptionItem]) -> list[dict]:
        options, with_map = key[:2]
        records = captioner.caption_results([i.pixels for i in items], **options.generate_kwargs())
        _count_tokens(metrics, "caption", captioner.tokenizer, [r["caption"] for r in records])
        out = _per_item(records, "caption", options, len(items))
        if with_map:
            for item, result in zip(items, out):
                result[ATTENTION] = captioner.attention(item.image, **options.generate_kwargs())
        return out

    return batch


class CaptionRequests:
    """Captioning through in-flight batching (xattn/serve/inflight.py): each request joins the captioner's running
    decode batch on its own options; its record is caption_batch's for it alone."""

    def __init__(self, captioner, metrics=None):
        self.captioner, self.metrics = captioner, metrics

    def scheduler(self, max_rows: int):
        return self.captioner.engine.inflight(max_rows)

    def request(self, key, item: CaptionItem):
        """The engine's request (ValueError where the model refuses the options)."""
        return self.captioner.engine.request(pixel_values=item.pixels[None], **key[0].generate_kwargs())

    def record(self, key, item: CaptionItem, result) -> dict:
        options, with_map = key[:2]
        records = self.captioner.results(result.sequences, result.avg_logprob)
        _count_tokens(self.metrics, "caption", self.captioner.tokenizer, [r["caption"] for r in records])
        out = _per_item(records, "caption", options, 1)[0]
        if with_map:
            out[ATTENTION] = self.captioner.attention(item.image, **options.generate_kwargs())
        return out


# a record's attention (the model's part of a map, computed with the caption), drawn by attention_map_png outside
# the decode thread: drawing takes a second or so, which the other requests must not wait for
ATTENTION = "_attention"


def attention_map_png(image, attention) -> str:
    """The attention map (Captioner.attention_map's picture) as base64 PNG."""
    from ..tasks.captioning import draw_attention

    with tempfile.TemporaryDirectory(prefix="xattn-map-") as folder:
        path = os.path.join(folder, "map.png")
        draw_attention(image, attention, path)
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()


# ---- transcription ----------------------------------------------------------------------------------------------
def transcribe_batch(transcriber, metrics=None) -> Callable[[Any, list[np.ndarray]], list[dict]]:
    """batch(key, waveforms): key = (Generation, ...); one record per waveform {"text", "avg_logprob", ...}."""

    def batch(key, waveforms: list[np.ndarray]) -> list[dict]:
        options = key[0]
        records = transcriber.transcribe_results(waveforms, **options.generate_kwargs())
        _count_tokens(metrics, "transcribe", transcriber.tokenizer, [r["text"] for r in records])
        return _per_item(records, "text", options, len(waveforms))

    return batch


def _per_item(records: list[dict], key: str, options: Generation, items: int) -> list[dict]:
    """num_return_sequences records per item -> one dict per item: the first result's fields (its text as "text")
    and, with several, all of them under "results"."""
    n = options.num_return_sequences
    out = []
    for i in range(items):
        group = [_text_first(r, key) for r in records[i * n: (i + 1) * n]]
        out.append({**group[0], "results": group} if n > 1 else group[0])
    return out


def _text_first(record: dict, key: str) -> dict:
    return {"text": record[key], **{k: v for k, v in record.items() if k != key}}


def _count_tokens(metrics, task: str, tokenizer, texts: list[str]) -> None:
    if metrics is not None:
        metrics.generated(task, sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"]))  # + the end token


# ---- speech -----------------------------------------------------------------------------------------------------
@dataclass
class SpeechItem:
    text: str
    voice: str
    options: Generation
    send: Callable[[np.ndarray | None], None]  # called in the worker thread with each chunk, then None at the end
    stop: threading.Event = field(default_factory=threading.Event)  # set when the client left or the deadline passed


def speech_batch(speaker, metrics=None) -> Callable[[Any, list[SpeechItem]], list[int]]:
    """batch(None, [item]): streams the item's audio through item.send; the result is its number of samples."""
    from ..tasks.audio_codes import HOP

    def batch(key, items: list[SpeechItem]) -> list[int]:
        samples = []
        for item in items:
            total = 0
            try:
                for piece in speaker.stream(item.text, item.voice, **item.options.generate_kwargs()):
                    if item.stop.is_set():  # nobody listens: stop generating
                        break
                    item.send(piece)
                    total += len(piece)
                    if metrics is not None:
                        metrics.generated("speech", len(piece) // HOP)
            finally:
                item.send(None)
            samples.append(total)
        return samples

    return batch


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming servers write;
    readers take the data up to the end of the file)."""
    import struct

    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                                  sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def pcm16(piece: np.ndarray, sample_rate: int) -> bytes:
    """Float samples as 16-bit PCM, converted by libsndfile as `xattn speak` writes its file (the same numbers)."""
    import io

    import soundfile

    out = io.BytesIO()
    soundfile.write(out, piece, sample_rate, format="RAW", subtype="PCM_16", endian="LITTLE")
    return out.getvalue()


_SAFE = re.compile(r"[^A-Za-z0-9._ -]")


def display_name(filename: str | None) -> str:
    """The upload's name as messages show it: its base name, odd characters replaced."""
    return _SAFE.sub("_", os.path.basename(filename or ""))[:200] or "upload"
