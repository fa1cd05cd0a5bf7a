// Quantized matrix products: quantize the activation rows once, then split the weight rows across
// the pool. Each thread hands its rows and a chunk of tokens to the table's gemm kernel, which
// decodes each weight block once for several tokens.
#include "kernels/matmul.h"

#include <algorithm>
#include <array>
#include <string>

#include "kernels/repack.h"
#include "util/error.h"

namespace microspec {

namespace {

// Rows per scheduling grain: 16 floats of output = one cache line, so threads never share one.
constexpr int64_t kRowGrain = 16;
// Tokens per gemm call. Bounds the kernels' per-call activation repacking (a few hundred KB at
// most) and keeps a chunk's activations in L2 while the thread's weight rows stream past.
constexpr int64_t kTokenChunk = 256;
// Quantize activations on the pool only when there is enough work to pay for the wakeup.
constexpr int64_t kParallelQuantizeElems = 1 << 15;

struct Activations {
  const uint8_t* data;
  size_t stride;  // bytes per token row
};

// The table's kernel for w's type; Error when it has none.
GemmFn gemm_for(MatmulContext& ctx, const QMatrix& w) {
  const KernelTable& k = ctx.kernels();
  const int type_id = int(w.type);
  const GemmFn gemm = type_id >= 0 && type_id < kMaxTypeId ? k.gemm[type_id] : nullptr;
  if (!gemm)
    throw Error(std::string("no ") + k.name + " matmul kernel for weights of type " +
                type_name(uint32_t(w.type)));
  return gemm;
}

// x brought into the activation format of w's type (x itself for F32).
Activations quantize_input(MatmulContext& ctx, const QMatrix& w, const float* x, int64_t n_tokens) {
  const KernelTable& k = ctx.kernels();
  const GgmlType act_type = activation_type(w.type);
  const size_t act_stride = row_bytes(act_type, w.cols);  // throws when cols is not whole blocks
  if (act_type == GgmlType::F32) return {reinterpret_cast<const uint8_t*>(x), act_stride};
  uint8_t* buf = ctx.scratch(act_stride * size_t(n_tokens));
  const QuantizeRowFn quantize = k.quantize[int(act_type)];
  const int64_t cols = w.cols;
  auto run = [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) quantize(x + t * cols, buf + size_t(t) * act_stride, cols);
  };
  if (n_tokens > 1 && n_tokens * cols >= kParallelQuantizeElems)
    ctx.pool().parallel_for(n_tokens, 1, run);
  else
    run(0, n_tokens, 0);
  return {buf, act_stride};
}

// Rows per grain. Many-token products give each kernel call a per-call setup over all the
// activations, so there the rows go out in two chunks per thread (still enough for one thread to
// take over another's second half); otherwise in cache-line grains.
int64_t row_grain(MatmulContext& ctx, int64_t rows, int64_t n_tokens) {
  if (n_tokens < 8) return kRowGrain;
  const int64_t per_chunk = (rows + 2 * ctx.pool().size() - 1) / (2 * ctx.pool().size());
  return std::max(kRowGrain, (per_chunk + kRowGrain - 1) / kRowGrain * kRowGrain);
}

void check_shape(const QMatrix& w, int64_t n_tokens, int64_t n_out, int64_t ldy) {
  if (n_tokens < 0 || w.rows < 0 || w.cols <= 0 || ldy < n_out)
    throw Error("matmul: bad shape (rows " + std::to_string(w.rows) + ", cols " + std::to_string(w.cols) +
                ", tokens " + std::to_string(n_tokens) + ", ldy " + std::to_string(ldy) + ")");
}

// Outputs [b, e) of w's product with prepared activations, in chunks of tokens. `rows` null: w's
// rows b..e, through the interleaved tiles when the table reads them (b is then a multiple of the
// tile's 16 rows); otherwise the gathered rows rows[b..e) of the file layout.
void product_rows(MatmulContext& ctx, const QMatrix& w, const int32_t* rows, GemmFn gemm, const Activations& act,
                  int64_t n_tokens, float* y, int64_t ldy, int64_t b, int64_t e) {
  const InterleavedGemmFn gemm_tiles = !rows && w.interleaved && w.interleaved_of == w.data
                                           ? ctx.kernels().gemm_interleaved[int(w.type)]
                                           : nullptr;
  for (int64_t t0 = 0; t0 < n_tokens; t0 += kTokenChunk) {
    const int64_t nt = std::min(kTokenChunk, n_tokens - t0);
    const uint8_t* a = act.data + size_t(t0) * act.stride;
    if (gemm_tiles)
      gemm_tiles(w.interleaved + size_t(b / kInterleavedRows) * interleaved_tile_bytes(w.type, w.cols), e - b, a,
                 act.stride, nt, w.cols, y + t0 * ldy + b, ldy);
    else if (rows)
      gemm(w.data, w.row_stride, rows + b, e - b, a, act.stride, nt, w.cols, y + t0 * ldy + b, ldy);
    else
      gemm(w.data + size_t(b) * w.row_stride, w.row_stride, nullptr, e - b, a, act.stride, nt, w.cols,
           y + t0 * ldy + b, ldy);
  }
}

// One product of matmul_shared_input's on its group's row axis, where it starts at row `first`.
struct AxisPart {
  const SharedInputProduct* p;
  GemmFn gemm;
  int64_t first;
};

// The products of one activation format, their input quantized once, in one pool call on one row
// axis where each product starts at a multiple of 16 rows (a tile). A chunk may cover the end of
// one product and the start of the next: each gets its part.
void run_axis(MatmulContext& ctx, std::span<const AxisPart> parts, int64_t axis, const float* x, int64_t n_tokens) {
  const Activations act = quantize_input(ctx, *parts[0].p->w, x, n_tokens);
  ctx.pool().parallel_for(axis, row_grain(ctx, axis, n_tokens), [&](int64_t b, int64_t e, int) {
    for (const AxisPart& part : parts) {
      const SharedInputProduct& p = *part.p;
      const int64_t rb = std::max(b - part.first, int64_t(0)), re = std::min(e - part.first, p.w->rows);
      if (rb < re) product_rows(ctx, *p.w, nullptr, part.gemm, act, n_tokens, p.y, p.ldy, rb, re);
    }
  });
}

// Chunks start at multiples of the grain, a multiple of the 16 rows of a tile.
static_assert(kRowGrain % kInterleavedRows == 0);

}  // namespace

void MatmulContext::reserve(int64_t n_tokens, int64_t cols) {
  // Every activation format takes at most 1.25 bytes per element (Q8_K: 292/256) except F32,
  // which never uses the scratch: matmul passes f32 activations through untouched.
  const size_t bytes = size_t(n_tokens) * size_t(cols) * 5 / 4 + 64;
  if (scratch_.size() < bytes + 64) scratch_.resize(bytes + 64);
}

uint8_t* MatmulContext::scratch(size_t bytes) {
  if (scratch_.size() < bytes + 64) scratch_.resize(bytes + 64);
  const uintptr_t p = reinterpret_cast<uintptr_t>(scratch_.data());
  return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
}

void matmul(MatmulContext& ctx, const QMatrix& w, const float* x, int64_t n_tokens, float* y, int64_t ldy) {
  check_shape(w, n_tokens, w.rows, ldy);
  if (n_tokens == 0 || w.rows == 0) return;
  const GemmFn gemm = gemm_for(ctx, w);
  const Activations act = quantize_input(ctx, w, x, n_tokens);
  ctx.pool().parallel_for(w.rows, row_grain(ctx, w.rows, n_tokens), [&](int64_t b, int64_t e, int) {
    product_rows(ctx, w, nullptr, gemm, act, n_tokens, y, ldy, b, e);
  });
}

void matmul_shared_input(MatmulContext& ctx, std::span<const SharedInputProduct> products, const float* x,
                         int64_t n_tokens) {
  if (products.size() > kMaxSharedInputProducts)
    throw Error("matmul_shared_input: " + std::to_string(products.size()) + " products, at most " +
                std::to_string(kMaxSharedInputProducts));
  for (const SharedInputProduct& p : products) {
    check_shape(*p.w, n_tokens, p.w->rows, p.ldy);
    if (p.w->cols != products[0].w->cols)
      throw Error("matmul_shared_input: products of " + std::to_string(products[0].w->cols) + " and " +
                  std::to_string(p.w->cols) + " columns cannot share an input");
  }
  if (n_tokens == 0) return;
  // Groups of one activation format (usually all of the products form one), in order of first use.
  std::array<bool, kMaxSharedInputProducts> grouped{};
  for (size_t g = 0; g < products.size(); ++g) {
    if (grouped[g]) continue;
    const GgmlType format = activation_type(products[g].w->type);
    std::array<AxisPart, kMaxSharedInputProducts> parts{};
    size_t n_parts = 0;
    int64_t axis = 0;
    for (size_t i = g; i < products.size(); ++i) {
      if (grouped[i] || activation_type(products[i].w->type) != format) continue;
      parts[n_parts++] = {&products[i], gemm_for(ctx, *products[i].w), axis};
      axis += (products[i].w->rows + kRowGrain - 1) / kRowGrain * kRowGrain;
      grouped[i] = true;
    }
    if (axis > 0) run_axis(ctx, std::span<const AxisPart>(parts.data(), n_parts), axis, x, n_tokens);
  }
}

void matmul_rows(MatmulContext& ctx, const QMatrix& w, const int32_t* rows, int64_t n_rows, const float* x,
                 int64_t n_tokens, float* y, int64_t ldy) {
  check_shape(w, n_tokens, n_rows, ldy);
  for (int64_t j = 0; j < n_rows; ++j)
    if (rows[j] < 0 || rows[j] >= w.rows)
      throw Error("matmul_rows: row " + std::to_string(rows[j]) + " outside a matrix of " +
                  std::to_string(w.rows) + " rows");
  if (n_tokens == 0 || n_rows == 0) return;
  const GemmFn gemm = gemm_for(ctx, w);
  const Activations act = quantize_input(ctx, w, x, n_tokens);
  ctx.pool().parallel_for(n_rows, row_grain(ctx, n_rows, n_tokens), [&](int64_t b, int64_t e, int) {
    product_rows(ctx, w, rows, gemm, act, n_tokens, y, ldy, b, e);
  });
}

}  // namespace microspec
