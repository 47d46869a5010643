"""Training images corrupted as real files are (xattn.datasets.augment, `xattn train --augment`): reproducible
corruptions of every kind, an augmented run that resumes bit-identically, the scene spec's three-shape sizes,
and the per-condition evaluation recipe."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from test_train_hostile import SCHEDULE, _write_scenes, assert_same_final, one_line_error

from xattn.cli import main
from xattn.datasets.augment import CORRUPTIONS, FILE_CONDITIONS, corrupt, draw_kinds
from xattn.datasets.scenes import IMAGE_SIZE, SIZES, THREE_SHAPE_SCALE, draw, scene_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_each_corruption_is_reproducible_rgb_and_changes_the_image(kind):
    image = draw(scene_for(4, 7))
    first = corrupt(image, random.Random(11), [kind])
    assert first.mode == "RGB"
    assert corrupt(image, random.Random(11), [kind]).tobytes() == first.tobytes()
    if kind == "resize":
        assert first.size != image.size and first.width == first.height and 32 <= first.width <= 1024
    else:
        assert first.size == image.size and first.tobytes() != image.tobytes()


def test_drawn_corruptions_are_reproducible_and_varied():
    images = [draw(scene_for(4, i)) for i in range(40)]
    once = [corrupt(im, random.Random(f"5:{i}")).tobytes() for i, im in enumerate(images)]
    again = [corrupt(im, random.Random(f"5:{i}")).tobytes() for i, im in enumerate(images)]
    assert once == again
    clean = sum(a == im.tobytes() for a, im in zip(once, images))
    assert 4 <= clean <= 24  # about 30% left as drawn
    rng = random.Random(0)
    drawn = [kind for _ in range(500) for kind in draw_kinds(rng)]
    assert set(drawn) == set(CORRUPTIONS)
    with pytest.raises(ValueError, match="unknown corruption 'sepia'"):
        corrupt(images[0], random.Random(0), ["sepia"])


def test_file_conditions_give_rgb_images_the_processor_takes():
    image = draw(scene_for(4, 0))
    for name, change in FILE_CONDITIONS.items():
        changed = change(image)
        assert changed.mode == "RGB", name
    assert FILE_CONDITIONS["resized 64->32->224"](image).size == (224, 224)
    assert FILE_CONDITIONS["resized 64->256->64"](image).size == (IMAGE_SIZE, IMAGE_SIZE)


def test_three_shape_scenes_scale_small_and_large_shapes_by_the_spec():
    seen = {"small": [], "large": []}
    for i in range(600):
        scene = scene_for(4, i)
        for shape in scene.shapes:
            factor = THREE_SHAPE_SCALE if len(scene.shapes) == 3 else 1.0
            low, high = SIZES[shape.size]
            assert low * factor <= shape.radius <= high * factor
            if len(scene.shapes) == 3:
                seen[shape.size].append(shape.radius)
    assert min(seen["small"]) >= 3.2 and max(seen["small"]) <= 4.8 and max(seen["small"]) > 4.5
    assert min(seen["large"]) >= 7.2 and max(seen["large"]) <= 9.6
    # the drawing before small shapes were scaled: the same captions, small shapes 4-6 px
    before = scene_for(4, 5, small_scale=1.0)
    assert before.caption == scene_for(4, 5).caption
    assert all(4.0 <= s.radius <= 6.0 for i in range(600) for s in scene_for(4, i, small_scale=1.0).shapes
               if s.size == "small")


def test_training_scenes_can_draw_small_shapes_at_both_readings_with_the_specs_captions(tmp_path):
    from PIL import Image

    from xattn.datasets.scenes import write_imagefolder

    write_imagefolder(str(tmp_path / "unscaled"), 40, 6, progress=False, small_scales=(1.0, 1.0))
    write_imagefolder(str(tmp_path / "mixed"), 40, 6, progress=False, small_scales=(0.8, 1.0))
    write_imagefolder(str(tmp_path / "spec"), 40, 6, progress=False)
    lines = {name: [json.loads(line) for line in open(tmp_path / name / "metadata.jsonl")]
             for name in ("unscaled", "mixed", "spec")}
    assert [r["text"] for r in lines["mixed"]] == [r["text"] for r in lines["spec"]] == \
        [scene_for(6, i).caption for i in range(40)]
    pixels = {name: [Image.open(tmp_path / name / r["file_name"]).tobytes() for r in rows]
              for name, rows in lines.items()}
    assert pixels["unscaled"] == [draw(scene_for(6, i, small_scale=1.0)).tobytes() for i in range(40)]
    three_small = [i for i in range(40) if any(len(scene_for(6, i).shapes) == 3 and s.size == "small"
                                               for s in scene_for(6, i).shapes)]
    assert three_small  # only these differ between the readings; the mixed set draws some at neither end
    differs = [i for i in three_small if pixels["mixed"][i] not in (pixels["spec"][i], pixels["unscaled"][i])]
    assert len(differs) >= len(three_small) // 2
    same = [i for i in range(40) if i not in three_small]
    assert all(pixels["mixed"][i] == pixels["spec"][i] == pixels["unscaled"][i] for i in same)


# ---- xattn train --augment ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """A tiny scenes folder as recipes/make_scenes.py writes it."""
    from xattn.datasets.tokenizer import train_caption_tokenizer

    root = tmp_path_factory.mktemp("scenes")
    _write_scenes(str(root / "train"), 8, 1)
    _write_scenes(str(root / "validation"), 2, 2)
    train_caption_tokenizer([scene_for(1, i).caption for i in range(500)], vocab_size=360).save_pretrained(
        str(root / "tokenizer"))
    return str(root)


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads():
    threads = torch.get_num_threads()  # --threads 1 sets them for the whole test process
    yield
    torch.set_num_threads(threads)


def augmented_argv(data, out, *extra):
    return ["train", "--data", data, "--model", "new-scene-captioner", "--out", str(out), *SCHEDULE, "--augment",
            *extra]


def test_an_interrupted_augmented_run_resumes_to_the_same_weights(scenes, tmp_path, monkeypatch):
    import xattn.datasets.augment
    import xattn.train.loop

    real_corrupt, corrupted = xattn.datasets.augment.corrupt, []

    def counted(image, rng, kinds=None):
        corrupted.append(1)
        return real_corrupt(image, rng, kinds)

    monkeypatch.setattr(xattn.datasets.augment, "corrupt", counted)
    assert main(augmented_argv(scenes, tmp_path / "unbroken")) == 0
    assert len(corrupted) == 10  # 5 steps of 2: every training image, none of the validation ones

    real_save = xattn.train.loop.save_checkpoint

    def save_then_stop(model, optimizer, step, history, config, run_options=None):
        real_save(model, optimizer, step, history, config, run_options)
        if step == 2:
            raise ValueError("stopped after checkpoint-2")

    monkeypatch.setattr(xattn.train.loop, "save_checkpoint", save_then_stop)
    out = tmp_path / "interrupted"
    assert main(augmented_argv(scenes, out)) == 2
    assert (out / "latest").read_text() == "checkpoint-2" and not (out / "final").exists()
    monkeypatch.setattr(xattn.train.loop, "save_checkpoint", real_save)
    assert main(augmented_argv(scenes, out, "--resume")) == 0
    assert_same_final(str(out), str(tmp_path / "unbroken"))


def test_each_use_of_a_training_image_is_corrupted_afresh(scenes):
    from xattn.datasets.digits import read_split
    from xattn.train.command import ImageRows

    rows = ImageRows(read_split(os.path.join(scenes, "train")), augment=True)
    random.seed(3)
    uses = [rows[0]["image"].tobytes() for _ in range(6)]
    random.seed(3)
    assert [rows[0]["image"].tobytes() for _ in range(6)] == uses
    assert len(set(uses)) >= 3
    plain = ImageRows(read_split(os.path.join(scenes, "train")))
    assert plain[0]["image"].tobytes() == plain[0]["image"].tobytes()


def test_augment_is_refused_for_a_speaker(scenes, tmp_path, capsys):
    """A speaker learns to say its training audio: corrupting it would teach the corruption."""
    argv = augmented_argv(scenes, tmp_path / "out")
    argv[argv.index("--model") + 1] = "new-speaker"
    assert main(argv) == 2
    message = one_line_error(capsys)
    assert "--augment" in message and "new-speaker" in message
    assert not os.path.exists(tmp_path / "out" / "latest")


# ---- evaluation per condition -------------------------------------------------------------------------------
def test_the_condition_recipe_scores_every_condition_and_the_samples(tmp_path):
    out = tmp_path / "eval-conditions.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "eval_captioner_conditions.py"),
                          "--count", "4", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["seed"] == 4
    assert set(FILE_CONDITIONS) < set(report["conditions"])
    for name, row in report["conditions"].items():
        assert row["images"] == 4 and 0 <= row["exact_match"] <= 1, name
        assert f"| {name} |" in run.stdout
    assert report["samples"]["images"] == 8
    assert "| shipped samples (data/samples) |" in run.stdout
    refused = subprocess.run([sys.executable, os.path.join(REPO, "recipes", "eval_captioner_conditions.py"),
                              "--seed", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--seed 1" in refused.stderr
