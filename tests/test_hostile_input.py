"""Hostile and careless input to caption, transcribe, speak, train, bench and the Python API: checkpoints never
run their code, a bad file never takes its batch down, user files are never destroyed, outputs are locked,
exit codes tell the truth, and every refusal is one line naming the file or option."""

import contextlib
import fcntl
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

import xattn
from conftest import save_task_models
from xattn.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAYLOAD = """import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PretrainedConfig
class PayloadConfig(PretrainedConfig):
    model_type = "payload"
"""


# ---- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny captioner, recognizer and speaker checkpoints (random weights), saved as the real ones are."""
    from xattn.tasks.audio_codes import CHUNK, N_MELS, Codebook
    from xattn.tasks.speech_synthesis import new_speaker, text_tokenizer

    root = tmp_path_factory.mktemp("models")
    paths = save_task_models(root)
    speaker_tokenizer = text_tokenizer(["one", "two"])
    codebook = Codebook(np.random.default_rng(1).normal(-4, 2, size=(16, N_MELS)).astype(np.float32))
    speaker = new_speaker(speaker_tokenizer, codebook.size, max_codes=CHUNK + 10)
    speaker.generation_config.max_new_tokens = 8
    paths["speaker"] = str(root / "speaker")
    speaker.save_pretrained(paths["speaker"])
    speaker_tokenizer.save_pretrained(paths["speaker"])
    codebook.save_pretrained(paths["speaker"])
    return paths


@pytest.fixture()
def image(tmp_path):
    path = tmp_path / "good.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """A second of noise-like audio at 16 kHz: long enough for any encoder."""
    path = tmp_path_factory.mktemp("audio") / "good.wav"
    soundfile.write(path, np.random.default_rng(0).normal(0, 0.1, 16000).astype(np.float32), 16000)
    return str(path)


def _copy(source: str, target) -> str:
    import shutil

    shutil.copytree(source, target)
    return str(target)


def _one_line(err: str, *needles: str) -> None:
    err = err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@contextlib.contextmanager
def _stdin(text: str):
    """transformers' "[y/N]" prompt reads sys.stdin: answer it with `text` ("" = closed)."""
    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


@contextlib.contextmanager
def _tmpfs(path, size: str, read_only: bool = False):
    """A small real file system (root can mount here); skipped, and said so, where mounting is not allowed."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk and read-only cases did not run")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


# ---- 1. checkpoints never run their code ----------------------------------------------------------------------
def _payload_checkpoint(source: str, target, where: str, marker: str) -> str:
    path = _copy(source, target)
    with open(os.path.join(path, "payload.py"), "w") as f:
        f.write(PAYLOAD.format(marker=marker))
    name = {"config": "config.json", "custom-type": "config.json", "tokenizer": "tokenizer_config.json",
            "preprocessor": "preprocessor_config.json"}[where]
    file = os.path.join(path, name)
    with open(file) as f:
        content = json.load(f)
    if where == "custom-type":
        content["model_type"] = "payload"
    auto = {"config": {"AutoConfig": "payload.PayloadConfig"}, "custom-type": {"AutoConfig": "payload.PayloadConfig"},
            "tokenizer": {"AutoTokenizer": ["payload.PayloadConfig", None]},
            "preprocessor": {"AutoImageProcessor": "payload.PayloadConfig",
                             "AutoFeatureExtractor": "payload.PayloadConfig"}}[where]
    content["auto_map"] = auto
    with open(file, "w") as f:
        json.dump(content, f)
    return path


WHERE = ["config", "custom-type", "tokenizer", "preprocessor"]


@pytest.mark.parametrize("answer", ["", "y\ny\ny\n"], ids=["stdin-closed", "stdin-yes"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("command", ["caption", "transcribe", "speak", "train"])
def test_a_checkpoint_asking_for_its_own_code_is_refused(models, tmp_path, capsys, image, speech, command, where,
                                                         answer):
    source = {"caption": "captioner", "transcribe": "recognizer", "speak": "speaker", "train": "captioner"}[command]
    if command == "speak" and where == "preprocessor":
        where = "config"  # the speaker has no preprocessor_config.json
    marker = str(tmp_path / "marker")
    payload = _payload_checkpoint(models[source], tmp_path / "payload", where, marker)
    data = tmp_path / "data"
    for split in ("train", "validation"):
        (data / split).mkdir(parents=True)
    argv = {"caption": ["caption", image], "transcribe": ["transcribe", speech],
            "speak": ["speak", "one two", "-o", str(tmp_path / "x.wav")],
            "train": ["train", "--data", str(data), "--out", str(tmp_path / "run")]}[command]
    with _stdin(answer):
        code = main([*argv, "--model", payload])
    assert code == 2
    _one_line(capsys.readouterr().err, "its own Python code")
    assert not os.path.exists(marker)


@pytest.mark.parametrize("where", WHERE)
def test_load_refuses_custom_code_and_trust_remote_code(models, tmp_path, where):
    marker = str(tmp_path / "marker")
    payload = _payload_checkpoint(models["captioner"], tmp_path / "payload", where, marker)
    with pytest.raises(ValueError, match="its own Python code"):
        xattn.load(payload)
    with pytest.raises(ValueError, match="trust_remote_code"):
        xattn.load(models["captioner"], trust_remote_code=True)
    assert not os.path.exists(marker)


def test_a_real_process_answering_yes_runs_no_checkpoint_code(models, tmp_path, image):
    marker = str(tmp_path / "marker")
    payload = _payload_checkpoint(models["captioner"], tmp_path / "payload", "custom-type", marker)
    run = subprocess.run([sys.executable, "-m", "xattn.cli", "caption", image, "--model", payload],
                         input="y\n" * 5, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and not os.path.exists(marker)
    _one_line(run.stderr, "config.json", "its own Python code")


# ---- 2. a bad file never takes its batch down ------------------------------------------------------------------
@pytest.mark.parametrize("samples", [0, 1, 100, 399])
def test_too_short_audio_is_refused_at_load_and_the_batch_goes_on(models, tmp_path, speech, samples):
    short = str(tmp_path / "short.wav")
    soundfile.write(short, np.full(samples, 0.1, np.float32), 16000)
    out = tmp_path / "out.jsonl"
    code = main(["transcribe", speech, short, speech, "--model", models["recognizer"], "-o", str(out), "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 1 and [("error" in r) for r in rows] == [False, True, False]
    assert rows[1]["file"] == short and short in rows[1]["error"]
    assert ("too short" in rows[1]["error"]) or ("no samples" in rows[1]["error"])


def test_a_batch_that_fails_in_the_model_is_retried_file_by_file(tmp_path):
    from xattn.jobs import JobOutput, run_batches

    files = [f"f{i}" for i in range(7)]

    def process(items):  # the "encoder" fails for any batch holding f3
        if "f3" in items:
            raise RuntimeError("negative dimensions are not allowed")
        return [{"caption": item.upper()} for item in items]

    out = tmp_path / "out.jsonl"
    output = JobOutput(str(out))
    assert run_batches(files, lambda f: f, process, output, batch_size=4, progress=False) == 1
    output.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["file"] for r in rows] == files
    assert rows[3] == {"file": "f3", "error": "f3: RuntimeError: negative dimensions are not allowed"}
    assert all(rows[i]["caption"] == f"F{i}" for i in (0, 1, 2, 4, 5, 6))


# ---- 3. outputs: checked first, locked, never rewritten ---------------------------------------------------------
def _fifo(tmp_path):
    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("target,message", [
    (lambda t: str(t), "is a folder"),
    (lambda t: str(t / "missing" / "out.jsonl"), "does not exist"),
    (lambda t: "/dev/null", "not a regular file"),
    (_fifo, "not a regular file"),
])
def test_bad_outputs_are_refused_before_any_work(models, tmp_path, capsys, image, target, message):
    output = target(tmp_path)
    assert main(["caption", image, image, "--model", models["captioner"], "-o", output]) == 2
    _one_line(capsys.readouterr().err, "-o", message)


@pytest.mark.parametrize("content", ["my notes\nline two\nthe last line", "{\"a\": 1}\n", "x\n" * 3,
                                     '{"file": "a.png", "caption": "x"}\nnot ours at the end'])
def test_a_file_of_other_lines_is_never_rewritten(models, tmp_path, capsys, image, content):
    out = tmp_path / "notes.txt"
    out.write_text(content)
    assert main(["caption", image, image, "--model", models["captioner"], "-o", str(out)]) == 2
    _one_line(capsys.readouterr().err, str(out), "not a result line of xattn")
    assert out.read_text() == content


def test_a_second_job_on_the_same_output_is_refused(models, tmp_path, capsys, image):
    out = tmp_path / "out.jsonl"
    with open(out, "a") as held:  # as a running job holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["caption", image, image, "--model", models["captioner"], "-o", str(out)]) == 2
        _one_line(capsys.readouterr().err, "another xattn job is writing")
    assert out.read_text() == ""
    assert main(["caption", image, image, "--model", models["captioner"], "-o", str(out), "--quiet"]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_a_read_only_place_is_refused(models, tmp_path, capsys, image):
    with _tmpfs(tmp_path / "ro", "1m", read_only=True) as folder:
        out = os.path.join(folder, "out.jsonl")
        assert main(["caption", image, image, "--model", models["captioner"], "-o", out]) == 2
        _one_line(capsys.readouterr().err, "-o", "permission denied")


def test_disk_full_keeps_earlier_results_and_resumes_to_the_unbroken_output(models, tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(40):  # long names: the output spans several of tmpfs's 4 KB pages
        Image.new("RGB", (64, 64), (6 * i, 10, 250 - 6 * i)).save(folder / f"{i:03d}{'-long-name' * 20}.png")
    whole = tmp_path / "whole.jsonl"
    flags = ["--model", models["captioner"], "--batch-size", "2", "--quiet"]
    assert main(["caption", str(folder), "-o", str(whole), *flags]) == 0
    expected = whole.read_bytes()
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        filler = os.path.join(disk, "filler")
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # fill it, then free about half the output
            f.write(b"\0" * (64 * 1024))
        os.truncate(filler, os.path.getsize(filler) - max(4096, len(expected) // 2))
        out = os.path.join(disk, "out.jsonl")
        assert main(["caption", str(folder), "-o", out, *flags]) == 2
        _one_line(capsys.readouterr().err, out, "disk is full", "resume")
        partial = Path(out).read_bytes()
        assert 0 < len(partial) < len(expected) and expected.startswith(partial.rpartition(b"\n")[0])
        os.remove(filler)
        assert main(["caption", str(folder), "-o", out, *flags]) == 0
        assert Path(out).read_bytes() == expected


def test_stdout_streams_and_a_pipe_never_hangs(models, tmp_path, image):
    command = [sys.executable, "-m", "xattn.cli", "caption", image, image, "--model", models["captioner"], "--quiet"]
    streamed = subprocess.run(" ".join([*command, "-o", "-", "| cat"]), shell=True, capture_output=True, text=True,
                              timeout=300)
    assert streamed.returncode == 0
    assert [json.loads(line)["file"] for line in streamed.stdout.splitlines()] == [image, image]
    piped = subprocess.run(" ".join([*command, "-o", "/dev/stdout", "| cat"]), shell=True, capture_output=True,
                           text=True, timeout=300)
    _one_line(piped.stderr, "not a regular file")


def test_speak_refusals_leave_an_existing_wav_untouched(models, tmp_path, capsys):
    out = tmp_path / "keep.wav"
    soundfile.write(out, np.zeros(800, np.float32), 16000)
    before = out.read_bytes()
    cases = [(["speak", "4 2"], "cannot say"), (["speak", "one", "--voice", "three"], "unknown voice"),
             (["speak", ""], "empty"), (["speak", "one", "--spectrogram", str(tmp_path / "no" / "x.png")],
                                        "does not exist")]
    for argv, message in cases:
        assert main([*argv, "--model", models["speaker"], "-o", str(out)]) == 2
        _one_line(capsys.readouterr().err, message)
        assert out.read_bytes() == before
    assert main(["speak", "one two", "--model", models["speaker"], "-o", str(out), "--seed", "1"]) == 0
    assert out.read_bytes() != before and not [p for p in os.listdir(tmp_path) if "partial" in p]


@pytest.mark.parametrize("output,message", [("speech", "ending in .wav"), ("missing/x.wav", "does not exist"),
                                            (".", "is a folder")])
def test_speak_bad_outputs(models, tmp_path, capsys, output, message):
    assert main(["speak", "one", "--model", models["speaker"], "-o", str(tmp_path / output)]) == 2
    _one_line(capsys.readouterr().err, "-o", message)


def test_speak_on_a_full_disk_leaves_no_partial_file(models, tmp_path, capsys):
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        with open(os.path.join(disk, "filler"), "wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (64 * 1024))
        out = os.path.join(disk, "x.wav")
        assert main(["speak", "one two", "--model", models["speaker"], "-o", out]) == 2
        _one_line(capsys.readouterr().err, "-o", "the disk is full")
        assert os.listdir(disk) == ["filler"]


@pytest.mark.parametrize("target,message", [("missing/map.png", "does not exist"), ("map.jpg", "ending in .png")])
def test_attention_map_into_a_bad_place(models, tmp_path, capsys, image, target, message):
    assert main(["caption", image, "--model", models["captioner"], "--attention-map", str(tmp_path / target)]) == 2
    _one_line(capsys.readouterr().err, "--attention-map", message)


# ---- 4. exit codes tell the truth ----------------------------------------------------------------------------
def test_a_resumed_job_with_earlier_errors_exits_1(models, tmp_path, capsys, image):
    missing = str(tmp_path / "missing.png")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"file": missing, "error": f"{missing}: no such file"}) + "\n")
    assert main(["caption", missing, image, "--model", models["captioner"], "-o", str(out), "--quiet"]) == 1
    assert "1 of 2 files failed" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2


# ---- 6. images and audio ---------------------------------------------------------------------------------------
def test_exif_orientation_is_applied_as_transformers_does(tmp_path):
    from transformers.image_utils import load_image as hf_load_image

    from xattn.tasks.vision import load_image

    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :40] = (255, 0, 0)  # left half red, right half blue
    pixels[:, 40:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = str(tmp_path / "phone.jpg")
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    ours = np.asarray(load_image(path))
    assert ours.shape == (80, 40, 3)  # upright: portrait
    assert np.array_equal(ours, np.asarray(hf_load_image(path).convert("RGB")))
    assert ours[5, 20, 0] > 200 and ours[75, 20, 2] > 200  # red on top after the turn


def test_a_batch_holds_preprocessed_images_not_decoded_ones(models, tmp_path):
    from xattn.tasks.captioning import Captioner

    path = str(tmp_path / "large.png")
    Image.new("RGB", (3000, 2000), (10, 200, 10)).save(path)
    item = Captioner(models["captioner"]).load(path)
    assert isinstance(item, torch.Tensor) and tuple(item.shape) == (3, 64, 64)


def _wav_declaring(path, seconds: float, rate: int = 48000, channels: int = 8) -> None:
    """A real WAV file of `seconds` of silence, sparse on disk (the zeros take no space until read)."""
    data = int(seconds * rate) * channels * 2
    header = b"RIFF" + struct.pack("<I", 36 + data) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, channels, rate, rate * channels * 2, channels * 2, 16) + b"data" + struct.pack("<I", data)
    path.write_bytes(header)
    os.truncate(path, len(header) + data)


def test_long_audio_is_refused_from_its_header_before_reading(models, tmp_path, capsys):
    path = tmp_path / "ten-minutes.wav"
    _wav_declaring(path, 600)
    with _no_full_read():
        assert main(["transcribe", str(path), "--model", models["recognizer"]]) == 2
    _one_line(capsys.readouterr().err, str(path), "600.0 s of audio")


@contextlib.contextmanager
def _no_full_read():
    real = soundfile.read

    def refuse(*args, **kwargs):
        raise AssertionError("the whole file was read before its length was checked")

    soundfile.read = refuse
    try:
        yield
    finally:
        soundfile.read = real


# ---- 7. one line, exit 2, for every bad option and checkpoint ---------------------------------------------------
@pytest.mark.parametrize("argv,option", [
    (["caption", "x.png", "--batch-size", "0"], "--batch-size"),
    (["caption", "x.png", "--batch-size", "-1"], "--batch-size"),
    (["caption", "x.png", "--seed", str(2**70)], "--seed"),
    (["caption", "x.png", "--num-beams", "0"], "--num-beams"),
    (["caption", "x.png", "--top-k", "-1"], "--top-k"),
    (["caption", "x.png", "--temperature", "nan"], "--temperature"),
    (["caption", "x.png", "--shard", "5/2"], "--shard"),
    (["transcribe", "x.wav", "--max-seconds", "nan"], "--max-seconds"),
    (["transcribe", "x.wav", "--max-seconds", "inf"], "--max-seconds"),
    (["transcribe", "x.wav", "--max-seconds", "0"], "--max-seconds"),
    (["transcribe", "x.wav", "--batch-size", "0"], "--batch-size"),
    (["speak", "one", "--seed", "-3"], "--seed"),
    (["speak", "one", "--top-p", "0"], "--top-p"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--threads", "-1"], "--threads"),
    (["bench", "--short", "0"], "--short"),
    (["caption", "x.png", "--weights", "int4"], "--weights"),
])
def test_bad_options_are_one_line_usage_errors(capsys, argv, option):
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, f"argument {option}")


@pytest.mark.parametrize("flag,target,message", [("--json", "missing/out.json", "does not exist"),
                                                 ("--chart", "out.jpg", "ending in .png")])
def test_bench_checks_its_outputs_before_measuring(tmp_path, capsys, flag, target, message):
    assert main(["bench", "--quick", "--no-ctranslate2", flag, str(tmp_path / target)]) == 2
    _one_line(capsys.readouterr().err, flag, message)


def _absurd_header(path):
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 2**62))


def _garbage(path):
    with open(path, "wb") as f:
        f.write(b"not safetensors at all")


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage,file,message", [
    (_absurd_header, "model.safetensors", "cannot load the checkpoint"),
    (_garbage, "model.safetensors", "cannot load the checkpoint"),
    (_truncate, "model.safetensors", "cannot load the checkpoint"),
    (os.remove, "preprocessor_config.json", "image processor"),
    (_garbage, "tokenizer_config.json", "tokenizer_config.json: not a readable JSON file"),
    (_garbage, "config.json", "config.json: not a readable JSON file"),
])
def test_damaged_checkpoints_are_one_line_errors(models, tmp_path, capsys, image, damage, file, message):
    path = _copy(models["captioner"], tmp_path / "damaged")
    damage(os.path.join(path, file))
    assert main(["caption", image, "--model", path]) == 2
    _one_line(capsys.readouterr().err, message)


def test_damaged_codebook_is_one_line(models, tmp_path, capsys):
    path = _copy(models["speaker"], tmp_path / "damaged")
    _garbage(os.path.join(path, "codebook.npz"))
    assert main(["speak", "one", "--model", path, "-o", str(tmp_path / "x.wav")]) == 2
    _one_line(capsys.readouterr().err, "codebook")


# ---- kill and resume -------------------------------------------------------------------------------------------
def test_a_job_killed_three_times_ends_byte_identical_to_an_unbroken_run(models, tmp_path):
    import random
    import signal
    import time

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(60):
        Image.new("RGB", (64, 64), (4 * i, 255 - 4 * i, (37 * i) % 256)).save(folder / f"{i:02d}.png")
    (folder / "broken.png").write_text("not an image")  # an error line among them
    flags = [str(folder), "--model", models["captioner"], "--batch-size", "3", "--quiet", "--num-beams", "2"]
    whole = tmp_path / "whole.jsonl"
    assert main(["caption", *flags, "-o", str(whole)]) == 1
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "xattn.cli", "caption", *flags, "-o", str(out)]
    rng = random.Random(7)
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lines_before = len(out.read_bytes().splitlines()) if out.exists() else 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # wait for this run's first batch
            if out.exists() and len(out.read_bytes().splitlines()) > lines_before:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            # a kill counts when it left the job unfinished (a run killed after its last line, while exiting, does
            # not test resuming)
            kills += 0 < len(out.read_bytes()) < len(whole.read_bytes())
        proc.wait()
    assert kills >= 2, "the job ended before it could be killed unfinished: make it longer"
    assert subprocess.run(command, capture_output=True, timeout=300).returncode == 1
    assert out.read_bytes() == whole.read_bytes()
