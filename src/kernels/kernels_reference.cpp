// Scalar reference kernels: dequantization, activation and weight quantization, and the integer
// dot products of each weight type with its activation type. These define what the SIMD tables
// must compute; they follow ggml's arithmetic (integer sums per block, one float multiply-add per
// block or sub-block) so results stay close to llama.cpp's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "kernels/repack.h"
#include "util/error.h"

namespace microspec {

namespace {

inline float h2f(fp16_t h) {
  return fp16_to_fp32(h);
}

// Round half to even in the default floating-point environment, as the SIMD quantizers do with
// cvtps2dq, so the reference and SIMD activation quantizers agree bit for bit.
inline int round_even(float x) {
  return static_cast<int>(std::nearbyint(x));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block (12 packed bytes).
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantization

void dequant_q4_0(const BlockQ4_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = float((x[b].qs[j] & 0xF) - 8) * d;
      y[j + 16] = float((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d), m = h2f(x[b].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = float(x[b].qs[j] & 0xF) * d + m;
      y[j + 16] = float(x[b].qs[j] >> 4) * d + m;
    }
  }
}

void dequant_q5_0(const BlockQ5_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d);
    const uint32_t h = load_u32(x[b].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4);
      const int hi = (x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
      y[j] = float(lo - 16) * d;
      y[j + 16] = float(hi - 16) * d;
    }
  }
}

void dequant_q5_1(const BlockQ5_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d), m = h2f(x[b].m);
    const uint32_t h = load_u32(x[b].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4);
      const int hi = (x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
      y[j] = float(lo) * d + m;
      y[j + 16] = float(hi) * d + m;
    }
  }
}

void dequant_q8_0(const BlockQ8_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d);
    for (int j = 0; j < kQK; ++j) y[j] = float(x[b].qs[j]) * d;
  }
}

void dequant_q8_1(const BlockQ8_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = h2f(x[b].d);
    for (int j = 0; j < kQK; ++j) y[j] = float(x[b].qs[j]) * d;
  }
}

void dequant_q4_k(const BlockQ4_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
    const uint8_t* q = x[b].qs;
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {
      int sc, m;
      scale_min_k4(2 * c, x[b].scales, &sc, &m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      scale_min_k4(2 * c + 1, x[b].scales, &sc, &m);
      const float d2 = d * float(sc), m2 = dmin * float(m);
      for (int l = 0; l < 32; ++l) {
        y[l] = d1 * float(q[l] & 0xF) - m1;
        y[l + 32] = d2 * float(q[l] >> 4) - m2;
      }
    }
  }
}

void dequant_q5_k(const BlockQ5_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
    const uint8_t* q = x[b].qs;
    const uint8_t* qh = x[b].qh;
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {
      int sc, m;
      scale_min_k4(2 * c, x[b].scales, &sc, &m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      scale_min_k4(2 * c + 1, x[b].scales, &sc, &m);
      const float d2 = d * float(sc), m2 = dmin * float(m);
      const uint8_t u1 = uint8_t(1u << (2 * c)), u2 = uint8_t(2u << (2 * c));
      for (int l = 0; l < 32; ++l) {
        y[l] = d1 * float((q[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
        y[l + 32] = d2 * float((q[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
      }
    }
  }
}

void dequant_q6_k(const BlockQ6_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d);
    const uint8_t* ql = x[b].ql;
    const uint8_t* qh = x[b].qh;
    const int8_t* sc = x[b].scales;
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[is + 0]) * float(q1);
        y[l + 32] = d * float(sc[is + 2]) * float(q2);
        y[l + 64] = d * float(sc[is + 4]) * float(q3);
        y[l + 96] = d * float(sc[is + 6]) * float(q4);
      }
    }
  }
}

void dequant_q8_k(const BlockQ8_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQKK)
    for (int j = 0; j < kQKK; ++j) y[j] = x[b].d * float(x[b].qs[j]);
}

// ---------------------------------------------------------------------------------------------
// Activation quantization (also used for Q8_0 weights)

void quant_q8_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK; ++j) y[b].qs[j] = int8_t(round_even(x[j] * id));
  }
}

void quant_q8_1(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_1*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      y[b].qs[j] = int8_t(round_even(x[j] * id));
      sum += y[b].qs[j];
    }
    y[b].d = fp32_to_fp16(d);
    y[b].s = fp32_to_fp16(float(sum) * d);
  }
}

// As ggml: the scale maps the element of largest magnitude (the first, on ties) to -127, so every
// quant lies in [-127, 127]; bsums hold the sum of each 16 quants for the K-quant min terms.
void quant_q8_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(out);
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQKK; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < kQKK; ++j) y[b].qs[j] = int8_t(std::min(127, round_even(iscale * x[j])));
    for (int g = 0; g < kQKK / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += y[b].qs[g * 16 + j];
      y[b].bsums[g] = int16_t(sum);
    }
    y[b].d = 1.0f / iscale;
  }
}

void quant_f32(const float* x, void* out, int64_t n) {
  std::memcpy(out, x, size_t(n) * sizeof(float));
}

// ---------------------------------------------------------------------------------------------
// Weight quantization (tests and tiny models): round to nearest, no importance weighting.

void quant_f16(const float* x, void* out, int64_t n) {
  auto* y = static_cast<fp16_t*>(out);
  for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

void quant_bf16(const float* x, void* out, int64_t n) {
  auto* y = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    if ((bits & 0x7fffffff) > 0x7f800000)
      y[i] = uint16_t((bits >> 16) | 0x40);  // NaN stays a (quiet) NaN
    else
      y[i] = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);  // round half to even
  }
}

// The value of largest magnitude (its sign kept) of x[0..n).
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void quant_q4_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ4_0*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const float d = signed_absmax(x, kQK) / -8.0f;  // the extreme value maps to quant 0
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::clamp(int(x[j] * id + 8.5f), 0, 15);
      const int hi = std::clamp(int(x[j + 16] * id + 8.5f), 0, 15);
      y[b].qs[j] = uint8_t(lo | (hi << 4));
    }
  }
}

void quant_q5_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ5_0*>(out);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const float d = signed_absmax(x, kQK) / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    uint32_t h = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::clamp(int(x[j] * id + 16.5f), 0, 31);
      const int hi = std::clamp(int(x[j + 16] * id + 16.5f), 0, 31);
      y[b].qs[j] = uint8_t((lo & 0xF) | ((hi & 0xF) << 4));
      h |= uint32_t(lo >> 4) << j;
      h |= uint32_t(hi >> 4) << (j + 16);
    }
    std::memcpy(y[b].qh, &h, 4);
  }
}

// Asymmetric 32-element blocks: value = q * d + m with q in [0, levels].
template <class Block, int kLevels>
void quant_asym(const float* x, Block* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    const float mn = *std::min_element(x, x + kQK), mx = *std::max_element(x, x + kQK);
    const float d = (mx - mn) / float(kLevels);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    y[b].m = fp32_to_fp16(mn);
    int q[kQK];
    for (int j = 0; j < kQK; ++j) q[j] = std::clamp(int((x[j] - mn) * id + 0.5f), 0, kLevels);
    for (int j = 0; j < kQK / 2; ++j) y[b].qs[j] = uint8_t((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    if constexpr (kLevels == 31) {
      uint32_t h = 0;
      for (int j = 0; j < kQK; ++j) h |= uint32_t(q[j] >> 4) << j;
      std::memcpy(y[b].qh, &h, 4);
    }
  }
}

void quant_q4_1(const float* x, void* out, int64_t n) {
  quant_asym<BlockQ4_1, 15>(x, static_cast<BlockQ4_1*>(out), n / kQK);
}
void quant_q5_1(const float* x, void* out, int64_t n) {
  quant_asym<BlockQ5_1, 31>(x, static_cast<BlockQ5_1*>(out), n / kQK);
}

// Q4_K / Q5_K: eight 32-element sub-blocks, value = d*sc*q - dmin*m with 6-bit sc and m.
// Computes the quants (0..kLevels) of one 256-element block and fills d, dmin and scales.
template <int kLevels>
void quant_k_scales(const float* x, fp16_t* d_out, fp16_t* dmin_out, uint8_t* scales, uint8_t* q) {
  float scale[8], min[8];  // per sub-block: step and the (non-negative) amount subtracted
  for (int j = 0; j < 8; ++j) {
    const float* s = x + 32 * j;
    const float mn = std::min(0.0f, *std::min_element(s, s + 32));
    const float mx = *std::max_element(s, s + 32);
    scale[j] = std::max(0.0f, mx - mn) / float(kLevels);
    min[j] = -mn;
  }
  const float max_scale = *std::max_element(scale, scale + 8), max_min = *std::max_element(min, min + 8);
  const float d = max_scale / 63.0f, dmin = max_min / 63.0f;
  int sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = d > 0.0f ? std::clamp(round_even(scale[j] / d), 0, 63) : 0;
    m[j] = dmin > 0.0f ? std::clamp(round_even(min[j] / dmin), 0, 63) : 0;
  }
  *d_out = fp32_to_fp16(d);
  *dmin_out = fp32_to_fp16(dmin);
  for (int j = 0; j < 4; ++j) {
    scales[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = uint8_t(m[j] | ((m[j + 4] >> 4) << 6));
    scales[j + 8] = uint8_t((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
  // Quantize against the rounded scales, as the decoder will see them.
  const float df = h2f(*d_out), dminf = h2f(*dmin_out);
  for (int j = 0; j < 8; ++j) {
    const float step = df * float(sc[j]), off = dminf * float(m[j]);
    for (int l = 0; l < 32; ++l)
      q[32 * j + l] =
          step > 0.0f ? uint8_t(std::clamp(round_even((x[32 * j + l] + off) / step), 0, kLevels)) : 0;
  }
}

void quant_q4_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ4_K*>(out);
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    uint8_t q[kQKK];
    quant_k_scales<15>(x, &y[b].d, &y[b].dmin, y[b].scales, q);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) y[b].qs[32 * c + l] = uint8_t(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
  }
}

void quant_q5_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ5_K*>(out);
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    uint8_t q[kQKK];
    quant_k_scales<31>(x, &y[b].d, &y[b].dmin, y[b].scales, q);
    std::memset(y[b].qh, 0, sizeof(y[b].qh));
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = q[64 * c + l], hi = q[64 * c + 32 + l];
        y[b].qs[32 * c + l] = uint8_t((lo & 0xF) | ((hi & 0xF) << 4));
        y[b].qh[l] |= uint8_t(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
  }
}

// Q6_K: sixteen 16-element sub-blocks with signed 8-bit scales, value = d*sc*(q - 32).
void quant_q6_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ6_K*>(out);
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    float scale[16];
    float max_abs_scale = 0.0f;
    for (int j = 0; j < 16; ++j) {
      scale[j] = signed_absmax(x + 16 * j, 16) / -32.0f;  // the extreme value maps to quant 0
      max_abs_scale = std::max(max_abs_scale, std::fabs(scale[j]));
    }
    const float d = max_abs_scale / 127.0f;
    y[b].d = fp32_to_fp16(d);
    const float df = h2f(y[b].d);
    uint8_t q[kQKK];
    for (int j = 0; j < 16; ++j) {
      const int sc = d > 0.0f ? std::clamp(round_even(scale[j] / d), -127, 127) : 0;
      y[b].scales[j] = int8_t(sc);
      const float step = df * float(sc);
      for (int l = 0; l < 16; ++l)
        q[16 * j + l] = step != 0.0f ? uint8_t(std::clamp(round_even(x[16 * j + l] / step) + 32, 0, 63)) : 32;
    }
    for (int half = 0; half < 2; ++half) {
      uint8_t* ql = y[b].ql + 64 * half;
      uint8_t* qh = y[b].qh + 32 * half;
      const uint8_t* qq = q + 128 * half;
      for (int l = 0; l < 32; ++l) {
        const int q1 = qq[l], q2 = qq[l + 32], q3 = qq[l + 64], q4 = qq[l + 96];
        ql[l] = uint8_t((q1 & 0xF) | ((q3 & 0xF) << 4));
        ql[l + 32] = uint8_t((q2 & 0xF) | ((q4 & 0xF) << 4));
        qh[l] = uint8_t((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dot products

float dot_f32(const void* w, const void* a, int64_t n) {
  const float* x = static_cast<const float*>(w);
  const float* y = static_cast<const float*>(a);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(y[i]);
  return float(sum);
}

float dot_f16(const void* w, const void* a, int64_t n) {
  const fp16_t* x = static_cast<const fp16_t*>(w);
  const float* y = static_cast<const float*>(a);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(h2f(x[i])) * double(y[i]);
  return float(sum);
}

float dot_bf16(const void* w, const void* a, int64_t n) {
  const uint16_t* x = static_cast<const uint16_t*>(w);
  const float* y = static_cast<const float*>(a);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(bf16_to_fp32(x[i])) * double(y[i]);
  return float(sum);
}

float dot_q4_0(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ4_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQK; ++b) {
    int sumi = 0;
    for (int j = 0; j < kQK / 2; ++j)
      sumi += ((x[b].qs[j] & 0xF) - 8) * y[b].qs[j] + ((x[b].qs[j] >> 4) - 8) * y[b].qs[j + 16];
    sum += float(sumi) * (h2f(x[b].d) * h2f(y[b].d));
  }
  return sum;
}

float dot_q4_1(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ4_1*>(w);
  const auto* y = static_cast<const BlockQ8_1*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQK; ++b) {
    int sumi = 0;
    for (int j = 0; j < kQK / 2; ++j)
      sumi += (x[b].qs[j] & 0xF) * y[b].qs[j] + (x[b].qs[j] >> 4) * y[b].qs[j + 16];
    sum += float(sumi) * (h2f(x[b].d) * h2f(y[b].d)) + h2f(x[b].m) * h2f(y[b].s);
  }
  return sum;
}

float dot_q5_0(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ5_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQK; ++b) {
    const uint32_t h = load_u32(x[b].qh);
    int sumi = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = ((x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4)) - 16;
      const int hi = ((x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - 16;
      sumi += lo * y[b].qs[j] + hi * y[b].qs[j + 16];
    }
    sum += float(sumi) * (h2f(x[b].d) * h2f(y[b].d));
  }
  return sum;
}

float dot_q5_1(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ5_1*>(w);
  const auto* y = static_cast<const BlockQ8_1*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQK; ++b) {
    const uint32_t h = load_u32(x[b].qh);
    int sumi = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (x[b].qs[j] & 0xF) | (((h >> j) & 1) << 4);
      const int hi = (x[b].qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
      sumi += lo * y[b].qs[j] + hi * y[b].qs[j + 16];
    }
    sum += float(sumi) * (h2f(x[b].d) * h2f(y[b].d)) + h2f(x[b].m) * h2f(y[b].s);
  }
  return sum;
}

float dot_q8_0(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ8_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQK; ++b) {
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += x[b].qs[j] * y[b].qs[j];
    sum += float(sumi) * (h2f(x[b].d) * h2f(y[b].d));
  }
  return sum;
}

// Q4_K / Q5_K: sum_j d*sc_j*<q, a>_j - dmin * sum_j m_j*<1, a>_j, the second from bsums.
template <class Block>
float dot_q45_k(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const Block*>(w);
  const auto* y = static_cast<const BlockQ8_K*>(a);
  constexpr bool kHigh = sizeof(Block) == sizeof(BlockQ5_K);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int sumi = 0, summ = 0;
    for (int c = 0; c < 4; ++c) {
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        int sc, m;
        scale_min_k4(j, x[b].scales, &sc, &m);
        int dot = 0;
        for (int l = 0; l < 32; ++l) {
          int q = half ? x[b].qs[32 * c + l] >> 4 : x[b].qs[32 * c + l] & 0xF;
          if constexpr (kHigh) q += ((x[b].qh[l] >> j) & 1) << 4;
          dot += q * y[b].qs[32 * j + l];
        }
        sumi += sc * dot;
        summ += m * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
      }
    }
    sum += h2f(x[b].d) * y[b].d * float(sumi) - h2f(x[b].dmin) * y[b].d * float(summ);
  }
  return sum;
}

float dot_q6_k(const void* w, const void* a, int64_t n) {
  const auto* x = static_cast<const BlockQ6_K*>(w);
  const auto* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0.0f;
  for (int64_t b = 0; b < n / kQKK; ++b) {
    int q[kQKK];
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x[b].ql + 64 * half;
      const uint8_t* qh = x[b].qh + 32 * half;
      int* qq = q + 128 * half;
      for (int l = 0; l < 32; ++l) {
        qq[l] = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        qq[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        qq[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        qq[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      }
    }
    int sumi = 0;
    for (int j = 0; j < 16; ++j) {
      int dot = 0;
      for (int l = 0; l < 16; ++l) dot += q[16 * j + l] * y[b].qs[16 * j + l];
      sumi += x[b].scales[j] * dot;
    }
    sum += h2f(x[b].d) * y[b].d * float(sumi);
  }
  return sum;
}

template <VecDotFn kDot>
void gemm_by_rows(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
                  size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* ab = static_cast<const uint8_t*>(act);
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* row = wb + size_t(row_ids ? row_ids[r] : r) * w_stride;
    for (int64_t t = 0; t < n_tokens; ++t) out[t * ldo + r] = kDot(row, ab + t * act_stride, n);
  }
}

// Interleaved weights (repack.h): each row read back into the file's format and dotted by kDot,
// so the results are bitwise those of the file's layout.
template <VecDotFn kDot, GgmlType kType>
void gemm_interleaved_by_rows(const void* tiles, int64_t n_rows, const void* act, size_t act_stride,
                              int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  std::vector<uint8_t> row(row_bytes(kType, n));
  const auto* ab = static_cast<const uint8_t*>(act);
  for (int64_t r = 0; r < n_rows; ++r) {
    deinterleave_row(kType, static_cast<const uint8_t*>(tiles), n, r, row.data());
    for (int64_t t = 0; t < n_tokens; ++t) out[t * ldo + r] = kDot(row.data(), ab + t * act_stride, n);
  }
}

template <VecDotFn kDot>
void set_dot(KernelTable& t, GgmlType type) {
  t.vec_dot[int(type)] = kDot;
  t.gemm[int(type)] = gemm_by_rows<kDot>;
}

void require_multiple(GgmlType type, int64_t n) {
  const TypeTraits& tr = type_traits(type);
  if (n < 0 || n % tr.block_elems != 0)
    throw Error(std::to_string(n) + " elements is not a multiple of the " + tr.name + " block size " +
                std::to_string(tr.block_elems));
}

}  // namespace

GgmlType activation_type(GgmlType weight) {
  switch (weight) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return GgmlType::F32;
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0:
      return GgmlType::Q8_0;
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
      return GgmlType::Q8_1;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return GgmlType::Q8_K;
    default:
      throw Error("no matmul kernel for weights of type " + type_name(uint32_t(weight)));
  }
}

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  require_multiple(type, n);
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, size_t(n) * sizeof(float));
      return;
    case GgmlType::F16: {
      const auto* x = static_cast<const fp16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = h2f(x[i]);
      return;
    }
    case GgmlType::BF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(x[i]);
      return;
    }
    case GgmlType::Q4_0:
      return dequant_q4_0(static_cast<const BlockQ4_0*>(src), dst, n / kQK);
    case GgmlType::Q4_1:
      return dequant_q4_1(static_cast<const BlockQ4_1*>(src), dst, n / kQK);
    case GgmlType::Q5_0:
      return dequant_q5_0(static_cast<const BlockQ5_0*>(src), dst, n / kQK);
    case GgmlType::Q5_1:
      return dequant_q5_1(static_cast<const BlockQ5_1*>(src), dst, n / kQK);
    case GgmlType::Q8_0:
      return dequant_q8_0(static_cast<const BlockQ8_0*>(src), dst, n / kQK);
    case GgmlType::Q8_1:
      return dequant_q8_1(static_cast<const BlockQ8_1*>(src), dst, n / kQK);
    case GgmlType::Q4_K:
      return dequant_q4_k(static_cast<const BlockQ4_K*>(src), dst, n / kQKK);
    case GgmlType::Q5_K:
      return dequant_q5_k(static_cast<const BlockQ5_K*>(src), dst, n / kQKK);
    case GgmlType::Q6_K:
      return dequant_q6_k(static_cast<const BlockQ6_K*>(src), dst, n / kQKK);
    case GgmlType::Q8_K:
      return dequant_q8_k(static_cast<const BlockQ8_K*>(src), dst, n / kQKK);
    default:
      throw Error("cannot dequantize tensors of type " + type_name(uint32_t(type)));
  }
}

void quantize_row_reference(GgmlType type, const float* src, void* dst, int64_t n) {
  require_multiple(type, n);
  switch (type) {
    case GgmlType::F32:
      return quant_f32(src, dst, n);
    case GgmlType::F16:
      return quant_f16(src, dst, n);
    case GgmlType::BF16:
      return quant_bf16(src, dst, n);
    case GgmlType::Q4_0:
      return quant_q4_0(src, dst, n);
    case GgmlType::Q4_1:
      return quant_q4_1(src, dst, n);
    case GgmlType::Q5_0:
      return quant_q5_0(src, dst, n);
    case GgmlType::Q5_1:
      return quant_q5_1(src, dst, n);
    case GgmlType::Q8_0:
      return quant_q8_0(src, dst, n);
    case GgmlType::Q8_1:
      return quant_q8_1(src, dst, n);
    case GgmlType::Q4_K:
      return quant_q4_k(src, dst, n);
    case GgmlType::Q5_K:
      return quant_q5_k(src, dst, n);
    case GgmlType::Q6_K:
      return quant_q6_k(src, dst, n);
    case GgmlType::Q8_K:
      return quant_q8_k(src, dst, n);
    default:
      throw Error("cannot quantize to type " + type_name(uint32_t(type)));
  }
}

namespace {

// --- attention on half floats: the order of operations every table reproduces -----------------

// Element i goes to lane i % 16 (an 8-element tail to lanes 0..7), each lane a chain of fused
// multiply-adds; then lanes l + 8 onto l, l + 4 onto l, and (0 + 2) + (1 + 3). a_at(i): the first
// operand's element i as f32.
template <class A>
float dot_in_lanes(const A& a_at, const fp16_t* b, int64_t n) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] = std::fma(a_at(i + l), fp16_to_fp32(b[i + l]), lane[l]);
  for (; i < n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] = std::fma(a_at(i + l), fp16_to_fp32(b[i + l]), lane[l]);
  float half[8], quarter[4];
  for (int l = 0; l < 8; ++l) half[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; ++l) quarter[l] = half[l] + half[l + 4];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

void f16_round(const float* x, fp16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

void f16_widen(const fp16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

void f16_scores(const float* q, int64_t ldq, int32_t n_q, const fp16_t* k, int64_t k_stride, int32_t n_keys,
                int64_t n, float* out, int64_t ldo) {
  for (int32_t r = 0; r < n_q; ++r)
    for (int32_t j = 0; j < n_keys; ++j)
      out[r * ldo + j] = dot_in_lanes([&](int64_t i) { return q[r * ldq + i]; }, k + j * k_stride, n);
}

void f16_weighted_sum(const float* w, int64_t ldw, int32_t n_q, const fp16_t* v, int64_t v_stride,
                      int32_t n_keys, int64_t n, float* out, int64_t ldo) {
  for (int32_t r = 0; r < n_q; ++r) {
    float* o = out + r * ldo;
    std::fill(o, o + n, 0.0f);
    for (int32_t j = 0; j < n_keys; ++j)
      if (w[r * ldw + j] != 0.0f) f16_axpy_reference(w[r * ldw + j], v + j * v_stride, o, n);
  }
}

// --- row arithmetic (RowKernels): the order of operations every table reproduces -------------

// e^x by the steps in kernels_internal.h.
inline float exp_one(float x) {
  if (std::isnan(x)) return x;
  if (x < detail::kExpMin) return 0.0f;
  if (x > detail::kExpMax) return std::numeric_limits<float>::infinity();
  const float n = std::nearbyint(x * detail::kExpLog2e);
  float r = std::fma(-n, detail::kExpLn2Hi, x);
  r = std::fma(-n, detail::kExpLn2Lo, r);
  float p = detail::kExpC[7];
  for (int k = 6; k >= 0; --k) p = std::fma(p, r, detail::kExpC[k]);
  uint32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;  // times 2^n: the result stays normal
  std::memcpy(&p, &bits, 4);
  return p;
}

void exp_rows(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_one(x[i]);
}

void silu_mul(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + exp_one(-g[i])) * u[i];
}

void gelu_tanh_mul(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float inner = std::fma((detail::kGeluCubic * x) * x, x, x);  // x + 0.044715 x^3
    g[i] = x / (1.0f + exp_one(-detail::kGeluTwoC * inner)) * u[i];
  }
}

void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  double lane[8] = {};
  for (int64_t i = 0; i < n; ++i) lane[i % 8] = std::fma(double(x[i]), double(x[i]), lane[i % 8]);
  const double ss = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  const float scale = 1.0f / std::sqrt(float(ss / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void softmax_seen(float* x, const uint8_t* seen, int64_t n, float scale) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j)
    if (seen[j]) {
      x[j] = x[j] * scale;
      m = std::max(m, x[j]);
    }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = seen[j] ? exp_one(x[j] - m) : 0.0f;
    sum += x[j];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) x[j] *= inv_sum;
}

}  // namespace

float f16_dot_reference(const fp16_t* a, const fp16_t* b, int64_t n) {
  return dot_in_lanes([&](int64_t i) { return fp16_to_fp32(a[i]); }, b, n);
}

void f16_axpy_reference(float alpha, const fp16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(alpha, fp16_to_fp32(x[i]), y[i]);
}

const KernelTable& reference_kernels() {
  static const KernelTable table = [] {
    KernelTable t{};
    t.name = "reference";
    set_dot<dot_f32>(t, GgmlType::F32);
    set_dot<dot_f16>(t, GgmlType::F16);
    set_dot<dot_bf16>(t, GgmlType::BF16);
    set_dot<dot_q4_0>(t, GgmlType::Q4_0);
    set_dot<dot_q4_1>(t, GgmlType::Q4_1);
    set_dot<dot_q5_0>(t, GgmlType::Q5_0);
    set_dot<dot_q5_1>(t, GgmlType::Q5_1);
    set_dot<dot_q8_0>(t, GgmlType::Q8_0);
    set_dot<dot_q45_k<BlockQ4_K>>(t, GgmlType::Q4_K);
    set_dot<dot_q45_k<BlockQ5_K>>(t, GgmlType::Q5_K);
    set_dot<dot_q6_k>(t, GgmlType::Q6_K);
    t.gemm_interleaved[int(GgmlType::Q8_0)] = gemm_interleaved_by_rows<dot_q8_0, GgmlType::Q8_0>;
    t.gemm_interleaved[int(GgmlType::Q4_0)] = gemm_interleaved_by_rows<dot_q4_0, GgmlType::Q4_0>;
    t.gemm_interleaved[int(GgmlType::Q4_1)] = gemm_interleaved_by_rows<dot_q4_1, GgmlType::Q4_1>;
    t.gemm_interleaved[int(GgmlType::Q5_0)] = gemm_interleaved_by_rows<dot_q5_0, GgmlType::Q5_0>;
    t.gemm_interleaved[int(GgmlType::Q5_1)] = gemm_interleaved_by_rows<dot_q5_1, GgmlType::Q5_1>;
    t.gemm_interleaved[int(GgmlType::Q4_K)] = gemm_interleaved_by_rows<dot_q45_k<BlockQ4_K>, GgmlType::Q4_K>;
    t.gemm_interleaved[int(GgmlType::Q6_K)] = gemm_interleaved_by_rows<dot_q6_k, GgmlType::Q6_K>;
    t.quantize[int(GgmlType::F32)] = quant_f32;
    t.quantize[int(GgmlType::Q8_0)] = quant_q8_0;
    t.quantize[int(GgmlType::Q8_1)] = quant_q8_1;
    t.quantize[int(GgmlType::Q8_K)] = quant_q8_k;
    t.f16 = {f16_round, f16_widen, f16_scores, f16_weighted_sum};
    t.rows = {exp_rows, silu_mul, gelu_tanh_mul, rms_norm_row, softmax_seen};
    return t;
  }();
  return table;
}

}  // namespace microspec
