"""--model, xattn.load() and train --model take hub ids, resolved through huggingface_hub's cache as from_pretrained
resolves them (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT, revision). Nothing can be downloaded here, so the tests build
a Hugging Face cache from the shipped models and run xattn in fresh processes pointed at it."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file

from conftest import save_task_models
from xattn.cli import main
from xattn.tasks import SHIPPED_MODELS

SAMPLES = os.path.join(os.path.dirname(SHIPPED_MODELS), "samples")
MAIN, V1 = "1" * 40, "2" * 40  # the commits behind refs/main and the tag v1


def _cache_entry(hub, repo_id: str, folder: str, commit: str, ref: str = "main") -> None:
    """A repository as huggingface_hub lays out its cache: snapshots/<commit>/ and refs/<ref> naming it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hub = root / "hub"
    tiny = save_task_models(tmp_path_factory.mktemp("tiny"))
    _cache_entry(hub, "xattn-test/scene-captioner", os.path.join(SHIPPED_MODELS, "scene-captioner"), MAIN)
    _cache_entry(hub, "xattn-test/scene-captioner", tiny["captioner"], V1, ref="v1")
    _cache_entry(hub, "xattn-test/digit-recognizer", os.path.join(SHIPPED_MODELS, "digit-recognizer"), MAIN)
    _cache_entry(hub, "xattn-test/speaker", os.path.join(SHIPPED_MODELS, "speaker"), MAIN)
    payload = root / "payload"
    shutil.copytree(os.path.join(SHIPPED_MODELS, "scene-captioner"), payload)
    config = json.loads((payload / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "payload.PayloadConfig"}
    (payload / "config.json").write_text(json.dumps(config))
    (payload / "payload.py").write_text(f"open({str(root / 'marker')!r}, 'w').close()\n")
    _cache_entry(hub, "xattn-test/payload", str(payload), MAIN)
    for split in ("train", "validation"):
        (root / "data" / split).mkdir(parents=True)
    return {"root": root, "tiny": tiny}


def _env(hf_home, offline: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(hf_home["root"])
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:  # "online", with a hub that refuses every connection: what a machine without network sees
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    return env


def _xattn(hf_home, *argv, offline: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xattn.cli", *argv], env=_env(hf_home, offline), capture_output=True,
                          text=True, timeout=600)


def _captions(output: str) -> list[str]:
    return [json.loads(line)["caption"] for line in output.splitlines()]


IMAGES = [os.path.join(SAMPLES, f"scene-{i}.{'jpg' if i in (0, 4) else 'png'}") for i in range(3)]


def test_caption_by_hub_id_equals_the_local_folder_offline_and_without_a_hub(hf_home, capsys):
    assert main(["caption", *IMAGES, "-o", "-", "--quiet"]) == 0
    expected = _captions(capsys.readouterr().out)
    for offline in (True, False):  # HF_HUB_OFFLINE, or a hub that cannot be reached: the cache serves both
        run = _xattn(hf_home, "caption", *IMAGES, "--model", "xattn-test/scene-captioner", "-o", "-", "--quiet",
                     offline=offline)
        assert run.returncode == 0, run.stderr
        assert _captions(run.stdout) == expected


def test_revision_picks_the_tagged_snapshot(hf_home, capsys):
    assert main(["caption", *IMAGES, "--model", hf_home["tiny"]["captioner"], "-o", "-", "--quiet"]) == 0
    tiny = _captions(capsys.readouterr().out)
    run = _xattn(hf_home, "caption", *IMAGES, "--model", "xattn-test/scene-captioner", "--revision", "v1", "-o", "-",
                 "--quiet")
    assert run.returncode == 0, run.stderr
    assert _captions(run.stdout) == tiny
    run = _xattn(hf_home, "caption", IMAGES[0], "--model", "xattn-test/scene-captioner", "--revision", "v2")
    assert run.returncode == 2 and "not in the Hugging Face cache at revision v2" in run.stderr


SCRIPT = """
import torch, transformers, xattn
tokens = {}
for revision in ("main", "v1"):  # main: the shipped captioner; v1: a tiny one of another shape
    model = transformers.VisionEncoderDecoderModel.from_pretrained("xattn-test/scene-captioner", revision=revision)
    size = model.config.encoder.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    expected = model.generate(pixel_values=pixels, max_new_tokens=8)
    ours = xattn.load("xattn-test/scene-captioner", revision=revision)
    assert ours.hf_model.config.encoder.hidden_size == model.config.encoder.hidden_size, revision
    assert torch.equal(ours.generate(pixel_values=pixels, max_new_tokens=8), expected), revision
    tokens[revision] = expected
assert tokens["main"].shape != tokens["v1"].shape or not torch.equal(tokens["main"], tokens["v1"])
print("same tokens as transformers")
"""


def test_load_by_hub_id_reads_what_transformers_reads(hf_home):
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=_env(hf_home), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "same tokens as transformers" in run.stdout, run.stderr


def test_transcribe_and_speak_by_hub_id(hf_home, tmp_path, capsys):
    clips = [os.path.join(SAMPLES, f"digits-{i}.wav") for i in (0, 1)]
    assert main(["transcribe", *clips, "-o", "-", "--quiet"]) == 0
    expected = capsys.readouterr().out
    run = _xattn(hf_home, "transcribe", *clips, "--model", "xattn-test/digit-recognizer", "-o", "-", "--quiet")
    assert run.returncode == 0 and run.stdout == expected, run.stderr
    local, by_id = str(tmp_path / "local.wav"), str(tmp_path / "id.wav")
    assert main(["speak", "four two seven", "-o", local, "--seed", "5"]) == 0  # the speaker samples
    run = _xattn(hf_home, "speak", "four two seven", "--model", "xattn-test/speaker", "-o", by_id, "--seed", "5")
    assert run.returncode == 0, run.stderr
    assert np.array_equal(soundfile.read(local)[0], soundfile.read(by_id)[0])


@pytest.mark.parametrize("offline,how", [(True, "HF_HUB_OFFLINE is set, so the hub was not asked"),
                                         (False, "the hub (http://127.0.0.1:9) could not be reached")])
def test_a_missing_id_says_where_it_was_looked_up(hf_home, offline, how):
    for argv in (["caption", IMAGES[0]], ["transcribe", "x.wav"], ["speak", "one"],
                 ["train", "--data", str(hf_home["root"] / "data"), "--out", str(hf_home["root"] / "run")]):
        run = _xattn(hf_home, *argv, "--model", "xattn-test/missing", offline=offline)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert "xattn-test/missing: no such local folder, and not in the Hugging Face cache" in lines[0]
        assert str(hf_home["root"] / "hub") in lines[0] and how in lines[0]


def test_a_hub_checkpoint_asking_for_its_own_code_is_refused(hf_home):
    run = _xattn(hf_home, "caption", IMAGES[0], "--model", "xattn-test/payload")
    assert run.returncode == 2 and "its own Python code" in run.stderr
    assert not (hf_home["root"] / "marker").exists()


def test_paths_are_never_taken_for_hub_ids(tmp_path, capsys):
    for name in ("./missing", str(tmp_path / "missing"), "a/b/c", "../x"):
        assert main(["caption", IMAGES[0], "--model", name]) == 2
        assert capsys.readouterr().err.strip() == f"xattn caption: error: {name}: no such checkpoint directory"
    assert main(["caption", IMAGES[0], "--model", hf_dir := os.path.join(SHIPPED_MODELS, "scene-captioner"),
                 "--revision", "v1"]) == 2
    assert f"{hf_dir} is a local folder; --revision applies only to hub ids" in capsys.readouterr().err


def test_train_from_a_hub_id_equals_training_from_the_folder(hf_home, tmp_path):
    from xattn.datasets.scenes import draw, scene_for

    data = tmp_path / "data"
    for split, count in (("train", 2), ("validation", 1)):
        (data / split).mkdir(parents=True)
        with open(data / split / "metadata.jsonl", "w") as f:
            for i in range(count):
                draw(scene_for(7, i)).save(data / split / f"{i}.png")
                f.write(json.dumps({"file_name": f"{i}.png", "text": scene_for(7, i).caption}) + "\n")
    schedule = ["--data", str(data), "--max-steps", "1", "--batch-size", "2", "--eval-every", "100", "--threads", "1",
                "--seed", "3", "--mixed-precision", "no"]
    threads = torch.get_num_threads()
    try:
        assert main(["train", *schedule, "--model", os.path.join(SHIPPED_MODELS, "scene-captioner"), "--out",
                     str(tmp_path / "local")]) == 0
    finally:
        torch.set_num_threads(threads)
    run = _xattn(hf_home, "train", *schedule, "--model", "xattn-test/scene-captioner", "--out", str(tmp_path / "hub"))
    assert run.returncode == 0, run.stderr
    local, hub = (load_file(str(tmp_path / name / "final" / "model.safetensors")) for name in ("local", "hub"))
    assert local.keys() == hub.keys() and all(torch.equal(local[k], hub[k]) for k in local)
