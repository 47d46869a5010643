"""xattn's own CPU kernels (products.h, rowwise.h, checks.h, bf16.h, amx_bf16.h, amx_attention.h, matvec.cpp,
layers.cpp, screen.cpp, encoder.cpp, cache_rows.cpp, beam_candidates.cpp, cross_heads.cpp, argmax_rows.cpp),
compiled on first use with the system's g++ against torch's headers.

`matvec(x, panels(weight), N, bias=None)`: x [..., K] fp32 times weight [N, K] fp32 -> [..., N].
`matvec_rows(x, weight, bias=None)`: the same product reading an fp32 weight [N, K] as it is (no copy).
`matvec_int8(x, int8_blocks(weight), N, scale, bias=None)`: int8 weight with one scale per row, x quantized to int8
per row inside.
`decoder_layers(...)`: one decode step through every GPT-2 block (see layers.cpp). `greedy_tokens(...)`: the
argmax of an fp32 LM head read mostly as int8, with proven bounds (see screen.cpp). `encoder_layers(...)`: a
batch through every ViT layer (see encoder.cpp), with `bf16_attention(...)` and `tile_linear(...)`, its attention
and AMX tile product, callable alone. `reorder_rows(...)`: a beam step's reorder of the cache's self K/V
in one call (see cache_rows.cpp). `beam_candidates(...)`: a beam step's best candidates, torch.topk's exactly or
None (see beam_candidates.cpp). `cross_heads(...)`: a bfloat16 cross K/V projection's output into the cache's
heads (see cross_heads.cpp). `argmax_rows(scores)`: torch.argmax(scores, dim=-1) over fp32 rows, the same indices
(see argmax_rows.cpp). Every op checks each tensor it is given (checks.h) and refuses a wrong one with a
RuntimeError naming it.

The build lands in ~/.cache/xattn/ (or $XATTN_CACHE) keyed by the sources and the torch version, so later processes
load it at once. One process builds while others wait on a lock file; g++'s output goes to a .log beside the build,
and a build past XATTN_BUILD_TIMEOUT seconds (600) is stopped. `available()` is False where the kernels cannot be
built or run (no g++, no AVX2/FMA, not x86-64, XATTN_NO_KERNELS=1), with a warning quoting g++'s error where a build
failed; callers then use torch's kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name)
            for name in ("matvec.cpp", "layers.cpp", "screen.cpp", "encoder.cpp", "cache_rows.cpp",
                         "beam_candidates.cpp", "cross_heads.cpp", "argmax_rows.cpp")]
_HEADERS = [os.path.join(_HERE, name)
            for name in ("products.h", "rowwise.h", "checks.h", "bf16.h", "amx_bf16.h", "amx_attention.h")]
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


def matvec_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 times a contiguous fp32 weight [N, K] read in place -> [..., N]: each output a dot product
    summed in one fixed order, whatever the rows beside it."""
    return torch.ops.xattn_kernels.matvec_rows(x, weight, bias)


def amx_bf16() -> bool:
    """Whether this CPU (and its OS) gives the ViT kernel's bfloat16 tile products: AMX-BF16 and AVX512-BF16."""
    return available() and torch.ops.xattn_kernels.amx_bf16()


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 weight [N, K] -> AMX's B tiles [ceil(N / 16), ceil(K / 32), 16, 32]: per 16 columns and 32 values of
    K, 16 rows each holding the 16 columns' pairs of consecutive K values (zeros past N and K); see amx_bf16.h."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, -(-k // 32) * 32, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 32, 16, 2)  # [n block, n, k step, pair, 2]
    return blocks.permute(0, 2, 3, 1, 4).reshape(padded.shape[0] // 16, padded.shape[1] // 32, 16, 32).contiguous()


def int8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] -> the kernels' layout [ceil(N / 8), ceil(K / 32), 8, 32]: 8 rows interleaved 32 columns
    at a time (zeros past N and K), so that a block of rows is one stream."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 8) * 8, -(-k // 32) * 32, dtype=torch.int8)
    padded[:n, :k] = weight
    return padded.view(padded.shape[0] // 8, 8, -1, 32).transpose(1, 2).contiguous()


def unblock_int8(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int8_blocks(weight) -> weight [n, k] again."""
    return blocks.transpose(1, 2).reshape(blocks.shape[0] * 8, -1)[:n, :k].contiguous()


def matvec_int8(x: torch.Tensor, blocks: torch.Tensor, n: int, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32, quantized per row to int8 inside, times the int8 weight [n, K] held as int8_blocks(weight),
    with one scale per row."""
    return torch.ops.xattn_kernels.matvec_int8(x, blocks, n, scale, bias)


def int8_kernel(use: str | None = None) -> str:
    """The int8 products' kernel, "amx" (AMX-INT8 from 8 rows, VNNI below), "vnni" (AVX-512 VNNI) or "avx2", the
    best the CPU has unless switched to `use` first: the same int32 sums, so the same results (XATTN_INT8_KERNEL=avx2
    picks AVX2 at start)."""
    if not available():
        raise RuntimeError("xattn's kernels are not available here (see kernels.available)")
    _state["int8_kernel"] = torch.ops.xattn_kernels.int8_kernel(use)
    return _state["int8_kernel"]


@contextlib.contextmanager
def using_int8_kernel(use: str) -> Iterator[None]:
    """int8 products through kernel `use` ("avx2", "vnni" or "amx") inside the block, the one before restored after."""
    before = int8_kernel()
    int8_kernel(use)
    try:
        yield
    finally:
        int8_kernel(before)


def int8_kernel_is_vnni() -> bool:
    """Whether int8_kernel() runs AVX-512 VNNI ("vnni", or "amx", which runs VNNI below 8 rows), read from Python
    (no op call, so that torch.compile traces it)."""
    return available() and _state["int8_kernel"] in ("vnni", "amx")


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


def tile_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16) times an [N, K] weight held as AMX tiles (bf16_tiles; K a multiple of 32) + bias [N]:
    fp32 [M, N], each row's sums the same tile steps whatever M (a CPU with AMX-BF16)."""
    return torch.ops.xattn_kernels.tile_linear(x, tiles, bias)


def bf16_attention(qkv: torch.Tensor, images: int, heads: int) -> torch.Tensor:
    """The ViT kernel's attention: ctx [B * S, D] = softmax(Q K^T / sqrt(hd)) V per image and head, Q, K, V the
    thirds of qkv [B * S, 3D] (bfloat16 rows), fp32 sums and softmax, bfloat16 result; on AMX tiles where the CPU has
    AMX-BF16 and hd is a multiple of 32 (amx_attention.h), else torch's attention."""
    return torch.ops.xattn_kernels.bf16_attention(qkv, images, heads)


def reorder_rows(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, valid: int) -> None:
    """Row i of keys/values [L, B, H, T_max, hd] takes row index[i]'s positions [0, valid), in place (beam search's
    reorder; any mapping, each source read as it was before the call)."""
    torch.ops.xattn_kernels.reorder_rows(keys, values, index, valid)


def cross_heads(kv: torch.Tensor, bias: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """keys, values [n, H, S, hd] (float16 or float32, contiguous) = the heads of kv [n, S, 2D] (bfloat16) + bias
    [2D] (fp32), rounded once to their dtype: keys from kv's first D columns, values from the rest."""
    torch.ops.xattn_kernels.cross_heads(kv, bias, keys, values)


def beam_candidates(log_probs: torch.Tensor, scores: torch.Tensor, keep: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch.topk((log_probs [B * beams, V] + scores [B, beams] per row).view(B, beams * V), keep): values and
    indices [B, keep], exactly torch's; None where equal values or a NaN leave the choice to torch.topk, or where
    keep + 1 > V."""
    if keep + 1 > log_probs.shape[-1]:
        return None
    values, index = torch.ops.xattn_kernels.beam_candidates(log_probs.contiguous(), scores.contiguous(), keep)
    return (values, index) if values.shape[1] == keep else None


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """torch.argmax(scores [R, V], dim=-1) for fp32 rows: each row's first index of its largest value, or of its
    first NaN (see argmax_rows.cpp)."""
    return torch.ops.xattn_kernels.argmax_rows(scores)


def greedy_tokens(x, weight, bias, screen, scale, bounds, forbidden) -> torch.Tensor:
    """argmax over matvec_rows(x [M, K], weight [N, K], bias) with the forbidden ids left out, read through the int8
    copy `screen` (int8_blocks) with proven bounds [3, N] (see screen.cpp): tokens [M], equal to the full product's
    argmax."""
    return torch.ops.xattn_kernels.greedy_tokens(x, weight, bias, screen, scale, bounds, forbidden)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None


def _cpu_has_avx2_fma() -> bool:
    flags = cpu_flags() or set()
    return "avx2" in flags and "fma" in flags and "f16c" in flags  # every AVX2 CPU has F16C


class BuildError(RuntimeError):
    """g++ failed or ran past its time; the message quotes its error and names the log with all of its output."""


def _load() -> bool:
    if os.environ.get("XATTN_NO_KERNELS") == "1" or platform.machine() != "x86_64" or not _cpu_has_avx2_fma():
        return False
    try:
        torch.ops.load_library(_build())
    except (OSError, RuntimeError) as error:  # no g++ (OSError), BuildError, or a library that does not load
        warnings.warn(f"xattn's CPU kernels could not be built or loaded: {error}; using torch's kernels",
                      stacklevel=3)
        return False
    _register_fake()
    _state["int8_kernel"] = torch.ops.xattn_kernels.int8_kernel(None)  # AMX or VNNI where the CPU has it
    asked = os.environ.get("XATTN_INT8_KERNEL")
    if asked:
        try:
            _state["int8_kernel"] = torch.ops.xattn_kernels.int8_kernel(asked)
        except RuntimeError:  # a typo, or a kernel asked of a CPU without it
            why = {"vnni": "this CPU has no AVX-512 VNNI", "amx": "this CPU (or its OS) gives no AMX-INT8"}.get(
                asked, "expected avx2, vnni or amx")
            warnings.warn(f"XATTN_INT8_KERNEL={asked!r}: {why}; using {_state['int8_kernel']}", stacklevel=3)
    return True


def _build() -> str:
    """The kernels' shared library for these sources and this torch, built once per cache folder: a process that
    finds another building waits on the lock file, then loads what that one built."""
    name = _name()
    cache = os.environ.get("XATTN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "xattn"))
    target = os.path.join(cache, f"{name}.so")
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if os.path.exists(target):  # built while this process waited
            return target
        _remove_stale(cache, name)
        with tempfile.TemporaryDirectory(dir=cache, prefix=f"{name}.tmp") as tmp:  # renamed whole: never half a .so
            out = os.path.join(tmp, "kernels.so")
            _compile(out, os.path.join(cache, f"{name}.log"))
            os.replace(out, target)
    return target


def _name() -> str:
    """kernels-<key>: the build's name, keyed by the sources and the torch version."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"kernels-{digest.hexdigest()[:16]}"


def _remove_stale(cache: str, name: str) -> None:
    """Temporary folders a killed build left: this build's own (its lock is held, so none is in use), and those of
    builds from before the lock (`tmp*`) once older than any build may run."""
    for entry in os.scandir(cache):
        if not entry.is_dir(follow_symlinks=False):
            continue
        ours = entry.name.startswith(f"{name}.tmp")
        legacy = (entry.name.startswith("tmp") and time.time() - entry.stat().st_mtime > _timeout()
                  and set(os.listdir(entry.path)) <= {"kernels.so"})  # nothing else's, should the cache be /tmp
        if ours or legacy:
            shutil.rmtree(entry.path, ignore_errors=True)


def _timeout() -> float:
    return float(os.environ.get("XATTN_BUILD_TIMEOUT", 600))


def _compile(out: str, log: str) -> None:
    """g++ over the sources into `out`, its output into `log`; BuildError on failure or past the timeout."""
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch.compiled_with_cxx11_abi())
    command = ["g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(torch_dir, "include"),
               "-I", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"), *_SOURCES,
               "-L", os.path.join(torch_dir, "lib"), "-lc10", "-ltorch_cpu", "-o", out]
    with open(log, "w") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        # its own process group, so that a timeout ends the compiler proper (cc1plus) too, not only the driver
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        code = None
        try:
            code = process.wait(timeout=_timeout())
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:  # past the timeout, or this process was interrupted (a new session's
                os.killpg(process.pid, signal.SIGKILL)  # compiler does not get the terminal's Ctrl-C)
                process.wait()
    if code is None:
        raise BuildError(f"g++ ran past {_timeout():.0f} s (XATTN_BUILD_TIMEOUT); its output: {log}")
    if code:
        with open(log) as f:
            lines = [line.rstrip()[:300] for line in f.readlines()[1:]]
        # the first errors are the cause (later ones often follow from them); without any, the output's end
        quoted = [line for line in lines if "error" in line][:3] or lines[-3:]
        raise BuildError(f"g++ exited with {code}: {' | '.join(quoted)} (all of its output: {log})")


def _register_fake() -> None:
    @torch.library.register_fake("xattn_kernels::matvec")
    def _(x, weight_panels, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("xattn_kernels::matvec_rows")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("xattn_kernels::matvec_int8")
    def _(x, blocks, n, scale, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("xattn_kernels::greedy_tokens")
    def _(x, weight, bias, screen, scale, bounds, forbidden):
        return x.new_empty(x.shape[0], dtype=torch.long)
