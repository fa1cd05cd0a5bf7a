#pragma once
// Private to src/kernels: small 256-bit helpers that the AVX2 and AVX-512 kernel files share.
//
// In an unnamed namespace on purpose, as token_count.h: each kernel file is compiled with its own
// target flags (kernels_avx512.cpp with AVX-512), so every file must get its own copy. A shared
// inline function would let the linker keep the AVX-512 file's copy for the AVX2 files too.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/types.h"

namespace microspec {
namespace {

inline float h2f(fp16_t h) {
  return _cvtsh_ss(h);
}

inline __m256i loadu256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

inline __m128i loadu128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// Sum of the 8 int32 lanes.
inline int32_t hsum_i32x8(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(x);
}

// Sum of the 32 int8 quants of a Q8_0 / Q8_1 activation block.
inline int32_t block_sum(const int8_t* qs) {
  // Unsigned sums of q + 128 over 8-byte groups, minus 32 * 128.
  const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(loadu256(qs), _mm256_set1_epi8(char(0x80))), _mm256_setzero_si256());
  const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return int32_t(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
}

// The activation summaries of the 32-element formats' kernels, per token and block: d, the
// activation scale, and x:
//   asymmetric weights (W::kAsym: Q4_1, Q5_1): s = d * sum(quants);
//   symmetric weights multiplied as unsigned quants w + 2^W::kBiasShift: the integer start
//   -2^kBiasShift * sum(quants), stored as int32 bits;
//   nothing where the products already include it: kStarts == kInTheProducts (the AMX tiles'
//   signed weights), or W::kBiasShift < 0 (AVX2's signed Q8_0).
struct ActInfo {
  float* d;  // [n_tokens * nb]
  float* x;  // [n_tokens * nb]
};

enum class Starts { kComputed, kInTheProducts };

template <class W, Starts kStarts = Starts::kComputed>
void act_info(const uint8_t* act, size_t act_stride, int64_t n_tokens, int64_t nb, ActInfo info) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const auto* y = reinterpret_cast<const typename W::Act*>(act + size_t(t) * act_stride);
    for (int64_t b = 0; b < nb; ++b) {
      info.d[t * nb + b] = h2f(y[b].d);
      if constexpr (W::kAsym) {
        info.x[t * nb + b] = h2f(y[b].s);
      } else if constexpr (kStarts == Starts::kComputed && W::kBiasShift >= 0) {
        const int32_t start = -(block_sum(y[b].qs) << W::kBiasShift);
        std::memcpy(&info.x[t * nb + b], &start, 4);
      }
    }
  }
}

}  // namespace
}  // namespace microspec
