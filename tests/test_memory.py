"""`xattn bench --memory`: each weight format's resident memory in a fresh process, counted in copies of the
decoder's projections; packed and int8 hold at most one (issue 20)."""

import pytest

from conftest import tiny_captioner
from xattn.bench import memory


def test_one_copy_is_the_projections_of_every_block_and_the_head_in_the_formats_bytes():
    model = tiny_captioner(seed=50)
    config = model.decoder.config
    d, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
    inner = config.n_inner or 4 * d
    per_block = d * 3 * d + d * d + d * d + d * d + d * inner + inner * d  # qkv, out, cross q, cross out, MLP
    values = layers * per_block + vocab * d
    channels = layers * (3 * d + d + d + d + inner + d) + vocab
    decoder = __import__("xattn").from_hf(model).decoder
    assert memory.one_copy_mb(decoder, "packed") == pytest.approx(4 * values / 2**20)
    assert memory.one_copy_mb(decoder, "bf16") == pytest.approx(2 * values / 2**20)
    assert memory.one_copy_mb(decoder, "int8") == pytest.approx((values + 4 * channels) / 2**20)


def test_packed_and_int8_hold_at_most_one_extra_copy_of_the_benchmark_decoder():
    results = {f.weights: f for f in memory.run(["packed", "int8"], threads=1, progress=lambda line: None)}
    packed, int8 = results["packed"], results["int8"]
    assert packed.error is None and int8.error is None
    # packed: panels for the blocks, the head read in place, plus the greedy head's int8 screen (a quarter of it)
    assert packed.extra_mb <= packed.one_copy_mb
    # int8: its copy and a few MB of the steps' own bookkeeping (a copy is 132 MB); fbgemm's copy is not made at one
    # row. The libraries loaded once per process (kernels, fbgemm's and oneDNN's probes) are counted apart
    assert 0 < int8.libraries_mb < 0.2 * int8.one_copy_mb
    assert int8.extra_mb <= 1.1 * int8.one_copy_mb
    assert int8.peak_extra_mb["B=1 greedy"] < int8.extra_mb + 0.5 * int8.one_copy_mb
    if "int8 avx2" in results:  # AVX-512 VNNI here: no fbgemm copy at 32 rows either, where AVX2 alone makes one
        avx2 = results["int8 avx2"]
        assert avx2.error is None
        assert avx2.peak_extra_mb["B=8 beam 4"] - int8.peak_extra_mb["B=8 beam 4"] > 0.7 * int8.one_copy_mb
    assert "+format" in memory.table(list(results.values()))


def test_live_activation_memory_counts_saved_tensors_and_leaves_weights_and_gradients_out():
    import torch

    from xattn.bench.training import live_activation_mb

    weight = torch.nn.Parameter(torch.randn(2048, 2048))  # 16 MB of weights, 16 MB of gradient: not activations
    x = torch.randn(1024, 2048)

    def forward_backward():
        hidden = torch.relu(x @ weight)  # 8 MB: the product, then the ReLU output autograd keeps
        (hidden * hidden).sum().backward()  # the square keeps its input too

    measured = live_activation_mb(forward_backward)
    assert weight.grad is not None
    # x, the product, the ReLU output, the square and their gradients are [1024, 2048] (8 MB) each: six at the
    # backward's peak; with the 32 MB of weight and gradient counted it would be 80
    assert 16 <= measured <= 56
