// Row-wise pieces shared by the decoder's and the encoder's layers (layers.cpp, encoder.cpp): layer norm, e^x,
// softmax.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "bf16.h"
#include "products.h"

namespace xattn {

// Rows in parallel (from 4 rows on); float sums in 8 lanes, the variance from a second pass as torch does. y: float,
// or bfloat16 (uint16_t: the float result rounded) for a bfloat16 product's input.
template <typename Out>
inline void layer_norm(const float* x, int64_t rows, int64_t D, const float* gamma, const float* beta, double eps,
                       Out* y) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xm = x + m * D;
      const int64_t d8 = D - D % 8;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < d8; d += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xm + d));
      float sum = hsum(acc);
      for (int64_t d = d8; d < D; ++d) sum += xm[d];
      const float mean = sum / D;
      const __m256 mu = _mm256_set1_ps(mean);
      acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < d8; d += 8) {
        const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(xm + d), mu);
        acc = _mm256_fmadd_ps(c, c, acc);
      }
      float var = hsum(acc);
      for (int64_t d = d8; d < D; ++d) var += (xm[d] - mean) * (xm[d] - mean);
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var) / D + eps));
      int64_t d = 0;
      if constexpr (std::is_same_v<Out, uint16_t>) {  // bfloat16: 8 at a time (float's loop the compiler widens)
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (; d + 8 <= D; d += 8) {
          const __m256 c = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xm + d), mu), inv8);
          store8(y + m * D + d, _mm256_fmadd_ps(c, _mm256_loadu_ps(gamma + d), _mm256_loadu_ps(beta + d)));
        }
      }
      for (; d < D; ++d) store1(y + m * D + d, (xm[d] - mean) * inv * gamma[d] + beta[d]);
    }
  });
}

// e^x = 2^n e^r with x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two for an exact n ln2): Cephes' degree-5
// polynomial for e^r (relative error ~1e-7, as expf), highest degree first (amx_bf16.h's exp2_16, for 16 lanes,
// takes 2^t by another polynomial and scalef).
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPolynomial[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x for x <= 0 in 8 lanes, 2^n put into the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), x);
  __m256 y = _mm256_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPolynomial[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// scores[t] = e^(scores[t] - peak), 0 where masked; returns their sum.
inline float exponentiate(float* scores, int64_t positions, float peak, const bool* mask) {
  const __m256 top = _mm256_set1_ps(peak);
  int64_t t = 0;
  for (; t + 8 <= positions; t += 8)
    _mm256_storeu_ps(scores + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), top)));
  for (; t < positions; ++t) scores[t] = std::exp(scores[t] - peak);
  float total = 0.f;
  for (t = 0; t < positions; ++t) {
    if (mask && !mask[t]) scores[t] = 0.f;
    total += scores[t];
  }
  return total;
}

// softmax of row [n] in place (no mask), 8 lanes at a time.
inline void softmax(float* row, int64_t n) {
  const int64_t n8 = n - n % 8;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n8; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float peak = lanes[0];
  for (int j = 1; j < 8; ++j) peak = std::max(peak, lanes[j]);
  for (int64_t t = n8; t < n; ++t) peak = std::max(peak, row[t]);
  const __m256 top = _mm256_set1_ps(peak);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t t = 0; t < n8; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), top));
    _mm256_storeu_ps(row + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum(sum8);
  for (int64_t t = n8; t < n; ++t) total += row[t] = std::exp(row[t] - peak);
  const float inv = 1.f / total;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t t = 0; t < n8; t += 8) _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_loadu_ps(row + t), inv8));
  for (int64_t t = n8; t < n; ++t) row[t] *= inv;
}

}  // namespace xattn
