#pragma once
// Private to src/kernels: a call's token count (1..8) turned into a compile-time constant for the
// kernels' templates, row groups of such counts, and the cache blocking of many-token products.
//
// In an unnamed namespace on purpose: each kernel file is compiled with its own target flags
// (kernels_avx512.cpp with AVX-512), so every file must get its own copy. A shared inline
// function would let the linker keep the AVX-512 file's copy for the AVX2 file too.
#include <algorithm>
#include <cstdint>

namespace microspec {
namespace {

// Calls f.template operator()<NT>() with NT = n as a compile-time constant (n outside 2..8: 1).
template <class F>
inline void with_token_count(int64_t n, F&& f) {
  switch (n) {
    case 8:
      f.template operator()<8>();
      break;
    case 7:
      f.template operator()<7>();
      break;
    case 6:
      f.template operator()<6>();
      break;
    case 5:
      f.template operator()<5>();
      break;
    case 4:
      f.template operator()<4>();
      break;
    case 3:
      f.template operator()<3>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    default:
      f.template operator()<1>();
      break;
  }
}

// Calls f.template operator()<NR>(r0) for consecutive groups of NR <= group (<= 8) rows from r0,
// covering [0, n): the attention kernels' blocks of query rows.
template <class F>
inline void for_row_groups(int64_t n, int64_t group, F&& f) {
  for (int64_t r0 = 0; r0 < n; r0 += group)
    with_token_count(n - r0 < group ? n - r0 : group, [&]<int NR>() { f.template operator()<NR>(r0); });
}

// Cache blocking of a many-token product over contiguous weight tiles. A call of more than
// kTokenBlock tokens goes through its tiles in chunks of about kChunkBytes (they stay in L2 once
// read) and, per chunk, through its tokens in blocks of kTokenBlock, every tile of the chunk
// against one block before the next: a block's activations (16 x 680 bytes for Gemma's LM head)
// stay in L1 beside the tile in use. One pass of all tokens per tile instead lets 64 tokens'
// activations (43 KB) push the tile and themselves out of a 32 KB L1 at every group of tokens:
// Gemma's LM head at 64 tokens ran at 130 against 164 GMAC/s blocked (Zen 4, AVX-512, one thread,
// CPU time). Smaller calls are one block over all tiles. f(tile_begin, tile_end, t_begin, t_end)
// is called for each chunk and block, blocks of a chunk in order, so the first block of a chunk
// (t_begin == 0) is the one that reads its tiles from memory.
constexpr int64_t kTokenBlock = 16;
constexpr size_t kChunkBytes = size_t(256) << 10;

template <class F>
inline void for_tile_chunks_and_token_blocks(int64_t n_tiles, size_t tile_bytes, int64_t n_tokens, F&& f) {
  if (n_tiles <= 0 || n_tokens <= 0) return;
  if (n_tokens <= kTokenBlock) return f(int64_t(0), n_tiles, int64_t(0), n_tokens);
  const int64_t chunk = std::max(int64_t(1), int64_t(kChunkBytes / tile_bytes));
  for (int64_t c0 = 0; c0 < n_tiles; c0 += chunk)
    for (int64_t b0 = 0; b0 < n_tokens; b0 += kTokenBlock)
      f(c0, std::min(n_tiles, c0 + chunk), b0, std::min(n_tokens, b0 + kTokenBlock));
}

}  // namespace
}  // namespace microspec
