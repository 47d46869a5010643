"""xattn's own CPU kernels (products.h, rowwise.h, matvec.cpp, layers.cpp, screen.cpp, encoder.cpp), compiled on
first use with the system's g++ against torch's headers.

`matvec(x, panels(weight), N, bias=None)`: x [..., K] fp32 times weight [N, K] fp32 -> [..., N].
`matvec_int8(x, int8_blocks(weight), N, scale, bias=None)`: int8 weight with one scale per row, x quantized to int8
per row inside.
`decoder_layers(...)`: one decode step through every GPT-2 block (see layers.cpp). `greedy_tokens(...)`: the
argmax of an fp32 LM head read mostly as int8, with proven bounds (see screen.cpp). `encoder_layers(...)`: a
batch through every ViT layer (see encoder.cpp). The build lands in
~/.cache/xattn/ (or $XATTN_CACHE) keyed by the source and the torch version, so later processes load it at
once. `available()` is False where it cannot be built or run (no g++, no AVX2/FMA, not x86-64,
XATTN_NO_KERNELS=1); callers then use torch's kernels.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
import warnings

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ("matvec.cpp", "layers.cpp", "screen.cpp", "encoder.cpp")]
_HEADERS = [os.path.join(_HERE, name) for name in ("products.h", "rowwise.h")]
_state: dict = {}


def available() -> bool:
    if "ok" not in _state:
        _state["ok"] = _load()
    return _state["ok"]


PANEL = 16  # output columns per fp32 panel


def panels(weight: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] -> the kernels' layout [ceil(N / 16), K, 16]: panel p holds columns 16p .. 16p + 15 (zeros
    past N), so that the product reads the weight as one stream of 64-byte rows."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def matvec(x: torch.Tensor, weight_panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 times the weight [n, K] held as panels(weight) -> [..., n]."""
    return torch.ops.xattn_kernels.matvec(x, weight_panels, n, bias)


def int8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] -> the kernels' layout [ceil(N / 8), ceil(K / 32), 8, 32]: 8 rows interleaved 32 columns
    at a time (zeros past N and K), so that a block of rows is one stream."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 8) * 8, -(-k // 32) * 32, dtype=torch.int8)
    padded[:n, :k] = weight
    return padded.view(padded.shape[0] // 8, 8, -1, 32).transpose(1, 2).contiguous()


def matvec_int8(x: torch.Tensor, blocks: torch.Tensor, n: int, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32, quantized per row to int8 inside, times the int8 weight [n, K] held as int8_blocks(weight),
    with one scale per row."""
    return torch.ops.xattn_kernels.matvec_int8(x, blocks, n, scale, bias)


def decoder_layers(hidden, norm_weight, norm_bias, weights, scales, biases, packed, keys, values, cross_keys,
                   cross_values, cross_mask, enc_index, position, scalings, eps) -> torch.Tensor:
    """hidden [B, D] through every GPT-2 block at `position`, writing its K/V into keys/values in place."""
    return torch.ops.xattn_kernels.decoder_layers(
        hidden, norm_weight, norm_bias, weights, scales, biases, packed, keys, values, cross_keys, cross_values,
        cross_mask, enc_index, position, scalings, eps)


def encoder_layers(hidden, norm_weight, norm_bias, weights, biases, packed, heads, eps, workspace) -> None:
    """hidden [B, S, D] through every pre-norm ViT layer in place, the intermediate results in `workspace` (see
    encoder.cpp)."""
    torch.ops.xattn_kernels.encoder_layers(hidden, norm_weight, norm_bias, weights, biases, packed, heads, eps,
                                           workspace)


def greedy_tokens(x, weight_panels, bias, screen, scale, bounds, forbidden) -> torch.Tensor:
    """argmax over matvec(x [M, K], weight_panels, N, bias) with the forbidden ids left out, read through the int8
    copy `screen` (int8_blocks) with proven bounds [3, N] (see screen.cpp): tokens [M], equal to the full product's
    argmax."""
    return torch.ops.xattn_kernels.greedy_tokens(x, weight_panels, bias, screen, scale, bounds, forbidden)


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


def _load() -> bool:
    if os.environ.get("XATTN_NO_KERNELS") == "1" or platform.machine() != "x86_64" or not _cpu_has_avx2_fma():
        return False
    try:
        torch.ops.load_library(_build())
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        warnings.warn(f"xattn's CPU kernels could not be built ({str(error).splitlines()[0][:200]}); "
                      "using torch's kernels", stacklevel=3)
        return False
    _register_fake()
    return True


def _build() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    key = digest.hexdigest()[:16]
    cache = os.environ.get("XATTN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "xattn"))
    target = os.path.join(cache, f"kernels-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: concurrent builds are safe
        out = os.path.join(tmp, "kernels.so")
        subprocess.run(
            ["g++", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(torch_dir, "include"),
             "-I", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"), *_SOURCES,
             "-L", os.path.join(torch_dir, "lib"), "-lc10", "-ltorch_cpu", "-o", out],
            check=True, capture_output=True, text=True,
        )
        os.replace(out, target)
    return target


def _register_fake() -> None:
    @torch.library.register_fake("xattn_kernels::matvec")
    def _(x, weight_panels, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("xattn_kernels::matvec_int8")
    def _(x, blocks, n, scale, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("xattn_kernels::greedy_tokens")
    def _(x, weight_panels, bias, screen, scale, bounds, forbidden):
        return x.new_empty(x.shape[0], dtype=torch.long)
