"""Speech as real files bring it: the training corruptions (xattn.datasets.augment_audio) are seeded and do what
they say, files without speech are the only rows with empty text, `xattn train --augment` trains a recognizer
and resumes bit-identically after a kill, and the per-condition evaluation recipe runs."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from xattn.cli import main
from xattn.datasets.augment_audio import Corruption, apply_corruption, corrupt, draw_corruption
from xattn.datasets.digits import (
    DIGITS,
    NO_SPEECH_SHARE,
    SPEEDS,
    TRAIN_VARIANTS,
    NoSpeech,
    Utterance,
    read_split,
    utterance_for,
    write_split,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE = 16_000


def speechlike(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    """Tones at 300 Hz-6 kHz under a syllable-rate envelope: full band, loud and quiet parts, float32 in [-1, 1]."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    tones = sum(rng.uniform(0.3, 1.0) * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in (300, 1200, 2500, 6000))
    return (0.15 * tones * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)).astype(np.float32)


def band_energy(samples: np.ndarray, low: float, high: float) -> float:
    spectrum = np.abs(np.fft.rfft(samples)) ** 2
    frequencies = np.fft.rfftfreq(len(samples), 1 / RATE)
    return float(spectrum[(frequencies >= low) & (frequencies < high)].sum())


def db(ratio: float) -> float:
    return 10 * np.log10(ratio)


# ---- the corruptions ------------------------------------------------------------------------------------------
def test_corruption_is_seeded_and_keeps_a_sane_waveform():
    clip = speechlike()
    kept = clip.copy()
    kinds = {"clean": 0, "padded": 0, "floor": 0, "noise": 0, "telephone": 0, "gain": 0}
    for seed in range(200):
        out = corrupt(clip, RATE, np.random.default_rng(seed))
        assert np.array_equal(out, corrupt(clip, RATE, np.random.default_rng(seed)))
        assert out.dtype == np.float32 and out.ndim == 1 and np.isfinite(out).all() and np.abs(out).max() <= 1
        assert len(clip) <= len(out) <= len(clip) + 2 * RATE
        drawn = draw_corruption(np.random.default_rng(seed))
        kinds["clean"] += drawn == Corruption()
        kinds["padded"] += drawn.lead_seconds > 0
        kinds["floor"] += drawn.floor_dbfs is not None
        kinds["noise"] += drawn.snr_db is not None
        kinds["telephone"] += drawn.telephone
        kinds["gain"] += drawn.gain_db != 0
    assert np.array_equal(clip, kept)  # the kept waveform is never written to
    assert all(20 <= count <= 130 for count in kinds.values()), kinds  # every kind is drawn, none always
    one, other = (corrupt(clip, RATE, np.random.default_rng(seed)) for seed in (1, 2))
    assert not np.array_equal(one, other)


def test_silence_is_added_at_both_ends():
    clip = speechlike()
    out = apply_corruption(clip, RATE, Corruption(lead_seconds=0.25, trail_seconds=0.5), np.random.default_rng(0))
    assert len(out) == len(clip) + RATE // 4 + RATE // 2
    assert not out[: RATE // 4].any() and not out[-RATE // 2 :].any()
    assert np.array_equal(out[RATE // 4 : RATE // 4 + len(clip)], clip)


def test_the_noise_floor_and_the_snr_are_what_they_say():
    floor = apply_corruption(np.zeros(RATE, np.float32), RATE, Corruption(floor_dbfs=-50.0), np.random.default_rng(0))
    assert db(np.mean(floor.astype(np.float64) ** 2)) == pytest.approx(-50, abs=0.2)
    clip = speechlike()
    noisy = apply_corruption(clip, RATE, Corruption(snr_db=20.0), np.random.default_rng(0))
    noise = noisy.astype(np.float64) - clip
    assert db(np.mean(clip.astype(np.float64) ** 2) / np.mean(noise**2)) == pytest.approx(20, abs=0.2)
    # the SNR is the speech's own: padding does not make the noise quieter
    both = apply_corruption(clip, RATE, Corruption(lead_seconds=1.0, snr_db=20.0), np.random.default_rng(0))
    assert db(np.mean(clip.astype(np.float64) ** 2) / np.mean(both[:RATE].astype(np.float64) ** 2)) == \
        pytest.approx(20, abs=0.3)
    silent = np.zeros(RATE, np.float32)  # a file without speech has no level to put noise under
    assert not apply_corruption(silent, RATE, Corruption(snr_db=10.0), np.random.default_rng(0)).any()


def test_the_8_khz_band_removes_everything_above_4_khz():
    clip = speechlike()
    out = apply_corruption(clip, RATE, Corruption(telephone=True), np.random.default_rng(0))
    assert len(out) == len(clip) and out.dtype == np.float32
    assert db(band_energy(out, 4200, 8000) / band_energy(clip, 4200, 8000)) < -40
    assert db(band_energy(out, 200, 3500) / band_energy(clip, 200, 3500)) == pytest.approx(0, abs=0.5)


def test_gain_scales_and_clips():
    clip = speechlike()
    quieter = apply_corruption(clip, RATE, Corruption(gain_db=-20.0), np.random.default_rng(0))
    np.testing.assert_allclose(quieter, clip * 0.1, rtol=1e-5, atol=1e-8)
    louder = apply_corruption(clip * 4, RATE, Corruption(gain_db=6.0), np.random.default_rng(0))
    assert np.abs(louder).max() == 1.0 and (np.abs(louder) == 1.0).any()


# ---- files without speech: the only rows with empty text --------------------------------------------------------
def test_no_speech_rows_leave_the_speech_rows_as_they_were():
    drawn = [utterance_for(11, i, TRAIN_VARIANTS, no_speech=NO_SPEECH_SHARE) for i in range(2000)]
    silent = [u for u in drawn if isinstance(u, NoSpeech)]
    assert 30 <= len(silent) <= 90 and all(u.text == "" for u in silent)
    assert {u.level_dbfs is None for u in silent} == {True, False}
    for i, u in enumerate(drawn):
        if isinstance(u, Utterance):
            assert u == utterance_for(11, i, TRAIN_VARIANTS)
    speeds = [u.speed for u in drawn if isinstance(u, Utterance)]
    assert SPEEDS == (100, 260) and min(speeds) <= 105 and max(speeds) >= 255 and SPEEDS[0] <= min(speeds)
    assert max(speeds) <= SPEEDS[1]
    assert {u.speed for u in (utterance_for(14, i, TRAIN_VARIANTS, (201, 260)) for i in range(100))} <= \
        set(range(201, 261))


@pytest.fixture(scope="module")
def tokenizer():
    from xattn.datasets.tokenizer import train_caption_tokenizer

    return train_caption_tokenizer([" ".join(DIGITS)] * 20, vocab_size=300)


def test_files_without_speech_are_written_read_and_labelled_with_the_end_token_alone(tmp_path, tokenizer):
    import soundfile

    from xattn.tasks.transcription import SpeechBatches, new_digit_recognizer

    folder = str(tmp_path / "train")
    write_split(folder, 4, lambda i: utterance_for(11, i, TRAIN_VARIANTS, no_speech=1.0), progress=False)
    rows = read_split(folder)
    assert [r["text"] for r in rows] == [""] * 4 and all(r["no_speech"] is True for r in rows)
    for row in rows:
        samples, rate = soundfile.read(row["path"])
        assert rate == 22050 and len(samples) == round(row["seconds"] * rate)
        if row["level_dbfs"] is None:
            assert not samples.any()
        else:
            assert db(np.mean(samples**2)) == pytest.approx(row["level_dbfs"], abs=0.5)
    _, features = new_digit_recognizer(tokenizer)
    batch = SpeechBatches(features, tokenizer)(rows[:1] + [{"path": rows[1]["path"], "text": "four two"}])
    spoken = tokenizer("four two")["input_ids"] + [tokenizer.eos_token_id]
    assert batch["labels"][1].tolist() == spoken
    assert batch["labels"][0].tolist() == [tokenizer.eos_token_id] + [-100] * (len(spoken) - 1)
    assert torch.isfinite(batch["input_features"]).all()


@pytest.mark.parametrize("row,accepted", [
    ({"text": "", "no_speech": True}, True),
    ({"text": "four", "no_speech": False}, True),
    ({"text": "four"}, True),
    ({"text": ""}, "empty 'text'"),
    ({"text": "  "}, "empty 'text'"),
    ({"text": "", "no_speech": False}, "empty 'text'"),
    ({"text": "four", "no_speech": True}, "has empty 'text'"),
    ({"text": "", "no_speech": "yes"}, "must be true or false"),
])
def test_only_rows_marked_no_speech_may_have_empty_text(tmp_path, row, accepted):
    (tmp_path / "0.wav").write_bytes(b"")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "0.wav", **row}) + "\n")
    if accepted is True:
        assert read_split(str(tmp_path))[0]["text"] == row["text"]
    else:
        with pytest.raises(ValueError, match=accepted) as error:
            read_split(str(tmp_path))
        assert "metadata.jsonl line 1" in str(error.value)


def test_augmented_batches_are_fresh_each_time_and_follow_the_global_seed(tmp_path, tokenizer):
    from xattn.tasks.transcription import SpeechBatches, new_digit_recognizer

    folder = str(tmp_path / "train")
    write_split(folder, 1, lambda i: NoSpeech(1.0, -30.0, 7), progress=False)  # noise: every corruption shows
    rows = read_split(folder) * 2
    _, features = new_digit_recognizer(tokenizer)
    batches = SpeechBatches(features, tokenizer, augment=corrupt)
    random.seed(5)
    first, second = batches(rows), batches(rows)
    random.seed(5)
    again = batches(rows)
    assert torch.equal(first["input_features"], again["input_features"])
    assert not torch.equal(first["input_features"], second["input_features"])


# ---- training with --augment ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits(tmp_path_factory, espeak_ng, tokenizer):
    """A tiny spoken-digits folder as recipes/make_digits.py writes it: 6 utterances and a file without speech."""
    root = tmp_path_factory.mktemp("digits")

    def train_row(i):
        return utterance_for(11, i, TRAIN_VARIANTS, no_speech=1.0 if i == 6 else 0.0)

    write_split(str(root / "train"), 7, train_row, progress=False)
    write_split(str(root / "validation"), 2, lambda i: utterance_for(12, i, TRAIN_VARIANTS), progress=False)
    tokenizer.save_pretrained(str(root / "tokenizer"))
    return str(root)


def augmented_argv(data, out, *extra):
    from test_train_hostile import SCHEDULE

    return ["train", "--data", data, "--model", "new-digit-recognizer", "--out", str(out), *SCHEDULE, "--augment",
            *extra]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()  # --threads 1 sets them for the whole test process
    yield
    torch.set_num_threads(threads)


def test_train_with_augment_corrupts_every_training_clip(digits, tmp_path, monkeypatch):
    import xattn.datasets.augment_audio as augment_audio

    calls = []

    def counted(waveform, rate, rng):
        calls.append(len(waveform))
        return corrupt(waveform, rate, rng)

    monkeypatch.setattr(augment_audio, "corrupt", counted)
    assert main(augmented_argv(digits, tmp_path / "out", "--max-steps", "2", "--eval-every", "2")) == 0
    assert len(calls) == 2 * 2  # two steps of two clips; the validation clips are scored clean
    assert os.path.isfile(tmp_path / "out" / "final" / "model.safetensors")


def test_an_augmented_run_killed_in_a_checkpoint_write_resumes_to_the_same_weights(digits, tmp_path):
    from test_train_hostile import _KILLED_RUNS, assert_same_final

    killed = str(tmp_path / "killed")
    runs = [("augmented", augmented_argv(digits, killed), "after_renaming", ["checkpoint-4"])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUNS, json.dumps(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert main(augmented_argv(digits, tmp_path / "unbroken")) == 0  # alongside the killed run
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))
    assert result["killed"] and "checkpoint-4" in result["files"], result
    with open(os.path.join(killed, "latest")) as f:
        assert f.read() == "checkpoint-2"
    assert main(augmented_argv(digits, killed, "--resume")) == 0
    assert_same_final(killed, str(tmp_path / "unbroken"))


def test_the_speaker_refuses_augment(tmp_path, capsys):
    data = tmp_path / "tts"
    for split in ("train", "validation"):
        (data / split).mkdir(parents=True)
    assert main(["train", "--data", str(data), "--model", "new-speaker", "--out", str(tmp_path / "out"),
                 "--augment"]) == 2
    assert "leave --augment out" in capsys.readouterr().err


# ---- the evaluation recipe --------------------------------------------------------------------------------------
def test_the_conditions_recipe_reports_every_condition(tmp_path, espeak_ng):
    out = tmp_path / "eval-conditions.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "eval_recognizer_conditions.py"), "--count",
                          "2", "--work", str(tmp_path / "work"), "--json", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    conditions = json.loads(out.read_text())["conditions"]
    assert list(conditions) == ["clean", "silence 0.5 s", "201-260 wpm", "noise 20 dB SNR", "8 kHz band",
                                "silence only", "noise floor only", "noise only"]
    for name, result in conditions.items():
        assert result["files"] == 2
        assert 0 <= result["wer" if "wer" in result else "empty"] <= (10 if "wer" in result else 1), name
    table = [line for line in run.stdout.splitlines() if line.startswith("|")]
    assert len(table) == len(conditions) + 2  # the Markdown table: header, rule and a row each
