"""Property-based: random bytes, image sizes/modes, audio arrays and generate() options never crash with
anything but the documented ValueError."""

import io

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import xattn
from conftest import tiny_captioner
from xattn.tasks.audio import load_audio, to_mono
from xattn.tasks.vision import load_image

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".png", ".jpg", ".wav", ".flac", ".bin"]))
def test_random_bytes_are_a_clear_error_or_a_valid_result(tmp_path, data, suffix):
    path = tmp_path / f"random{suffix}"
    path.write_bytes(data)
    for loader in (load_image, load_audio):
        try:
            out = loader(str(path))
        except ValueError as error:
            assert str(path) in str(error)
        else:
            assert out is not None


@FAST
@given(width=st.integers(1, 300), height=st.integers(1, 300),
       mode=st.sampled_from(["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F", "YCbCr"]),
       fmt=st.sampled_from(["PNG", "TIFF", "WEBP", "BMP", "JPEG", "GIF"]))
def test_any_image_size_and_mode_loads_as_rgb(tmp_path, width, height, mode, fmt):
    image = Image.new(mode, (width, height))
    path = tmp_path / f"image.{fmt.lower()}"
    try:
        image.save(path, format=fmt)
    except (OSError, ValueError, KeyError):
        return  # Pillow cannot write this mode in this format: nothing to load
    loaded = load_image(str(path))
    assert loaded.mode == "RGB" and loaded.size == (width, height)


@FAST
@given(frames=st.integers(0, 4000), channels=st.integers(1, 6), rate=st.integers(1000, 96000),
       special=st.sampled_from([None, np.nan, np.inf, -np.inf, 0.0]))
def test_any_audio_array_is_mono_at_16k_or_a_clear_error(frames, channels, rate, special):
    samples = np.random.default_rng(frames).uniform(-1, 1, (frames, channels)).astype(np.float32)
    if special is not None and frames:
        samples[frames // 2, 0] = special
    try:
        out = to_mono(samples, rate)
    except ValueError as error:
        assert frames == 0 or not np.isfinite(special)
        assert "samples" in str(error)
    else:
        assert out.ndim == 1 and out.dtype == np.float32 and np.isfinite(out).all()
        assert abs(len(out) - frames * 16000 / rate) <= 1


@FAST
@given(rate=st.sampled_from([8000, 11025, 22050, 44100, 48000]), channels=st.integers(1, 4),
       subtype=st.sampled_from(["PCM_16", "PCM_24", "FLOAT"]), seconds=st.floats(0.01, 0.3))
def test_any_wav_rate_and_channel_count_loads(tmp_path, rate, channels, subtype, seconds):
    frames = max(1, int(rate * seconds))
    data = np.random.default_rng(channels).uniform(-0.5, 0.5, (frames, channels))
    buffer = io.BytesIO()
    soundfile.write(buffer, data, rate, subtype=subtype, format="WAV")
    path = tmp_path / "a.wav"
    path.write_bytes(buffer.getvalue())
    out = load_audio(str(path))
    assert out.ndim == 1 and abs(len(out) - frames * 16000 / rate) <= 1


_ENGINE = xattn.from_hf(tiny_captioner(seed=8))
_PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
_OPTION = st.one_of(st.none(), st.integers(-3, 70), st.floats(-2, 3), st.just(float("nan")), st.booleans(),
                    st.sampled_from(["never", "x", [2, 5], []]))


@settings(max_examples=60, deadline=None)
@given(options=st.fixed_dictionaries({}, optional={
    name: _OPTION for name in ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                               "repetition_penalty", "num_beams", "length_penalty", "early_stopping",
                               "num_return_sequences", "eos_token_id", "pad_token_id")}))
def test_random_generate_options_give_tokens_or_a_clear_error(options):
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("max_new_tokens", 4)
    try:
        out = _ENGINE.generate(pixel_values=_PIXELS, **options)
    except ValueError as error:
        assert str(error)
    else:
        assert out.dtype == torch.long and out.ndim == 2 and out.shape[0] % 2 == 0


@pytest.mark.parametrize("bad", [{"max_new_tokens": 10**6}, {"num_beams": 3, "num_return_sequences": 4}])
def test_out_of_range_options_say_what_to_pass(bad):
    with pytest.raises(ValueError):
        _ENGINE.generate(pixel_values=_PIXELS, **bad)
