"""Tortoise's autoregressive stage decoding through xattn (xattn.integrations.tortoise), on a real tortoise-tts 3.0.0
`UnifiedVoice` at a tiny random config (no weights downloaded).

tortoise-tts' own decoding cannot run on the transformers xattn supports (its GPT2InferenceModel has no
`generate`), so the reference is its decoding done by hand the way transformers' generate does it: tortoise's own
GPT2InferenceModel.forward (the full sequence every step, as with its default kv_cache=False; or transformers'
cache and attention mask, as with kv_cache=True) scored by transformers' own logits processors in transformers'
order, drawing with torch.multinomial. Skipped when tortoise-tts is not installed (pip install -e '.[tts-pipelines]').
"""

import importlib.util
import subprocess
import sys
import types

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

if importlib.util.find_spec("tortoise") is None:
    pytest.skip("tortoise-tts is not installed (pip install -e '.[tts-pipelines]')", allow_module_level=True)

from xattn.integrations import tortoise  # noqa: E402

with tortoise.importable():
    from tortoise.models.autoregressive import UnifiedVoice  # noqa: E402

START, STOP = 38, 39
SETTINGS = {  # keywords as TextToSpeech.tts() passes them (its presets: top_p .8, temperature .8, rp 2)
    "greedy rp 2": dict(do_sample=False, repetition_penalty=2.0),
    "greedy rp 10": dict(do_sample=False, repetition_penalty=10.0),
    "sampling, tts() defaults, 3 candidates": dict(do_sample=True, top_p=0.8, temperature=0.8, repetition_penalty=2.0,
                                                   length_penalty=1.0, num_return_sequences=3),
    # min_length counts tortoise's fake prompt ([1] * 12 + [start] here)
    "sampling, min_length 20, 3 candidates": dict(do_sample=True, top_p=0.8, temperature=0.8, repetition_penalty=2.0,
                                                  num_return_sequences=3, min_length=20),
    "sampling, top-k 10, 2 candidates": dict(do_sample=True, top_k=10, top_p=0.9, temperature=1.2,
                                             repetition_penalty=1.5, num_return_sequences=2),
}


def unified_voice(kv_cache: bool):
    torch.manual_seed(0)
    voice = UnifiedVoice(layers=2, model_dim=32, heads=2, max_text_tokens=20, max_mel_tokens=30, number_text_tokens=16,
                         number_mel_codes=40, start_mel_token=START, stop_mel_token=STOP, checkpointing=False)
    voice.post_init_gpt2_config(kv_cache=kv_cache)
    return voice.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["kv_cache=False (tortoise's default)", "kv_cache=True"])
def voice(request):
    return unified_voice(request.param)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(2)
    return torch.randn(1, 32, generator=g), torch.randint(1, 16, (1, 9), generator=g)  # conditioning latent, text


def reference(voice, cond, text, *, do_sample=False, temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0,
              num_return_sequences=1, length_penalty=None, min_length=0):
    """inference_speech as transformers' generate runs it, by hand, through tortoise's own forward."""
    model = voice.inference_model
    prefix_length = voice.compute_embeddings(cond, text).shape[1] - 1
    ids = voice.compute_embeddings(cond, text).repeat_interleave(num_return_sequences, 0)  # [1] * P + [start]
    processors = [RepetitionPenaltyLogitsProcessor(repetition_penalty), MinLengthLogitsProcessor(min_length, STOP)]
    if do_sample:
        processors += [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    processors = LogitsProcessorList(processors)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    past = None
    for _ in range(voice.max_mel_tokens - 1):
        mask = torch.ones_like(ids)
        if model.kv_cache and past is not None:  # transformers feeds the last token, its cache and the whole mask
            out = model(input_ids=ids[:, -1:], past_key_values=past, attention_mask=mask, use_cache=True)
        else:
            out = model(input_ids=ids, attention_mask=mask, use_cache=model.kv_cache)
        past = out.past_key_values if model.kv_cache else None
        scores = processors(ids, out.logits[:, -1].float())
        token = torch.multinomial(scores.softmax(-1), 1)[:, 0] if do_sample else scores.argmax(-1)
        token = torch.where(unfinished, token, STOP)
        unfinished &= token != STOP
        ids = torch.cat([ids, token[:, None]], 1)
        if not unfinished.any():
            break
    return ids[:, prefix_length + 1:]


def test_tortoise_does_not_import_or_decode_without_xattn(voice, inputs):
    code = "import tortoise.models.autoregressive"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and ("ImportError" in result.stderr or "ModuleNotFoundError" in result.stderr)
    cond, text = inputs
    with pytest.raises(AttributeError, match="generate"):  # its GPT2InferenceModel lacks GenerationMixin
        voice.inference_speech(cond, text, do_sample=False)
    tortoise.enable(voice)
    try:
        codes = voice.inference_speech(cond, text, do_sample=False)
    finally:
        tortoise.disable(voice)
    assert codes.shape[0] == 1 and codes.shape[1] > 3
    assert not tortoise.is_enabled(voice)


def test_importable_in_a_fresh_interpreter():
    """Nothing of transformers' model code imported before the block: transformers.processing_utils' first import
    puts a new module in sys.modules["transformers"] on the way (the names the block adds must be on that one)."""
    code = "\n".join([
        "import sys",
        "from xattn.integrations import tortoise as integration",
        "assert 'transformers.processing_utils' not in sys.modules",
        "with integration.importable():",
        "    import tortoise.models.autoregressive",
        "    from tortoise.api import TextToSpeech",
        "import transformers",
        "assert not hasattr(transformers, 'LogitsWarper') and 'torchaudio' not in sys.modules",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("setting", SETTINGS)
def test_candidates_equal_tortoises_decoding_by_hand(voice, inputs, setting):
    cond, text = inputs
    kwargs = SETTINGS[setting]
    for seed in (5, 6):
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = reference(voice, cond, text, **kwargs)
        tortoise.enable(voice)
        try:
            torch.manual_seed(seed)
            codes = voice.inference_speech(cond, text, **kwargs)
        finally:
            tortoise.disable(voice)
        assert torch.equal(codes, expected)
        assert codes.shape == (kwargs.get("num_return_sequences", 1), codes.shape[1]) and codes.shape[1] > 3


def test_kv_cache_positions_are_tortoises(inputs):
    """With kv_cache=True tortoise's cached steps read a different audio position; xattn follows each mode, and the
    two modes really decode differently here (else the reference would not tell them apart)."""
    cond, text = inputs
    with torch.no_grad():
        plain, cached = (reference(unified_voice(kv), cond, text, repetition_penalty=2.0) for kv in (False, True))
    assert not torch.equal(plain[:, : cached.shape[1]], cached[:, : plain.shape[1]])


def test_enable_takes_texttospeech_and_refuses_what_it_cannot_do(inputs):
    cond, text = inputs
    voice = unified_voice(False)
    tortoise.enable(voice)
    with pytest.raises(ValueError, match="typical"):
        voice.inference_speech(cond, text, typical_sampling=True)
    with pytest.raises(ValueError, match="input_tokens"):
        voice.inference_speech(cond, text, input_tokens=torch.tensor([[3, 4]]))
    tortoise.disable(voice)
    tts = types.SimpleNamespace(autoregressive=voice)  # tortoise.api.TextToSpeech holds it there
    tortoise.enable(tts)
    assert tortoise.is_enabled(voice)
    tortoise.disable(tts)
    assert not tortoise.is_enabled(voice)
    bare = UnifiedVoice.__new__(UnifiedVoice)
    torch.nn.Module.__init__(bare)
    bare.inference_model = None
    with pytest.raises(ValueError, match="post_init_gpt2_config"):
        tortoise.enable(bare)


@pytest.mark.parametrize("setting", ["greedy rp 2", "sampling, top-k 10, 2 candidates"])
def test_packed_weights_give_exacts_candidates(voice, inputs, setting):
    cond, text = inputs
    codes = {}
    for weights in ("exact", "packed"):
        tortoise.enable(voice, weights=weights)
        try:
            torch.manual_seed(5)
            codes[weights] = voice.inference_speech(cond, text, **SETTINGS[setting])
        finally:
            tortoise.disable(voice)
    assert torch.equal(codes["packed"], codes["exact"]) and codes["exact"].shape[1] > 3


def test_int8_weights_and_an_unknown_format(inputs):
    cond, text = inputs
    voice = unified_voice(True)
    tortoise.enable(voice, weights="int8")
    try:
        codes = voice.inference_speech(cond, text, do_sample=True, num_return_sequences=2, max_generate_length=8,
                                       min_new_tokens=8)
    finally:
        tortoise.disable(voice)
    assert codes.shape == (2, 8) and int(codes.max()) < 40 and not bool((codes == STOP).any())
    with pytest.raises(ValueError) as error:
        tortoise.enable(voice, weights="float16")
    assert str(error.value) == "weights='float16': choose one of exact, packed, bf16, int8"
    assert not tortoise.is_enabled(voice)
