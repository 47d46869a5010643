"""xattn.vit: a ViTModel's layers in one kernel call, against transformers' own forward."""

import pytest
import torch
from transformers import ViTConfig, ViTModel

import xattn
from conftest import tiny_captioner
from xattn.fast import kernels
from xattn.fast.formats import ConvertedLinear, convert_linears
from xattn.fast.vit import ViTEncoder, supports

pytestmark = pytest.mark.kernels  # skipped when the test runs, where they cannot be built (conftest.py)


def vit(seed=0, **overrides) -> ViTModel:
    """24 px images in 8 px patches (10 positions: no 16-wide panel is full), 3 heads of 16 (hd = 16), odd MLP."""
    torch.manual_seed(seed)
    config = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=61, image_size=24,
                  patch_size=8)
    return ViTModel(ViTConfig(**{**config, **overrides})).eval()


def relative_error(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("overrides", [{}, {"num_attention_heads": 4, "hidden_size": 36}, {"qkv_bias": False}])
def test_fp32_layers_equal_transformers_up_to_rounding(overrides):
    model = vit(**overrides)
    pixels = torch.randn(3, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
    got = ViTEncoder(model, "packed")(pixels)[0]
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_the_bench_shape_equals_transformers_up_to_rounding():
    """ViT-B's shape (197 positions, 12 heads of 64), two layers: the tiles cover full and partial panels."""
    model = vit(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=2, image_size=224,
                patch_size=16)
    pixels = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
    got = ViTEncoder(model, "packed")(pixels)[0]
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_int8_layers_are_as_close_to_fp32_as_int8_linears_are():
    """The kernel's layers run fbgemm's int8 products (7 bits per tensor), as converted linears do where xattn's AVX2
    kernel is chosen (with VNNI, linears of up to 64 rows run xattn's 8 bits per row, closer to fp32)."""
    model = vit(seed=3)
    pixels = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(4))
    with kernels.using_int8_kernel("avx2"), torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
        linears = convert_linears(model, "int8")(pixel_values=pixels).last_hidden_state
    got = ViTEncoder(model, "int8")(pixels)[0]
    assert not torch.equal(got, want)
    assert relative_error(got, want) < 0.05
    assert relative_error(got, want) < 1.5 * relative_error(linears, want)


def test_the_workspace_is_kept_for_a_batch_size_and_replaced_for_another():
    model = vit(seed=5)
    encoder = ViTEncoder(model, "packed")
    pixels = torch.randn(3, 3, 24, 24, generator=torch.Generator().manual_seed(6))
    first = encoder(pixels)[0]
    kept = [t.data_ptr() for t in encoder._workspace]
    again = encoder(pixels)[0]
    assert [t.data_ptr() for t in encoder._workspace] == kept
    assert torch.equal(first, again)
    one = encoder(pixels[1:2])[0]  # another size: a new workspace, and the same image's result
    assert encoder._workspace[0].shape[0] == 10
    assert (one[0] - first[1]).abs().max() < 1e-5 * first.abs().max()


def test_with_weights_runs_a_vit_encoder_through_the_kernel_and_leaves_others_to_converted_linears():
    model = tiny_captioner(seed=7)
    exact = xattn.from_hf(model)
    engine = exact.with_weights("int8", encoder_weights="int8")
    assert isinstance(engine.encoder, ViTEncoder) and engine.encoder.kind == "int8"
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    got, _ = engine.encode(pixel_values=pixels)
    want, _ = exact.encode(pixel_values=pixels)
    assert got.shape == want.shape and relative_error(got, want) < 0.05
    assert engine.generate(pixel_values=pixels, max_new_tokens=4).shape == (2, 5)
    bf16 = exact.with_weights("packed", encoder_weights="bf16")
    assert any(isinstance(m, ConvertedLinear) for m in bf16.encoder.modules())


def test_unsupported_encoders_are_refused_by_name():
    relu = vit(hidden_act="relu")
    assert not supports(relu, "int8") and supports(vit(), "int8") and not supports(vit(), "bf16")
    with pytest.raises(ValueError, match="ViTModel with GELU"):
        ViTEncoder(relu, "int8")
    with pytest.raises(ValueError, match="weights='exact'"):
        ViTEncoder(vit(), "exact")
    with pytest.raises(ValueError, match="pass no attention_mask"):
        ViTEncoder(vit(), "packed")(torch.randn(1, 3, 24, 24), attention_mask=torch.ones(1, 10))
