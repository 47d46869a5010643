// Matrix-vector products for decode steps (a few rows of activations against a whole weight matrix), AVX2 + FMA.
//
// A decode step at batch 1-8 streams every weight once, so its speed is memory bandwidth. These products walk 8
// weight rows at a time with a software prefetch of the next block, on torch's own thread pool, and reach the
// bandwidth of a plain sum over the same bytes; oneDNN's and fbgemm's general kernels stop short of it there.
// Weights are [N, K] row-major (nn.Linear's layout): fp32, or int8 with one fp32 scale per row. For int8 each
// activation row is quantized to int8 (symmetric, one scale per row) and bytes are multiplied with vpmaddubsw,
// x's sign moved onto w so that |x| can be the unsigned operand.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace xattn {

constexpr int64_t kRows = 8;  // weight rows per block

// How a product's result is stored: y = p + bias, or y += p + bias (a residual connection).
enum class Store { kSet, kAdd };

struct Weight {
  const void* data;    // [N, K] float or int8
  const float* scale;  // [N] for int8 weights, nullptr for fp32
  const float* bias;   // [N] or nullptr
  int64_t N, K;
};

inline void store(float* y, float value, Store how) {
  if (how == Store::kAdd)
    *y += value;
  else
    *y = value;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// y[m, n] (+)= sum_k x[m, k] w[n, k] + bias[n], for m < M, n in [n0, n0 + rows), rows <= R, prefetching one cache
// line of each of the next R weight rows as it goes. R = 8 at up to 4 activation rows (bandwidth-bound: more
// streams in flight; spills are cheap there); R = 4 with M <= 3 above (compute-bound: 12 accumulators, 3 x vectors
// and one w vector fit the 16 AVX2 registers).
template <int M, int R>
void block_fp32(const float* x, int64_t K, const float* w, int64_t n0, int64_t rows, const float* bias, float* y,
                int64_t N, Store how, bool prefetch) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  const float* base = w + n0 * K;
  for (int64_t k = 0; k < k8; k += 8) {
    if (prefetch && k % 16 == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(base + (R + r) * K + k), _MM_HINT_T0);
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const __m256 wv = _mm256_loadu_ps(base + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(xv[m], wv, acc[m][r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc[m][r]);
      for (int64_t k = k8; k < K; ++k) sum += x[m * K + k] * base[r * K + k];
      if (bias) sum += bias[n];
      store(y + m * N + n, sum, how);
    }
  }
}

// int32 dot products of quantized rows xq[m] (|xq| <= 127) with int8 weight rows [n0, n0 + rows), kRows at a time:
// |x| (unsigned) times w with x's sign moved onto it; pairs of products (<= 2 * 127 * 127) fit int16.
template <int M>
void block_int8(const int8_t* xq, int64_t K, const int8_t* w, int64_t n0, int64_t rows, const float* x_scale,
                const float* scale, const float* bias, float* y, int64_t N, Store how) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_si256();
  const int64_t k32 = K - K % 32;
  const int8_t* base = w + n0 * K;
  for (int64_t k = 0; k < k32; k += 32) {
    if (k % 64 == 0)  // one cache line of each row of the next block
      for (int r = 0; r < kRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(base + (kRows + r) * K + k), _MM_HINT_T0);
    __m256i xv[M], xa[M];
    for (int m = 0; m < M; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
      xa[m] = _mm256_abs_epi8(xv[m]);
    }
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + r * K + k));
      for (int m = 0; m < M; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(xa[m], _mm256_sign_epi8(wv, xv[m]));
        acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    for (int m = 0; m < M; ++m) {
      int32_t sum = hsum_epi32(acc[m][r]);
      for (int64_t k = k32; k < K; ++k) sum += int32_t(xq[m * K + k]) * int32_t(base[r * K + k]);
      float out = float(sum) * x_scale[m] * scale[n];
      if (bias) out += bias[n];
      store(y + m * N + n, out, how);
    }
  }
}

inline void product_fp32(const float* x, int64_t M, const Weight& w, float* y, Store how) {
  const int64_t K = w.K, N = w.N;
  const float* weight = static_cast<const float*>(w.data);
  at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows, rows = std::min(kRows, N - n0);
      switch (M) {
        case 1: block_fp32<1, 8>(x, K, weight, n0, rows, w.bias, y, N, how, true); continue;
        case 2: block_fp32<2, 8>(x, K, weight, n0, rows, w.bias, y, N, how, true); continue;
        case 3: block_fp32<3, 8>(x, K, weight, n0, rows, w.bias, y, N, how, true); continue;
        case 4: block_fp32<4, 8>(x, K, weight, n0, rows, w.bias, y, N, how, true); continue;
      }
      for (int64_t half = 0; half < rows; half += 4) {
        const int64_t n = n0 + half, r = std::min<int64_t>(4, rows - half);
        for (int64_t m0 = 0, chunk; m0 < M; m0 += chunk) {
          chunk = std::min<int64_t>(3, M - m0);
          const float* xm = x + m0 * K;
          float* ym = y + m0 * N;
          const bool first = m0 == 0;  // later passes find the block in cache
          switch (chunk) {
            case 1: block_fp32<1, 4>(xm, K, weight, n, r, w.bias, ym, N, how, first); break;
            case 2: block_fp32<2, 4>(xm, K, weight, n, r, w.bias, ym, N, how, first); break;
            default: block_fp32<3, 4>(xm, K, weight, n, r, w.bias, ym, N, how, first); break;
          }
        }
      }
    }
  });
}

// Each activation row to int8, symmetric, one scale per row (a plain loop: a few ATen ops per call would cost
// more than the product at one row).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* x_scale) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[m * K + k]));
    x_scale[m] = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / x_scale[m];
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int8_t>(std::nearbyint(x[m * K + k] * inv));
  }
}

inline void product_int8(const float* x, int64_t M, const Weight& w, float* y, Store how) {
  const int64_t K = w.K, N = w.N;
  std::vector<int8_t> xq(M * K);
  std::vector<float> x_scale(M);
  quantize_rows(x, M, K, xq.data(), x_scale.data());
  const int8_t* q = xq.data();
  const int8_t* weight = static_cast<const int8_t*>(w.data);
  const float* xs = x_scale.data();
  at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min(kRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2)
          block_int8<2>(q + m0 * K, K, weight, n0, rows, xs + m0, w.scale, w.bias, y + m0 * N, N, how);
        else
          block_int8<1>(q + m0 * K, K, weight, n0, rows, xs + m0, w.scale, w.bias, y + m0 * N, N, how);
      }
    }
  });
}

// y [M, N] from x [M, K]: fp32 or int8 by the weight's scale.
inline void product(const float* x, int64_t M, const Weight& w, float* y, Store how = Store::kSet) {
  if (w.scale)
    product_int8(x, M, w, y, how);
  else
    product_fp32(x, M, w, y, how);
}

}  // namespace xattn
