"""xattn.vit: a ViTModel's layers in one kernel call, against transformers' own forward."""

import pytest
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTModel

import xattn
from conftest import tiny_captioner
from xattn.fast import accelerate_encoder, kernels
from xattn.fast.formats import ConvertedLinear, convert_linears
from xattn.fast.vit import _PROJECTIONS, ViTEncoder, _layers, _naming, supports

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
    assert isinstance(bf16.encoder, ViTEncoder) and bf16.encoder.kind == "bf16"
    relu = vit(hidden_act="relu")  # not the kernel's: its modules stay, with converted linears
    assert any(isinstance(m, ConvertedLinear) for m in accelerate_encoder(relu, "bf16").modules())


def test_unsupported_encoders_are_refused_by_name():
    relu = vit(hidden_act="relu")
    assert not supports(relu, "int8") and supports(vit(), "int8") and supports(vit(), "bf16")
    assert not supports(vit(), "exact")
    with pytest.raises(ValueError, match="ViTModel with GELU"):
        ViTEncoder(relu, "int8")
    with pytest.raises(ValueError, match="weights='exact'"):
        ViTEncoder(vit(), "exact")
    with pytest.raises(ValueError, match="pass no attention_mask"):
        ViTEncoder(vit(), "packed")(torch.randn(1, 3, 24, 24), attention_mask=torch.ones(1, 10))


def bf16_layers(model: ViTModel, pixels: torch.Tensor, tiles: bool = False) -> torch.Tensor:
    """The bf16 kind's math written out with torch's ops: each product's input rounded to bfloat16; qkv's sums + bias,
    and fc1's GELU(sums + bias), rounded once to bfloat16 (Q, K, V and fc2's input); attention over bfloat16 Q, K, V
    (torch's); the norms in fp32. out's and fc2's sums: rounded to bfloat16 (oneDNN's products), or unrounded (the
    AMX tiles'), their biases and the residual sums in fp32."""
    def biased(x, linear):  # the sums in fp32 (exact products of bfloat16 values), the bias added before rounding
        return F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)

    def residual(x, linear):
        if tiles:
            return biased(x, linear)
        return F.linear(x.bfloat16(), linear.weight.bfloat16()).float() + linear.bias

    hidden = model.embeddings(pixels)
    if tiles:  # the patch projection on the tiles too: its pixels and weights rounded to bfloat16, fp32 sums
        conv = model.embeddings.patch_embeddings.projection
        patches = F.conv2d(pixels.bfloat16().float(), conv.weight.bfloat16().float(), conv.bias, stride=conv.stride)
        cls = model.embeddings.cls_token.expand(len(pixels), -1, -1)
        hidden = torch.cat((cls, patches.flatten(2).transpose(1, 2)), dim=1) + model.embeddings.position_embeddings
    batch, positions, width = hidden.shape
    for layer in _layers(model):  # transformers 5.x's names or 4.x's
        modules = dict(layer.named_modules())
        (*qkv, out, fc1, fc2) = (modules[name] for group in _PROJECTIONS[_naming(layer)]
                                 for name in ([group] if isinstance(group, str) else group))
        x = layer.layernorm_before(hidden)
        q, k, v = (biased(x, m).bfloat16().view(batch, positions, -1, width // model.config.num_attention_heads)
                   .transpose(1, 2) for m in qkv)
        context = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, positions, width)
        hidden = hidden + residual(context, out)
        inner = F.gelu(biased(layer.layernorm_after(hidden), fc1)).bfloat16()
        hidden = hidden + residual(inner, fc2)
    return model.layernorm(hidden)


def test_bf16_layers_do_the_bf16_math():
    model = vit(seed=5)
    pixels = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
        same_math = bf16_layers(model, pixels)
    encoder = ViTEncoder(model, "bf16")
    got = encoder(pixels)[0]
    assert encoder.kind == "bf16" and all(w.dtype == torch.bfloat16 for w in encoder._weights)
    assert not torch.equal(got, want)
    assert relative_error(got, want) < 0.02
    assert relative_error(got, same_math) < 0.1 * relative_error(got, want)
    assert torch.equal(encoder(pixels)[0], got)  # the workspace kept between calls changes nothing


def tile_vit(seed=0, **overrides) -> ViTModel:
    """Widths the AMX tiles take (64, MLP 96: multiples of 32), 10 positions an image."""
    return vit(seed=seed, **{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, **overrides})


def _amx_bf16_or_skip():
    if not kernels.amx_bf16():
        pytest.skip("this CPU (or its OS) gives no AMX-BF16: the bf16 kind runs oneDNN's products here")


def test_bf16_tiles_hold_each_weight_value_where_amx_reads_it():
    weight = torch.randn(40, 70).bfloat16()  # N and K past a tile: zeros fill the rest
    tiles = kernels.bf16_tiles(weight)
    assert tiles.shape == (3, 3, 16, 32)
    n, k = torch.meshgrid(torch.arange(48), torch.arange(96), indexing="ij")
    # row r of tile (n // 16, k // 32) holds the pair k = 2r, 2r + 1 of each of its 16 columns, column-major pairs
    at = tiles[n // 16, k // 32, (k % 32) // 2, (n % 16) * 2 + k % 2]
    padded = torch.zeros(48, 96, dtype=torch.bfloat16)
    padded[:40, :70] = weight
    assert torch.equal(at, padded)


@pytest.mark.parametrize("heads", [4, 2])  # heads of 16: torch's attention; of 32: xattn's on the tiles
def test_bf16_tile_layers_do_the_tile_math(heads):
    _amx_bf16_or_skip()
    model = tile_vit(seed=11, num_attention_heads=heads)
    pixels = torch.randn(4, 3, 24, 24, generator=torch.Generator().manual_seed(12))  # 40 rows: a part-filled pair
    with torch.no_grad():
        want = model(pixel_values=pixels).last_hidden_state
        same_math = bf16_layers(model, pixels, tiles=True)
    encoder = ViTEncoder(model, "bf16")
    assert encoder.tiles and encoder.rows_independent
    assert all(w.dtype == torch.bfloat16 and w.dim() == 4 for w in encoder._weights)
    got = encoder(pixels)[0]
    assert relative_error(got, want) < 0.02
    assert relative_error(got, same_math) < 0.1 * relative_error(got, want)
    # oneDNN's products round the out and fc2 sums to bfloat16 first: with the same (transformers') patch projection,
    # the tiles are closer to fp32
    onednn = ViTEncoder(model, "bf16", tiles=False)
    assert not onednn.tiles and not onednn.rows_independent and onednn._patch_tiles is None
    encoder._patch_tiles = None
    assert relative_error(encoder(pixels)[0], want) < relative_error(onednn(pixels)[0], want)


@pytest.mark.parametrize("heads", [4, 2])
@pytest.mark.parametrize("batch", [1, 3, 7, 52])  # 52 x 10 rows: the threads split the rows, not the columns
def test_bf16_tiles_give_each_image_what_it_gets_alone(batch, heads):
    _amx_bf16_or_skip()
    encoder = ViTEncoder(tile_vit(seed=13, num_attention_heads=heads), "bf16")
    pixels = torch.randn(52, 3, 24, 24, generator=torch.Generator().manual_seed(14))
    alone = torch.cat([encoder(pixels[i:i + 1])[0] for i in range(52)])
    together = torch.cat([encoder(pixels[i:i + batch])[0] for i in range(0, 52, batch)])
    assert torch.equal(together, alone)


def test_the_tile_encoder_projects_patches_on_the_tiles_and_leaves_other_sizes_to_transformers():
    _amx_bf16_or_skip()
    model = tile_vit(seed=15)
    encoder = ViTEncoder(model, "bf16")
    assert encoder._patch_tiles is not None
    pixels = torch.randn(3, 3, 24, 24, generator=torch.Generator().manual_seed(16))
    conv = model.embeddings.patch_embeddings.projection
    with torch.no_grad():
        exact = model.embeddings(pixels)
        patches = F.conv2d(pixels.bfloat16().float(), conv.weight.bfloat16().float(), conv.bias, stride=conv.stride)
        want = torch.cat((model.embeddings.cls_token.expand(3, -1, -1), patches.flatten(2).transpose(1, 2)), dim=1)
        want = want + model.embeddings.position_embeddings
        got = encoder._embed(pixels, False)
        assert relative_error(got, want) < 1e-6  # the bfloat16 math, fp32 sums in another order
        assert 1e-4 < relative_error(got, exact) < 1e-2  # and not transformers' fp32 product
        assert torch.equal(encoder._embed(pixels, True), model.embeddings(pixels, interpolate_pos_encoding=True))
        channels_last = pixels.contiguous(memory_format=torch.channels_last)  # the same values, other strides
        assert torch.equal(encoder(channels_last)[0], encoder(pixels)[0])
        with pytest.raises(ValueError, match="doesn't match model"):
            encoder(torch.randn(1, 3, 32, 32))  # transformers' own refusal
        with pytest.raises(ValueError, match="channel dimension"):
            encoder(torch.randn(1, 4, 24, 24))
    # a patch width the tiles do not take (3 x 5 x 5 = 75 values): transformers' projection
    odd = ViTEncoder(tile_vit(seed=15, image_size=25, patch_size=5), "bf16")
    assert odd._patch_tiles is None


def torch_attention(qkv: torch.Tensor, images: int, heads: int) -> torch.Tensor:
    """torch's scaled_dot_product_attention per image and head over rows qkv [B * S, 3D] (Q, K, V), in qkv's dtype,
    as rows [B * S, D]: over views of qkv, as the ViT kernel calls it where its own does not run."""
    rows, width = qkv.shape
    split = qkv.view(images, rows // images, 3, heads, width // (3 * heads))
    q, k, v = (split.select(2, i).transpose(1, 2) for i in range(3))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, width // 3)


@pytest.mark.parametrize("images,positions,heads,hd,spread", [
    (1, 1, 1, 32, 1.0), (2, 17, 2, 64, 1.0), (3, 33, 3, 64, 4.0), (1, 197, 12, 64, 1.0), (2, 64, 2, 128, 2.0),
    (2, 31, 1, 96, 8.0), (1, 16, 2, 32, 1.0)])
def test_tile_attention_is_torchs_attention_up_to_rounding(images, positions, heads, hd, spread):
    """Against the fp32 math over the same bfloat16 Q, K, V: as close as torch's own bfloat16 attention, whatever the
    positions (a part-filled row pair, key block or step of 32 keys) and head widths that are multiples of 32;
    `spread` scales the inputs (x 8: scores in the hundreds, the softmax near one-hot)."""
    _amx_bf16_or_skip()
    generator = torch.Generator().manual_seed(positions * hd)
    qkv = (torch.randn(images * positions, 3 * heads * hd, generator=generator) * spread).bfloat16()
    exact = torch_attention(qkv.float(), images, heads)
    torchs = torch_attention(qkv, images, heads).float()
    got = kernels.bf16_attention(qkv, images, heads)
    assert got.dtype == torch.bfloat16 and got.shape == (images * positions, heads * hd)
    if positions == 1:  # one key: the output is V, exactly
        assert torch.equal(got, qkv[:, 2 * heads * hd:])
        return
    assert relative_error(got.float(), exact) < 1.1 * relative_error(torchs, exact)
    assert relative_error(got.float(), torchs) < 1.5 * relative_error(torchs, exact)
    alone = torch.cat([kernels.bf16_attention(part.contiguous(), 1, heads) for part in qkv.chunk(images)])
    assert torch.equal(alone, got)  # each image's result is its own


def test_attention_of_narrower_heads_is_torchs():
    """Heads of 16 (not a multiple of 32) run torch's attention: its bits."""
    qkv = torch.randn(2 * 10, 3 * 4 * 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(kernels.bf16_attention(qkv, 2, 4), torch_attention(qkv, 2, 4))


def test_a_nan_in_tile_attention_stays_in_its_image_and_head():
    _amx_bf16_or_skip()
    qkv = torch.randn(2 * 20, 3 * 2 * 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    clean = kernels.bf16_attention(qkv, 2, 2)
    qkv[3, 2 * 32 + 5] = float("nan")  # image 0, position 3: a value of head 0's key
    got = kernels.bf16_attention(qkv, 2, 2)
    assert torch.isnan(got[:20, :32]).all()  # every query of image 0 reads that key
    assert torch.equal(got[:20, 32:], clean[:20, 32:]) and torch.equal(got[20:], clean[20:])


def test_tiles_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="tiles=True needs"):
        ViTEncoder(vit(), "bf16", tiles=True)  # width 48: not a multiple of 32
    with pytest.raises(ValueError, match="tiles=True needs"):
        ViTEncoder(tile_vit(), "packed", tiles=True)
