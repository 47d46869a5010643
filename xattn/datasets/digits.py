"""Spoken digit strings synthesized with espeak-ng, saved as wav files + metadata.jsonl (spec in data/README.md).

An utterance is 1-6 digits spoken as words ("four two seven"), by one of espeak-ng's English voices with one
of its voice variants, at a random speed and pitch. Splits are made by voice *variant*: the held-out
variants are never heard in training. A share of the training split is files without speech (digital zeros
or white noise) whose transcript is empty, so that a recognizer learns to say nothing when nobody speaks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .metadata import NO_SPEECH

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
SPEEDS = (100, 260)  # words per minute, uniform: slow to fast talkers (espeak-ng's default is 175)
PITCHES = (25, 75)  # espeak-ng's 0-99 scale, uniform
# the TTS learns to speak like these: name -> (voice, variant, speed, pitch), all fixed
TTS_VOICES = {"us-female": ("en-us", "f3", 170, 55), "gb-male": ("en-gb", "m1", 170, 40)}
# the TTS splits' seeds (recipes/make_tts_data.py) and the train split's size: eval_tts.py draws held-out strings
# from other seeds and leaves out the train split's texts
TTS_SPLIT_SEEDS = {"train": 21, "validation": 22, "test": 23}
TTS_TRAIN_SIZE = 6000
TTS_WORDS = ("hello", "yes", "no", "okay", "stop", "go", "thank you", "goodbye")  # a few words besides digits
NO_SPEECH_SHARE = 0.03  # of the training split: files without speech, transcribed as empty text
NO_SPEECH_SECONDS = (0.5, 3.0)  # uniform
NO_SPEECH_DBFS = (-60.0, -20.0)  # white noise RMS, uniform; one in three files is digital zeros instead
SAMPLE_RATE = 22_050  # what espeak-ng -w writes; the files without speech are written at it too


@dataclass(frozen=True)
class Utterance:
    text: str  # "four two seven"
    voice: str  # espeak-ng language voice, e.g. "en-gb"
    variant: str  # espeak-ng voice variant, e.g. "f3"
    speed: int
    pitch: int


@dataclass(frozen=True)
class NoSpeech:
    """A file without speech: its transcript is empty, and its metadata row says "no_speech": true."""
    seconds: float
    level_dbfs: float | None  # RMS of its white noise in dB below full scale; None: digital zeros
    noise_seed: int  # numpy's seed for the noise

    @property
    def text(self) -> str:
        return ""


def utterance_for(seed: int, index: int, variants: tuple[str, ...], speeds: tuple[int, int] = SPEEDS,
                  no_speech: float = 0.0) -> Utterance | NoSpeech:
    """The index-th utterance of a split: a pure function of its arguments, so splits remake identically.

    speeds: the range of words per minute. no_speech: the share of indices that are files without speech
    instead, drawn after the utterance, so every other index is the same utterance whatever the share."""
    rng = random.Random(seed * 1_000_003 + index)
    digits = [rng.choice(DIGITS) for _ in range(rng.randint(1, 6))]
    spoken = Utterance(" ".join(digits), rng.choice(VOICES), rng.choice(variants), rng.randint(*speeds),
                       rng.randint(*PITCHES))
    if rng.random() >= no_speech:
        return spoken
    seconds = round(rng.uniform(*NO_SPEECH_SECONDS), 2)
    level = None if rng.random() < 1 / 3 else round(rng.uniform(*NO_SPEECH_DBFS), 1)
    return NoSpeech(seconds, level, rng.getrandbits(32))


def no_speech_samples(spoken: NoSpeech, sampling_rate: int = SAMPLE_RATE):
    """The file's samples: mono float32 [seconds x sampling_rate], zeros or white noise at its level."""
    import numpy as np

    from .augment_audio import white_noise

    length = round(spoken.seconds * sampling_rate)
    if spoken.level_dbfs is None:
        return np.zeros(length, np.float32)
    return np.clip(white_noise(length, spoken.level_dbfs, np.random.default_rng(spoken.noise_seed)), -1.0, 1.0)


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


def synthesize(utterance: Utterance | NoSpeech, path: str) -> None:
    """Write the utterance as espeak-ng speaks it (a 22050 Hz mono 16-bit wav), or a file without speech as the
    same kind of wav."""
    if isinstance(utterance, NoSpeech):
        import soundfile

        soundfile.write(path, no_speech_samples(utterance), SAMPLE_RATE, subtype="PCM_16", format="WAV")
        return
    voice = f"{utterance.voice}+{utterance.variant}"
    subprocess.run([espeak(), "-v", voice, "-s", str(utterance.speed), "-p", str(utterance.pitch), "-w", path,
                    utterance.text], check=True, capture_output=True)


def write_split(directory: str, count: int, utterance: Callable[[int], Utterance | NoSpeech],
                progress: bool = True) -> None:
    """wav files + metadata.jsonl of utterance(0..count-1): file_name, text, voice, variant, speed, pitch; or, for
    a file without speech, file_name, text "", no_speech true, seconds, level_dbfs, noise_seed. Resumable like
    the scenes."""
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
            row = asdict(spoken) if isinstance(spoken, Utterance) else {"text": "", NO_SPEECH: True, **asdict(spoken)}
            f.write(json.dumps({"file_name": name, **row}) + "\n")
            f.flush()


def read_split(directory: str, check: Callable[[dict], None] | None = None) -> list[dict]:
    """The rows of metadata.jsonl (file_name and text), each with the absolute `path` of its file; a file_name
    leading outside `directory`, an empty text in a row not marked "no_speech": true, or a malformed line is a
    ValueError naming metadata.jsonl and the line."""
    from .metadata import read_metadata

    return read_metadata(directory, required=("file_name", "text"), check=check)
