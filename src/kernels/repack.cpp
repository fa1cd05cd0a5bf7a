// The interleaved weight layout (see repack.h): writing it from the file's format and reading a
// row back (for the reference table and the tests).
#include "kernels/repack.h"

#include <cstring>
#include <string>

#include "util/error.h"

namespace microspec {

namespace {

constexpr size_t kQuantBytesPerBlock = 8 * 16 * 4;  // [8 dwords][16 rows][4 bytes]
constexpr size_t kScaleBytesPerBlock = 16 * sizeof(fp16_t);

void require_layout(GgmlType type, int64_t cols) {
  if (!has_interleaved_layout(type))
    throw Error(std::string("no interleaved layout for weights of type ") + type_name(uint32_t(type)));
  if (cols <= 0 || cols % kQK != 0)
    throw Error("interleaved layout: " + std::to_string(cols) + " columns are not whole blocks of " +
                std::to_string(kQK));
}

}  // namespace

bool has_interleaved_layout(GgmlType type) {
  return type == GgmlType::Q8_0;
}

size_t interleaved_tile_bytes(GgmlType type, int64_t cols) {
  require_layout(type, cols);
  const size_t nb = size_t(cols / kQK);
  return (nb * (kQuantBytesPerBlock + kScaleBytesPerBlock) + 63) & ~size_t(63);
}

size_t interleaved_bytes(GgmlType type, int64_t rows, int64_t cols) {
  if (rows < 0) throw Error("interleaved layout: negative row count " + std::to_string(rows));
  return size_t((rows + kInterleavedRows - 1) / kInterleavedRows) * interleaved_tile_bytes(type, cols);
}

void interleave_tiles(GgmlType type, const uint8_t* src, size_t src_stride, int64_t rows, int64_t cols,
                      int64_t first_tile, int64_t end_tile, uint8_t* dst) {
  const size_t tile_bytes = interleaved_tile_bytes(type, cols);
  const int64_t nb = cols / kQK;
  for (int64_t t = first_tile; t < end_tile; ++t) {
    uint8_t* tile = dst + size_t(t) * tile_bytes;
    uint8_t* quants = tile;
    auto* scales = reinterpret_cast<fp16_t*>(tile + size_t(nb) * kQuantBytesPerBlock);
    for (int64_t r = 0; r < kInterleavedRows; ++r) {
      const int64_t row = t * kInterleavedRows + r < rows ? t * kInterleavedRows + r : rows - 1;
      const auto* blocks = reinterpret_cast<const BlockQ8_0*>(src + size_t(row) * src_stride);
      for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(&scales[b * 16 + r], &blocks[b].d, sizeof(fp16_t));
        for (int k = 0; k < 8; ++k)
          for (int e = 0; e < 4; ++e)
            quants[size_t(b) * kQuantBytesPerBlock + size_t(k) * 64 + size_t(r) * 4 + size_t(e)] =
                uint8_t(blocks[b].qs[4 * k + e]) ^ 0x80u;
      }
    }
    const size_t used = size_t(nb) * (kQuantBytesPerBlock + kScaleBytesPerBlock);
    std::memset(tile + used, 0, tile_bytes - used);
  }
}

void deinterleave_row(GgmlType type, const uint8_t* interleaved, int64_t cols, int64_t r, uint8_t* dst) {
  const size_t tile_bytes = interleaved_tile_bytes(type, cols);
  const int64_t nb = cols / kQK;
  const uint8_t* tile = interleaved + size_t(r / kInterleavedRows) * tile_bytes;
  const int64_t lane = r % kInterleavedRows;
  const auto* scales = reinterpret_cast<const fp16_t*>(tile + size_t(nb) * kQuantBytesPerBlock);
  auto* blocks = reinterpret_cast<BlockQ8_0*>(dst);
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(&blocks[b].d, &scales[b * 16 + lane], sizeof(fp16_t));
    for (int k = 0; k < 8; ++k)
      for (int e = 0; e < 4; ++e)
        blocks[b].qs[4 * k + e] =
            int8_t(tile[size_t(b) * kQuantBytesPerBlock + size_t(k) * 64 + size_t(lane) * 4 + size_t(e)] ^ 0x80u);
  }
}

}  // namespace microspec
