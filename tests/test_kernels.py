"""xattn's AVX2 matrix-vector kernel: built on first use, equal to torch's products within rounding for fp32 and
int8 weights at any shape (tails included), and optional: without it the formats fall back to torch's kernels."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from xattn.fast import kernels


def _can_build() -> bool:
    return shutil.which("g++") is not None and kernels._cpu_has_avx2_fma()


pytestmark = pytest.mark.skipif(not _can_build(), reason="needs g++ and an x86-64 CPU with AVX2 + FMA")


def test_the_kernel_builds_and_loads_here():
    assert kernels.available()


@pytest.fixture(autouse=True, scope="module")
def _built():
    """The ops exist once the library is loaded: a test run alone (-k) loads it first."""
    kernels.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 13, 32])
@pytest.mark.parametrize("k,n", [(32, 37), (768, 2304), (3072, 768), (20, 13), (8, 1), (40, 9)])
def test_fp32_and_int8_products_equal_torch_within_rounding(rows, k, n):
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    fp32 = kernels.matvec(x, kernels.panels(weight), n, bias)
    assert fp32.shape == (rows, n) and torch.allclose(fp32.double(), expected, atol=1e-3, rtol=1e-4)
    # each product is one FMA chain in k order, whatever the rows beside it: row by row gives the same bits
    assert torch.equal(torch.cat([kernels.matvec(x[i:i + 1], kernels.panels(weight), n, bias) for i in range(rows)]),
                       fp32)
    # the weight read in place: each product one dot product in a fixed order, whatever the rows beside it
    in_place = kernels.matvec_rows(x, weight, bias)
    assert in_place.shape == (rows, n) and torch.allclose(in_place.double(), expected, atol=1e-3, rtol=1e-4)
    assert torch.equal(torch.cat([kernels.matvec_rows(x[i:i + 1], weight, bias) for i in range(rows)]), in_place)
    # int8: the same product with x rounded to 8 bits per row (as the kernel does) is exact in int32
    scales = weight.abs().amax(dim=1) / 127
    quantized = (weight / scales[:, None]).round().to(torch.int8)
    x_scales = x.abs().amax(dim=1, keepdim=True) / 127
    x_rounded = (x / x_scales).round()
    expected = (x_rounded.double() @ quantized.double().t()) * x_scales.double() * scales.double() + bias.double()
    int8 = kernels.matvec_int8(x, kernels.int8_blocks(quantized), n, scales, bias).double()
    assert torch.allclose(int8, expected, atol=1e-4, rtol=1e-5)
    exact = torch.nn.functional.linear(x.double(), quantized.double() * scales.double()[:, None], bias.double())
    error = (int8 - exact).abs().max()
    assert error < 0.02 * exact.abs().max()  # and close to the unquantized activations' result


@pytest.mark.parametrize("rows,k", [(1, 768), (3, 13), (16, 3072), (5, 8), (2, 40), (4, 7)])
def test_int8_products_quantize_each_row_exactly_so(rows, k):
    """Through an identity weight the product gives back x as quantized: q = round(x * (1 / s)) to even with
    s = max|x| / 127 per row, times s; a NaN is left out of the max and quantizes to 0 (vector lanes and the tail)."""
    generator = torch.Generator().manual_seed(rows * 31 + k)
    x = torch.randn(rows, k, generator=generator) * 3
    x[0, -1] = float("nan")  # in the tail where k % 8 != 0, else in the last vector
    if k > 8:
        x[-1, 2] = float("nan")
        x[-1, 5] = 2.5 * x[-1].nan_to_num().abs().max() / 127  # a tie once scaled: rounds to even
    identity = torch.eye(k, dtype=torch.int8)
    got = kernels.matvec_int8(x, kernels.int8_blocks(identity), k, torch.ones(k))
    scale = x.nan_to_num().abs().amax(dim=1, keepdim=True) / 127
    want = torch.round(x * (1 / scale)).nan_to_num(0.0) * scale
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17, 64, 70])
@pytest.mark.parametrize("k,n", [(32, 37), (768, 2304), (3072, 16), (20, 13), (8, 1), (100, 9), (64, 33)])
def test_the_int8_kernels_give_the_same_bits(rows, k, n, int8_kernel):
    """AVX-512 VNNI's product adds x + 128 times w and takes 128 x the row's sum off again; AVX2's moves x's sign onto
    w; AMX multiplies signed bytes in tiles of 16 rows (a part-filled last one): the same int32 sums, so the same
    results, at every row count and tail of N and K; and each row's result does not depend on the rows beside it."""
    generator = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 5
    x[0, : k // 2] = 0  # a zero half, and below the extremes of the int8 range
    quantized = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    quantized[0] = 127  # the row sums' extremes
    quantized[-1] = -127
    blocks, scales, bias = kernels.int8_blocks(quantized), torch.rand(n, generator=generator), torch.randn(n)
    got = kernels.matvec_int8(x, blocks, n, scales, bias)
    by_row = torch.cat([kernels.matvec_int8(x[i:i + 1], blocks, n, scales, bias) for i in range(rows)])
    with kernels.using_int8_kernel("avx2"):
        avx2 = kernels.matvec_int8(x, blocks, n, scales, bias)
    assert torch.equal(got, avx2)
    assert torch.equal(by_row, got)
    x_scales = x.abs().amax(dim=1, keepdim=True) / 127
    expected = ((x / x_scales).round().double() @ quantized.double().t()) * x_scales.double() * scales.double() + bias
    assert torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-5)  # and each is the product asked for


def test_the_int8_kernel_is_chosen_by_name_and_refuses_others():
    chosen = kernels.int8_kernel()
    assert chosen in ("avx2", "vnni", "amx")
    assert kernels.int8_kernel(chosen) == chosen
    with pytest.raises(RuntimeError, match="expected 'avx2', 'vnni' or 'amx'"):
        kernels.int8_kernel("avx512")
    assert kernels.int8_kernel() == chosen
    # XATTN_INT8_KERNEL=avx2 picks AVX2 when the library loads, in a fresh process
    code = "from xattn.fast import kernels; kernels.available(); print(kernels.int8_kernel())"
    env = dict(os.environ, XATTN_INT8_KERNEL="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "avx2", out.stderr[-2000:]
    assert "XATTN_INT8_KERNEL" not in out.stderr
    # a value it cannot take is said in one warning, and the default kept
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XATTN_INT8_KERNEL="avx-512"),
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == chosen, out.stderr[-2000:]
    assert "XATTN_INT8_KERNEL='avx-512': expected avx2, vnni or amx; using " + chosen in out.stderr


def test_leading_dimensions_are_kept_and_bad_input_is_refused():
    x = torch.randn(2, 3, 16)
    weight = torch.randn(5, 16)
    out = kernels.matvec(x, kernels.panels(weight), 5)
    assert out.shape == (2, 3, 5) and torch.allclose(out, x @ weight.t(), atol=1e-5)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.matvec(torch.randn(1, 15), kernels.panels(weight), 5)
    with pytest.raises(RuntimeError, match="panels"):
        kernels.matvec(torch.randn(1, 16), weight, 5)  # an [N, K] weight, not its panels
    with pytest.raises(RuntimeError, match="panels"):
        kernels.matvec(torch.randn(1, 16), kernels.panels(weight), 17)  # more columns than the panels hold
    with pytest.raises(RuntimeError, match="int8"):
        kernels.matvec_int8(torch.randn(1, 16), weight, 5, torch.ones(5))
    blocks = kernels.int8_blocks(torch.ones(5, 16, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.matvec_int8(torch.randn(1, 40), blocks, 5, torch.ones(5))  # K past the blocks' 32 columns
    with pytest.raises(RuntimeError, match="scale"):
        kernels.matvec_int8(torch.randn(1, 16), blocks, 5, torch.ones(4))


def _argmax_rows_cases():
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(16, 50257, generator=generator)
    yield "gpt-2 logits", logits
    ties = torch.randint(0, 3, (9, 4099), generator=generator).float()  # many equal largest values
    yield "ties", ties
    rows = torch.randn(6, 100, generator=generator)
    rows[0, 7] = rows[0, 70] = float("nan")  # the first NaN wins, as in torch
    rows[1, 99] = float("nan")  # in the tail
    rows[2] = float("-inf")
    rows[3, 40] = float("inf")
    rows[4] = 0.0
    rows[4, 3] = -0.0  # equal to 0.0: the first index
    rows[5, 65:] = rows[5].max() + 1  # the largest value repeated in every lane
    yield "special values", rows
    for width in (1, 7, 31, 32, 33, 65):  # below, at and past one round of the four 8-lane chains
        yield f"width {width}", torch.randn(3, width, generator=generator)
    yield "no rows", torch.randn(0, 40)


@pytest.mark.parametrize("name,scores", list(_argmax_rows_cases()), ids=[n for n, _ in _argmax_rows_cases()])
def test_argmax_rows_is_torchs_argmax(name, scores):
    assert torch.equal(kernels.argmax_rows(scores), torch.argmax(scores, dim=-1))


def test_argmax_rows_refuses_what_it_does_not_take():
    for scores, message in ((torch.randn(4, 8).double(), "scores"), (torch.randn(8), "scores"),
                            (torch.randn(8, 4).t(), "scores"), (torch.randn(3, 0), "0 < V")):
        with pytest.raises(RuntimeError, match=message):
            kernels.argmax_rows(scores)


def test_without_the_kernel_the_formats_fall_back_and_give_the_same_tokens(tmp_path):
    script = f"""
import torch, sys, xattn
sys.path.insert(0, {os.path.dirname(__file__)!r})
from conftest import tiny_captioner
from xattn.fast import kernels
model = tiny_captioner(seed=51)
pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
out = xattn.from_hf(model, weights="packed").generate(pixel_values=pixels, max_new_tokens=8, min_new_tokens=8)
assert torch.equal(out, model.generate(pixel_values=pixels, max_new_tokens=8, min_new_tokens=8))
print(kernels.available())
"""
    env = dict(os.environ, XATTN_NO_KERNELS="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_fresh_cache_directory_gets_a_new_build(tmp_path):
    code = "from xattn.fast import kernels; print(kernels.available(), kernels._build())"
    env = dict(os.environ, XATTN_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    ok, path = done.stdout.split()
    assert ok == "True" and path.startswith(str(tmp_path)) and os.path.exists(path)


# The build's own tests compile a one-line source (seconds, not the kernels' minute or more), through a g++ on PATH
# that records each run, so that a test can count the builds.
PROBE = "int xattn_probe() { return 1; }\n"


@pytest.fixture
def probe_build(tmp_path, monkeypatch):
    """kernels._build() over a one-line source into an empty cache, g++ recording its runs in `runs`."""
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    bin_dir, cache = tmp_path / "bin", tmp_path / "cache"
    bin_dir.mkdir()
    gxx = bin_dir / "g++"
    gxx.write_text(f'#!/bin/sh\necho run >> {tmp_path / "runs"}\nsleep "${{GXX_DELAY:-0}}"\n'
                   f'exec {shutil.which("g++")} "$@"\n')
    gxx.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XATTN_CACHE", str(cache))
    monkeypatch.setattr(kernels, "_SOURCES", [str(source)])
    monkeypatch.setattr(kernels, "_HEADERS", [])
    return tmp_path


def _runs(tmp_path) -> int:
    runs = tmp_path / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_two_processes_building_at_once_build_once(probe_build):
    code = ("import sys; from xattn.fast import kernels; kernels._SOURCES, kernels._HEADERS = [sys.argv[1]], []; "
            "print(kernels._build())")
    env = dict(os.environ, GXX_DELAY="4")  # the first holds the lock long enough for the second to wait on it
    processes = [subprocess.Popen([sys.executable, "-c", code, str(probe_build / "probe.cpp")], env=env,
                                  stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = [p.communicate(timeout=300)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    assert paths[0] == paths[1] and os.path.exists(paths[0])
    assert _runs(probe_build) == 1
    name = os.path.basename(paths[0])[:-3]
    assert sorted(os.listdir(probe_build / "cache")) == [f"{name}.lock", f"{name}.log", f"{name}.so"]  # no tmp*


def test_a_failed_build_warns_with_the_compilers_error_and_its_log(probe_build, monkeypatch):
    (probe_build / "probe.cpp").write_text(PROBE + "int broken( { return 2; }\n")
    monkeypatch.delenv("XATTN_NO_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_state", {})
    with pytest.warns(UserWarning, match="could not be built") as warned:
        assert not kernels.available()
    message = str(warned[0].message)
    log = probe_build / "cache" / f"{kernels._name()}.log"
    assert "probe.cpp:2:" in message and "error" in message and str(log) in message
    assert "probe.cpp:2:" in log.read_text()
    assert [entry for entry in os.listdir(probe_build / "cache") if ".tmp" in entry] == []


def test_a_build_past_its_timeout_is_stopped(probe_build, monkeypatch):
    monkeypatch.setenv("GXX_DELAY", "60")
    monkeypatch.setenv("XATTN_BUILD_TIMEOUT", "1")
    with pytest.raises(kernels.BuildError, match="ran past 1 s"):
        kernels._build()
    assert [entry for entry in os.listdir(probe_build / "cache") if ".tmp" in entry] == []


def test_a_killed_builds_leftovers_are_removed_by_the_next_build(probe_build):
    cache = probe_build / "cache"
    ours, legacy, fresh, foreign = (cache / f"{kernels._name()}.tmpkilled", cache / "tmpold", cache / "tmpnew",
                                    cache / "tmpforeign")
    for folder in (ours, legacy, fresh, foreign):
        folder.mkdir(parents=True)
    (legacy / "kernels.so").write_bytes(b"half a library")
    (foreign / "notes.txt").write_text("not a build's")
    for folder in (legacy, foreign):  # older than any build may run: left by a build from before the lock
        os.utime(folder, (0, 0))
    path = kernels._build()
    assert os.path.exists(path) and _runs(probe_build) == 1
    assert not ours.exists() and not legacy.exists()
    assert fresh.exists() and foreign.exists()  # perhaps a build running now; not a build's folder
