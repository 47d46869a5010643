"""Hostile input to xattn's kernels: each op, given a valid call (built as xattn's callers build it, at tiny sizes)
with one argument made wrong, refuses it with a RuntimeError naming that argument, where an unchecked op would
read or write past a buffer, divide by zero, or quietly compute with the wrong shape."""

import pytest
import torch

from xattn.fast import kernels
from xattn.fast.torch_ops import prepack_int8

pytestmark = pytest.mark.kernels  # skipped when the test runs, where they cannot be built (conftest.py)

L, B, H, HD, T, S, B_ENC, F = 2, 2, 4, 8, 8, 5, 2, 64  # layers, rows, heads, head dim, cache, encoder positions
D = H * HD
SHAPES = [(3 * D, D), (D, D), (D, D), (D, D), (F, D), (D, F)]  # [N, K] of qkv, attn_out, cross_q, cross_out, mlp_in/out


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _quantized(n, k):
    """An [n, k] int8 weight as the int8 format holds it (xattn.weights.Int8Linear): blocks, scales, fbgemm's copy."""
    weight = _randn(n, k)
    quantized, packed = prepack_int8(weight, _randn(n))
    return kernels.int8_blocks(quantized.int_repr()), quantized.q_per_channel_scales().float(), packed


def _non_contiguous(t):
    """t's values in a tensor of t's shape whose last dimension is strided."""
    return torch.zeros(*t.shape, 2, dtype=t.dtype)[..., 0].copy_(t)


def decoder_args(int8=False, cross=True):
    """The arguments xattn.fused.FusedLayers passes: fp32 panels with biases, or int8 blocks with their scales and
    fbgemm's packed copies; the cache's tensors (xattn/cache.py) with beams gathered by enc_index."""
    shapes = [s for _ in range(L) for i, s in enumerate(SHAPES) if cross or i not in (2, 3)]
    if int8:
        weights, scales, packed = map(list, zip(*(_quantized(n, k) for n, k in shapes)))
    else:
        weights, scales, packed = [kernels.panels(_randn(n, k)) for n, k in shapes], [], []
    return dict(
        hidden=_randn(B, D), norm_weight=1 + 0.1 * _randn(L, 3, D), norm_bias=0.1 * _randn(L, 3, D), weights=weights,
        scales=scales, biases=[_randn(n) for n, _ in shapes], packed=packed, keys=torch.zeros(L, B, H, T, HD),
        values=torch.zeros(L, B, H, T, HD), cross_keys=_randn(L, B_ENC, H, S, HD) if cross else None,
        cross_values=_randn(L, B_ENC, H, S, HD) if cross else None,
        cross_mask=torch.tensor([[True] * S, [True] * (S - 1) + [False]]) if cross else None,
        enc_index=torch.tensor([1, 0]) if cross else None, position=torch.tensor(3), scalings=[HD ** -0.5] * L,
        eps=1e-5,
    )


def _replace(name, index, make):
    """args[name][index] = make()"""
    def change(args):
        args[name] = list(args[name])
        args[name][index] = make()
    return change


def _set(**makes):
    """args[name] = make() for each name"""
    return lambda args: args.update({name: make() for name, make in makes.items()})


def _edit(name, edit):
    """args[name] = edit(args[name])"""
    return lambda args: args.update({name: edit(args[name])})


def _no_cross_but(**makes):
    def change(args):
        args.update(decoder_args(cross=False))
        _set(**makes)(args)
    return change


def _panels(n, k):
    return lambda: kernels.panels(_randn(n, k))


def _case(change, message, id):
    return pytest.param(change, message, id=id)


DECODER_CASES = [
    _case(_replace("weights", 1, _panels(D // 2, D)), r"weights\[1\] \(layer 0 attn_out\)", "attn_out too narrow"),
    _case(_replace("weights", 1, _panels(2 * D, D)), r"weights\[1\] \(layer 0 attn_out\)", "attn_out too wide"),
    _case(_replace("weights", 7, _panels(D, 2 * D)), r"weights\[7\] \(layer 1 attn_out\)", "attn_out K too large"),
    _case(_replace("weights", 2, _panels(3 * D, D)), r"weights\[2\] \(layer 0 cross_q\)", "cross_q too wide"),
    _case(_replace("weights", 5, _panels(D, D)), r"weights\[5\] \(layer 0 mlp_out\)", "mlp_out K not mlp_in N"),
    _case(_replace("weights", 0, lambda: kernels.panels(_randn(3 * D, D)).double()), r"weights\[0\] \(layer 0 qkv\)",
          "float64 weight"),
    _case(_replace("weights", 1, lambda: _non_contiguous(kernels.panels(_randn(D, D)))),
          r"weights\[1\].*non-contiguous", "non-contiguous weight"),
    _case(_edit("weights", lambda w: w[:-1]), r"weights: expected 12 weights", "one weight missing"),
    _case(_replace("biases", 1, lambda: _randn(D // 2)), r"biases\[1\] \(layer 0 attn_out\)", "bias too short"),
    _case(_replace("biases", 4, lambda: _randn(F + 1)), r"biases\[4\] \(layer 0 mlp_in\)", "bias too long"),
    _case(_replace("biases", 0, lambda: _randn(3 * D).double()), r"biases\[0\] \(layer 0 qkv\)", "float64 bias"),
    _case(_edit("biases", lambda b: b[:-1]), r"biases: expected none or one per weight", "one bias missing"),
    _case(_edit("norm_weight", lambda t: t.view(L, 3 * D)), r"norm_weight \[L, 3, D\]: expected", "norm_weight 2-d"),
    _case(_edit("norm_bias", torch.Tensor.double), r"norm_bias \[L, 3, D\]: expected", "float64 norm_bias"),
    _case(_edit("hidden", torch.Tensor.double), r"hidden \[B, D\]: expected", "float64 hidden"),
    _case(_edit("keys", torch.Tensor.double), r"keys \[L, B, H, T_max, hd\]: expected", "float64 keys"),
    _case(_edit("keys", _non_contiguous), r"keys.*non-contiguous", "non-contiguous keys"),
    _case(_set(values=lambda: torch.zeros(L, B, H, T - 1, HD)), r"values \(keys' shape\)", "shorter values"),
    _case(_set(cross_keys=lambda: torch.zeros(L, B_ENC, H // 2, S, 2 * HD)), r"cross_keys \[L, B_enc, H, S, hd\]",
          "cross_keys with another head split"),
    _case(_set(cross_values=lambda: torch.zeros(L, B_ENC, H, S - 1, HD)),
          r"cross_values \(cross_keys' shape and dtype\)", "cross_values with fewer positions"),
    _case(_edit("cross_values", torch.Tensor.half), r"cross_values \(cross_keys' shape and dtype\): expected .*float32",
          "float16 cross_values with float32 cross_keys"),
    _case(_edit("cross_keys", torch.Tensor.double), r"cross_keys \[L, B_enc, H, S, hd\] \(float32 or float16\)",
          "float64 cross_keys"),
    _case(_edit("cross_mask", torch.Tensor.flatten), r"cross_mask: expected", "cross_mask flattened"),
    _case(_edit("cross_mask", lambda m: m.to(torch.uint8)), r"cross_mask: expected", "uint8 cross_mask"),
    _case(_set(enc_index=lambda: torch.tensor([0])), r"enc_index \[B\]: expected", "enc_index too short"),
    _case(_set(enc_index=lambda: torch.tensor([0, B_ENC])), r"enc_index\[1\] = 2 is outside", "enc_index too large"),
    _case(_set(enc_index=lambda: torch.tensor([-1, 0])), r"enc_index\[0\] = -1 is outside", "negative enc_index"),
    _case(_set(enc_index=lambda: torch.tensor([1, 0], dtype=torch.int32)), r"enc_index: expected", "int32 enc_index"),
    _case(_set(enc_index=lambda: None, cross_mask=lambda: None, cross_keys=lambda: _randn(L, 3, H, S, HD),
               cross_values=lambda: _randn(L, 3, H, S, HD)),
          r"multiple of the 3 encoder rows", "more encoder rows than rows without enc_index"),  # was a division by 0
    _case(_no_cross_but(enc_index=lambda: torch.tensor([0, 0])), r"need cross_keys", "enc_index without cross_keys"),
    _case(_set(position=lambda: torch.tensor(2.5)), r"position: expected one integer", "fractional position"),
    _case(_set(position=lambda: torch.tensor([1, 2, 3])), r"position: expected one integer, or one per row \(B=2\)",
          "three positions for two rows"),
    _case(_set(position=lambda: torch.tensor([[1, 2]])), r"position: expected one integer", "positions [1, B]"),
    _case(_set(position=lambda: torch.tensor([1, T])), r"position 8 \(row 1\) is outside the cache",
          "a row's position past the cache"),
    _case(_set(values=lambda: torch.zeros(L, 2 * B, H, T, HD)[:, :B]), r"values \(keys' shape\).*strides",
          "values strided unlike keys"),
    _case(_set(scalings=lambda: [1.0]), r"scalings: expected one per layer", "one scaling missing"),
]
INT8_CASES = [
    _case(_replace("scales", 1, lambda: torch.ones(D // 2)), r"scales\[1\] \(layer 0 attn_out\)", "scale too short"),
    _case(_edit("scales", lambda s: s[:-1]), r"scales: expected none", "one scale missing"),
    _case(_set(scales=lambda: []), r"scales: int8 weights need", "no scales"),
    _case(_replace("weights", 1, lambda: _quantized(2 * D, D)[0]), r"weights\[1\] \(layer 0 attn_out\).*int8 blocks",
          "int8 blocks too wide"),
    _case(_edit("packed", lambda p: p[:-1]), r"packed: expected none or one", "one packed weight missing"),
    _case(_replace("packed", 1, lambda: _quantized(D // 2, D)[2]), r"packed\[1\] \(layer 0 attn_out\)",
          "packed weight too narrow"),
    _case(_replace("packed", 1, lambda: prepack_int8(_randn(D // 2, D), None)[1]), r"packed\[1\]'s product",
          "packed weight without bias too narrow"),
]


@pytest.mark.parametrize("int8", [False, True])
def test_the_valid_call_runs(int8):
    args = decoder_args(int8)
    out = kernels.decoder_layers(**args)
    assert out.shape == (B, D) and torch.isfinite(out).all() and args["keys"][:, :, :, 3].abs().sum() > 0
    assert kernels.decoder_layers(**decoder_args(cross=False)).shape == (B, D)


@pytest.mark.parametrize("change,message", DECODER_CASES)
def test_decoder_layers_refuses(change, message):
    args = decoder_args()
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.decoder_layers(**args)


@pytest.mark.parametrize("change,message", INT8_CASES)
def test_decoder_layers_refuses_int8(change, message):
    args = decoder_args(int8=True)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.decoder_layers(**args)


@pytest.mark.parametrize("int8", [False, True])
def test_rows_at_their_own_positions_in_a_range_of_a_larger_cache(int8):
    """In-flight batching: each row at its own position, the cache a range of a larger one's rows (strided); each
    row's output and K/V are those of the row run alone at its position."""
    keys, values = _randn(L, B + 2, H, T, HD), 2 * _randn(L, B + 2, H, T, HD)  # earlier requests' K/V
    stale = keys.clone()
    args = dict(decoder_args(int8), packed=[], keys=keys[:, 1:1 + B], values=values[:, 1:1 + B])
    positions = (3, 6)
    alone = []
    for b, position in enumerate(positions):
        e = int(args["enc_index"][b])
        row = dict(args, hidden=args["hidden"][b:b + 1], keys=args["keys"][:, b:b + 1].clone(),
                   values=args["values"][:, b:b + 1].clone(), position=torch.tensor(position), enc_index=None,
                   cross_keys=args["cross_keys"][:, e:e + 1].contiguous(),
                   cross_values=args["cross_values"][:, e:e + 1].contiguous(),
                   cross_mask=args["cross_mask"][e:e + 1].contiguous())
        alone.append((kernels.decoder_layers(**row), row["keys"], row["values"]))
    out = kernels.decoder_layers(**dict(args, position=torch.tensor(positions)))
    for b, (hidden, row_keys, row_values) in enumerate(alone):
        assert torch.equal(out[b:b + 1], hidden)
        assert torch.equal(keys[:, 1 + b: 2 + b], row_keys) and torch.equal(values[:, 1 + b: 2 + b], row_values)
        assert not torch.equal(keys[:, 1 + b, :, positions[b]], stale[:, 1 + b, :, positions[b]])  # written there
    assert torch.equal(keys[:, 0], stale[:, 0]) and torch.equal(keys[:, -1], stale[:, -1])  # rows outside untouched


def test_a_refused_step_leaves_the_cache_as_it_was():
    args = decoder_args()
    _replace("weights", 7, _panels(2 * D, D))(args)  # layer 1's: the check comes before layer 0 runs
    with pytest.raises(RuntimeError, match=r"weights\[7\]"):
        kernels.decoder_layers(**args)
    assert not args["keys"].any() and not args["values"].any()


def _products(int8):
    """matvec's, matvec_rows' (int8 None) or matvec_int8's valid arguments for x [2, 40] times an [N = 5, K = 40]
    weight."""
    x, bias = _randn(2, 40), _randn(5)
    if int8 is None:
        return kernels.matvec_rows, dict(x=x, weight=_randn(5, 40), bias=bias)
    if int8:
        blocks, scale, _ = _quantized(5, 40)
        return kernels.matvec_int8, dict(x=x, blocks=blocks, n=5, scale=scale, bias=bias)
    return kernels.matvec, dict(x=x, weight_panels=kernels.panels(_randn(5, 40)), n=5, bias=bias)


PRODUCT_CASES = [  # (int8, change, message)
    pytest.param(False, _set(bias=lambda: _randn(4)), r"bias: expected", id="bias too short"),
    pytest.param(False, _set(bias=lambda: _randn(5).double()), r"bias: expected", id="float64 bias"),
    pytest.param(True, _set(bias=lambda: _randn(1, 5)), r"bias: expected", id="bias [1, N]"),
    pytest.param(False, _edit("x", torch.Tensor.double), r"x: expected", id="float64 x"),
    pytest.param(False, _set(n=lambda: 0), r"n: expected a positive", id="n = 0"),
    pytest.param(False, _set(n=lambda: 17), r"weight: expected contiguous CPU float32 panels \[2, 40, 16\]",
                 id="panels for fewer columns"),
    pytest.param(True, _set(n=lambda: 9), r"weight: expected contiguous CPU int8 blocks \[2, 2, 8, 32\]",
                 id="blocks for fewer columns"),
    pytest.param(None, _set(bias=lambda: _randn(4)), r"bias: expected", id="rows: bias too short"),
    pytest.param(None, _edit("x", lambda x: x[:, :39]), r"x's last dimension \(39\) must be the weight's K \(40\)",
                 id="rows: x narrower"),
    pytest.param(None, _edit("weight", lambda w: w.t().contiguous().t()), r"weight: expected a contiguous",
                 id="rows: non-contiguous weight"),
    pytest.param(None, _edit("weight", torch.Tensor.double), r"weight: expected a contiguous CPU float32",
                 id="rows: float64 weight"),
    pytest.param(None, _edit("weight", lambda w: w[None]), r"weight: expected .* with 2 dimensions",
                 id="rows: weight [1, N, K]"),
    pytest.param(True, _edit("scale", torch.Tensor.double), r"scale: expected", id="float64 scale"),
    pytest.param(True, _edit("scale", lambda s: s[:, None]), r"scale: expected", id="scale [N, 1]"),
    pytest.param(True, _edit("scale", _non_contiguous), r"scale: expected", id="non-contiguous scale"),
]


@pytest.mark.parametrize("int8,change,message", PRODUCT_CASES)
def test_products_refuse(int8, change, message):
    op, args = _products(int8)
    op(**args)  # valid as built
    change(args)
    with pytest.raises(RuntimeError, match=message):
        op(**args)


def head_args():
    """xattn.head.GreedyHead's arguments for a vocabulary of 40 and width 32, two rows."""
    from xattn.fast.formats import PackedLinear
    from xattn.fast.greedy_head import GreedyHead

    head = GreedyHead(PackedLinear(_randn(40, 32), _randn(40)))
    return dict(x=_randn(2, 32), weight=head.weight, bias=head.bias, screen=head.screen, scale=head.scales,
                bounds=head.bounds, forbidden=torch.tensor([2]))


HEAD_CASES = [
    _case(_edit("bounds", lambda b: b[:2].contiguous()), r"bounds: expected", "bounds [2, N]"),
    _case(_edit("screen", lambda s: s.view(5, 1, 16, 16)), r"screen \(the head's int8 copy",
          "screen with another inner layout"),
    _case(_set(weight=lambda: _randn(40, 16)), r"weight \(the head's fp32 weight", "weight with another K"),
    _case(_set(weight=_panels(40, 32)), r"weight \(the head's fp32 weight", "the weight's panels"),
    _case(_edit("weight", lambda w: w.t().contiguous().t()), r"weight \(the head's fp32 weight",
          "non-contiguous weight"),
    _case(_set(bias=lambda: _randn(39)), r"bias: expected", "bias too short"),
    _case(_set(bias=lambda: _randn(40).double()), r"bias: expected", "float64 bias"),
    _case(_edit("scale", _non_contiguous), r"scale: expected", "non-contiguous scale"),
    _case(_set(forbidden=lambda: torch.tensor([2], dtype=torch.int32)), r"forbidden: expected", "int32 forbidden"),
    _case(_set(forbidden=lambda: torch.tensor([[2]])), r"forbidden: expected token ids \[F\]", "forbidden [1, F]"),
    _case(_edit("x", _non_contiguous), r"x: expected a contiguous", "non-contiguous x"),
]


@pytest.mark.parametrize("change,message", HEAD_CASES)
def test_greedy_tokens_refuses(change, message):
    args = head_args()
    assert kernels.greedy_tokens(**args).shape == (2,)  # valid as built
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.greedy_tokens(**args)


M, F_VIT = B * S, 48  # encoder rows (images x positions), MLP width


def encoder_args(int8=False):
    """xattn.vit.ViTEncoder's arguments: fp32 weights [N, K] with biases, or fbgemm's packed ones; a workspace."""
    shapes = [(3 * D, D), (D, D), (F_VIT, D), (D, F_VIT)] * L
    weights, biases = [_randn(n, k) for n, k in shapes], [_randn(n) for n, _ in shapes]
    packed = [prepack_int8(w, b)[1] for w, b in zip(weights, biases)] if int8 else []
    return dict(hidden=_randn(B, S, D), norm_weight=1 + 0.1 * _randn(L, 2, D), norm_bias=0.1 * _randn(L, 2, D),
                weights=[] if int8 else weights, biases=[] if int8 else biases, packed=packed, heads=H, eps=1e-12,
                workspace=[torch.empty(M, n) for n in (D, 3 * D, D, D, F_VIT)])


ENCODER_CASES = [  # (int8, change, message)
    pytest.param(False, _set(heads=lambda: 5), r"heads: expected a divisor", id="heads not dividing D"),
    pytest.param(False, _edit("norm_bias", lambda t: t.view(L, 2 * D)), r"norm_bias \[L, 2, D\]: expected",
                 id="norm_bias 2-d"),
    pytest.param(False, _replace("weights", 3, lambda: _randn(D, F_VIT + 1)), r"weights\[3\] \(layer 0 fc2",
                 id="fc2 K not fc1 N"),
    pytest.param(False, _replace("weights", 0, lambda: _randn(3 * D, D).double()), r"weights\[0\] \(layer 0 qkv",
                 id="float64 weight"),
    pytest.param(False, _replace("biases", 1, lambda: _randn(1, D)), r"biases\[1\] \(layer 0 out\)", id="bias [1, N]"),
    pytest.param(False, _edit("biases", lambda b: b[:-1]), r"weights/biases: expected 4", id="one bias missing"),
    pytest.param(False, _replace("workspace", 1, lambda: torch.empty(M - 1, 3 * D)), r"workspace\[1\] \(qkv",
                 id="workspace qkv one row short"),
    pytest.param(False, _edit("workspace", lambda w: w[:4]), r"workspace: expected 5", id="workspace of four"),
    pytest.param(False, _edit("hidden", _non_contiguous), r"hidden \[B, S, D\]: expected", id="non-contiguous hidden"),
    pytest.param(True, _edit("packed", lambda p: p[:-1]), r"packed: expected 4", id="one packed weight missing"),
    pytest.param(True, _set(weights=lambda: [_randn(3 * D, D)]), r"weights/biases: expected none",
                 id="packed and fp32 weights"),
    pytest.param(True, _replace("packed", 1, lambda: prepack_int8(_randn(D // 2, D), _randn(D // 2))[1]),
                 r"packed\[1\] \(layer 0 out\)", id="packed weight too narrow"),
    pytest.param(True, _replace("packed", 0, lambda: prepack_int8(_randn(D, D), None)[1]), r"packed\[0\]'s product",
                 id="packed weight without bias too narrow"),
]


def bf16_encoder_args():
    """bfloat16 weights: a workspace of three bfloat16 tensors, the products' inputs and outputs [M, D] and their
    wide results [M, max(3D, F)]."""
    args = encoder_args()
    args["weights"] = [w.bfloat16() for w in args["weights"]]
    args["workspace"] = [torch.empty(M, n, dtype=torch.bfloat16) for n in (D, D, max(3 * D, F_VIT))]
    return args


BF16_ENCODER_CASES = [  # (change, message)
    pytest.param(_replace("weights", 1, lambda: _randn(D, D)), r"weights\[1\] \(layer 0 out \[N, K\]\): expected a "
                 r"contiguous CPU bfloat16", id="one fp32 weight among bfloat16"),
    pytest.param(_replace("weights", 2, lambda: _randn(F_VIT).bfloat16()),
                 r"weights\[2\] \(layer 0 fc1 \[F, D\], or its tiles", id="fc1 weight 1-d"),
    pytest.param(_edit("workspace", lambda w: w[:2]), r"workspace: expected 3 tensors", id="two bfloat16 workspaces"),
    pytest.param(_replace("workspace", 2, lambda: torch.empty(M, 3 * D - 1, dtype=torch.bfloat16)),
                 r"workspace\[2\] \(bfloat16 wide results", id="wide results one column short"),
    pytest.param(_replace("workspace", 1, lambda: torch.empty(M - 1, D, dtype=torch.bfloat16)),
                 r"workspace\[1\] \(bfloat16 outputs", id="outputs one row short"),
    pytest.param(_replace("workspace", 0, lambda: torch.empty(M, D)), r"workspace\[0\] \(bfloat16 inputs",
                 id="fp32 inputs"),
]


F_TILES = 64  # an MLP width the tiles take (a multiple of 32)


def bf16_tile_encoder_args():
    """bfloat16 weights as AMX tiles (kernels.bf16_tiles) with the bfloat16 workspace."""
    args = bf16_encoder_args()
    shapes = [(3 * D, D), (D, D), (F_TILES, D), (D, F_TILES)] * L
    args["weights"] = [kernels.bf16_tiles(_randn(n, k).bfloat16()) for n, k in shapes]
    args["biases"] = [_randn(n) for n, _ in shapes]
    return args


TILE_ENCODER_CASES = [  # (change, message)
    pytest.param(_replace("weights", 1, lambda: _randn(D, D).bfloat16()), r"weights\[1\] \(layer 0 out tiles "
                 r"\[N / 16, K / 32, 16, 32\]\)", id="one plain weight among tiles"),
    pytest.param(_replace("weights", 3, lambda: kernels.bf16_tiles(_randn(D, F_TILES + 32).bfloat16())),
                 r"weights\[3\] \(layer 0 fc2 tiles", id="fc2 tiles for a wider K"),
    pytest.param(_replace("weights", 2, lambda: kernels.bf16_tiles(_randn(F_TILES, D)).float()),
                 r"weights\[2\] \(layer 0 fc1 tiles", id="fp32 tiles"),
]


@pytest.mark.parametrize("change,message", TILE_ENCODER_CASES)
def test_bf16_tile_encoder_layers_refuses(change, message):
    args = bf16_tile_encoder_args()
    if not kernels.amx_bf16():
        with pytest.raises(RuntimeError, match="tiles need a CPU"):
            kernels.encoder_layers(**args)
        return
    kernels.encoder_layers(**args)  # valid as built
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.encoder_layers(**args)


@pytest.mark.parametrize("change,message", BF16_ENCODER_CASES)
def test_bf16_encoder_layers_refuses(change, message):
    args = bf16_encoder_args()
    kernels.encoder_layers(**args)  # valid as built
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.encoder_layers(**args)


@pytest.mark.parametrize("int8,change,message", ENCODER_CASES)
def test_encoder_layers_refuses(int8, change, message):
    args = encoder_args(int8)
    kernels.encoder_layers(**args)  # valid as built
    change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.encoder_layers(**args)


ATTENTION_CASES = [  # (qkv, images, heads, message): qkv [B * S, 3D] bfloat16 rows is valid with images=2, heads=2
    pytest.param(lambda q: q.float(), 2, 2, r"qkv \[B \* S, 3D\]: expected", id="float32 qkv"),
    pytest.param(lambda q: q.view(2, 10, -1), 2, 2, r"qkv \[B \* S, 3D\]: expected", id="3-d qkv"),
    pytest.param(_non_contiguous, 2, 2, r"qkv \[B \* S, 3D\]", id="non-contiguous qkv"),
    pytest.param(lambda q: q, 3, 2, r"images: expected a divisor of qkv's 20 rows", id="images not dividing rows"),
    pytest.param(lambda q: q, 0, 2, r"images: expected a divisor", id="no images"),
    pytest.param(lambda q: q[:0], 1, 2, r"images: expected a divisor of qkv's 0 rows", id="no rows"),
    pytest.param(lambda q: q, 2, 5, r"heads: expected qkv's width 192", id="heads not dividing width"),
    pytest.param(lambda q: q, 2, 0, r"heads: expected", id="no heads"),
]


@pytest.mark.parametrize("edit,images,heads,message", ATTENTION_CASES)
def test_bf16_attention_refuses(edit, images, heads, message):
    qkv = _randn(20, 3 * 2 * 32).bfloat16()
    assert kernels.bf16_attention(qkv, 2, 2).shape == (20, 64)  # valid as built
    with pytest.raises(RuntimeError, match=message):
        kernels.bf16_attention(edit(qkv), images, heads)


TILE_LINEAR_CASES = [  # (argument, bad value, message): x [5, 64] bfloat16, tiles of a [32, 64] weight, bias [32]
    pytest.param("x", lambda: _randn(5, 64), r"x \[M, K\]: expected", id="float32 x"),
    pytest.param("x", lambda: _randn(5, 96).bfloat16(), r"tiles \[N / 16, K / 32, 16, 32\] \(K = x's 96",
                 id="x wider than the tiles"),
    pytest.param("x", lambda: _randn(5, 40).bfloat16(), r"K = x's 40, a multiple of 32", id="K not a multiple of 32"),
    pytest.param("tiles", lambda: _randn(32, 64).bfloat16(), r"tiles \[N / 16, K / 32, 16, 32\]: expected",
                 id="an unpacked weight"),
    pytest.param("bias", lambda: _randn(31), r"bias \[N\]", id="bias one short"),
    pytest.param("bias", lambda: _randn(32).double(), r"bias \[N\]", id="float64 bias"),
]


@pytest.mark.parametrize("name,bad,message", TILE_LINEAR_CASES)
def test_tile_linear_refuses(name, bad, message):
    args = dict(x=_randn(5, 64).bfloat16(), tiles=kernels.bf16_tiles(_randn(32, 64).bfloat16()), bias=_randn(32))
    if not kernels.amx_bf16():
        with pytest.raises(RuntimeError, match="needs a CPU"):
            kernels.tile_linear(**args)
        return
    assert kernels.tile_linear(**args).shape == (5, 32)  # valid as built
    args[name] = bad()
    with pytest.raises(RuntimeError, match=message):
        kernels.tile_linear(**args)
