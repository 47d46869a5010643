// Attention over bfloat16 Q, K, V on AMX tiles for the ViT kernel's bfloat16 layers (encoder.cpp).
//
// At a ViT's ~200 positions torch's flash attention takes several times what its two products cost on the tiles. Here
// each (image, head) is one work item: Q copied, K^T and V packed as the B operand of tdpbf16ps ([pairs of k][16
// columns][2]), then per 32 query rows: the scores Q K^T in fp32 on tiles, the softmax in 16 lanes (e^x as 2^t with a
// polynomial and scalef), P rounded to bfloat16 as torch's is before its P V product, P V on tiles, each row divided
// by its sum and rounded to bfloat16. As with torch's, every image's result is its own whatever the batch (the
// bfloat16 tile encoder stays row-independent), and the values equal torch's up to the order of fp32 sums.
//
// Every buffer is 64-byte aligned: a tile row that straddles two cache lines costs two loads, and the tile loads
// here come from buffers the vector units have just written.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>

#include "amx_bf16.h"

namespace xattn {

// Per-thread buffers for one call's shape; the padding (rows and keys past S) is zeroed once and never written.
struct AttentionBuffers {
  int64_t S, hd, rows, keys;  // rows: S rounded up to 32 (query row pairs); keys: S rounded up to 32
  Lines<uint16_t> q;          // [rows][hd]
  Lines<uint16_t> kt;         // K^T as B tiles: [keys / 16 blocks][hd / 32 steps][16 pairs of d][16 keys][2]
  Lines<uint16_t> v;          // V as B tiles: [keys / 32 steps][hd / 16 blocks][16 pairs of keys][16 dims][2]
  Lines<uint16_t> p;          // P [32][keys] bfloat16 (keys past S zero)
  Lines<float> scores;        // [32][keys]
  Lines<float> out;           // [32][hd]
  AttentionBuffers(int64_t S_, int64_t hd_)
      : S(S_), hd(hd_), rows((S_ + 31) / 32 * 32), keys((S_ + 31) / 32 * 32), q(rows * hd), kt(keys * hd),
        v(keys * hd), p(32 * keys), scores(32 * keys), out(32 * hd) {}
};

// r[i] word j <- r[j] word i: 16 x 16 32-bit words.
XATTN_AVX512_BF16 inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows: words interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads: 64-bit halves interleaved
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: across the four quads
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// One head's Q, K and V (rows `stride` values apart) into the buffers' tile layouts.
XATTN_AVX512_BF16 inline void pack_head(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t stride,
                                        AttentionBuffers& b) {
  const int64_t S = b.S, hd = b.hd, words = hd / 2;
  for (int64_t s = 0; s < S; ++s) std::memcpy(b.q.data() + s * hd, q + s * stride, hd * 2);
  // K^T: word w (dims 2w, 2w + 1) of key s goes to block s / 16, step w / 16, pair w % 16, column s % 16: 16 keys'
  // 16 words at a time, a 16 x 16 transpose of 32-bit words (keys past S: zeros)
  uint32_t* kt = reinterpret_cast<uint32_t*>(b.kt.data());
  for (int64_t s0 = 0; s0 < S; s0 += 16)
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      __m512i r[16];
      for (int64_t n = 0; n < 16; ++n)
        r[n] = s0 + n < S ? _mm512_loadu_si512(k + (s0 + n) * stride + 2 * w0) : _mm512_setzero_si512();
      transpose16(r);
      uint32_t* block = kt + (s0 / 16) * words * 16 + (w0 / 16) * 256;
      for (int64_t w = 0; w < 16; ++w) _mm512_storeu_si512(block + w * 16, r[w]);
    }
  // V: keys s, s + 1 interleaved dim by dim: 32 dims of the pair give one 64-byte row of two dim blocks' tiles
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const int64_t blocks = hd / 16;
  for (int64_t s = 0; s < S; s += 2) {
    uint16_t* pair = b.v.data() + (s / 32) * blocks * 512 + (s % 32 / 2) * 32;
    for (int64_t d = 0; d < hd; d += 32) {
      const __m512i first = _mm512_loadu_si512(v + s * stride + d);
      const __m512i second = s + 1 < S ? _mm512_loadu_si512(v + (s + 1) * stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(pair + (d / 16) * 512, _mm512_permutex2var_epi16(first, low, second));
      _mm512_storeu_si512(pair + (d / 16 + 1) * 512, _mm512_permutex2var_epi16(first, high, second));
    }
  }
}

// Softmax of `rows` rows of scores (the first S of each row; `factor` = scale x log2 e) into P, bfloat16; the rows'
// 1 / sums into inverse. Four vectors at a time with their own maxima and sums: one chain through a row would wait
// on each max and add in turn.
XATTN_AVX512_BF16 inline void softmax_rows(AttentionBuffers& b, int64_t rows, float factor, float* inverse) {
  const int64_t S = b.S, full = S / 16 * 16, quads = S / 64 * 64;
  const __mmask16 tail = static_cast<__mmask16>((1u << (S - full)) - 1);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), c = _mm512_set1_ps(factor);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = b.scores.data() + r * b.keys;
    __m512 peak[4] = {lowest, lowest, lowest, lowest};
    int64_t s = 0;
    for (; s < quads; s += 64)
      for (int i = 0; i < 4; ++i) peak[i] = _mm512_max_ps(peak[i], _mm512_loadu_ps(row + s + 16 * i));
    for (; s < full; s += 16) peak[0] = _mm512_max_ps(peak[0], _mm512_loadu_ps(row + s));
    if (tail) peak[1] = _mm512_max_ps(peak[1], _mm512_mask_loadu_ps(lowest, tail, row + full));
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(peak[0], peak[1]),
                                                         _mm512_max_ps(peak[2], peak[3])));
    const __m512 shift = _mm512_set1_ps(-top * factor);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    uint16_t* p = b.p.data() + r * b.keys;
    auto exps = [&](int64_t at, int i) XATTN_AVX512_BF16 {
      const __m512 e = exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(row + at), c, shift));
      sum[i] = _mm512_add_ps(sum[i], e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + at), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    };
    for (s = 0; s < quads; s += 64)
      for (int i = 0; i < 4; ++i) exps(s + 16 * i, i);
    for (; s < full; s += 16) exps(s, 0);
    if (tail) {
      const __m512 e = exp2_16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, row + full), c, shift));
      sum[1] = _mm512_add_ps(sum[1], _mm512_maskz_mov_ps(tail, e));
      _mm256_mask_storeu_epi16(p + full, tail, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    const __m512 total = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
    inverse[r] = 1.f / _mm512_reduce_add_ps(total);
  }
}

// c [32 rows][32 columns] (rows ldc floats apart) = the sum over `steps` steps of A x [B0 B1]: A's 32 rows from a
// (lda values apart), 32 values further each step; B0, B1 the tiles at b0, b1, b_step values further each step.
XATTN_AVX512_BF16 inline void block_sums(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                                         int64_t b_step, int64_t steps, float* c, int64_t ldc) {
  XATTN_TILE_ZERO(4);
  XATTN_TILE_ZERO(5);
  XATTN_TILE_ZERO(6);
  XATTN_TILE_ZERO(7);
  for (int64_t s = 0; s < steps; ++s) {
    XATTN_TILE_LOAD(0, a + s * 32, lda * 2);
    XATTN_TILE_LOAD(1, a + 16 * lda + s * 32, lda * 2);
    XATTN_TILE_LOAD(2, b0 + s * b_step, 64);
    XATTN_TILE_LOAD(3, b1 + s * b_step, 64);
    XATTN_TILE_DOTS_BF16(4, 0, 2);
    XATTN_TILE_DOTS_BF16(5, 0, 3);
    XATTN_TILE_DOTS_BF16(6, 1, 2);
    XATTN_TILE_DOTS_BF16(7, 1, 3);
  }
  XATTN_TILE_STORE(4, c, ldc * 4);
  XATTN_TILE_STORE(5, c + 16, ldc * 4);
  XATTN_TILE_STORE(6, c + 16 * ldc, ldc * 4);
  XATTN_TILE_STORE(7, c + 16 * ldc + 16, ldc * 4);
}

// Items [begin, end) of B x H (image, head), each: ctx's rows of the image, the head's columns = attention.
XATTN_AVX512_BF16 inline void tile_attention_part(const uint16_t* qkv, int64_t S, int64_t H, int64_t hd, float scale,
                                                  uint16_t* ctx, int64_t begin, int64_t end) {
  const SquareTiles config;
  asm volatile("ldtilecfg %0" ::"m"(config) : "memory");
  AttentionBuffers b(S, hd);
  const int64_t D = H * hd, steps = hd / 32, keys = b.keys;
  const float factor = scale * kLog2e;
  alignas(64) float inverse[32];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t image = item / H, head = item % H;
    const uint16_t* base = qkv + image * S * 3 * D + head * hd;
    pack_head(base, base + D, base + 2 * D, 3 * D, b);
    for (int64_t r0 = 0; r0 < b.rows; r0 += 32) {
      const uint16_t* q0 = b.q.data() + r0 * hd;
      for (int64_t k0 = 0; k0 < keys; k0 += 32) {  // scores [32 rows][32 keys]: Q K^T over hd in steps of 32
        const uint16_t* kt0 = b.kt.data() + (k0 / 16) * steps * 512;
        block_sums(q0, hd, kt0, kt0 + steps * 512, 512, steps, b.scores.data() + k0, keys);
      }
      const int64_t rows = std::min<int64_t>(32, S - r0);
      softmax_rows(b, rows, factor, inverse);
      for (int64_t d0 = 0; d0 < hd; d0 += 32) {  // out [32 rows][32 dims]: P V over the keys in steps of 32
        const uint16_t* v0 = b.v.data() + (d0 / 16) * 512;
        block_sums(b.p.data(), keys, v0, v0 + 512, (hd / 16) * 512, keys / 32, b.out.data() + d0, hd);
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* y = ctx + (image * S + r0 + r) * D + head * hd;
        const __m512 inv = _mm512_set1_ps(inverse[r]);
        for (int64_t d = 0; d < hd; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
              _mm512_mul_ps(_mm512_loadu_ps(b.out.data() + r * hd + d), inv))));
      }
    }
  }
  asm volatile("tilerelease" ::: "memory");
}

// ctx [B * S, H * hd] = softmax(Q K^T * scale) V per image and head, Q, K, V read from qkv [B * S, 3 H hd], all
// bfloat16; hd a multiple of 32 (checked by the caller), a CPU with AMX-BF16.
inline void tile_attention(const uint16_t* qkv, int64_t B, int64_t S, int64_t H, int64_t hd, float scale,
                           uint16_t* ctx) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    tile_attention_part(qkv, S, H, hd, scale, ctx, begin, end);
  });
}

}  // namespace xattn
