#include "kernels/repacked_weights.h"

#include <new>

#include "kernels/repack.h"

namespace microspec {

QMatrix RepackedWeights::add(QMatrix m, const KernelTable& kernels, ThreadPool& pool) {
  if (!has_interleaved_layout(m.type) || !kernels.gemm_interleaved[int(m.type)]) return m;
  const size_t bytes = interleaved_bytes(m.type, m.rows, m.cols);
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) & ~size_t(63)));
  if (!p) throw std::bad_alloc();
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
