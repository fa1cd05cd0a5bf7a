// Kernels: dequantization against hand-built blocks, SIMD tables against the scalar reference
// (dot products, activation quantizers, matmul tiling and threading, the half-float attention
// arithmetic bit for bit), the thread pool (also two pools sharing the cores), and dot products on
// tensors of the two real models against their dequantized f32 values.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "kernels/matmul.h"
#include "kernels/repack.h"
#include "kernels/threadpool.h"
#include "support/test_helpers.h"
#include "util/error.h"

namespace microspec {
namespace {

const GgmlType kWeightTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0,
                                 GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                                 GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};

std::string tname(GgmlType t) {
  return type_name(uint32_t(t));
}

using test::simd_tables;

void put_f16(std::vector<uint8_t>& b, size_t off, float v) {
  const fp16_t h = fp32_to_fp16(v);
  std::memcpy(b.data() + off, &h, 2);
}

float get_f16(const uint8_t* p) {
  fp16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

std::vector<float> dequant(GgmlType type, const void* data, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(type, data, out.data(), n);
  return out;
}

std::vector<float> random_floats(std::mt19937& rng, int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  // A few outliers, as real activations have.
  for (int i = 0; i < 3 && n > 0; ++i) v[rng() % size_t(n)] *= 8.0f;
  return v;
}

// Byte offsets of a quantized block's f16 fields: the scale d, then the min (Q4_1, Q5_1) or dmin
// (Q4_K, Q5_K).
std::vector<size_t> f16_fields(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
      return {0, 2};
    case GgmlType::Q6_K:
      return {offsetof(BlockQ6_K, d)};
    default:
      return {0};
  }
}

// A row of n elements of `type`. Quantized types get uniformly random bytes (every quant and
// scale bit pattern, e.g. Q8_0 quants of -128 and Q6_K scales of -128) with sane f16 scale fields;
// float types get random values.
std::vector<uint8_t> random_row(GgmlType type, int64_t n, std::mt19937& rng) {
  std::vector<uint8_t> b(row_bytes(type, n));
  if (type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16) {
    quantize_row_reference(type, random_floats(rng, n).data(), b.data(), n);
    return b;
  }
  for (uint8_t& x : b) x = uint8_t(rng());
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  const TypeTraits& tr = type_traits(type);
  const std::vector<size_t> fields = f16_fields(type);
  for (size_t blk = 0; blk < b.size() / tr.block_bytes; ++blk)
    for (size_t off : fields) put_f16(b, blk * tr.block_bytes + off, scale(rng));
  return b;
}

// Per element, the size of the constant that a type's dot product adds as a separate float term
// (Q4_1/Q5_1: m; Q4_K/Q5_K: dmin * m_j). Such a term can cancel against the integer term, so the
// rounding tolerance must scale with both, not with the dequantized value alone.
std::vector<float> offset_magnitudes(GgmlType type, const uint8_t* row, int64_t n) {
  std::vector<float> off(static_cast<size_t>(n), 0.0f);
  if (type == GgmlType::Q4_1 || type == GgmlType::Q5_1) {
    const size_t bb = type_traits(type).block_bytes;
    for (int64_t i = 0; i < n; ++i) off[size_t(i)] = std::fabs(get_f16(row + size_t(i / kQK) * bb + 2));
  } else if (type == GgmlType::Q4_K || type == GgmlType::Q5_K) {
    const size_t bb = type_traits(type).block_bytes;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* blk = row + size_t(i / kQKK) * bb;
      const uint8_t* s = blk + 4;
      const int j = int(i % kQKK) / 32;
      const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      off[size_t(i)] = std::fabs(get_f16(blk + 2) * float(m));
    }
  }
  return off;
}

// Bound on float rounding differences between two evaluations of the same integer dot product:
// 1e-5 of the sum of the magnitudes of everything summed. The integer block sums are exact in every
// table, so only the rounding of the per-block float products and the summation order differ: a
// few ulp (6e-8 each) per block, far below 1e-5 for the row lengths used here.
double rounding_bound(GgmlType type, const uint8_t* row, const float* a_deq, int64_t n) {
  const std::vector<float> w = dequant(type, row, n);
  const std::vector<float> off = offset_magnitudes(type, row, n);
  double mag = 0.0;
  for (int64_t i = 0; i < n; ++i)
    mag += (std::fabs(double(w[size_t(i)])) + off[size_t(i)]) * std::fabs(a_deq[i]);
  return 1e-5 * mag + 1e-30;
}

// Bound on |quantized dot - exact f32 dot| caused by quantizing the activations: each element is
// off by at most half a step plus the f16 rounding of the block scale (127 steps * 2^-11 = 0.062
// step), and Q8_1's f16 block sum s adds |m * s| * 2^-11 per block. Plus rounding_bound's slack.
double quantization_bound(GgmlType type, const uint8_t* row, const float* x, int64_t n) {
  const GgmlType at = activation_type(type);
  if (at == GgmlType::F32) return rounding_bound(type, row, x, n);
  const std::vector<float> w = dequant(type, row, n);
  const std::vector<float> off = offset_magnitudes(type, row, n);
  const int64_t blk = at == GgmlType::Q8_K ? kQKK : kQK;
  double bound = 0.0;
  for (int64_t b0 = 0; b0 < n; b0 += blk) {
    double amax = 0.0, wsum = 0.0, xsum = 0.0;
    for (int64_t i = b0; i < b0 + blk; ++i) {
      amax = std::max(amax, std::fabs(double(x[i])));
      wsum += std::fabs(double(w[size_t(i)])) + off[size_t(i)];
      xsum += std::fabs(double(x[i]));
    }
    const double step = amax / 127.0;
    bound += wsum * step * 0.57;
    if (at == GgmlType::Q8_1) bound += off[size_t(b0)] * xsum * 1.1 / 2048.0;
  }
  return bound + rounding_bound(type, row, x, n) * 2.0;
}

std::vector<uint8_t> quantize_act(const KernelTable& k, GgmlType weight_type, const std::vector<float>& x) {
  const GgmlType at = activation_type(weight_type);
  std::vector<uint8_t> a(row_bytes(at, int64_t(x.size())));
  k.quantize[int(at)](x.data(), a.data(), int64_t(x.size()));
  return a;
}

// ---------------------------------------------------------------------------------------------
// Dequantization of hand-built blocks (values worked out by hand from the format rules)

TEST(Dequantize, Q4_0) {
  BlockQ4_0 b{};
  b.d = fp32_to_fp16(0.5f);
  b.qs[0] = 0x1F;   // element 0: 15, element 16: 1
  b.qs[15] = 0x80;  // element 15: 0, element 31: 8
  const auto y = dequant(GgmlType::Q4_0, &b, 32);
  EXPECT_EQ(y[0], 3.5f);    // (15 - 8) * 0.5
  EXPECT_EQ(y[16], -3.5f);  // (1 - 8) * 0.5
  EXPECT_EQ(y[15], -4.0f);  // (0 - 8) * 0.5
  EXPECT_EQ(y[31], 0.0f);   // (8 - 8) * 0.5
  EXPECT_EQ(y[1], -4.0f);
}

TEST(Dequantize, Q4_1) {
  BlockQ4_1 b{};
  b.d = fp32_to_fp16(0.25f);
  b.m = fp32_to_fp16(-1.0f);
  b.qs[2] = 0xA3;  // element 2: 3, element 18: 10
  const auto y = dequant(GgmlType::Q4_1, &b, 32);
  EXPECT_EQ(y[2], -0.25f);  // 3 * 0.25 - 1
  EXPECT_EQ(y[18], 1.5f);   // 10 * 0.25 - 1
  EXPECT_EQ(y[0], -1.0f);
}

TEST(Dequantize, Q5_0HighBits) {
  BlockQ5_0 b{};
  b.d = fp32_to_fp16(2.0f);
  b.qs[0] = 0x21;  // element 0: nibble 1, element 16: nibble 2
  b.qs[1] = 0x43;  // element 1: 3, element 17: 4
  // Fifth bits: element 0 (bit 0) and element 17 (bit 17) set, elements 1 and 16 clear.
  const uint32_t qh = (1u << 0) | (1u << 17);
  std::memcpy(b.qh, &qh, 4);
  const auto y = dequant(GgmlType::Q5_0, &b, 32);
  EXPECT_EQ(y[0], 2.0f);     // (1 | 16) - 16 = 1, times 2
  EXPECT_EQ(y[16], -28.0f);  // 2 - 16 = -14, times 2
  EXPECT_EQ(y[1], -26.0f);   // 3 - 16 = -13
  EXPECT_EQ(y[17], 8.0f);    // (4 | 16) - 16 = 4
  EXPECT_EQ(y[31], -32.0f);  // 0 - 16
}

TEST(Dequantize, Q5_1HighBits) {
  BlockQ5_1 b{};
  b.d = fp32_to_fp16(0.5f);
  b.m = fp32_to_fp16(1.0f);
  b.qs[15] = 0xF0;               // element 15: 0, element 31: 15
  const uint32_t qh = 1u << 31;  // element 31's fifth bit
  std::memcpy(b.qh, &qh, 4);
  const auto y = dequant(GgmlType::Q5_1, &b, 32);
  EXPECT_EQ(y[31], 16.5f);  // 31 * 0.5 + 1
  EXPECT_EQ(y[15], 1.0f);
}

TEST(Dequantize, Q8_0) {
  BlockQ8_0 b{};
  b.d = fp32_to_fp16(0.25f);
  b.qs[3] = -7;
  b.qs[31] = -128;
  const auto y = dequant(GgmlType::Q8_0, &b, 32);
  EXPECT_EQ(y[3], -1.75f);
  EXPECT_EQ(y[31], -32.0f);
  EXPECT_EQ(y[0], 0.0f);
}

TEST(Dequantize, Q4_KScalesAndMins) {
  BlockQ4_K b{};
  b.d = fp32_to_fp16(0.5f);
  b.dmin = fp32_to_fp16(0.25f);
  // Sub-block 1: scale 5, min 7 (plain 6-bit fields in bytes 1 and 5).
  b.scales[1] = 5;
  b.scales[5] = 7;
  // Sub-block 4: scale 37 = 0b10'0101, min 50 = 0b11'0010: low nibbles in byte 8, top two bits in
  // bits 6-7 of bytes 0 (scale) and 4 (min).
  b.scales[8] = 0x5 | (0x2 << 4);
  b.scales[0] = uint8_t(2 << 6);
  b.scales[4] = uint8_t(3 << 6);
  b.qs[0] = 0x90;   // element 0 (sub 0): 0; element 32 (sub 1): 9
  b.qs[64] = 0x0B;  // element 128 (chunk 2 low nibbles = sub 4): 11
  const auto y = dequant(GgmlType::Q4_K, &b, 256);
  EXPECT_EQ(y[32], 0.5f * 5 * 9 - 0.25f * 7);      // 20.75
  EXPECT_EQ(y[128], 0.5f * 37 * 11 - 0.25f * 50);  // 191
  EXPECT_EQ(y[0], 0.0f);                           // scale 0, min 0 (top bits of byte 0 belong to sub 4)
}

TEST(Dequantize, Q5_KHighBits) {
  BlockQ5_K b{};
  b.d = fp32_to_fp16(1.0f);
  b.dmin = fp32_to_fp16(1.0f);
  b.scales[2] = 3;                // sub-block 2: scale 3, min 0
  b.scales[3] = 1;                // sub-block 3: scale 1, min 0
  b.qs[32 + 5] = 0x42;            // element 69 (chunk 1 low = sub 2): 2; element 101 (sub 3): 4
  b.qh[5] = (1 << 2) | (1 << 3);  // fifth bits of elements 64+5 (bit 2c) and 96+5 (bit 2c+1), c = 1
  const auto y = dequant(GgmlType::Q5_K, &b, 256);
  EXPECT_EQ(y[69], 3.0f * (2 + 16));
  EXPECT_EQ(y[101], 1.0f * (4 + 16));
}

TEST(Dequantize, Q6_KScaleLastAndSigned) {
  BlockQ6_K b{};
  b.d = fp32_to_fp16(0.5f);  // stored after the quants and scales
  b.scales[0] = -3;
  b.scales[6] = 5;  // elements 96-111: l + 96 with l < 16 uses scale is + 6
  b.scales[15] = -128;
  // Element 0: low 4 bits from ql[0] low nibble, high 2 bits from qh[0] bits 0-1: q = 0x3A = 58.
  b.ql[0] = 0x0A;
  b.qh[0] = 0x03;
  // Element 96: ql[32] high nibble 0x7, qh[0] bits 6-7 = 0 -> q = 7.
  b.ql[32] = 0x70;
  // Element 255 (second half, l = 31, fourth group): ql[64+63] high nibble, qh[32+31] bits 6-7.
  b.ql[127] = 0xF0;
  b.qh[63] = 0xC0;  // q = 63
  const auto y = dequant(GgmlType::Q6_K, &b, 256);
  EXPECT_EQ(y[0], 0.5f * -3 * (58 - 32));
  EXPECT_EQ(y[96], 0.5f * 5 * (7 - 32));
  EXPECT_EQ(y[255], 0.5f * -128 * (63 - 32));
  EXPECT_EQ(y[1], 0.5f * -3 * (0 - 32));
}

TEST(Dequantize, FloatTypes) {
  const fp16_t h[2] = {0x3C00, 0xC500};  // 1.0, -5.0
  EXPECT_EQ(dequant(GgmlType::F16, h, 2), (std::vector<float>{1.0f, -5.0f}));
  const uint16_t bf[2] = {0x3F80, 0xC0A0};  // 1.0, -5.0
  EXPECT_EQ(dequant(GgmlType::BF16, bf, 2), (std::vector<float>{1.0f, -5.0f}));
}

TEST(Dequantize, RejectsPartialBlocksAndUnknownTypes) {
  float out[64];
  uint8_t in[64] = {};
  EXPECT_THROW(dequantize_row(GgmlType::Q8_0, in, out, 31), Error);
  EXPECT_THROW(dequantize_row(GgmlType::Q2_K, in, out, 256), Error);
  EXPECT_THROW(quantize_row_reference(GgmlType::Q3_K, out, in, 256), Error);
}

// Quantizing and dequantizing with the reference returns each value within the error its format
// allows, as a fraction of the block's largest magnitude A (worked out from each quantizer):
// Q4_0/Q5_0 map -A..A onto 16/32 levels with the top one clamped (one step: A/8, A/16); Q4_1/Q5_1
// half a step of (max - min) <= 2A; K-quants add the rounding of their 6/8-bit sub-block scales and
// mins; float types their mantissa.
TEST(QuantizeReference, RoundTripWithinTheFormatsError) {
  std::mt19937 rng(1);
  struct Case {
    GgmlType type;
    double max_err;  // fraction of the block's absmax
  };
  const Case cases[] = {{GgmlType::F32, 0.0},        {GgmlType::F16, 1.0 / 2048}, {GgmlType::BF16, 1.0 / 256},
                        {GgmlType::Q8_0, 1.1 / 254}, {GgmlType::Q4_0, 1.01 / 8},  {GgmlType::Q5_0, 1.01 / 16},
                        {GgmlType::Q4_1, 1.05 / 15}, {GgmlType::Q5_1, 1.05 / 31}, {GgmlType::Q4_K, 0.1},
                        {GgmlType::Q5_K, 0.06},      {GgmlType::Q6_K, 0.035}};
  for (const Case& c : cases) {
    const int64_t n = 1024;
    const std::vector<float> x = random_floats(rng, n);
    std::vector<uint8_t> q(row_bytes(c.type, n));
    quantize_row_reference(c.type, x.data(), q.data(), n);
    const std::vector<float> y = dequant(c.type, q.data(), n);
    // Float types: relative to each element itself.
    const int64_t blk = type_traits(c.type).block_elems;
    double worst = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += blk) {
      double amax = 0;
      for (int64_t i = b0; i < b0 + blk; ++i) amax = std::max(amax, std::fabs(double(x[size_t(i)])));
      for (int64_t i = b0; i < b0 + blk; ++i) {
        const double err = std::fabs(double(y[size_t(i)]) - x[size_t(i)]);
        ASSERT_LE(err, c.max_err * amax) << tname(c.type) << " element " << i;
        worst = std::max(worst, amax > 0 ? err / amax : 0.0);
      }
    }
    // The bound is not vacuous: the format does lose something (except F32).
    if (c.type != GgmlType::F32) EXPECT_GT(worst, c.max_err * 0.2) << tname(c.type);
  }
}

// ---------------------------------------------------------------------------------------------
// SIMD tables against the reference

TEST(KernelTables, DispatchIsSafe) {
  const CpuFeatures& f = cpu_features();
  EXPECT_TRUE(f.avx2 && f.fma && f.f16c);  // the binary is built for them
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
  EXPECT_EQ(avx512_kernels() != nullptr, avx512);
  EXPECT_EQ(amx_kernels() != nullptr, avx512 && f.amx_int8);
  EXPECT_STREQ(best_kernels().name, amx_kernels() ? "amx" : avx512 ? "avx512" : "avx2");
  EXPECT_STREQ(kernels_by_name("auto").name, best_kernels().name);
  EXPECT_STREQ(kernels_by_name("reference").name, "reference");
  EXPECT_STREQ(kernels_by_name("avx2").name, "avx2");
  EXPECT_THROW(kernels_by_name("sse2"), Error);
  if (avx512) EXPECT_STREQ(kernels_by_name("avx512").name, "avx512");
  else EXPECT_THROW(kernels_by_name("avx512"), Error);
  if (amx_kernels()) EXPECT_STREQ(kernels_by_name("amx").name, "amx");
  else EXPECT_THROW(kernels_by_name("amx"), Error);
  for (const KernelTable* k : {&reference_kernels(), &avx2_kernels()}) {
    for (GgmlType t : kWeightTypes) {
      EXPECT_NE(k->vec_dot[int(t)], nullptr) << k->name << " " << tname(t);
      EXPECT_NE(k->gemm[int(t)], nullptr) << k->name << " " << tname(t);
      EXPECT_NE(k->quantize[int(activation_type(t))], nullptr) << k->name << " " << tname(t);
    }
  }
}

// The AVX-512 table takes part in every SIMD-against-reference test below (simd_tables()) when
// the CPU has it. Without it those tests cover AVX2 only: this test says so as a named skip, which
// ctest's and gtest's summaries list, instead of the AVX-512 cases vanishing silently.
TEST(KernelTables, Avx512TableIsTested) {
  const CpuFeatures& f = cpu_features();
  if (!(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni))
    GTEST_SKIP() << "this CPU lacks AVX-512 (F, BW, VL, DQ and VNNI): the AVX-512 kernels are not tested";
  const std::vector<const KernelTable*> tables = simd_tables();
  ASSERT_GE(tables.size(), 2u);
  EXPECT_STREQ(tables[1]->name, "avx512");
}

// Likewise for the AMX table: where the CPU (or the OS) gives no AMX int8 tiles, its kernels are
// not tested, and this named skip says so.
TEST(KernelTables, AmxTableIsTested) {
  if (!amx_kernels())
    GTEST_SKIP() << "this CPU or OS gives no AMX int8 tiles (or lacks AVX-512): the AMX kernels are not tested";
  const std::vector<const KernelTable*> tables = simd_tables();
  ASSERT_EQ(tables.size(), 3u);
  EXPECT_STREQ(tables[2]->name, "amx");
  // It multiplies every interleaved type on tiles; the file layout's kernels are the AVX-512 table's.
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K,
                     GgmlType::Q6_K}) {
    EXPECT_NE(tables[2]->gemm_interleaved[int(t)], tables[1]->gemm_interleaved[int(t)]) << tname(t);
    EXPECT_EQ(tables[2]->gemm[int(t)], tables[1]->gemm[int(t)]) << tname(t);
  }
}

TEST(KernelTables, ActivationQuantizersMatchReferenceBitForBit) {
  std::mt19937 rng(2);
  for (const KernelTable* k : simd_tables()) {
    for (GgmlType at : {GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K}) {
      for (int64_t n : {256, 768, 4096}) {
        std::vector<float> x = random_floats(rng, n, 3.0f);
        // An all-zero block, a block whose extreme is negative, and a tie in magnitude.
        std::fill(x.begin(), x.begin() + 32, 0.0f);
        x[40] = -50.0f;
        x[300 % n] = 50.0f;
        std::vector<uint8_t> want(row_bytes(at, n)), got(row_bytes(at, n), 0xCD);
        reference_kernels().quantize[int(at)](x.data(), want.data(), n);
        k->quantize[int(at)](x.data(), got.data(), n);
        ASSERT_EQ(want, got) << k->name << " " << tname(at) << " n=" << n;
      }
    }
  }
}

TEST(KernelTables, VecDotMatchesReference) {
  std::mt19937 rng(3);
  for (const KernelTable* k : simd_tables()) {
    for (GgmlType type : kWeightTypes) {
      const int64_t blk = std::max<int64_t>(type_traits(type).block_elems, 32);
      // One block, an odd number of blocks (AVX-512 pairs 32-element blocks), many blocks; odd
      // lengths for the float types.
      std::vector<int64_t> sizes = {blk, 3 * blk, 20 * blk, 33 * blk};
      if (blk == 32) sizes.push_back(19 * 32);
      if (type_traits(type).block_elems == 1) sizes.insert(sizes.end(), {1, 7, 45, 641});
      for (int64_t n : sizes) {
        for (int rep = 0; rep < 4; ++rep) {
          const std::vector<uint8_t> w = random_row(type, n, rng);
          const std::vector<float> x = random_floats(rng, n);
          const std::vector<uint8_t> a = quantize_act(reference_kernels(), type, x);
          const std::vector<float> a_deq =
              activation_type(type) == GgmlType::F32 ? x : dequant(activation_type(type), a.data(), n);
          const float want = reference_kernels().vec_dot[int(type)](w.data(), a.data(), n);
          const float got = k->vec_dot[int(type)](w.data(), a.data(), n);
          ASSERT_NEAR(got, want, rounding_bound(type, w.data(), a_deq.data(), n))
              << k->name << " " << tname(type) << " n=" << n;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention on half floats

std::vector<fp16_t> random_halves(std::mt19937& rng, int64_t n, float scale) {
  const std::vector<float> x = random_floats(rng, n, scale);
  std::vector<fp16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = fp32_to_fp16(x[i]);
  return h;
}

std::vector<float> widen(const std::vector<fp16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = fp16_to_fp32(h[i]);
  return x;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// Head sizes: multiples of 8 with and without a 16-element remainder (64: SmolLM2, 256: Gemma 3).
const int64_t kHeadSizes[] = {8, 16, 24, 40, 64, 128, 136, 256};

TEST(F16Attention, ReferenceIsTheRoundedDotProduct) {
  std::mt19937 rng(21);
  const F16AttentionKernels& ref = reference_kernels().f16;
  for (int64_t n : kHeadSizes) {
    const std::vector<fp16_t> a = random_halves(rng, n, 1.0f), b = random_halves(rng, n, 1.0f);
    double exact = 0.0, magnitude = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      exact += double(fp16_to_fp32(a[size_t(i)])) * fp16_to_fp32(b[size_t(i)]);
      magnitude += std::abs(double(fp16_to_fp32(a[size_t(i)])) * fp16_to_fp32(b[size_t(i)]));
    }
    // f32 accumulation over at most n / 16 + 4 roundings of partial sums bounded by magnitude.
    EXPECT_NEAR(f16_dot_reference(a.data(), b.data(), n), exact, magnitude * 1e-6 * double(n / 16 + 4)) << "n=" << n;

    std::vector<float> y = random_floats(rng, n), want(y);
    f16_axpy_reference(0.375f, a.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_TRUE(same_bits(y[size_t(i)], std::fma(0.375f, fp16_to_fp32(a[size_t(i)]), want[size_t(i)])));

    const std::vector<float> x = random_floats(rng, n, 100.0f);
    std::vector<fp16_t> h(static_cast<size_t>(n));
    ref.round(x.data(), h.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(h[size_t(i)], fp32_to_fp16(x[size_t(i)]));
      EXPECT_LE(std::abs(fp16_to_fp32(h[size_t(i)]) - x[size_t(i)]), std::abs(x[size_t(i)]) * 0x1p-11f);
    }
  }
}

TEST(F16Attention, SimdTablesMatchReferenceBitForBit) {
  std::mt19937 rng(22);
  const F16AttentionKernels& ref = reference_kernels().f16;
  for (const KernelTable* k : simd_tables()) {
    ASSERT_TRUE(k->f16.round && k->f16.scores && k->f16.weighted_sum) << k->name;
    for (int64_t n : kHeadSizes) {
      for (int rep = 0; rep < 20; ++rep) {
        // One query against one key, and one weighted value: dot and axpy (onto zeros) exactly.
        const std::vector<fp16_t> a = random_halves(rng, n, 2.0f), b = random_halves(rng, n, 2.0f);
        const std::vector<float> a32 = widen(a);
        float got = 0.0f;
        k->f16.scores(a32.data(), n, 1, b.data(), n, 1, n, &got, 1);
        const float want = f16_dot_reference(a.data(), b.data(), n);
        ASSERT_TRUE(same_bits(want, got)) << k->name << " dot n=" << n << ": " << got << " vs " << want;

        const float alpha = std::ldexp(float(1 + rng() % 1023) / 1024.0f, -int(rng() % 8));
        std::vector<float> y_ref(size_t(n), 0.0f), y_got(size_t(n), -1.0f);
        f16_axpy_reference(alpha, a.data(), y_ref.data(), n);
        k->f16.weighted_sum(&alpha, 1, 1, a.data(), n, 1, n, y_got.data(), n);
        ASSERT_EQ(0, std::memcmp(y_ref.data(), y_got.data(), sizeof(float) * size_t(n))) << k->name << " axpy";

        const std::vector<float> x = random_floats(rng, n, 30.0f);
        std::vector<fp16_t> h_ref(static_cast<size_t>(n)), h_got(static_cast<size_t>(n), 0xFFFF);
        ref.round(x.data(), h_ref.data(), n);
        k->f16.round(x.data(), h_got.data(), n);
        ASSERT_EQ(h_ref, h_got) << k->name << " round n=" << n;
      }
    }
  }
}

// What batched verification relies on: a row's result depends only on its operands, not on where
// the row lies (another cache slot, another row of a batch, any alignment) nor on its neighbours.
TEST(F16Attention, ResultDoesNotDependOnWhereTheRowLies) {
  std::mt19937 rng(23);
  std::vector<const KernelTable*> tables = simd_tables();
  tables.push_back(&reference_kernels());
  for (const KernelTable* k : tables) {
    for (int64_t n : {int64_t(64), int64_t(256), int64_t(24)}) {
      const std::vector<fp16_t> q = random_halves(rng, n, 1.0f), key = random_halves(rng, n, 1.0f);
      const std::vector<float> q32 = widen(q);
      const float weight = 0.25f;
      float alone = 0.0f;
      k->f16.scores(q32.data(), n, 1, key.data(), n, 1, n, &alone, 1);
      std::vector<float> y_alone(static_cast<size_t>(n));
      k->f16.weighted_sum(&weight, 1, 1, key.data(), n, 1, n, y_alone.data(), n);
      // The key as row r of a batch of rows with other contents, at every offset mod 16 elements:
      // alone in a call, and as one of the call's keys (the others weighing 0).
      for (int64_t offset = 0; offset < 16; ++offset) {
        const int32_t rows = 5;
        std::vector<fp16_t> batch = random_halves(rng, offset + rows * n + 16, 1.0f);
        for (int32_t r = 0; r < rows; ++r) {
          fp16_t* row = batch.data() + offset + r * n;
          std::copy(key.begin(), key.end(), row);
          float got = 0.0f;
          k->f16.scores(q32.data(), n, 1, row, n, 1, n, &got, 1);
          ASSERT_TRUE(same_bits(alone, got)) << k->name << " n=" << n << " offset " << offset << " row " << r;
          std::vector<float> ys(size_t(offset + n + 16), 7.0f);
          k->f16.weighted_sum(&weight, 1, 1, row, n, 1, n, ys.data() + offset, n);
          ASSERT_EQ(0, std::memcmp(ys.data() + offset, y_alone.data(), sizeof(float) * size_t(n)))
              << k->name << " axpy n=" << n << " offset " << offset;
          ASSERT_EQ(ys[size_t(offset + n)], 7.0f) << k->name << " axpy wrote past the row";
        }
        std::vector<float> all(static_cast<size_t>(rows));
        k->f16.scores(q32.data(), n, 1, batch.data() + offset, n, rows, n, all.data(), rows);
        for (int32_t r = 0; r < rows; ++r)
          ASSERT_TRUE(same_bits(alone, all[size_t(r)])) << k->name << " n=" << n << " key " << r << " of a call";
        std::vector<float> one_hot(static_cast<size_t>(rows), 0.0f), ys(static_cast<size_t>(n));
        for (int32_t r = 0; r < rows; ++r) {
          std::fill(one_hot.begin(), one_hot.end(), 0.0f);
          one_hot[size_t(r)] = weight;
          k->f16.weighted_sum(one_hot.data(), rows, 1, batch.data() + offset, n, rows, n, ys.data(), n);
          ASSERT_EQ(0, std::memcmp(ys.data(), y_alone.data(), sizeof(float) * size_t(n)))
              << k->name << " weighted sum n=" << n << " key " << r << " of a call";
        }
      }
    }
  }
}

// widen: every half float (all 65,536 bit patterns; NaNs stay NaNs) in every table, exactly.
TEST(F16Attention, WidenIsExactForEveryHalf) {
  std::vector<const KernelTable*> tables = simd_tables();
  tables.push_back(&reference_kernels());
  std::vector<fp16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = fp16_t(i);
  for (const KernelTable* k : tables) {
    ASSERT_TRUE(k->f16.widen) << k->name;
    std::vector<float> y(all.size() + 8, -7.0f);
    k->f16.widen(all.data(), y.data(), int64_t(all.size()) - 8);  // a tail of 8 left out
    for (size_t i = 0; i + 8 < all.size(); ++i) {
      const float want = fp16_to_fp32(all[i]);
      if (std::isnan(want))
        ASSERT_TRUE(std::isnan(y[i])) << k->name << " half " << i;
      else
        ASSERT_TRUE(same_bits(want, y[i])) << k->name << " half " << i << ": " << y[i] << " vs " << want;
    }
    ASSERT_EQ(y[all.size() - 8], -7.0f) << k->name << " widen wrote past n";
  }
}

// The blocked forms (scores, weighted_sum) in every table: each (query, key) score is dot's bits
// on the half-float query, each output row axpy's chain over the nonzero weights in key order,
// whatever the number of query rows in the call (1..kRows, past the tables' register blocks) and
// the strides; a row beyond n_q and the elements past n are not written.
TEST(F16Attention, BlockedFormsArePerRowDotAndAxpyBitForBit) {
  std::mt19937 rng(24);
  std::vector<const KernelTable*> tables = simd_tables();
  tables.push_back(&reference_kernels());
  constexpr int32_t kRows = 19, kKeys = 70;  // past the tables' blocks of 32 keys
  for (const KernelTable* k : tables) {
    ASSERT_TRUE(k->f16.scores && k->f16.weighted_sum) << k->name;
    for (int64_t n : kHeadSizes) {
      const int64_t ldq = n + 8, k_stride = n + 24, ldo = kKeys + 3;  // strides other than n
      const std::vector<fp16_t> q16 = random_halves(rng, kRows * ldq, 1.0f);
      const std::vector<float> q = widen(q16);
      const std::vector<fp16_t> keys = random_halves(rng, kKeys * k_stride, 1.0f);
      // Weights as attention makes them: half floats in [0, 1], some exactly 0 (masked keys), and
      // one key holding an infinity that only zero weights meet (a zero weight must skip it).
      // Sparse: zeros anywhere; dense: only key 5's (so later blocks of keys have none).
      for (const bool sparse : {true, false}) {
        std::vector<float> w(size_t(kRows) * kKeys);
        for (size_t i = 0; i < w.size(); ++i)
          w[i] = sparse && rng() % 4 == 0 ? 0.0f : fp16_to_fp32(fp32_to_fp16(float(1 + rng() % 4095) / 4096.0f));
        std::vector<fp16_t> values = keys;
        for (int32_t r = 0; r < kRows; ++r) w[size_t(r) * kKeys + 5] = 0.0f;
        values[5 * k_stride] = 0x7C00;  // +inf
        for (int32_t n_q : {1, 2, 3, 4, 5, 8, 9, 16, kRows}) {
          std::vector<float> got(size_t(kRows) * ldo, -1.0f);
          k->f16.scores(q.data(), ldq, n_q, keys.data(), k_stride, kKeys, n, got.data(), ldo);
          for (int32_t r = 0; r < kRows; ++r)
            for (int32_t j = 0; j < kKeys; ++j) {
              const float want = r < n_q ? f16_dot_reference(q16.data() + r * ldq, keys.data() + j * k_stride, n) : -1.0f;
              ASSERT_TRUE(same_bits(want, got[size_t(r) * ldo + j]))
                  << k->name << " scores n=" << n << " n_q " << n_q << " row " << r << " key " << j;
            }
          std::vector<float> sums(size_t(kRows) * ldq, -1.0f);
          k->f16.weighted_sum(w.data(), kKeys, n_q, values.data(), k_stride, kKeys, n, sums.data(), ldq);
          for (int32_t r = 0; r < kRows; ++r) {
            std::vector<float> want(size_t(ldq), -1.0f);
            if (r < n_q) {
              std::fill(want.begin(), want.begin() + n, 0.0f);
              for (int32_t j = 0; j < kKeys; ++j)
                if (w[size_t(r) * kKeys + j] != 0.0f)
                  f16_axpy_reference(w[size_t(r) * kKeys + j], values.data() + j * k_stride, want.data(), n);
            }
            ASSERT_EQ(0, std::memcmp(want.data(), sums.data() + size_t(r) * ldq, sizeof(float) * size_t(ldq)))
                << k->name << " weighted_sum n=" << n << " n_q " << n_q << " row " << r << (sparse ? " sparse" : " dense");
          }
        }
      }
    }
  }
}

// The reference dot products themselves against the f32 dot of the dequantized operands.
TEST(KernelTables, ReferenceVecDotIsTheDequantizedDot) {
  std::mt19937 rng(4);
  for (GgmlType type : kWeightTypes) {
    const int64_t n = 512;
    const std::vector<uint8_t> w = random_row(type, n, rng);
    const std::vector<float> x = random_floats(rng, n);
    const std::vector<uint8_t> a = quantize_act(reference_kernels(), type, x);
    const GgmlType at = activation_type(type);
    const std::vector<float> a_deq = at == GgmlType::F32 ? x : dequant(at, a.data(), n);
    const std::vector<float> wd = dequant(type, w.data(), n);
    double exact = 0.0;
    for (int64_t i = 0; i < n; ++i) exact += double(wd[size_t(i)]) * a_deq[size_t(i)];
    double tol = rounding_bound(type, w.data(), a_deq.data(), n);
    // Q8_1 carries s = d * sum(q) rounded to f16 for the m term: |m| * |s| * 2^-11 per block.
    if (at == GgmlType::Q8_1) {
      const std::vector<float> off = offset_magnitudes(type, w.data(), n);
      for (int64_t i = 0; i < n; ++i) tol += off[size_t(i)] * std::fabs(a_deq[size_t(i)]) / 2048.0 * 1.01;
    }
    EXPECT_NEAR(reference_kernels().vec_dot[int(type)](w.data(), a.data(), n), exact, tol) << tname(type);
  }
}

// ---------------------------------------------------------------------------------------------
// matmul

struct Matrix {
  GgmlType type;
  int64_t rows, cols;
  std::vector<uint8_t> data;
  QMatrix q() const { return {type, data.data(), rows, cols, row_bytes(type, cols)}; }
};

Matrix random_matrix(GgmlType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  Matrix m{type, rows, cols, {}};
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<uint8_t> row = random_row(type, cols, rng);
    m.data.insert(m.data.end(), row.begin(), row.end());
  }
  return m;
}

// Checks y (n_tokens x ldy, the first n_out columns) against want within per-entry bounds.
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::vector<double>& tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i)
    if (!(std::fabs(double(got[i]) - want[i]) <= tol[i])) {
      ADD_FAILURE() << what << ": entry " << i << " got " << got[i] << " want " << want[i] << " tol "
                    << tol[i];
      ++bad;
    }
}

// The exact product the matmul tests measure against: each weight row dequantized by the scalar
// reference, dotted in double. y[t * ldy + r] for t < n_tokens, r < w.rows.
void matmul_reference(const QMatrix& w, const float* x, int64_t n_tokens, float* y, int64_t ldy) {
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.data + size_t(r) * w.row_stride, row.data(), w.cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      double sum = 0.0;
      for (int64_t i = 0; i < w.cols; ++i) sum += double(row[size_t(i)]) * double(x[t * w.cols + i]);
      y[t * ldy + r] = float(sum);
    }
  }
}

TEST(Matmul, TablesThreadsAndShapesAgreeWithReference) {
  std::mt19937 rng(5);
  struct Shape {
    int64_t rows, cols32, colsK;
  };
  const Shape shapes[] = {{1, 160, 256}, {7, 640, 512}, {37, 96, 768}, {100, 64, 256}};
  const int64_t token_counts[] = {1, 3, 5, 8, 17, 64, 67};  // 5, 8: the few-token kernels' groups
  for (GgmlType type : kWeightTypes) {
    const bool k_quant = type_traits(type).block_elems == kQKK;
    for (const Shape& s : shapes) {
      const int64_t cols = k_quant ? s.colsK : (type_traits(type).block_elems == 1 ? s.cols32 + 3 : s.cols32);
      const Matrix w = random_matrix(type, s.rows, cols, rng);
      const int64_t max_tokens = 67;
      const std::vector<float> x = random_floats(rng, max_tokens * cols);
      // Exact f32 products and the activation-quantization bound for every (token, row).
      std::vector<float> exact(size_t(max_tokens * s.rows));
      std::vector<double> qbound(exact.size()), rbound(exact.size());
      matmul_reference(w.q(), x.data(), max_tokens, exact.data(), s.rows);
      for (int64_t t = 0; t < max_tokens; ++t) {
        const std::vector<float> xt(x.begin() + t * cols, x.begin() + (t + 1) * cols);
        const std::vector<uint8_t> a = quantize_act(reference_kernels(), type, xt);
        const GgmlType at = activation_type(type);
        const std::vector<float> a_deq = at == GgmlType::F32 ? xt : dequant(at, a.data(), cols);
        for (int64_t r = 0; r < s.rows; ++r) {
          const uint8_t* row = w.data.data() + size_t(r) * row_bytes(type, cols);
          qbound[size_t(t * s.rows + r)] = quantization_bound(type, row, x.data() + t * cols, cols);
          rbound[size_t(t * s.rows + r)] = rounding_bound(type, row, a_deq.data(), cols);
        }
      }
      for (int64_t nt : token_counts) {
        const size_t n_out = size_t(nt * s.rows);
        const std::vector<float> want_exact(exact.begin(), exact.begin() + n_out);
        // The reference table through matmul (one thread): within quantization error of exact.
        ThreadPool pool1(1);
        MatmulContext ref_ctx(pool1, reference_kernels());
        std::vector<float> ref(n_out);
        matmul(ref_ctx, w.q(), x.data(), nt, ref.data(), s.rows);
        expect_close(ref, want_exact, {qbound.begin(), qbound.begin() + n_out},
                     "reference matmul " + tname(type) + " tokens " + std::to_string(nt));
        for (const KernelTable* k : simd_tables()) {
          for (int threads : {1, 2, 3}) {
            ThreadPool pool(threads);
            MatmulContext ctx(pool, *k);
            std::vector<float> got(n_out, NAN);
            matmul(ctx, w.q(), x.data(), nt, got.data(), s.rows);
            const std::string what = std::string(k->name) + " " + tname(type) + " rows " +
                                     std::to_string(s.rows) + " cols " + std::to_string(cols) + " tokens " +
                                     std::to_string(nt) + " threads " + std::to_string(threads);
            expect_close(got, ref, {rbound.begin(), rbound.begin() + n_out}, "matmul " + what);
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(Matmul, RowsSubsetAndStridedOutput) {
  std::mt19937 rng(6);
  for (GgmlType type :
       {GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F32}) {
    const int64_t cols = type_traits(type).block_elems == kQKK ? 512 : 640;
    const int64_t rows = 300;
    const Matrix w = random_matrix(type, rows, cols, rng);
    // Unsorted, repeated, runs of consecutive ids, and the last row.
    std::vector<int32_t> ids = {299, 0, 1, 2, 3, 150, 7, 7, 298, 42, 43, 44, 45, 46, 100};
    for (int i = 0; i < 40; ++i) ids.push_back(int32_t(rng() % rows));
    const int64_t n_ids = int64_t(ids.size());
    for (int64_t nt : {1, 5, 18}) {
      const std::vector<float> x = random_floats(rng, nt * cols);
      // Rounding bounds per (token, row) against the reference table's full product.
      std::vector<double> rbound(size_t(nt * rows));
      for (int64_t t = 0; t < nt; ++t) {
        const std::vector<float> xt(x.begin() + t * cols, x.begin() + (t + 1) * cols);
        const GgmlType at = activation_type(type);
        const std::vector<float> a_deq =
            at == GgmlType::F32 ? xt : dequant(at, quantize_act(reference_kernels(), type, xt).data(), cols);
        for (int64_t r = 0; r < rows; ++r)
          rbound[size_t(t * rows + r)] =
              rounding_bound(type, w.data.data() + size_t(r) * row_bytes(type, cols), a_deq.data(), cols);
      }
      const int64_t ldy = n_ids + 5;  // padded output rows
      ThreadPool pool1(1);
      MatmulContext ref_ctx(pool1, reference_kernels());
      std::vector<float> full(size_t(nt * rows));
      matmul(ref_ctx, w.q(), x.data(), nt, full.data(), rows);
      for (const KernelTable* k : simd_tables()) {
        for (int threads : {1, 2, 3}) {
          ThreadPool pool(threads);
          MatmulContext ctx(pool, *k);
          std::vector<float> got(size_t(nt * ldy), -7.0f);
          matmul_rows(ctx, w.q(), ids.data(), n_ids, x.data(), nt, got.data(), ldy);
          for (int64_t t = 0; t < nt; ++t) {
            for (int64_t j = 0; j < n_ids; ++j) {
              const size_t ref = size_t(t * rows + ids[size_t(j)]);
              ASSERT_NEAR(got[size_t(t * ldy + j)], full[ref], rbound[ref])
                  << k->name << " " << tname(type) << " token " << t << " id " << ids[size_t(j)];
            }
            for (int64_t j = n_ids; j < ldy; ++j)
              ASSERT_EQ(got[size_t(t * ldy + j)], -7.0f) << "padding written";
          }
        }
      }
    }
  }
}

// A token's result must not depend on the other tokens in the call, the thread count, or whether
// its row goes through matmul or matmul_rows: speculative decoding verifies a batch of drafted
// tokens and must reproduce one-token decoding exactly. So: bitwise equality, no tolerance.
namespace {

// Each of the first n_tokens tokens of x alone through w, on one thread: the one-token decoding
// path, [n_tokens][w.rows].
std::vector<float> one_token_products(const KernelTable& k, const QMatrix& w, const std::vector<float>& x,
                                      int64_t n_tokens) {
  ThreadPool pool(1);
  MatmulContext ctx(pool, k);
  std::vector<float> alone(size_t(n_tokens * w.rows));
  for (int64_t t = 0; t < n_tokens; ++t)
    matmul(ctx, w, x.data() + t * w.cols, 1, alone.data() + t * w.rows, w.rows);
  return alone;
}

// y, one call's [n][rows] products of tokens first..first + n - 1, against those tokens' rows of
// `alone` (one_token_products), every element equal.
::testing::AssertionResult equals_one_token_products(const std::vector<float>& y, const std::vector<float>& alone,
                                                     int64_t first, int64_t rows) {
  for (size_t i = 0; i < y.size(); ++i)
    if (!(y[i] == alone[size_t(first * rows) + i]))
      return ::testing::AssertionFailure() << "position " << i / size_t(rows) << " row " << i % size_t(rows)
                                           << ": " << y[i] << " in the call, " << alone[size_t(first * rows) + i]
                                           << " alone";
  return ::testing::AssertionSuccess();
}

// cols32 / colsK: the column count for the 32-element formats / the K-quants.
void expect_batch_invariant(int64_t cols32, int64_t colsK, uint32_t seed) {
  std::mt19937 rng(seed);
  for (GgmlType type : kWeightTypes) {
    const int64_t cols = type_traits(type).block_elems == kQKK ? colsK : cols32;
    const int64_t rows = 37;  // two full tiles of 16 rows and a short one
    const Matrix w = random_matrix(type, rows, cols, rng);
    const int64_t max_tokens = 67;
    const std::vector<float> x = random_floats(rng, max_tokens * cols);
    for (const KernelTable* k : simd_tables()) {
      const std::vector<float> alone = one_token_products(*k, w.q(), x, max_tokens);
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        MatmulContext ctx(pool, *k);
        // Every count of the few-token kernels (1-16: verification of a draft, batched decode),
        // then counts past a group of 8 tokens and many-token calls; each call starting at token
        // `first`, so a token sits at every position of a batch across the calls.
        std::vector<int64_t> counts;
        for (int64_t nt = 1; nt <= 16; ++nt) counts.push_back(nt);
        for (int64_t nt : {17, 24, 31, 32, 33, 48, 64, 67}) counts.push_back(nt);
        for (int64_t nt : counts)
          for (int64_t first : {int64_t(0), max_tokens - nt, (max_tokens - nt) / 2}) {
            std::vector<float> y(size_t(nt * rows));
            matmul(ctx, w.q(), x.data() + first * cols, nt, y.data(), rows);
            ASSERT_TRUE(equals_one_token_products(y, alone, first, rows))
                << k->name << " " << tname(type) << " cols " << cols << " tokens " << nt << " from token " << first
                << " threads " << threads;
          }
        // Gathered rows (matmul_rows: a row at any position of the gather, repeated ids, a tail
        // shorter than a row block) for every few-token count and past a group of 8 tokens.
        std::vector<int32_t> ids = {36, 0, 5, 6, 7, 20, 36, 1, 2, 3, 4};
        for (int64_t nt : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16}) {
          std::vector<float> y(size_t(nt) * ids.size());
          matmul_rows(ctx, w.q(), ids.data(), int64_t(ids.size()), x.data(), nt, y.data(),
                      int64_t(ids.size()));
          for (int64_t t = 0; t < nt; ++t)
            for (size_t j = 0; j < ids.size(); ++j)
              ASSERT_EQ(y[size_t(t) * ids.size() + j], alone[size_t(t * rows + ids[j])])
                  << k->name << " " << tname(type) << " matmul_rows tokens " << nt << " token " << t << " id "
                  << ids[j];
        }
      }
    }
  }
}

}  // namespace

TEST(Matmul, BatchInvariantBitForBit) {
  expect_batch_invariant(160, 768, 10);  // odd block counts (5 and 3): a lone last block
  expect_batch_invariant(640, 512, 11);  // even ones (Gemma's 640 columns)
}

// Interleaved weights (repack.h): the layout reads back to the file's rows (a short last
// tile repeats the last row), and every table that reads it gives the file layout's bits for
// every token count, thread count and tile-aligned row view; a table that does not read it
// multiplies the file's bytes.
std::vector<uint8_t> interleave(const Matrix& w) {
  std::vector<uint8_t> out(interleaved_bytes(w.type, w.rows, w.cols), 0xAB);
  interleave_tiles(w.type, w.data.data(), row_bytes(w.type, w.cols), w.rows, w.cols, 0,
                   (w.rows + kInterleavedRows - 1) / kInterleavedRows, out.data());
  return out;
}

// The matrix w read through its interleaved copy `tiles` (interleave(w)); empty tiles: the file's layout.
QMatrix with_tiles(const Matrix& w, const std::vector<uint8_t>& tiles) {
  QMatrix m = w.q();
  if (!tiles.empty()) {
    m.interleaved = tiles.data();
    m.interleaved_of = m.data;
  }
  return m;
}

const GgmlType kInterleavedTypes[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
                                      GgmlType::Q5_1, GgmlType::Q4_K, GgmlType::Q6_K};
bool is_k_quant(GgmlType type) { return type_traits(type).block_elems == kQKK; }

TEST(Interleaved, RowsReadBackAndShortTilesRepeatTheLastRow) {
  std::mt19937 rng(21);
  for (GgmlType type : kInterleavedTypes)
  for (int64_t rows : {1, 15, 16, 17, 37})
    for (int64_t blocks : {1, 5, 20}) {
      const int64_t cols = blocks * type_traits(type).block_elems;
      const Matrix w = random_matrix(type, rows, cols, rng);
      const std::vector<uint8_t> packed = interleave(w);
      const size_t rb = row_bytes(type, cols);
      // 32-element formats: the file's 16 rows' bytes, padded to a multiple of 64; K-quants: one
      // record per superblock.
      const size_t record = type == GgmlType::Q4_K ? Q4KRecord::kBytes : Q6KRecord::kBytes;
      EXPECT_EQ(interleaved_tile_bytes(type, cols), is_k_quant(type) ? size_t(blocks) * record : (16 * rb + 63) / 64 * 64)
          << tname(type);
      const int64_t padded = (rows + 15) / 16 * 16;
      std::vector<uint8_t> back(rb);
      for (int64_t r = 0; r < padded; ++r) {
        deinterleave_row(type, packed.data(), cols, r, back.data());
        const int64_t src = std::min(r, rows - 1);
        ASSERT_EQ(std::memcmp(back.data(), w.data.data() + size_t(src) * rb, rb), 0)
            << tname(type) << " rows " << rows << " cols " << cols << " row " << r;
      }
    }
  EXPECT_FALSE(has_interleaved_layout(GgmlType::Q5_K));
  EXPECT_THROW(interleaved_tile_bytes(GgmlType::Q5_K, 256), Error);
  EXPECT_THROW(interleaved_tile_bytes(GgmlType::Q8_0, 48), Error);
  EXPECT_THROW(interleaved_tile_bytes(GgmlType::Q4_K, 640), Error);
}

TEST(Matmul, InterleavedWeightsGiveTheFileLayoutsBits) {
  std::mt19937 rng(22);
  std::vector<const KernelTable*> tables{&reference_kernels()};
  for (const KernelTable* k : simd_tables()) tables.push_back(k);
  int interleaved_tables = 0;
  for (GgmlType type : kInterleavedTypes)
  for (int64_t cols : is_k_quant(type) ? std::vector<int64_t>{768, 1024} : std::vector<int64_t>{160, 640})
    for (int64_t rows : {37, 300}) {
      const Matrix w = random_matrix(type, rows, cols, rng);
      const std::vector<uint8_t> packed = interleave(w);
      const QMatrix wi = with_tiles(w, packed);
      const int64_t max_tokens = 67;
      const std::vector<float> x = random_floats(rng, max_tokens * cols);
      for (const KernelTable* k : tables) {
        interleaved_tables += k->gemm_interleaved[int(type)] != nullptr && (cols == 160 || cols == 768) && rows == 37;
        // Each token alone on the file's layout: the one-token decoding path.
        const std::vector<float> alone = one_token_products(*k, w.q(), x, max_tokens);
        std::vector<int64_t> counts;
        for (int64_t nt = 1; nt <= 16; ++nt) counts.push_back(nt);
        for (int64_t nt : {17, 24, 31, 32, 33, 48, 64, 67}) counts.push_back(nt);
        for (int threads : {1, 2, 3}) {
          ThreadPool pool(threads);
          MatmulContext ctx(pool, *k);
          for (int64_t nt : counts) {
            if (k == &reference_kernels() && (threads > 1 || nt % 4 != 1)) continue;  // scalar: a sample
            const int64_t first = (max_tokens - nt) / 2;
            std::vector<float> y(size_t(nt * rows), NAN);
            matmul(ctx, wi, x.data() + first * cols, nt, y.data(), rows);
            ASSERT_TRUE(equals_one_token_products(y, alone, first, rows))
                << k->name << " interleaved " << tname(type) << " rows " << rows << " cols " << cols << " tokens " << nt
                << " threads " << threads;
          }
          // A view of rows [16, rows) (starting the second tile) with its part of the interleaved copy.
          QMatrix view = wi;
          view.data += 16 * view.row_stride;
          view.interleaved += interleaved_tile_bytes(type, cols);
          view.interleaved_of = view.data;
          view.rows = rows - 16;
          for (int64_t nt : {1, 5, 9}) {
            std::vector<float> y(size_t(nt * view.rows), NAN);
            matmul(ctx, view, x.data(), nt, y.data(), view.rows);
            for (int64_t t = 0; t < nt; ++t)
              for (int64_t r = 0; r < view.rows; ++r)
                ASSERT_EQ(y[size_t(t * view.rows + r)], alone[size_t(t * rows + 16 + r)])
                    << k->name << " " << tname(type) << " view from row 16, tokens " << nt << " token " << t << " row " << 16 + r;
          }
        }
      }
    }
  // The reference and AVX2 tables, and the AVX-512 and AMX ones where this CPU has them, read the
  // layout of every type.
  EXPECT_EQ(interleaved_tables, 7 * (2 + (avx512_kernels() ? 1 : 0) + (amx_kernels() ? 1 : 0)));
  // A copy pointed at other rows (as a packed subset of an LM head is) multiplies its own rows.
  const Matrix a = random_matrix(GgmlType::Q8_0, 40, 640, rng), b = random_matrix(GgmlType::Q8_0, 40, 640, rng);
  const std::vector<uint8_t> a_tiles = interleave(a);
  QMatrix moved = a.q();
  moved.interleaved = a_tiles.data();
  moved.interleaved_of = moved.data;
  moved.data = b.data.data();
  const std::vector<float> x = random_floats(rng, 3 * 640);
  for (const KernelTable* k : tables) {
    ThreadPool pool(2);
    MatmulContext ctx(pool, *k);
    std::vector<float> got(3 * 40), want(3 * 40);
    matmul(ctx, moved, x.data(), 3, got.data(), 40);
    matmul(ctx, b.q(), x.data(), 3, want.data(), 40);
    EXPECT_EQ(got, want) << k->name << ": a re-pointed copy read the interleaved rows it no longer names";
  }
}

// Calls of more than 16 tokens go through the interleaved tiles in chunks of about 256 KB and
// their tokens in blocks of 16 (token_count.h, for_tile_chunks_and_token_blocks). Matrices whose
// tiles are large (2048 columns: 7 Q8_0 tiles or 14 Q4_K tiles a chunk) and a call of 700 rows per
// thread cross several chunks, with a short last chunk and tile; 17-67 tokens give full and short
// last token blocks. Every row must still be the one-token product's, bit for bit.
TEST(Matmul, TokenBlocksOverTileChunksKeepEveryRowsBits) {
  std::mt19937 rng(31);
  const int64_t rows = 1400 + 5, cols = 2048, max_tokens = 67;
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K}) {
    const Matrix w = random_matrix(type, rows, cols, rng);
    const std::vector<uint8_t> packed = interleave(w);
    const QMatrix wi = with_tiles(w, packed);
    const std::vector<float> x = random_floats(rng, max_tokens * cols);
    for (const KernelTable* k : simd_tables()) {
      if (!k->gemm_interleaved[int(type)]) continue;
      const std::vector<float> alone = one_token_products(*k, w.q(), x, max_tokens);
      for (int threads : {1, 2}) {
        ThreadPool pool(threads);
        MatmulContext ctx(pool, *k);
        for (int64_t nt : {16, 17, 40, 67}) {
          const int64_t first = max_tokens - nt;
          std::vector<float> y(size_t(nt * rows), NAN);
          matmul(ctx, wi, x.data() + first * cols, nt, y.data(), rows);
          ASSERT_TRUE(equals_one_token_products(y, alone, first, rows))
              << k->name << " " << tname(type) << " tokens " << nt << " threads " << threads;
        }
      }
    }
  }
}

// A layer's q/k/v (or gate/up) in one call: each output is bitwise the separate product's, also
// when the products' activation formats differ (two groups), their rows are not whole tiles, a
// pool chunk covers the end of one product and the start of the next (many tokens, large
// grains), and in either layout. Outputs start as NaN, so a row left unwritten fails.
TEST(Matmul, SharedInputProductsEqualSeparateProducts) {
  std::mt19937 rng(7);
  const int64_t cols = 512, max_tokens = 19;
  const std::vector<std::pair<GgmlType, int64_t>> shapes = {
      {GgmlType::Q4_K, 80}, {GgmlType::Q5_0, 37}, {GgmlType::Q6_K, 48}, {GgmlType::Q8_0, 21}};
  std::vector<Matrix> ws;
  std::vector<std::vector<uint8_t>> packed;
  for (const auto& [type, rows] : shapes) {
    ws.push_back(random_matrix(type, rows, cols, rng));
    packed.push_back(interleave(ws.back()));
  }
  const std::vector<float> x = random_floats(rng, max_tokens * cols);
  std::vector<const KernelTable*> tables = simd_tables();
  tables.push_back(&reference_kernels());
  for (const KernelTable* k : tables)
    for (bool tiles : {false, true})
      for (int threads : {1, 2}) {
        ThreadPool pool(threads);
        MatmulContext ctx(pool, *k);
        std::vector<QMatrix> qs;
        for (size_t i = 0; i < ws.size(); ++i)
          qs.push_back(tiles && k->gemm_interleaved[int(ws[i].type)] ? with_tiles(ws[i], packed[i]) : ws[i].q());
        for (int64_t nt : {1, 3, 8, 19}) {
          std::vector<std::vector<float>> want(qs.size()), got(qs.size());
          std::vector<SharedInputProduct> products;
          for (size_t i = 0; i < qs.size(); ++i) {
            want[i].assign(size_t(nt * qs[i].rows), NAN);
            got[i].assign(size_t(nt * qs[i].rows), NAN);
            matmul(ctx, qs[i], x.data(), nt, want[i].data(), qs[i].rows);
            products.push_back({&qs[i], got[i].data(), qs[i].rows});
          }
          matmul_shared_input(ctx, products, x.data(), nt);
          for (size_t i = 0; i < qs.size(); ++i)
            for (size_t e = 0; e < got[i].size(); ++e)
              ASSERT_EQ(got[i][e], want[i][e]) << k->name << (tiles ? " tiles" : " file layout") << " threads "
                                               << threads << " tokens " << nt << " product " << i << " ("
                                               << tname(ws[i].type) << ") token " << e / qs[i].rows << " row "
                                               << e % qs[i].rows;
        }
      }
  // Products must share the column count, and there are at most kMaxSharedInputProducts.
  ThreadPool pool(1);
  MatmulContext ctx(pool, reference_kernels());
  const Matrix other = random_matrix(GgmlType::Q8_0, 16, 256, rng);
  const QMatrix a = ws[3].q(), b = other.q();
  std::vector<float> ya(64), yb(64);
  const SharedInputProduct mixed[] = {{&a, ya.data(), a.rows}, {&b, yb.data(), b.rows}};
  EXPECT_NE(test::error_of([&] { matmul_shared_input(ctx, mixed, x.data(), 1); }).find("512 and 256 columns"),
            std::string::npos);
  const SharedInputProduct five[] = {{&a, ya.data(), a.rows}, {&a, ya.data(), a.rows}, {&a, ya.data(), a.rows},
                                     {&a, ya.data(), a.rows}, {&a, ya.data(), a.rows}};
  EXPECT_NE(test::error_of([&] { matmul_shared_input(ctx, five, x.data(), 1); }).find("5 products, at most 4"),
            std::string::npos);
}

// The AVX2 kernels of the quantized types compute each (row, block) integer exactly and then apply
// the AVX-512 table's float steps in the same order, one row per lane (kernels_avx2_quantized.cpp),
// so the two tables agree bit for bit on those types, in both layouts and for any token count: a
// model gives the same logits on either machine. Named skip where the CPU has no AVX-512.
TEST(Matmul, Avx2AndAvx512TablesGiveTheSameBits) {
  const KernelTable* avx512 = avx512_kernels();
  if (!avx512) GTEST_SKIP() << "this CPU lacks AVX-512: the AVX2 table cannot be compared with it";
  std::mt19937 rng(31);
  std::vector<GgmlType> types(std::begin(kInterleavedTypes), std::end(kInterleavedTypes));
  types.push_back(GgmlType::Q5_K);  // no interleaved layout: the file's on both tables
  for (GgmlType type : types)
    for (int64_t cols : is_k_quant(type) || type == GgmlType::Q5_K ? std::vector<int64_t>{256, 1024}
                                                                     : std::vector<int64_t>{32, 160, 640})
      for (int64_t rows : {5, 37}) {
        const Matrix w = random_matrix(type, rows, cols, rng);
        const std::vector<uint8_t> packed = has_interleaved_layout(type) ? interleave(w) : std::vector<uint8_t>{};
        const QMatrix wf = w.q(), wi = with_tiles(w, packed);
        const int64_t max_tokens = 19;
        const std::vector<float> x = random_floats(rng, max_tokens * cols);
        ThreadPool pool(2);
        MatmulContext ctx2(pool, avx2_kernels()), ctx512(pool, *avx512);
        std::vector<const QMatrix*> layouts{&wf};
        if (!packed.empty()) layouts.push_back(&wi);
        for (const QMatrix* m : layouts)
          for (int64_t nt : {1, 2, 3, 5, 8, 9, 16, 19}) {
            std::vector<float> got(size_t(nt * rows), NAN), want(size_t(nt * rows), NAN);
            matmul(ctx2, *m, x.data(), nt, got.data(), rows);
            matmul(ctx512, *m, x.data(), nt, want.data(), rows);
            for (size_t i = 0; i < got.size(); ++i)
              ASSERT_EQ(got[i], want[i]) << tname(type) << (m == &wi ? " interleaved" : " file layout") << " rows "
                                         << rows << " cols " << cols << " tokens " << nt << " token " << i / rows
                                         << " row " << i % rows;
          }
      }
}

// What the AVX2 table computes, written out per (row, token) in scalar code: each block's exact
// integer dot product, then the float steps of kernels_avx2_quantized.cpp (its top comment) in
// order, one std::fma per fused step. The AVX-512 table takes the same steps (the test above), so
// this pins both to one sequence on any x86 CPU, AVX-512 or not: reordering or fusing a single
// float step in any AVX2 path changes some bits here.
//
// The integers come from the format's own decoding: a block dequantized with its scale set to 1
// (and its offset or min to 0) gives its quants as the kernels multiply them (Q8_0, Q4_0, Q5_0:
// q - bias; Q4_1, Q5_1: q; Q4_K, Q5_K: sc_j q; Q6_K: sc_j (q - 32)), and with scale 0 and min 1
// it gives -m_j per element (Q4_K, Q5_K).
struct BlockInts {
  std::vector<int32_t> q, m;  // per element; m: only the K-quants with mins
};

BlockInts block_ints(GgmlType type, const uint8_t* block) {
  const TypeTraits& tr = type_traits(type);
  const std::vector<size_t> fields = f16_fields(type);
  std::vector<uint8_t> b(block, block + tr.block_bytes);
  auto decode = [&](float scale, float offset) {
    put_f16(b, fields[0], scale);
    if (fields.size() > 1) put_f16(b, fields[1], offset);
    const std::vector<float> v = dequant(type, b.data(), tr.block_elems);
    return std::vector<int32_t>(v.begin(), v.end());
  };
  BlockInts ints{decode(1.0f, 0.0f), {}};
  if (type == GgmlType::Q4_K || type == GgmlType::Q5_K) ints.m = decode(0.0f, 1.0f);
  return ints;
}

// One row against one token's quantized activations `act` (activation_type(type) blocks).
float float_steps_model(GgmlType type, const uint8_t* row, const uint8_t* act, int64_t cols) {
  const TypeTraits& tr = type_traits(type);
  const GgmlType at = activation_type(type);
  const std::vector<size_t> fields = f16_fields(type);
  float acc = 0.0f;
  for (int64_t b = 0; b < cols / tr.block_elems; ++b) {
    const uint8_t* wb = row + size_t(b) * tr.block_bytes;
    const BlockInts w = block_ints(type, wb);
    const float dw = get_f16(wb + fields[0]);
    if (at == GgmlType::Q8_K) {
      const auto& a = reinterpret_cast<const BlockQ8_K*>(act)[b];
      int32_t isum = 0, m = 0;
      for (int e = 0; e < kQKK; ++e) {
        isum += w.q[size_t(e)] * a.qs[e];
        if (!w.m.empty()) m -= w.m[size_t(e)] * a.qs[e];
      }
      acc = std::fma(float(isum), dw * a.d, acc);  // Q6_K: the offset -32 sc_j is in w.q
      if (!w.m.empty()) acc = std::fma(-float(m), get_f16(wb + fields[1]) * a.d, acc);
    } else {
      const size_t ab = row_bytes(at, kQK);
      const uint8_t* a = act + size_t(b) * ab;
      const auto* qs = reinterpret_cast<const int8_t*>(a + ab - kQK);
      int32_t i = 0;
      for (int e = 0; e < kQK; ++e) i += w.q[size_t(e)] * qs[e];
      const float scaled = float(i) * get_f16(a);
      acc = std::fma(scaled, dw, acc);
      if (at == GgmlType::Q8_1) acc = std::fma(get_f16(wb + fields[1]), get_f16(a + 2), acc);
    }
  }
  return acc;
}

TEST(Matmul, Avx2TableTakesTheDocumentedFloatStepsBitForBit) {
  std::mt19937 rng(33);
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                        GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
    for (int64_t cols : type_traits(type).block_elems == kQKK ? std::vector<int64_t>{256, 1024}
                                                                : std::vector<int64_t>{32, 160, 640}) {
      const int64_t rows = 37, max_tokens = 19;
      const Matrix w = random_matrix(type, rows, cols, rng);
      const std::vector<uint8_t> packed = has_interleaved_layout(type) ? interleave(w) : std::vector<uint8_t>{};
      const std::vector<float> x = random_floats(rng, max_tokens * cols);
      std::vector<float> want(size_t(max_tokens * rows));
      for (int64_t t = 0; t < max_tokens; ++t) {
        const std::vector<uint8_t> a =
            quantize_act(reference_kernels(), type, {x.begin() + t * cols, x.begin() + (t + 1) * cols});
        for (int64_t r = 0; r < rows; ++r)
          want[size_t(t * rows + r)] = float_steps_model(type, w.data.data() + size_t(r) * row_bytes(type, cols),
                                                         a.data(), cols);
      }
      const QMatrix wf = w.q(), wi = with_tiles(w, packed);
      std::vector<const QMatrix*> layouts{&wf};
      if (!packed.empty()) layouts.push_back(&wi);
      ThreadPool pool(2);
      MatmulContext ctx(pool, avx2_kernels());
      for (const QMatrix* m : layouts)
        for (int64_t nt = 1; nt <= max_tokens; ++nt) {
          std::vector<float> got(size_t(nt * rows), NAN);
          matmul(ctx, *m, x.data(), nt, got.data(), rows);
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_EQ(got[i], want[i]) << tname(type) << (m == &wi ? " interleaved" : " file layout") << " cols "
                                       << cols << " tokens " << nt << " token " << i / rows << " row " << i % rows;
        }
    }
}

// The largest integer products the formats allow: every quant at its extreme (Q8_0: -128 and
// 127; 4-, 5- and 6-bit: all bits set; K-quant scales and mins at their largest) against
// activations that all quantize to +127 or all to -127. The AVX2 kernels keep sums of products in
// int16 where the bounds allow (kernels_avx2_quantized.cpp), and an overflow there would be far
// off; every table, in both layouts and for one to many tokens, must match the scalar reference's
// exact integers up to float rounding.
TEST(Matmul, ExtremeQuantsDoNotOverflow) {
  const int64_t rows = 24;
  std::vector<const KernelTable*> tables = simd_tables();
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K,
                        GgmlType::Q5_K, GgmlType::Q6_K}) {
    const int64_t cols = is_k_quant(type) || type == GgmlType::Q5_K ? 512 : 256;
    const TypeTraits& tr = type_traits(type);
    Matrix w{type, rows, cols, std::vector<uint8_t>(row_bytes(type, cols) * rows, 0xFF)};
    const std::vector<size_t> fields = f16_fields(type);
    for (size_t blk = 0; blk < w.data.size() / tr.block_bytes; ++blk) {
      const size_t o = blk * tr.block_bytes;
      if (type == GgmlType::Q8_0)  // rows alternate between all -128 and all 127
        std::memset(&w.data[o + 2], blk / (cols / kQK) % 2 ? 0x7F : 0x80, kQK);
      if (type == GgmlType::Q6_K)  // scales alternate between 127 and -128
        for (int j = 0; j < 16; ++j) w.data[o + offsetof(BlockQ6_K, scales) + j] = j % 2 ? 0x80 : 0x7F;
      for (size_t f = 0; f < fields.size(); ++f) put_f16(w.data, o + fields[f], f == 0 ? 0.01f : 0.001f);
    }
    const std::vector<uint8_t> packed = has_interleaved_layout(type) ? interleave(w) : std::vector<uint8_t>{};
    const QMatrix wi = with_tiles(w, packed);
    for (float sign : {1.0f, -1.0f}) {
      const int64_t max_tokens = 17;
      const std::vector<float> x(size_t(max_tokens * cols), sign);
      std::vector<float> want(size_t(max_tokens * rows));
      {
        ThreadPool pool(1);
        MatmulContext ctx(pool, reference_kernels());
        matmul(ctx, w.q(), x.data(), max_tokens, want.data(), rows);
      }
      for (const KernelTable* k : tables)
        for (int64_t nt : {1, 2, 8, 17}) {
          ThreadPool pool(1);
          MatmulContext ctx(pool, *k);
          for (const QMatrix& m : {w.q(), wi}) {
            std::vector<float> got(size_t(nt * rows), NAN);
            matmul(ctx, m, x.data(), nt, got.data(), rows);
            for (size_t i = 0; i < got.size(); ++i)
              ASSERT_NEAR(got[i], want[i], 1e-4 * std::fabs(want[i]) + 1e-3)
                  << k->name << " " << tname(type) << (m.interleaved ? " interleaved" : " file layout") << " tokens "
                  << nt << " sign " << sign << " token " << i / rows << " row " << i % rows;
          }
        }
    }
  }
}

TEST(Matmul, RejectsBadInput) {
  ThreadPool pool(1);
  MatmulContext ctx(pool, best_kernels());
  std::vector<uint8_t> data(4096);
  float x[64] = {}, y[64] = {};
  const QMatrix partial{GgmlType::Q8_0, data.data(), 2, 48, 0};  // 48 is not whole blocks
  EXPECT_THROW(matmul(ctx, partial, x, 1, y, 2), Error);
  const QMatrix unsupported{GgmlType::Q2_K, data.data(), 1, 256, 84};
  EXPECT_THROW(matmul(ctx, unsupported, x, 1, y, 1), Error);
  const QMatrix ok{GgmlType::Q8_0, data.data(), 2, 32, 34};
  const int32_t bad_ids[] = {0, 2};
  EXPECT_THROW(matmul_rows(ctx, ok, bad_ids, 2, x, 1, y, 2), Error);
}

TEST(Matmul, ReservedScratchIsReused) {
  ThreadPool pool(2);
  MatmulContext ctx(pool, best_kernels());
  ctx.reserve(64, 2048);
  uint8_t* p = ctx.scratch(0);
  std::mt19937 rng(7);
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q6_K}) {
    const Matrix w = random_matrix(type, 16, 2048, rng);
    const std::vector<float> x = random_floats(rng, 64 * 2048);
    std::vector<float> y(64 * 16);
    matmul(ctx, w.q(), x.data(), 64, y.data(), 16);
    EXPECT_EQ(ctx.scratch(0), p) << "matmul reallocated the reserved scratch for " << tname(type);
  }
}

// ---------------------------------------------------------------------------------------------
// Thread pool

TEST(ThreadPool, ManySmallCallsCoverEveryIndexOnce) {
  std::mt19937 rng(8);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ASSERT_EQ(pool.size(), threads);
    std::vector<std::atomic<int>> hits(200);
    for (int call = 0; call < 2000; ++call) {
      const int64_t n = int64_t(rng() % 200), grain = 1 + int64_t(rng() % 9);
      for (auto& h : hits) h.store(0, std::memory_order_relaxed);
      std::atomic<int> bad{0};
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e, int t) {
        if (t < 0 || t >= threads || b >= e || b % grain != 0 || (e % grain != 0 && e != n)) bad.fetch_add(1);
        for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1, std::memory_order_relaxed);
      });
      ASSERT_EQ(bad.load(), 0) << "threads " << threads << " n " << n << " grain " << grain;
      for (int64_t i = 0; i < 200; ++i)
        ASSERT_EQ(hits[size_t(i)].load(), i < n ? 1 : 0)
            << "index " << i << " n " << n << " threads " << threads;
    }
  }
}

TEST(ThreadPool, UsesAllThreadsAndSurvivesIdleSleep) {
  ThreadPool pool(2);
  // Chunks slow enough that the caller cannot finish them all before the worker joins in.
  auto slow = [](std::atomic<int>& mask) {
    return [&mask](int64_t, int64_t, int t) {
      mask.fetch_or(1 << t);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    };
  };
  std::atomic<int> seen_mask{0};
  pool.parallel_for(64, 1, slow(seen_mask));
  EXPECT_EQ(seen_mask.load(), 3);
  // Long enough for the worker to stop spinning and block; the next call must wake it.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  seen_mask = 0;
  pool.parallel_for(64, 1, slow(seen_mask));
  EXPECT_EQ(seen_mask.load(), 3);
}

// Two pools sharing the cores (a target and a separate draft model, two server slots): once the
// other pool has started a call, this pool's idle worker must stop polling and sleep rather than
// burn a core the other pool needs. The pools poll for an hour when idle, so only the hand-over
// can put the worker to sleep; before it existed, this test waited in vain.
TEST(ThreadPool, IdleWorkersSleepOnceAnotherPoolRuns) {
  const auto hour = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::hours(1));
  ThreadPool target(2, hour), draft(2, hour);
  std::atomic<int> seen_mask{0};
  auto slow = [&seen_mask](int64_t, int64_t, int t) {
    seen_mask.fetch_or(1 << t);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  target.parallel_for(16, 1, slow);
  EXPECT_EQ(seen_mask.load(), 3);
  EXPECT_EQ(target.sleeping_workers(), 0);  // polling for the next call
  draft.parallel_for(16, 1, [](int64_t, int64_t, int) {});
  // A liveness wait, not a speed check: the worker sees the hand-over within microseconds.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (target.sleeping_workers() != 1 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(target.sleeping_workers(), 1) << "the target pool's idle worker kept polling";
  // The target wakes for its next call and takes the polling over from the draft pool.
  seen_mask = 0;
  target.parallel_for(16, 1, slow);
  EXPECT_EQ(seen_mask.load(), 3);
  const auto give_up2 = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (draft.sleeping_workers() != 1 && std::chrono::steady_clock::now() < give_up2)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(draft.sleeping_workers(), 1) << "the draft pool's idle worker kept polling";
}

// A worker that makes no progress (here: stuck in its first chunk until a timer releases it) must
// not hold up its other chunks: the caller takes them over.
TEST(ThreadPool, CallerTakesOverChunksOfAStuckWorker) {
  ThreadPool pool(2);
  std::atomic<bool> release{false};
  std::atomic<int> worker_chunks{0}, caller_chunks{0};
  std::vector<std::atomic<int>> hits(64);
  std::thread timer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    release = true;
  });
  pool.parallel_for(64, 1, [&](int64_t b, int64_t e, int t) {
    for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
    if (t == 1) {
      worker_chunks.fetch_add(1);
      while (!release.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    } else if (caller_chunks.fetch_add(1) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));  // let the worker get stuck first
    }
  });
  timer.join();
  for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << i;
  // 8 chunks, 4 owned by each thread: the worker got stuck in its first, the caller ran the rest.
  EXPECT_EQ(worker_chunks.load(), 1);
  EXPECT_EQ(caller_chunks.load(), 7);
}

TEST(ThreadPool, CallerExceptionPropagatesAfterStartedChunksFinish) {
  ThreadPool pool(3);
  std::atomic<int> started{0}, finished{0};
  EXPECT_THROW(pool.parallel_for(3, 1,
                                 [&](int64_t, int64_t, int t) {
                                   if (t == 0) throw Error("boom");
                                   started.fetch_add(1);
                                   std::this_thread::sleep_for(std::chrono::milliseconds(5));
                                   finished.fetch_add(1);
                                 }),
               Error);
  EXPECT_EQ(started.load(), finished.load()) << "a chunk was still running after parallel_for returned";
  // The pool still works afterwards.
  std::atomic<int> count{0};
  pool.parallel_for(90, 1, [&](int64_t b, int64_t e, int) { count.fetch_add(int(e - b)); });
  EXPECT_EQ(count.load(), 90);
}

// ---------------------------------------------------------------------------------------------
// Real tensors: every table's dot products against the dequantized f32 rows

void check_real_tensor(const GgufFile& f, const std::string& name, GgmlType expect_type) {
  const GgufTensor* t = f.find_tensor(name);
  ASSERT_NE(t, nullptr) << name;
  ASSERT_EQ(t->type, expect_type) << name;
  const int64_t cols = t->ne[0], rows = t->rows();
  const size_t stride = row_bytes(t->type, cols);
  const QMatrix w{t->type, t->data, rows, cols, stride};
  // First rows, some in the middle, and the last ones (the end of the mapping).
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < 6; ++r) ids.push_back(int32_t(r));
  for (int64_t r = rows / 2; r < rows / 2 + 5; ++r) ids.push_back(int32_t(r));
  for (int64_t r = rows - 6; r < rows; ++r) ids.push_back(int32_t(r));
  std::mt19937 rng(9);
  std::vector<const KernelTable*> tables = simd_tables();
  tables.push_back(&reference_kernels());
  // One token (the decode kernels) and nine (the many-token kernels).
  for (int64_t nt : {1, 9}) {
    const std::vector<float> x = random_floats(rng, nt * cols);
    for (const KernelTable* k : tables) {
      ThreadPool pool(2);
      MatmulContext ctx(pool, *k);
      std::vector<float> y(size_t(nt) * ids.size());
      matmul_rows(ctx, w, ids.data(), int64_t(ids.size()), x.data(), nt, y.data(), int64_t(ids.size()));
      for (size_t j = 0; j < ids.size(); ++j) {
        const uint8_t* row = t->data + size_t(ids[j]) * stride;
        const std::vector<float> wd = dequant(t->type, row, cols);
        for (int64_t tok = 0; tok < nt; ++tok) {
          double exact = 0.0;
          for (int64_t i = 0; i < cols; ++i) exact += double(wd[size_t(i)]) * x[size_t(tok * cols + i)];
          const double tol = quantization_bound(t->type, row, x.data() + tok * cols, cols);
          ASSERT_NEAR(y[size_t(tok) * ids.size() + j], exact, tol)
              << k->name << " " << name << " row " << ids[j] << " token " << tok << " of " << nt;
        }
      }
    }
  }
}

TEST(RealTensors, GemmaDotProductsMatchDequantizedRows) {
  test::require_file(test::gemma_path());
  const auto f = GgufFile::open(test::gemma_path());
  check_real_tensor(*f, "blk.0.attn_q.weight", GgmlType::Q5_0);
  check_real_tensor(*f, "blk.0.attn_output.weight", GgmlType::Q4_K);
  check_real_tensor(*f, "blk.0.ffn_down.weight", GgmlType::Q6_K);
  check_real_tensor(*f, "token_embd.weight", GgmlType::Q8_0);
}

TEST(RealTensors, SmolLMDotProductsMatchDequantizedRows) {
  test::require_file(test::smollm_path());
  const auto f = GgufFile::open(test::smollm_path());
  check_real_tensor(*f, "blk.0.attn_q.weight", GgmlType::Q4_1);
  check_real_tensor(*f, "blk.29.ffn_down.weight", GgmlType::Q4_1);
  check_real_tensor(*f, "token_embd.weight", GgmlType::Q8_0);
}

}  // namespace
}  // namespace microspec
