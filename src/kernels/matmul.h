#pragma once
// Matrix products of a quantized weight matrix with a batch of f32 activation rows.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/threadpool.h"

namespace microspec {

// A 2-D weight in the file's own format: `rows` rows of `cols` elements; row r starts at
// data + r * row_stride. For a GGUF weight with ne = [in, out]: cols = in, rows = out.
struct QMatrix {
  GgmlType type = GgmlType::F32;
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_stride = 0;
  // The same rows in the interleaved layout of repack.h (built at load for kernel tables that read
  // it), or null, and the `data` it holds the rows of. matmul uses it when the table has a
  // gemm_interleaved kernel for the type and data is still interleaved_of: a copy of the matrix
  // pointed at other rows (a packed subset of an LM head) falls back to its own data. matmul_rows
  // (gathered rows) always reads data.
  const uint8_t* interleaved = nullptr;
  const uint8_t* interleaved_of = nullptr;
};

// Scratch for quantized activations; grows on first use to the largest batch seen, then stays.
class MatmulContext {
 public:
  MatmulContext(ThreadPool& pool, const KernelTable& kernels) : pool_(&pool), kernels_(&kernels) {}
  ThreadPool& pool() { return *pool_; }
  const KernelTable& kernels() const { return *kernels_; }
  // Preallocates scratch for up to n_tokens rows of `cols` elements of any activation type.
  void reserve(int64_t n_tokens, int64_t cols);
  uint8_t* scratch(size_t bytes);

 private:
  ThreadPool* pool_;
  const KernelTable* kernels_;
  std::vector<uint8_t> scratch_;
};

// y[t * ldy + r] = dot(W row r, x[t * w.cols .. ]) for t < n_tokens, r < w.rows. Each result is
// bitwise independent of n_tokens, the other tokens and the thread count (see GemmFn).
void matmul(MatmulContext& ctx, const QMatrix& w, const float* x, int64_t n_tokens, float* y, int64_t ldy);

// One product of several that share their input x: y[t * ldy + r] = dot(W row r, x[t]).
struct SharedInputProduct {
  const QMatrix* w = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
};
constexpr size_t kMaxSharedInputProducts = 4;

// matmul() of every product (at most kMaxSharedInputProducts, all of w.cols columns) on the same
// x: a layer's q/k/v or gate/up. x is quantized once per activation format, and the products of
// one format share one pool call, so the pool wakes once and small matrices balance together.
// Every output is bitwise what matmul() of its matrix alone gives.
void matmul_shared_input(MatmulContext& ctx, std::span<const SharedInputProduct> products, const float* x,
                         int64_t n_tokens);

// Same for a subset of rows: y[t * ldy + j] = dot(W row rows[j], x[t]) for j < n_rows.
void matmul_rows(MatmulContext& ctx, const QMatrix& w, const int32_t* rows, int64_t n_rows, const float* x,
                 int64_t n_tokens, float* y, int64_t ldy);

}  // namespace microspec
