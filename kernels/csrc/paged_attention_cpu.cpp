// Paged decode attention for CPUs: one query per sequence, reading the K/V blocks in place.
//
// The torch reference gathers every sequence's blocks into a padded batch before attending, which
// copies the whole context once more per layer; on a CPU that traffic is most of a decode step. Here
// each sequence walks its block table, so the cache is read once, block by block, and every query head
// uses each key and value row while it is in L1.
//
// A sliding window starts the walk at the block of the first visible key (HF's kv_idx > q_idx - window),
// so a long context costs its window; the blocks before it are never read (the KV cache manager may
// have freed them). A logit soft-cap (Gemma 2) squashes the scaled scores with tanh before the softmax.
//
// An FP8 cache (float8_e4m3fn, kv_cache_dtype="fp8") is read as cache * scale, as in kernels/reference.py:
// each block's visible rows are widened to float32 once, into a per-thread buffer that stays in L1, and
// every query head of the group reads them there (AVX2 has no FP8: three integer ops and F16C's float16
// widening per eight values, see widen16); k_scale joins the score scale and v_scale multiplies the
// output. Widening as the rows are loaded instead would redo it for each head of a GQA group: that
// measured 3x slower than float32.
//
// Registered as torch.ops.pagedserve.paged_attention_decode; kernels/cpu.py builds it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

struct Shape {
  int64_t num_heads, head_dim, block_size, num_kv_heads, group, max_blocks, token_stride, block_stride;
};

// An FP8 e4m3 (float8_e4m3fn) cache element, as its byte.
struct Fp8E4M3 {
  uint8_t bits;
};

// float32 of every e4m3 byte, for the scalar loops.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
      if ((b & 0x7F) == 0x7F) magnitude = std::numeric_limits<float>::quiet_NaN();  // e4m3fn's only NaN
      values[b] = (b & 0x80) ? -magnitude : magnitude;
    }
    return values;
  }();
  return table;
}


// An FP8 cache is widened to float32 times 2**-8 (kFp8Widened), which is exact: an e4m3 byte's bits, moved
// into float16's places, are its value times 2**-8 (subnormals included), and F16C widens those to float32
// in one instruction. The scales the caller folds in make up the 2**8: the scores' products and the
// outputs come out bit for bit as from the plain values (scaling by powers of two commutes with rounding,
// barring float32 underflow).
constexpr float kFp8Widened = 0x1p-8f;

#ifdef PAGEDSERVE_AVX2
// Sixteen e4m3 bytes as float32 times kFp8Widened; false (nothing written) if one is a NaN (0x7F/0xFF),
// which float16's places would turn into a number: the caller takes the table then.
inline bool widen16(const Fp8E4M3* p, float* out) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i seven_bits = _mm_set1_epi8(0x7F);
  if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(bytes, seven_bits), seven_bits))) return false;
  // Each byte into the high half of a 16-bit word (sign at bit 15, exponent and mantissa at bits 8-14);
  // an arithmetic shift by one puts exponent and mantissa at float16's bits 7-13 and copies the sign into
  // bit 14, which the mask clears.
  const __m128i zero = _mm_setzero_si128(), keep = _mm_set1_epi16(static_cast<int16_t>(0xBFFF));
  const __m128i low = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, bytes), 1), keep);
  const __m128i high = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, bytes), 1), keep);
  _mm256_storeu_ps(out, _mm256_cvtph_ps(low));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(high));
  return true;
}
#endif

// `count` consecutive cache elements as float32: a float32 cache as it is, FP8 widened into `buffer`
// (times kFp8Widened).
const float* as_float(const float* values, int64_t, std::vector<float>&) { return values; }

// n e4m3 values as float32 times kFp8Widened, through the table.
void widen_scalar(const Fp8E4M3* values, int64_t n, float* out) {
  const auto& table = fp8_table();
  for (int64_t i = 0; i < n; ++i) out[i] = table[values[i].bits] * kFp8Widened;
}

const float* as_float(const Fp8E4M3* values, int64_t count, std::vector<float>& buffer) {
  buffer.resize(count);
  float* out = buffer.data();
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  for (; i + 16 <= count; i += 16)
    if (!widen16(values + i, out + i)) widen_scalar(values + i, 16, out + i);
#endif
  widen_scalar(values + i, count - i, out + i);
  return out;
}

// Scores q . k * scale of one query head against `count` consecutive rows of a block.
void block_scores(const float* query, const float* key, int64_t count, const Shape& s, float scale,
                  float* out) {
  int64_t t = 0;
#ifdef PAGEDSERVE_AVX2
  if (s.head_dim % 8 == 0) {
    for (; t + 4 <= count; t += 4) {
      const float* k0 = key + t * s.token_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < s.head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(query + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + s.token_stride + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * s.token_stride + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * s.token_stride + d), a3);
      }
      // Four horizontal sums at once.
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(out + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
  }
#endif
  for (; t < count; ++t) {
    const float* k = key + t * s.token_stride;
    float acc = 0.f;
    for (int64_t d = 0; d < s.head_dim; ++d) acc += query[d] * k[d];
    out[t] = acc * scale;
  }
}

#ifdef PAGEDSERVE_AVX2
// exp for x <= 0 (softmax after subtracting the max). Below -87 the result is flushed to 0: those
// weights are far below float32 resolution next to the max's 1, and denormal products would stall.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, pagedserve::exp256(x));
}
#endif

// In place: row <- softmax(row).
void softmax(float* row, int64_t n) {
  const float peak = *std::max_element(row, row + n);
  int64_t i = 0;
  float total = 0.f;
#ifdef PAGEDSERVE_AVX2
  const __m256 peak_v = _mm256_set1_ps(peak);
  __m256 total_v = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), peak_v));
    _mm256_storeu_ps(row + i, e);
    total_v = _mm256_add_ps(total_v, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total_v);
  for (float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - peak);
    total += row[i];
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

// out[0:head_dim] += sum over `count` value rows of weights[t] * value[t].
void accumulate_values(const float* weights, const float* value, int64_t count, const Shape& s, float* out) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  // 64 output dims stay in eight registers across the block's rows.
  for (; d + 64 <= s.head_dim; d += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_loadu_ps(out + d + 8 * j);
    for (int64_t t = 0; t < count; ++t) {
      const __m256 w = _mm256_set1_ps(weights[t]);
      const float* v = value + t * s.token_stride + d;
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + d + 8 * j, acc[j]);
  }
  // The rest eight at a time (head_dim 80, 96, or the tests' 16): left to the scalar loop below, whose
  // strided reads do not vectorize, it cost most of a small model's step.
  for (; d + 8 <= s.head_dim; d += 8) {
    __m256 acc = _mm256_loadu_ps(out + d);
    for (int64_t t = 0; t < count; ++t)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[t]), _mm256_loadu_ps(value + t * s.token_stride + d), acc);
    _mm256_storeu_ps(out + d, acc);
  }
#endif
  for (; d < s.head_dim; ++d) {
    float acc = out[d];
    for (int64_t t = 0; t < count; ++t) acc += weights[t] * value[t * s.token_stride + d];
    out[d] = acc;
  }
}

// Blocks are requested this far ahead of use, since a block's successor in the table need not be its
// neighbour in memory. (One block ahead measured the same within this machine's noise; four cost nothing.)
constexpr int64_t kPrefetchBlocks = 4;

template <typename T>
void prefetch_block(const T* cache, const int32_t* table, int64_t b, int64_t num_blocks, const Shape& s) {
  if (b >= num_blocks) return;
  const T* block = cache + table[b] * s.block_stride;
  for (int64_t i = 0; i < s.block_stride; i += 64 / sizeof(T)) __builtin_prefetch(block + i);  // a line each
}

// In place: row <- tanh(row / cap) * cap.
void softcap_row(float* row, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) row[i] = std::tanh(row[i] * inv) * cap;
}

// The first key position the query at context_len - 1 sees; window <= 0 means no window.
int64_t first_visible(int64_t context_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(context_len - window, 0) : 0;
}

// One sequence: every query head attends over its visible keys, positions [lo, context_len). Heads are
// the inner loop so each block's K (then V) is read as one contiguous stream. Scores are indexed from
// lo; the walk covers blocks first_block .. num_blocks - 1 of the table.
// scale includes k_scale; v_scale multiplies the outputs at the end (1 for a float32 cache).
template <typename T>
void attend(const float* queries, const T* k_cache, const T* v_cache, const int32_t* table,
            int64_t context_len, const Shape& s, float scale, float v_scale, int64_t window, float softcap,
            std::vector<float>& scores, std::vector<float>& rows_buffer, float* outs) {
  std::fill(outs, outs + s.num_heads * s.head_dim, 0.f);
  if (context_len <= 0) return;
  const int64_t lo = first_visible(context_len, window), span = context_len - lo;
  scores.resize(s.num_heads * span);
  const int64_t first_block = lo / s.block_size, num_blocks = (context_len + s.block_size - 1) / s.block_size;
  // Rows [begin, end) of block b that are visible, as positions.
  auto rows = [&](int64_t b) {
    return std::pair<int64_t, int64_t>{std::max(b * s.block_size, lo), std::min((b + 1) * s.block_size, context_len)};
  };
  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b) prefetch_block(k_cache, table, b, num_blocks, s);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    prefetch_block(k_cache, table, b + kPrefetchBlocks, num_blocks, s);
    const auto [begin, end] = rows(b);
    const float* block = as_float(k_cache + table[b] * s.block_stride + (begin - b * s.block_size) * s.token_stride,
                                  (end - begin) * s.token_stride, rows_buffer);
    for (int64_t h = 0; h < s.num_heads; ++h)
      block_scores(queries + h * s.head_dim, block + (h / s.group) * s.head_dim, end - begin, s, scale,
                   scores.data() + h * span + (begin - lo));
  }
  for (int64_t b = first_block; b < first_block + kPrefetchBlocks; ++b) prefetch_block(v_cache, table, b, num_blocks, s);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    if (softcap > 0.f) softcap_row(scores.data() + h * span, span, softcap);
    softmax(scores.data() + h * span, span);
  }
  for (int64_t b = first_block; b < num_blocks; ++b) {
    prefetch_block(v_cache, table, b + kPrefetchBlocks, num_blocks, s);
    const auto [begin, end] = rows(b);
    const float* block = as_float(v_cache + table[b] * s.block_stride + (begin - b * s.block_size) * s.token_stride,
                                  (end - begin) * s.token_stride, rows_buffer);
    for (int64_t h = 0; h < s.num_heads; ++h)
      accumulate_values(scores.data() + h * span + (begin - lo), block + (h / s.group) * s.head_dim, end - begin,
                        s, outs + h * s.head_dim);
  }
  if (v_scale != 1.f)
    for (int64_t i = 0; i < s.num_heads * s.head_dim; ++i) outs[i] *= v_scale;
}

// Every sequence, longest contexts first, handed out one at a time so that threads finish together.
template <typename T>
void attend_all(const float* q_ptr, const T* k_ptr, const T* v_ptr, const int32_t* table_ptr,
                const int32_t* len_ptr, int64_t num_seqs, const Shape& s, float scale, float v_scale,
                int64_t sliding_window, float softcap, float* out_ptr) {
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_seqs);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, rows_buffer;
    for (int64_t i = next.fetch_add(1); i < num_seqs; i = next.fetch_add(1)) {
      const int64_t seq = order[i];
      attend(q_ptr + seq * s.num_heads * s.head_dim, k_ptr, v_ptr, table_ptr + seq * s.max_blocks, len_ptr[seq], s,
             scale, v_scale, sliding_window, softcap, scores, rows_buffer, out_ptr + seq * s.num_heads * s.head_dim);
    }
  });
}

// q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32 (each >= 1); sliding_window
// and logit_softcap 0 for none; k_scale and v_scale apply to an FP8 cache only.
at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale, int64_t sliding_window, double logit_softcap, double k_scale,
                                  double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "pagedserve CPU attention: CPU tensors only");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(q.scalar_type() == at::kFloat && (fp8 || k_cache.scalar_type() == at::kFloat) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "pagedserve CPU attention: float32 queries, float32 or float8_e4m3fn caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "pagedserve CPU attention: int32 block tables and context lengths");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "pagedserve CPU attention: contiguous caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "pagedserve CPU attention: shapes do not follow the kernel contract");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0,
              "pagedserve CPU attention: sliding_window and logit_softcap are positive, or 0 for none");
  const at::Tensor query = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  Shape s;
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  s.block_size = k_cache.size(1);
  s.num_kv_heads = k_cache.size(2);
  s.group = s.num_heads / s.num_kv_heads;
  s.max_blocks = tables.size(1);
  s.token_stride = s.num_kv_heads * s.head_dim;
  s.block_stride = s.block_size * s.token_stride;
  const int64_t num_seqs = query.size(0);
  at::Tensor out = at::empty_like(query);
  const float* q_ptr = query.data_ptr<float>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(logit_softcap);

  // A bad table would read outside the cache: refuse it here, as the reference's indexing would.
  const int64_t cache_blocks = k_cache.size(0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t used = (len_ptr[seq] + s.block_size - 1) / s.block_size;
    TORCH_CHECK(len_ptr[seq] >= 0 && used <= s.max_blocks,
                "paged_attention_decode: context longer than its block table");
    // Only the blocks read: those before the window may be placeholders.
    for (int64_t b = first_visible(len_ptr[seq], sliding_window) / s.block_size; b < used; ++b) {
      const int32_t block = table_ptr[seq * s.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < cache_blocks, "paged_attention_decode: block id out of range");
    }
  }
  if (fp8) {
    const float widened = 1.f / kFp8Widened;
    attend_all(q_ptr, static_cast<const Fp8E4M3*>(k_cache.data_ptr()), static_cast<const Fp8E4M3*>(v_cache.data_ptr()),
               table_ptr, len_ptr, num_seqs, s, fscale * static_cast<float>(k_scale) * widened,
               static_cast<float>(v_scale) * widened, sliding_window, fsoftcap, out_ptr);
  } else {
    attend_all(q_ptr, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table_ptr, len_ptr, num_seqs, s, fscale,
               1.f, sliding_window, fsoftcap, out_ptr);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int sliding_window=0, float logit_softcap=0., float k_scale=1., "
        "float v_scale=1.) -> Tensor");
  m.impl("paged_attention_decode", c10::DispatchKey::CPU, TORCH_FN(paged_attention_decode));
}
