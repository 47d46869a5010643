"""The engine's specification: the same tokens as transformers' generate on the same weights."""

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

import xattn
from conftest import frequent_token, tiny_captioner, tiny_gpt2, tiny_recognizer, with_eos

DECODER_VARIANTS = {
    "default": {},
    "inverse-layer-scaling": {"scale_attn_by_inverse_layer_idx": True},
    "relu-wide-mlp": {"activation_function": "relu", "n_inner": 50},
    "projected-encoder": {"encoder_hidden": 48},  # encoder 48 -> decoder 32 through enc_to_dec_proj
}

SEARCHES = {
    "greedy": dict(max_new_tokens=14),
    "beam4-return2": dict(max_new_tokens=14, num_beams=4, num_return_sequences=2),
    "beam3-lp0.5-early": dict(max_new_tokens=14, num_beams=3, length_penalty=0.5, early_stopping=True),
    "beam4-lp2-never": dict(max_new_tokens=14, num_beams=4, length_penalty=2.0, early_stopping="never"),
    "greedy-min-rep": dict(max_new_tokens=14, min_new_tokens=6, repetition_penalty=1.5),
    "beam2-min-rep": dict(max_new_tokens=14, num_beams=2, min_new_tokens=5, repetition_penalty=1.3),
}


def _build(variant):
    overrides = dict(DECODER_VARIANTS[variant])
    return tiny_captioner(seed=list(DECODER_VARIANTS).index(variant), **overrides)


@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("batch", [1, 3])
def test_captioner_tokens_match_transformers(variant, search, batch):
    model = _build(variant)
    pixels = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
    # an EOS the model really emits, so rows stop at different steps and padding/finishing is exercised
    with_eos(model, frequent_token(model, {"pixel_values": pixels}))
    expected = model.generate(pixel_values=pixels, **SEARCHES[search])
    got = xattn.from_hf(model).generate(pixel_values=pixels, **SEARCHES[search])
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_rows_stop_at_their_own_eos(images):
    model = tiny_captioner(seed=11)
    model = with_eos(model, frequent_token(model, {"pixel_values": images}))
    got = xattn.from_hf(model).generate(pixel_values=images, max_new_tokens=14)
    eos = model.generation_config.eos_token_id
    stops = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in got[:, 1:]]
    assert any(s is not None for s in stops), "the chosen EOS never occurred; the test would prove nothing"
    expected = model.generate(pixel_values=images, max_new_tokens=14)
    assert torch.equal(got, expected)
    for row, stop in zip(got[:, 1:], stops):
        if stop is not None:
            assert (row[stop + 1:] == model.generation_config.pad_token_id).all()


@pytest.mark.parametrize("batch", [1, 3])
def test_sampling_matches_transformers_with_the_same_seed(captioner, batch):
    pixels = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=20, top_p=0.9, temperature=0.8, repetition_penalty=1.3,
                  num_return_sequences=2)
    torch.manual_seed(1234)
    expected = captioner.generate(pixel_values=pixels, **kwargs)
    torch.manual_seed(1234)
    got = xattn.from_hf(captioner).generate(pixel_values=pixels, **kwargs)
    assert torch.equal(got, expected)


def test_seeded_generator_reproduces_and_differs_across_seeds(captioner, images):
    model = xattn.from_hf(captioner)
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=0, temperature=1.5)
    a = model.generate(pixel_values=images, generator=torch.Generator().manual_seed(3), **kwargs)
    b = model.generate(pixel_values=images, generator=torch.Generator().manual_seed(3), **kwargs)
    c = model.generate(pixel_values=images, generator=torch.Generator().manual_seed(4), **kwargs)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_speech_batch_with_padding_matches_transformers_row_by_row():
    model = tiny_recognizer()
    lengths = [1600, 1100, 700]
    waves = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in lengths]
    values = torch.zeros(len(waves), max(lengths))
    mask = torch.zeros(len(waves), max(lengths), dtype=torch.long)
    for i, w in enumerate(waves):
        values[i, : len(w)], mask[i, : len(w)] = w, 1
    with_eos(model, frequent_token(model, {"input_values": values, "attention_mask": mask}))
    engine = xattn.from_hf(model)
    for kwargs in (dict(max_new_tokens=12), dict(max_new_tokens=12, num_beams=4, num_return_sequences=2)):
        expected = model.generate(input_values=values, attention_mask=mask, **kwargs)
        got = engine.generate(input_values=values, attention_mask=mask, **kwargs)
        assert torch.equal(got, expected)


def test_padded_encoder_states_match_unpadded_rows():
    """Cross-attention honours encoder_attention_mask: a padded batch row == that row alone, unpadded."""
    model = tiny_captioner(seed=3)
    engine = xattn.from_hf(model)
    lengths = [17, 9, 4]
    states = torch.randn(3, 17, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 17, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        states[i, n:] = 1e4  # garbage in the padding must not leak into the output
    for kwargs in (dict(max_new_tokens=12), dict(max_new_tokens=12, num_beams=4)):
        got = engine.generate(encoder_hidden_states=states, encoder_attention_mask=mask, **kwargs)
        for i, n in enumerate(lengths):
            alone = BaseModelOutput(last_hidden_state=states[i : i + 1, :n])
            expected = model.generate(encoder_outputs=alone, **kwargs)
            assert torch.equal(got[i : i + 1, : expected.shape[1]], expected)


def test_gpt2_decoder_with_given_encoder_states_matches_transformers():
    model = tiny_gpt2(seed=5)
    states = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    prompt = torch.tensor([[1, 5, 9], [1, 7, 3]])
    engine = xattn.from_hf(model)
    for kwargs in (dict(max_new_tokens=10), dict(max_new_tokens=10, num_beams=3, num_return_sequences=3)):
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), encoder_hidden_states=states,
                                  **kwargs)
        got = engine.generate(prompt, encoder_hidden_states=states, **kwargs)
        assert torch.equal(got, expected)


def test_plain_gpt2_without_cross_attention_matches_transformers():
    model = tiny_gpt2(seed=6, add_cross_attention=False)
    prompt = torch.tensor([[1, 5, 9, 4]])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, num_beams=2)
    got = xattn.from_hf(model).generate(prompt, max_new_tokens=10, num_beams=2)
    assert torch.equal(got, expected)


def test_vit_b16_gpt2_small_shape_matches_transformers():
    """The real shape: ViT-B/16 at 224 px (197 positions) + GPT-2 small (12 x 768, vocab 50257)."""
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(0)
    decoder = GPT2Config(add_cross_attention=True, is_decoder=True, bos_token_id=50256, eos_token_id=50256,
                         pad_token_id=50256)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), decoder)
    config.decoder_start_token_id = config.pad_token_id = config.eos_token_id = 50256
    model = VisionEncoderDecoderModel(config).eval()
    pixels = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    engine = xattn.from_hf(model)
    for kwargs in (dict(max_new_tokens=8), dict(max_new_tokens=6, num_beams=4, num_return_sequences=2)):
        for batch in (1, 2):
            expected = model.generate(pixel_values=pixels[:batch], **kwargs)
            got = engine.generate(pixel_values=pixels[:batch], **kwargs)
            assert torch.equal(got, expected)
