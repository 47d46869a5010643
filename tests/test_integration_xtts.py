"""coqui-tts XTTS decoding its GPT through xattn (xattn.integrations.xtts), on a real `Xtts` built at a tiny random
config (no weights downloaded).

The references are coqui's own decoding in the same process: transformers' generate on coqui's GPT2InferenceModel.
On transformers 4.57 that runs as shipped; on 5.x it fails (the cache arrives as `cache=`, coqui reads
`past_key_values`), so there the reference is coqui's decoding with that one keyword forwarded (`coquis_own`), and
a full recomputation with transformers' own logits processors checks the codes and latents independently of
transformers' generate. Skipped when coqui-tts is not installed (pip install -e '.[tts-pipelines]').
"""

import contextlib
import importlib.util
import types

import pytest
import torch
import transformers
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

if importlib.util.find_spec("TTS") is None:
    pytest.skip("coqui-tts is not installed (pip install -e '.[tts-pipelines]')", allow_module_level=True)

from xattn.integrations import torchaudio_stand_in, xtts  # noqa: E402

with torchaudio_stand_in():
    from TTS.tts.configs.xtts_config import XttsConfig  # noqa: E402
    from TTS.tts.models.xtts import Xtts, XttsArgs  # noqa: E402

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
START, STOP = 38, 39
# XTTS v2's shape at a tiny size. gpt_max_audio_tokens + 3 = the audio vocabulary: coqui gives its inference
# GPT2Config vocab_size = max_mel_tokens, and transformers' beam search reshapes the scores by that vocab_size
# (with XTTS v2's real config, 608 != its 1026 audio tokens, coqui's own beam search fails; xattn's does not read it).
# (8194, 8192 codes + start + stop, is only the default of coqui-tts 0.28's XttsArgs and GPT.)
ARGS = dict(gpt_layers=2, gpt_n_model_channels=32, gpt_n_heads=2, gpt_number_text_tokens=20, gpt_start_text_token=18,
            gpt_stop_text_token=19, gpt_num_audio_tokens=40, gpt_start_audio_token=START,
            gpt_stop_audio_token=STOP, gpt_max_audio_tokens=37, gpt_max_text_tokens=30, gpt_max_prompt_tokens=10,
            gpt_use_perceiver_resampler=True, decoder_input_dim=32)
SETTINGS = {  # keywords as Xtts.inference() passes them to GPT.generate
    "greedy rp 2": dict(do_sample=False, repetition_penalty=2.0, num_beams=1, num_return_sequences=1),
    "greedy rp 10": dict(do_sample=False, repetition_penalty=10.0, num_beams=1, num_return_sequences=1),
    "beam 3": dict(do_sample=False, repetition_penalty=2.0, num_beams=3, length_penalty=1.0, num_return_sequences=1),
    "beam 3, lp 2, 2 returned": dict(do_sample=False, repetition_penalty=2.0, num_beams=3, length_penalty=2.0,
                                     num_return_sequences=2),
    "sampling (inference() defaults)": dict(do_sample=True, temperature=0.75, top_k=50, top_p=0.85,
                                            repetition_penalty=10.0, num_beams=1, num_return_sequences=1),
    # min_length counts coqui's fake prompt (46 ids here); unfiltered, seed 5 stops after 14 tokens
    "sampling, min_length 54": dict(do_sample=True, temperature=0.75, top_k=50, top_p=0.85, repetition_penalty=10.0,
                                    num_beams=1, num_return_sequences=1, min_length=54),
    "sampling, min_length 62": dict(do_sample=True, temperature=0.75, top_k=50, top_p=0.85, repetition_penalty=10.0,
                                    num_beams=1, num_return_sequences=1, min_length=62),
    "sampling, gpt_batch_size 3": dict(do_sample=True, temperature=0.75, top_k=50, top_p=0.85,
                                       repetition_penalty=2.0, num_beams=1, num_return_sequences=3),
}


class CharTokenizer:  # coqui's VoiceBpeTokenizer needs a vocab file; the GPT only sees ids
    char_limits = {"en": 250}

    def encode(self, text, lang):
        return [1 + ord(c) % 15 for c in text]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = Xtts(XttsConfig(model_args=XttsArgs(**ARGS)))
    model.eval()
    model.tokenizer = CharTokenizer()
    return model


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    cond = torch.randn(1, 32, 32, generator=g)  # the perceiver's 32 conditioning latents
    speaker = torch.randn(1, 512, 1, generator=g)
    text = torch.IntTensor(CharTokenizer().encode("hello world", "en"))[None]
    return cond, speaker, text


@contextlib.contextmanager
def coquis_own(model):
    """coqui's own decoding; on transformers 5.x with the cache forwarded under the name coqui reads."""
    assert not xtts.is_enabled(model)
    inference = model.gpt.gpt_inference
    if TRANSFORMERS_5:
        own = inference.forward

        def forward(*args, cache=None, **kwargs):
            if cache is not None:
                kwargs["past_key_values"] = cache
            return own(*args, **kwargs)

        inference.forward = forward
    try:
        yield
    finally:
        inference.__dict__.pop("forward", None)


@contextlib.contextmanager
def enabled(model):
    xtts.enable(model)
    try:
        yield
    finally:
        xtts.disable(model)


def seeded(fn, seed=5):
    torch.manual_seed(seed)
    with torch.no_grad():
        return fn()


@pytest.mark.skipif(not TRANSFORMERS_5, reason="coqui-tts' own decoding works on transformers 4.x")
def test_coquis_own_decoding_fails_on_transformers_5_and_xattn_decodes(model, inputs):
    cond, speaker, _ = inputs
    with pytest.raises(AttributeError, match="get_seq_length"):
        model.inference("hello world", "en", cond, speaker)
    with enabled(model):
        out = model.inference("hello world", "en", cond, speaker)
        chunks = list(model.inference_stream("hello world", "en", cond, speaker, stream_chunk_size=4))
    assert out["wav"].size > 0 and torch.cat(chunks).numel() > 0
    with pytest.raises(AttributeError, match="get_seq_length"):  # disable() restores coqui's own
        model.inference("hello world", "en", cond, speaker)


@pytest.mark.parametrize("setting", SETTINGS)
def test_codes_equal_coquis_own_decoding(model, inputs, setting):
    cond, _, text = inputs
    kwargs = SETTINGS[setting]
    with coquis_own(model):
        expected = seeded(lambda: model.gpt.generate(cond, text, **kwargs))
    with enabled(model):
        codes = seeded(lambda: model.gpt.generate(cond, text, **kwargs))
    assert torch.equal(codes, expected)
    assert codes.shape[0] == kwargs["num_return_sequences"] and codes.shape[1] > 3


def full_recompute(gpt, cond, text, penalty, steps):
    """Greedy XTTS decoding without any cache: the whole sequence through coqui's modules at every step, scored by
    transformers' RepetitionPenaltyLogitsProcessor over the ids coqui's generate() sees ([1] * P + [start] + ...)."""
    ids = gpt.compute_embeddings(cond, text)
    prefix = gpt.gpt_inference.cached_prefix_emb
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)])
    latents = []
    for _ in range(steps):
        audio = ids[:, prefix.shape[1]:]  # start + generated
        emb = gpt.mel_embedding(audio) + gpt.mel_pos_embedding(audio)
        hidden = gpt.gpt(inputs_embeds=torch.cat([prefix, emb], 1)).last_hidden_state[:, -1]
        latents.append(gpt.final_norm(hidden))
        token = processors(ids, gpt.mel_head(latents[-1])).argmax(-1)
        ids = torch.cat([ids, token[:, None]], 1)
        if int(token) == STOP:
            break
    return ids[:, prefix.shape[1] + 1:], torch.stack(latents, 1)


@pytest.mark.parametrize("penalty", [2.0, 10.0])
def test_greedy_codes_and_latents_equal_a_full_recompute(model, inputs, penalty):
    cond, _, text = inputs
    gpt = model.gpt
    with torch.no_grad():
        expected, expected_latents = full_recompute(gpt, cond, text, penalty, gpt.max_gen_mel_tokens)
        gpt.compute_embeddings(cond, text)  # coqui's prefix: conditioning latents + text embeddings
        out = xtts.decoder(gpt).generate(gpt.gpt_inference.cached_prefix_emb, start_token=START, stop_token=STOP,
                                         max_new_tokens=gpt.max_gen_mel_tokens, repetition_penalty=penalty)
        with enabled(model):
            codes = model.gpt.generate(cond, text, do_sample=False, repetition_penalty=penalty)
    assert torch.equal(out.sequences, expected) and torch.equal(codes, expected)
    torch.testing.assert_close(out.latents, expected_latents, atol=1e-5, rtol=1e-5)


def test_the_penalty_covers_the_fake_prompt_as_coquis_does(model, inputs):
    """Without prompt_token the penalty leaves audio token 1 alone and the codes part from coqui's."""
    cond, _, text = inputs
    gpt = model.gpt
    with torch.no_grad():
        expected, _ = full_recompute(gpt, cond, text, 10.0, gpt.max_gen_mel_tokens)
        plain = xtts.decoder(gpt)
        plain.prompt_token = None
        gpt.compute_embeddings(cond, text)
        out = plain.generate(gpt.gpt_inference.cached_prefix_emb, start_token=START, stop_token=STOP,
                             max_new_tokens=gpt.max_gen_mel_tokens, repetition_penalty=10.0)
    n = min(out.sequences.shape[1], expected.shape[1])
    assert not torch.equal(out.sequences[:, :n], expected[:, :n])


@pytest.mark.parametrize("kwargs", [{}, dict(do_sample=False, repetition_penalty=2.0, speed=1.3)],
                         ids=["inference() defaults", "greedy, speed 1.3"])
def test_inference_audio_and_latents_equal_coquis_own(model, inputs, kwargs):
    cond, speaker, _ = inputs
    with coquis_own(model):
        expected = seeded(lambda: model.inference("hello world, again", "en", cond, speaker, **kwargs))
    with enabled(model):
        out = seeded(lambda: model.inference("hello world, again", "en", cond, speaker, **kwargs))
    assert torch.equal(torch.as_tensor(out["gpt_latents"]), torch.as_tensor(expected["gpt_latents"]))
    assert torch.equal(torch.as_tensor(out["wav"]), torch.as_tensor(expected["wav"]))


def stream_steps(model, cond, text, **kwargs):
    """Tokens [T] and latents [T, D] from GPT.get_generator, called as Xtts.inference_stream() calls it."""
    fake_inputs = model.gpt.compute_embeddings(cond, text)
    defaults = dict(top_k=50, top_p=0.85, temperature=0.75, do_sample=True, num_beams=1, num_return_sequences=1,
                    length_penalty=1.0, repetition_penalty=10.0, output_attentions=False, output_hidden_states=True,
                    return_dict_in_generate=True)
    steps = list(model.gpt.get_generator(fake_inputs=fake_inputs, **dict(defaults, **kwargs)))
    return torch.cat([t for t, _ in steps]), torch.cat([latent for _, latent in steps])


STREAMS = {"inference_stream() defaults": {}, "do_sample=False": dict(do_sample=False),
           "rp 2, top-k 10, top-p 0.9": dict(temperature=1.0, top_k=10, top_p=0.9, repetition_penalty=2.0)}


@pytest.mark.parametrize("setting", STREAMS)
def test_streamed_tokens_and_audio_equal_coquis_own(model, inputs, setting):
    """coqui's stream draws every token with torch.multinomial (do_sample=False only drops the filters): with the
    same seed xattn draws the same tokens. Its latents are the decoder's own hidden states (not recomputed, as
    inference() does), so they and the audio agree to float rounding."""
    cond, speaker, text = inputs
    kwargs = STREAMS[setting]
    for seed in (3, 4, 5):
        with coquis_own(model):
            expected, expected_latents = seeded(lambda: stream_steps(model, cond, text, **kwargs), seed)
        with enabled(model):
            tokens, latents = seeded(lambda: stream_steps(model, cond, text, **kwargs), seed)
        assert torch.equal(tokens, expected) and len(tokens) > 3
        torch.testing.assert_close(latents, expected_latents, atol=1e-5, rtol=1e-5)
    chunked = lambda: list(model.inference_stream("hello world", "en", cond, speaker, stream_chunk_size=8,  # noqa: E731
                                                  **kwargs))
    with coquis_own(model):
        expected_chunks = seeded(chunked)
    with enabled(model):
        chunks = seeded(chunked)
    assert len(chunks) == len(expected_chunks)
    for chunk, want in zip(chunks, expected_chunks):
        torch.testing.assert_close(chunk, want, atol=1e-4, rtol=1e-4)


def test_enable_takes_the_api_object_and_refuses_what_it_cannot_do(model, inputs):
    cond, _, text = inputs
    bare = Xtts.__new__(Xtts)
    torch.nn.Module.__init__(bare)
    bare.gpt = None
    with pytest.raises(ValueError, match="eval"):
        xtts.enable(bare)
    with enabled(model), pytest.raises(ValueError, match="beam sampling"):
        model.gpt.generate(cond, text, do_sample=True, num_beams=2)
    api = types.SimpleNamespace(synthesizer=types.SimpleNamespace(tts_model=model))  # coqui's TTS.api.TTS
    with enabled(api):
        assert xtts.is_enabled(model)
    assert not xtts.is_enabled(model)


def test_beam_search_with_xtts_v2s_vocab_mismatch(inputs):
    """XTTS v2's inference GPT2Config says vocab_size = max_mel_tokens (608), its head has 1026 audio tokens:
    transformers 4.57's beam search reshapes by the former and coqui's own fails (5.x reads the scores' shape);
    xattn's reads the head's scores as they are, and equals coqui's where that runs."""
    cond, _, text = inputs
    torch.manual_seed(0)
    model = Xtts(XttsConfig(model_args=XttsArgs(**dict(ARGS, gpt_max_audio_tokens=60))))  # vocab 63 != 40
    model.eval()
    kwargs = dict(do_sample=False, repetition_penalty=2.0, num_beams=3, num_return_sequences=1)
    expected = None
    with coquis_own(model):
        if TRANSFORMERS_5:
            expected = model.gpt.generate(cond, text, **kwargs)
        else:
            with pytest.raises(RuntimeError, match="shape"):
                model.gpt.generate(cond, text, **kwargs)
    with enabled(model):
        codes = model.gpt.generate(cond, text, **kwargs)
    assert codes.shape[0] == 1 and codes.shape[1] > 3 and int(codes.max()) < 40
    assert expected is None or torch.equal(codes, expected)


@contextlib.contextmanager
def enabled_in(model, weights):
    xtts.enable(model, weights=weights)
    try:
        yield
    finally:
        xtts.disable(model)


@pytest.mark.parametrize("setting", ["greedy rp 2", "greedy rp 10", "sampling, gpt_batch_size 3"])
def test_packed_weights_give_exacts_codes(model, inputs, setting):
    """fp32 copies sum in another order (logits differ by rounding only): the codes are exact's, which are coqui's."""
    cond, _, text = inputs
    kwargs = SETTINGS[setting]
    with enabled(model):
        expected = seeded(lambda: model.gpt.generate(cond, text, **kwargs))
    with enabled_in(model, "packed"):
        codes = seeded(lambda: model.gpt.generate(cond, text, **kwargs))
    assert torch.equal(codes, expected) and codes.shape[1] > 3


def test_int8_weights_decode_codes_of_the_right_shape(model, inputs):
    cond, _, text = inputs
    with enabled_in(model, "int8"):
        greedy = seeded(lambda: model.gpt.generate(cond, text, do_sample=False, max_new_tokens=10,
                                                   min_new_tokens=10))
        sampled = seeded(lambda: model.gpt.generate(cond, text, **dict(SETTINGS["sampling, gpt_batch_size 3"],
                                                                       max_new_tokens=10, min_new_tokens=10)))
    assert greedy.shape == (1, 10) and sampled.shape == (3, 10)
    codes = torch.cat([greedy, sampled])
    assert int(codes.min()) >= 0 and int(codes.max()) < 40 and not bool((codes == STOP).any())  # min_new_tokens


def test_an_unknown_weight_format_is_one_clear_error(model):
    with pytest.raises(ValueError) as error:
        xtts.enable(model, weights="fp16")
    assert str(error.value) == "weights='fp16': choose one of exact, packed, bf16, int8"
    assert not xtts.is_enabled(model)
