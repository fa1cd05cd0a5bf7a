// The interleaved weight layout (see repack.h): writing it from the file's format and reading a
// row back (for the reference table and the tests).
#include "kernels/repack.h"

#include <cstddef>
#include <cstring>
#include <string>

#include "util/error.h"

namespace microspec {

namespace {

// Bytes per block (of 16 rows) of each region of a tile.
struct Regions {
  size_t quants = 0, high = 0, d = 16 * sizeof(fp16_t), m = 0;
  size_t total() const { return quants + high + d + m; }
};

Regions regions(GgmlType type) {
  Regions g;
  switch (type) {
    case GgmlType::Q8_0:
      g.quants = 8 * 64;
      break;
    case GgmlType::Q4_0:
      g.quants = 4 * 64;
      break;
    case GgmlType::Q4_1:
      g.quants = 4 * 64;
      g.m = 16 * sizeof(fp16_t);
      break;
    case GgmlType::Q5_0:
      g.quants = 4 * 64;
      g.high = 16 * 4;
      break;
    case GgmlType::Q5_1:
      g.quants = 4 * 64;
      g.high = 16 * 4;
      g.m = 16 * sizeof(fp16_t);
      break;
    default:
      throw Error(std::string("no interleaved layout for weights of type ") + type_name(uint32_t(type)));
  }
  return g;
}

// Where a file block's fields lie (offsets in the block; -1: absent).
struct Fields {
  int d = 0, m = -1, qh = -1, qs = 0;
};

Fields fields(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0:
      return {int(offsetof(BlockQ8_0, d)), -1, -1, int(offsetof(BlockQ8_0, qs))};
    case GgmlType::Q4_0:
      return {int(offsetof(BlockQ4_0, d)), -1, -1, int(offsetof(BlockQ4_0, qs))};
    case GgmlType::Q4_1:
      return {int(offsetof(BlockQ4_1, d)), int(offsetof(BlockQ4_1, m)), -1, int(offsetof(BlockQ4_1, qs))};
    case GgmlType::Q5_0:
      return {int(offsetof(BlockQ5_0, d)), -1, int(offsetof(BlockQ5_0, qh)), int(offsetof(BlockQ5_0, qs))};
    default:  // Q5_1 (regions() has rejected the rest)
      return {int(offsetof(BlockQ5_1, d)), int(offsetof(BlockQ5_1, m)), int(offsetof(BlockQ5_1, qh)),
              int(offsetof(BlockQ5_1, qs))};
  }
}

// Fifth bits: element i = 4k + e (bit i of the file's qh) <-> bit 8e + k of the layout's word.
// Byte j of qh holds elements 8j..8j+7 (k = 2j, 2j + 1): its bits land where byte 0's would,
// shifted left by 2j, so a table of byte 0's patterns serves every byte.
struct SpreadTable {
  uint32_t v[256];
  constexpr SpreadTable() : v() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i)
        if ((b >> i) & 1) v[b] |= 1u << (8 * (i % 4) + i / 4);
  }
};
constexpr SpreadTable kSpread;

uint32_t spread_high_bits(uint32_t qh) {
  uint32_t v = 0;
  for (int j = 0; j < 4; ++j) v |= kSpread.v[(qh >> (8 * j)) & 0xFFu] << (2 * j);
  return v;
}
uint32_t gather_high_bits(uint32_t v) {
  uint32_t qh = 0;
  for (int i = 0; i < 32; ++i) qh |= ((v >> (8 * (i % 4) + i / 4)) & 1u) << i;
  return qh;
}

void require_layout(GgmlType type, int64_t cols) {
  regions(type);  // throws for a type without the layout
  if (cols <= 0 || cols % kQK != 0)
    throw Error("interleaved layout: " + std::to_string(cols) + " columns are not whole blocks of " +
                std::to_string(kQK));
}

// Everything about a tile of a matrix of `type` with `cols` columns: its size, its regions and
// where they start, the file block's fields, the quant groups per block.
struct Tile {
  size_t bytes;
  Regions g;
  Fields f;
  size_t block_bytes;
  int64_t nb;
  size_t quants, high, d, m;  // byte offset of each region in the tile
  int groups;                 // 4-byte groups per block and row in the quant region
};

Tile tile_of(GgmlType type, int64_t cols) {
  require_layout(type, cols);
  Tile t;
  t.g = regions(type);
  t.f = fields(type);
  t.block_bytes = type_traits(type).block_bytes;
  t.nb = cols / kQK;
  t.bytes = (size_t(t.nb) * t.g.total() + 63) & ~size_t(63);
  const size_t n = size_t(t.nb);
  t.quants = 0;
  t.high = n * t.g.quants;
  t.d = n * (t.g.quants + t.g.high);
  t.m = n * (t.g.quants + t.g.high + t.g.d);
  t.groups = int(t.g.quants / 64);
  return t;
}

// --- K-quant records ---------------------------------------------------------------------------

bool is_k_layout(GgmlType type) {
  return type == GgmlType::Q4_K || type == GgmlType::Q6_K;
}

size_t record_bytes(GgmlType type) {
  return type == GgmlType::Q4_K ? Q4KRecord::kBytes : Q6KRecord::kBytes;
}

void require_k_layout(GgmlType type, int64_t cols) {
  if (cols <= 0 || cols % kQKK != 0)
    throw Error("interleaved layout: " + std::to_string(cols) + " columns are not whole " +
                type_name(uint32_t(type)) + " superblocks of " + std::to_string(kQKK));
}

// Sub-block j's 6-bit scale and min from a Q4_K block's 12 packed bytes, and back (ggml's packing:
// j < 4 in the low 6 bits of bytes j and 4 + j; j >= 4 in the nibbles of byte 4 + j with the top
// two bits in bits 6-7 of bytes j - 4 and j).
void unpack_k4_scale(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}
void pack_k4_scales(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = uint8_t(m[j] | ((m[j + 4] >> 4) << 6));
    q[j + 8] = uint8_t((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
}

// Row r (0..15) of a record from / to one superblock in the file's format.
void put_row(GgmlType type, const uint8_t* blk, size_t r, uint8_t* rec) {
  if (type == GgmlType::Q4_K) {
    const auto& x = *reinterpret_cast<const BlockQ4_K*>(blk);
    for (int g = 0; g < 32; ++g) std::memcpy(rec + Q4KRecord::kQuants + 64 * g + 4 * r, x.qs + 4 * g, 4);
    for (int j = 0; j < 8; ++j)
      unpack_k4_scale(x.scales, j, rec + Q4KRecord::kScales + 16 * j + r, rec + Q4KRecord::kMins + 16 * j + r);
    std::memcpy(rec + Q4KRecord::kD + 2 * r, &x.d, 2);
    std::memcpy(rec + Q4KRecord::kDmin + 2 * r, &x.dmin, 2);
    return;
  }
  const auto& x = *reinterpret_cast<const BlockQ6_K*>(blk);
  for (int g = 0; g < 32; ++g) std::memcpy(rec + Q6KRecord::kLow + 64 * g + 4 * r, x.ql + 4 * g, 4);
  for (int m = 0; m < 16; ++m) std::memcpy(rec + Q6KRecord::kHigh + 64 * m + 4 * r, x.qh + 4 * m, 4);
  for (int j = 0; j < 16; ++j) std::memcpy(rec + Q6KRecord::kScales + 16 * j + r, x.scales + j, 1);
  std::memcpy(rec + Q6KRecord::kD + 2 * r, &x.d, 2);
}
void get_row(GgmlType type, const uint8_t* rec, size_t r, uint8_t* blk) {
  if (type == GgmlType::Q4_K) {
    auto& x = *reinterpret_cast<BlockQ4_K*>(blk);
    for (int g = 0; g < 32; ++g) std::memcpy(x.qs + 4 * g, rec + Q4KRecord::kQuants + 64 * g + 4 * r, 4);
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = rec[Q4KRecord::kScales + 16 * j + r];
      m[j] = rec[Q4KRecord::kMins + 16 * j + r];
    }
    pack_k4_scales(sc, m, x.scales);
    std::memcpy(&x.d, rec + Q4KRecord::kD + 2 * r, 2);
    std::memcpy(&x.dmin, rec + Q4KRecord::kDmin + 2 * r, 2);
    return;
  }
  auto& x = *reinterpret_cast<BlockQ6_K*>(blk);
  for (int g = 0; g < 32; ++g) std::memcpy(x.ql + 4 * g, rec + Q6KRecord::kLow + 64 * g + 4 * r, 4);
  for (int m = 0; m < 16; ++m) std::memcpy(x.qh + 4 * m, rec + Q6KRecord::kHigh + 64 * m + 4 * r, 4);
  for (int j = 0; j < 16; ++j) std::memcpy(x.scales + j, rec + Q6KRecord::kScales + 16 * j + r, 1);
  std::memcpy(&x.d, rec + Q6KRecord::kD + 2 * r, 2);
}

void interleave_k_tiles(GgmlType type, const uint8_t* src, size_t src_stride, int64_t rows, int64_t cols,
                        int64_t first_tile, int64_t end_tile, uint8_t* dst) {
  const int64_t nsb = cols / kQKK;
  const size_t rec_bytes = record_bytes(type), tile_bytes = size_t(nsb) * rec_bytes;
  const size_t block_bytes = type_traits(type).block_bytes;
  for (int64_t t = first_tile; t < end_tile; ++t) {
    uint8_t* tile = dst + size_t(t) * tile_bytes;
    std::memset(tile, 0, tile_bytes);  // the records' padding
    for (int64_t r = 0; r < kInterleavedRows; ++r) {
      const int64_t row = t * kInterleavedRows + r < rows ? t * kInterleavedRows + r : rows - 1;
      for (int64_t s = 0; s < nsb; ++s)
        put_row(type, src + size_t(row) * src_stride + size_t(s) * block_bytes, size_t(r), tile + size_t(s) * rec_bytes);
    }
  }
}

}  // namespace

bool has_interleaved_layout(GgmlType type) {
  return type == GgmlType::Q8_0 || type == GgmlType::Q4_0 || type == GgmlType::Q4_1 || type == GgmlType::Q5_0 ||
         type == GgmlType::Q5_1 || is_k_layout(type);
}

size_t interleaved_tile_bytes(GgmlType type, int64_t cols) {
  if (!is_k_layout(type)) return tile_of(type, cols).bytes;
  require_k_layout(type, cols);
  return size_t(cols / kQKK) * record_bytes(type);
}

size_t interleaved_bytes(GgmlType type, int64_t rows, int64_t cols) {
  if (rows < 0) throw Error("interleaved layout: negative row count " + std::to_string(rows));
  return size_t((rows + kInterleavedRows - 1) / kInterleavedRows) * interleaved_tile_bytes(type, cols);
}

void interleave_tiles(GgmlType type, const uint8_t* src, size_t src_stride, int64_t rows, int64_t cols,
                      int64_t first_tile, int64_t end_tile, uint8_t* dst) {
  if (is_k_layout(type)) {
    require_k_layout(type, cols);
    interleave_k_tiles(type, src, src_stride, rows, cols, first_tile, end_tile, dst);
    return;
  }
  const Tile at = tile_of(type, cols);
  const Regions& g = at.g;
  const Fields& f = at.f;
  for (int64_t t = first_tile; t < end_tile; ++t) {
    uint8_t* tile = dst + size_t(t) * at.bytes;
    for (int64_t r = 0; r < kInterleavedRows; ++r) {
      const int64_t row = t * kInterleavedRows + r < rows ? t * kInterleavedRows + r : rows - 1;
      for (int64_t b = 0; b < at.nb; ++b) {
        const uint8_t* blk = src + size_t(row) * src_stride + size_t(b) * at.block_bytes;
        uint8_t* quants = tile + at.quants + size_t(b) * g.quants;
        const uint32_t bias = type == GgmlType::Q8_0 ? 0x80808080u : 0;  // Q8_0: int8 + 128 = XOR 0x80
        for (int k = 0; k < at.groups; ++k) {
          uint32_t v;
          std::memcpy(&v, blk + f.qs + 4 * k, 4);
          v ^= bias;
          std::memcpy(quants + size_t(k) * 64 + size_t(r) * 4, &v, 4);
        }
        if (f.qh >= 0) {
          uint32_t qh;
          std::memcpy(&qh, blk + f.qh, 4);
          const uint32_t v = spread_high_bits(qh);
          std::memcpy(tile + at.high + size_t(b) * g.high + size_t(r) * 4, &v, 4);
        }
        std::memcpy(tile + at.d + size_t(b) * g.d + size_t(r) * 2, blk + f.d, 2);
        if (f.m >= 0) std::memcpy(tile + at.m + size_t(b) * g.m + size_t(r) * 2, blk + f.m, 2);
      }
    }
    const size_t used = size_t(at.nb) * g.total();
    std::memset(tile + used, 0, at.bytes - used);
  }
}

void deinterleave_row(GgmlType type, const uint8_t* interleaved, int64_t cols, int64_t r, uint8_t* dst) {
  if (is_k_layout(type)) {
    const size_t tile_bytes = interleaved_tile_bytes(type, cols), rec_bytes = record_bytes(type);
    const uint8_t* tile = interleaved + size_t(r / kInterleavedRows) * tile_bytes;
    for (int64_t s = 0; s < cols / kQKK; ++s)
      get_row(type, tile + size_t(s) * rec_bytes, size_t(r % kInterleavedRows),
              dst + size_t(s) * type_traits(type).block_bytes);
    return;
  }
  const Tile at = tile_of(type, cols);
  const Regions& g = at.g;
  const Fields& f = at.f;
  const uint8_t* tile = interleaved + size_t(r / kInterleavedRows) * at.bytes;
  const size_t lane = size_t(r % kInterleavedRows);
  for (int64_t b = 0; b < at.nb; ++b) {
    uint8_t* blk = dst + size_t(b) * at.block_bytes;
    const uint8_t* quants = tile + at.quants + size_t(b) * g.quants;
    for (int k = 0; k < at.groups; ++k)
      for (int e = 0; e < 4; ++e) {
        const uint8_t q = quants[size_t(k) * 64 + lane * 4 + size_t(e)];
        blk[f.qs + 4 * k + e] = type == GgmlType::Q8_0 ? uint8_t(q ^ 0x80u) : q;
      }
    if (f.qh >= 0) {
      uint32_t v;
      std::memcpy(&v, tile + at.high + size_t(b) * g.high + lane * 4, 4);
      const uint32_t qh = gather_high_bits(v);
      std::memcpy(blk + f.qh, &qh, 4);
    }
    std::memcpy(blk + f.d, tile + at.d + size_t(b) * g.d + lane * 2, 2);
    if (f.m >= 0) std::memcpy(blk + f.m, tile + at.m + size_t(b) * g.m + lane * 2, 2);
  }
}

}  // namespace microspec
