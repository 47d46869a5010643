"""Spoken digit strings synthesized with espeak-ng, saved as wav files + metadata.jsonl (spec in data/README.md).

An utterance is 1-6 digits spoken as words ("four two seven"), by one of espeak-ng's English voices with one
of its voice variants, at a random speed and pitch. Splits are made by voice *variant*: the held-out
variants are never heard in training.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029",
          "en-us-nyc")
# espeak-ng's variants (voices/!v), less the novelty ones (robots, whispers, croaks) nobody speaks like
TRAIN_VARIANTS = ("Alex", "Andrea", "Andy", "Annie", "Denis", "Diogo", "Gene", "Henrique", "Hugo", "Jacky",
                  "Lee", "Marco", "Mario", "Michael", "Nguyen", "adam", "anika", "announcer", "antonio",
                  "aunty", "belinda", "boris", "caleb", "david", "ed", "edward", "f1", "f2", "f3", "f5",
                  "grandma", "grandpa", "gustave", "iven", "iven2", "john", "linda", "m1", "m2", "m4", "m5",
                  "m6", "m8", "marcelo", "max", "michel", "miguel", "norbert", "pablo", "paul", "pedro",
                  "quincy", "rob", "robert", "sandro", "shelby", "steph", "steph3", "travis", "victor", "zac")
HELD_OUT_VARIANTS = ("Alicia", "Mike", "benjamin", "f4", "iven3", "m3", "m7", "steph2")
SPEEDS = (120, 200)  # words per minute, uniform
PITCHES = (25, 75)  # espeak-ng's 0-99 scale, uniform
# the TTS learns to speak like these: name -> (voice, variant, speed, pitch), all fixed
TTS_VOICES = {"us-female": ("en-us", "f3", 170, 55), "gb-male": ("en-gb", "m1", 170, 40)}
TTS_WORDS = ("hello", "yes", "no", "okay", "stop", "go", "thank you", "goodbye")  # a few words besides digits


@dataclass(frozen=True)
class Utterance:
    text: str  # "four two seven"
    voice: str  # espeak-ng language voice, e.g. "en-gb"
    variant: str  # espeak-ng voice variant, e.g. "f3"
    speed: int
    pitch: int


def utterance_for(seed: int, index: int, variants: tuple[str, ...]) -> Utterance:
    """The index-th utterance of a split: a pure function of (seed, index), so splits remake identically."""
    rng = random.Random(seed * 1_000_003 + index)
    digits = [rng.choice(DIGITS) for _ in range(rng.randint(1, 6))]
    return Utterance(" ".join(digits), rng.choice(VOICES), rng.choice(variants), rng.randint(*SPEEDS),
                     rng.randint(*PITCHES))


def tts_utterance_for(seed: int, index: int) -> Utterance:
    """The index-th utterance of a TTS split: digits (nine in ten) or one of a few words, in a TTS voice."""
    rng = random.Random(seed * 1_000_003 + index)
    if rng.random() < 0.9:
        text = " ".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 6)))
    else:
        text = rng.choice(TTS_WORDS)
    name = rng.choice(sorted(TTS_VOICES))
    voice, variant, speed, pitch = TTS_VOICES[name]
    return Utterance(text, voice, variant, speed, pitch)


def tts_voice_name(row: dict) -> str:
    """The TTS voice name of a metadata row (or asdict(Utterance)) spoken in a TTS voice; ValueError otherwise."""
    for name, (voice, variant, _, _) in TTS_VOICES.items():
        if (voice, variant) == (row.get("voice"), row.get("variant")):
            return name
    known = ", ".join(f"{v}+{var}" for v, var, _, _ in TTS_VOICES.values())
    raise ValueError(f"voice {row.get('voice')!r} variant {row.get('variant')!r} is not a TTS voice ({known})")


def espeak() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)")
    return path


def synthesize(utterance: Utterance, path: str) -> None:
    """Write the utterance as espeak-ng speaks it (a 22050 Hz mono wav)."""
    voice = f"{utterance.voice}+{utterance.variant}"
    subprocess.run([espeak(), "-v", voice, "-s", str(utterance.speed), "-p", str(utterance.pitch), "-w", path,
                    utterance.text], check=True, capture_output=True)


def write_split(directory: str, count: int, utterance: Callable[[int], Utterance], progress: bool = True) -> None:
    """wav files + metadata.jsonl (file_name, text, voice, variant, speed, pitch) of utterance(0..count-1);
    resumable like the scenes."""
    from tqdm import tqdm

    from ..jobs import finished_inputs

    os.makedirs(directory, exist_ok=True)
    metadata = os.path.join(directory, "metadata.jsonl")
    done = len(finished_inputs(metadata, key="file_name"))
    with open(metadata, "a") as f:
        for index in tqdm(range(done, count), desc=os.path.basename(directory), disable=not progress, initial=done,
                          total=count):
            spoken = utterance(index)
            name = f"{index:06d}.wav"
            synthesize(spoken, os.path.join(directory, name))
            f.write(json.dumps({"file_name": name, **asdict(spoken)}) + "\n")
            f.flush()


def read_split(directory: str, check: Callable[[dict], None] | None = None) -> list[dict]:
    """The rows of metadata.jsonl (file_name and text), each with the absolute `path` of its file; a file_name
    leading outside `directory` or a malformed line is a ValueError naming metadata.jsonl and the line."""
    from .metadata import read_metadata

    return read_metadata(directory, required=("file_name", "text"), check=check)
