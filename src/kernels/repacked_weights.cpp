#include "kernels/repacked_weights.h"

#include <sys/mman.h>

#include <new>

#include "kernels/repack.h"

namespace microspec {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}  // namespace

QMatrix RepackedWeights::add(QMatrix m, const KernelTable& kernels, ThreadPool& pool) {
  if (!has_interleaved_layout(m.type) || !kernels.gemm_interleaved[int(m.type)]) return m;
  const size_t bytes = interleaved_bytes(m.type, m.rows, m.cols);
  // Large copies in 2 MiB pages where the kernel offers them (fewer page faults while writing,
  // fewer TLB misses while streaming); small ones 64-byte aligned.
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(align, (bytes + align - 1) & ~(align - 1)));
  if (!p) throw std::bad_alloc();
  if (align == kHugePage) madvise(p, (bytes + align - 1) & ~(align - 1), MADV_HUGEPAGE);  // advice only
  copies_.emplace_back(p);
  bytes_ += bytes;
  const int64_t n_tiles = (m.rows + kInterleavedRows - 1) / kInterleavedRows;
  pool.parallel_for(n_tiles, 64, [&](int64_t b, int64_t e, int) {
    interleave_tiles(m.type, m.data, m.row_stride, m.rows, m.cols, b, e, p);
  });
  m.interleaved = p;
  m.interleaved_of = m.data;
  return m;
}

}  // namespace microspec
