"""Bad input gets a ValueError that says what to pass instead."""

import pytest
import torch

import xattn
from conftest import tiny_captioner, tiny_gpt2


@pytest.fixture(scope="module")
def engine():
    return xattn.from_hf(tiny_captioner(seed=41))


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 32, 32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=100), "exceeds the decoder's n_positions"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(num_beams=2, num_return_sequences=3), "must be <= num_beams"),
        (dict(num_return_sequences=2), "greedy search returns one sequence"),
        (dict(do_sample=True, temperature=0.0), "temperature must be a positive number"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
        (dict(num_beams=0), "num_beams must be"),
        (dict(num_beams=2, do_sample=True), "beam sampling is not supported"),
        (dict(early_stopping="sometimes", num_beams=2), "early_stopping must be"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(frobnicate=True), "unsupported generate() arguments"),
        (dict(pad_token_id=10**6, eos_token_id=5), "pad_token_id=1000000 is outside the vocabulary (0..98)"),
        (dict(pad_token_id=-1), "pad_token_id=-1 is outside the vocabulary"),
        (dict(decoder_start_token_id=-3), "the decoder prompt holds token id -3, outside the vocabulary (0..98)"),
        (dict(decoder_input_ids=torch.tensor([[1, 500], [1, 2]])), "holds token id 500, outside the vocabulary"),
    ],
)
def test_bad_generation_options(engine, pixels, kwargs, message):
    with pytest.raises(ValueError, match=_re(message)):
        engine.generate(pixel_values=pixels, **kwargs)
    if "decoder_input_ids" not in kwargs and "max_new_tokens" not in kwargs:  # an in-flight request is checked alike
        with pytest.raises(ValueError, match=_re(message)):
            engine.request(pixel_values=pixels[:1], **kwargs)


def _re(text):
    import re

    return re.escape(text)


def test_encoder_states_for_a_decoder_without_cross_attention():
    plain = xattn.from_hf(tiny_gpt2(add_cross_attention=False))
    with pytest.raises(ValueError, match="no cross-attention"):
        plain.generate(torch.tensor([[1]]), encoder_hidden_states=torch.randn(1, 5, 32), max_new_tokens=3)


def test_mismatched_batch_sizes():
    engine = xattn.from_hf(tiny_gpt2())
    with pytest.raises(ValueError, match="batch sizes differ"):
        engine.generate(torch.ones(3, 1, dtype=torch.long), encoder_hidden_states=torch.randn(2, 5, 32),
                        max_new_tokens=3)


def test_wrong_dtype_and_hidden_size(engine, pixels):
    with pytest.raises(ValueError, match="dtype torch.float64 but the model runs in torch.float32"):
        engine.generate(pixel_values=pixels.double(), max_new_tokens=3)
    with pytest.raises(ValueError, match="hidden size 16"):
        engine.generate(encoder_hidden_states=torch.randn(2, 5, 16), max_new_tokens=3)
    with pytest.raises(ValueError, match="integer token ids"):
        engine.generate(pixel_values=pixels, decoder_input_ids=torch.ones(2, 1), max_new_tokens=3)


def test_wrong_device(engine, pixels):
    meta = torch.empty(2, 3, 32, 32, device="meta")
    with pytest.raises(ValueError, match="is on meta but the model is on cpu"):
        engine.generate(pixel_values=meta, max_new_tokens=3)


def test_mask_shape_and_missing_inputs(engine):
    with pytest.raises(ValueError, match="encoder_attention_mask has shape"):
        engine.generate(encoder_hidden_states=torch.randn(2, 5, 32), encoder_attention_mask=torch.ones(2, 4),
                        max_new_tokens=3)
    with pytest.raises(ValueError, match="pass pixel_values"):
        engine.generate(max_new_tokens=3)
    with pytest.raises(ValueError, match="with a cache, pass decoder_input_ids"):
        engine.generate(past_key_values=((torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)),) * 2)
    with pytest.raises(ValueError, match="pass one encoder input"):
        engine.generate(pixel_values=torch.randn(1, 3, 32, 32), encoder_hidden_states=torch.randn(1, 5, 32))


def test_not_a_gpt2_decoder():
    with pytest.raises(ValueError, match="not a GPT-2 decoder"):
        xattn.from_hf(torch.nn.Linear(2, 2))
