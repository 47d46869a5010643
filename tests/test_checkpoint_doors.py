"""Checkpoints and runs handed over carelessly or with intent: weights that leave tensors unset (transformers would
fill them with random values and xattn would caption on), a config asking for a million layers (built before any
weight is read), weights saved in fp16 or bf16 (the hub's habit), ids past the vocabulary, JSON nested past
Python's recursion limit, and a training run started into a folder that holds one."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from xattn.cli import main
from xattn.tasks.captioning import Captioner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTIONER = os.path.join(REPO, "data", "models", "scene-captioner")
IMAGE = os.path.join(REPO, "data", "samples", "scene-1.png")


def _copy(tmp_path, name="ck"):
    target = tmp_path / name
    shutil.copytree(CAPTIONER, target)
    return target


def _edit_json(path, edit):
    with open(path) as f:
        values = json.load(f)
    edit(values)
    with open(path, "w") as f:
        json.dump(values, f)


def _one_line(capsys, *needles):
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("Loading weights")]  # transformers' progress bar
    assert len(err) == 1 and "Traceback" not in err[0], err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def test_weights_that_leave_tensors_unset_are_refused(tmp_path, capsys):
    folder = _copy(tmp_path)
    weights = load_file(folder / "model.safetensors")
    dropped = [k for k in weights if ".h.1." in k]
    assert dropped
    save_file({k: v for k, v in weights.items() if k not in dropped}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"its weights do not set {len(dropped)} of the model's tensors"):
        Captioner(str(folder))
    assert main(["caption", IMAGE, "--model", str(folder)]) == 2
    _one_line(capsys, str(folder), "do not set")


def test_a_config_asking_for_more_layers_than_the_weights_hold_is_refused(tmp_path, capsys):
    folder = _copy(tmp_path)
    _edit_json(folder / "config.json", lambda c: c["decoder"].update(n_layer=c["decoder"]["n_layer"] + 2))
    with pytest.raises(ValueError, match="do not set"):
        Captioner(str(folder))
    _edit_json(folder / "config.json", lambda c: c["decoder"].update(n_layer=10**6))  # was a hang, memory growing
    assert main(["caption", IMAGE, "--model", str(folder)]) == 2
    _one_line(capsys, "n_layer=1000000; at most 1000")


def test_weights_whose_shapes_do_not_match_the_config_are_refused(tmp_path):
    folder = _copy(tmp_path)
    _edit_json(folder / "config.json", lambda c: c["decoder"].update(n_positions=7))
    with pytest.raises(ValueError, match="its weights' shapes do not match config.json"):
        Captioner(str(folder))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_checkpoint_saved_in_half_precision_runs_in_float32(tmp_path, dtype):
    folder = _copy(tmp_path)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(dtype) for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_json(folder / "config.json", lambda c: c.update(torch_dtype=str(dtype).removeprefix("torch."),
                                                          dtype=str(dtype).removeprefix("torch.")))
    captioner = Captioner(str(folder))
    assert captioner.engine.decoder.dtype == torch.float32
    assert captioner.caption_results([captioner.load(IMAGE)])[0]["caption"]  # was "convert it" to float16


@pytest.mark.parametrize("name", ["decoder_start_token_id", "pad_token_id"])
def test_a_start_or_pad_token_outside_the_vocabulary_is_refused(tmp_path, name):
    folder = _copy(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update({name: 10**6}))
    with pytest.raises(ValueError, match=rf"{name}=1000000 is outside the model's vocabulary"):
        Captioner(str(folder))


def test_json_nested_past_the_recursion_limit_names_its_file(tmp_path):
    folder = _copy(tmp_path)
    (folder / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not a readable JSON file"):
        Captioner(str(folder))


def test_training_into_a_folder_holding_a_run_needs_resume(tmp_path, capsys):
    data = tmp_path / "data"
    for sub in ("train", "validation", "tokenizer"):
        (data / sub).mkdir(parents=True)
    out = tmp_path / "out"
    (out / "checkpoint-6").mkdir(parents=True)
    (out / "latest").write_text("checkpoint-6")
    code = main(["train", "--data", str(data), "--model", "new-scene-captioner", "--out", str(out),
                 "--max-steps", "2"])
    assert code == 2
    _one_line(capsys, f"--out {out}: already holds a run (checkpoint-6, latest); pass --resume")
    assert (out / "checkpoint-6").is_dir() and (out / "latest").read_text() == "checkpoint-6"


def test_a_generation_bigger_than_the_machine_is_refused_before_allocating(tmp_path, capsys):
    assert main(["caption", IMAGE, "--num-beams", "100000000"]) == 2  # was an attempt at 3.6 TB
    _one_line(capsys, "needs 100000000 decoding rows", "GB of cache alone, more than this machine's")
    folder = _copy(tmp_path)
    _edit_json(folder / "generation_config.json", lambda g: g.update(num_beams=10**9))
    assert main(["caption", IMAGE, "--model", str(folder)]) == 2
    _one_line(capsys, "needs 1000000000 decoding rows")
    assert main(["speak", "four", "--num-return-sequences", "3", "-o", str(tmp_path / "x.wav")]) == 2
    _one_line(capsys, "--num-return-sequences: speak writes one audio")
    assert not (tmp_path / "x.wav").exists()


def test_preprocessor_sizes_past_reason_are_refused_at_load(tmp_path):
    from xattn.tasks.transcription import Transcriber

    folder = _copy(tmp_path)
    _edit_json(folder / "preprocessor_config.json", lambda p: p.update(size={"height": 60000, "width": 60000}))
    with pytest.raises(ValueError, match=r"preprocessor_config.json resizes images to height=60000"):
        Captioner(str(folder))  # was a MemoryError per image, blamed on the image
    recognizer = tmp_path / "rec"
    shutil.copytree(os.path.join(REPO, "data", "models", "digit-recognizer"), recognizer)
    for change, message in [({"sampling_rate": 10**9}, "sampling_rate=1000000000"),
                            ({"num_mel_bins": 10**7, "feature_size": 10**7}, "=10000000; at most 4096"),  # 19 GB
                            ({"stride": 0}, "stride=0")]:
        shutil.copy(os.path.join(REPO, "data", "models", "digit-recognizer", "preprocessor_config.json"),
                    recognizer / "preprocessor_config.json")
        _edit_json(recognizer / "preprocessor_config.json", lambda p, c=change: p.update(c))
        with pytest.raises(ValueError, match=message):
            Transcriber(str(recognizer))


def test_a_failing_evaluation_keeps_the_steps_before_it(tmp_path, capsys):
    from xattn.datasets.scenes import draw, scene_for
    from xattn.datasets.tokenizer import train_caption_tokenizer

    data = tmp_path / "scenes"
    for split, count, seed in (("train", 6, 1), ("validation", 2, 2)):
        (data / split).mkdir(parents=True)
        with open(data / split / "metadata.jsonl", "w") as f:
            for i in range(count):
                draw(scene_for(seed, i)).save(data / split / f"{i}.png")
                f.write(json.dumps({"file_name": f"{i}.png", "text": scene_for(seed, i).caption}) + "\n")
    (data / "validation" / "0.png").write_bytes((data / "validation" / "0.png").read_bytes()[:100])  # truncated
    train_caption_tokenizer([scene_for(1, i).caption for i in range(200)], vocab_size=360).save_pretrained(
        str(data / "tokenizer"))
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        code = main(["train", "--data", str(data), "--model", "new-scene-captioner", "--out", str(out),
                     "--max-steps", "4", "--batch-size", "2", "--save-every", "4", "--eval-every", "3", "--eval-limit",
                     "2", "--warmup-steps", "1", "--seed", "3", "--threads", "1", "--mixed-precision", "no"])
    finally:
        torch.set_num_threads(threads)
    assert code == 2
    assert "0.png: not a readable image" in capsys.readouterr().err
    assert (out / "checkpoint-3").is_dir() and (out / "latest").read_text().strip() == "checkpoint-3"


def test_ctrl_c_is_one_line_naming_resume(tmp_path, capsys, monkeypatch):
    from xattn.train import command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "main", interrupted)
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == (
        f"xattn train: interrupted; rerun with --resume to continue from the last checkpoint in {tmp_path / 'out'}")
