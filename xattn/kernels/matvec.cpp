// Matrix-vector products for decode steps (a few rows of activations against a whole weight matrix), AVX2 + FMA.
//
// A decode step at batch 1-4 streams every weight once, so its speed is memory bandwidth. These kernels walk 8
// weight rows at a time with a software prefetch of the next block, on torch's own thread pool, and reach the
// bandwidth of a plain sum over the same bytes; oneDNN's and fbgemm's general kernels stop short of it there.
// Weights are [N, K] row-major (nn.Linear's layout). `matvec`: fp32. `matvec_int8`: int8 weights with one fp32
// scale per row; each activation row is quantized to int8 (symmetric, one scale per row) and bytes are
// multiplied with vpmaddubsw, x's sign moved onto w so that |x| can be the unsigned operand.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>
#include <torch/library.h>

namespace {

constexpr int64_t kRows = 8;  // weight rows per block
constexpr int64_t kMaxM = 4;  // activation rows handled per pass over a block

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] = sum_k x[m, k] w[n, k] + bias[n], for m < M (M <= kMaxM), n in [n0, n0 + rows)
template <int M>
void block(const float* x, int64_t K, const float* w, int64_t n0, int64_t rows, const float* bias, float* y,
           int64_t N) {
  __m256 acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  const float* base = w + n0 * K;
  for (int64_t k = 0; k < k8; k += 8) {
    if (k % 16 == 0)  // one cache line of each row of the next block
      for (int r = 0; r < kRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(base + (kRows + r) * K + k), _MM_HINT_T0);
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int r = 0; r < kRows; ++r) {
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
      y[m * N + n] = sum;
    }
  }
}

void run(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows, rows = std::min(kRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N;
        switch (std::min(kMaxM, M - m0)) {
          case 1: block<1>(xm, K, w, n0, rows, bias, ym, N); break;
          case 2: block<2>(xm, K, w, n0, rows, bias, ym, N); break;
          case 3: block<3>(xm, K, w, n0, rows, bias, ym, N); break;
          default: block<4>(xm, K, w, n0, rows, bias, ym, N); break;
        }
      }
    }
  });
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "weight must be a contiguous float32 [N, K] tensor");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's K");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  run(x2.data_ptr<float>(), x2.size(0), K, weight.data_ptr<float>(), N,
      bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y.view(shape);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// int32 dot products of quantized rows xq[m] (|xq| <= 127) with int8 weight rows [n0, n0 + rows), kRows at a time:
// |x| (unsigned) times w with x's sign moved onto it; pairs of products (<= 2 * 127 * 127) fit int16.
template <int M>
void block_int8(const int8_t* xq, int64_t K, const int8_t* w, int64_t n0, int64_t rows, const float* x_scale,
                const float* scale, const float* bias, float* y, int64_t N) {
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
      y[m * N + n] = out;
    }
  }
}

at::Tensor matvec_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar,
              "weight must be a contiguous int8 [N, K] tensor");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's K");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  // each activation row to int8, symmetric: one scale per row (a plain loop: a few ATen ops per call would
  // cost more than the product at one row)
  std::vector<int8_t> xq(M * K);
  std::vector<float> x_scale(M);
  const float* xf = x2.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(xf[m * K + k]));
    x_scale[m] = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / x_scale[m];
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int8_t>(std::nearbyint(xf[m * K + k] * inv));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* q = xq.data();
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* xs = x_scale.data();
  const float* s = scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min(kRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2)
          block_int8<2>(q + m0 * K, K, w, n0, rows, xs + m0, s, b, out + m0 * N, N);
        else
          block_int8<1>(q + m0 * K, K, w, n0, rows, xs + m0, s, b, out + m0 * N, N);
      }
    }
  });
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(xattn_kernels, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(xattn_kernels, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("matvec_int8", &matvec_int8);
}
