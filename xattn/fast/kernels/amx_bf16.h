// bfloat16 products on AMX tiles for the ViT kernel's bfloat16 layers (encoder.cpp), where the CPU has AMX-BF16.
//
// oneDNN's bfloat16 matmul (torch's mm on these CPUs) picks its blocking by the number of rows, so an image's rows
// come out differently in a batch of 16 than alone: a server could not encode the requests that arrive together in
// one call and still give each the result it gets alone. Here every output value is the same sequence of tdpbf16ps
// steps over K whatever M is (each tile row computed from its own input row), so each row's result is independent
// of the rows beside it, bit for bit; and the bias, GELU or residual sum is applied to the fp32 sums as each 32 x 32
// block is finished, in cache, where oneDNN's product would be followed by a sweep over its whole output.
//
// The weight is packed once into B tiles: [ceil(N / 16)][ceil(K / 32)][16 pairs of k][16 columns][2]
// (kernels.bf16_tiles, in Python), so each tile load is 1 KB in a row; x is read in place as A tiles (16 rows x 32
// values, its row stride apart). A thread takes a range of 32-row pairs (of 32-column pairs of blocks where the rows
// are few) and walks its rows in chunks that stay in L2 while the weights stream past.
#pragma once

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "products.h"
#include "rowwise.h"

namespace xattn {

#define XATTN_TILE_DOTS_BF16(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define XATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Whether the CPU has AMX-TILE, AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and AVX512-BF16 (leaf 7 subleaf 1: EAX
// bit 5), and Linux gives this process the tile state (amx_tile_state).
inline bool amx_bf16_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!vnni_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
      return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
    return amx_tile_state();
  }();
  return ok;
}

// A zeroed array of n T (n >= 0) on 64-byte boundaries: a tile row that straddles two cache lines costs two loads.
template <typename T>
struct Lines {
  std::unique_ptr<T[], decltype(&std::free)> memory;
  explicit Lines(int64_t n)
      : memory(static_cast<T*>(std::aligned_alloc(64, std::max<int64_t>(1, (n * sizeof(T) + 63) / 64) * 64)),
               &std::free) {
    TORCH_CHECK(memory, "out of memory for ", n * sizeof(T), " bytes of attention buffers");
    std::memset(memory.get(), 0, n * sizeof(T));
  }
  T* data() const { return memory.get(); }
};

// Every tile 16 rows x 64 bytes: 16 x 32 bfloat16 (an A operand), 16 pairs x 16 columns (a B operand), 16 x 16 fp32.
struct alignas(64) SquareTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// 2^t in 16 lanes: t = n + f with n the nearest integer, 2^f on [-1/2, 1/2] by a degree-5 polynomial (a Chebyshev
// fit, relative error < 2e-7, as expf's), times 2^n by scalef; t clamped at -150 (2^t rounds to 0 below it) so
// that -inf gives 0, not inf - inf.
XATTN_AVX512_BF16 inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(_mm512_set1_ps(-150.f), t);  // t second: a NaN passes through
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.34004327e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67603736e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55032715e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40221068e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000012f));
  return _mm512_scalef_ps(p, n);
}

// The exact (erf) GELU, x (1 + erf(x / sqrt 2)) / 2, with erfc(z) for z = |x| / sqrt 2 from Abramowitz and Stegun's
// 7.1.26 (t = 1 / (1 + p z), a polynomial in t times e^(-z^2); |error| < 1.5e-7): x - x erfc(z) / 2 for x >= 0,
// x erfc(z) / 2 below. Far below bfloat16's rounding, which every result then takes.
XATTN_AVX512_BF16 inline __m512 gelu16(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
  const __m512 d = _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f));
  __m512 t = _mm512_rcp14_ps(d);  // 1 / d to 2^-14, then one Newton step: t (2 - d t)
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.f)));
  __m512 poly = _mm512_set1_ps(1.061405429f);
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
  const __m512 gauss = exp2_16(_mm512_mul_ps(_mm512_mul_ps(z, z), _mm512_set1_ps(-kLog2e)));  // e^(-z^2)
  const __m512 erfc = _mm512_mul_ps(_mm512_mul_ps(poly, t), gauss);
  const __m512 half_tail = _mm512_mul_ps(_mm512_mul_ps(x, erfc), _mm512_set1_ps(0.5f));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(negative, _mm512_sub_ps(x, half_tail), half_tail);
}

// How a product's fp32 sums + bias are finished: rounded to bfloat16 (kRound), through GELU then rounded (kGelu), or
// added to an fp32 residual stream (kAccumulate).
enum class Finish { kRound, kGelu, kAccumulate };

struct TileProduct {
  const uint16_t* x;  // [M, K] bfloat16
  const uint16_t* w;  // B tiles [N / 16][K / 32][16][32]
  const float* bias;  // [N]
  void* out;          // [M, N]: bfloat16 (kRound, kGelu) or fp32 (kAccumulate)
  int64_t M, K, N;
  Finish how;
};

// A finished block's sums [32][32] (rows of 32) waiting for their bias and finish: 16 values at a time, interleaved
// with the next block's tile products, so that the vector units finish one block while the tiles compute the next.
struct Pending {
  const float* sums = nullptr;
  int64_t m0 = 0, n0 = 0, per_row = 0, next = 0, total = 0;  // per_row: 16-value vectors in a row (1 or 2)
};

// The next `count` vectors of `pending` (all that are left where count < 0) finished into p.out.
XATTN_AVX512_BF16 inline void finish_vectors(const TileProduct& p, Pending& pending, int64_t count) {
  const int64_t last = count < 0 ? pending.total : std::min(pending.total, pending.next + count);
  for (; pending.next < last; ++pending.next) {
    const int64_t r = pending.next / pending.per_row, c = pending.next % pending.per_row * 16;
    const int64_t n = pending.n0 + c, at = (pending.m0 + r) * p.N + n;
    __m512 v = _mm512_add_ps(_mm512_load_ps(pending.sums + r * 32 + c), _mm512_loadu_ps(p.bias + n));
    if (p.how == Finish::kAccumulate) {
      float* y = static_cast<float*>(p.out) + at;
      _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), v));
      continue;
    }
    if (p.how == Finish::kGelu) v = gelu16(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + at),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// Row pairs [rows_begin, rows_end) x column pairs [begin, end) of p on this thread.
XATTN_AVX512_BF16 inline void tile_product_part(const TileProduct& p, int64_t rows_begin, int64_t rows_end,
                                                int64_t begin, int64_t end) {
  const SquareTiles config;
  asm volatile("ldtilecfg %0" ::"m"(config) : "memory");
  const int64_t ksteps = p.K / 32, blocks = p.N / 16;
  // x's rows per chunk: ~512 KB of x in L2 while the weights stream past, in whole 32-row pairs, but at least 5 pairs:
  // each chunk reads every weight panel from L3 again, and at a wide K (fc2) fewer rows cannot cover that read
  const int64_t chunk = std::max<int64_t>(5, (512 * 1024) / (32 * p.K * 2));
  alignas(64) float sums[32 * 32];  // the last block's, finished during the next block's products
  Pending pending;
  // each step of a block's products finishes this many of the previous block's (up to) 64 vectors
  const int64_t per_step = (64 + ksteps - 1) / ksteps;
  // the last pair's rows past M come from here, zeros (so no read goes past x); only the thread that has that pair
  const int64_t full = p.M / 32;
  Lines<uint16_t> tail(full < rows_end ? 32 * p.K : 0);
  if (full < rows_end) std::memcpy(tail.data(), p.x + full * 32 * p.K, (p.M - full * 32) * p.K * 2);
  for (int64_t c0 = rows_begin; c0 < rows_end; c0 += chunk)
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b0 = 2 * pair;
      const bool two = b0 + 1 < blocks;
      const uint16_t* w0 = p.w + b0 * ksteps * 512;
      const uint16_t* w1 = w0 + ksteps * 512;
      for (int64_t mp = c0; mp < std::min(c0 + chunk, rows_end); ++mp) {
        const uint16_t* x0 = mp < full ? p.x + mp * 32 * p.K : tail.data();
        const uint16_t* x1 = x0 + 16 * p.K;
        XATTN_TILE_ZERO(4);
        XATTN_TILE_ZERO(6);
        if (two) {
          XATTN_TILE_ZERO(5);
          XATTN_TILE_ZERO(7);
        }
        for (int64_t s = 0; s < ksteps; ++s) {
          XATTN_TILE_LOAD(0, x0 + s * 32, p.K * 2);
          XATTN_TILE_LOAD(1, x1 + s * 32, p.K * 2);
          XATTN_TILE_LOAD(2, w0 + s * 512, 64);
          XATTN_TILE_DOTS_BF16(4, 0, 2);
          XATTN_TILE_DOTS_BF16(6, 1, 2);
          if (two) {
            XATTN_TILE_LOAD(3, w1 + s * 512, 64);
            XATTN_TILE_DOTS_BF16(5, 0, 3);
            XATTN_TILE_DOTS_BF16(7, 1, 3);
          }
          finish_vectors(p, pending, per_step);
        }
        finish_vectors(p, pending, -1);  // sums is free again
        XATTN_TILE_STORE(4, sums, 128);
        XATTN_TILE_STORE(6, sums + 16 * 32, 128);
        if (two) {
          XATTN_TILE_STORE(5, sums + 16, 128);
          XATTN_TILE_STORE(7, sums + 16 * 32 + 16, 128);
        }
        const int64_t per_row = two ? 2 : 1;
        pending = {sums, mp * 32, b0 * 16, per_row, 0, std::min<int64_t>(32, p.M - mp * 32) * per_row};
      }
    }
  finish_vectors(p, pending, -1);
  asm volatile("tilerelease" ::: "memory");
}

// p.out = finish(p.x p.w^T + p.bias); N a multiple of 16, K of 32 (the packed weight's shape checked by the caller).
// The threads split the rows where there are enough of them: each then reads the rows it wrote in the step before
// (the norms and the attention split rows alike), not half of them from the other core's cache; few rows, the
// columns. Either way every value is the same tile steps.
inline void tile_product(const TileProduct& p) {
  const int64_t rows = (p.M + 31) / 32, columns = (p.N / 16 + 1) / 2;
  if (rows >= 8 * at::get_num_threads())
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) { tile_product_part(p, begin, end, 0, columns); });
  else
    at::parallel_for(0, columns, 1, [&](int64_t begin, int64_t end) { tile_product_part(p, 0, rows, begin, end); });
}

}  // namespace xattn
