#pragma once
// Private to src/kernels: how the kernel files reach each other's tables.
#include "kernels/kernels.h"

namespace microspec::detail {

// The AVX-512 table. Defined in kernels_avx512.cpp, which is compiled with AVX-512 flags: even
// building the table may execute AVX-512 instructions, so only avx512_kernels() calls it, after
// checking cpu_features().
const KernelTable& avx512_table_unchecked();
// The AMX table (the AVX-512 table with AMX int8 tiles for many-token products on interleaved
// weights), in the same file; only amx_kernels() calls it, after checking cpu_features().amx_int8.
const KernelTable& amx_table_unchecked();

// Sets the AVX2 table's kernels for the quantized weight types (kernels_avx2_quantized.cpp): vec_dot
// and gemm for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, gemm_interleaved for all but Q5_K.
void set_avx2_quantized_kernels(KernelTable& t);

// The constants of the row kernels' e^x (kernels.h, RowKernels), shared by every table so each
// computes the reference's bits: x = n ln2 + r with n the nearest integer to x log2(e) and r =
// x - n ln2_hi - n ln2_lo (two fused multiply-adds; ln2_hi has 9 significant bits, so n ln2_hi is
// exact), e^r by the degree-7 Taylor polynomial (Horner, fused multiply-adds), and n added to the
// result's exponent bits. kExpMin/kExpMax bound the inputs for which that stays a normal float:
// below kExpMin the result is 0, above kExpMax +inf.
constexpr float kExpLog2e = 1.44269502f;
constexpr float kExpLn2Hi = 0.693359375f;
constexpr float kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpC[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
constexpr float kExpMin = -86.5f;              // n >= -125: the result's exponent field stays >= 1
constexpr float kExpMax = 88.72283172607422f;  // the float below 128 ln 2: r <= 0 when n = 128
// GELU-tanh's constants: 0.5 x (1 + tanh(c (x + 0.044715 x^3))) = x / (1 + e^(-2c (x + 0.044715 x^3))).
constexpr float kGeluCubic = 0.044715f;
constexpr float kGeluTwoC = 1.5957691216f;  // 2 sqrt(2 / pi)

}  // namespace microspec::detail
