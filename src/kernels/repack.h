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
#include <cstddef>
#include <cstdint>

#include "kernels/types.h"

namespace microspec {

constexpr int64_t kInterleavedRows = 16;  // rows per tile

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
