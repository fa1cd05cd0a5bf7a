// Device kernels of the CUDA backend (declared in ops.h). The quantized formats' arithmetic mirrors
// src/kernels/kernels_reference.cpp: the same activation quantization, the same integer block sums
// and the same per-block float combination, so only the order of the float sums across blocks differs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/ops.h"
#include "math/ranked_list.h"
#include "sampling/ranked_draw.h"
#include "util/error.h"

namespace microspec::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // matmul: one warp per output row, 8 warps per block

// ---------------------------------------------------------------------------------------------
// Byte-level loads (quantized blocks are packed at odd sizes, so nothing wider is aligned).

__device__ __forceinline__ float h2f(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
__device__ __forceinline__ float round_f16(float x) {
  return __half2float(__float2half_rn(x));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t b) {
  return __uint_as_float(b << 16);
}

__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialization
// may start while its predecessor finishes; it reads nothing the predecessor writes before
// pdl_wait(). Predecessors call pdl_trigger() early so their successor's blocks can be placed as
// theirs drain. Both are no-ops for kernels launched the ordinary way.
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
}

// Launches `kernel` as a programmatic dependent of the previous kernel on the stream (see
// pdl_wait): it may be placed on the GPU while its predecessor drains and waits inside.
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  MS_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Activation quantization: one thread per activation block, the CPU's loops as written.

// Q8_0 block: fp16 d, int8 qs[32] (34 bytes).
__device__ void quant_block_q8_0(const float* x, uint8_t* out, bool with_sum) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const int qoff = with_sum ? 4 : 2;  // Q8_1 has d and s before qs
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int q = __float2int_rn(x[j] * id);
    out[qoff + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
    sum += static_cast<int8_t>(q);
  }
  // Blocks are 34 or 36 bytes at even offsets, so the halves are 2-byte aligned: store them whole.
  // (Storing the two bytes of a half separately lost the low byte under nvcc 13.0 for sm_90.)
  uint16_t* halves = reinterpret_cast<uint16_t*>(out);
  halves[0] = __half_as_ushort(__float2half_rn(d));
  if (with_sum) halves[1] = __half_as_ushort(__float2half_rn(float(sum) * d));
}

// Q8_K block: float d, int8 qs[256], int16 bsums[16] (292 bytes, 4-byte aligned in the scratch).
__device__ void quant_block_q8_k(const float* x, uint8_t* out) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 256; ++j) {
    const float ax = fabsf(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  if (amax == 0.0f) {
    for (int j = 0; j < 292; ++j) out[j] = 0;
    return;
  }
  const float iscale = -127.0f / max;
  int8_t* qs = reinterpret_cast<int8_t*>(out + 4);
  for (int j = 0; j < 256; ++j) qs[j] = static_cast<int8_t>(min(127, __float2int_rn(iscale * x[j])));
  int16_t* bsums = reinterpret_cast<int16_t*>(out + 260);
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += qs[g * 16 + j];
    bsums[g] = static_cast<int16_t>(sum);
  }
  *reinterpret_cast<float*>(out) = 1.0f / iscale;
}

__global__ void k_quantize_act(const float* x, int64_t ldx, int32_t n_tokens, int64_t cols, GgmlType act,
                               uint8_t* out, size_t out_stride) {
  pdl_trigger();
  pdl_wait();
  const int block_elems = act == GgmlType::Q8_K ? 256 : 32;
  const size_t block_bytes = act == GgmlType::Q8_K ? 292 : act == GgmlType::Q8_1 ? 36 : 34;
  const int64_t nb = cols / block_elems;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nb * n_tokens) return;
  const int64_t t = i / nb, b = i % nb;
  const float* xb = x + t * ldx + b * block_elems;
  uint8_t* ob = out + t * out_stride + b * block_bytes;
  if (act == GgmlType::Q8_K)
    quant_block_q8_k(xb, ob);
  else
    quant_block_q8_0(xb, ob, act == GgmlType::Q8_1);
}

// ---------------------------------------------------------------------------------------------
// Block dot products of one weight block with its activation block: kernels_reference.cpp's.

template <GgmlType T>
struct QFormat;

template <>
struct QFormat<GgmlType::Q4_0> {
  static constexpr int kElems = 32, kBytes = 18, kActBytes = 34;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const uint8_t* qs = w + 2;
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 2);
    int sumi = 0;
    for (int j = 0; j < 16; ++j) sumi += ((qs[j] & 0xF) - 8) * aq[j] + ((qs[j] >> 4) - 8) * aq[j + 16];
    return float(sumi) * (h2f(w) * h2f(a));
  }
};

template <>
struct QFormat<GgmlType::Q4_1> {
  static constexpr int kElems = 32, kBytes = 20, kActBytes = 36;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const uint8_t* qs = w + 4;
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 4);
    int sumi = 0;
    for (int j = 0; j < 16; ++j) sumi += (qs[j] & 0xF) * aq[j] + (qs[j] >> 4) * aq[j + 16];
    return float(sumi) * (h2f(w) * h2f(a)) + h2f(w + 2) * h2f(a + 2);
  }
};

template <>
struct QFormat<GgmlType::Q5_0> {
  static constexpr int kElems = 32, kBytes = 22, kActBytes = 34;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const uint32_t h = load_u32(w + 2);
    const uint8_t* qs = w + 6;
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 2);
    int sumi = 0;
    for (int j = 0; j < 16; ++j) {
      const int lo = ((qs[j] & 0xF) | (((h >> j) & 1) << 4)) - 16;
      const int hi = ((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - 16;
      sumi += lo * aq[j] + hi * aq[j + 16];
    }
    return float(sumi) * (h2f(w) * h2f(a));
  }
};

template <>
struct QFormat<GgmlType::Q8_0> {
  static constexpr int kElems = 32, kBytes = 34, kActBytes = 34;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const int8_t* wq = reinterpret_cast<const int8_t*>(w + 2);
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 2);
    int sumi = 0;
    for (int j = 0; j < 32; ++j) sumi += wq[j] * aq[j];
    return float(sumi) * (h2f(w) * h2f(a));
  }
};

template <>
struct QFormat<GgmlType::Q4_K> {
  static constexpr int kElems = 256, kBytes = 144, kActBytes = 292;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const uint8_t* scales = w + 4;
    const uint8_t* qs = w + 16;
    const float ad = *reinterpret_cast<const float*>(a);
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 4);
    const int16_t* bsums = reinterpret_cast<const int16_t*>(a + 260);
    int sumi = 0, summ = 0;
    for (int c = 0; c < 4; ++c) {
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        int dot = 0;
        for (int l = 0; l < 32; ++l) {
          const int q = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
          dot += q * aq[32 * j + l];
        }
        sumi += sc * dot;
        summ += m * (bsums[2 * j] + bsums[2 * j + 1]);
      }
    }
    return h2f(w) * ad * float(sumi) - h2f(w + 2) * ad * float(summ);
  }
};

template <>
struct QFormat<GgmlType::Q6_K> {
  static constexpr int kElems = 256, kBytes = 210, kActBytes = 292;
  __device__ static float dot(const uint8_t* w, const uint8_t* a) {
    const uint8_t* ql0 = w;
    const uint8_t* qh0 = w + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(w + 192);
    const float ad = *reinterpret_cast<const float*>(a);
    const int8_t* aq = reinterpret_cast<const int8_t*>(a + 4);
    int sumi = 0;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = ql0 + 64 * half;
      const uint8_t* qh = qh0 + 32 * half;
      const int8_t* y = aq + 128 * half;
      // Sub-blocks of 16: (l / 16) picks the scale; the four quarter rows are 32 apart.
      int dots[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dots[is + 0] += q1 * y[l];
        dots[is + 2] += q2 * y[l + 32];
        dots[is + 4] += q3 * y[l + 64];
        dots[is + 6] += q4 * y[l + 96];
      }
      for (int s = 0; s < 8; ++s) sumi += scales[8 * half + s] * dots[s];
    }
    return h2f(w + 208) * ad * float(sumi);
  }
};

// One warp per (output row, token): lanes take blocks in turn, then sum across the warp.
template <GgmlType T>
__global__ void k_matmul_q(const uint8_t* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows,
                           int64_t nb, const uint8_t* act, size_t act_stride, int32_t n_tokens, float* y,
                           int64_t ldy, Store store) {
  pdl_trigger();
  pdl_wait();
  using F = QFormat<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t j = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int32_t t = blockIdx.y;
  if (j >= n_rows || t >= n_tokens) return;
  const uint8_t* wr = w + size_t(row_ids ? row_ids[j] : j) * w_stride;
  const uint8_t* ar = act + size_t(t) * act_stride;
  float s = 0.0f;
  for (int64_t b = lane; b < nb; b += kWarp) s += F::dot(wr + b * F::kBytes, ar + b * F::kActBytes);
  s = warp_sum(s);
  if (lane == 0) {
    float* out = y + int64_t(t) * ldy + j;
    *out = store == Store::Accumulate ? *out + s : s;
  }
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16 weights with float activations on CUDA cores (BF16: matmul_bf16_cuda_cores, the
// tensor-core product's peer): one warp per row, 16-byte weight loads,
// up to NT tokens per pass so each weight row is read once for them.

template <GgmlType T>
struct FloatWeight;
template <>
struct FloatWeight<GgmlType::BF16> {
  static constexpr int kBytesPerElem = 2;
  // 8 elements from 16 bytes.
  __device__ static void load8(const uint8_t* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(u[i] << 16);
      out[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
    }
  }
};
template <>
struct FloatWeight<GgmlType::F16> {
  static constexpr int kBytesPerElem = 2;
  __device__ static void load8(const uint8_t* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};
template <>
struct FloatWeight<GgmlType::F32> {
  static constexpr int kBytesPerElem = 4;
  __device__ static void load8(const uint8_t* p, float* out) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  }
};

// Written as explicit fused multiply-adds, so no instantiation can contract it differently (a
// product's bits must not depend on its kernel's token or row tiling: batch invariance).
__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
  float s = w[0] * a.x;
  s = fmaf(w[1], a.y, s);
  s = fmaf(w[2], a.z, s);
  s = fmaf(w[3], a.w, s);
  s = fmaf(w[4], b.x, s);
  s = fmaf(w[5], b.y, s);
  s = fmaf(w[6], b.z, s);
  return fmaf(w[7], b.w, s);
}

// One warp per R consecutive output rows, NT tokens per pass: each 16-byte weight load serves NT
// tokens and each activation load R rows (R > 1 keeps the activation reads of a many-token pass
// under the L1 bandwidth).
template <GgmlType T, int NT, int R>
__global__ void __launch_bounds__(kRowsPerBlock* kWarp)
    k_matmul_f(const uint8_t* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, int64_t cols,
               const float* x, int64_t ldx, float* y, int64_t ldy, Store store) {
  using F = FloatWeight<T>;
  const int lane = threadIdx.x % kWarp;
  const int64_t j0 = (int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp) * R;
  if (j0 >= n_rows) return;
  if (row_ids) pdl_wait();  // the ids may be the previous kernel's output: only the weights load early
  const uint8_t* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t j = j0 + r < n_rows ? j0 + r : n_rows - 1;
    wr[r] = w + size_t(row_ids ? row_ids[j] : j) * w_stride;
  }
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  constexpr int kUnroll = R == 1 ? 8 : 2;  // independent 16-byte weight loads in flight per lane: kUnroll * R
  const int64_t n_chunks = cols / 8;
  int64_t c = lane;
  // The first weight loads do not depend on the previous kernel: issue them before waiting for it.
  float wv[kUnroll][R][8];
  auto load_weights = [&](int64_t chunk) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) F::load8(wr[r] + (chunk + u * kWarp) * 8 * F::kBytesPerElem, wv[u][r]);
  };
  bool full = c + (kUnroll - 1) * kWarp < n_chunks;
  if (full) load_weights(c);
  pdl_wait();
  while (full) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(x + t * ldx + (c + u * kWarp) * 8);
        const float4 a = __ldg(xp), b = __ldg(xp + 1);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][t] += dot8(wv[u][r], a, b);
      }
    }
    c += kUnroll * kWarp;
    full = c + (kUnroll - 1) * kWarp < n_chunks;
    if (full) load_weights(c);
  }
  for (; c < n_chunks; c += kWarp) {
    float wv[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) F::load8(wr[r] + c * 8 * F::kBytesPerElem, wv[r]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xp = reinterpret_cast<const float4*>(x + t * ldx + c * 8);
      const float4 a = __ldg(xp), b = __ldg(xp + 1);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][t] += dot8(wv[r], a, b);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float s = warp_sum(acc[r][t]);
      if (lane == 0 && j0 + r < n_rows) {
        float* out = y + int64_t(t) * ldy + j0 + r;
        *out = store == Store::Accumulate ? *out + s : s;
      }
    }
  }
}

template <GgmlType T, int NT, int R>
void launch_matmul_f_tile(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, float* y,
                          int64_t ldy, Store store, cudaStream_t stream) {
  const int64_t rows_per_block = int64_t(kRowsPerBlock) * R;
  const dim3 grid(unsigned((rows.n_rows + rows_per_block - 1) / rows_per_block));
  // Launched as a programmatic dependent of the previous kernel: its weight stream starts early.
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kRowsPerBlock * kWarp);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  MS_CUDA(cudaLaunchKernelEx(&config, k_matmul_f<T, NT, R>, w.data, w.row_stride, rows.row_ids, rows.n_rows, w.cols,
                             x, ldx, y, ldy, store));
}

template <GgmlType T, int NT>
void launch_matmul_f_rows(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, float* y,
                          int64_t ldy, Store store, cudaStream_t stream) {
  // Four rows per warp where the grid stays large enough to fill the chip, else two.
  if (rows.n_rows >= 16384)
    launch_matmul_f_tile<T, NT, 4>(w, rows, x, ldx, y, ldy, store, stream);
  else
    launch_matmul_f_tile<T, NT, 2>(w, rows, x, ldx, y, ldy, store, stream);
}

template <GgmlType T>
void launch_matmul_f(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens,
                     float* y, int64_t ldy, Store store, cudaStream_t stream) {
  for (int32_t t0 = 0; t0 < n_tokens;) {
    const int32_t left = n_tokens - t0;
    const float* xt = x + int64_t(t0) * ldx;
    float* yt = y + int64_t(t0) * ldy;
    const int nt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    switch (nt) {
      case 8:
        launch_matmul_f_rows<T, 8>(w, rows, xt, ldx, yt, ldy, store, stream);
        break;
      case 4:
        launch_matmul_f_rows<T, 4>(w, rows, xt, ldx, yt, ldy, store, stream);
        break;
      case 2:
        launch_matmul_f_rows<T, 2>(w, rows, xt, ldx, yt, ldy, store, stream);
        break;
      default:
        launch_matmul_f_tile<T, 1, 1>(w, rows, xt, ldx, yt, ldy, store, stream);
    }
    t0 += nt;
  }
}

// ---------------------------------------------------------------------------------------------
// BF16 weights on tensor cores, for one token and for many alike (decode and verification must
// run the same arithmetic per token: greedy output of a speculative step equals plain decoding
// only if a token's logits do not depend on the batch it is in).
//
// mma.sync m16n8k16 (BF16 inputs, float accumulation): the 16 rows of A are weight rows, the 8
// columns of B are tokens. Float activations keep float accuracy as two BF16 halves, x = hi + lo
// (hi = bf16(x), lo = bf16(x - hi), x - hi exact in float; hi + lo is x to about 2^-17 relative),
// each multiplied into the same accumulator: W x = W hi + W lo. BF16 products are exact in float.
//
// A sum runs over the columns in an order that only the column count fixes: the columns are cut
// into 32-column chunks; warp w of a block's kMmaWarps takes chunks w, w + kMmaWarps, ... in
// increasing order; per chunk, four mma in a fixed order; then the warps' partial sums are added
// in warp order. Nothing of that depends on the number of tokens, a token's place in the batch,
// the unrolling or the token tile: per output element the same instructions on the same values.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16): lane = 4 g + q. A's registers hold rows g, g + 8,
// g, g + 8 at logical columns {2q, 2q+1}, {2q, 2q+1}, {2q+8, 2q+9}, {2q+8, 2q+9}; B's two
// registers hold token g at logical columns {2q, 2q+1} and {2q+8, 2q+9}; the float accumulator
// holds rows g, g, g + 8, g + 8 at tokens 2q, 2q+1, 2q, 2q+1. A dot product may take its terms in
// any order as long as A and B agree, so each lane loads 8 consecutive columns 32c + 8q .. + 7
// (16 bytes) of its two rows and of its token: elements 0-1 | 2-3 serve the chunk's first mma
// step as logical {2q, 2q+1} | {2q+8, 2q+9}, elements 4-5 | 6-7 the second.

constexpr int kMmaWarps = 8;  // warps of a block: the K split, fixed for every token count
constexpr int kMmaRows = 16;  // weight rows of a block (one m16 tile)
constexpr int kMmaMaxTiles = 8;  // token tiles of 8 per launch: up to 64 tokens per pass

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as BF16 pairs hi (round to nearest even) and lo = bf16(x - hi); the first float in
// the low half, as in memory.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t* hi, uint32_t* lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  *hi = *reinterpret_cast<const uint32_t*>(&h);
  *lo = *reinterpret_cast<const uint32_t*>(&l);
}

// y[t][row] (=|+=) W[row] . x[t] for kMmaRows rows per block and NT tiles of 8 tokens; KU chunks
// of weight loads in flight per lane (fewer where many tokens take the registers).
template <int NT, int KU>
__global__ void __launch_bounds__(kMmaWarps* kWarp)
    k_matmul_bf16_mma(const uint8_t* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, int64_t cols,
                      const float* x, int64_t ldx, int32_t n_tokens, float* y, int64_t ldy, Store store) {
  __shared__ float partial[kMmaWarps][NT * 4][kWarp];  // each warp's accumulators, lane-minor
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, q = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  if (row_ids) pdl_wait();  // the ids may be the previous kernel's output: only the weights load early
  const uint8_t* wr[2];  // this lane's rows g and g + 8 (clamped: rows past the end are read, not written)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = min(row0 + g + 8 * h, n_rows - 1);
    wr[h] = w + size_t(row_ids ? row_ids[r] : r) * w_stride;
  }
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

  const int64_t n_chunks = (cols + 31) / 32;
  const int64_t lane_col = 8 * q;
  constexpr int64_t kStride = int64_t(kMmaWarps) * KU;  // chunks between a warp's iterations
  uint4 wv[KU][2];
  auto load_weights = [&](int64_t c) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int64_t col = (c + u * kMmaWarps) * 32 + lane_col;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        wv[u][h] = col < cols ? __ldg(reinterpret_cast<const uint4*>(wr[h] + col * 2)) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first weight loads do not depend on the previous kernel: issue them before waiting for it.
  int64_t c = warp;
  if (c < n_chunks) load_weights(c);
  pdl_wait();
  while (c < n_chunks) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int64_t chunk = c + u * kMmaWarps;
      if (chunk >= n_chunks) break;  // the same for the whole warp
      const int64_t col = chunk * 32 + lane_col;
      const uint32_t a_first[4] = {wv[u][0].x, wv[u][1].x, wv[u][0].y, wv[u][1].y};
      const uint32_t a_second[4] = {wv[u][0].z, wv[u][1].z, wv[u][0].w, wv[u][1].w};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int32_t t = j * 8 + g;
        float4 p = make_float4(0.0f, 0.0f, 0.0f, 0.0f), r = p;
        if (t < n_tokens && col < cols) {
          const float4* xp = reinterpret_cast<const float4*>(x + int64_t(t) * ldx + col);
          p = __ldg(xp);
          r = __ldg(xp + 1);
        }
        uint32_t hi[4], lo[4];
        split_bf16x2(p.x, p.y, &hi[0], &lo[0]);
        split_bf16x2(p.z, p.w, &hi[1], &lo[1]);
        split_bf16x2(r.x, r.y, &hi[2], &lo[2]);
        split_bf16x2(r.z, r.w, &hi[3], &lo[3]);
        mma_bf16_16816(acc[j], a_first, hi[0], hi[1]);
        mma_bf16_16816(acc[j], a_first, lo[0], lo[1]);
        mma_bf16_16816(acc[j], a_second, hi[2], hi[3]);
        mma_bf16_16816(acc[j], a_second, lo[2], lo[3]);
      }
    }
    c += kStride;
    if (c < n_chunks) load_weights(c);
  }

  // The warps' partial sums, added in warp order.
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][j * 4 + i][lane] = acc[j][i];
  __syncthreads();
  for (int e = threadIdx.x; e < NT * 4 * kWarp; e += kMmaWarps * kWarp) {
    const int slot = e / kWarp, l = e % kWarp;
    float s = partial[0][slot][l];
#pragma unroll
    for (int v = 1; v < kMmaWarps; ++v) s += partial[v][slot][l];
    const int j = slot / 4, i = slot % 4;
    const int64_t row = row0 + l / 4 + 8 * (i / 2);
    const int32_t t = j * 8 + 2 * (l % 4) + i % 2;
    if (row < n_rows && t < n_tokens) {
      float* out = y + int64_t(t) * ldy + row;
      *out = store == Store::Accumulate ? *out + s : s;
    }
  }
}

template <int NT>
void launch_matmul_bf16_tiles(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx,
                              int32_t n_tokens, float* y, int64_t ldy, Store store, cudaStream_t stream) {
  constexpr int kUnroll = NT <= 2 ? 8 : NT == 4 ? 4 : 2;
  const dim3 grid(unsigned((rows.n_rows + kMmaRows - 1) / kMmaRows));
  launch_pdl(k_matmul_bf16_mma<NT, kUnroll>, grid, kMmaWarps * kWarp, 0, stream, w.data, w.row_stride, rows.row_ids,
             rows.n_rows, w.cols, x, ldx, n_tokens, y, ldy, store);
  MS_CUDA_LAUNCH();
}

// Passes of up to 64 tokens, each with the fewest tiles of 8 (a power of two) that hold it.
void launch_matmul_bf16(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens,
                        float* y, int64_t ldy, Store store, cudaStream_t stream) {
  for (int32_t t0 = 0; t0 < n_tokens; t0 += kMmaMaxTiles * 8) {
    const int32_t n = std::min(n_tokens - t0, kMmaMaxTiles * 8);
    const float* xt = x + int64_t(t0) * ldx;
    float* yt = y + int64_t(t0) * ldy;
    if (n <= 8)
      launch_matmul_bf16_tiles<1>(w, rows, xt, ldx, n, yt, ldy, store, stream);
    else if (n <= 16)
      launch_matmul_bf16_tiles<2>(w, rows, xt, ldx, n, yt, ldy, store, stream);
    else if (n <= 32)
      launch_matmul_bf16_tiles<4>(w, rows, xt, ldx, n, yt, ldy, store, stream);
    else
      launch_matmul_bf16_tiles<8>(w, rows, xt, ldx, n, yt, ldy, store, stream);
  }
}

GgmlType activation_type_of(GgmlType w) {
  switch (w) {
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0:
      return GgmlType::Q8_0;
    case GgmlType::Q4_1:
      return GgmlType::Q8_1;
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
      return GgmlType::Q8_K;
    default:
      return GgmlType::F32;
  }
}

template <GgmlType T>
void launch_matmul_q(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens,
                     float* y, int64_t ldy, Store store, uint8_t* scratch, cudaStream_t stream) {
  using F = QFormat<T>;
  const GgmlType act = activation_type_of(T);
  const int64_t nb = w.cols / F::kElems;
  const size_t act_stride = size_t(nb) * F::kActBytes;
  quantize_activations(act, x, ldx, n_tokens, w.cols, scratch, stream);
  const dim3 grid(unsigned((rows.n_rows + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(n_tokens));
  launch_pdl(k_matmul_q<T>, grid, kRowsPerBlock * kWarp, 0, stream, w.data, w.row_stride, rows.row_ids, rows.n_rows, nb,
                                                            scratch, act_stride, n_tokens, y, ldy, store);
  MS_CUDA_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Dequantization of whole rows (embeddings): one thread per block of the row.

__device__ void dequant_block(GgmlType type, const uint8_t* b, float* y, float scale) {
  switch (type) {
    case GgmlType::F32:
      y[0] = *reinterpret_cast<const float*>(b) * scale;
      return;
    case GgmlType::F16:
      y[0] = h2f(b) * scale;
      return;
    case GgmlType::BF16:
      y[0] = bf16_bits_to_f32(uint32_t(b[0]) | (uint32_t(b[1]) << 8)) * scale;
      return;
    case GgmlType::Q4_0: {
      const float d = h2f(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = float((b[2 + j] & 0xF) - 8) * d * scale;
        y[j + 16] = float((b[2 + j] >> 4) - 8) * d * scale;
      }
      return;
    }
    case GgmlType::Q4_1: {
      const float d = h2f(b), m = h2f(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = (float(b[4 + j] & 0xF) * d + m) * scale;
        y[j + 16] = (float(b[4 + j] >> 4) * d + m) * scale;
      }
      return;
    }
    case GgmlType::Q5_0: {
      const float d = h2f(b);
      const uint32_t h = load_u32(b + 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = (b[6 + j] & 0xF) | (((h >> j) & 1) << 4);
        const int hi = (b[6 + j] >> 4) | (((h >> (j + 16)) & 1) << 4);
        y[j] = float(lo - 16) * d * scale;
        y[j + 16] = float(hi - 16) * d * scale;
      }
      return;
    }
    case GgmlType::Q8_0: {
      const float d = h2f(b);
      for (int j = 0; j < 32; ++j) y[j] = float(static_cast<int8_t>(b[2 + j])) * d * scale;
      return;
    }
    case GgmlType::Q4_K: {
      const float d = h2f(b), dmin = h2f(b + 2);
      const uint8_t* q = b + 16;
      for (int c = 0; c < 4; ++c, q += 32, y += 64) {
        int sc, m;
        scale_min_k4(2 * c, b + 4, &sc, &m);
        const float d1 = d * float(sc), m1 = dmin * float(m);
        scale_min_k4(2 * c + 1, b + 4, &sc, &m);
        const float d2 = d * float(sc), m2 = dmin * float(m);
        for (int l = 0; l < 32; ++l) {
          y[l] = (d1 * float(q[l] & 0xF) - m1) * scale;
          y[l + 32] = (d2 * float(q[l] >> 4) - m2) * scale;
        }
      }
      return;
    }
    case GgmlType::Q6_K: {
      const float d = h2f(b + 208);
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = d * float(sc[is + 0]) * float(q1) * scale;
          y[l + 32] = d * float(sc[is + 2]) * float(q2) * scale;
          y[l + 64] = d * float(sc[is + 4]) * float(q3) * scale;
          y[l + 96] = d * float(sc[is + 6]) * float(q4) * scale;
        }
      }
      return;
    }
    default:
      return;
  }
}

__global__ void k_gather_rows(GgmlType type, const uint8_t* w, size_t stride, int64_t rows, int64_t cols,
                              int block_elems, size_t block_bytes, const int32_t* ids, int32_t n, float scale,
                              float* out) {
  pdl_trigger();
  pdl_wait();
  const int64_t nb = cols / block_elems;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nb * n) return;
  const int64_t r = i / nb, b = i % nb;
  const int64_t id = ids[r] >= 0 && ids[r] < rows ? ids[r] : 0;  // see gather_rows_f32
  dequant_block(type, w + size_t(id) * stride + b * block_bytes, out + r * cols + b * block_elems, scale);
}

// ---------------------------------------------------------------------------------------------
// Norms, RoPE, activation, residual add.

constexpr int kNormThreads = 1024;  // one row per block: a decode step's row is one block, so go wide

__global__ void __launch_bounds__(kNormThreads)
    k_rms_norm(const float* x, float* y, int32_t rows_per_group, int64_t group_stride, int32_t dim,
               const float* weight, float eps) {
  pdl_trigger();
  pdl_wait();
  const int32_t g = blockIdx.x / rows_per_group, r = blockIdx.x % rows_per_group;
  const int64_t off = int64_t(g) * group_stride + int64_t(r) * dim;
  const float* xr = x + off;
  float* yr = y + off;
  __shared__ double partial[kNormThreads / kWarp];
  double ss = 0.0;  // in double, as the CPU sums
#pragma unroll 4
  for (int i = threadIdx.x; i < dim; i += kNormThreads) ss += double(xr[i]) * xr[i];
  for (int o = kWarp / 2; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = ss;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kNormThreads / kWarp; ++w) total += partial[w];
  const float scale = 1.0f / sqrtf(float(total / dim) + eps);
  for (int i = threadIdx.x; i < dim; i += kNormThreads) yr[i] = xr[i] * scale * weight[i];
}

__global__ void k_gated_activation(const float* gate, const float* up, int64_t ld, int32_t n, int32_t n_ff,
                                   Activation act, float* h) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * n_ff) return;
  const int64_t t = i / n_ff, c = i % n_ff;
  const float g = gate[t * ld + c], u = up[t * ld + c];
  h[i] = act == Activation::GeluTanh ? g / (1.0f + expf(-1.5957691216f * (g + 0.044715f * g * g * g))) * u
                                     : g / (1.0f + expf(-g)) * u;
}

__global__ void k_stream_barrier() {}

__global__ void k_add(float* x, const float* o, int64_t count) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] += o[i];
}

__global__ void k_add_bias_rows(float* y, int64_t ld, int32_t n, const float* bias, int32_t dim) {
  pdl_trigger();
  pdl_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * dim) return;
  y[(i / dim) * ld + i % dim] += bias[i % dim];
}

__global__ void k_select_rows(const float* x, int32_t dim, const int32_t* rows, float* out) {
  pdl_trigger();
  pdl_wait();
  const float* src = x + int64_t(rows[blockIdx.x]) * dim;
  float* dst = out + int64_t(blockIdx.x) * dim;
  for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

__global__ void k_decode_begin(DeviceKV kv, DecodeState st) {
  st.out_ids[0] = st.tokens[0];
  *st.counter = 1;
  st.positions[0] = *kv.n_past;
  st.parents[0] = -1;
  st.output_rows[0] = 0;
}

__global__ void k_decode_advance(DeviceKV kv, DecodeState st) {
  pdl_trigger();
  pdl_wait();
  const int32_t n_past = *kv.n_past + 1;
  *kv.n_past = n_past;
  st.positions[0] = n_past;
  st.out_ids[(*st.counter)++] = st.tokens[0];
}

// ---------------------------------------------------------------------------------------------
// KV cache: slot metadata, stores, attention with the tree mask, compaction.

__global__ void k_set_slot_meta(DeviceKV kv, DeviceBatch batch) {
  pdl_trigger();
  pdl_wait();
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.n) return;
  const int32_t slot = *kv.n_past + batch.start + i;
  kv.positions[slot] = batch.positions[i];
  kv.parents[slot] = batch.parents[i];
}

// One block per (head, token) of the q and k heads, plus one per token for the values: rotate
// the head's pairs (theta built by repeated multiplication, as the CPU does), store the rotated k
// and the v in the cache as halves.
__global__ void k_rope_and_store_kv(float* qkv, int64_t ld, DeviceKV kv, int32_t il, DeviceBatch batch,
                                    RopeShape shape) {
  pdl_trigger();
  pdl_wait();
  const int32_t h = blockIdx.x, t = blockIdx.y, hd = shape.head_dim, half = shape.n_rot / 2;
  float* row = qkv + int64_t(t) * ld;
  const int64_t slot = *kv.n_past + batch.start + t;
  uint16_t* kc = kv.k + (int64_t(il) * kv.n_ctx + slot) * kv.kv_dim;
  if (h == shape.n_head + shape.n_head_kv) {  // the values, and k dimensions past n_rot (none in practice)
    uint16_t* vc = kv.v + (int64_t(il) * kv.n_ctx + slot) * kv.kv_dim;
    for (int32_t e = threadIdx.x; e < kv.kv_dim; e += blockDim.x) {
      if (e % hd >= shape.n_rot) kc[e] = __half_as_ushort(__float2half_rn(row[int64_t(shape.n_head) * hd + e]));
      vc[e] = __half_as_ushort(__float2half_rn(row[int64_t(shape.n_head) * hd + kv.kv_dim + e]));
    }
    return;
  }
  const float pos = float(batch.positions[t]);
  float* xh = row + int64_t(h) * hd;
  for (int32_t j = threadIdx.x; j < half; j += blockDim.x) {
    float theta = pos;
    for (int32_t k = 0; k < j; ++k) theta *= shape.theta_scale;
    float s, c;
    sincosf(theta, &s, &c);
    const int32_t i0 = shape.neox ? j : 2 * j, i1 = shape.neox ? j + half : 2 * j + 1;
    const float a = xh[i0], b = xh[i1];
    const float r0 = a * c - b * s, r1 = a * s + b * c;
    if (h < shape.n_head) {
      xh[i0] = r0;
      xh[i1] = r1;
    } else {
      const int32_t off = (h - shape.n_head) * hd;
      kc[off + i0] = __half_as_ushort(__float2half_rn(r0));
      kc[off + i1] = __half_as_ushort(__float2half_rn(r1));
    }
  }
}

constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / kWarp;
constexpr int kMaxHeadDim = 256;

__device__ float block_reduce(float v, float* red, bool take_max) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = take_max ? fmaxf(v, other) : v + other;
  }
  __syncthreads();
  if (threadIdx.x % kWarp == 0) red[threadIdx.x / kWarp] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kAttnWarps; ++w) r = take_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// One block per (token, head). Shared memory: scores [n_ctx], the token's ancestor chain [n_ctx],
// the query rounded to halves [head_dim], per-warp partial outputs [warps][head_dim].
__global__ void __launch_bounds__(kAttnThreads)
    k_attention(DeviceKV kv, int32_t il, DeviceBatch batch, const float* q, int64_t ldq, AttentionShape shape,
                float* out) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ unsigned char smem_raw[];
  float* scores = reinterpret_cast<float*>(smem_raw);
  int32_t* chain = reinterpret_cast<int32_t*>(scores + kv.n_ctx);
  float* qh = reinterpret_cast<float*>(chain + kv.n_ctx);
  float* partial = qh + kMaxHeadDim;
  __shared__ float red[kAttnWarps];
  __shared__ int32_t n_chain_s;

  const int32_t i = blockIdx.x / shape.n_head, h = blockIdx.x % shape.n_head;
  const int32_t hd = shape.head_dim, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int32_t n_past = *kv.n_past;
  const int32_t qpos = batch.positions[i];
  const int32_t koff = (h / (shape.n_head / shape.n_head_kv)) * hd;
  if (threadIdx.x == 0) {
    // Pending slots this token sees: itself and its chain of ancestors, stored root first. A parent
    // is always an earlier slot; a link that is not (stale metadata: a bug) ends the walk, so it
    // can neither loop nor run past the chain's shared memory.
    int32_t n = 0;
    for (int32_t p = batch.start + i; p >= 0;) {
      chain[n++] = p;
      const int32_t parent = kv.parents[n_past + p];
      p = parent < p ? parent : -1;
    }
    for (int32_t a = 0, b = n - 1; a < b; ++a, --b) {
      const int32_t tmp = chain[a];
      chain[a] = chain[b];
      chain[b] = tmp;
    }
    n_chain_s = n;
  }
  for (int32_t d = threadIdx.x; d < hd; d += kAttnThreads)
    qh[d] = round_f16(q[int64_t(i) * ldq + int64_t(h) * hd + d]);
  __syncthreads();
  const int32_t n_keys = n_past + n_chain_s;
  auto slot_of = [&](int32_t key) { return key < n_past ? key : n_past + chain[key - n_past]; };
  const uint16_t* kbase = kv.k + int64_t(il) * kv.n_ctx * kv.kv_dim + koff;
  const uint16_t* vbase = kv.v + int64_t(il) * kv.n_ctx * kv.kv_dim + koff;

  // Scores: four neighbouring lanes per key, each taking every fourth 16-byte chunk of the row
  // (all its loads issued together), summed across the four. Every lane runs the same number of
  // rounds so the shuffles see full warps.
  constexpr int kPerKey = 4, kKeysPerRound = kAttnThreads / kPerKey;
  const int32_t part = threadIdx.x % kPerKey, chunks = hd / 8;  // chunks <= 32
  const int32_t rounds = (n_keys + kKeysPerRound - 1) / kKeysPerRound;
  for (int32_t r = 0; r < rounds; ++r) {
    const int32_t key = r * kKeysPerRound + threadIdx.x / kPerKey;
    const bool valid = key < n_keys;
    const int32_t slot = valid ? slot_of(key) : 0;
    const uint4* kr = reinterpret_cast<const uint4*>(kbase + int64_t(slot) * kv.kv_dim);
    uint4 u[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int32_t c = part + kPerKey * k;
      u[k] = valid && c < chunks ? kr[c] : make_uint4(0, 0, 0, 0);
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int32_t c = part + kPerKey * k;
      if (c >= chunks) break;
      const uint32_t w4[4] = {u[k].x, u[k].y, u[k].z, u[k].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w4[e]));
        s += qh[8 * c + 2 * e] * f.x + qh[8 * c + 2 * e + 1] * f.y;
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (valid && part == 0) {
      const bool masked = shape.window != 0 && qpos - kv.positions[slot] >= shape.window;
      scores[key] = masked ? -INFINITY : s * shape.scale;
    }
  }
  __syncthreads();
  float m = -INFINITY;
  for (int32_t key = threadIdx.x; key < n_keys; key += kAttnThreads) m = fmaxf(m, scores[key]);
  m = block_reduce(m, red, true);
  float sum = 0.0f;
  for (int32_t key = threadIdx.x; key < n_keys; key += kAttnThreads) {
    const float e = scores[key] == -INFINITY ? 0.0f : expf(scores[key] - m);
    scores[key] = e;
    sum += e;
  }
  sum = block_reduce(sum, red, false);
  const float inv_sum = 1.0f / sum;  // the token always sees itself, so sum >= 1

  // Output: a warp per key, lanes across the head; per-warp partials summed at the end.
  float acc[kMaxHeadDim / kWarp];
#pragma unroll
  for (int c = 0; c < kMaxHeadDim / kWarp; ++c) acc[c] = 0.0f;
#pragma unroll 4
  for (int32_t key = warp; key < n_keys; key += kAttnWarps) {
    if (scores[key] == 0.0f) continue;
    const float p = round_f16(scores[key] * inv_sum);
    const uint16_t* vr = vbase + int64_t(slot_of(key)) * kv.kv_dim;
#pragma unroll
    for (int c = 0; c < kMaxHeadDim / kWarp; ++c) {
      const int32_t d = lane + c * kWarp;
      if (d < hd) acc[c] += p * __half2float(__ushort_as_half(vr[d]));
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxHeadDim / kWarp; ++c) {
    const int32_t d = lane + c * kWarp;
    if (d < hd) partial[warp * kMaxHeadDim + d] = acc[c];
  }
  __syncthreads();
  for (int32_t d = threadIdx.x; d < hd; d += kAttnThreads) {
    float s = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) s += partial[w * kMaxHeadDim + d];
    out[(int64_t(i) * shape.n_head + h) * hd + d] = s;
  }
}

size_t attention_smem_bytes(int32_t n_ctx) {
  return size_t(n_ctx) * (sizeof(float) + sizeof(int32_t)) + sizeof(float) * kMaxHeadDim * (1 + kAttnWarps);
}

// Each thread owns one element of one layer's K or V rows and moves it through the kept slots in
// order, so no thread reads a slot another thread has overwritten.
__global__ void k_kv_compact_rows(DeviceKV kv, const int32_t* idx, const int32_t* n_keep_at) {
  const int64_t per_layer = kv.kv_dim;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= 2 * kv.n_layer * per_layer) return;
  uint16_t* base = i < kv.n_layer * per_layer ? kv.k : kv.v;
  const int64_t li = i % (kv.n_layer * per_layer);
  const int64_t il = li / per_layer, e = li % per_layer;
  const int32_t n_past = *kv.n_past, n_keep = *n_keep_at;
  for (int32_t j = 0; j < n_keep; ++j) {
    const int32_t src = n_past + idx[j], dst = n_past + j;
    if (src != dst) base[(il * kv.n_ctx + dst) * kv.kv_dim + e] = base[(il * kv.n_ctx + src) * kv.kv_dim + e];
  }
}

__global__ void k_kv_compact_meta(DeviceKV kv, const int32_t* idx, const int32_t* n_keep_at) {
  const int32_t n_past = *kv.n_past, n_keep = *n_keep_at;
  for (int32_t j = 0; j < n_keep; ++j) {
    kv.positions[n_past + j] = kv.positions[n_past + idx[j]];
    kv.parents[n_past + j] = -1;
  }
  *kv.n_past = n_past + n_keep;
}

__global__ void k_kv_advance(DeviceKV kv, int32_t n) {
  *kv.n_past += n;
}

// ---------------------------------------------------------------------------------------------
// Argmax and top-k: order by value descending, then index ascending; NaN never wins.

constexpr int kSelectThreads = 1024;

__device__ void block_best(float& v, int64_t& i) {
  __shared__ float sv[kSelectThreads / kWarp];
  __shared__ int64_t si[kSelectThreads / kWarp];
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (oi >= 0 && ranks_before(ov, oi, v, i)) v = ov, i = oi;
  }
  __syncthreads();
  if (threadIdx.x % kWarp == 0) sv[threadIdx.x / kWarp] = v, si[threadIdx.x / kWarp] = i;
  __syncthreads();
  v = sv[0];
  i = si[0];
  for (int w = 1; w < int(blockDim.x / kWarp); ++w)
    if (si[w] >= 0 && ranks_before(sv[w], si[w], v, i)) v = sv[w], i = si[w];
}

// The k best of x[0, n) in the (value desc, index asc) order, NaN never and -inf only with
// keep_neg_inf, handed to take(j, value, index) by thread 0 for j in [0, k) (index -1 past the
// values there are). One block, one pass over the row: each thread keeps its own k best of the
// elements it reads (sorted, k <= 64, in local memory), then k block-wide rounds take the best of
// the threads' heads, whose owner moves on to its next.
template <class Take>
__device__ void block_top_k(const float* x, int64_t n, int32_t k, bool keep_neg_inf, const Take& take) {
  float lv[64];
  int64_t li[64];
  int32_t count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = x[i];
    if (keep_neg_inf || v > -INFINITY) ranked_insert(lv, li, count, k, v, i);  // NaN never enters
  }
  int32_t head = 0;
  for (int32_t j = 0; j < k; ++j) {
    float bv = 0.0f;
    int64_t bi = -1;
    if (head < count) bv = lv[head], bi = li[head];
    block_best(bv, bi);
    if (bi >= 0 && head < count && li[head] == bi) ++head;  // indices are unique: one owner
    if (threadIdx.x == 0) take(j, bv, bi);
    __syncthreads();  // block_best's shared slots are written again next round
  }
}

// Order-preserving key of (value, index): larger value first, then lower index; 0 = nothing.
// -0 and +0 take one key, so their tie goes to the lower index as in the CPU's argmax.
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t i) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

constexpr int kArgmaxThreads = 256, kArgmaxPerThread = 16;

__global__ void k_argmax_partial(const float* x, int64_t n, unsigned long long* keys) {
  pdl_trigger();
  pdl_wait();
  const float* row = x + int64_t(blockIdx.y) * n;
  unsigned long long best = 0;
  const int64_t base = int64_t(blockIdx.x) * kArgmaxThreads * kArgmaxPerThread + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kArgmaxPerThread; ++k) {
    const int64_t i = base + int64_t(k) * kArgmaxThreads;
    if (i < n && !isnan(row[i])) best = max(best, argmax_key(row[i], i));
  }
  for (int o = kWarp / 2; o > 0; o /= 2) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x % kWarp == 0 && best != 0) atomicMax(&keys[blockIdx.y], best);
}

__global__ void k_argmax_final(const unsigned long long* keys, int32_t n_rows, int32_t* out) {
  pdl_trigger();
  pdl_wait();
  const int32_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < n_rows) out[r] = keys[r] == 0 ? -1 : int32_t(0xFFFFFFFFu - uint32_t(keys[r] & 0xFFFFFFFFu));
}

// The row's k best (block_top_k, -inf kept); block r takes row first + r of the range.
__global__ void __launch_bounds__(kSelectThreads)
    k_top_k_rows(const float* x, int64_t ld, int64_t n, RowRange rows, int32_t k, int32_t* ids,
                 float* values) {
  const int32_t r = blockIdx.x;
  const int32_t count = rows.count ? *rows.count : rows.max_rows;
  if (r >= count) return;
  const int32_t at = (rows.first ? *rows.first : 0) + r;
  const float* row = x + int64_t(rows.list ? rows.list[at] : at) * ld;
  ids += int64_t(r) * k;
  values += int64_t(r) * k;
  block_top_k(row, n, k, /*keep_neg_inf=*/true, [&](int32_t j, float v, int64_t i) {
    ids[j] = int32_t(i);
    values[j] = i >= 0 ? v : -INFINITY;
  });
}

// The CPU sampler's draw over the row's ranked k best (ranked_draw.h) in one thread; the ranked
// entries end at the first id -1 (past the non-NaN values) or -inf value (never sampled).
__global__ void k_draw_top_k(const int32_t* ids, const float* values, int32_t k, const DrawSettings* settings,
                             const uint64_t* bits, const int32_t* draw, int32_t* out) {
  const int32_t n = ranked_count(ids, values, k);
  if (n == 0) {
    *out = -1;
    return;
  }
  const int32_t rank = draw_ranked(n, [&](int32_t i) { return values[i]; }, *settings,
                                   bits[draw ? *draw : 0]);
  *out = ids[rank];
}

// ---------------------------------------------------------------------------------------------
// Dynamic draft vocabulary (window_state.h's functions in one thread, the packed head's gather in
// parallel), then random fills.

__global__ void k_vocab_pin(DraftVocabState* st, const int32_t* ids, int32_t n) {
  for (int32_t i = 0; i < n; ++i) window_pin(st->window, ids[i]);
}

__global__ void k_vocab_begin(DraftVocabState* st, const int32_t* prompt, int32_t n_prompt,
                              const int32_t* prompt_top, int32_t k, int32_t use_k) {
  vocab_state_begin(*st, prompt, n_prompt, prompt_top, k, use_k);
}

__global__ void k_vocab_step(DraftVocabState* st, const int32_t* tree, const int32_t* tops, const VocabUpdate* update,
                             int32_t k) {
  vocab_state_step(*st, tree, update->n_tree, tops, update->n_rows * k);
}

__global__ void k_gather_packed_rows(const uint8_t* full, size_t stride, const RowCopy* copies, const int32_t* n_copies,
                                     uint8_t* rows) {
  if (int32_t(blockIdx.x) >= *n_copies) return;
  const RowCopy c = copies[blockIdx.x];
  const uint8_t* src = c.src >= 0 ? full + size_t(c.src) * stride : rows + size_t(-c.src - 1) * stride;
  uint8_t* dst = rows + size_t(c.dst) * stride;
  if (stride % 16 == 0) {
    for (size_t o = threadIdx.x * 16; o < stride; o += blockDim.x * 16)
      *reinterpret_cast<uint4*>(dst + o) = *reinterpret_cast<const uint4*>(src + o);
  } else {
    for (size_t o = threadIdx.x; o < stride; o += blockDim.x) dst[o] = src[o];
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    k_packed_argmax(const float* logits, int64_t ld, const int32_t* n_rows, const int32_t* token_of_slot,
                    int32_t if_empty, int32_t* out) {
  const float* row = logits + int64_t(blockIdx.x) * ld;
  const int32_t n = *n_rows;
  float bv = 0.0f;
  int64_t bi = -1;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (ranks_before(row[i], i, bv, bi)) bv = row[i], bi = i;
  block_best(bv, bi);
  if (threadIdx.x == 0) out[blockIdx.x] = bi >= 0 ? token_of_slot[bi] : if_empty;
}

// The k best of the first *n_rows values of each row (block_top_k, -inf kept), as token_of_slot's
// ids; block r takes row r.
__global__ void __launch_bounds__(kSelectThreads)
    k_packed_top_k(const float* logits, int64_t ld, const int32_t* n_rows, const int32_t* token_of_slot,
                   int32_t k, int32_t* ids, float* values) {
  const float* row = logits + int64_t(blockIdx.x) * ld;
  ids += int64_t(blockIdx.x) * k;
  values += int64_t(blockIdx.x) * k;
  block_top_k(row, *n_rows, k, /*keep_neg_inf=*/true, [&](int32_t j, float v, int64_t i) {
    ids[j] = i >= 0 ? token_of_slot[i] : -1;
    values[j] = i >= 0 ? v : -INFINITY;
  });
}

// top_k_logprobs (speculative/tree.cpp) per row: the largest value, the sum of exp(v - max) in
// double, then the k best (block_top_k).
__global__ void __launch_bounds__(kSelectThreads)
    k_tree_proposals(const float* logits, int64_t ld, int64_t n_fixed, const int32_t* n_valid,
                     const int32_t* ids, int32_t k, int32_t* tokens, float* logprobs) {
  __shared__ float s_max[kSelectThreads / kWarp];
  __shared__ double s_sum[kSelectThreads / kWarp];
  const float* row = logits + int64_t(blockIdx.x) * ld;
  const int64_t n = n_valid ? *n_valid : n_fixed;
  tokens += int64_t(blockIdx.x) * k;
  logprobs += int64_t(blockIdx.x) * k;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  // 1. The largest value (NaN never compares larger).
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, row[i]);
  for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) s_max[warp] = m;
  __syncthreads();
  m = s_max[0];
  for (int w = 1; w < n_warps; ++w) m = fmaxf(m, s_max[w]);
  if (!(m > -INFINITY)) {  // nothing finite
    if (threadIdx.x < k) tokens[threadIdx.x] = -1, logprobs[threadIdx.x] = 0.0f;
    return;
  }
  // 2. The softmax's normaliser; with a +inf value, the count of them.
  const bool has_inf = isinf(m);
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (has_inf)
      sum += v == m ? 1.0 : 0.0;
    else if (v > -INFINITY)
      sum += exp(double(v - m));
  }
  for (int o = kWarp / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();
  sum = 0.0;
  for (int w = 0; w < n_warps; ++w) sum += s_sum[w];
  const float log_sum = float(log(sum));
  // 3. The k best, -inf excluded.
  block_top_k(row, n, k, /*keep_neg_inf=*/false, [&](int32_t j, float v, int64_t i) {
    tokens[j] = i < 0 ? -1 : ids ? ids[i] : int32_t(i);
    logprobs[j] = i < 0 ? 0.0f : has_inf ? (v == m ? -log_sum : -INFINITY) : fminf(0.0f, (v - m) - log_sum);
  });
}

__global__ void k_chain_begin(ChainState st) { ::microspec::chain_begin(st); }

__global__ void k_chain_draw(ChainState st, ChainSampling m, int32_t d) { ::microspec::chain_draw(st, m, d); }
__global__ void k_chain_sample_accept(ChainState st, ChainSampling m) { ::microspec::chain_sample_accept(st, m); }

__global__ void k_chain_accept(ChainState st) { ::microspec::chain_accept(st); }
__global__ void k_chain_head_caught_up(ChainState st) { ::microspec::chain_head_caught_up(st); }

__global__ void k_tree_begin(TreeState st) { ::microspec::tree_begin(st); }
__global__ void k_tree_absorb(TreeState st, int32_t forward) { ::microspec::tree_absorb(st, forward); }
__global__ void k_tree_rank(TreeState st) {
  const int32_t c = int32_t(blockIdx.x * blockDim.x + threadIdx.x);
  if (c < st.shape.candidates()) ::microspec::tree_rank(st, c);
}
__global__ void k_tree_lay_out_verification(TreeState st) { ::microspec::tree_lay_out_verification(st); }
__global__ void k_tree_accept(TreeState st) { ::microspec::tree_accept(st); }
__global__ void k_tree_lay_out_root(TreeState st) { ::microspec::tree_lay_out_root(st); }
__global__ void k_tree_head_caught_up(TreeState st) { ::microspec::tree_head_caught_up(st); }
__global__ void k_tree_draw(TreeState st, TreeSampling m, int32_t forward) { ::microspec::tree_draw(st, m, forward); }
__global__ void k_tree_keep_first(TreeState st) { ::microspec::tree_keep_first(st); }
__global__ void k_tree_sample_accept(TreeState st, TreeSampling m) { ::microspec::tree_sample_accept(st, m); }

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

__global__ void k_fill_random16(bool bf16, uint16_t* data, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = hash_uniform(seed, i) * scale;
    data[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
  }
}

__global__ void k_fill_random_f32(float* data, int64_t n, float base, float scale, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = base + hash_uniform(seed, i) * scale;
}

unsigned blocks_for(int64_t n, int threads) {
  return unsigned((n + threads - 1) / threads);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host entry points

bool matmul_supported(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

size_t matmul_scratch_bytes(int64_t n_tokens, int64_t cols) {
  return size_t(n_tokens) * size_t(cols) * 5 / 4 + 256;  // Q8_K, the widest: 292 bytes per 256
}

namespace {
void check_float_layout(const DeviceMatrix& w, const float* x, int64_t ldx) {
  if (w.cols % 8 != 0 || ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || w.row_stride % 16 != 0)
    throw Error("cuda matmul: float weights need cols % 8 == 0 and 16-byte aligned rows (cols " +
                std::to_string(w.cols) + ", ldx " + std::to_string(ldx) + ")");
}
}  // namespace

void matmul_bf16_cuda_cores(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens,
                            float* y, int64_t ldy, Store store, uint8_t* /*act_scratch*/, cudaStream_t stream) {
  if (n_tokens <= 0 || rows.n_rows <= 0) return;
  if (w.type != GgmlType::BF16)
    throw Error("cuda matmul_bf16_cuda_cores: weights of type " + type_name(uint32_t(w.type)) + ", want BF16");
  check_float_layout(w, x, ldx);
  launch_matmul_f<GgmlType::BF16>(w, rows, x, ldx, n_tokens, y, ldy, store, stream);
}

void matmul(const DeviceMatrix& w, RowSelection rows, const float* x, int64_t ldx, int32_t n_tokens, float* y,
            int64_t ldy, Store store, uint8_t* act_scratch, cudaStream_t stream) {
  if (n_tokens <= 0 || rows.n_rows <= 0) return;
  switch (w.type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      check_float_layout(w, x, ldx);
      if (w.type == GgmlType::BF16)
        launch_matmul_bf16(w, rows, x, ldx, n_tokens, y, ldy, store, stream);
      else if (w.type == GgmlType::F16)
        launch_matmul_f<GgmlType::F16>(w, rows, x, ldx, n_tokens, y, ldy, store, stream);
      else
        launch_matmul_f<GgmlType::F32>(w, rows, x, ldx, n_tokens, y, ldy, store, stream);
      return;
    case GgmlType::Q4_0:
      return launch_matmul_q<GgmlType::Q4_0>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    case GgmlType::Q4_1:
      return launch_matmul_q<GgmlType::Q4_1>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    case GgmlType::Q5_0:
      return launch_matmul_q<GgmlType::Q5_0>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    case GgmlType::Q8_0:
      return launch_matmul_q<GgmlType::Q8_0>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    case GgmlType::Q4_K:
      return launch_matmul_q<GgmlType::Q4_K>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    case GgmlType::Q6_K:
      return launch_matmul_q<GgmlType::Q6_K>(w, rows, x, ldx, n_tokens, y, ldy, store, act_scratch, stream);
    default:
      throw Error("cuda matmul: no kernel for weights of type " + type_name(uint32_t(w.type)));
  }
}

void quantize_activations(GgmlType act, const float* x, int64_t ldx, int32_t n_tokens, int64_t cols, uint8_t* out,
                          cudaStream_t stream) {
  if (act != GgmlType::Q8_0 && act != GgmlType::Q8_1 && act != GgmlType::Q8_K)
    throw Error("cuda quantize_activations: not an activation type: " + type_name(uint32_t(act)));
  const TypeTraits& tt = type_traits(act);
  const int64_t n_blocks = cols / tt.block_elems * n_tokens;
  launch_pdl(k_quantize_act, unsigned((n_blocks + 127) / 128), 128, 0, stream, x, ldx, n_tokens, cols, act, out,
                                                                       row_bytes(act, cols));
  MS_CUDA_LAUNCH();
}

void gather_rows_f32(const DeviceMatrix& w, const int32_t* ids, int32_t n, float scale, float* out,
                     cudaStream_t stream) {
  if (!matmul_supported(w.type)) throw Error("cuda: no dequantization for type " + type_name(uint32_t(w.type)));
  const TypeTraits& tt = type_traits(w.type);
  const int64_t n_threads = w.cols / tt.block_elems * n;
  launch_pdl(k_gather_rows, blocks_for(n_threads, 128), 128, 0, stream, w.type, w.data, w.row_stride, w.rows, w.cols,
             int(tt.block_elems), tt.block_bytes, ids, n, scale, out);
  MS_CUDA_LAUNCH();
}

void rms_norm(const float* x, float* y, RowGroups rows, int32_t dim, const float* weight, float eps,
              cudaStream_t stream) {
  const int64_t n = int64_t(rows.n_groups) * rows.rows_per_group;
  if (n == 0) return;
  launch_pdl(k_rms_norm, unsigned(n), kNormThreads, 0, stream, x, y, rows.rows_per_group, rows.group_stride, dim, weight,
                                                        eps);
  MS_CUDA_LAUNCH();
}

void rope_and_store_kv(float* qkv, int64_t ld, const DeviceKV& kv, int32_t il, const DeviceBatch& batch,
                       RopeShape shape, cudaStream_t stream) {
  const dim3 grid(unsigned(shape.n_head + shape.n_head_kv + 1), unsigned(batch.n));
  launch_pdl(k_rope_and_store_kv, grid, 128, 0, stream, qkv, ld, kv, il, batch, shape);
  MS_CUDA_LAUNCH();
}

void gated_activation(const float* gate, const float* up, int64_t ld, int32_t n, int32_t n_ff, Activation act,
                      float* h, cudaStream_t stream) {
  launch_pdl(k_gated_activation, blocks_for(int64_t(n) * n_ff, 256), 256, 0, stream, gate, up, ld, n, n_ff, act, h);
  MS_CUDA_LAUNCH();
}

void stream_barrier(cudaStream_t stream) {
  k_stream_barrier<<<1, 1, 0, stream>>>();
  MS_CUDA_LAUNCH();
}

void add_inplace(float* x, const float* o, int64_t count, cudaStream_t stream) {
  launch_pdl(k_add, blocks_for(count, 256), 256, 0, stream, x, o, count);
  MS_CUDA_LAUNCH();
}

void add_bias_rows(float* y, int64_t ld, int32_t n, const float* bias, int32_t dim, cudaStream_t stream) {
  launch_pdl(k_add_bias_rows, blocks_for(int64_t(n) * dim, 256), 256, 0, stream, y, ld, n, bias, dim);
  MS_CUDA_LAUNCH();
}

void select_rows(const float* x, int32_t dim, const int32_t* rows, int32_t n, float* out, cudaStream_t stream) {
  if (n == 0) return;
  launch_pdl(k_select_rows, unsigned(n), 256, 0, stream, x, dim, rows, out);
  MS_CUDA_LAUNCH();
}

void decode_begin(const DeviceKV& kv, const DecodeState& st, cudaStream_t stream) {
  k_decode_begin<<<1, 1, 0, stream>>>(kv, st);
  MS_CUDA_LAUNCH();
}

void decode_advance(const DeviceKV& kv, const DecodeState& st, cudaStream_t stream) {
  launch_pdl(k_decode_advance, 1, 1, 0, stream, kv, st);
  MS_CUDA_LAUNCH();
}

void set_slot_meta(const DeviceKV& kv, const DeviceBatch& batch, cudaStream_t stream) {
  launch_pdl(k_set_slot_meta, blocks_for(batch.n, 128), 128, 0, stream, kv, batch);
  MS_CUDA_LAUNCH();
}

int32_t attention_max_ctx() {
  return 24576;  // scores and chain in shared memory: 196 KB of the 227 KB a Hopper block may have
}

void attention_prepare(int32_t n_ctx) {
  static size_t smem_allowed = 48 * 1024;
  const size_t smem = attention_smem_bytes(n_ctx);
  if (smem > smem_allowed) {
    MS_CUDA(cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    smem_allowed = smem;
  }
}

void attention(const DeviceKV& kv, int32_t il, const DeviceBatch& batch, const float* q, int64_t ldq,
               AttentionShape shape, float* out, cudaStream_t stream) {
  if (shape.head_dim > kMaxHeadDim || shape.head_dim % 8 != 0)
    throw Error("cuda attention: head_dim " + std::to_string(shape.head_dim) + " (at most 256, a multiple of 8)");
  if (kv.n_ctx > attention_max_ctx())
    throw Error("cuda attention: context " + std::to_string(kv.n_ctx) + " exceeds " +
                std::to_string(attention_max_ctx()));
  const size_t smem = attention_smem_bytes(kv.n_ctx);
  attention_prepare(kv.n_ctx);
  launch_pdl(k_attention, unsigned(batch.n * shape.n_head), kAttnThreads, smem, stream, kv, il, batch, q, ldq, shape, out);
  MS_CUDA_LAUNCH();
}

void kv_compact(const DeviceKV& kv, const int32_t* idx, const int32_t* n_keep, cudaStream_t stream) {
  const int64_t n = 2 * int64_t(kv.n_layer) * kv.kv_dim;
  k_kv_compact_rows<<<blocks_for(n, 256), 256, 0, stream>>>(kv, idx, n_keep);
  MS_CUDA_LAUNCH();
  k_kv_compact_meta<<<1, 1, 0, stream>>>(kv, idx, n_keep);
  MS_CUDA_LAUNCH();
}

void kv_advance(const DeviceKV& kv, int32_t n, cudaStream_t stream) {
  k_kv_advance<<<1, 1, 0, stream>>>(kv, n);
  MS_CUDA_LAUNCH();
}

void argmax_rows(const float* x, int32_t n_rows, int64_t n, int32_t* out, uint64_t* scratch, cudaStream_t stream) {
  if (n_rows == 0) return;
  if (n >= (int64_t(1) << 32)) throw Error("cuda argmax: rows of 2^32 or more values");
  MS_CUDA(cudaMemsetAsync(scratch, 0, sizeof(uint64_t) * n_rows, stream));
  const dim3 grid(blocks_for(n, kArgmaxThreads * kArgmaxPerThread), unsigned(n_rows));
  launch_pdl(k_argmax_partial, grid, kArgmaxThreads, 0, stream, x, n, reinterpret_cast<unsigned long long*>(scratch));
  MS_CUDA_LAUNCH();
  launch_pdl(k_argmax_final, blocks_for(n_rows, 128), 128, 0, stream, reinterpret_cast<const unsigned long long*>(scratch),
                                                              n_rows, out);
  MS_CUDA_LAUNCH();
}

void top_k_rows(const float* x, int64_t ld, int64_t n, RowRange rows, int32_t k, int32_t* ids, float* values,
                cudaStream_t stream) {
  if (k < 1 || k > 64) throw Error("cuda top_k: k must be in 1..64, got " + std::to_string(k));
  if (rows.max_rows < 0) throw Error("cuda top_k: negative row count");
  if (rows.max_rows == 0) return;
  k_top_k_rows<<<unsigned(rows.max_rows), kSelectThreads, 0, stream>>>(x, ld, n, rows, k, ids, values);
  MS_CUDA_LAUNCH();
}

void draw_top_k(const int32_t* ids, const float* values, int32_t k, const DrawSettings* settings,
                const uint64_t* bits, const int32_t* draw, int32_t* out, cudaStream_t stream) {
  if (k < 1 || k > 64) throw Error("cuda draw_top_k: k must be in 1..64, got " + std::to_string(k));
  k_draw_top_k<<<1, 1, 0, stream>>>(ids, values, k, settings, bits, draw, out);
  MS_CUDA_LAUNCH();
}

void vocab_pin(DraftVocabState* st, const int32_t* ids, int32_t n, cudaStream_t stream) {
  if (n < 0) throw Error("cuda vocab_pin: negative count");
  if (n == 0) return;
  k_vocab_pin<<<1, 1, 0, stream>>>(st, ids, n);
  MS_CUDA_LAUNCH();
}

void vocab_begin(DraftVocabState* st, const int32_t* prompt, int32_t n_prompt, const int32_t* prompt_top, int32_t k,
                 int32_t use_k, cudaStream_t stream) {
  if (n_prompt < 0 || use_k < 0 || use_k > k) throw Error("cuda vocab_begin: bad prompt sizes");
  k_vocab_begin<<<1, 1, 0, stream>>>(st, prompt, n_prompt, prompt_top, k, use_k);
  MS_CUDA_LAUNCH();
}

void vocab_step(DraftVocabState* st, const int32_t* tree, const int32_t* tops, const VocabUpdate* update, int32_t k,
                cudaStream_t stream) {
  if (k < 0) throw Error("cuda vocab_step: negative K_ver");
  k_vocab_step<<<1, 1, 0, stream>>>(st, tree, tops, update, k);
  MS_CUDA_LAUNCH();
}

void gather_packed_rows(const DeviceMatrix& full, const RowCopy* copies, const int32_t* n_copies, int32_t max_copies,
                        uint8_t* rows, cudaStream_t stream) {
  if (max_copies <= 0) return;
  k_gather_packed_rows<<<unsigned(max_copies), 128, 0, stream>>>(full.data, full.row_stride, copies, n_copies, rows);
  MS_CUDA_LAUNCH();
}

void packed_argmax(const float* logits, int64_t ld, int32_t n_out, const int32_t* n_rows, const int32_t* token_of_slot,
                   int32_t if_empty, int32_t* out, cudaStream_t stream) {
  if (n_out <= 0) return;
  k_packed_argmax<<<unsigned(n_out), kSelectThreads, 0, stream>>>(logits, ld, n_rows, token_of_slot, if_empty, out);
  MS_CUDA_LAUNCH();
}

void tree_proposals(const float* logits, int64_t ld, int64_t n, const int32_t* n_valid, const int32_t* ids,
                    int32_t n_rows, int32_t k, int32_t* tokens, float* logprobs, cudaStream_t stream) {
  if (k < 1 || k > 64) throw Error("cuda tree_proposals: k must be in 1..64, got " + std::to_string(k));
  if (n_rows < 0 || n < 0) throw Error("cuda tree_proposals: negative sizes");
  if (n_rows == 0) return;
  k_tree_proposals<<<unsigned(n_rows), kSelectThreads, 0, stream>>>(logits, ld, n, n_valid, ids, k, tokens, logprobs);
  MS_CUDA_LAUNCH();
}

namespace {
void check_tree_shape(const TreeState& st, const char* what) {
  const TreeShape& s = st.shape;
  if (!s.valid())
    throw Error(std::string("cuda ") + what + ": a tree of top-k " + std::to_string(s.top_k) + ", depth " +
                std::to_string(s.depth) + " and " + std::to_string(s.total) + " nodes has no fixed shape");
}
}  // namespace

void tree_begin(const TreeState& st, cudaStream_t stream) {
  check_tree_shape(st, "tree_begin");
  k_tree_begin<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void tree_absorb(const TreeState& st, int32_t forward, cudaStream_t stream) {
  check_tree_shape(st, "tree_absorb");
  if (forward < 0 || forward > st.shape.depth)
    throw Error("cuda tree_absorb: forward " + std::to_string(forward) + " outside 0.." + std::to_string(st.shape.depth));
  k_tree_absorb<<<1, 1, 0, stream>>>(st, forward);
  MS_CUDA_LAUNCH();
}

void tree_finish(const TreeState& st, cudaStream_t stream) {
  check_tree_shape(st, "tree_finish");
  k_tree_rank<<<blocks_for(st.shape.candidates(), 128), 128, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
  k_tree_lay_out_verification<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void tree_accept(const TreeState& st, cudaStream_t stream) {
  check_tree_shape(st, "tree_accept");
  k_tree_accept<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void tree_lay_out_root(const TreeState& st, cudaStream_t stream) {
  k_tree_lay_out_root<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void tree_head_caught_up(const TreeState& st, cudaStream_t stream) {
  if (!st.head.n_past) throw Error("cuda tree_head_caught_up: the tree has no draft head");
  k_tree_head_caught_up<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

namespace {
void check_tree_sampling(const TreeState& st, const TreeSampling& m, const char* what) {
  check_tree_shape(st, what);
  if (m.k < 1 || m.k > 64)
    throw Error(std::string("cuda ") + what + ": top-k " + std::to_string(m.k) + " outside 1..64");
}
}  // namespace

void tree_draw(const TreeState& st, const TreeSampling& sampling, int32_t forward, cudaStream_t stream) {
  check_tree_sampling(st, sampling, "tree_draw");
  if (forward < 0 || forward > st.shape.depth)
    throw Error("cuda tree_draw: forward " + std::to_string(forward) + " outside 0.." + std::to_string(st.shape.depth));
  k_tree_draw<<<1, 1, 0, stream>>>(st, sampling, forward);
  MS_CUDA_LAUNCH();
}

void tree_finish_first(const TreeState& st, cudaStream_t stream) {
  check_tree_shape(st, "tree_finish_first");
  k_tree_keep_first<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
  k_tree_lay_out_verification<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void tree_sample_accept(const TreeState& st, const TreeSampling& sampling, cudaStream_t stream) {
  check_tree_sampling(st, sampling, "tree_sample_accept");
  k_tree_sample_accept<<<1, 1, 0, stream>>>(st, sampling);
  MS_CUDA_LAUNCH();
}

void chain_begin(const ChainState& st, cudaStream_t stream) {
  if (st.depth < 0) throw Error("cuda chain_begin: negative depth");
  k_chain_begin<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void chain_accept(const ChainState& st, cudaStream_t stream) {
  if (st.depth < 0) throw Error("cuda chain_accept: negative depth");
  k_chain_accept<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

namespace {
void check_chain_sampling(const ChainState& st, const ChainSampling& m, const char* what) {
  if (st.depth < 0 || m.k < 1 || m.k > 64 || m.draws_per_step < st.depth)
    throw Error(std::string("cuda ") + what + ": depth " + std::to_string(st.depth) + ", top-k " + std::to_string(m.k) +
                " (1..64) and " + std::to_string(m.draws_per_step) + " draft draws per step (at least the depth)");
}
}  // namespace

void chain_draw(const ChainState& st, const ChainSampling& sampling, int32_t d, cudaStream_t stream) {
  check_chain_sampling(st, sampling, "chain_draw");
  if (d < 0 || d >= st.depth) throw Error("cuda chain_draw: draft " + std::to_string(d) + " outside the chain");
  k_chain_draw<<<1, 1, 0, stream>>>(st, sampling, d);
  MS_CUDA_LAUNCH();
}

void chain_sample_accept(const ChainState& st, const ChainSampling& sampling, cudaStream_t stream) {
  check_chain_sampling(st, sampling, "chain_sample_accept");
  k_chain_sample_accept<<<1, 1, 0, stream>>>(st, sampling);
  MS_CUDA_LAUNCH();
}

void packed_top_k(const float* logits, int64_t ld, int32_t n_out, const int32_t* n_rows, const int32_t* token_of_slot,
                  int32_t k, int32_t* ids, float* values, cudaStream_t stream) {
  if (k < 1 || k > 64) throw Error("cuda packed_top_k: k must be in 1..64, got " + std::to_string(k));
  if (n_out < 1) return;
  k_packed_top_k<<<unsigned(n_out), kSelectThreads, 0, stream>>>(logits, ld, n_rows, token_of_slot, k, ids, values);
  MS_CUDA_LAUNCH();
}

void chain_head_caught_up(const ChainState& st, cudaStream_t stream) {
  if (!st.head.n_past || !st.head.root_row || !st.head.slot_parents || !st.head.draft_positions)
    throw Error("cuda chain_head_caught_up: the chain has no draft head's arrays");
  k_chain_head_caught_up<<<1, 1, 0, stream>>>(st);
  MS_CUDA_LAUNCH();
}

void fill_random(GgmlType type, void* data, int64_t n, float scale, uint64_t seed, cudaStream_t stream) {
  if (type != GgmlType::BF16 && type != GgmlType::F16)
    throw Error("cuda fill_random: BF16 or F16 only, got " + type_name(uint32_t(type)));
  k_fill_random16<<<4096, 256, 0, stream>>>(type == GgmlType::BF16, static_cast<uint16_t*>(data), n, scale, seed);
  MS_CUDA_LAUNCH();
}

void fill_random_f32(float* data, int64_t n, float base, float scale, uint64_t seed, cudaStream_t stream) {
  k_fill_random_f32<<<1024, 256, 0, stream>>>(data, n, base, scale, seed);
  MS_CUDA_LAUNCH();
}

}  // namespace microspec::cuda
