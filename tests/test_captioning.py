"""Captioning: scenes match their spec, the CLI captions files and folders, batch jobs lose nothing."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from xattn.cli import main
from xattn.datasets.scenes import IMAGE_SIZE, draw, scene_for, vocabulary
from xattn.datasets.tokenizer import train_caption_tokenizer
from xattn.tasks.captioning import Captioner, new_scene_captioner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scene_captions_follow_the_geometry():
    for i in range(300):
        scene = scene_for(5, i)
        shapes = scene.shapes
        for a, b in zip(shapes, shapes[1:]):
            if scene.layout == "row":
                assert b.x - a.x > 2 * abs(b.y - a.y)  # clearly to the right, not below
            else:
                assert b.y - a.y > 2 * abs(b.x - a.x)
        for s in shapes:
            assert s.radius <= s.x <= IMAGE_SIZE - s.radius and s.radius <= s.y <= IMAGE_SIZE - s.radius
        for a in range(len(shapes)):  # no overlap
            for b in range(a + 1, len(shapes)):
                gap = math.dist((shapes[a].x, shapes[a].y), (shapes[b].x, shapes[b].y))
                assert gap > shapes[a].radius + shapes[b].radius
        assert set(scene.caption.replace(",", " ,").split()) <= set(vocabulary())


def test_scenes_are_reproducible_and_drawn_in_their_colours():
    scene = scene_for(9, 4)
    assert scene_for(9, 4) == scene and scene_for(9, 5) != scene
    image = draw(scene)
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE) and image.mode == "RGB"
    assert draw(scene).tobytes() == image.tobytes()
    from xattn.datasets.scenes import COLOURS
    for shape in scene.shapes:
        assert image.getpixel((int(shape.x), int(shape.y))) == pytest.approx(COLOURS[shape.colour], abs=40)


def test_tokenizer_gives_one_token_per_word_and_round_trips():
    captions = [scene_for(1, i).caption for i in range(2000)]
    tokenizer = train_caption_tokenizer(captions, vocab_size=360)
    for caption in captions[:50]:
        ids = tokenizer(caption)["input_ids"]
        assert len(ids) == len(caption.replace(",", " ,").split())
        assert tokenizer.decode(ids) == caption


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random scene captioner saved like the shipped one (weights + tokenizer + image processor)."""
    path = tmp_path_factory.mktemp("captioner")
    tokenizer = train_caption_tokenizer([scene_for(1, i).caption for i in range(500)], vocab_size=360)
    torch.manual_seed(0)
    model, processor = new_scene_captioner(tokenizer)
    model.generation_config.max_new_tokens = 6
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path), model, processor, tokenizer


def test_captioner_output_equals_transformers_generate(tiny_checkpoint):
    path, model, processor, tokenizer = tiny_checkpoint
    images = [draw(scene_for(3, i)) for i in range(4)]
    captioner = Captioner(path)
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    expected = tokenizer.batch_decode(model.eval().generate(pixel_values=pixels, num_beams=3),
                                      skip_special_tokens=True)
    assert captioner.caption(images, num_beams=3) == [e.strip() for e in expected]


def test_cli_captions_a_folder_to_jsonl_and_reports_bad_files(tiny_checkpoint, tmp_path, capsys):
    path = tiny_checkpoint[0]
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        draw(scene_for(3, i)).save(folder / f"{i}.png")
    (folder / "2.png").write_bytes(b"this is not a png")
    Image.new("LA", (40, 30)).save(folder / "gray-alpha.png")  # unusual modes just work
    out = tmp_path / "captions.jsonl"
    code = main(["caption", str(folder), "--model", path, "-o", str(out), "--batch-size", "2", "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 1  # one file failed
    assert [os.path.basename(r["file"]) for r in rows] == ["0.png", "1.png", "2.png", "3.png", "4.png",
                                                           "gray-alpha.png"]
    assert "not a readable image" in rows[2]["error"] and all("caption" in r for i, r in enumerate(rows) if i != 2)


def test_rerun_after_a_kill_gives_the_output_of_an_unbroken_run(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint[0]
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        draw(scene_for(3, i)).save(folder / f"{i}.png")
    whole, broken = tmp_path / "whole.jsonl", tmp_path / "broken.jsonl"
    assert main(["caption", str(folder), "--model", path, "-o", str(whole), "--quiet"]) == 0
    lines = whole.read_text().splitlines(keepends=True)
    broken.write_text("".join(lines[:2]) + lines[2][:7])  # killed while writing the third line
    assert main(["caption", str(folder), "--model", path, "-o", str(broken), "--quiet"]) == 0
    assert broken.read_text() == whole.read_text()


def test_attention_map_png(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint[0]
    image = tmp_path / "scene.png"
    draw(scene_for(3, 1)).save(image)
    out = tmp_path / "map.png"
    assert main(["caption", str(image), "--model", path, "--attention-map", str(out)]) == 0
    with Image.open(out) as picture:
        assert picture.width > 200 and picture.height > 100


def test_missing_file_and_bad_model_give_one_line_errors(tiny_checkpoint, tmp_path):
    script = os.path.join(REPO, "recipes", "caption.py")
    run = subprocess.run([sys.executable, script, str(tmp_path / "nope.png"), "--model", tiny_checkpoint[0]],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "no such file" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, script, str(tmp_path / "x.png"), "--model", str(tmp_path / "nomodel")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "Traceback" not in run.stderr


def test_nlpconnect_layout_checkpoint_captions_through_model_flag(tmp_path):
    """ViT-B/16 at 224 px + GPT-2 small with bos = eos = decoder_start = 50256 and a GPT-2-style byte-level
    tokenizer: the layout of nlpconnect/vit-gpt2-image-captioning, with random weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        GPT2Config,
        PreTrainedTokenizerFast,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
        ViTImageProcessor,
    )

    torch.manual_seed(0)
    decoder = GPT2Config(add_cross_attention=True, is_decoder=True, bos_token_id=50256, eos_token_id=50256)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), decoder)
    config.decoder_start_token_id = config.pad_token_id = config.eos_token_id = 50256
    model = VisionEncoderDecoderModel(config)
    model.generation_config.update(max_length=8, num_beams=2, decoder_start_token_id=50256, eos_token_id=50256,
                                   pad_token_id=50256, bos_token_id=50256)
    model.save_pretrained(tmp_path)
    processor = ViTImageProcessor(size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(tmp_path)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"tok{i}": i for i in range(len(vocab), 50256)})
    vocab["<|endoftext|>"] = 50256
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    gpt2_style = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    gpt2_style.save_pretrained(tmp_path)
    image = tmp_path / "photo.jpg"
    Image.new("RGB", (320, 240), (90, 140, 200)).save(image)
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(image), "--model", str(tmp_path), "-o", str(out), "--quiet"]) == 0
    row = json.loads(out.read_text())
    assert isinstance(row["caption"], str) and "error" not in row


def test_upscale_recipe_gives_what_transformers_interpolation_gives(tiny_checkpoint, tmp_path):
    """recipes/upscale_captioner.py (how the shipped captioner went from 64 to 96 px): the new checkpoint's plain
    forward at 96 px equals transformers' own interpolate_pos_encoding forward of the 64 px one, and its
    processor resizes to 96."""
    from transformers import AutoImageProcessor, VisionEncoderDecoderModel

    source, model, _, _ = tiny_checkpoint
    out = tmp_path / "up96"
    run = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "upscale_captioner.py"), source, str(out),
                          "--image-size", "96"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    upscaled = VisionEncoderDecoderModel.from_pretrained(out).eval()
    assert upscaled.config.encoder.image_size == 96
    assert AutoImageProcessor.from_pretrained(out).size == {"height": 96, "width": 96}
    pixels = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval().encoder(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
        assert torch.allclose(upscaled.encoder(pixel_values=pixels).last_hidden_state, expected, atol=1e-5)
    refused = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "upscale_captioner.py"), source,
                              str(tmp_path / "bad"), "--image-size", "100"], capture_output=True, text=True)
    assert refused.returncode != 0 and "not a multiple of the patch size" in refused.stderr
