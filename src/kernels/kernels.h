#pragma once
// Dot-product kernels on quantized weights. Every kernel exists as a scalar reference and as SIMD
// versions with the same signature; tests check each SIMD table against the reference table.
//
// Scheme (as ggml does): activations are quantized once per matmul to the format that the weight
// type's integer dot product consumes (activation_type), then each weight row is dotted with it.
#include <cstddef>
#include <cstdint>

#include "kernels/types.h"

namespace microspec {

// Quantizes n floats (n a multiple of the activation type's block) into `out`.
using QuantizeRowFn = void (*)(const float* x, void* out, int64_t n);
// Dot product of one weight row (in its GGUF format) with one activation row (in activation_type).
using VecDotFn = float (*)(const void* weight_row, const void* act_row, int64_t n);

constexpr int kMaxTypeId = 40;

struct KernelTable {
  const char* name;                    // "reference", "avx2", "avx512"
  VecDotFn vec_dot[kMaxTypeId];        // indexed by weight type id; nullptr where unsupported
  QuantizeRowFn quantize[kMaxTypeId];  // indexed by activation type id (F32, Q8_0, Q8_1, Q8_K)
};

// Activation format consumed by the dot product of weights of type `weight`:
// F32/F16/BF16 -> F32; Q4_0/Q5_0/Q8_0 -> Q8_0; Q4_1/Q5_1 -> Q8_1; K-quants -> Q8_K.
GgmlType activation_type(GgmlType weight);

const KernelTable& reference_kernels();
const KernelTable& avx2_kernels();
const KernelTable* avx512_kernels();  // nullptr when this CPU lacks AVX-512 F/BW/VL/VNNI
const KernelTable& best_kernels();     // the fastest table this CPU runs, chosen once at run time

// Scalar reference dequantization of n elements of `type` (n a multiple of the block size).
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false;
};
const CpuFeatures& cpu_features();

}  // namespace microspec
