// AVX2 + FMA + F16C kernels: the baseline every supported x86-64 CPU runs. This file: float
// weights (F32, F16, BF16), the activation quantizers, attention and the row arithmetic; the
// quantized weight types are in kernels_avx2_quantized.cpp.
//
// A float weight row is dotted with up to 4 activation rows per pass (gemm tiles rows x tokens
// over it); vec_dot is gemm on one row and one token. Results differ from the reference only in
// float summation order.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "kernels/simd_common.h"
#include "kernels/token_count.h"

namespace microspec {

namespace {


inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// ---------------------------------------------------------------------------------------------
// Float weights against f32 activations

// Element formats of the float weight types: 8 at a time, or one.
struct F32Elems {
  using T = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float load1(const float* p) { return *p; }
};
struct F16Elems {
  using T = fp16_t;
  static __m256 load8(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float load1(const fp16_t* p) { return h2f(*p); }
};
struct BF16Elems {
  using T = uint16_t;
  static __m256 load8(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static float load1(const uint16_t* p) { return bf16_to_fp32(*p); }
};

// Most tokens one call of a float row kernel takes: two accumulators per token.
constexpr int64_t kFloatTokens = 4;

template <class E>
struct FloatKernel {
  template <int NT>
  static void dot(const void* w, const float* const* y, int64_t n, float* s) {
    const auto* x = static_cast<const typename E::T*>(w);
    __m256 acc0[NT], acc1[NT];
    for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256 w0 = E::load8(x + i), w1 = E::load8(x + i + 8);
      for (int t = 0; t < NT; ++t) {
        acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(y[t] + i), acc0[t]);
        acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(y[t] + i + 8), acc1[t]);
      }
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 w0 = E::load8(x + i);
      for (int t = 0; t < NT; ++t) acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(y[t] + i), acc0[t]);
    }
    for (int t = 0; t < NT; ++t) {
      float sum = hsum(_mm256_add_ps(acc0[t], acc1[t]));
      for (int64_t j = i; j < n; ++j) sum += E::load1(x + j) * y[t][j];
      s[t] = sum;
    }
  }
};

using F32Kernel = FloatKernel<F32Elems>;
using F16Kernel = FloatKernel<F16Elems>;
using BF16Kernel = FloatKernel<BF16Elems>;

// Rows in blocks of 8 so a block's weights stay in L1 while every group of up to 4 tokens passes
// over it; up to 4 tokens, each weight row is streamed once.
template <class K>
void gemm(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
          size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  constexpr int64_t kRowBlock = 8;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
    const int64_t r1 = r0 + kRowBlock < n_rows ? r0 + kRowBlock : n_rows;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kFloatTokens) {
      const int64_t g = n_tokens - t0 < kFloatTokens ? n_tokens - t0 : kFloatTokens;
      const float* rows[kFloatTokens];
      for (int64_t i = 0; i < g; ++i) rows[i] = reinterpret_cast<const float*>(ab + size_t(t0 + i) * act_stride);
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = wb + size_t(row_ids ? row_ids[r] : r) * w_stride;
        float s[kFloatTokens] = {};
        with_token_count(g, [&]<int NT>() {
          if constexpr (NT <= kFloatTokens) K::template dot<NT>(row, rows, n, s);
        });
        for (int64_t i = 0; i < g; ++i) out[(t0 + i) * ldo + r] = s[i];
      }
    }
  }
}

template <class K>
float vec_dot(const void* w, const void* a, int64_t n) {
  float s;
  gemm<K>(w, 0, nullptr, 1, a, 0, 1, n, &s, 1);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Activation quantization (bit-identical to the reference: same scale, round half to even)

// 32 floats -> absmax and the four int32 vectors of round(x * id) after the scale is known.
inline __m256 abs_ps(__m256 v) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Rounds 32 floats times id to int32 (half to even) and packs them to 32 int8 in order.
inline __m256i round_pack32(const float* x, __m256 id, __m256i* i32) {
  for (int k = 0; k < 4; ++k) i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id));
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  // The packs interleave 128-bit lanes: restore element order.
  return _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float absmax32(const float* x) {
  __m256 m = abs_ps(_mm256_loadu_ps(x));
  for (int k = 1; k < 4; ++k) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8 * k)));
  return hmax(m);
}

void quantize_q8_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const float d = absmax32(x) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i i32[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), round_pack32(x, _mm256_set1_ps(id), i32));
    y[b].d = fp32_to_fp16(d);
  }
}

void quantize_q8_1(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_1*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const float d = absmax32(x) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i i32[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), round_pack32(x, _mm256_set1_ps(id), i32));
    const int sum =
        hsum_i32x8(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
    y[b].d = fp32_to_fp16(d);
    y[b].s = fp32_to_fp16(float(sum) * d);
  }
}

void quantize_q8_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(out);
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < kQKK; k += 8) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + k)));
    const float amax = hmax(m);
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    // The first element of largest magnitude, with its sign (as the reference picks it).
    float max = 0.0f;
    const __m256 vmax = _mm256_set1_ps(amax);
    for (int k = 0; k < kQKK; k += 8) {
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + k)), vmax, _CMP_EQ_OQ));
      if (mask) {
        max = x[k + __builtin_ctz(unsigned(mask))];
        break;
      }
    }
    const float iscale = -127.0f / max;
    const __m256 vs = _mm256_set1_ps(iscale);
    for (int k = 0; k < kQKK; k += 32) {
      __m256i i32[4];
      // packs saturates at 127, which is the reference's min(127, q).
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + k), round_pack32(x + k, vs, i32));
      y[b].bsums[k / 16] = int16_t(hsum_i32x8(_mm256_add_epi32(i32[0], i32[1])));
      y[b].bsums[k / 16 + 1] = int16_t(hsum_i32x8(_mm256_add_epi32(i32[2], i32[3])));
    }
    y[b].d = 1.0f / iscale;
  }
}

void quantize_f32(const float* x, void* out, int64_t n) {
  std::memcpy(out, x, size_t(n) * sizeof(float));
}

// --- attention on half floats, in the reference's order (kernels.h) ---------------------------

inline __m256 load_f16x8(const fp16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

void f16_round(const float* x, fp16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

void f16_widen(const fp16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, load_f16x8(x + i));
}

// Blocks of up to NR query rows: each key (value) row is widened once for all of them; every
// row's arithmetic is f16_dot_reference's (f16_axpy_reference's) exactly.
template <int NR>
void scores_rows(const float* q, int64_t ldq, const fp16_t* k, int64_t k_stride, int32_t n_keys, int64_t n,
                 float* out, int64_t ldo) {
  for (int32_t j = 0; j < n_keys; ++j) {
    const fp16_t* kj = k + j * k_stride;
    __m256 acc0[NR], acc1[NR];  // lanes 0..7 and 8..15 of each row
    for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256 k0 = load_f16x8(kj + i), k1 = load_f16x8(kj + i + 8);
      for (int r = 0; r < NR; ++r) {
        acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + i), k0, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + i + 8), k1, acc1[r]);
      }
    }
    for (; i < n; i += 8) {
      const __m256 k0 = load_f16x8(kj + i);
      for (int r = 0; r < NR; ++r) acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + i), k0, acc0[r]);
    }
    for (int r = 0; r < NR; ++r) out[r * ldo + j] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
  }
}

// Keys in blocks of kValueBlock so that a block's value rows stay in L1 while every 8-element
// column of them is summed; a row's partial sums go through `out` between blocks, which leaves
// each element's chain of fused multiply-adds, in key order, as it is.
constexpr int32_t kValueBlock = 32;

template <int NR>
void weighted_sum_rows(const float* w, int64_t ldw, const fp16_t* v, int64_t v_stride, int32_t n_keys, int64_t n,
                       float* out, int64_t ldo) {
  const __m256 zero = _mm256_setzero_ps();
  if (n_keys == 0) {
    for (int r = 0; r < NR; ++r) std::fill(out + r * ldo, out + r * ldo + n, 0.0f);
    return;
  }
  for (int32_t j0 = 0; j0 < n_keys; j0 += kValueBlock) {
    const int32_t j1 = std::min(n_keys, j0 + kValueBlock);
    // Blocks without a zero weight (all but the ones around a mask's edge) take the plain path.
    bool any_zero = false;
    for (int r = 0; r < NR; ++r)
      for (int32_t j = j0; j < j1; ++j) any_zero |= w[r * ldw + j] == 0.0f;
    for (int64_t i = 0; i < n; i += 8) {
      __m256 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = j0 == 0 ? zero : _mm256_loadu_ps(out + r * ldo + i);
      for (int32_t j = j0; j < j1; ++j) {
        const __m256 x = load_f16x8(v + j * v_stride + i);
        for (int r = 0; r < NR; ++r) {
          const __m256 wr = _mm256_broadcast_ss(w + r * ldw + j);
          if (any_zero) {
            // A zero weight leaves the row as it is (skipped, as kernels.h says), any other adds.
            const __m256 keep = _mm256_cmp_ps(wr, zero, _CMP_NEQ_UQ);
            acc[r] = _mm256_blendv_ps(acc[r], _mm256_fmadd_ps(wr, x, acc[r]), keep);
          } else {
            acc[r] = _mm256_fmadd_ps(wr, x, acc[r]);
          }
        }
      }
      for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * ldo + i, acc[r]);
    }
  }
}

constexpr int32_t kAvx2AttentionRows = 4;

void f16_scores(const float* q, int64_t ldq, int32_t n_q, const fp16_t* k, int64_t k_stride, int32_t n_keys,
                int64_t n, float* out, int64_t ldo) {
  for_row_groups(n_q, kAvx2AttentionRows, [&]<int NR>(int64_t r0) {
    scores_rows<NR>(q + r0 * ldq, ldq, k, k_stride, n_keys, n, out + r0 * ldo, ldo);
  });
}

void f16_weighted_sum(const float* w, int64_t ldw, int32_t n_q, const fp16_t* v, int64_t v_stride,
                      int32_t n_keys, int64_t n, float* out, int64_t ldo) {
  for_row_groups(n_q, kAvx2AttentionRows, [&]<int NR>(int64_t r0) {
    weighted_sum_rows<NR>(w + r0 * ldw, ldw, v, v_stride, n_keys, n, out + r0 * ldo, ldo);
  });
}

// --- row arithmetic (RowKernels), the reference's steps on 8 lanes ---------------------------

// e^x by the steps in kernels_internal.h; the lanes outside [kExpMin, kExpMax] and NaN lanes are
// computed on anyway and replaced at the end.
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(detail::kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(detail::kExpLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(detail::kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(detail::kExpC[7]);
  for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(detail::kExpC[k]));
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  __m256 y = _mm256_castsi256_ps(scaled);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(detail::kExpMin), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(detail::kExpMax), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// f(i, count) on [0, n) in pieces of 8 elements, the last one of count = n % 8 when that is not 0.
template <class F>
inline void for_eights(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) f(i, 8);
  if (i < n) f(i, n - i);
}

// 8 floats from p, the lanes from count on 0 (and stored back only below count).
inline __m256 load8(const float* p, int64_t count) {
  if (count == 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {};
  std::memcpy(buf, p, sizeof(float) * count);
  return _mm256_load_ps(buf);
}
inline void store8(float* p, __m256 v, int64_t count) {
  if (count == 8) return _mm256_storeu_ps(p, v);
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, sizeof(float) * count);
}
// Lanes whose seen byte is not 0 (lanes from count on: none).
inline __m256 seen_mask8(const uint8_t* seen, int64_t count) {
  uint64_t bytes = 0;
  std::memcpy(&bytes, seen, size_t(count));
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()));
}

void exp_rows(const float* x, float* y, int64_t n) {
  for_eights(n, [&](int64_t i, int64_t count) { store8(y + i, exp8(load8(x + i, count)), count); });
}

void silu_mul(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for_eights(n, [&](int64_t i, int64_t count) {
    const __m256 x = load8(g + i, count);
    const __m256 e = exp8(_mm256_xor_ps(x, sign));
    store8(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), load8(u + i, count)), count);
  });
}

void gelu_tanh_mul(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(detail::kGeluCubic);
  const __m256 minus_two_c = _mm256_set1_ps(-detail::kGeluTwoC);
  for_eights(n, [&](int64_t i, int64_t count) {
    const __m256 x = load8(g + i, count);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(cubic, x), x), x, x);
    const __m256 e = exp8(_mm256_mul_ps(minus_two_c, inner));
    store8(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), load8(u + i, count)), count);
  });
}

void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256d lanes03 = _mm256_setzero_pd(), lanes47 = _mm256_setzero_pd();  // element i in lane i % 8
  for_eights(n, [&](int64_t i, int64_t count) {
    const __m256 v = load8(x + i, count);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    lanes03 = _mm256_fmadd_pd(lo, lo, lanes03);
    lanes47 = _mm256_fmadd_pd(hi, hi, lanes47);
  });
  const __m256d h = _mm256_add_pd(lanes03, lanes47);                                         // l + l+4
  const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));      // h0+h2, h1+h3
  const double ss = _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
  const float scale = 1.0f / std::sqrt(float(ss / double(n)) + eps);
  const __m256 s = _mm256_set1_ps(scale);
  for_eights(n, [&](int64_t i, int64_t count) {
    store8(y + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i, count), s), load8(w + i, count)), count);
  });
}

void softmax_seen(float* x, const uint8_t* seen, int64_t n, float scale) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m8 = minus_inf;
  for_eights(n, [&](int64_t i, int64_t count) {
    const __m256 s = _mm256_mul_ps(load8(x + i, count), _mm256_set1_ps(scale));
    m8 = _mm256_max_ps(m8, _mm256_blendv_ps(minus_inf, s, seen_mask8(seen + i, count)));
    store8(x + i, s, count);
  });
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  float sum = 0.0f;
  for_eights(n, [&](int64_t i, int64_t count) {
    store8(x + i, _mm256_and_ps(exp8(_mm256_sub_ps(load8(x + i, count), m)), seen_mask8(seen + i, count)), count);
    for (int64_t j = i; j < i + count; ++j) sum += x[j];  // in entry order, as the reference
  });
  const __m256 inv_sum = _mm256_set1_ps(1.0f / sum);
  for_eights(n, [&](int64_t i, int64_t count) { store8(x + i, _mm256_mul_ps(load8(x + i, count), inv_sum), count); });
}

template <class K>
void set(KernelTable& t, GgmlType type) {
  t.vec_dot[int(type)] = vec_dot<K>;
  t.gemm[int(type)] = gemm<K>;
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table = [] {
    KernelTable t{};
    t.name = "avx2";
    set<F32Kernel>(t, GgmlType::F32);
    set<F16Kernel>(t, GgmlType::F16);
    set<BF16Kernel>(t, GgmlType::BF16);
    // The quantized types.
    detail::set_avx2_quantized_kernels(t);
    t.quantize[int(GgmlType::F32)] = quantize_f32;
    t.quantize[int(GgmlType::Q8_0)] = quantize_q8_0;
    t.quantize[int(GgmlType::Q8_1)] = quantize_q8_1;
    t.quantize[int(GgmlType::Q8_K)] = quantize_q8_k;
    t.f16 = {f16_round, f16_widen, f16_scores, f16_weighted_sum};
    t.rows = {exp_rows, silu_mul, gelu_tanh_mul, rms_norm_row, softmax_seen};
    return t;
  }();
  return table;
}

}  // namespace microspec
