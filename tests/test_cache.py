"""The static cache: logits equal transformers' forward, K/V equal transformers' cache, interop both ways."""

import pytest
import torch

import xattn
from conftest import tiny_captioner
from xattn import CrossAttentionCache


def _hf_forward(model, pixels, tokens, cache=None):
    """transformers' own forward of the decoder tokens, returning (logits, cache) under either cache name."""
    kwargs = {"past_key_values" if _legacy_name() else "cache": cache} if cache is not None else {}
    out = model(pixel_values=pixels, decoder_input_ids=tokens, use_cache=True, **kwargs)
    return out.logits, getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _legacy_name() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


@pytest.fixture(scope="module")
def setup():
    model = tiny_captioner(seed=21)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(6))
    tokens[:, 0] = 1
    return model, xattn.from_hf(model), pixels, tokens


def _filled_cache(engine, pixels, length):
    states, mask = engine.encode(pixel_values=pixels)
    return engine.decoder.new_cache(pixels.shape[0], length, states, mask)


def test_full_sequence_logits_match_transformers_forward(setup):
    model, engine, pixels, tokens = setup
    expected, _ = _hf_forward(model, pixels, tokens)
    cache = _filled_cache(engine, pixels, tokens.shape[1])
    got = engine.decoder.prefill(cache, input_ids=tokens, all_logits=True)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_cached_step_by_step_logits_equal_uncached(setup):
    _, engine, pixels, tokens = setup
    full = engine.decoder.prefill(_filled_cache(engine, pixels, 16), input_ids=tokens, all_logits=True)
    cache = _filled_cache(engine, pixels, 16)
    steps = [engine.decoder.prefill(cache, input_ids=tokens[:, :1])]
    for pos in range(1, tokens.shape[1]):
        steps.append(engine.decoder.decode_step(tokens[:, pos], cache))  # at cache.position == pos, advances it
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5, rtol=0)


def test_to_legacy_equals_transformers_kv(setup):
    model, engine, pixels, tokens = setup
    _, hf_cache = _hf_forward(model, pixels, tokens)
    cache = _filled_cache(engine, pixels, 20)
    engine.decoder.prefill(cache, input_ids=tokens)
    legacy = cache.to_legacy()
    assert len(legacy) == model.config.decoder.n_layer
    for (k, v), layer in zip(legacy, hf_cache.self_attention_cache.layers):
        assert k.shape == layer.keys.shape == (2, 4, tokens.shape[1], 8)
        assert torch.allclose(k, layer.keys, atol=1e-5) and torch.allclose(v, layer.values, atol=1e-5)
    for (_, _, ck, cv), layer in zip(cache.to_legacy(cross=True), hf_cache.cross_attention_cache.layers):
        assert torch.allclose(ck, layer.keys, atol=1e-5) and torch.allclose(cv, layer.values, atol=1e-5)


def test_to_hf_cache_continues_in_transformers(setup):
    """xattn's cache handed to transformers' forward gives the logits xattn computes for the next token."""
    model, engine, pixels, tokens = setup
    cache = _filled_cache(engine, pixels, 20)
    engine.decoder.prefill(cache, input_ids=tokens[:, :-1])
    hf_logits, _ = _hf_forward(model, pixels, tokens[:, -1:], cache=cache.to_hf())
    ours = engine.decoder.decode_step(tokens[:, -1], cache)
    assert torch.allclose(hf_logits[:, -1], ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", ["from_hf", "from_legacy", "from_legacy_cross"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_continued_from_a_given_cache_equals_uninterrupted(setup, source, num_beams):
    model, engine, pixels, _ = setup
    full = engine.generate(pixel_values=pixels, max_new_tokens=12, min_new_tokens=12)
    cut = 5  # positions already in the cache; the prompt brings one more token
    if source == "from_hf":
        _, given = _hf_forward(model, pixels, full[:, :cut])
    else:
        cache = _filled_cache(engine, pixels, cut)
        engine.decoder.prefill(cache, input_ids=full[:, :cut])
        given = cache.to_legacy(cross=source == "from_legacy_cross")
    kwargs = dict(max_new_tokens=12 - cut, min_new_tokens=12 - cut, num_beams=num_beams)
    if source == "from_legacy":  # self-attention tuples only: cross K/V come from the encoder again
        states, mask = engine.encode(pixel_values=pixels)
        given = CrossAttentionCache.from_legacy(given, 13)
        given.set_cross(*engine.decoder.cross_key_values(states), mask)
    resumed = engine.generate(decoder_input_ids=full[:, : cut + 1], past_key_values=given, **kwargs)
    if num_beams == 1:
        assert torch.equal(resumed, full)
    else:
        uninterrupted = engine.generate(pixel_values=pixels, decoder_input_ids=full[:, : cut + 1], **kwargs)
        assert torch.equal(resumed, uninterrupted)


def test_from_hf_keeps_one_cross_copy_per_input(setup):
    """transformers holds cross K/V once per beam; adopting its cache keeps one per input."""
    model, engine, pixels, tokens = setup
    per_beam_pixels = pixels.repeat_interleave(4, dim=0)
    _, hf_cache = _hf_forward(model, per_beam_pixels, tokens.repeat_interleave(4, dim=0)[:, :3])
    cache = CrossAttentionCache.from_hf(hf_cache, 10)
    assert cache.batch_size == 8 and cache.encoder_batch_size == 2 and cache.group_size == 4
    for (_, _, ck, _), layer in zip(cache.to_legacy(cross=True), hf_cache.cross_attention_cache.layers):
        assert torch.equal(ck, layer.keys)


def test_beams_share_cross_kv_computed_once_and_self_kv_stays_in_place(setup, monkeypatch):
    model, engine, pixels, _ = setup
    calls = []
    original = engine.decoder.cross_key_values
    monkeypatch.setattr(engine.decoder, "cross_key_values", lambda s: calls.append(s.shape) or original(s))
    out = engine.generate(pixel_values=pixels, max_new_tokens=10, num_beams=4, return_dict_in_generate=True)
    assert calls == [torch.Size([2, 17, 32])]
    cache = out.cache
    assert cache.batch_size == 8 and cache.cross_keys.shape[1] == 2  # 8 beam rows read 2 stored inputs
    assert torch.equal(out.sequences, model.generate(pixel_values=pixels, max_new_tokens=10, num_beams=4))


def test_cache_buffers_are_written_in_place(setup):
    _, engine, pixels, tokens = setup
    cache = _filled_cache(engine, pixels, 12)
    keys_ptr, values_ptr = cache.keys.data_ptr(), cache.values.data_ptr()
    engine.decoder.prefill(cache, input_ids=tokens[:, :3])
    for pos in range(3, 8):
        engine.decoder.decode_step(tokens[:, pos], cache)
    cache.reorder(torch.tensor([1, 0]))
    assert cache.keys.data_ptr() == keys_ptr and cache.values.data_ptr() == values_ptr
    assert cache.keys.shape == (2, 2, 4, 12, 8)  # [layers, B, H, T_max, D]
    assert cache.to_legacy()[0][0].shape == (2, 4, 8, 8)


def test_select_rows_and_expand_share_cross_kv(setup):
    _, engine, pixels, tokens = setup
    cache = _filled_cache(engine, pixels, 12)
    engine.decoder.prefill(cache, input_ids=tokens[:, :4])
    expanded = cache.expand(3)
    assert expanded.cross_keys is cache.cross_keys and expanded.batch_size == 6 and expanded.enc_index is None
    picked = expanded.select_rows(torch.tensor([5, 0]))
    assert picked.cross_keys is cache.cross_keys
    assert picked.encoder_rows().tolist() == [1, 0]
    # the selected rows decode exactly like the original rows they came from
    nxt = tokens[[1, 0], 4]
    a = engine.decoder.decode_step(nxt, picked)  # both at position 4: the selection has a position of its own
    b = engine.decoder.decode_step(tokens[:, 4], cache)
    assert torch.allclose(a, b[[1, 0]], atol=1e-5)
