"""`xattn train` under hostile conditions, for the three shipped model kinds (captioner, recognizer, speaker) on
tiny data: the same seed gives the same weights; SIGKILL at chosen points of a checkpoint (or codebook) write,
then --resume, ends bit-identical to an unbroken run; data files outside their folder, bad numeric options,
broken checkpoints and a full disk are one-line refusals with exit code 2, never tracebacks."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from xattn.cli import main

KINDS = {"captioner": ("scenes", "new-scene-captioner"), "recognizer": ("digits", "new-digit-recognizer"),
         "speaker": ("tts", "new-speaker")}
# checkpoints at steps 2, 4 and 5; evaluation (and loss.png) at step 5 only
SCHEDULE = ["--max-steps", "5", "--batch-size", "2", "--save-every", "2", "--eval-every", "100", "--eval-limit", "1",
            "--warmup-steps", "2", "--learning-rate", "3e-3", "--seed", "3", "--threads", "1", "--mixed-precision",
            "no"]


def _write_scenes(directory, count, seed):
    from xattn.datasets.scenes import draw, scene_for

    os.makedirs(directory)
    with open(os.path.join(directory, "metadata.jsonl"), "w") as f:
        for i in range(count):
            draw(scene_for(seed, i)).save(os.path.join(directory, f"{i}.png"))
            f.write(json.dumps({"file_name": f"{i}.png", "text": scene_for(seed, i).caption}) + "\n")


def _write_speech(directory, count, utterance):
    from xattn.datasets.digits import synthesize

    os.makedirs(directory)
    with open(os.path.join(directory, "metadata.jsonl"), "w") as f:
        for i in range(count):
            synthesize(utterance(i), os.path.join(directory, f"{i}.wav"))
            f.write(json.dumps({"file_name": f"{i}.wav", **asdict(utterance(i))}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory, espeak_ng):
    """Tiny data folders as recipes/make_scenes.py, make_digits.py and make_tts_data.py write them."""
    from xattn.datasets.digits import DIGITS, TRAIN_VARIANTS, tts_utterance_for, utterance_for
    from xattn.datasets.scenes import scene_for
    from xattn.datasets.tokenizer import train_caption_tokenizer

    root = tmp_path_factory.mktemp("data")
    _write_scenes(str(root / "scenes" / "train"), 8, 1)
    _write_scenes(str(root / "scenes" / "validation"), 2, 2)
    captions = [scene_for(1, i).caption for i in range(500)]
    train_caption_tokenizer(captions, vocab_size=360).save_pretrained(str(root / "scenes" / "tokenizer"))
    _write_speech(str(root / "digits" / "train"), 6, lambda i: utterance_for(11, i, TRAIN_VARIANTS))
    _write_speech(str(root / "digits" / "validation"), 2, lambda i: utterance_for(12, i, TRAIN_VARIANTS))
    train_caption_tokenizer([" ".join(DIGITS)] * 20, vocab_size=300).save_pretrained(str(root / "digits" / "tokenizer"))
    _write_speech(str(root / "tts" / "train"), 10, lambda i: tts_utterance_for(21, i))  # > 256 frames: a codebook
    (root / "tts" / "validation").mkdir()
    return {kind: str(root / folder) for kind, (folder, _) in KINDS.items()}


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads():
    threads = torch.get_num_threads()  # --threads 1 sets them for the whole test process
    yield
    torch.set_num_threads(threads)


def train_argv(data, kind, out, *extra):
    return ["train", "--data", data[kind], "--model", KINDS[kind][1], "--out", str(out), *SCHEDULE, *extra]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]  # no bars
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("xattn train: error: "), err
    return lines[0]


def assert_same_final(out, reference):
    """The final weights (and the speaker's codebook) of two runs are bit-identical."""
    mine, theirs = load_file(f"{out}/final/model.safetensors"), load_file(f"{reference}/final/model.safetensors")
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    if os.path.exists(f"{reference}/final/codebook.npz"):
        with np.load(f"{out}/final/codebook.npz") as a, np.load(f"{reference}/final/codebook.npz") as b:
            assert np.array_equal(a["centroids"], b["centroids"])


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """kind -> the output folder of an unbroken in-process run (made on first use)."""
    root = tmp_path_factory.mktemp("reference")
    made = {}

    def get(kind):
        if kind not in made:
            assert main(train_argv(data, kind, root / kind)) == 0
            made[kind] = str(root / kind)
        return made[kind]

    return get


# ---- kills: a separate process, killed at chosen points; the runs fork from one warm process ---------------
_KILLED_RUNS = r"""
import json, os, signal, sys, traceback
import numpy as np
import sklearn.cluster
from transformers import EncoderDecoderModel, SpeechEncoderDecoderModel, VisionEncoderDecoderModel
import xattn.cli, xattn.tasks.audio_codes, xattn.tasks.captioning, xattn.tasks.speech_synthesis
import xattn.tasks.transcription, xattn.train.checkpoints, xattn.train.command


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def after_weights(n):  # inside the n-th checkpoint write: checkpoint-N.tmp holds the weights, nothing else
    real, calls = xattn.train.checkpoints.save_model, []
    def save_model(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            die()
    xattn.train.checkpoints.save_model = save_model


def after_renaming(name):  # checkpoint-N is complete under its name; `latest` still names the one before
    real = xattn.train.checkpoints.replace_directory
    def replace_directory(tmp, final):
        real(tmp, final)
        if os.path.basename(final) == name:
            die()
    xattn.train.checkpoints.replace_directory = replace_directory


def before_pointer(name):  # the new `latest` is written beside the old one, not yet renamed over it
    real = os.replace
    def replace(src, dst, **kwargs):
        if os.path.basename(dst) == "latest" and open(src).read() == name:
            die()
        real(src, dst, **kwargs)
    os.replace = replace


def mid_codebook():  # half of the speaker's codebook.npz is on disk
    real = np.savez
    def savez(file, **arrays):
        real(file, **arrays)
        os.truncate(file, os.path.getsize(file) // 2)
        die()
    np.savez = savez


for name, argv, hook, hook_args in json.loads(sys.argv[1]):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            globals()[hook](*hook_args)
            xattn.cli.main(argv)
        except BaseException:
            traceback.print_exc()
        os._exit(70)  # not killed
    _, status = os.waitpid(pid, 0)
    out = argv[argv.index("--out") + 1]
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"name": name, "killed": killed, "files": sorted(os.listdir(out))}), flush=True)
"""


@pytest.fixture(scope="module")
def killed(data, tmp_path_factory):
    """Starts the killed runs in a separate process (it works while this one trains the references); calling
    the result waits for it: {run name: (killed by SIGKILL, files in --out afterwards)}, and the --out folders."""
    root = tmp_path_factory.mktemp("killed")
    outs = {kind: str(root / kind) for kind in KINDS}
    runs = [
        ("captioner", train_argv(data, "captioner", outs["captioner"]), "after_weights", [2]),
        ("recognizer", train_argv(data, "recognizer", outs["recognizer"]), "after_renaming", ["checkpoint-4"]),
        ("speaker codebook", train_argv(data, "speaker", outs["speaker"]), "mid_codebook", []),
        ("speaker", train_argv(data, "speaker", outs["speaker"], "--resume"), "before_pointer", ["checkpoint-4"]),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUNS, json.dumps(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    result = {}

    def wait():
        if not result:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr[-3000:]
            for line in stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    result[row["name"]] = (row["killed"], row["files"])
            assert len(result) == len(runs), stdout + stderr[-3000:]
        return result

    yield wait, outs
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_same_seed_gives_the_same_weights(kind, data, reference, killed, tmp_path):
    """Two runs in one process (so every global RNG starts elsewhere the second time) end bit-identical.
    (`killed` starts the killed runs' process here, to work alongside.)"""
    first = reference(kind)
    assert main(train_argv(data, kind, tmp_path / "again")) == 0
    assert_same_final(str(tmp_path / "again"), first)


@pytest.mark.parametrize("kind", list(KINDS))
def test_killed_during_a_checkpoint_write_resumes_to_the_same_weights(kind, data, reference, killed):
    wait, outs = killed
    runs = wait()
    out = outs[kind]
    assert runs[kind][0], f"the {kind} run was not killed: {runs[kind]}"
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "checkpoint-2"  # the kill landed in the write of checkpoint-4
    files = runs[kind][1]
    if kind == "captioner":
        assert "checkpoint-4.tmp" in files and "checkpoint-4" not in files
    elif kind == "recognizer":
        assert "checkpoint-4" in files and "checkpoint-4.tmp" not in files
    else:
        assert runs["speaker codebook"][0] and "codebook" not in runs["speaker codebook"][1]
        assert "checkpoint-4" in files and any(f.startswith(".latest") for f in files)
    assert main(train_argv(data, kind, out, "--resume")) == 0
    assert_same_final(out, reference(kind))


# ---- data files outside their folder ------------------------------------------------------------------------
@pytest.mark.parametrize("escape", ["dot-dot", "absolute", "symlink"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_data_files_outside_their_folder_are_refused(kind, escape, data, tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(data[kind], copy, symlinks=True)
    train = copy / "train"
    first = json.loads((train / "metadata.jsonl").read_text().splitlines()[0])
    secret = tmp_path / ("secret" + os.path.splitext(first["file_name"])[1])  # a real file, outside the folder
    shutil.copy(train / first["file_name"], secret)
    name = {"dot-dot": f"../../{secret.name}", "absolute": str(secret), "symlink": "link" + secret.suffix}[escape]
    if escape == "symlink":
        os.symlink(secret, train / name)
    with open(train / "metadata.jsonl", "a") as f:
        f.write(json.dumps({**first, "file_name": name}) + "\n")
    lines = len((train / "metadata.jsonl").read_text().splitlines())
    out = tmp_path / "out"
    argv = train_argv({kind: str(copy)}, kind, out)
    assert main(argv) == 2
    message = one_line_error(capsys)
    assert f"{train / 'metadata.jsonl'} line {lines}" in message and repr(name) in message
    assert not os.path.exists(out / "latest") and not os.path.exists(out / "final")


@pytest.mark.parametrize("kind,line,message", [
    ("recognizer", '{"file_name": "0.wav", "text": "one"', "line 7: not JSON"),
    ("recognizer", '["0.wav", "one"]', "line 7: not a JSON object"),
    ("recognizer", '{"file_name": "0.wav"}', "line 7: needs 'text' as text"),
    ("recognizer", '{"file_name": "missing.wav", "text": "one"}', "line 7: file_name 'missing.wav': no such file"),
    ("speaker", '{"file_name": "0.wav", "text": "one", "voice": "en-us", "variant": "m3"}', "not a TTS voice"),
    ("speaker", '{"file_name": "0.wav", "text": "4 2", "voice": "en-us", "variant": "f3"}', "cannot say"),
    ("captioner", '{"file_name": "0.png", "text": "' + "a red circle " * 30 + '"}', "decoder holds at most"),
])
def test_bad_metadata_rows_are_refused_before_training(kind, line, message, data, tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(data[kind], copy)
    metadata = copy / "train" / "metadata.jsonl"
    rows = metadata.read_text().splitlines()[:6] + [line]
    metadata.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    assert main(train_argv({kind: str(copy)}, kind, out)) == 2
    assert message in one_line_error(capsys)
    assert not os.path.exists(out / "latest")


def test_audio_the_model_cannot_take_is_named(data, tmp_path, capsys):
    import soundfile

    copy = tmp_path / "data"
    shutil.copytree(data["recognizer"], copy)
    soundfile.write(str(copy / "train" / "0.wav"), np.zeros(10), 16000)  # shorter than one feature frame
    assert main(train_argv({"recognizer": str(copy)}, "recognizer", tmp_path / "out", "--batch-size", "6")) == 2
    message = one_line_error(capsys)
    assert os.path.realpath(copy / "train" / "0.wav") in message and "cannot train on it" in message


# ---- bad options --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [
    ("--save-every", "0"), ("--eval-every", "0"), ("--threads", "0"), ("--threads", "-1"), ("--batch-size", "0"),
    ("--batch-size", "-1"), ("--seed", str(2**70)), ("--seed", "-1"), ("--max-steps", "0"), ("--max-steps", "-1"),
    ("--max-steps", "1.5"), ("--learning-rate", "-1e-3"), ("--learning-rate", "nan"), ("--learning-rate", "0"),
    ("--learning-rate", "inf"), ("--keep-checkpoints", "0"), ("--eval-limit", "0"), ("--eval-limit", "-1"),
    ("--patch-size", "0"), ("--patch-size", "7"), ("--warmup-steps", "-1"), ("--weight-decay", "nan"),
    ("--max-grad-norm", "0"), ("--mixed-precision", "fp8"),
])
def test_bad_numbers_are_usage_errors(flag, value, tmp_path, capsys):
    try:  # argparse's usage error: exit 2, whether main returns it or argparse raises SystemExit
        code = main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "out"), f"{flag}={value}"])
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"xattn train: error: argument {flag}: ") and value in errors[0], err
    assert not os.path.exists(tmp_path / "out")


# ---- broken checkpoints -------------------------------------------------------------------------------------
def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage,named", [
    ("latest names a missing folder", "latest"), ("latest names no checkpoint", "latest"),
    ("truncated weights", "checkpoint-5/weights.safetensors"), ("truncated state", "checkpoint-5/trainer_state.pt"),
    ("empty state", "checkpoint-5/trainer_state.pt"), ("a list for a state", "checkpoint-5/trainer_state.pt"),
    ("a text step", "checkpoint-5/trainer_state.pt"), ("no loss history", "checkpoint-5/trainer_state.pt"),
    ("random states of another shape", "checkpoint-5/trainer_state.pt"),
])
def test_a_broken_checkpoint_is_named_on_resume(damage, named, data, reference, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(reference("captioner"), out)
    if damage == "latest names a missing folder":
        (out / "latest").write_text("checkpoint-9")
    elif damage == "latest names no checkpoint":
        (out / "latest").write_text("../../etc")
    elif damage == "truncated weights":
        _truncate(out / "checkpoint-5" / "weights.safetensors")
    elif damage == "truncated state":
        _truncate(out / "checkpoint-5" / "trainer_state.pt")
    elif damage == "empty state":
        (out / "checkpoint-5" / "trainer_state.pt").write_bytes(b"")
    else:  # a readable file (weights_only) whose contents are not what the loop reads
        state_file = out / "checkpoint-5" / "trainer_state.pt"
        state = torch.load(state_file, weights_only=True)
        if damage == "a list for a state":
            state = [state["step"]]
        elif damage == "a text step":
            state["step"] = "five"
        elif damage == "no loss history":
            del state["history"]["loss"]
        else:
            state["rng"]["numpy"] = {"keys": "no"}
        torch.save(state, state_file)
    final = (out / "final" / "model.safetensors").read_bytes()
    assert main(train_argv(data, "captioner", out, "--resume")) == 2
    message = one_line_error(capsys)
    assert str(out / named) in message and ("--resume" in message or "checkpoint-4" in message), message
    assert (out / "final" / "model.safetensors").read_bytes() == final  # nothing was overwritten


@pytest.mark.parametrize("changed,flag", [
    (("--batch-size", "1"), "--batch-size"), (("--seed", "7"), "--seed"),
    (("--learning-rate", "0.5"), "--learning-rate"),
    (("--augment",), "--augment"), (("--data", None), "--data"),
])
def test_a_resume_with_other_options_is_refused(changed, flag, data, reference, tmp_path, capsys):
    """Resuming with options that change what the run computes would give neither the interrupted run nor a fresh
    one; options that do not (how often to save or evaluate) may change."""
    out = tmp_path / "out"
    shutil.copytree(reference("captioner"), out)
    final = (out / "final" / "model.safetensors").read_bytes()
    argv = train_argv(data, "captioner", out, "--resume")
    if flag == "--data":
        other = tmp_path / "same-scenes-elsewhere"
        shutil.copytree(data["captioner"], other)
        argv[argv.index("--data") + 1] = str(other)
    elif changed[0] in argv:
        argv[argv.index(changed[0]) + 1] = changed[1]
    else:
        argv += list(changed)
    assert main(argv) == 2
    message = one_line_error(capsys)
    assert str(out / "checkpoint-") in message and f"written by a run with {flag} " in message, message
    assert (out / "final" / "model.safetensors").read_bytes() == final  # nothing was overwritten
    assert main(train_argv(data, "captioner", out, "--resume", "--save-every", "3", "--eval-every", "7")) == 0


def test_a_checkpoint_without_its_preprocessor_config_is_refused(data, reference, tmp_path, capsys):
    checkpoint = tmp_path / "model"
    shutil.copytree(os.path.join(reference("captioner"), "final"), checkpoint)
    os.remove(checkpoint / "preprocessor_config.json")
    argv = train_argv(data, "captioner", tmp_path / "out")
    argv[argv.index("--model") + 1] = str(checkpoint)
    assert main(argv) == 2
    message = one_line_error(capsys)
    assert str(checkpoint) in message and "preprocessor" in message


# ---- a full disk --------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 96 MB tmpfs when this process may mount one (root), else None (the full disk is then simulated)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        yield None
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    yield folder if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.parametrize("after_step", [2, 5])
def test_a_full_disk_is_one_line_and_resumable(after_step, data, reference, small_disk, tmp_path, monkeypatch,
                                               capsys):
    """The disk fills up after checkpoint-{after_step}: the next write (checkpoint-4, or loss.png after the last
    checkpoint) fails; the message names it, the earlier checkpoint is intact and --resume finishes the run."""
    import errno

    import xattn.train.checkpoints
    import xattn.train.loop

    out = (small_disk or tmp_path) / "out"
    filler = (small_disk or tmp_path) / "filler"
    real_save = xattn.train.loop.save_checkpoint

    def fill():
        if small_disk is None:  # the simulated disk is full while the filler exists
            filler.write_bytes(b"")
            return
        with open(filler, "wb") as f, pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()

    def save_then_fill(model, optimizer, step, history, config, run_options=None):
        real_save(model, optimizer, step, history, config, run_options)
        if step == after_step:
            fill()

    def full_when_filled(real):
        def write(*args, **kwargs):
            if filler.exists():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args, **kwargs)
        return write

    monkeypatch.setattr(xattn.train.loop, "save_checkpoint", save_then_fill)
    if small_disk is None:  # no tmpfs: the weights and the loss curve fail as on a full disk
        monkeypatch.setattr(xattn.train.checkpoints, "save_model", full_when_filled(xattn.train.checkpoints.save_model))
        monkeypatch.setattr(xattn.train.loop, "plot_history", full_when_filled(xattn.train.loop.plot_history))

    assert main(train_argv(data, "captioner", out)) == 2
    message = one_line_error(capsys)
    failed = out / ("checkpoint-4.tmp" if after_step == 2 else "loss.png")
    assert str(failed) in message and "No space left on device" in message and "--resume" in message, message
    assert (out / "latest").read_text() == f"checkpoint-{after_step}"
    assert not (out / "checkpoint-4.tmp").exists() and not (out / "final").exists()

    os.remove(filler)  # space is free again
    monkeypatch.undo()
    assert main(train_argv(data, "captioner", out, "--resume")) == 0
    assert_same_final(str(out), reference("captioner"))
