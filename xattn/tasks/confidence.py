"""Which captions and transcripts not to trust: a sequence whose average token log-probability (xattn.hf.scores)
falls below the threshold calibrated on the model's held-out data (confidence.json in the checkpoint's folder,
written by recipes/calibrate_confidence.py), or whose words repeat degenerately ("a large large large ...")."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

CONFIDENCE_FILE = "confidence.json"
REPEATS = 3  # a word, or a phrase of up to MAX_PHRASE words, said this many times in a row is degenerate
MAX_PHRASE = 4  # (a checkpoint whose real outputs repeat, such as digit strings, sets its own count)


@dataclass(frozen=True)
class Confidence:
    threshold: float | None  # avg_logprob below this is low confidence; None: the checkpoint was never calibrated
    repeats: int = REPEATS

    @classmethod
    def from_pretrained(cls, folder: str) -> Confidence:
        """The checkpoint's calibration, or none (then only repetition marks a result)."""
        file = os.path.join(folder, CONFIDENCE_FILE)
        if not os.path.isfile(file):
            return cls(None)
        try:
            with open(file, encoding="utf-8") as f:
                content = json.load(f)
            threshold, repeats = content["avg_logprob_threshold"], content.get("repeats", REPEATS)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{file}: not a calibration xattn wrote ({type(error).__name__}: {error})") from None
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
                or threshold > 0:
            raise ValueError(f"{file}: avg_logprob_threshold must be a log-probability (a number <= 0), "
                             f"got {threshold!r}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or not 2 <= repeats <= 1000:
            raise ValueError(f"{file}: repeats must be a whole number from 2 to 1000, got {repeats!r}")
        return cls(float(threshold), repeats)

    def judge(self, text: str, avg_logprob: float) -> str | None:
        """Why this result is low-confidence, or None when nothing speaks against it."""
        repeated = repetition(text, self.repeats)
        if repeated is not None:
            return f"degenerate repetition ({repeated!r} {self.repeats}+ times in a row)"
        if self.threshold is not None and not avg_logprob >= self.threshold:  # NaN (nothing generated) too
            return f"avg_logprob {avg_logprob:.3f} is below the model's calibrated {self.threshold:.3f}"
        return None

    def results(self, texts: list[str], avg_logprobs: list[float], key: str) -> list[dict]:
        """The JSON record of each result: {key: text, "avg_logprob", "low_confidence"[, "low_confidence_reason"]}."""
        records = []
        for text, score in zip(texts, avg_logprobs):
            reason = self.judge(text, score)
            record = {key: text, "avg_logprob": round(score, 4) if math.isfinite(score) else None,
                      "low_confidence": reason is not None}
            if reason is not None:
                record["low_confidence_reason"] = reason
            records.append(record)
        return records


def repetition(text: str, times: int = REPEATS) -> str | None:
    """The first word or phrase (up to MAX_PHRASE words) that the text says `times` times in a row."""
    words = text.split()
    for size in range(1, MAX_PHRASE + 1):
        for start in range(len(words) - size * times + 1):
            phrase = words[start: start + size]
            if all(words[start + k * size: start + (k + 1) * size] == phrase for k in range(1, times)):
                return " ".join(phrase)
    return None


def longest_run(texts: list[str]) -> int:
    """The most times any word or phrase repeats in a row in these texts (1: never)."""
    for times in range(2, 1000):
        if not any(repetition(text, times) for text in texts):
            return times - 1
    return 1000


def calibrate(avg_logprobs: list[float], unmarked: float) -> float:
    """The threshold that leaves the share `unmarked` of held-out results above it (a low quantile)."""
    ordered = sorted(v for v in avg_logprobs if math.isfinite(v))
    if not ordered:
        raise ValueError("no finite avg_logprob to calibrate on")
    return ordered[min(len(ordered) - 1, int(math.floor((1 - unmarked) * len(ordered))))]


def save_calibration(folder: str, threshold: float, repeats: int, about: dict) -> str:
    from ..files import save_json

    path = os.path.join(folder, CONFIDENCE_FILE)
    save_json({"avg_logprob_threshold": round(threshold, 6), "repeats": repeats, **about}, path)
    return path
