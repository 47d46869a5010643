"""A cache handed to generate() by a real caller: transformers' cache classes, self-only caches, encoder masks that
come with the cache, the last position, all-padding inputs. Every case gives transformers' generate tokens."""

import copy
import inspect

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.modeling_outputs import BaseModelOutput

import xattn
from conftest import tiny_captioner, tiny_gpt2, tiny_recognizer
from xattn import CrossAttentionCache

NEW = 12  # tokens generated in all; the prompt at the handoff holds CUT of them
CUT = 5  # positions in the handed-over cache (the start token and CUT - 1 generated ones)
WIDE = 0.1  # decoder weights' std: at GPT-2's 0.02 the tiny decoders' tokens barely depend on their input


def _forward(model, tokens, cache=None, **inputs):
    """transformers' forward of the decoder tokens -> the cache it returns (under either line's argument name)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    inputs["decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"] = tokens
    if cache is not None:
        inputs[name] = cache
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    return getattr(out, "cache", None) or out.past_key_values


@pytest.fixture(scope="module")
def captioning():
    model = tiny_captioner(seed=21, initializer_range=WIDE)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    full = model.generate(pixel_values=pixels, max_new_tokens=NEW, min_new_tokens=NEW)
    return model, pixels, full


def _self_only(kind: str, hf_cache):
    """The self-attention part of transformers' cache, as a caller might hand it over."""
    self_cache = hf_cache.self_attention_cache
    if kind == "legacy tuples":
        return tuple((layer.keys, layer.values) for layer in self_cache.layers)
    if kind == "DynamicCache":
        return self_cache
    return EncoderDecoderCache(self_cache, DynamicCache())  # "EncoderDecoderCache, empty cross cache"


@pytest.mark.parametrize("kind", ["legacy tuples", "DynamicCache", "EncoderDecoderCache, empty cross cache"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_cache_without_cross_kv_takes_them_from_the_encoder_inputs(captioning, kind, num_beams):
    model, pixels, full = captioning
    given = _self_only(kind, _forward(model, full[:, :CUT], pixel_values=pixels))
    kwargs = dict(decoder_input_ids=full[:, : CUT + 1], max_new_tokens=NEW - CUT, min_new_tokens=NEW - CUT,
                  num_beams=num_beams)
    expected = model.generate(pixel_values=pixels, **kwargs)
    got = xattn.from_hf(model).generate(pixel_values=pixels, past_key_values=given, **kwargs)
    assert torch.equal(got, expected)


def test_a_cache_without_cross_kv_takes_them_from_given_encoder_states(captioning):
    model, pixels, full = captioning
    engine = xattn.from_hf(model)
    states, _ = engine.encode(pixel_values=pixels)
    given = _self_only("DynamicCache", _forward(model, full[:, :CUT], pixel_values=pixels))
    got = engine.generate(encoder_hidden_states=states, past_key_values=given, decoder_input_ids=full[:, : CUT + 1],
                          max_new_tokens=NEW - CUT, min_new_tokens=NEW - CUT)
    assert torch.equal(got, full)


def test_a_cache_without_cross_kv_and_nothing_to_compute_them_from_is_refused(captioning):
    model, pixels, full = captioning
    given = _self_only("legacy tuples", _forward(model, full[:, :CUT], pixel_values=pixels))
    with pytest.raises(ValueError, match="holds no cross-attention K/V: pass pixel_values"):
        xattn.from_hf(model).generate(past_key_values=given, decoder_input_ids=full[:, : CUT + 1], max_new_tokens=3)


def test_an_empty_transformers_cache_is_no_cache(captioning):
    model, pixels, full = captioning
    got = xattn.from_hf(model).generate(pixel_values=pixels, past_key_values=DynamicCache(), max_new_tokens=NEW,
                                        min_new_tokens=NEW)
    assert torch.equal(got, full)


@pytest.mark.parametrize("self_cache", ["StaticCache", "DynamicCache", "sliding window, within it"])
def test_every_transformers_cache_class_continues_from_its_held_positions(captioning, self_cache):
    """A StaticCache's buffer is longer than what it holds (zeros past it): get_seq_length() says how much."""
    model, pixels, full = captioning
    config = model.config.decoder
    if self_cache == "StaticCache":
        empty = StaticCache(config=config, max_cache_len=20)
    else:
        if self_cache != "DynamicCache":
            config = copy.deepcopy(config)
            config.sliding_window = 8
        empty = DynamicCache(config=config)
    hf_cache = _forward(model, full[:, :CUT], EncoderDecoderCache(empty, DynamicCache()), pixel_values=pixels)
    assert type(hf_cache.self_attention_cache) is type(empty)
    adopted = CrossAttentionCache.from_hf(hf_cache, 16)
    assert adopted.length == CUT and adopted.has_cross
    got = xattn.from_hf(model).generate(past_key_values=hf_cache, decoder_input_ids=full[:, : CUT + 1],
                                        max_new_tokens=NEW - CUT, min_new_tokens=NEW - CUT)
    assert torch.equal(got, full)


def test_a_sliding_window_cache_that_dropped_positions_is_refused(captioning):
    model, pixels, full = captioning
    config = copy.deepcopy(model.config.decoder)
    config.sliding_window = 4
    hf_cache = _forward(model, full[:, :CUT + 3], EncoderDecoderCache(DynamicCache(config=config), DynamicCache()),
                        pixel_values=pixels)
    with pytest.raises(ValueError, match="holds 8 positions but keeps only"):
        CrossAttentionCache.from_hf(hf_cache, 16)


def _wide(model, seed: int):
    """The model with its decoder's matrices drawn again at std WIDE."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.decoder.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, WIDE, generator=generator)
    return model


def _padded_speech():
    lengths = [1600, 1100, 700]
    values = torch.zeros(len(lengths), max(lengths))
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        values[i, :n], mask[i, :n] = torch.randn(n, generator=torch.Generator().manual_seed(n)), 1
    return values, mask


@pytest.mark.parametrize("mask_given_as", ["attention_mask", "encoder_attention_mask"])
def test_a_given_cache_honours_the_encoder_mask(mask_given_as):
    """transformers' cache of a padded speech batch (cross K/V of the padding included), continued with 4 beams."""
    model = _wide(tiny_recognizer(seed=1), seed=1)
    engine = xattn.from_hf(model)
    values, mask = _padded_speech()
    prefix = model.generate(input_values=values, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
    hf_cache = _forward(model, prefix[:, :-1], input_values=values, attention_mask=mask)
    kwargs = dict(decoder_input_ids=prefix, max_new_tokens=8, min_new_tokens=3, num_beams=4)
    expected = model.generate(input_values=values, attention_mask=mask, **kwargs)
    if mask_given_as == "attention_mask":
        given = dict(input_values=values, attention_mask=mask)
    else:
        states, states_mask = engine.encode(mask, input_values=values)
        given = dict(encoder_hidden_states=states, encoder_attention_mask=states_mask)
    assert torch.equal(engine.generate(past_key_values=hf_cache, **given, **kwargs), expected)


def test_rows_with_the_same_cross_kv_but_different_masks_are_not_folded_together():
    model = tiny_gpt2(seed=5, initializer_range=WIDE)
    states = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(2)).repeat(2, 1, 1)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4])
    prompt = torch.tensor([[1, 5, 9], [1, 5, 9]])
    hf_cache = _forward(model, prompt[:, :-1], encoder_hidden_states=states, encoder_attention_mask=mask)
    adopted = CrossAttentionCache.from_hf(hf_cache, 16, cross_mask=mask)
    assert adopted.encoder_batch_size == 2 and torch.equal(adopted.cross_mask, mask.bool())
    assert CrossAttentionCache.from_hf(hf_cache, 16).encoder_batch_size == 1  # no masks: one copy is enough
    kwargs = dict(encoder_hidden_states=states, encoder_attention_mask=mask, max_new_tokens=10)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    assert not torch.equal(expected[0], expected[1])  # the masks matter
    got = xattn.from_hf(model).generate(prompt, past_key_values=hf_cache, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_max_length_may_be_n_positions_plus_one(captioning, num_beams):
    """The last generated token is never fed back, so it needs no position (transformers produces it too)."""
    model, pixels, _ = captioning
    n_positions = model.config.decoder.n_positions
    expected = model.generate(pixel_values=pixels, max_length=n_positions + 1, num_beams=num_beams,
                              min_new_tokens=n_positions)
    assert expected.shape[1] == n_positions + 1
    engine = xattn.from_hf(model)
    got = engine.generate(pixel_values=pixels, max_length=n_positions + 1, num_beams=num_beams,
                          min_new_tokens=n_positions)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match=f"lower max_new_tokens to at most {n_positions}"):
        engine.generate(pixel_values=pixels, max_length=n_positions + 2)


@pytest.mark.parametrize("weights", ["packed", "int8", "bf16"])
def test_an_all_padding_row_decodes_as_exact_does(weights):
    """Attention over an input whose every position is padding: zeros, as SDPA (exact) and transformers give."""
    model = tiny_captioner(seed=3)
    states = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    kwargs = dict(encoder_hidden_states=states, encoder_attention_mask=mask, max_new_tokens=8)
    reference = xattn.from_hf(model)
    exact = reference.generate(**kwargs)
    assert torch.equal(exact, model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=states),
                                             attention_mask=mask, max_new_tokens=8))
    engine = xattn.from_hf(model, weights=weights)
    assert torch.equal(engine.generate(**kwargs), exact)
    tolerance = 1e-4 if weights == "packed" else 0.05
    decoders = (engine.decoder, reference.decoder)
    caches = [decoder.new_cache(3, 4, states, mask) for decoder in decoders]
    prefills = [decoder.prefill(c, input_ids=exact[:, :2], all_logits=True) for decoder, c in zip(decoders, caches)]
    assert torch.allclose(*prefills, atol=tolerance)
    steps = [decoder.decode_step(exact[:, 2], c) for decoder, c in zip(decoders, caches)]  # packed, int8: fused
    assert torch.allclose(*steps, atol=tolerance)


def test_a_padded_prompt_of_a_decoder_alone_is_refused_not_ignored():
    model = xattn.from_hf(tiny_gpt2(seed=1))
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    with pytest.raises(ValueError, match="padded decoder prompts are not supported"):
        model.generate(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]), max_new_tokens=3)
    full = model.generate(ids, attention_mask=torch.ones(2, 3, dtype=torch.long), max_new_tokens=3)
    assert torch.equal(full, model.generate(ids, max_new_tokens=3))
