"""Every bad input a user can hand `xattn caption|transcribe|speak|train` gets a one-line message naming the
file or option, a non-zero exit and no traceback; odd but valid input just works."""

import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import soundfile
from PIL import Image

from conftest import gpt2_config, save_task_models
from xattn.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny captioner and a tiny recognizer saved with tokenizer and preprocessor, and broken checkpoints."""
    from transformers import GPT2LMHeadModel, VisionEncoderDecoderConfig

    root = tmp_path_factory.mktemp("models")
    paths = save_task_models(root)
    paths["incomplete"] = str(root / "incomplete")  # config, no weights
    VisionEncoderDecoderConfig.from_pretrained(paths["captioner"]).save_pretrained(paths["incomplete"])
    paths["no-cross"] = str(root / "no-cross")  # a plain GPT-2: nothing to cross-attend with
    GPT2LMHeadModel(gpt2_config(add_cross_attention=False)).save_pretrained(paths["no-cross"])
    return paths


def _png_declaring(path, width, height):
    """A valid PNG header that declares a huge image (a decompression bomb), with almost no data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10))
                     + chunk(b"IEND", b""))


def _image_cases(tmp):
    good = tmp / "good.png"
    Image.new("RGB", (64, 64), "red").save(good)
    truncated = tmp / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:60])
    text = tmp / "notes.png"
    text.write_text("hello")
    bomb = tmp / "bomb.png"
    _png_declaring(bomb, 60000, 60000)
    return [(str(tmp / "missing.png"), "no such file"), (str(text), "not a readable image"),
            (str(truncated), "not a readable image"), (str(bomb), "decompression bomb")]


def test_bad_images_one_by_one(models, tmp_path, capsys):
    for path, message in _image_cases(tmp_path):
        assert main(["caption", path, "--model", models["captioner"]]) == 2, path
        err = capsys.readouterr().err.strip()
        assert message in err and path in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_odd_but_valid_images_just_work(models, tmp_path, capsys):
    files = []
    for mode, suffix in [("L", "png"), ("LA", "png"), ("RGBA", "png"), ("CMYK", "jpg"), ("I;16", "png"),
                         ("P", "gif"), ("1", "bmp")]:
        path = tmp_path / f"{mode.replace(';', '')}.{suffix}"
        Image.new(mode, (50, 40)).save(path)
        files.append(str(path))
    out = tmp_path / "out.jsonl"
    assert main(["caption", *files, "--model", models["captioner"], "-o", str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["file"] for r in rows] == files and all("caption" in r for r in rows)


def test_a_batch_with_bad_images_reports_them_and_goes_on(models, tmp_path, capsys):
    cases = _image_cases(tmp_path)
    good = str(tmp_path / "good.png")
    files = [good] + [p for p, _ in cases] + [good]
    out = tmp_path / "out.jsonl"
    assert main(["caption", *files, "--model", models["captioner"], "-o", str(out), "--quiet"]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "caption" in rows[0] and "caption" in rows[-1]
    for row, (_, message) in zip(rows[1:-1], cases):
        assert message in row["error"]
    assert f"{len(cases)} of {len(files)} files failed" in capsys.readouterr().err


def _audio_cases(tmp):
    text = tmp / "notes.wav"
    text.write_text("hello")
    empty = tmp / "empty.wav"
    soundfile.write(empty, np.zeros(0), 16000)
    nan = tmp / "nan.wav"
    soundfile.write(nan, np.full(800, np.nan), 16000, subtype="FLOAT")
    inf = tmp / "inf.wav"
    soundfile.write(inf, np.full(800, np.inf), 16000, subtype="FLOAT")
    long = tmp / "long.wav"
    soundfile.write(long, np.zeros(16000 * 25, dtype=np.int16), 16000)
    return [(str(tmp / "missing.wav"), "no such file"), (str(text), "not a readable audio"), (str(empty), "no samples"),
            (str(nan), "NaN"), (str(inf), "infinite"), (str(long), "at most 20 s")]


def test_bad_audio_one_by_one(models, tmp_path, capsys):
    for path, message in _audio_cases(tmp_path):
        assert main(["transcribe", path, "--model", models["recognizer"]]) == 2, path
        err = capsys.readouterr().err.strip()
        assert message in err and path in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_silent_and_odd_audio_just_works(models, tmp_path):
    files = []
    for name, rate, channels in [("silent", 16000, 1), ("stereo8k", 8000, 2), ("six-channels", 48000, 6),
                                 ("odd-rate", 12345, 1)]:
        path = tmp_path / f"{name}.wav"
        samples = np.zeros((rate // 2, channels)) if name == "silent" else \
            np.random.default_rng(0).uniform(-0.3, 0.3, (rate // 2, channels))
        soundfile.write(path, samples, rate)
        files.append(str(path))
    out = tmp_path / "out.jsonl"
    assert main(["transcribe", *files, "--model", models["recognizer"], "-o", str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["file"] for r in rows] == files and all("text" in r for r in rows)


@pytest.mark.parametrize("command", ["caption", "transcribe"])
@pytest.mark.parametrize("model,message", [("missing", "no such checkpoint directory"),
                                           ("incomplete", "cannot load the checkpoint"),
                                           ("no-cross", "is not")])
def test_bad_checkpoints(models, tmp_path, capsys, command, model, message):
    path = models.get(model, str(tmp_path / "missing-model"))
    assert main([command, "x", "--model", path]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_captioner_given_to_transcribe_and_back(models, capsys):
    assert main(["transcribe", "x.wav", "--model", models["captioner"]]) == 2
    assert "not a speech model" in capsys.readouterr().err
    assert main(["caption", "x.png", "--model", models["recognizer"]]) == 2
    assert "not an image captioner" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
    (["--max-new-tokens", "500"], "n_positions"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "must be <= num_beams"),
    (["--do-sample", "--temperature", "-1"], "argument --temperature: must be greater than 0"),
    (["--do-sample", "--top-p", "1.5"], "argument --top-p: must be at most 1"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: must be greater than 0"),
    (["--num-beams", "2", "--do-sample"], "beam sampling is not supported"),
])
def test_out_of_range_generation_options(models, tmp_path, capsys, flags, message):
    image = tmp_path / "x.png"
    Image.new("RGB", (64, 64)).save(image)
    assert main(["caption", str(image), "--model", models["captioner"], *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_debug_shows_the_traceback_and_plain_shows_one_line(tmp_path):
    script = os.path.join(REPO, "recipes", "caption.py")
    missing = str(tmp_path / "missing.png")
    plain = subprocess.run([sys.executable, script, missing], capture_output=True, text=True)
    debug = subprocess.run([sys.executable, script, missing, "--debug"], capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "no such file" in plain.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_bench_refuses_an_unknown_row_with_the_choices(capsys):
    from xattn.cli import main

    assert main(["bench", "--rows", "B=3 beam 2", "--no-ctranslate2"]) == 2
    assert "unknown --rows ['B=3 beam 2']" in capsys.readouterr().err
