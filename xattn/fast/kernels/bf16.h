// bfloat16 <-> fp32 conversions shared by the kernels' bfloat16 paths (encoder.cpp, cross_heads.cpp), 8 lanes at a
// time with AVX2; the same values as torch's conversions (round to nearest, ties to even; a NaN stays a NaN).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace xattn {

// x rounded to the nearest bfloat16 (ties to even, a NaN kept a NaN), as torch's conversion rounds.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>((bits >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// 8 floats rounded as to_bf16 rounds each
inline __m128i to_bf16x8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i half = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  half = _mm256_blendv_epi8(half, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(half, half);  // [0..3, 0..3 | 4..7, 4..7] as 16 bits each
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

inline __m256 from_bf16x8(const uint16_t* h) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// y [n] bfloat16 = x [n] fp32, rounded
inline void round_span(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), to_bf16x8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = to_bf16(x[i]);
}

inline uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// 8 floats stored as float32, as float16 (to nearest even, through F16C, as torch converts) or as bfloat16 (uint16_t)
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(at::Half* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store8(uint16_t* out, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16x8(v)); }
inline void store1(float* out, float v) { *out = v; }
inline void store1(at::Half* out, float v) { *out = static_cast<at::Half>(v); }
inline void store1(uint16_t* out, float v) { *out = to_bf16(v); }

// out[i] = float(in[i]) + bias[i] for i < n (bfloat16 in, the sum in fp32, rounded once to Out); with accumulate
// (float32 out only) out[i] += that sum. out may be in itself.
template <typename Out>
inline void add_bias(const uint16_t* in, const float* bias, int64_t n, Out* out, bool accumulate = false) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_add_ps(from_bf16x8(in + i), _mm256_loadu_ps(bias + i));
    if constexpr (std::is_same_v<Out, float>)
      if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    store8(out + i, v);
  }
  for (; i < n; ++i) {
    float v = from_bf16(in[i]) + bias[i];
    if constexpr (std::is_same_v<Out, float>)
      if (accumulate) v = out[i] + v;
    store1(out + i, v);
  }
}

}  // namespace xattn
