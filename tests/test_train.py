"""Fine-tuning: gradient checkpointing changes no gradient; a killed run resumes to the same weights."""

import numpy as np
import pytest
import torch
import transformers
from transformers.models.vision_encoder_decoder.modeling_vision_encoder_decoder import shift_tokens_right

from conftest import tiny_captioner, tiny_recognizer
from xattn.train import chunked_loss
from xattn.train.loop import TrainConfig, batch_indices, enable_checkpointing, latest_checkpoint, train


class RandomCaptions:
    """A deterministic toy data set: random images, random 6-token captions (+ EOS)."""

    def __init__(self, n=48):
        g = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(3, 99, (n, 7), generator=g)
        self.labels[:, -1] = 2

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def collate(rows):
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def assert_same_weights(a, b):
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name


def _dropout_model(seed=61):
    model = tiny_captioner(seed=seed, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    return model


def test_gradient_checkpointing_gives_the_same_gradients():
    data = RandomCaptions()
    batch = collate([data[i] for i in range(8)])
    grads = []
    for checkpointing in (False, True):
        model = tiny_captioner(seed=62)
        model.train()
        if checkpointing:
            enable_checkpointing(model)
        model.config.use_cache = False
        torch.manual_seed(0)  # the same dropout masks in both runs (non-reentrant checkpointing replays RNG)
        model(**batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    assert any("crossattention" in n for n in plain)  # the cross-attention path is covered
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-5, rtol=0), name


@pytest.mark.parametrize("make,name", [(tiny_captioner, "pixel_values"), (tiny_recognizer, "input_values")])
def test_the_loops_losses_are_the_encoder_decoder_loss_with_its_gradients(make, name):
    """chunked_loss.loss (with checkpointing) and full_loss equal the cross-entropy of the model's logits against
    the labels, decoder inputs shifted by transformers' own shift_tokens_right; on 4.57 the captioner's own .loss
    shifts twice (transformers #40111), on 5.x it is this loss too."""
    generator = torch.Generator().manual_seed(1)
    inputs = {name: torch.randn(3, 3, 32, 32, generator=generator)} if name == "pixel_values" else \
        {name: torch.randn(3, 1600, generator=generator), "attention_mask": torch.ones(3, 1600, dtype=torch.long)}
    if name == "input_values":
        inputs["attention_mask"][2, 1200:] = 0  # a shorter clip: the encoder mask reaches the decoder
    labels = torch.randint(3, 90, (3, 9), generator=generator)
    labels[1, 6:] = -100  # padding, ignored
    results = {}
    for way in ("reference", "full", "chunked", "model's own"):
        model = make(seed=3).train()
        model.config.use_cache = False
        if way == "chunked":
            enable_checkpointing(model)
        assert chunked_loss.applies(model)
        torch.manual_seed(5)  # the same dropout masks; wav2vec2 draws its time masks from numpy
        np.random.seed(5)
        if way == "reference":
            start = shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)
            logits = model(**inputs, decoder_input_ids=start).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        elif way == "full":
            loss = chunked_loss.full_loss(model, labels=labels, **inputs)
        elif way == "chunked":
            loss = chunked_loss.loss(model, labels=labels, chunk_rows=4, **inputs)
        else:
            loss = model(**inputs, labels=labels).loss
        loss.backward()
        results[way] = (loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    reference_loss, reference = results["reference"]
    assert any("lm_head" in n or "wte" in n for n in reference)
    ways = ["full", "chunked"] + (["model's own"] if int(transformers.__version__.split(".")[0]) >= 5 else [])
    for way in ways:
        value, gradients = results[way]
        assert value == pytest.approx(reference_loss, abs=1e-5), way
        assert gradients.keys() == reference.keys(), way
        for key in reference:
            assert torch.allclose(reference[key], gradients[key], atol=1e-5, rtol=0), (way, key)


def _chunked_and_reference_gradients(model_seed, tie, passes=1, autocast=False):
    """(reference, chunked) gradients of `passes` backward passes over two batches (accumulated in .grad)."""
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 3, 32, 32, generator=generator), torch.randint(3, 90, (2, 7), generator=generator))
               for _ in range(passes)]
    batches[0][1][0, 4:] = -100
    results = []
    for way in ("reference", "chunked"):
        model = tiny_captioner(seed=model_seed, tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0).train()
        model.config.use_cache = False
        assert (model.decoder.lm_head.weight is model.decoder.get_input_embeddings().weight) == tie
        for pixels, labels in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if way == "reference":
                    loss = chunked_loss.full_loss(model, labels=labels, pixel_values=pixels)
                else:
                    loss = chunked_loss.loss(model, labels=labels, chunk_rows=3, pixel_values=pixels)
            loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return results


@pytest.mark.parametrize("tie,passes", [(True, 2), (False, 1), (False, 2)])
def test_the_chunked_loss_accumulates_gradients_like_autograd(tie, passes):
    """Gradients already in .grad are added to (gradient accumulation), a head not tied to the embeddings gets its
    gradient too."""
    reference, chunked = _chunked_and_reference_gradients(7, tie, passes)
    assert reference.keys() == chunked.keys() and any("lm_head" in n or "wte" in n for n in reference)
    for key in reference:
        assert torch.allclose(reference[key], chunked[key], atol=1e-5, rtol=0), key


def test_the_chunked_loss_under_bf16_autocast_is_autocasts_loss():
    reference, chunked = _chunked_and_reference_gradients(8, True, autocast=True)
    assert reference.keys() == chunked.keys()
    for key in reference:  # bf16 products: the two sum in different orders
        torch.testing.assert_close(chunked[key], reference[key], atol=2e-3, rtol=2e-2, msg=key)


def test_the_chunked_loss_puts_the_heads_gradient_in_grad_before_backward_reaches_the_embeddings():
    """The tied head's gradient (vocab x hidden) must not wait in autograd through the whole backward."""
    model = tiny_captioner(seed=9).train()
    model.config.use_cache = False
    enable_checkpointing(model)
    embeddings = model.decoder.get_input_embeddings()
    assert model.decoder.lm_head.weight is embeddings.weight
    seen = []

    def look(grad):  # runs when backward reaches the embeddings' output, before their own gradient
        seen.append(None if embeddings.weight.grad is None else embeddings.weight.grad.abs().sum().item())

    def on_output(module, args, out):
        out.register_hook(look)

    embeddings.register_forward_hook(on_output)
    labels = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    chunked_loss.loss(model, labels=labels, chunk_rows=4, pixel_values=torch.randn(2, 3, 32, 32)).backward()
    assert seen and seen[0] is not None and seen[0] > 0


def test_the_training_loop_chunks_the_loss_with_checkpointing_and_never_takes_the_models_own(tmp_path, monkeypatch):
    calls = {"loss": 0, "full_loss": 0}

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    for name in calls:
        monkeypatch.setattr(chunked_loss, name, counted(name, getattr(chunked_loss, name)))
    data = RandomCaptions()
    for checkpointing in (False, True):
        config = TrainConfig(output_dir=str(tmp_path / str(checkpointing)), max_steps=2, batch_size=4,
                             warmup_steps=1, mixed_precision="no", gradient_checkpointing=checkpointing)
        train(tiny_captioner(seed=64), data, collate, config, progress=False)
        assert calls == ({"loss": 2, "full_loss": 2} if checkpointing else {"loss": 0, "full_loss": 2})


def test_checkpointing_is_really_on():
    model = tiny_captioner(seed=63)
    enable_checkpointing(model)
    for part in (model.encoder, model.decoder):
        layers = [m for m in part.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and any(m.gradient_checkpointing for m in layers)


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    data = RandomCaptions()
    kwargs = dict(max_steps=10, batch_size=8, learning_rate=3e-3, warmup_steps=2, save_every=3, eval_every=5,
                  seed=4, mixed_precision="no")
    whole = _dropout_model()
    train(whole, data, collate, TrainConfig(output_dir=str(tmp_path / "whole"), **kwargs), progress=False)

    config = TrainConfig(output_dir=str(tmp_path / "pieces"), **kwargs)
    first = _dropout_model()
    train(first, data, collate, config, progress=False, stop_after=4)  # "killed" after step 4
    assert latest_checkpoint(config.output_dir).endswith("checkpoint-4")
    torch.manual_seed(999)  # whatever the new process's RNG is, resume restores the saved one
    second = _dropout_model(seed=77)  # a fresh process builds a differently initialised model
    history = train(second, data, collate, config, progress=False, resume=True)
    assert history["step"][-1] == 10 and len(history["loss"]) == 10
    assert_same_weights(whole, second)


def test_batches_cover_each_epoch_once():
    seen = torch.cat([batch_indices(s, 50, 8, seed=1) for s in range(6)])
    assert sorted(seen.tolist()) == sorted(set(seen.tolist())) and len(seen) == 48
    assert not torch.equal(batch_indices(0, 50, 8, seed=1), batch_indices(6, 50, 8, seed=1))


_KILLABLE_RUN = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_train import RandomCaptions, collate, _dropout_model
from xattn.train.loop import TrainConfig, train

torch.set_num_threads({threads})  # the parent's: the uninterrupted run it is compared with ran so

def slow_collate(rows):  # slow enough that the kill lands between checkpoints
    time.sleep(0.3)
    return collate(rows)

train(_dropout_model(), RandomCaptions(), slow_collate, TrainConfig(output_dir={out!r}, **{kwargs!r}),
      progress=False, resume=True)
"""


def test_run_killed_between_checkpoints_resumes_to_the_same_weights(tmp_path):
    """SIGKILL a training process after its first checkpoint, mid-way to the next; rerun with resume."""
    import os
    import signal
    import subprocess
    import sys
    import time

    data = RandomCaptions()
    kwargs = dict(max_steps=9, batch_size=8, learning_rate=3e-3, warmup_steps=2, save_every=3, eval_every=100,
                  seed=5, mixed_precision="no")
    whole = _dropout_model()
    train(whole, data, collate, TrainConfig(output_dir=str(tmp_path / "whole"), **kwargs), progress=False)

    out = str(tmp_path / "killed")
    script = _KILLABLE_RUN.format(tests=os.path.dirname(__file__), out=out, kwargs=kwargs,
                                  threads=torch.get_num_threads())
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 120
    while latest_checkpoint(out) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.45)  # one or two steps past checkpoint-3, before checkpoint-6
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest_checkpoint(out).endswith("checkpoint-3")
    resumed = _dropout_model(seed=78)
    train(resumed, data, collate, TrainConfig(output_dir=out, **kwargs), progress=False, resume=True)
    assert_same_weights(whole, resumed)


def noisy_collate(rows):
    """Draws from numpy's and python's global RNGs, as Wav2Vec2-BERT's time masking draws from numpy's."""
    import random

    import numpy as np

    batch = collate(rows)
    noise = torch.from_numpy(np.random.standard_normal(batch["pixel_values"].shape).astype("float32"))
    batch["pixel_values"] = batch["pixel_values"] + noise * random.random()
    return batch


def test_numpy_and_python_rngs_are_seeded_and_resumed(tmp_path):
    import random

    import numpy as np

    data = RandomCaptions(n=16)
    kwargs = dict(max_steps=6, batch_size=8, learning_rate=3e-3, warmup_steps=1, save_every=2, eval_every=100,
                  seed=6, mixed_precision="no")
    runs = []
    for name in ("one", "two"):  # the global RNGs are elsewhere for the second run: the seed puts them back
        model = tiny_captioner(seed=64)
        train(model, data, noisy_collate, TrainConfig(output_dir=str(tmp_path / name), **kwargs), progress=False)
        runs.append(model)
    assert_same_weights(*runs)
    config = TrainConfig(output_dir=str(tmp_path / "pieces"), **kwargs)
    train(tiny_captioner(seed=64), data, noisy_collate, config, progress=False, stop_after=3)
    np.random.seed(999)
    random.seed(999)
    resumed = tiny_captioner(seed=65)
    train(resumed, data, noisy_collate, config, progress=False, resume=True)
    assert_same_weights(runs[0], resumed)


def test_stale_checkpoints_of_an_earlier_run_do_not_outlive_the_new_one(tmp_path):
    """An earlier run's later checkpoints (and half-written ones) are dropped, never the new run's own."""
    import os

    for stale in ("checkpoint-100", "checkpoint-200", "checkpoint-6.tmp"):
        os.makedirs(tmp_path / stale)
    (tmp_path / "latest").write_text("checkpoint-200")
    config = TrainConfig(output_dir=str(tmp_path), max_steps=4, batch_size=8, save_every=2, keep_checkpoints=2,
                         warmup_steps=1, mixed_precision="no")
    train(tiny_captioner(seed=66), RandomCaptions(n=16), collate, config, progress=False)
    assert latest_checkpoint(str(tmp_path)).endswith("checkpoint-4")
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4"]


def test_a_diverging_loss_stops_before_it_spoils_the_weights(tmp_path):
    import pytest

    data = RandomCaptions(n=8)
    data.pixels[3] = float("nan")
    model = tiny_captioner(seed=67)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainConfig(output_dir=str(tmp_path), max_steps=3, batch_size=8, warmup_steps=1, mixed_precision="no")
    with pytest.raises(ValueError, match="the training loss is nan at step 1: lower --learning-rate"):
        train(model, data, collate, config, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_config_refuses_bad_numbers():
    import pytest

    for bad in (dict(max_steps=0), dict(batch_size=-1), dict(learning_rate=float("nan")), dict(learning_rate=0.0),
                dict(seed=2**70), dict(seed=-1), dict(save_every=0), dict(keep_checkpoints=0), dict(max_steps=1.5),
                dict(mixed_precision="fp8")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(output_dir="x", **bad)
