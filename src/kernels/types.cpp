#include "kernels/types.h"

#include <immintrin.h>

#include <cstring>

#include "util/error.h"

namespace microspec {

namespace {

struct Entry {
  uint32_t id;
  TypeTraits traits;
};

// Block geometry of every type ggml defines up to BF16 (facts of the format). `supported` marks
// those microspec has kernels for.
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},          {1, {"F16", 1, 2, true}},
    {2, {"Q4_0", 32, 18, true}},       {3, {"Q4_1", 32, 20, true}},
    {6, {"Q5_0", 32, 22, true}},       {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},       {9, {"Q8_1", 32, 36, false}},
    {10, {"Q2_K", 256, 84, false}},    {11, {"Q3_K", 256, 110, false}},
    {12, {"Q4_K", 256, 144, true}},    {13, {"Q5_K", 256, 176, true}},
    {14, {"Q6_K", 256, 210, true}},    {15, {"Q8_K", 256, 292, false}},
    {16, {"IQ2_XXS", 256, 66, false}}, {17, {"IQ2_XS", 256, 74, false}},
    {18, {"IQ3_XXS", 256, 98, false}}, {19, {"IQ1_S", 256, 50, false}},
    {20, {"IQ4_NL", 32, 18, false}},   {21, {"IQ3_S", 256, 110, false}},
    {22, {"IQ2_S", 256, 82, false}},   {23, {"IQ4_XS", 256, 136, false}},
    {24, {"I8", 1, 1, false}},         {25, {"I16", 1, 2, false}},
    {26, {"I32", 1, 4, true}},         {27, {"I64", 1, 8, true}},
    {28, {"F64", 1, 8, false}},        {29, {"IQ1_M", 256, 56, false}},
    {30, {"BF16", 1, 2, true}},
};

}  // namespace

const TypeTraits* type_traits(uint32_t raw_type) {
  for (const Entry& e : kTypes)
    if (e.id == raw_type) return &e.traits;
  return nullptr;
}

const TypeTraits& type_traits(GgmlType type) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  if (!t) throw Error("unknown tensor type id " + std::to_string(static_cast<uint32_t>(type)));
  return *t;
}

std::string type_name(uint32_t raw_type) {
  const TypeTraits* t = type_traits(raw_type);
  return t ? std::string(t->name) : "unknown(" + std::to_string(raw_type) + ")";
}

size_t row_bytes(GgmlType type, int64_t elems) {
  const TypeTraits& t = type_traits(type);
  if (elems < 0 || elems % t.block_elems != 0)
    throw Error(std::string("row of ") + std::to_string(elems) + " elements is not a multiple of the " + t.name +
                " block size " + std::to_string(t.block_elems));
  return static_cast<size_t>(elems / t.block_elems) * t.block_bytes;
}

float fp16_to_fp32(fp16_t h) { return _cvtsh_ss(h); }
fp16_t fp32_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

}  // namespace microspec
