// AVX2 + FMA + F16C kernels: the baseline every supported x86-64 CPU runs.
//
// Each weight type has one templated row kernel, dot<NT>, that decodes a weight block once and
// applies it to NT activation rows (NT = 1..8; 1..4 for Q4_K/Q5_K and float weights). gemm tiles
// rows x tokens over it, so up to 8 tokens stream each weight row once; vec_dot is gemm on one row
// and one token.
// Integer arithmetic is exact, so results differ from the reference only in float summation order.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "kernels/token_count.h"

namespace microspec {

namespace {

inline float h2f(fp16_t h) {
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

inline __m256i loadu(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// 16 packed bytes -> 32 bytes: low nibbles (elements 0-15) then high nibbles (elements 16-31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Bit j of h -> byte j = 0xFF or 0x00.
inline __m256i bits_to_bytes(uint32_t h) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(h)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Signed bytes w times signed bytes a, summed in pairs of 4 into 8 int32 lanes. |w|, |a| <= 127
// except w = -128, whose absolute value 128 still fits maddubs' unsigned operand.
inline __m256i dot_i8(__m256i w_abs, __m256i w, __m256i a) {
  const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Unsigned bytes u (<= 63) times signed bytes a, 8 int32 lanes.
inline __m256i dot_u8(__m256i u, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}

// ---------------------------------------------------------------------------------------------
// What one row kernel call reads of the activations

// Most tokens one row kernel call takes (the float kernels take 4: two accumulators per token).
constexpr int kGroup = 8;
static_assert(kGroup == 8, "with_token_count (token_count.h) covers 1..8 tokens");

// The activation rows of one call (up to kGroup tokens, in the weight type's activation format)
// and their block scales already in f32 (gemm converts them once per call instead of once per
// weight row): d is block b's scale of token t, s likewise Q8_1's s = d * sum(qs). Q8_0/Q8_1 keep
// them token-major, d[t * stride + b] (stride: the block count rounded up to even, the padding 0),
// for the block pairs of dot32; Q8_K block-major, d[b * kGroup + t], for BlockScales. Unused for
// f32 activations.
struct Acts {
  const uint8_t* row[kGroup];
  const float* d;
  const float* s;
  int64_t stride;
};

// Which f32 scales a kernel's activation format needs from gemm.
enum class ActScales { kNone, kD, kDS };

// What gemm needs to know of a kernel's activations: the most tokens per row kernel call, the
// f32 scales to convert, the elements per activation block and the block's layout.
struct Q8_0Acts {
  static constexpr int kMaxTokens = kGroup;
  static constexpr ActScales kScales = ActScales::kD;
  static constexpr int kBlockElems = kQK;
  using ActBlock = BlockQ8_0;
};
struct Q8_1Acts {
  static constexpr int kMaxTokens = kGroup;
  static constexpr ActScales kScales = ActScales::kDS;
  static constexpr int kBlockElems = kQK;
  using ActBlock = BlockQ8_1;
};
template <int kTokens>
struct Q8_KActs {
  static constexpr int kMaxTokens = kTokens;
  static constexpr ActScales kScales = ActScales::kD;
  static constexpr int kBlockElems = kQKK;
  using ActBlock = BlockQ8_K;
};
struct F32Acts {
  static constexpr int kMaxTokens = 4;  // two accumulators per token
  static constexpr ActScales kScales = ActScales::kNone;
  static constexpr int kBlockElems = 1;
  using ActBlock = float;
};

// Per-thread scratch for the f32 scales; grows to the largest call and stays.
float* scale_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// ---------------------------------------------------------------------------------------------
// 32-element formats against Q8_0 / Q8_1 activations

// Calls f.template operator()<T>() for T = 0..NT-1 in order.
template <int NT, class F, int T = 0>
inline void for_tokens(F&& f) {
  if constexpr (T < NT) {
    f.template operator()<T>();
    for_tokens<NT, F, T + 1>(static_cast<F&&>(f));
  }
}

// Two blocks' 8-lane integer sums folded into one vector: lanes 0, 2, 4, 6 hold block 0's lane
// pairs (0+2, 1+3, 4+6, 5+7), lanes 1, 3, 5, 7 block 1's. Exact integer adds on the shuffle and
// add ports, which leaves the multiply ports (sign, maddubs, madd, cvt, fma share two) to the
// dot products.
[[gnu::always_inline]] inline __m256i fold2(__m256i i0, __m256i i1) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(i0, i1), _mm256_unpackhi_epi32(i0, i1));
}

// Two f16 scales -> [a b a b a b a b] (kDup) or [a b 0 0 0 0 0 0].
template <bool kDup>
[[gnu::always_inline]] inline __m256 scale_pair(fp16_t a, fp16_t b) {
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(int(uint32_t(a) | uint32_t(b) << 16)));
  if constexpr (kDup)
    return _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(v)));
  else
    return _mm256_zextps128_ps256(_mm_movelh_ps(v, _mm_setzero_ps()));
}

// Two consecutive f32 values -> [a b a b a b a b].
[[gnu::always_inline]] inline __m256 f32_pair(const float* p) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
}

// The 32-element formats against Q8_0 (symmetric weights: K::decode gives signed w) or Q8_1
// (asymmetric, value = q*d + m: K::decode gives unsigned q, plus m * s per block).
//
// Blocks go in pairs: per token, the pair's two integer sums are folded into one vector (fold2),
// converted once and multiplied by [dx0*dy0, dx1*dy1, ...] in one fma, which halves the
// conversions and fmas per block against one vector per block. A token's float steps (per pair:
// that fma, then for Q8_1 one fma of [mx0, mx1, 0...] * [sy0, sy1, ...]; at the end a fixed
// horizontal sum) use only its own values, so its result is the same whatever NT. An odd last
// block pairs with a zero block of zero scale.
template <class K, int NT>
inline void dot32(const void* w, const Acts& a, int64_t n, float* s) {
  constexpr bool kAsym = std::is_same_v<typename K::ActBlock, BlockQ8_1>;
  using ActBlock = typename K::ActBlock;
  const auto* x = static_cast<const typename K::Block*>(w);
  const ActBlock* y[NT];
  for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const ActBlock*>(a.row[t]);
  const int64_t nb = n / kQK;
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  auto step = [&]<bool kPair>(int64_t b) {
    const __m256i q0 = K::decode(x[b]);
    const __m256i q1 = kPair ? K::decode(x[b + 1]) : _mm256_setzero_si256();
    const __m256i q0_abs = kAsym ? q0 : _mm256_sign_epi8(q0, q0);
    const __m256i q1_abs = kAsym ? q1 : _mm256_sign_epi8(q1, q1);
    const __m256 dx = scale_pair<true>(x[b].d, kPair ? x[b + 1].d : fp16_t(0));
    __m256 mx;
    if constexpr (kAsym) mx = scale_pair<false>(x[b].m, kPair ? x[b + 1].m : fp16_t(0));
    for_tokens<NT>([&]<int T>() {
      const __m256i a0 = loadu(y[T][b].qs);
      const __m256i i0 = kAsym ? dot_u8(q0, a0) : dot_i8(q0_abs, q0, a0);
      __m256i i1 = _mm256_setzero_si256();
      if constexpr (kPair) {
        const __m256i a1 = loadu(y[T][b + 1].qs);
        i1 = kAsym ? dot_u8(q1, a1) : dot_i8(q1_abs, q1, a1);
      }
      const __m256 sc = _mm256_mul_ps(dx, f32_pair(a.d + T * a.stride + b));
      acc[T] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold2(i0, i1)), sc, acc[T]);
      if constexpr (kAsym) acc[T] = _mm256_fmadd_ps(mx, f32_pair(a.s + T * a.stride + b), acc[T]);
    });
  };
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) step.template operator()<true>(b);
  if (b < nb) step.template operator()<false>(b);
  for (int t = 0; t < NT; ++t) s[t] = hsum(acc[t]);
}

struct Q8_0Kernel : Q8_0Acts {
  using Block = BlockQ8_0;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    dot32<Q8_0Kernel, NT>(w, a, n, s);
  }
  static __m256i decode(const BlockQ8_0& b) { return loadu(b.qs); }
};

struct Q4_0Kernel : Q8_0Acts {
  using Block = BlockQ4_0;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    dot32<Q4_0Kernel, NT>(w, a, n, s);
  }
  static __m256i decode(const BlockQ4_0& b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
};

struct Q5_0Kernel : Q8_0Acts {
  using Block = BlockQ5_0;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    dot32<Q5_0Kernel, NT>(w, a, n, s);
  }
  static __m256i decode(const BlockQ5_0& b) {
    const __m256i high = bits_to_bytes(load_u32(b.qh));
    return _mm256_sub_epi8(nibbles32(b.qs), _mm256_andnot_si256(high, _mm256_set1_epi8(16)));
  }
};

struct Q4_1Kernel : Q8_1Acts {
  using Block = BlockQ4_1;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    dot32<Q4_1Kernel, NT>(w, a, n, s);
  }
  static __m256i decode(const BlockQ4_1& b) { return nibbles32(b.qs); }
};

struct Q5_1Kernel : Q8_1Acts {
  using Block = BlockQ5_1;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    dot32<Q5_1Kernel, NT>(w, a, n, s);
  }
  static __m256i decode(const BlockQ5_1& b) {
    const __m256i high = bits_to_bytes(load_u32(b.qh));
    return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(high, _mm256_set1_epi8(16)));
  }
};

// ---------------------------------------------------------------------------------------------
// K-quants against Q8_K

// The combined scales dx * dy[t] of one K-quant block for NT tokens, each broadcast to 8 lanes.
// From 3 tokens on: one vector multiply for all tokens, then one in-lane shuffle per token; for
// one or two, scalar products and broadcasts (cheaper there). The products are the same floats.
template <int NT>
struct BlockScales {
  __m256 lo, hi;  // the products of tokens 0-3 / 4-7 in both 128-bit halves (NT > 2)
  float dx;
  const float* dy;
  BlockScales(float dx_, const float* dy_) : dx(dx_), dy(dy_) {
    if constexpr (NT > 2) {
      const __m256 v = _mm256_mul_ps(_mm256_set1_ps(dx), _mm256_loadu_ps(dy));
      lo = _mm256_permute2f128_ps(v, v, 0x00);
      if constexpr (NT > 4) hi = _mm256_permute2f128_ps(v, v, 0x11);
    }
  }
  template <int T>
  __m256 get() const {
    static_assert(T < NT);
    if constexpr (NT <= 2)
      return _mm256_set1_ps(dx * dy[T]);
    else
      return _mm256_permute_ps(T < 4 ? lo : hi, (T % 4) * 0x55);
  }
};

// The eight 6-bit scales and mins of a Q4_K/Q5_K block, as bytes.
[[gnu::always_inline]] inline void k4_scales(const uint8_t* packed, uint8_t* sc, uint8_t* m) {
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, m_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

// Mins as int16 pairs [m0, m0, m1, m1, ...], to madd with the 16 bsums.
[[gnu::always_inline]] inline __m256i k4_mins_pairs(const uint8_t* m) {
  uint64_t m8;
  std::memcpy(&m8, m, 8);
  const __m128i v = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(m8)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
}

template <bool kHigh>
struct Q45KKernel : Q8_KActs<4> {  // 8 tokens would spill isum and acc
  using Block = std::conditional_t<kHigh, BlockQ5_K, BlockQ4_K>;
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    const auto* x = static_cast<const Block*>(w);
    const BlockQ8_K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8_K*>(a.row[t]);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < n / kQKK; ++b) {
      uint8_t sc[8], m[8];
      k4_scales(x[b].scales, sc, m);
      const __m256i mins = k4_mins_pairs(m);
      const float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
      __m256i isum[NT];
      for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
      __m256i hbits = kHigh ? loadu(reinterpret_cast<const BlockQ5_K*>(&x[b])->qh) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = loadu(x[b].qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (kHigh) {
          // Bit 2c of qh[l] is the fifth bit of low-nibble element l, bit 2c+1 of the high one.
          const __m256i b16 = _mm256_set1_epi8(16);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), b16));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hbits, 3), b16));
          hbits = _mm256_srli_epi16(hbits, 2);
        }
        const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
        for (int t = 0; t < NT; ++t) {
          const __m256i p_lo = _mm256_maddubs_epi16(lo, loadu(y[t][b].qs + 64 * c));
          const __m256i p_hi = _mm256_maddubs_epi16(hi, loadu(y[t][b].qs + 64 * c + 32));
          isum[t] = _mm256_add_epi32(
              isum[t], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi)));
        }
      }
      const BlockScales<NT> sd(d, a.d + b * kGroup), sm(dmin, a.d + b * kGroup);
      for_tokens<NT>([&]<int T>() {
        const __m256i mi = _mm256_madd_epi16(loadu(y[T][b].bsums), mins);
        acc[T] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[T]), sd.template get<T>(), acc[T]);
        acc[T] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), sm.template get<T>(), acc[T]);
      });
    }
    for (int t = 0; t < NT; ++t) s[t] = hsum(acc[t]);
  }
};

struct Q6KKernel : Q8_KActs<kGroup> {
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    const auto* x = static_cast<const BlockQ6_K*>(w);
    const BlockQ8_K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8_K*>(a.row[t]);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < n / kQKK; ++b) {
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].scales)));
      __m256i isum[NT];
      // The -32 offset of every quant: -32 * sum_j sc_j * bsum_j.
      for (int t = 0; t < NT; ++t)
        isum[t] = _mm256_slli_epi32(
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(loadu(y[t][b].bsums), sc16)), 5);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = x[b].ql + 64 * half;
        const __m256i ql0 = loadu(ql), ql1 = loadu(ql + 32), qh = loadu(x[b].qh + 32 * half);
        // Elements 0-31, 32-63, 64-95, 96-127 of this half, as unsigned 6-bit values.
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                               _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                               _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(qh, _mm256_set1_epi8(48)));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                               _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(char(0xC0))), 2));
        for (int k = 0; k < 4; ++k) {
          // Elements 32k..32k+31 of the half use scales 8*half + 2k (first 16) and + 2k + 1.
          const int8_t* scp = x[b].scales + 8 * half + 2 * k;
          const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(scp[1]), _mm_set1_epi16(scp[0]));
          for (int t = 0; t < NT; ++t) {
            const __m256i p = _mm256_maddubs_epi16(q[k], loadu(y[t][b].qs + 128 * half + 32 * k));
            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sv));
          }
        }
      }
      const BlockScales<NT> sd(h2f(x[b].d), a.d + b * kGroup);
      for_tokens<NT>([&]<int T>() {
        acc[T] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[T]), sd.template get<T>(), acc[T]);
      });
    }
    for (int t = 0; t < NT; ++t) s[t] = hsum(acc[t]);
  }
};

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

template <class E>
struct FloatKernel : F32Acts {
  template <int NT>
  static void dot(const void* w, const Acts& a, int64_t n, float* s) {
    const auto* x = static_cast<const typename E::T*>(w);
    const float* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const float*>(a.row[t]);
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

// ---------------------------------------------------------------------------------------------
// Tiling

// The f32 scales of n_tokens activation rows of nb blocks each (see Acts), per group of G tokens:
// group g's d table at out + g * per_group, its s table (Q8_1) half a group after it.
template <class Block>
void act_scales(const uint8_t* act, size_t act_stride, int64_t n_tokens, int64_t nb, int G, float* out,
                size_t per_group) {
  constexpr bool kTokenMajor = !std::is_same_v<Block, BlockQ8_K>;
  const int64_t stride = (nb + 1) / 2 * 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const auto* y = reinterpret_cast<const Block*>(act + size_t(t) * act_stride);
    float* group = out + size_t(t / G) * per_group;
    if constexpr (kTokenMajor) {
      float* d = group + (t % G) * stride;
      for (int64_t b = 0; b < nb; ++b) d[b] = h2f(y[b].d);
      d[nb] = 0.0f;  // the padding when nb is odd (else overwritten or unused)
      if constexpr (std::is_same_v<Block, BlockQ8_1>) {
        float* s = d + per_group / 2;
        for (int64_t b = 0; b < nb; ++b) s[b] = h2f(y[b].s);
        s[nb] = 0.0f;
      }
    } else {
      for (int64_t b = 0; b < nb; ++b) group[b * kGroup + t % G] = y[b].d;
    }
  }
}

// Rows in blocks of 8 so a block's weights stay in L1 while every group of up to kMaxTokens tokens
// passes over it; up to kMaxTokens tokens, each weight row is streamed once and decoded once.
template <class K>
void gemm(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
          size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  constexpr int G = K::kMaxTokens;
  constexpr int64_t kRowBlock = 8;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  const float* scales = nullptr;  // per token group: [d table, s table], each nb * kGroup floats
  const int64_t nb = n / K::kBlockElems;
  size_t per_group = 0;
  if constexpr (K::kScales != ActScales::kNone) {
    // + 1: act_scales writes the odd-count padding entry even when nb is even.
    per_group = size_t((nb + 1) / 2 * 2 + 1) * kGroup * (K::kScales == ActScales::kDS ? 2 : 1);
    float* buf = scale_scratch(size_t((n_tokens + G - 1) / G) * per_group);
    act_scales<typename K::ActBlock>(ab, act_stride, n_tokens, nb, G, buf, per_group);
    scales = buf;
  }
  for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
    const int64_t r1 = r0 + kRowBlock < n_rows ? r0 + kRowBlock : n_rows;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += G) {
      const int64_t g = n_tokens - t0 < G ? n_tokens - t0 : G;
      Acts a{};
      for (int64_t i = 0; i < g; ++i) a.row[i] = ab + size_t(t0 + i) * act_stride;
      if (scales) {
        a.d = scales + size_t(t0 / G) * per_group;
        a.s = a.d + per_group / 2;
        a.stride = (nb + 1) / 2 * 2;
      }
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = wb + size_t(row_ids ? row_ids[r] : r) * w_stride;
        float s[kGroup] = {};
        with_token_count(g, [&]<int NT>() {
          if constexpr (NT <= G) K::template dot<NT>(row, a, n, s);
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
        hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
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
      y[b].bsums[k / 16] = int16_t(hsum_i32(_mm256_add_epi32(i32[0], i32[1])));
      y[b].bsums[k / 16 + 1] = int16_t(hsum_i32(_mm256_add_epi32(i32[2], i32[3])));
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
    set<Q4_0Kernel>(t, GgmlType::Q4_0);
    set<Q4_1Kernel>(t, GgmlType::Q4_1);
    set<Q5_0Kernel>(t, GgmlType::Q5_0);
    set<Q5_1Kernel>(t, GgmlType::Q5_1);
    set<Q8_0Kernel>(t, GgmlType::Q8_0);
    set<Q45KKernel<false>>(t, GgmlType::Q4_K);
    set<Q45KKernel<true>>(t, GgmlType::Q5_K);
    set<Q6KKernel>(t, GgmlType::Q6_K);
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
