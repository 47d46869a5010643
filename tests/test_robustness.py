"""Safe loading and sharded batch jobs."""

import json
import os

import pytest
import torch

import xattn
from conftest import tiny_captioner
from xattn.cli import main


@pytest.fixture(scope="module")
def pickle_checkpoint(tmp_path_factory):
    """A checkpoint whose weights exist only as a pickle (pytorch_model.bin), as older hub repositories hold."""
    path = tmp_path_factory.mktemp("pickled")
    model = tiny_captioner(seed=5)
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return str(path), model


def test_pickle_weights_are_refused_unless_allowed(pickle_checkpoint):
    path, model = pickle_checkpoint
    with pytest.raises(ValueError, match="allow_pickle=True"):
        xattn.load(path)
    engine = xattn.load(path, allow_pickle=True)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(engine.generate(pixel_values=pixels, max_new_tokens=5),
                       model.generate(pixel_values=pixels, max_new_tokens=5))


def test_cli_refuses_pickle_weights_with_a_hint(pickle_checkpoint, tmp_path, capsys):
    from PIL import Image

    image = str(tmp_path / "x.png")
    Image.new("RGB", (32, 32), "red").save(image)
    assert main(["caption", image, "--model", pickle_checkpoint[0]]) == 2
    assert "--allow-pickle" in capsys.readouterr().err


def test_shards_split_the_files_and_together_equal_one_job(tmp_path):
    from PIL import Image
    from transformers import ViTImageProcessor

    from xattn.datasets.tokenizer import train_caption_tokenizer

    model_dir = str(tmp_path / "model")
    tiny_captioner(seed=6).save_pretrained(model_dir)
    train_caption_tokenizer(["a b c d e f g h"] * 5, vocab_size=300).save_pretrained(model_dir)  # decodes its ids
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(model_dir)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(7):
        Image.new("RGB", (32, 32), (30 * i, 10, 200 - 20 * i)).save(folder / f"{i}.png")
    whole = tmp_path / "whole.jsonl"
    assert main(["caption", str(folder), "--model", model_dir, "-o", str(whole), "--quiet"]) == 0
    rows = []
    for i in range(3):
        out = tmp_path / f"shard{i}.jsonl"
        assert main(["caption", str(folder), "--model", model_dir, "-o", str(out), "--shard", f"{i}/3",
                     "--quiet"]) == 0
        rows += [json.loads(line) for line in out.read_text().splitlines()]
    expected = [json.loads(line) for line in whole.read_text().splitlines()]
    assert sorted(rows, key=lambda r: r["file"]) == sorted(expected, key=lambda r: r["file"]) and len(rows) == 7
    assert main(["caption", str(folder), "--model", model_dir, "--shard", "3/3"]) == 2  # argparse's usage error
    assert os.path.exists(whole)


@pytest.mark.parametrize("argv,message", [
    (["--data", "/nonexistent", "--out", "x"], "no train/ folder"),
    (["--data", "DATA", "--out", "x", "--model", "new-thing"], "unknown --model"),
    (["--data", "DATA", "--out", "x", "--model", "./missing-checkpoint"], "no such checkpoint directory"),
    (["--data", "DATA", "--out", "x", "--mixed-precision", "fp8"], "argument --mixed-precision: invalid choice"),
])
def test_train_command_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    data = tmp_path / "data"
    for split in ("train", "validation", "tokenizer"):
        (data / split).mkdir(parents=True)
    argv = [str(data) if a == "DATA" else a for a in argv]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
