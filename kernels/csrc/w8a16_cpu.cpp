// Weight-only INT8 matmul for float32 activations on the CPU: out = x @ (weight * scale[:, None]).T + bias.
//
// A decode step is memory-bound: each weight byte is read once per step, so reading int8 instead of
// float32 is up to 4x fewer bytes. The int8 row is widened to float32 in registers (never written
// back), and a tile of ROWS activation rows x CHANNELS output channels shares each widened weight
// vector and each activation load; with more rows than a tile, each weight tile is widened once into an
// L1 buffer that every row tile reads. For many rows (prefill) the step is compute-bound and
// kernels/cpu.py dequantizes the matrix once and calls the fp32 GEMM instead.
//
// Registered as torch.ops.pagedserve.w8a16_matmul; kernels/cpu.py builds it, kernels/reference.py
// ``w8a16_matmul`` is its spec.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t CHANNELS = 4;  // output channels per tile: independent FMA chains hide FMA latency
constexpr int64_t ROWS = 3;      // activation rows per tile, sharing each widened weight vector

#ifdef PAGEDSERVE_AVX2
using pagedserve::hsum;

inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
#endif

// dots[r][c] = sum_k x[r][k] * w[c][k] for R rows and C channels (unrolled: the accumulators stay in
// registers), before the scale. W: int8 (widened in registers) or float (a tile widened once).
template <int64_t R, int64_t C, typename W>
inline void dot_tile(const float* x, const W* w, int64_t k, float (&dots)[ROWS][CHANNELS]) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    __m256 wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = load8(w + c * k + i);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) dots[r][c] = hsum(acc[r][c]);
#else
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) dots[r][c] = 0.f;
#endif
  for (; i < k; ++i)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) dots[r][c] += x[r * k + i] * static_cast<float>(w[c * k + i]);
}

template <int64_t R, typename W>
inline void dot_rows(const float* x, const W* w, int64_t k, int64_t channels, float (&dots)[ROWS][CHANNELS]) {
  if (channels == CHANNELS) {
    dot_tile<R, CHANNELS, W>(x, w, k, dots);
  } else {  // the last channels of a task
    float one[ROWS][CHANNELS];
    for (int64_t c = 0; c < channels; ++c) {
      dot_tile<R, 1, W>(x, w + c * k, k, one);
      for (int64_t r = 0; r < R; ++r) dots[r][c] = one[r][0];
    }
  }
}

at::Tensor w8a16_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "w8a16_matmul: x float32 [M, K]");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == x.size(1),
              "w8a16_matmul: weight int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), "w8a16_matmul: scale float32 [N]");
  const at::Tensor input = x.contiguous(), w = weight.contiguous(), s = scale.contiguous();
  const int64_t m = input.size(0), k = input.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "w8a16_matmul: bias float32 [N]");
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({m, n}, input.options());
  const float *x_ptr = input.data_ptr<float>(), *s_ptr = s.data_ptr<float>();
  const float* b_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  const int8_t* w_ptr = w.data_ptr<int8_t>();
  float* out_ptr = out.data_ptr<float>();
  // Output channels per task: ~32 KiB of weights (stays in L2 while every row tile passes over it), a
  // multiple of the tile, so two threads split even the smallest matrix.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k) / CHANNELS) * CHANNELS;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float dots[ROWS][CHANNELS];
    // More rows than one tile: widen each weight tile once into this L1-sized buffer, then every row
    // tile reads floats (else each row tile would widen the same int8 values again).
    std::vector<float> widened(m > ROWS ? CHANNELS * k : 0);
    for (int64_t j = begin; j < end; j += CHANNELS) {
      const int64_t channels = std::min(CHANNELS, end - j);
      const int8_t* w_rows = w_ptr + j * k;
      if (m > ROWS) {
        for (int64_t i = 0; i < channels * k; ++i) widened[i] = static_cast<float>(w_rows[i]);
      }
      for (int64_t row0 = 0; row0 < m; row0 += ROWS) {
        const int64_t rows = std::min(ROWS, m - row0);
        const float* x_rows = x_ptr + row0 * k;
        if (m > ROWS) {
          const float* f_rows = widened.data();
          if (rows == 3) dot_rows<3>(x_rows, f_rows, k, channels, dots);
          else if (rows == 2) dot_rows<2>(x_rows, f_rows, k, channels, dots);
          else dot_rows<1>(x_rows, f_rows, k, channels, dots);
        } else if (rows == 3) dot_rows<3>(x_rows, w_rows, k, channels, dots);
        else if (rows == 2) dot_rows<2>(x_rows, w_rows, k, channels, dots);
        else dot_rows<1>(x_rows, w_rows, k, channels, dots);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < channels; ++c)
            out_ptr[(row0 + r) * n + j + c] = dots[r][c] * s_ptr[j + c] + (b_ptr ? b_ptr[j + c] : 0.f);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("w8a16_matmul(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("w8a16_matmul", c10::DispatchKey::CPU, TORCH_FN(w8a16_matmul));
}
