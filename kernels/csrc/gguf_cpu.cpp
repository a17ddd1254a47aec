// GGUF-block weights (Q8_0, Q4_0, Q4_1) times float32 activations on the CPU, read straight from the
// file's blocks: out = x @ W.T + bias.
//
// A decode step reads each weight byte once, so it is memory-bound only if the arithmetic keeps up: the
// w8a16 kernel (w8a16_cpu.cpp) widens every weight to float32 and tops out near 6 GB/s here. This one
// quantizes the activation rows once per call to int8 blocks of 32 (the weights' blocks), and each block's
// product is an int8 x int8 dot product: AVX2 maddubs + madd (16-bit pair sums, 32-bit lane sums), or one
// dpbusd where compiled for AVX512-VNNI; the integer block sum is scaled by d_w * d_x and accumulated in
// float32. Q4_1's offset m contributes m_w * d_x * sum(q_x), from the row's block sums (Q4_0: m = -8 d).
//
// Layout and math: kernels/reference.py ``gguf_matmul`` (the spec); kernels/cpu.py wraps this as
// ``gguf_matmul``. Registered as torch.ops.pagedserve.gguf_matmul.
//
// Batched rows are compute-bound, where this kernel's int8 products ran at a third of oneDNN's bfloat16
// GEMM on an AVX512-BF16 CPU: gguf_dequantize_bf16 (below) widens a layer's blocks once, at load, into
// the bfloat16 matrix kernels/cpu.py multiplies those rows by.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;  // ggml's type ids
constexpr int64_t CHANNELS = 4;  // output channels per tile: independent accumulator chains, shared x loads
constexpr int64_t SCALE_CHUNK = 64;  // blocks whose scales are computed ahead at a time

inline float half_to_float(const at::Half h) {
#ifdef PAGEDSERVE_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// The activation rows as blocks of 32: q = round(x / d) (half to even, as torch.round), d = max|x| / 127,
// and xs = d * sum(q) for the offset term. Same float operations as the reference, so the same integers.
void quantize_rows(const float* x, int64_t blocks, int8_t* q, float* d, float* xs) {
  for (int64_t i = 0; i < blocks; ++i) {
    const float* v = x + i * BLOCK;
    float amax = 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float scale = amax / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < BLOCK; ++j) {
      const auto value = static_cast<int32_t>(std::nearbyint(v[j] * inverse));
      q[i * BLOCK + j] = static_cast<int8_t>(value);
      sum += value;
    }
    d[i] = scale;
    xs[i] = scale * static_cast<float>(sum);
  }
}

#ifdef PAGEDSERVE_AVX2
using pagedserve::hsum;

// Eight int32 lane sums of u (unsigned bytes) times s (signed bytes), four products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // Pair sums stay below 2^15: Q4 15 * 128 * 2, Q8_0 128 * 127 * 2.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One block's 32 weight values against the activation block xq, as eight int32 partial sums.
template <int64_t QTYPE>
inline __m256i block_dot(const uint8_t* w, __m256i xq) {
  if constexpr (QTYPE == Q8_0) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    // maddubs needs one unsigned side: |w| times x with w's sign moved onto it.
    return dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
  } else {
    // values 0..15 are the low nibbles, 16..31 the high ones (GGUF's order): the 16 bytes in both lanes,
    // the upper lane shifted down a nibble, then both masked.
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i both = _mm256_blend_epi32(bytes, _mm256_srli_epi16(bytes, 4), 0xF0);
    return dot_u8s8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), xq);
  }
}
#endif

// sum_b m_w[b] * xs[b] for one channel (Q4 offsets; Q4_0's m = -8 d, applied as -8 * sum d xs: exact).
template <int64_t QTYPE>
inline float offset_term(const at::Half* d, const at::Half* m, const float* xs, int64_t nb) {
  const at::Half* v = QTYPE == Q4_1 ? m : d;
  float sum = 0.f;
  int64_t b = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; b + 8 <= nb; b += 8) {
    const __m256 vf = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + b)));
    acc = _mm256_fmadd_ps(vf, _mm256_loadu_ps(xs + b), acc);
  }
  sum = hsum(acc);
#endif
  for (; b < nb; ++b) sum += half_to_float(v[b]) * xs[b];
  return QTYPE == Q4_0 ? -8.f * sum : sum;
}

// dots[c] = channel c's product with one quantized activation row, for C channels (rows of qs).
template <int64_t QTYPE, int64_t C>
inline void dot_tile(const uint8_t* qs, const at::Half* d, const at::Half* m, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xs, float* dots) {
  constexpr int64_t qbytes = QTYPE == Q8_0 ? 32 : 16;
  const int64_t row_bytes = nb * qbytes;
#ifdef PAGEDSERVE_AVX2
  __m256 acc[C];
  for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  // The blocks' d_w * d_x, eight at a time ahead of the dot products (one broadcast load per block there
  // instead of a scalar float16 conversion and multiply), for a chunk of SCALE_CHUNK blocks.
  alignas(32) float scale[C][SCALE_CHUNK];
  for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) {
    const int64_t chunk = std::min(SCALE_CHUNK, nb - b0);
    for (int64_t c = 0; c < C; ++c) {
      int64_t b = 0;
      for (; b + 8 <= chunk; b += 8) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + c * nb + b0 + b)));
        _mm256_store_ps(scale[c] + b, _mm256_mul_ps(dw, _mm256_loadu_ps(xd + b0 + b)));
      }
      for (; b < chunk; ++b) scale[c][b] = half_to_float(d[c * nb + b0 + b]) * xd[b0 + b];
    }
    for (int64_t i = 0; i < chunk; ++i) {
      const int64_t b = b0 + i;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * BLOCK));
      for (int64_t c = 0; c < C; ++c) {
        const __m256 sums = _mm256_cvtepi32_ps(block_dot<QTYPE>(qs + c * row_bytes + b * qbytes, x));
        acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale[c] + i), sums, acc[c]);
      }
    }
  }
  for (int64_t c = 0; c < C; ++c) dots[c] = hsum(acc[c]);
#else
  for (int64_t c = 0; c < C; ++c) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* w = qs + c * row_bytes + b * qbytes;
      const int8_t* x = xq + b * BLOCK;
      int32_t sum = 0;
      for (int64_t j = 0; j < BLOCK; ++j) {
        int32_t wj;
        if constexpr (QTYPE == Q8_0) wj = static_cast<int8_t>(w[j]);
        else wj = j < 16 ? (w[j] & 0x0F) : (w[j - 16] >> 4);
        sum += wj * x[j];
      }
      acc += half_to_float(d[c * nb + b]) * xd[b] * static_cast<float>(sum);
    }
    dots[c] = acc;
  }
#endif
  if constexpr (QTYPE != Q8_0)
    for (int64_t c = 0; c < C; ++c) dots[c] += offset_term<QTYPE>(d + c * nb, m ? m + c * nb : nullptr, xs, nb);
}

template <int64_t QTYPE>
void matmul(const float* x, const uint8_t* qs, const at::Half* d, const at::Half* m, const float* bias,
            int64_t rows, int64_t n, int64_t k, float* out) {
  constexpr int64_t qbytes = QTYPE == Q8_0 ? 32 : 16;
  const int64_t nb = k / BLOCK;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xd(rows * nb), xs(rows * nb);
  quantize_rows(x, rows * nb, xq.data(), xd.data(), xs.data());
  // Channels per task: ~16 KiB of blocks (in L1/L2 while every row passes over it), a multiple of the
  // tile, so two threads split even the smallest matrix.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, nb * qbytes) / CHANNELS) * CHANNELS;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float dots[CHANNELS];
    for (int64_t j = begin; j < end; j += CHANNELS) {
      const int64_t channels = std::min(CHANNELS, end - j);
      const uint8_t* w = qs + j * nb * qbytes;
      const at::Half* dj = d + j * nb;
      const at::Half* mj = m ? m + j * nb : nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* xr = xq.data() + r * k;
        const float *xdr = xd.data() + r * nb, *xsr = xs.data() + r * nb;
        if (channels == CHANNELS) {
          dot_tile<QTYPE, CHANNELS>(w, dj, mj, nb, xr, xdr, xsr, dots);
        } else {  // the last channels of a task
          for (int64_t c = 0; c < channels; ++c)
            dot_tile<QTYPE, 1>(w + c * nb * qbytes, dj + c * nb, mj ? mj + c * nb : nullptr, nb, xr, xdr, xsr,
                               dots + c);
        }
        for (int64_t c = 0; c < channels; ++c) out[r * n + j + c] = dots[c] + (bias ? bias[j + c] : 0.f);
      }
    }
  });
}

// float32 -> bfloat16 bits, rounded to nearest even as torch's .to(torch.bfloat16) (NaN stays a NaN).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen int32 values q as bfloat16 bits of d * q + m (two float32 roundings, then to nearest even).
inline __m256i dequantize16(__m512i q, __m512 d, __m512 m, bool offset) {
  __m512 v = _mm512_cvtepi32_ps(q);
  v = _mm512_mul_ps(v, d);
  if (offset) v = _mm512_add_ps(v, m);
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(bits);
}
#endif

// One block's 32 values d * q + m (m = 0 for Q8_0, -8 d for Q4_0) as bfloat16 bits. The product and the
// sum are two float32 roundings, as in reference.dequantize_gguf; fp-contract=off keeps the compiler from
// fusing them into one FMA (a different rounding, so other bfloat16 values now and then).
template <int64_t QTYPE>
__attribute__((optimize("fp-contract=off"))) inline void dequantize_block(const uint8_t* w, float d, float m,
                                                                          uint16_t* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  __m512i low, high;
  if constexpr (QTYPE == Q8_0) {
    low = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    high = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    high = _mm512_srli_epi32(bytes, 4);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), dequantize16(low, dv, mv, QTYPE != Q8_0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), dequantize16(high, dv, mv, QTYPE != Q8_0));
#else
  float values[BLOCK];
  for (int64_t j = 0; j < BLOCK; ++j) {
    int32_t q;
    if constexpr (QTYPE == Q8_0) q = static_cast<int8_t>(w[j]);
    else q = j < 16 ? (w[j] & 0x0F) : (w[j - 16] >> 4);
    values[j] = static_cast<float>(q) * d;
  }
  if constexpr (QTYPE != Q8_0)
    for (int64_t j = 0; j < BLOCK; ++j) values[j] = values[j] + m;
  for (int64_t j = 0; j < BLOCK; ++j) out[j] = to_bf16(values[j]);
#endif
}

template <int64_t QTYPE>
void dequantize(const uint8_t* qs, const at::Half* d, const at::Half* m, int64_t n, int64_t k, uint16_t* out) {
  constexpr int64_t qbytes = QTYPE == Q8_0 ? 32 : 16;
  const int64_t nb = k / BLOCK;
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / k), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = row * nb + b;
        const float scale = half_to_float(d[i]);
        const float offset = QTYPE == Q4_1 ? half_to_float(m[i]) : QTYPE == Q4_0 ? -8.f * scale : 0.f;
        dequantize_block<QTYPE>(qs + i * qbytes, scale, offset, out + i * BLOCK);
      }
  });
}

// A layer's blocks, checked against the layout (kernels/reference.py) with `op`'s name in the messages, and
// made contiguous; k < 0 takes K from qs's width.
struct Blocks {
  at::Tensor qs, scales, mins;  // mins: Q4_1 only
  int64_t n, nb;
};

Blocks checked_blocks(const char* op, const at::Tensor& qs, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t qtype, int64_t k) {
  TORCH_CHECK(qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1, op, ": block type must be Q8_0, Q4_0 or Q4_1");
  const int64_t qbytes = qtype == Q8_0 ? 32 : 16;
  TORCH_CHECK(qs.device().is_cpu() && qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) % qbytes == 0 &&
                  (k < 0 || qs.size(1) == k / BLOCK * qbytes),
              op, ": qs uint8 [N, K / 32 * block bytes]");
  const int64_t n = qs.size(0), nb = qs.size(1) / qbytes;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == n * nb, op, ": scales float16 [N, K / 32]");
  Blocks blocks{qs.contiguous(), scales.contiguous(), at::Tensor(), n, nb};
  if (qtype == Q4_1) {
    TORCH_CHECK(mins.has_value() && mins->defined() && mins->scalar_type() == at::kHalf && mins->numel() == n * nb,
                op, ": Q4_1 needs mins float16 [N, K / 32]");
    blocks.mins = mins->contiguous();
  }
  return blocks;
}

// The matrix [N, K] the blocks stand for, in bfloat16: kernels/cpu.py multiplies prefill-sized batches
// by it with oneDNN's bfloat16 GEMM. Spec: reference.dequantize_gguf(...).to(torch.bfloat16).
at::Tensor gguf_dequantize_bf16(const at::Tensor& qs, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                int64_t qtype) {
  const Blocks b = checked_blocks("gguf_dequantize_bf16", qs, scales, mins, qtype, -1);
  const int64_t k = b.nb * BLOCK;
  at::Tensor out = at::empty({b.n, k}, qs.options().dtype(at::kBFloat16));
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* w = b.qs.data_ptr<uint8_t>();
  const auto* d = b.scales.data_ptr<at::Half>();
  const at::Half* m = b.mins.defined() ? b.mins.data_ptr<at::Half>() : nullptr;
  if (qtype == Q8_0) dequantize<Q8_0>(w, d, m, b.n, k, out_ptr);
  else if (qtype == Q4_0) dequantize<Q4_0>(w, d, m, b.n, k, out_ptr);
  else dequantize<Q4_1>(w, d, m, b.n, k, out_ptr);
  return out;
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_matmul: x float32 [M, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % BLOCK == 0, "gguf_matmul: K must be a multiple of 32");
  const Blocks blocks = checked_blocks("gguf_matmul", qs, scales, mins, qtype, k);
  const int64_t n = blocks.n;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "gguf_matmul: bias float32 [N]");
    b = bias->contiguous();
  }
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({input.size(0), n}, input.options());
  const auto* d_ptr = blocks.scales.data_ptr<at::Half>();
  const at::Half* m_ptr = blocks.mins.defined() ? blocks.mins.data_ptr<at::Half>() : nullptr;
  const float* b_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* x_ptr = input.data_ptr<float>();
  const uint8_t* w_ptr = blocks.qs.data_ptr<uint8_t>();
  const int64_t rows = input.size(0);
  float* out_ptr = out.data_ptr<float>();
  if (qtype == Q8_0) matmul<Q8_0>(x_ptr, w_ptr, d_ptr, m_ptr, b_ptr, rows, n, k, out_ptr);
  else if (qtype == Q4_0) matmul<Q4_0>(x_ptr, w_ptr, d_ptr, m_ptr, b_ptr, rows, n, k, out_ptr);
  else matmul<Q4_1>(x_ptr, w_ptr, d_ptr, m_ptr, b_ptr, rows, n, k, out_ptr);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gguf_matmul(Tensor x, Tensor qs, Tensor scales, Tensor? mins, int qtype, Tensor? bias=None) -> Tensor");
  m.impl("gguf_matmul", c10::DispatchKey::CPU, TORCH_FN(gguf_matmul));
  m.def("gguf_dequantize_bf16(Tensor qs, Tensor scales, Tensor? mins, int qtype) -> Tensor");
  m.impl("gguf_dequantize_bf16", c10::DispatchKey::CPU, TORCH_FN(gguf_dequantize_bf16));
}
