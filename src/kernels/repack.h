#pragma once
// Weights repacked at load into an interleaved layout that a kernel table's interleaved kernels
// read without decoding or transposing (KernelTable::gemm_interleaved). The mapped GGUF stays the
// source of truth: the interleaved copy is built from it and is an extra allocation of the same
// size as the matrix (`--no-repack` keeps only the zero-copy path).
//
// Layout "16 rows x dwords", for the 32-element formats Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1: rows go
// in tiles of 16 (a short last tile repeats its last row). A tile of a matrix with nb blocks per
// row is interleaved_tile_bytes() long and holds, region after region:
//   quants [nb][groups][16][4] bytes: group k of block b = 4 bytes of each of the tile's 16 rows
//          (row r at byte 4r), so one 64-byte load covers 16 rows:
//          Q8_0: 8 groups, group k = elements 4k..4k+3, each the stored int8 plus 128 (unsigned);
//          4- and 5-bit types: 4 groups, group j = the stored bytes qs[4j..4j+3], whose low
//          nibbles are elements 4j..4j+3 and high nibbles elements 16+4j..16+4j+3;
//   high   (Q5_0, Q5_1) [nb][16] uint32: each row's 32 fifth bits, bit 8e + k holding element
//          4k + e's, so that the bits of elements 4k..4k+3 sit k bits below bit 4 of bytes 0..3;
//   d      [nb][16] fp16: block b's scale of rows 0..15;
//   m      (Q4_1, Q5_1) [nb][16] fp16: block b's min of rows 0..15;
// zero padding to a multiple of 64 bytes. Tile t starts at t * interleaved_tile_bytes(). A tile
// takes the same bytes as its 16 rows in the file, but for the padding.
//
// Layout "16 rows x superblock records", for the K-quant formats Q4_K and Q6_K: rows go in tiles
// of 16 as above, and a tile of a matrix with nsb = cols / 256 superblocks per row is nsb records,
// record s holding superblock s of the tile's 16 rows (offsets in Q4KRecord / Q6KRecord below):
//   Q4_K, 2368 bytes (file: 16 x 144 = 2304):
//     quants [32][16][4] bytes: group g = bytes qs[4g..4g+3] of each row (row r at byte 4r), whose
//            low nibbles are elements 64c + 4l..4l+3 (c = g / 8, l = g % 8: sub-block 2c) and high
//            nibbles elements 64c + 32 + 4l..4l+3 (sub-block 2c + 1);
//     scales [8][16], mins [8][16] bytes: sub-block j's 6-bit scale and min of rows 0..15, unpacked
//            from the file's 12 bytes (a bijection: deinterleave_row packs them back);
//     d [16], dmin [16] fp16.
//   Q6_K, 3392 bytes (file: 16 x 210 = 3360):
//     low    [32][16][4] bytes: group g = bytes ql[4g..4g+3]: half h = g / 16, b = 4 (g % 16); low
//            nibbles are elements 128h + b..b+3, high nibbles 128h + 64 + b..b+3;
//     high   [16][16][4] bytes: group m = bytes qh[4m..4m+3] as in the file (half m / 8, l = 4 (m % 8):
//            bits 0-1, 2-3, 4-5, 6-7 of byte l + e are the top bits of elements 128h + l + e + 0, 32,
//            64, 96, so it completes low groups 16h + m % 8 and 16h + 8 + m % 8);
//     scales [16][16] int8: sub-block j's scale of rows 0..15; d [16] fp16; 32 bytes of zeros.
#include <cstddef>
#include <cstdint>

#include "kernels/types.h"

namespace microspec {

constexpr int64_t kInterleavedRows = 16;  // rows per tile

// Byte offsets in a K-quant record (see above).
struct Q4KRecord {
  static constexpr size_t kQuants = 0, kScales = 2048, kMins = 2176, kD = 2304, kDmin = 2336, kBytes = 2368;
};
struct Q6KRecord {
  static constexpr size_t kLow = 0, kHigh = 2048, kScales = 3072, kD = 3328, kBytes = 3392;
};

// Whether `type` has the interleaved layout.
bool has_interleaved_layout(GgmlType type);
// Bytes of one tile of 16 rows of `cols` elements, and of a whole matrix of `rows` rows. Throw
// Error for a type without the layout or cols that are not whole blocks.
size_t interleaved_tile_bytes(GgmlType type, int64_t cols);
size_t interleaved_bytes(GgmlType type, int64_t rows, int64_t cols);
// Writes rows [first_tile * 16, ...) of a matrix in the file's format (row r at src + r *
// src_stride, `rows` rows in all) as tiles [first_tile, end_tile) of the interleaved layout at dst
// (the whole matrix's interleaved buffer, interleaved_bytes() long). Tiles are independent, so
// disjoint tile ranges can be written by different threads.
void interleave_tiles(GgmlType type, const uint8_t* src, size_t src_stride, int64_t rows, int64_t cols,
                      int64_t first_tile, int64_t end_tile, uint8_t* dst);
// Row r of an interleaved matrix back in the file's format (row_bytes(type, cols) bytes at dst).
void deinterleave_row(GgmlType type, const uint8_t* interleaved, int64_t cols, int64_t r, uint8_t* dst);

}  // namespace microspec
