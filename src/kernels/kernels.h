#pragma once
// Dot-product kernels on quantized weights. Every kernel exists as a scalar reference and as SIMD
// versions with the same signature; tests check each SIMD table against the reference table.
//
// Scheme (as ggml does): activations are quantized once per matmul to the format that the weight
// type's integer dot product consumes (activation_type), then each weight row is dotted with it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/types.h"

namespace microspec {

// Quantizes n floats (n a multiple of the activation type's block) into `out`.
using QuantizeRowFn = void (*)(const float* x, void* out, int64_t n);
// Dot product of one weight row (in its GGUF format) with one activation row (in activation_type).
using VecDotFn = float (*)(const void* weight_row, const void* act_row, int64_t n);
// Many rows times many activations: out[t * ldo + r] = dot(weight row r, activation row t) for
// r < n_rows, t < n_tokens. Weight row r starts at w + id(r) * w_stride bytes, where id(r) is
// row_ids[r], or r when row_ids is null; activation row t (in activation_type, n elements) at
// act + t * act_stride bytes. Each SIMD table tiles this so a weight row is decoded once for several
// tokens; n_tokens == 1 is the decode case and is streamed.
// Batch invariance: out[t * ldo + r] is bitwise the same whatever n_tokens, the other rows and
// tokens in the call, and the split of rows into calls, so a batched verification of drafted
// tokens reproduces one-token decoding exactly (tests check this for every table).
using GemmFn = void (*)(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows,
                        const void* act, size_t act_stride, int64_t n_tokens, int64_t n, float* out,
                        int64_t ldo);
// The same product on weights in the interleaved layout of repack.h: rows [0, n_rows) of the
// tiles that start at `tiles` (so the first row is the first of a tile), out and act as for GemmFn.
// Bitwise the same results as the table's GemmFn on the same rows in the file's format, so a
// matrix gives the same bits repacked or not, and batch invariance carries over.
using InterleavedGemmFn = void (*)(const void* tiles, int64_t n_rows, const void* act, size_t act_stride,
                                   int64_t n_tokens, int64_t n, float* out, int64_t ldo);

// Attention arithmetic on half-float (IEEE binary16) rows of the KV cache; n is a multiple of 8.
// Every table computes bitwise the same results (the reference fixes the order: 16 lanes of fused
// multiply-adds, an 8-element tail into lanes 0..7, then a fixed pairwise reduction), and a result
// depends only on its own operands: not on where the rows lie in memory, nor on the other rows of a
// batch. So attention gives the same bits whatever the table, and batched verification of drafted
// tokens reproduces one-token decoding exactly.
// The per-row arithmetic, which the tables' blocked forms below reproduce bit for bit (their
// specification and test oracle; the model calls the blocked forms):
// dot(a, b) over n half floats, accumulated in f32.
float f16_dot_reference(const fp16_t* a, const fp16_t* b, int64_t n);
// y[i] += alpha * x[i] (x half floats, y f32), one fused multiply-add per element.
void f16_axpy_reference(float alpha, const fp16_t* x, float* y, int64_t n);
// y[i] = x[i] rounded to the nearest half float (ties to even).
using F16RoundFn = void (*)(const float* x, fp16_t* y, int64_t n);
// y[i] = x[i] widened to f32 (exact).
using F16WidenFn = void (*)(const fp16_t* x, float* y, int64_t n);

// Blocked forms of dot and axpy for attention over many query rows at once (all heads of a KV
// group, several queries): each key or value row is read once for all query rows, and every
// result is bitwise the per-row arithmetic's, so a row's result does not depend on the block.
// scores: out[r * ldo + j] = dot(q_r, k_j) in f16_dot_reference's order, for r < n_q, j < n_keys;
// q_r = q + r * ldq holds half-float values widened to f32 (f16-rounded queries), k_j = k + j * k_stride.
using F16ScoresFn = void (*)(const float* q, int64_t ldq, int32_t n_q, const fp16_t* k, int64_t k_stride,
                             int32_t n_keys, int64_t n, float* out, int64_t ldo);
// weighted_sum: out_r = 0, then f16_axpy_reference(w[r * ldw + j], v_j, out_r) for j = 0..n_keys-1 in order,
// skipping the weights that are exactly zero; v_j = v + j * v_stride, out_r = out + r * ldo.
using F16WeightedSumFn = void (*)(const float* w, int64_t ldw, int32_t n_q, const fp16_t* v, int64_t v_stride,
                                  int32_t n_keys, int64_t n, float* out, int64_t ldo);

struct F16AttentionKernels {
  F16RoundFn round;
  F16WidenFn widen;
  F16ScoresFn scores;
  F16WeightedSumFn weighted_sum;
};

// Row arithmetic outside the matrix products: activations, normalisation, the attention softmax.
// Every table computes bitwise the reference's results (the reference fixes each step: explicit
// fused multiply-adds, and where a row is summed, fixed lanes with a fixed reduction), and a
// result depends only on its own row, so the table and the batch do not change any bit.
// exp: y[i] = e^x[i] for x in [-86.5, 88.7228317], 0 below, +inf above,
// NaN for NaN (the steps: kernels_internal.h; within 0.9 ulp of e^x on a sweep of the range). y may be x.
using ExpFn = void (*)(const float* x, float* y, int64_t n);
// Gated activations, in place: g[i] = act(g[i]) * u[i], with silu(x) = x / (1 + e^-x) and
// gelu_tanh(x) = x / (1 + e^(-2c (x + 0.044715 x^3))) (= 0.5 x (1 + tanh(c (x + 0.044715 x^3)))),
// e^ as exp above, x + 0.044715 x^3 as one fused multiply-add of (0.044715 x) x with x.
using GatedActivationFn = void (*)(float* g, const float* u, int64_t n);
// RMSNorm of one row: y[i] = x[i] * s * w[i] with s = 1 / sqrt(float(ss / n) + eps) (f32 steps),
// ss = sum of x[i]^2 in double: element i in lane i % 8 (a fused multiply-add chain per lane),
// then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). y may be x.
using RmsNormFn = void (*)(const float* x, const float* w, int64_t n, float eps, float* y);
// Softmax over the entries a query sees, in place: s_j = x[j] * scale where seen[j] != 0, m = the
// largest s_j, e_j = exp(s_j - m) (0 where not seen), x[j] = e_j * (1 / sum), the e_j summed one by
// one in entry order. That order makes the result depend only on the sequence of seen entries,
// not on where they lie among unseen ones: a drafted token's row in a tree (its ancestors among
// other branches) gets the bits of its row in plain decoding. At least one entry seen.
using SoftmaxFn = void (*)(float* x, const uint8_t* seen, int64_t n, float scale);

struct RowKernels {
  ExpFn exp;
  GatedActivationFn silu_mul;
  GatedActivationFn gelu_tanh_mul;
  RmsNormFn rms_norm;
  SoftmaxFn softmax;
};

constexpr int kMaxTypeId = 40;

struct KernelTable {
  const char* name;                    // "reference", "avx2", "avx512", "amx"
  VecDotFn vec_dot[kMaxTypeId];        // indexed by weight type id; nullptr where unsupported
  QuantizeRowFn quantize[kMaxTypeId];  // indexed by activation type id (F32, Q8_0, Q8_1, Q8_K)
  GemmFn gemm[kMaxTypeId];             // indexed by weight type id; set wherever vec_dot is
  // Indexed by weight type id; set for the types whose interleaved layout (repack.h) this table
  // reads, nullptr elsewhere (weights of those types are then not repacked for it).
  InterleavedGemmFn gemm_interleaved[kMaxTypeId];
  F16AttentionKernels f16;             // attention on the half-float KV cache
  RowKernels rows;                     // activations, normalisation, softmax
};

// Activation format consumed by the dot product of weights of type `weight`:
// F32/F16/BF16 -> F32; Q4_0/Q5_0/Q8_0 -> Q8_0; Q4_1/Q5_1 -> Q8_1; K-quants -> Q8_K.
GgmlType activation_type(GgmlType weight);

const KernelTable& reference_kernels();
const KernelTable& avx2_kernels();
const KernelTable* avx512_kernels();  // nullptr when this CPU lacks AVX-512 F/BW/VL/VNNI
// The AVX-512 table whose interleaved kernels for the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1) and the K-quants Q4_K and Q6_K run groups of 16 tokens on AMX int8 tiles, bitwise the
// AVX-512 table's results; nullptr
// when the CPU lacks AMX-TILE/AMX-INT8, the OS does not enable the tile state, or the kernel
// refuses this process the tile data permission (Linux arch_prctl ARCH_REQ_XCOMP_PERM).
const KernelTable* amx_kernels();
// The fastest table this CPU runs, chosen once at run time.
const KernelTable& best_kernels();
// "auto" (best_kernels), "reference", "avx2", "avx512" or "amx": for benchmarks and for ruling kernels out
// when debugging (the CLI's --kernels). Throws Error for other names or ISAs this CPU lacks.
const KernelTable& kernels_by_name(std::string_view name);

// Scalar reference dequantization of n elements of `type` (n a multiple of the block size): every
// supported weight type and the activation types Q8_1 and Q8_K. Throws Error for other types.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

// Scalar reference quantization of n floats into any supported weight type (F32, F16, BF16, Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) or activation type (Q8_1, Q8_K). Plain round-to-nearest
// without importance weighting: for tests and tiny random models, not for producing real models.
// Throws Error for other types or when n is not a multiple of the block size.
void quantize_row_reference(GgmlType type, const float* src, void* dst, int64_t n);

// Instruction sets usable here: CPUID says the CPU has them AND XGETBV says the OS saves their
// registers (so avx512* are all false under an OS that does not enable the ZMM state).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false;
  bool avx512dq = false;  // the AVX-512 file is compiled with -mavx512dq too, so the table needs it
  // AMX-TILE and AMX-INT8 in CPUID, the tile state enabled in XCR0, and the tile data permission
  // granted to this process (requested once, at detection).
  bool amx_int8 = false;
};
const CpuFeatures& cpu_features();
// The CPU's model name as /proc/cpuinfo gives it ("AMD EPYC ..."), or "unknown CPU".
std::string cpu_model_name();

}  // namespace microspec
