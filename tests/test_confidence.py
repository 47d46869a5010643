"""avg_logprob (faster-whisper's) on every result, and the low-confidence mark: calibrated per checkpoint
(confidence.json), tested on the shipped captioner against held-out scenes and inputs it was never meant for."""

import json
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import xattn
from conftest import tiny_captioner, with_eos
from xattn.cli import main
from xattn.datasets.scenes import draw, scene_for
from xattn.tasks.captioning import Captioner
from xattn.tasks.confidence import Confidence, calibrate, longest_run, repetition


def _teacher_forced(model, pixels, sequences, eos: int, group: int) -> torch.Tensor:
    """transformers' own forward over the finished sequences: mean log p(token) up to and including the first EOS."""
    with torch.no_grad():
        logits = model(pixel_values=pixels.repeat_interleave(group, dim=0), decoder_input_ids=sequences[:, :-1]).logits
    logprobs = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]
    means = []
    for row, scores in zip(sequences[:, 1:], logprobs):
        hits = (row == eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else len(row)
        means.append(scores[:n].mean())
    return torch.stack(means)


@pytest.mark.parametrize("weights,tolerance", [("exact", 1e-5), ("packed", 1e-4)])
@pytest.mark.parametrize("kwargs", [dict(), dict(num_beams=3, num_return_sequences=2),
                                    dict(do_sample=True, num_return_sequences=3, top_k=0)],
                         ids=["greedy", "beams", "sampling"])
def test_avg_logprob_is_the_models_own_mean_token_logprob(weights, tolerance, kwargs):
    model = tiny_captioner(seed=2)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    eos = 36  # greedy: rows 2 and 3 stop at their 4th token, row 1 never (the padding after EOS is left out)
    with_eos(model, eos)
    engine = xattn.from_hf(model, weights=weights)
    torch.manual_seed(0)
    out = engine.generate(pixel_values=pixels, return_dict_in_generate=True, max_new_tokens=12, **kwargs)
    if not kwargs:
        assert [bool((row == eos).any()) for row in out.sequences] == [False, True, True]
    group = out.sequences.shape[0] // pixels.shape[0]
    expected = _teacher_forced(model, pixels, out.sequences, eos, group)
    assert torch.allclose(out.avg_logprob, expected, atol=tolerance), (out.avg_logprob, expected)


def test_avg_logprob_scored_in_chunks_of_fewer_rows_than_inputs(monkeypatch):
    """Rows are replayed in chunks that keep their logits within a budget (a GPT-2 vocabulary: 10 rows of 33 tokens);
    a chunk of fewer rows than inputs reads each row's own encoder row (it was refused as 'not a multiple')."""
    import xattn.hf.scores as scores

    engine = xattn.from_hf(tiny_captioner(seed=2))
    pixels = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    kwargs = dict(return_dict_in_generate=True, max_new_tokens=8, num_beams=2, num_return_sequences=2)
    whole = engine.generate(pixel_values=pixels, **kwargs)
    monkeypatch.setattr(scores, "_LOGIT_BUDGET", 1)  # one row at a time
    chunked = engine.generate(pixel_values=pixels, **kwargs)
    assert torch.equal(chunked.sequences, whole.sequences)
    torch.testing.assert_close(chunked.avg_logprob, whole.avg_logprob, rtol=0, atol=1e-6)


def test_greedy_avg_logprob_equals_transformers_generate_logits():
    model = tiny_captioner(seed=6)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    theirs = model.generate(pixel_values=pixels, max_new_tokens=10, output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(theirs.logits, dim=1).log_softmax(-1)  # [B, new, V], the raw logits of each step
    chosen = steps.gather(-1, theirs.sequences[:, 1:, None])[..., 0]
    ours = xattn.from_hf(model).generate(pixel_values=pixels, max_new_tokens=10, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.allclose(ours.avg_logprob, chosen.mean(-1), atol=1e-5)


def test_repetition_and_judgement():
    assert repetition("a large large large red star") == "large"
    assert repetition("a red star a red star a red star") == "a red star"
    assert repetition("a large red star, a large red star and a large red star") is None  # commas differ
    assert repetition("two two four") is None and repetition("two two two", times=4) is None
    assert longest_run(["one two two two", "three"]) == 3 and longest_run(["a b"]) == 1
    rule = Confidence(-0.05)
    assert rule.judge("a small red circle", -0.01) is None
    assert "below the model's calibrated -0.050" in rule.judge("a small red circle", -0.2)
    assert rule.judge("", float("nan")) is not None  # nothing generated is never trusted
    assert "degenerate repetition" in Confidence(None).judge("a a a", -0.001)
    assert calibrate([-0.5] + [-0.01] * 99, unmarked=0.99) == -0.01


@pytest.mark.parametrize("content,message", [
    ("{", "not a calibration xattn wrote"), ('{"repeats": 3}', "not a calibration xattn wrote"),
    ('{"avg_logprob_threshold": "low"}', "must be a log-probability"),
    ('{"avg_logprob_threshold": true}', "must be a log-probability"),
    ('{"avg_logprob_threshold": 0.5}', "must be a log-probability"),
    ('{"avg_logprob_threshold": NaN}', "must be a log-probability"),
    ('{"avg_logprob_threshold": -0.1, "repeats": 1}', "repeats must be a whole number"),
    ('{"avg_logprob_threshold": -0.1, "repeats": 2.5}', "repeats must be a whole number"),
])
def test_a_bad_calibration_file_is_refused_in_one_line(tmp_path, content, message):
    (tmp_path / "confidence.json").write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        Confidence.from_pretrained(str(tmp_path))
    assert "confidence.json" in str(error.value) and "\n" not in str(error.value)


# ---- the shipped captioner ---------------------------------------------------------------------------------------
def _noise(rng):
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))


def _gradient(rng, i):
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, 64)[:, None, None] if i % 2 else np.linspace(0, 1, 64)[None, :, None]
    return Image.fromarray((a * (1 - t) + b * t * np.ones((64, 64, 1))).astype(np.uint8))


def _text(rng, i):
    image = Image.new("RGB", (64, 64), tuple(int(v) for v in rng.integers(0, 256, 3)))
    words = ["hello", "xattn", "STOP", "cat", "42", "exit", "GPT-2", "menu"]
    ImageDraw.Draw(image).text((int(rng.integers(0, 24)), int(rng.integers(0, 48))), words[i % len(words)],
                               fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return image


@pytest.fixture(scope="module")
def shipped():
    return Captioner()


def _marked(captioner, images) -> list[bool]:
    from xattn.tasks.vision import pixel_values

    marks = []
    for start in range(0, len(images), 50):
        pixels = list(pixel_values(captioner.processor, images[start: start + 50]))
        marks += [r["low_confidence"] for r in captioner.caption_results(pixels)]
    return marks


def test_the_shipped_captioner_trusts_held_out_scenes_and_doubts_what_it_was_not_made_for(shipped):
    assert shipped.confidence.threshold is not None  # calibrated on validation scenes (seed 2)
    held_out = _marked(shipped, [draw(scene_for(3, i)) for i in range(300)])  # the test split's seed
    assert sum(held_out) / len(held_out) <= 0.02
    rng = np.random.default_rng(11)
    for name, images in [("noise", [_noise(rng) for _ in range(40)]),
                         ("gradients", [_gradient(rng, i) for i in range(40)]),
                         ("drawn text", [_text(rng, i) for i in range(40)])]:
        marks = _marked(shipped, images)
        assert sum(marks) / len(marks) >= 0.9, name


def test_caption_lines_carry_avg_logprob_and_a_mark_with_one_stderr_line(shipped, tmp_path, capsys):
    good = tmp_path / "scene.png"
    draw(scene_for(3, 0)).save(good)
    noise = tmp_path / "noise.png"
    _gradient(np.random.default_rng(0), 0).save(noise)
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(good), str(noise), "-o", str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["low_confidence"] for r in rows] == [False, True]
    assert all(isinstance(r["avg_logprob"], float) and r["avg_logprob"] <= 0 for r in rows)
    assert "low_confidence_reason" in rows[1] and "low_confidence_reason" not in rows[0]
    err = [line for line in capsys.readouterr().err.splitlines() if "low confidence" in line]
    assert err == [f"xattn caption: low confidence: {noise}: {rows[1]['low_confidence_reason']}"]
    out2 = tmp_path / "beams.jsonl"
    assert main(["caption", str(good), "-o", str(out2), "--quiet", "--num-beams", "3",
                 "--num-return-sequences", "2"]) == 0
    row = json.loads(out2.read_text())
    assert len(row["captions"]) == len(row["avg_logprobs"]) == len(row["low_confidences"]) == 2
    assert all(math.isfinite(v) for v in row["avg_logprobs"])


def test_a_checkpoint_without_calibration_marks_only_repetition(tmp_path):
    from conftest import save_task_models

    paths = save_task_models(tmp_path)
    assert not os.path.exists(os.path.join(paths["captioner"], "confidence.json"))
    assert Captioner(paths["captioner"]).confidence == Confidence(None)
