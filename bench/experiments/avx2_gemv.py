"""Experiment (not part of xattn): an AVX2 fp32 matrix-vector kernel vs oneDNN's prepacked linear vs a plain
sum over the same number of bytes, on the decode step's 73 weights (GPT-2 small + cross-attention + LM head).
Compiled with torch's cpp_extension (g++, Python headers). 2026-12-02, 2-core AMD EPYC, 2 threads, one run:
8 rows per block with a software prefetch (gemv8) 20.4-21.3 ms, 4-row blocks 21.5-24.4, oneDNN 25.7-31.2,
sum over 552 MB 18.8-20.1. See the performance issue's note.

    python bench/experiments/avx2_gemv.py
"""
import time

import torch
from torch.utils.cpp_extension import load_inline

src = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo); __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s); s = _mm_add_ss(s, sh); return _mm_cvtss_f32(s);
}

// y[m, n] = sum_k x[m, k] w[n, k] + b[n]; w row-major [N, K], K % 8 == 0, rows of x processed 4 at a time
torch::Tensor gemv8(torch::Tensor x, torch::Tensor w) {
  const int64_t K = x.size(1), N = w.size(0);
  auto y = torch::empty({1, N}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>(); float* Y = y.data_ptr<float>();
  at::parallel_for(0, N / 8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const float* w0 = W + nb * 8 * K;
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        __m256 xv = _mm256_loadu_ps(X + k);
        _mm_prefetch((const char*)(w0 + 8 * K + k), _MM_HINT_T0);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + j * K + k), a[j]);
      }
      for (int j = 0; j < 8; ++j) Y[nb * 8 + j] = hsum(a[j]);
    }
  });
  return y;
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>();
  const float* B = b.defined() && b.numel() ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n = nb * 4;
      const float* w0 = W + n * K; const float* w1 = w0 + K; const float* w2 = w1 + K; const float* w3 = w2 + K;
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const int64_t mm = std::min<int64_t>(2, M - m0);
        __m256 a[2][4];
        for (int i = 0; i < 2; ++i) for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
          __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
          for (int i = 0; i < mm; ++i) {
            __m256 xv = _mm256_loadu_ps(X + (m0 + i) * K + k);
            a[i][0] = _mm256_fmadd_ps(xv, v0, a[i][0]); a[i][1] = _mm256_fmadd_ps(xv, v1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(xv, v2, a[i][2]); a[i][3] = _mm256_fmadd_ps(xv, v3, a[i][3]);
          }
        }
        for (int i = 0; i < mm; ++i) for (int j = 0; j < 4; ++j)
          Y[(m0 + i) * N + n + j] = hsum(a[i][j]) + (B ? B[n + j] : 0.f);
      }
    }
  });
  // leftover rows (N % 4)
  for (int64_t n = (N / 4) * 4; n < N; ++n) for (int64_t m = 0; m < M; ++m) {
    float s = 0; for (int64_t k = 0; k < K; ++k) s += X[m * K + k] * W[n * K + k];
    Y[m * N + n] = s + (B ? B[n] : 0.f);
  }
  return y;
}
'''


def best(fn, repeats=10):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 4] * 1000


def main():
    mod = load_inline("xgemv", cpp_sources=[src], functions=["linear_f32", "gemv8"],
                      extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"])
    torch.set_num_threads(2)
    d = 768
    shapes = [(3 * d, d), (d, d), (d, d), (d, d), (4 * d, d), (d, 4 * d)] * 12 + [(50257, d)]
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    biases = [torch.zeros(o) for o, _ in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    big = torch.randn(138_000_000)  # as many bytes as the 73 weights
    xs = {d: torch.randn(1, d), 4 * d: torch.randn(1, 4 * d)}
    print("gemv8 max error", (mod.gemv8(xs[d], weights[0]) - xs[d] @ weights[0].t()).abs().max().item())
    for _ in range(3):
        four = best(lambda: [mod.linear_f32(xs[w.shape[1]], w, b) for w, b in zip(weights, biases)])
        eight = best(lambda: [mod.gemv8(xs[w.shape[1]], w) for w in weights])
        onednn = best(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, b, "none", [], "")
                               for w, p, b in zip(weights, packed, biases)])
        total = best(lambda: big.sum())
        print(f"4-row blocks {four:.1f} ms, gemv8 {eight:.1f}, oneDNN {onednn:.1f}, sum {total:.1f}")


if __name__ == "__main__":
    main()
