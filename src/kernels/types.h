#pragma once
// ggml tensor types as stored in GGUF files, and their block layouts.
// Layouts follow ggml's definitions (facts of the file format); see shared/reference/gguf-and-models.md.
#include <cstddef>
#include <cstdint>
#include <string>

namespace microspec {

enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  BF16 = 30,
};

struct TypeTraits {
  const char* name;
  int64_t block_elems;  // elements per block (1 for plain float types)
  size_t block_bytes;   // bytes per block
  bool supported;       // whether microspec reads it: kernels for weight types; I32/I64 index tensors (d2t)
};

// Traits of a raw type id from a file; returns nullptr for ids ggml does not define.
const TypeTraits* type_traits(uint32_t raw_type);
const TypeTraits& type_traits(GgmlType type);  // throws Error for unknown ids
std::string type_name(uint32_t raw_type);       // "Q4_K", or "unknown(123)"

// Bytes for one row of `elems` elements; throws Error if elems is not a multiple of the block size.
size_t row_bytes(GgmlType type, int64_t elems);

constexpr int kQK = 32;    // elements per block of the 32-element formats
constexpr int kQKK = 256;  // elements per block of the K-quant formats

using fp16_t = uint16_t;

#pragma pack(push, 1)
struct BlockQ4_0 {
  fp16_t d;
  uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {
  fp16_t d, m;
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {
  fp16_t d;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {
  fp16_t d, m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
  fp16_t d;
  int8_t qs[kQK];
};
// Activation format paired with Q4_1/Q5_1 weights: s = d * sum(qs).
struct BlockQ8_1 {
  fp16_t d, s;
  int8_t qs[kQK];
};
struct BlockQ4_K {
  fp16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
struct BlockQ5_K {
  fp16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  fp16_t d;
};
// Activation format paired with K-quant weights.
struct BlockQ8_K {
  float d;
  int8_t qs[kQKK];
  int16_t bsums[kQKK / 16];  // sum of each group of 16 qs
};
#pragma pack(pop)

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

float fp16_to_fp32(fp16_t h);
fp16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace microspec
