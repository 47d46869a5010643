"""The shipped TTS: the README's command writes speech that the shipped recognizer understands, in both voices;
streaming gives the same audio, its first chunk before the end."""

import json
import os
import subprocess
import sys

import numpy as np
import soundfile
import torch

from xattn.tasks.audio import load_audio
from xattn.tasks.speech_synthesis import Speaker
from xattn.tasks.transcription import Transcriber

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_command_writes_speech_the_recognizer_understands(tmp_path):
    out = str(tmp_path / "out.wav")
    run = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "tts.py"), "four two seven", "-o", out,
                          "--seed", "0"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert soundfile.info(out).duration > 0.5
    assert Transcriber().transcribe([load_audio(out)]) == ["four two seven"]


def test_both_voices_speak_and_stream_equals_whole():
    speaker, transcriber = Speaker(), Transcriber()
    assert speaker.voices == ["gb-male", "us-female"]
    texts = {"gb-male": "nine one five", "us-female": "three eight"}
    for voice, text in texts.items():
        whole = speaker.speak(text, voice, generator=torch.Generator().manual_seed(1))
        pieces = list(speaker.stream(text, voice, generator=torch.Generator().manual_seed(1)))
        assert np.array_equal(np.concatenate(pieces), whole)
        assert transcriber.transcribe([whole]) == [text], voice


def test_eval_tts_draws_held_out_strings_from_a_new_seed_and_scores_each_voice(tmp_path):
    from xattn.datasets.digits import DIGITS, tts_utterance_for

    out = tmp_path / "eval.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "eval_tts.py"), "--draw", "24", "--count", "3",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    spoken = [line.split("'")[1] for line in run.stdout.splitlines() if " -> " in line]
    trained = {tts_utterance_for(21, i).text for i in range(6000)}  # make_tts_data.py's train split (its defaults)
    assert len(spoken) == 3 and all(set(t.split()) <= set(DIGITS) and t not in trained for t in spoken)
    scores = json.loads(out.read_text())
    assert scores["utterances"] == 3 and sum(v["utterances"] for v in scores["per_voice"].values()) == 3
    assert set(scores["per_voice"]) <= {"gb-male", "us-female"}
    refused = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "eval_tts.py"), "--draw", "23"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "seed of a split" in refused.stderr
