"""Tiny random models (hidden 32, 2 layers) keep the suite fast; one ViT-B/16 + GPT-2-small test proves the
real shape. Every model is built from a seed, so a failure reproduces."""

import shutil

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    SpeechEncoderDecoderConfig,
    SpeechEncoderDecoderModel,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
    ViTConfig,
    Wav2Vec2Config,
)

import xattn


def _threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# A test or a module's fixture that sets torch's thread count must not change the tests after it (a run in this
# process compared with one in a subprocess depends on it). Autouse fixtures come before the others of their scope.
_torch_threads_restored_per_module = pytest.fixture(autouse=True, scope="module")(_threads_restored)
_torch_threads_restored_per_test = pytest.fixture(autouse=True)(_threads_restored)

VOCAB = 99
BOS, EOS, PAD = 1, 2, 0


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """Replace module.name with a wrapper that records each call's first argument's row count (which path ran)."""
    calls = []
    real = getattr(module, name)

    def counted(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(module, name, counted)
    return calls


def gpt2_config(**overrides) -> GPT2Config:
    kwargs = dict(
        n_embd=32, n_layer=2, n_head=4, n_inner=None, vocab_size=VOCAB, n_positions=64, add_cross_attention=True,
        is_decoder=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_captioner(seed: int = 0, encoder_hidden: int = 32, encoder_inner: int = 37,
                   **decoder_overrides) -> VisionEncoderDecoderModel:
    """ViT (32 px, 8 px patches -> 17 positions) + GPT-2 with cross-attention, random weights."""
    torch.manual_seed(seed)
    encoder = ViTConfig(
        hidden_size=encoder_hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=encoder_inner,
        image_size=32, patch_size=8,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, gpt2_config(**decoder_overrides))
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = BOS, PAD, EOS
    return VisionEncoderDecoderModel(config).eval()


def tiny_recognizer(seed: int = 0) -> SpeechEncoderDecoderModel:
    """Wav2Vec2 (layer-norm feature extractor, so padding is masked) + GPT-2 with cross-attention."""
    torch.manual_seed(seed)
    encoder = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, conv_dim=(16, 16),
        conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer", do_stable_layer_norm=True, vocab_size=VOCAB,
    )
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, gpt2_config())
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = BOS, PAD, EOS
    return SpeechEncoderDecoderModel(config).eval()


def save_task_models(root) -> dict:
    """The scene captioner's and the digit recognizer's architectures (random weights, 4 new tokens) saved as the
    shipped checkpoints are, with tokenizer and preprocessor: {"captioner": path, "recognizer": path}."""
    from xattn.datasets.tokenizer import train_caption_tokenizer
    from xattn.tasks.captioning import new_scene_captioner
    from xattn.tasks.transcription import new_digit_recognizer

    tokenizer = train_caption_tokenizer(["a small red circle above a large blue square"] * 5, vocab_size=300)
    torch.manual_seed(0)
    paths = {}
    for name, (model, preprocessor) in [("captioner", new_scene_captioner(tokenizer)),
                                        ("recognizer", new_digit_recognizer(tokenizer))]:
        model.generation_config.max_new_tokens = 4
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        preprocessor.save_pretrained(paths[name])
    return paths


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(**overrides)).eval()


def frequent_token(model, generate_kwargs) -> int:
    """A token that transformers' greedy output emits mid-sequence: used as EOS so rows stop at different steps."""
    with torch.no_grad():
        out = model.generate(**generate_kwargs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    body = out[:, 2:].flatten()
    return int(torch.mode(body).values)


def with_eos(model, eos: int):
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    if hasattr(model.config, "decoder"):
        model.config.decoder.eos_token_id = eos
    return model


@pytest.fixture(scope="session")
def espeak_ng():
    """Speech data is synthesized with espeak-ng (a system package): without it those tests skip, saying how to
    install it (.ci/run does)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed: apt-get install espeak-ng (Debian/Ubuntu; .ci/run installs it)")


@pytest.fixture(scope="session")
def captioner():
    return tiny_captioner()


@pytest.fixture(scope="session")
def images():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def xattn_of(model):
    return xattn.from_hf(model)


# `pytest.mark.kernels`: the test needs xattn's CPU kernels. Checked when the test runs, not at collection, since
# the first check builds them (g++, a minute or more), and collecting a file should never do that.
def pytest_configure(config):
    config.addinivalue_line("markers", "kernels: needs xattn's CPU kernels (built on first use, when a test runs)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("kernels") is not None:
        from xattn.fast import kernels

        if not kernels.available():
            pytest.skip("needs xattn's kernels (g++, x86-64 with AVX2 + FMA, XATTN_NO_KERNELS unset); a failed "
                        "build's warning says why")


@pytest.fixture(params=["avx2", "vnni", "amx"])
def int8_kernel(request):
    """Each int8 kernel of xattn's in turn (skipped where the CPU lacks its instructions), the default restored
    after."""
    from xattn.fast import kernels

    if not kernels.available():
        pytest.skip("needs xattn's kernels")
    before = kernels.int8_kernel()
    try:
        kernels.int8_kernel(request.param)
    except RuntimeError as error:  # this CPU lacks its instructions
        pytest.skip(str(error))
    try:
        yield request.param
    finally:
        kernels.int8_kernel(before)


def fast_engine_and_pixels(weights: str):
    """A tiny captioner in a fast weight format and two 32 px images: what the kernel-hook tests decode."""
    import xattn

    engine = xattn.from_hf(tiny_captioner(seed=43), weights=weights)
    return engine, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
