// Matrix-vector products for decode steps (a few rows of activations against a whole weight matrix), AVX2 + FMA.
//
// A decode step at batch 1-8 streams every weight once, so its speed is memory bandwidth; at 32 rows (8 inputs x 4
// beams) it is bound by the FMA units. fp32 weights are stored in 16-column panels (see product_fp32) read as one
// stream with the next panel prefetched, which reaches the bandwidth of a plain sum at one row and ~70% of the FMA
// peak at 32; int8 weights, one fp32 scale per row, are stored in blocks of 8 interleaved rows (see block_int8) read
// the same way: each activation row is quantized to int8 (symmetric, one scale per row) and bytes are multiplied with
// vpmaddubsw, x's sign moved onto w so that |x| can be the unsigned operand. All run on torch's thread pool.
#pragma once

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace xattn {

constexpr int64_t kRows = 8;  // weight rows per block

// How a product's result is stored: y = p + bias, or y += p + bias (a residual connection).
enum class Store { kSet, kAdd };

struct Weight {
  const void* data;    // fp32 panels [ceil(N / 16), K, 16], or int8 blocks [ceil(N / 8), ceil(K / 32), 8, 32]
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

inline bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// fp32 weights are panels: [ceil(N / 16), K, 16], panel p holding output columns 16p .. 16p + 15 (zeros past N), so
// that one k step of a panel is 64 contiguous bytes. A tile of M <= 6 activation rows x 16 columns lives in 12
// registers for the whole of K, each product summed in k order by one FMA chain (the same for any M, so a row's
// result does not depend on the rows beside it); the next panel is prefetched into L2 as this one is read.
constexpr int64_t kPanel = 16;

inline void fma_row(const float* x, __m256 w0, __m256 w1, __m256& c0, __m256& c1) {
  const __m256 xb = _mm256_broadcast_ss(x);
  c0 = _mm256_fmadd_ps(xb, w0, c0);
  c1 = _mm256_fmadd_ps(xb, w1, c1);
}

// y[n0 + j] (+)= c[j] + bias[n0 + j] for j < cols
inline void store_row(__m256 c0, __m256 c1, float* y, int64_t n0, int64_t cols, const float* bias, Store how) {
  alignas(32) float sums[kPanel];
  _mm256_store_ps(sums, c0);
  _mm256_store_ps(sums + 8, c1);
  for (int64_t j = 0; j < cols; ++j) store(y + n0 + j, bias ? sums[j] + bias[n0 + j] : sums[j], how);
}

template <int M>
void tile_fp32(const float* x, int64_t K, const float* panel, const float* next, int64_t n0, int64_t cols,
               const float* bias, float* y, int64_t N, Store how) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00;
  __m256 c10 = _mm256_setzero_ps(), c11 = c10;
  __m256 c20 = _mm256_setzero_ps(), c21 = c20;
  __m256 c30 = _mm256_setzero_ps(), c31 = c30;
  __m256 c40 = _mm256_setzero_ps(), c41 = c40;
  __m256 c50 = _mm256_setzero_ps(), c51 = c50;
  for (int64_t k = 0; k < K; ++k) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    if constexpr (M > 0) fma_row(x + 0 * K + k, w0, w1, c00, c01);
    if constexpr (M > 1) fma_row(x + 1 * K + k, w0, w1, c10, c11);
    if constexpr (M > 2) fma_row(x + 2 * K + k, w0, w1, c20, c21);
    if constexpr (M > 3) fma_row(x + 3 * K + k, w0, w1, c30, c31);
    if constexpr (M > 4) fma_row(x + 4 * K + k, w0, w1, c40, c41);
    if constexpr (M > 5) fma_row(x + 5 * K + k, w0, w1, c50, c51);
  }
  if constexpr (M > 0) store_row(c00, c01, y + 0 * N, n0, cols, bias, how);
  if constexpr (M > 1) store_row(c10, c11, y + 1 * N, n0, cols, bias, how);
  if constexpr (M > 2) store_row(c20, c21, y + 2 * N, n0, cols, bias, how);
  if constexpr (M > 3) store_row(c30, c31, y + 3 * N, n0, cols, bias, how);
  if constexpr (M > 4) store_row(c40, c41, y + 4 * N, n0, cols, bias, how);
  if constexpr (M > 5) store_row(c50, c51, y + 5 * N, n0, cols, bias, how);
}

// Rows per tile: 6 while 10 or more are left (or exactly 6), then two tiles of about half the rest.
inline int64_t tile_rows(int64_t left) { return left >= 10 || left <= 6 ? std::min<int64_t>(6, left) : (left + 1) / 2; }

// tile_fp32 for rows = 1..6 rows of x (row stride K) against one panel; y's rows are N apart.
inline void tile_fp32_rows(int64_t rows, const float* x, int64_t K, const float* panel, const float* next, int64_t n0,
                           int64_t cols, const float* bias, float* y, int64_t N, Store how) {
  switch (rows) {
    case 1: return tile_fp32<1>(x, K, panel, next, n0, cols, bias, y, N, how);
    case 2: return tile_fp32<2>(x, K, panel, next, n0, cols, bias, y, N, how);
    case 3: return tile_fp32<3>(x, K, panel, next, n0, cols, bias, y, N, how);
    case 4: return tile_fp32<4>(x, K, panel, next, n0, cols, bias, y, N, how);
    case 5: return tile_fp32<5>(x, K, panel, next, n0, cols, bias, y, N, how);
    default: return tile_fp32<6>(x, K, panel, next, n0, cols, bias, y, N, how);
  }
}

inline void product_fp32(const float* x, int64_t M, const Weight& w, float* y, Store how) {
  const int64_t K = w.K, N = w.N, panels = (N + kPanel - 1) / kPanel;
  const float* weight = static_cast<const float*>(w.data);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = weight + p * K * kPanel;
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
        rows = tile_rows(M - m0);
        const float* next = m0 == 0 && p + 1 < end ? panel + K * kPanel : nullptr;
        tile_fp32_rows(rows, x + m0 * K, K, panel, next, n0, cols, w.bias, y + m0 * N, N, how);
      }
    }
  });
}

// fp32 weights may also be read as they are, [N, K] in rows (an nn.Linear's weight, such as a tied LM head: no copy).
// Each output is then a dot product summed in one fixed order, the same for any number of rows beside it
// (dot_fp32): one 8-lane FMA chain over the blocks of 8 columns, its lanes added by hsum, then the columns past the
// last block in order, then the bias. Up to 4 activation rows read the weight one row at a time (one sequential
// stream, as fast as the panels at 1-4 rows); more rows go in tiles of 3 activation rows x 4 weight rows (12
// accumulators), each weight row read once per tile.
inline float finish_dot(__m256 acc, const float* x, const float* w, int64_t K, const float* bias, int64_t n) {
  float sum = hsum(acc);
  for (int64_t k = K - K % 8; k < K; ++k) sum = std::fma(x[k], w[k], sum);
  return bias ? sum + bias[n] : sum;
}

inline float dot_fp32(const float* x, const float* w, int64_t K, const float* bias, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc);
  return finish_dot(acc, x, w, K, bias, n);
}

// M activation rows x R weight rows from w (row stride K); next: the next tile's weight rows to prefetch, or nullptr.
template <int M, int R>
void tile_rows_fp32(const float* x, int64_t K, const float* w, const float* next, int64_t n0, const float* bias,
                    float* y, int64_t N, Store how) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k + 8 <= K; k += 8) {
    if (next && k % 16 == 0)  // a 64-byte line of each of the next tile's rows every other step
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T1);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      store(y + m * N + n0 + r, finish_dot(acc[m][r], x + m * K, w + r * K, K, bias, n0 + r), how);
}

// Every activation row against weight rows n0 .. n0 + R - 1, in tiles of up to Most rows.
template <int R, int Most>
void rows_against(const float* x, int64_t M, int64_t K, const float* w, const float* next, int64_t n0,
                  const float* bias, float* y, int64_t N, Store how) {
  for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
    rows = std::min<int64_t>(Most, M - m0);
    const float* pre = m0 == 0 ? next : nullptr;
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    if (Most >= 4 && rows == 4)
      tile_rows_fp32<(Most >= 4 ? 4 : 1), R>(xm, K, w, pre, n0, bias, ym, N, how);
    else if (rows == 3)
      tile_rows_fp32<3, R>(xm, K, w, pre, n0, bias, ym, N, how);
    else if (rows == 2)
      tile_rows_fp32<2, R>(xm, K, w, pre, n0, bias, ym, N, how);
    else
      tile_rows_fp32<1, R>(xm, K, w, pre, n0, bias, ym, N, how);
  }
}

template <int R, int Most>
void product_rows_tiles(const float* x, int64_t M, const float* weight, int64_t N, int64_t K, const float* bias,
                        float* y, Store how) {
  const int64_t tiles = N / R;
  at::parallel_for(0, tiles + 1, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * R;
      if (t == tiles) {  // the rows past the last whole tile, one by one
        for (int64_t n = n0; n < N; ++n)
          for (int64_t m = 0; m < M; ++m) store(y + m * N + n, dot_fp32(x + m * K, weight + n * K, K, bias, n), how);
        continue;
      }
      const float* w = weight + n0 * K;
      rows_against<R, Most>(x, M, K, w, t + 1 < end ? w + R * K : nullptr, n0, bias, y, N, how);
    }
  });
}

inline void product_rows_fp32(const float* x, int64_t M, const float* weight, int64_t N, int64_t K, const float* bias,
                              float* y, Store how = Store::kSet) {
  if (M <= 4)
    product_rows_tiles<1, 4>(x, M, weight, N, K, bias, y, how);
  else
    product_rows_tiles<4, 3>(x, M, weight, N, K, bias, y, how);
}

// int8 weights are blocks [ceil(N / 8), ceil(K / 32), 8, 32]: 8 rows interleaved 32 bytes at a time (zeros past N
// and K), so a block is one 8 x K stream and the next block can be prefetched as this one is read.
constexpr int64_t kBytes = 32;  // int8 columns per step of a block
inline int64_t padded_k(int64_t K) { return (K + kBytes - 1) / kBytes * kBytes; }

// int32 dot products of quantized rows xq[m] (|xq| <= 127, K32 long) with the 8 rows of one int8 block: |x|
// (unsigned) times w with x's sign moved onto it; pairs of products (<= 2 * 127 * 127) fit int16.
template <int M>
void block_int8(const int8_t* xq, int64_t K32, const int8_t* block, const int8_t* next, int64_t n0, int64_t rows,
                const float* x_scale, const float* scale, const float* bias, float* y, int64_t N, Store how) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K32; k += kBytes) {
    const int8_t* step = block + k * kRows;
    if (next)
      for (int64_t line = 0; line < kRows * kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kRows + line), _MM_HINT_T1);
    __m256i xv[M], xa[M];
    for (int m = 0; m < M; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K32 + k));
      xa[m] = _mm256_abs_epi8(xv[m]);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + r * kBytes));
      for (int m = 0; m < M; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(xa[m], _mm256_sign_epi8(wv, xv[m]));
        acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    for (int m = 0; m < M; ++m) {
      // the bias by one explicit fma: left to the compiler, `a * b + c` was contracted in one instantiation of M and
      // not in the other, and a row's result must not depend on how many rows are computed beside it
      const float scaled = float(hsum_epi32(acc[m][r])) * x_scale[m];
      store(y + m * N + n, bias ? std::fma(scaled, scale[n], bias[n]) : scaled * scale[n], how);
    }
  }
}

// Each activation row to int8 [M, K32] (zeros past K), symmetric, one scale per row. 8 lanes at a time, the same
// values as the scalar steps (max and rounding are exact in any order; a NaN is skipped by the max and quantizes to 0,
// as the scalar cast makes it): at 16 rows and K = 3072 the scalar loop, run before the product's threads start,
// took as long as a third of the product.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t K32, int8_t* xq, float* x_scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int64_t k8 = K - K % 8;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    int8_t* qm = xq + m * K32;
    __m256 peak = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8)  // max(v, peak) keeps peak where v is NaN, as std::max(peak, v) does
      peak = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xm + k)), peak);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peak);
    float amax = 0.f;
    for (float v : lanes) amax = std::max(amax, v);
    for (int64_t k = k8; k < K; ++k) amax = std::max(amax, std::abs(xm[k]));
    x_scale[m] = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / x_scale[m];
    const __m256 factor = _mm256_set1_ps(inv);
    for (int64_t k = 0; k < k8; k += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xm + k), factor);
      const __m256 rounded = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256i q = _mm256_cvtps_epi32(rounded);
      q = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)), q);  // NaN -> 0
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qm + k), _mm_packs_epi16(q16, q16));
    }
    for (int64_t k = k8; k < K; ++k) qm[k] = static_cast<int8_t>(std::nearbyint(xm[k] * inv));
    for (int64_t k = K; k < K32; ++k) qm[k] = 0;
  }
}

// The same int32 sums with AVX-512 VNNI, where the CPU has it: vpdpbusd multiplies unsigned bytes by signed ones and
// adds each 4 products into an int32 lane without saturating, so x goes in as unsigned bytes offset by 128 (xq ^ 0x80)
// and 128 x the weight row's sum comes off again; a 64-byte load of a block step holds 2 of its rows, x's 32 bytes
// are broadcast to both halves. One instruction per 64 products where AVX2 needs four, which keeps beams and
// batches of rows at the weight stream's speed (see int8_kernel below for the choice between the two).
#define XATTN_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// acc + the 4-byte dot products of unsigned u with signed s, per int32 lane. In asm: GCC 12 keeps the intrinsic's
// accumulator in the lower 16 registers and copies every accumulator to and fro on each step.
XATTN_VNNI inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// The 8 row totals of a block's 4 accumulators (rows 2j and 2j + 1 in the halves of acc[j]), in row order: a
// transposing reduction, 4 lanes of 4 rows at a time (integer sums: exact in any order).
XATTN_VNNI inline __m256i row_totals(const __m512i* acc) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]), _mm512_unpackhi_epi32(acc[0], acc[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]), _mm512_unpackhi_epi32(acc[2], acc[3]));
  // each 128-bit lane: (row 0, 2, 4, 6) in lanes 0 and 1 of 4, (row 1, 3, 5, 7) in lanes 2 and 3, partial sums
  const __m512i all = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m512i pairs = _mm512_add_epi32(all, _mm512_shuffle_i32x4(all, all, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m128i even = _mm512_castsi512_si128(pairs), odd = _mm512_extracti32x4_epi32(pairs, 2);
  return _mm256_set_m128i(_mm_unpackhi_epi32(even, odd), _mm_unpacklo_epi32(even, odd));
}

// Sums: this tile also makes the block's row sums (the first tile of a block; later tiles reuse them).
template <int M, bool Sums>
XATTN_VNNI void block_int8_vnni(const uint8_t* xu, int64_t K32, const int8_t* block, const int8_t* next, int64_t n0,
                                int64_t rows, int32_t* row_sums, const float* x_scale, const float* scale,
                                const float* bias, float* y, int64_t N, Store how) {
  constexpr int J = kRows / 2;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[M][J], sums[J];  // acc[m][j]: rows 2j (low half) and 2j + 1 (high half) of the block against x row m
  for (int j = 0; j < J; ++j) {
    sums[j] = _mm512_setzero_si512();
    for (int m = 0; m < M; ++m) acc[m][j] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < K32; k += kBytes) {
    const int8_t* step = block + k * kRows;
    if (next)
      for (int64_t line = 0; line < kRows * kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + k * kRows + line), _MM_HINT_T1);
    __m512i wv[J];
    for (int j = 0; j < J; ++j) wv[j] = _mm512_loadu_si512(step + j * 64);
    if constexpr (Sums)
      for (int j = 0; j < J; ++j) sums[j] = dpbusd(sums[j], ones, wv[j]);
    for (int m = 0; m < M; ++m) {
      const __m512i xv =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + m * K32 + k)));
      for (int j = 0; j < J; ++j) acc[m][j] = dpbusd(acc[m][j], xv, wv[j]);
    }
  }
  if constexpr (Sums) _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_sums), row_totals(sums));
  const __m256i offset = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_sums)), 7);
  for (int m = 0; m < M; ++m) {
    alignas(32) int32_t dots[kRows];
    _mm256_store_si256(reinterpret_cast<__m256i*>(dots), _mm256_sub_epi32(row_totals(acc[m]), offset));
    for (int r = 0; r < rows; ++r) {  // the same float steps as block_int8's
      const int64_t n = n0 + r;
      const float scaled = float(dots[r]) * x_scale[m];
      store(y + m * N + n, bias ? std::fma(scaled, scale[n], bias[n]) : scaled * scale[n], how);
    }
  }
}

constexpr int kVnniRows = 4;  // activation rows per tile: 4 x 4 accumulators, 4 weight and 4 row-sum registers of 32

XATTN_VNNI inline void product_int8_vnni(const int8_t* xq, int64_t M, const Weight& w, int64_t K32, const float* xs,
                                         float* y, Store how) {
  const int64_t N = w.N, blocks = (N + kRows - 1) / kRows;
  std::vector<uint8_t> xu(M * K32);
  for (int64_t i = 0; i < M * K32; ++i) xu[i] = static_cast<uint8_t>(xq[i]) ^ 0x80;
  const uint8_t* u = xu.data();
  const int8_t* weight = static_cast<const int8_t*>(w.data);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min(kRows, N - n0);
      const int8_t* block = weight + blk * kRows * K32;
      int32_t sums_of_block[kRows];
      for (int64_t m0 = 0; m0 < M; m0 += kVnniRows) {
        const int8_t* next = m0 == 0 && blk + 1 < end ? block + kRows * K32 : nullptr;
        // the first tile of a block also makes its row sums, later tiles reuse them
        auto run = [&](auto first) {
          constexpr bool Sums = decltype(first)::value;
          const uint8_t* um = u + m0 * K32;
          float* ym = y + m0 * N;
          switch (std::min<int64_t>(kVnniRows, M - m0)) {
#define XATTN_TILE(R) \
  block_int8_vnni<R, Sums>(um, K32, block, next, n0, rows, sums_of_block, xs + m0, w.scale, w.bias, ym, N, how)
            case 1: XATTN_TILE(1); break;
            case 2: XATTN_TILE(2); break;
            case 3: XATTN_TILE(3); break;
            default: XATTN_TILE(4);
#undef XATTN_TILE
          }
        };
        if (m0 == 0)
          run(std::true_type{});
        else
          run(std::false_type{});
      }
    }
  });
}

// The same int32 sums on AMX, where the CPU has it (Intel Sapphire Rapids on): tdpbssd multiplies signed bytes by
// signed bytes, a tile of 8 weight rows x 32 columns (one block step, read in place: 8 rows 32 bytes apart) by 32
// columns of 16 activation rows (laid out per call as the instruction wants them: [8 groups of 4 columns][16 rows][4])
// into 8 x 16 int32 sums, 4096 products an instruction where VNNI does 64. From ~8 rows on VNNI is bound by its
// multiplies and AMX by the weight stream. The tile instructions are written in asm, each with a memory clobber (the
// compiler must not move loads and stores of the buffers across them), so no target flag is needed to build them.
#define XATTN_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define XATTN_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define XATTN_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define XATTN_TILE_DOTS(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

// Whether Linux gives this process the AMX tile state, which it does only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; oneDNN asks the same). Asked once.
inline bool amx_tile_state() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25) and the tile state.
inline bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!vnni_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
      return false;
    return amx_tile_state();
  }();
  return ok;
}

constexpr int64_t kAmxRows = 16;  // activation rows per tile (one int32 lane each)
constexpr int64_t kAmxFrom = 8;   // rows from which products run on AMX (below, VNNI: one weight stream either way)

// The tiles: 0, 1 weights (8 rows x 32 bytes), 2, 3 activations (8 x 64), 4-7 sums (8 x 64: 8 weight rows x 16
// activation rows). A thread loads this once before its tiles and releases the tile state after.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {32, 32, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {8, 8, 8, 8, 8, 8, 8, 8};
};

// x's quantized rows as the activation tiles: per group of 16 rows and block step of 32 columns, 512 bytes
// [8][16][4]: row k of the tile holds columns 4k .. 4k + 3 of each of the 16 rows (zeros past M).
inline std::vector<int8_t> amx_activations(const int8_t* xq, int64_t M, int64_t K32) {
  const int64_t groups = (M + kAmxRows - 1) / kAmxRows, steps = K32 / kBytes;
  std::vector<int8_t> tiles(groups * steps * 512, 0);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* group = tiles.data() + (m / kAmxRows) * steps * 512 + (m % kAmxRows) * 4;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t k = 0; k < 8; ++k) std::memcpy(group + s * 512 + k * 64, xq + m * K32 + s * kBytes + 4 * k, 4);
  }
  return tiles;
}

// The int32 sums of Blocks (1 or 2) weight blocks from `block` with Groups (1 or 2) activation tiles from `x`, over
// every step: sums [Blocks x Groups][8][16], block-major.
constexpr int64_t kAhead = 4;  // block steps the weight is prefetched ahead

template <int Blocks, int Groups>
void amx_sums(const int8_t* block, int64_t K32, const int8_t* x, int64_t steps, int32_t* sums) {
  const int8_t* block2 = block + kRows * K32;
  const int8_t* x2 = x + steps * 512;
  XATTN_TILE_ZERO(4);
  if constexpr (Blocks > 1) XATTN_TILE_ZERO(5);
  if constexpr (Groups > 1) XATTN_TILE_ZERO(6);
  if constexpr (Blocks > 1 && Groups > 1) XATTN_TILE_ZERO(7);
  for (int64_t s = 0; s < steps; ++s) {
    if (s + kAhead < steps)
      for (int64_t line = 0; line < kRows * kBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(block + (s + kAhead) * kRows * kBytes + line), _MM_HINT_T0);
        if constexpr (Blocks > 1)
          _mm_prefetch(reinterpret_cast<const char*>(block2 + (s + kAhead) * kRows * kBytes + line), _MM_HINT_T0);
      }
    XATTN_TILE_LOAD(0, block + s * kRows * kBytes, kBytes);
    XATTN_TILE_LOAD(2, x + s * 512, 64);
    XATTN_TILE_DOTS(4, 0, 2);
    if constexpr (Blocks > 1) {
      XATTN_TILE_LOAD(1, block2 + s * kRows * kBytes, kBytes);
      XATTN_TILE_DOTS(5, 1, 2);
    }
    if constexpr (Groups > 1) {
      XATTN_TILE_LOAD(3, x2 + s * 512, 64);
      XATTN_TILE_DOTS(6, 0, 3);
      if constexpr (Blocks > 1) XATTN_TILE_DOTS(7, 1, 3);
    }
  }
  XATTN_TILE_STORE(4, sums, 64);
  if constexpr (Blocks > 1) XATTN_TILE_STORE(5, sums + 128, 64);
  if constexpr (Groups > 1) XATTN_TILE_STORE(6, sums + Blocks * 128, 64);
  if constexpr (Blocks > 1 && Groups > 1) XATTN_TILE_STORE(7, sums + 3 * 128, 64);
}

inline void product_int8_amx(const int8_t* xq, int64_t M, const Weight& w, int64_t K32, const float* xs, float* y,
                             Store how) {
  const int64_t N = w.N, blocks = (N + kRows - 1) / kRows, steps = K32 / kBytes;
  const int64_t groups = (M + kAmxRows - 1) / kAmxRows;
  const std::vector<int8_t> x = amx_activations(xq, M, K32);
  const int8_t* weight = static_cast<const int8_t*>(w.data);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    asm volatile("ldtilecfg %0" ::"m"(config) : "memory");
    alignas(64) int32_t sums[4 * kRows * kAmxRows];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b0 = 2 * pair, pair_blocks = std::min<int64_t>(2, blocks - b0);
      const int8_t* block = weight + b0 * kRows * K32;
      for (int64_t g0 = 0; g0 < groups; g0 += 2) {
        const int64_t pair_groups = std::min<int64_t>(2, groups - g0);
        const int8_t* xg = x.data() + g0 * steps * 512;
        if (pair_blocks == 2 && pair_groups == 2) amx_sums<2, 2>(block, K32, xg, steps, sums);
        else if (pair_blocks == 2) amx_sums<2, 1>(block, K32, xg, steps, sums);
        else if (pair_groups == 2) amx_sums<1, 2>(block, K32, xg, steps, sums);
        else amx_sums<1, 1>(block, K32, xg, steps, sums);
        // row by row of y, each row's up to 16 columns together: y's rows may be a multiple of 4 KB apart, and
        // 16 of them written a column at a time would all fall in one set of the L1 cache
        for (int64_t j = 0; j < pair_groups; ++j)
          for (int64_t m = (g0 + j) * kAmxRows; m < std::min((g0 + j + 1) * kAmxRows, M); ++m)
            for (int64_t i = 0; i < pair_blocks; ++i) {
              const int32_t* tile = sums + (j * pair_blocks + i) * kRows * kAmxRows + m % kAmxRows;
              const int64_t n0 = (b0 + i) * kRows;
              for (int64_t r = 0; r < std::min(kRows, N - n0); ++r) {  // the same float steps as block_int8's
                const int64_t n = n0 + r;
                const float scaled = float(tile[r * kAmxRows]) * xs[m];
                store(y + m * N + n, w.bias ? std::fma(scaled, w.scale[n], w.bias[n]) : scaled * w.scale[n], how);
              }
            }
      }
    }
    asm volatile("tilerelease" ::: "memory");
  });
}

// Which int8 kernel products use: 2 AMX (from kAmxFrom rows; VNNI below), 1 AVX-512 VNNI, 0 AVX2; the same int32 sums
// each way, so the same results. The best the CPU has; XATTN_INT8_KERNEL (read in Python when the library loads) and
// tests switch it through xattn_kernels::int8_kernel.
inline std::atomic<int>& int8_kernel() {
  static std::atomic<int> kernel{amx_supported() ? 2 : vnni_supported() ? 1 : 0};
  return kernel;
}

inline void product_int8(const float* x, int64_t M, const Weight& w, float* y, Store how) {
  const int64_t K = w.K, N = w.N, K32 = padded_k(K), blocks = (N + kRows - 1) / kRows;
  std::vector<int8_t> xq(M * K32);
  std::vector<float> x_scale(M);
  quantize_rows(x, M, K, K32, xq.data(), x_scale.data());
  const int8_t* q = xq.data();
  const float* xs = x_scale.data();
  // one row streams the weight either way, and AVX2's kernel does it without the row sums' extra products
  const int kernel = int8_kernel().load(std::memory_order_relaxed);
  if (kernel == 2 && M >= kAmxFrom) return product_int8_amx(q, M, w, K32, xs, y, how);
  if (M > 1 && kernel >= 1) return product_int8_vnni(q, M, w, K32, xs, y, how);
  const int8_t* weight = static_cast<const int8_t*>(w.data);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min(kRows, N - n0);
      const int8_t* block = weight + blk * kRows * K32;
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const int8_t* next = m0 == 0 && blk + 1 < end ? block + kRows * K32 : nullptr;
        if (M - m0 >= 2)
          block_int8<2>(q + m0 * K32, K32, block, next, n0, rows, xs + m0, w.scale, w.bias, y + m0 * N, N, how);
        else
          block_int8<1>(q + m0 * K32, K32, block, next, n0, rows, xs + m0, w.scale, w.bias, y + m0 * N, N, how);
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
