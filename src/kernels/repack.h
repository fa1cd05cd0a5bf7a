#pragma once
// Weights repacked at load into an interleaved layout that a kernel table's interleaved kernels
// read without decoding or transposing (KernelTable::gemm_interleaved). The mapped GGUF stays the
// source of truth: the interleaved copy is built from it and is an extra allocation of the same
// size as the matrix (`--no-repack` keeps only the zero-copy path).
//
// Layout "16 rows x dwords", Q8_0 only (the LM heads and Q8_0 files):
// rows go in tiles of 16 (a short last tile repeats its last row). A tile of a matrix with nb
// blocks per row is interleaved_tile_bytes() long and holds
//   quants [nb][8][16][4] bytes: for block b and k < 8, 64 bytes = dword k (elements 4k..4k+3) of
//          rows 0..15 of the tile, each byte the stored int8 plus 128 (as an unsigned byte), so
//          one 64-byte load is the unsigned operand of one vpdpbusd over 16 rows;
//   scales [nb][16] fp16: block b's scale of rows 0..15;
// zero padding to a multiple of 64 bytes. Tile t starts at t * interleaved_tile_bytes().
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
