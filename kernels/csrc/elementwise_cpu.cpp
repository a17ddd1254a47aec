// RMSNorm, residual add + RMSNorm, SiLU-and-mul and rotary embedding for float32 CPU tensors.
//
// At decode batch sizes each of these is a few microseconds of arithmetic, but the torch references
// run five to ten ATen ops apiece (~100 us per call, ~14 ms per decode step of the embedded model);
// one pass per row here.
//
// Registered as torch.ops.pagedserve.*; kernels/cpu.py builds them and keeps the references
// for other dtypes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// Rows per task: enough work that thread hand-off does not dominate.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "pagedserve CPU ", name, ": float32 CPU only");
}

// out = x / sqrt(mean(x^2) + eps) * weight, for one row.
inline void normalize_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm");
  check_float(weight, "rms_norm");
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  const int64_t n = input.size(-1), rows = input.numel() / std::max<int64_t>(1, n);
  at::Tensor out = at::empty_like(input);
  const float *x_ptr = input.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(x_ptr + r * n, w_ptr, eps, n, out_ptr + r * n);
  });
  return out;
}

// (rms_norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_float(x, "fused_add_rms_norm");
  check_float(residual, "fused_add_rms_norm");
  check_float(weight, "fused_add_rms_norm");
  const at::Tensor input = x.contiguous(), res = residual.contiguous(), w = weight.contiguous();
  const int64_t n = input.size(-1), rows = input.numel() / std::max<int64_t>(1, n);
  at::Tensor summed = at::empty_like(input), out = at::empty_like(input);
  const float *x_ptr = input.data_ptr<float>(), *r_ptr = res.data_ptr<float>(), *w_ptr = w.data_ptr<float>();
  float *sum_ptr = summed.data_ptr<float>(), *out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = sum_ptr + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = x_ptr[r * n + i] + r_ptr[r * n + i];
      normalize_row(row, w_ptr, eps, n, out_ptr + r * n);
    }
  });
  return {out, summed};
}

// Row elements for silu_and_mul_row: float32 values as they are, bfloat16 ones (their bits, uint16_t)
// widened to float32 on load and rounded to nearest even on store, as torch's .to(torch.bfloat16) rounds.
inline float to_float(float value) { return value; }

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

template <typename T>
T from_float(float value);

template <>
inline float from_float<float>(float value) {
  return value;
}

template <>
inline uint16_t from_float<uint16_t>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#ifdef PAGEDSERVE_AVX2
// Eight floats' bfloat16 bits (rounded as from_float<uint16_t>), one per 32-bit lane.
inline __m256i bf16_bits(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bits),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(uint16_t* p, __m256 v) {
  // packus works within 128-bit lanes: the two lanes' four words land in quadwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v), bf16_bits(v)), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// Eight floats rounded to T and widened back.
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
#endif

// silu(x[..., :d]) * x[..., d:] for one row, as reference.silu_and_mul computes it in T: F.silu's result
// rounded to T, then the product (nothing to round in float32). In bfloat16 for kernels/cpu.py's bfloat16
// gate/up products, whose rows go on to the down product's with no float32 copy either side.
template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, int64_t d, T* o) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
  for (; i + 8 <= d; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, pagedserve::exp256(_mm256_sub_ps(zero, g))));
    store8(o + i, _mm256_mul_ps(round8<T>(sig), load8(up + i)));
  }
#endif
  for (; i < d; ++i) {
    const float g = to_float(gate[i]);
    o[i] = from_float<T>(to_float(from_float<T>(g / (1.f + std::exp(-g)))) * to_float(up[i]));
  }
}

// silu(x[..., :d]) * x[..., d:], float32 or bfloat16
at::Tensor silu_and_mul(const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat),
              "pagedserve CPU silu_and_mul: float32 or bfloat16 CPU only");
  const at::Tensor input = x.contiguous();
  const int64_t width = input.size(-1), d = width / 2, rows = input.numel() / std::max<int64_t>(1, width);
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: the last dimension must be even");
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = d;
  at::Tensor out = at::empty(shape, input.options());
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bf16) {
        const auto* gate = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>()) + r * width;
        silu_and_mul_row(gate, gate + d, d, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + r * d);
      } else {
        const float* gate = input.data_ptr<float>() + r * width;
        silu_and_mul_row(gate, gate + d, d, out.data_ptr<float>() + r * d);
      }
    }
  });
  return out;
}

// Neox (rotate-half) rotary embedding of every head of one token.
inline void rotate_heads(const float* in, float* out, int64_t heads, int64_t head_dim, const float* cos,
                         const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float *x1 = in + h * head_dim, *x2 = x1 + half;
    float *o1 = out + h * head_dim, *o2 = o1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
      o2[i] = x2[i] * cos[i] + x1[i] * sin[i];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  check_float(q, "apply_rotary");
  check_float(k, "apply_rotary");
  check_float(cos_sin_cache, "apply_rotary");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), cache = cos_sin_cache.contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t tokens = qc.size(0), q_heads = qc.size(1), k_heads = kc.size(1), head_dim = qc.size(2);
  TORCH_CHECK(cache.size(1) == head_dim, "apply_rotary: cos_sin_cache width must equal head_dim");
  at::Tensor q_out = at::empty_like(qc), k_out = at::empty_like(kc);
  const float *q_ptr = qc.data_ptr<float>(), *k_ptr = kc.data_ptr<float>(), *c_ptr = cache.data_ptr<float>();
  const int64_t* p_ptr = pos.data_ptr<int64_t>();
  float *qo_ptr = q_out.data_ptr<float>(), *ko_ptr = k_out.data_ptr<float>();
  const int64_t max_position = cache.size(0);
  at::parallel_for(0, tokens, grain((q_heads + k_heads) * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(p_ptr[t] >= 0 && p_ptr[t] < max_position, "apply_rotary: position out of range");
      const float* cos = c_ptr + p_ptr[t] * head_dim;
      const float* sin = cos + head_dim / 2;
      rotate_heads(q_ptr + t * q_heads * head_dim, qo_ptr + t * q_heads * head_dim, q_heads, head_dim, cos, sin);
      rotate_heads(k_ptr + t * k_heads * head_dim, ko_ptr + t * k_heads * head_dim, k_heads, head_dim, cos, sin);
    }
  });
  return {q_out, k_out};
}

// The threads at::parallel_for runs these kernels on: torch's thread count where this file was built with
// OpenMP, 1 where it was not (the pragmas then compile to nothing). tests/kernels/test_cpu_kernels.py.
int64_t parallel_workers() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("apply_rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin_cache) -> (Tensor, Tensor)");
  m.def("parallel_workers() -> int");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(fused_add_rms_norm));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.impl("apply_rotary", c10::DispatchKey::CPU, TORCH_FN(apply_rotary));
  m.impl("parallel_workers", c10::DispatchKey::CatchAll, TORCH_FN(parallel_workers));
}
