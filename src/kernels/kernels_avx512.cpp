// AVX-512 (F, BW, VL, DQ, VNNI) kernels for the hot weight types: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1,
// Q4_K, Q5_K, Q6_K. Float weights and the quantizers come from the AVX2 table.
//
// This file is compiled with AVX-512 flags and only entered after cpu_features() says the CPU has
// them. Everything here has internal linkage and no standard-library templates are instantiated,
// so the linker can never substitute an AVX-512 copy of a shared inline function into code that
// runs on an AVX2-only machine.
//
// Rows are processed 16 at a time, one row per 32-bit lane of the float accumulators. Two paths:
// - few tokens (decode): each row's block pair (or K-quant superblock) is decoded and multiplied
//   with the activation with vpdpbusd (vpmaddubsw + vpdpwssd for K-quants), and the integer lanes
//   are then summed across the 16 rows into one integer per row and block (one token on Q4_K/Q5_K:
//   each row's integer comes from 256-bit instructions instead, rows16_k_rows); the token count
//   where the second path takes over is per weight type (kRowLanesMinTokens);
// - more tokens (verification of a draft, prefill): the 16 rows are decoded once and transposed
//   so that each register holds 4 consecutive quants of every row; each token then takes its 4
//   activation quants as a 32-bit broadcast, so one vpdpbusd advances 16 rows. For the 32-element
//   formats and up to 8 tokens each block pair is transposed in registers and used at once
//   (rows16_lanes); otherwise the whole tile is transposed into scratch first and reused by every
//   group of 8 tokens.
// Both paths compute the exact integer dot product of each (row, block) and then apply the same
// float operations in the same order, so a token's result does not depend on how many tokens
// share the call: batched verification reproduces one-token decoding bit for bit.
//
// Weights of the 32-element formats are decoded to unsigned bytes u = w + bias (bias 128 for Q8_0,
// 8 for Q4_0, 16 for Q5_0, 0 for the asymmetric Q4_1/Q5_1) for vpdpbusd (unsigned x signed); the
// bias is removed exactly with -bias * (sum of the block's activation quants).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "kernels/kernels.h"
#include "kernels/simd_common.h"
#include "kernels/token_count.h"
#include "kernels/kernels_internal.h"
#include "kernels/repack.h"

// GCC 12's AVX-512 intrinsic headers build "undefined" registers from self-initialised variables,
// which -Wmaybe-uninitialized (or -Wuninitialized, once inlined) reports at every use (a known
// false positive). Clang (the fuzzing build) has no such group.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace microspec {

namespace {


// Per-thread scratch (activation summaries, decoded tiles); grows to the largest call and stays.
struct Scratch {
  void* p = nullptr;
  size_t cap = 0;
  ~Scratch() { std::free(p); }
};

void* scratch(size_t bytes) {
  thread_local Scratch s;
  if (s.cap < bytes) {
    std::free(s.p);
    s.p = nullptr;
    s.cap = 0;
    const size_t cap = (bytes + bytes / 2 + 63) & ~size_t(63);
    s.p = std::aligned_alloc(64, cap);
    if (!s.p) throw std::bad_alloc();
    s.cap = cap;
  }
  return s.p;
}

// Word indices for vpermw: lanes 0-7 <- word a, 8-15 <- b, 16-23 <- c, 24-31 <- d.
inline __m512i word_index(int a, int b, int c, int d) {
  __m512i v = _mm512_set1_epi16(short(a));
  v = _mm512_mask_set1_epi16(v, 0x0000FF00u, short(b));
  v = _mm512_mask_set1_epi16(v, 0x00FF0000u, short(c));
  return _mm512_mask_set1_epi16(v, 0xFF000000u, short(d));
}

// Two blocks' 16 packed nibble bytes -> 64 bytes in element order: block 0 low nibbles (elements
// 0-15), block 0 high nibbles (16-31), then block 1 likewise.
inline __m512i nibbles64(__m128i q0, __m128i q1) {
  const __m512i v = _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1));
  const __m512i z = _mm512_shuffle_i64x2(v, v, 0x50);  // 128-bit lanes [q0, q0, q1, q1]
  // Shift the second copy of each block right by 4 (16-bit lanes 8-15 and 24-31).
  const __m512i shift = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFF00FF00u, 4);
  return _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi8(0x0F));
}

// In-register transpose of a 16x16 matrix of dwords: r[i] dword j <-> r[j] dword i.
[[gnu::always_inline]] inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + e], in 128-bit lane j: element 4j + e of rows 4g..4g+3.
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // 4x4 transpose of 128-bit lanes across u[e], u[4 + e], u[8 + e], u[12 + e].
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44),
                  v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44),
                  v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Summing integer lanes across 16 rows, in three steps:
// pair_sums(a, b): rows a, b -> per 128-bit lane j: [a(4j)+a(4j+2), b(4j)+b(4j+2), a(4j+1)+a(4j+3), ...]
inline __m512i pair_sums(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
// quad_sums(pair_sums(r0, r1), pair_sums(r2, r3)) -> per 128-bit lane j: the sums of lane group j
// (lanes 4j..4j+3) of rows r0..r3.
inline __m512i quad_sums(__m512i p01, __m512i p23) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(p01, p23), _mm512_unpackhi_epi64(p01, p23));
}
// From the quad sums of rows 0-3, 4-7, 8-11, 12-15: s0 = lanes 0-7 of each row (the first block
// of a pair), s1 = lanes 8-15 (the second), one row per lane.
inline void half_sums(const __m512i* q, __m512i* s0, __m512i* s1) {
  const __m512i a =
      _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], 0x88), _mm512_shuffle_i32x4(q[0], q[1], 0xDD));
  const __m512i b =
      _mm512_add_epi32(_mm512_shuffle_i32x4(q[2], q[3], 0x88), _mm512_shuffle_i32x4(q[2], q[3], 0xDD));
  *s0 = _mm512_shuffle_i32x4(a, b, 0x88);
  *s1 = _mm512_shuffle_i32x4(a, b, 0xDD);
}
// From the quad sums of rows 0-3, ..., 12-15: all 16 lanes of each row, one row per lane.
inline __m512i full_sums(const __m512i* q) {
  __m512i s0, s1;
  half_sums(q, &s0, &s1);
  return _mm512_add_epi32(s0, s1);
}

// The 16 rows of a tile: a short last tile repeats its last row (only valid outputs are stored).
struct RowTiles {
  const uint8_t* w;
  size_t stride;
  const int32_t* ids;
  int64_t n_rows;
  void rows(int64_t r0, const uint8_t** out) const {
    const int64_t valid = min64(16, n_rows - r0);
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t i = r0 + min64(r, valid - 1);
      out[r] = w + size_t(ids ? ids[i] : i) * stride;
    }
  }
};

// Sixteen interleaved row streams defeat the hardware prefetcher, so each tile loop prefetches the
// next tile while it works. When the next tile's rows are contiguous (matmul): a sequential sweep
// over its bytes, one slice per loop iteration; otherwise (matmul_rows): in each iteration, the
// part of each of its rows that the same iteration reads. Both go to L2 (hint T1), not L1: on Zen 4
// (2-core EPYC, 2026-12-01) the sweep into L1 evicted the current tile's lines and held the Gemma
// LM head (Q8_0 262144x640, one token, 2 threads) at 9.7 ms, 18 GB/s; into L2 it runs at 5.5 ms,
// 31 GB/s, the machine's measured read ceiling.
struct NextTile {
  const uint8_t* const* rows = nullptr;  // the next tile's 16 rows; null: no next tile
  const uint8_t* base = nullptr;         // non-null when they are contiguous: their first byte
  size_t bytes = 0;                      // and their total size
  size_t slice = 0;                      // bytes per iteration (set by sliced())

  // A copy for a loop of n iterations.
  NextTile sliced(int64_t n) const {
    NextTile t = *this;
    t.slice = ((bytes + size_t(n) - 1) / size_t(n) + 63) & ~size_t(63);
    return t;
  }
};

// Always inlined: GCC treats a function made only of prefetches as free of side effects and
// deletes the calls.
[[gnu::always_inline]] inline void prefetch_next(const NextTile& next, int64_t i, size_t at, size_t len) {
  if (!next.rows) return;
  if (next.base) {
    const size_t b = next.slice * size_t(i), e = b + next.slice < next.bytes ? b + next.slice : next.bytes;
    for (size_t o = b; o < e; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next.base + o), _MM_HINT_T1);
    return;
  }
  for (int r = 0; r < 16; ++r)
    for (size_t o = 0; o < len; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next.rows[r] + at + o), _MM_HINT_T1);
}

// Calls f(rows, next, r0, valid_mask) for each tile of 16 rows; the tile loop in f has n_iters
// iterations (block pairs or superblocks), which sets the prefetch slices.
template <class F>
void for_each_tile(const RowTiles& tiles, int64_t n_iters, F&& f) {
  if (tiles.n_rows <= 0) return;
  const uint8_t* rows[16];
  const uint8_t* next_rows[16];
  tiles.rows(0, next_rows);
  // The first tile has no predecessor to prefetch it: all of its lines are requested at once, so
  // that their misses overlap instead of arriving one demand load at a time (a thread's part of a
  // small matrix is only a few tiles).
  for (int r = 0; r < 16; ++r)
    for (size_t o = 0; o < tiles.stride; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next_rows[r] + o), _MM_HINT_T1);
  for (int64_t r0 = 0; r0 < tiles.n_rows; r0 += 16) {
    for (int r = 0; r < 16; ++r) rows[r] = next_rows[r];
    NextTile next;
    if (r0 + 16 < tiles.n_rows) {
      tiles.rows(r0 + 16, next_rows);
      next.rows = next_rows;
      if (!tiles.ids) {
        next.base = next_rows[0];
        next.bytes = size_t(min64(16, tiles.n_rows - r0 - 16)) * tiles.stride;
      }
    } else if (!tiles.ids && tiles.stride > 0) {
      // The last tile prefetches the 16 rows after this call's: usually the same thread's next
      // chunk of the matrix (prefetches never fault, past the matrix's end they are dropped or
      // wasted).
      next.rows = next_rows;  // only marks that there is a next tile; the sweep uses base
      next.base = tiles.w + size_t(tiles.n_rows) * tiles.stride;
      next.bytes = 16 * tiles.stride;
    }
    const int64_t valid = min64(16, tiles.n_rows - r0);
    f(rows, next.sliced(n_iters), r0, __mmask16((1u << valid) - 1));
  }
}

// =============================================================================================
// 32-element formats

// Weight decoders: pair() for two consecutive blocks, single() for a last odd block (loads nothing
// past it; the missing block's lanes are don't-care, its activation is zero).
struct Q8_0W {
  using Block = BlockQ8_0;
  using Act = BlockQ8_0;
  static constexpr GgmlType kType = GgmlType::Q8_0;
  static constexpr bool kAsym = false;
  static constexpr int kBiasShift = 7;  // u = w + 128
  static constexpr int64_t kRowLanesMinTokens = 3;  // measured on Zen 4 (EPYC, 1 thread): lanes win from 3 tokens
  // The amx table's tiles from 32 tokens: measured on the Xeon (2 threads), 16 tokens ran 7% slower
  // on tiles than on the AVX-512 kernel (one token group does not repay decoding the tile).
  static constexpr int64_t kAmxMinTokens = 32;
  static __m512i pair(const Block* b) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(loadu256(b[0].qs)), loadu256(b[1].qs), 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  }
  static __m512i single(const Block* b) {
    return _mm512_xor_si512(_mm512_zextsi256_si512(loadu256(b->qs)), _mm512_set1_epi8(char(0x80)));
  }
};

struct Q4_0W {
  using Block = BlockQ4_0;
  using Act = BlockQ8_0;
  static constexpr GgmlType kType = GgmlType::Q4_0;
  static constexpr bool kAsym = false;
  static constexpr int kBiasShift = 3;  // u = w + 8
  static constexpr int64_t kRowLanesMinTokens = 3;  // not measured separately: as Q8_0
  static constexpr int64_t kAmxMinTokens = 32;       // not measured separately: as Q8_0
  static __m512i pair(const Block* b) { return nibbles64(loadu128(b[0].qs), loadu128(b[1].qs)); }
  static __m512i single(const Block* b) { return nibbles64(loadu128(b->qs), _mm_setzero_si128()); }
};

struct Q5_0W {
  using Block = BlockQ5_0;
  using Act = BlockQ8_0;
  static constexpr GgmlType kType = GgmlType::Q5_0;
  static constexpr bool kAsym = false;
  static constexpr int kBiasShift = 4;  // u = w + 16
  static constexpr int64_t kRowLanesMinTokens = 2;  // measured on Zen 4: lanes equal per-row products at 2 tokens and win from 3
  static constexpr int64_t kAmxMinTokens = 16;  // measured on the Xeon: tiles 6-23% faster at 16 tokens
  static __m512i pair(const Block* b) {
    const __m512i nib = nibbles64(loadu128(b[0].qs), loadu128(b[1].qs));
    const __mmask64 high = _cvtu64_mask64(uint64_t(load_u32(b[0].qh)) | (uint64_t(load_u32(b[1].qh)) << 32));
    return _mm512_mask_add_epi8(nib, high, nib, _mm512_set1_epi8(16));
  }
  static __m512i single(const Block* b) {
    const __m512i nib = nibbles64(loadu128(b->qs), _mm_setzero_si128());
    return _mm512_mask_add_epi8(nib, _cvtu64_mask64(load_u32(b->qh)), nib, _mm512_set1_epi8(16));
  }
};

struct Q4_1W {
  using Block = BlockQ4_1;
  using Act = BlockQ8_1;
  static constexpr GgmlType kType = GgmlType::Q4_1;
  static constexpr bool kAsym = true;
  static constexpr int kBiasShift = 0;
  static constexpr int64_t kRowLanesMinTokens = 5;  // measured on Zen 4: per-row products win up to 4 tokens
  static constexpr int64_t kAmxMinTokens = 32;  // measured on the Xeon: tiles 9% slower at 16 tokens, faster from 32
  static __m512i pair(const Block* b) { return nibbles64(loadu128(b[0].qs), loadu128(b[1].qs)); }
  static __m512i single(const Block* b) { return nibbles64(loadu128(b->qs), _mm_setzero_si128()); }
};

struct Q5_1W {
  using Block = BlockQ5_1;
  using Act = BlockQ8_1;
  static constexpr GgmlType kType = GgmlType::Q5_1;
  static constexpr bool kAsym = true;
  static constexpr int kBiasShift = 0;
  static constexpr int64_t kRowLanesMinTokens = 3;  // not measured separately: as Q8_0
  static constexpr int64_t kAmxMinTokens = 16;       // not measured separately: as Q5_0
  static __m512i pair(const Block* b) {
    const __m512i nib = nibbles64(loadu128(b[0].qs), loadu128(b[1].qs));
    const __mmask64 high = _cvtu64_mask64(uint64_t(load_u32(b[0].qh)) | (uint64_t(load_u32(b[1].qh)) << 32));
    return _mm512_mask_add_epi8(nib, high, nib, _mm512_set1_epi8(16));
  }
  static __m512i single(const Block* b) {
    const __m512i nib = nibbles64(loadu128(b->qs), _mm_setzero_si128());
    return _mm512_mask_add_epi8(nib, _cvtu64_mask64(load_u32(b->qh)), nib, _mm512_set1_epi8(16));
  }
};

// Scales (and the asymmetric types' mins) of block b of the 16 rows, one row per lane. d is each
// block's first field, m right after it. (Plain loads: vpgatherdd measured slower.)
template <class W>
inline void block_scales(const uint8_t* const* rows, int64_t b, __m512* d, __m512* m) {
  alignas(64) uint32_t v[16];
  for (int r = 0; r < 16; ++r) v[r] = load_u32(rows[r] + size_t(b) * sizeof(typename W::Block));
  const __m512i dm = _mm512_load_si512(v);
  *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
  if (W::kAsym) *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
}

// vpermt2w indices for gathering the scale words of 16 rows (see pair_scales).
struct Words32 {
  alignas(64) int16_t v[32];
};
// Rows a, b -> words [a's k words, b's k words]; a row's words: d0 (word 0), and for k = 4 m0
// (word 1); then d1 (word w1) and for k = 4 m1 (w1 + 1).
constexpr Words32 gather_index(int k, int w1) {
  Words32 r{};
  const int sel[4] = {0, k == 4 ? 1 : w1, w1, w1 + 1};
  for (int j = 0; j < 2 * k; ++j) r.v[j] = int16_t((j < k ? 0 : 32) + sel[j % k]);
  return r;
}
// The first `width` words of a, then the first `width` of b.
constexpr Words32 merge_index(int width) {
  Words32 r{};
  for (int j = 0; j < 2 * width && j < 32; ++j) r.v[j] = int16_t(j < width ? j : 32 + (j - width));
  return r;
}
// Rows 0-15 with words (d0, d1) each -> [d0 of rows 0-15, d1 of rows 0-15].
constexpr Words32 deinterleave2_index() {
  Words32 r{};
  for (int i = 0; i < 32; ++i) r.v[i] = int16_t(i < 16 ? 2 * i : 2 * (i - 16) + 1);
  return r;
}
// Rows 0-7 in a, 8-15 in b, words (d0, m0, d1, m1) each -> [field f of rows 0-15, field f + 1].
constexpr Words32 deinterleave4_index(int f) {
  Words32 r{};
  for (int i = 0; i < 32; ++i) {
    const int row = i % 16, field = f + i / 16;
    r.v[i] = int16_t((row < 8 ? 0 : 32) + 4 * (row % 8) + field);
  }
  return r;
}

// The scales (and mins) of both blocks of pair p of the 16 rows, one row per lane: the words are
// collected from one load per row by a tree of vpermt2w (cheaper than 32 scalar loads).
template <class W>
inline void pair_scales(const uint8_t* const* rows, int64_t p, __m512* d, __m512* m) {
  using Block = typename W::Block;
  constexpr int kWords = W::kAsym ? 4 : 2;
  constexpr int kW1 = int(sizeof(Block) / 2);
  static constexpr Words32 kLevel1 = gather_index(kWords, kW1);
  static constexpr Words32 kLevel2 = merge_index(2 * kWords), kLevel3 = merge_index(4 * kWords);
  static constexpr Words32 kLevel4 = merge_index(16), kDeint2 = deinterleave2_index();
  static constexpr Words32 kDeintA = deinterleave4_index(0), kDeintB = deinterleave4_index(2);
  __m512i v[8];
  for (int i = 0; i < 8; ++i) {
    const uint8_t* a = rows[2 * i] + size_t(2 * p) * sizeof(Block);
    const uint8_t* b = rows[2 * i + 1] + size_t(2 * p) * sizeof(Block);
    // Q8_0's pair is 68 bytes with d1 at byte 34: a 64-byte load; the others fit in 32.
    const __m512i ra = 2 * sizeof(Block) >= 64 ? _mm512_loadu_si512(a) : _mm512_castsi256_si512(loadu256(a));
    const __m512i rb = 2 * sizeof(Block) >= 64 ? _mm512_loadu_si512(b) : _mm512_castsi256_si512(loadu256(b));
    v[i] = _mm512_permutex2var_epi16(ra, _mm512_load_si512(kLevel1.v), rb);
  }
  for (int i = 0; i < 4; ++i)
    v[i] = _mm512_permutex2var_epi16(v[2 * i], _mm512_load_si512(kLevel2.v), v[2 * i + 1]);
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_permutex2var_epi16(v[2 * i], _mm512_load_si512(kLevel3.v), v[2 * i + 1]);
  if constexpr (W::kAsym) {
    const __m512i fa = _mm512_permutex2var_epi16(v[0], _mm512_load_si512(kDeintA.v), v[1]);
    const __m512i fb = _mm512_permutex2var_epi16(v[0], _mm512_load_si512(kDeintB.v), v[1]);
    d[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(fa));
    m[0] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(fa, 1));
    d[1] = _mm512_cvtph_ps(_mm512_castsi512_si256(fb));
    m[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(fb, 1));
  } else {
    const __m512i all = _mm512_permutex2var_epi16(v[0], _mm512_load_si512(kLevel4.v), v[1]);
    const __m512i f = _mm512_permutexvar_epi16(_mm512_load_si512(kDeint2.v), all);
    d[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(f));
    d[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(f, 1));
  }
}

// Symmetric types: the integer start of block b (-bias * sum of its activation quants) in every lane.
template <class W>
inline __m512i block_start(const float* x, int64_t b) {
  int32_t start;
  std::memcpy(&start, &x[b], 4);
  return _mm512_set1_epi32(start);
}

// The float steps shared by both paths, for block b of 16 rows and one token: i = the exact
// integer dot products (bias not yet removed), dw/mw = the rows' scales and mins.
// kStarted: i already includes the integer start (exact either way).
template <class W, bool kStarted = false>
inline __m512 accumulate_block(__m512 acc, __m512i i, __m512 dw, __m512 mw, const float* d, const float* x,
                               int64_t b) {
  if constexpr (!W::kAsym && !kStarted) i = _mm512_add_epi32(i, block_start<W>(x, b));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(d[b])), dw, acc);
  if constexpr (W::kAsym) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(x[b]), acc);
  return acc;
}

// Few tokens: 16 rows against NT tokens.
template <class W, int NT>
void rows16_few(const uint8_t* const* rows, const NextTile& next, int64_t nb, const uint8_t* act,
                size_t act_stride, const float* ad, const float* ax, int64_t info_stride, float* out,
                int64_t ldo, __mmask16 valid) {
  using Block = typename W::Block;
  using Act = typename W::Act;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    const bool second = 2 * p + 1 < nb;
    prefetch_next(next, p, size_t(2 * p) * sizeof(Block), 2 * sizeof(Block));
    __m512i a[NT];
    for (int t = 0; t < NT; ++t) {
      const Act* y = reinterpret_cast<const Act*>(act + size_t(t) * act_stride) + 2 * p;
      const __m256i q1 = second ? loadu256(y[1].qs) : _mm256_setzero_si256();
      a[t] = _mm512_inserti64x4(_mm512_castsi256_si512(loadu256(y[0].qs)), q1, 1);
    }
    // Rows in groups of 4: dot products, then the first two summing steps, so that only the quad
    // sums of each token stay live.
    __m512i quads[NT][4];
    for (int g = 0; g < 4; ++g) {
      __m512i pairs[NT][2];
      for (int h = 0; h < 2; ++h) {
        const Block* ba = reinterpret_cast<const Block*>(rows[4 * g + 2 * h]) + 2 * p;
        const Block* bb = reinterpret_cast<const Block*>(rows[4 * g + 2 * h + 1]) + 2 * p;
        const __m512i ua = second ? W::pair(ba) : W::single(ba);
        const __m512i ub = second ? W::pair(bb) : W::single(bb);
        for (int t = 0; t < NT; ++t)
          pairs[t][h] = pair_sums(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ua, a[t]),
                                  _mm512_dpbusd_epi32(_mm512_setzero_si512(), ub, a[t]));
      }
      for (int t = 0; t < NT; ++t) quads[t][g] = quad_sums(pairs[t][0], pairs[t][1]);
    }
    __m512 dw[2], mw[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (second)
      pair_scales<W>(rows, p, dw, mw);
    else
      block_scales<W>(rows, 2 * p, &dw[0], &mw[0]);
    for (int t = 0; t < NT; ++t) {
      __m512i s0, s1;
      half_sums(quads[t], &s0, &s1);
      const float* d = ad + t * info_stride;
      const float* x = ax + t * info_stride;
      acc[t] = accumulate_block<W>(acc[t], s0, dw[0], mw[0], d, x, 2 * p);
      if (second) acc[t] = accumulate_block<W>(acc[t], s1, dw[1], mw[1], d, x, 2 * p + 1);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}


// Block b of 16 rows in row lanes (u[k]: dword k, elements 4k..4k+3, of every row; dw/mw their
// scales and mins) against NT tokens: each token's exact integer products, in two chains of four
// vpdpbusd (half the latency of one chain of 8) started at the integer start, then the shared float
// steps into acc[t]. Every path that holds a block in row lanes ends here.
template <class W, int NT>
[[gnu::always_inline]] inline void lanes_block(const __m512i* u, __m512 dw, __m512 mw, int64_t b, const uint8_t* act,
                                               size_t act_stride, const float* ad, const float* ax,
                                               int64_t info_stride, __m512* acc) {
  using Act = typename W::Act;
  for (int t = 0; t < NT; ++t) {
    const int8_t* q = reinterpret_cast<const Act*>(act + size_t(t) * act_stride)[b].qs;
    const float* x = ax + t * info_stride;
    __m512i i0 = W::kAsym ? _mm512_setzero_si512() : block_start<W>(x, b), i1 = _mm512_setzero_si512();
    for (int k = 0; k < 8; k += 2) {
      i0 = _mm512_dpbusd_epi32(i0, u[k], _mm512_set1_epi32(load_i32(q + 4 * k)));
      i1 = _mm512_dpbusd_epi32(i1, u[k + 1], _mm512_set1_epi32(load_i32(q + 4 * k + 4)));
    }
    acc[t] = accumulate_block<W, true>(acc[t], _mm512_add_epi32(i0, i1), dw, mw, ad + t * info_stride, x, b);
  }
}

// Many tokens: a tile of 16 rows decoded once into row lanes.
struct alignas(64) TilePair {
  __m512i u[16];  // u[k]: dword k of the pair (k < 8: block 0, else block 1) of rows 0-15
  __m512 d[2];    // the two blocks' scales of rows 0-15 (zero for a missing odd block)
  __m512 m[2];    // asymmetric types: the two blocks' mins
};

template <class W>
void build_tile(const uint8_t* const* rows, const NextTile& next, int64_t nb, TilePair* tile) {
  using Block = typename W::Block;
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    const bool second = 2 * p + 1 < nb;
    prefetch_next(next, p, size_t(2 * p) * sizeof(Block), 2 * sizeof(Block));
    __m512i u[16];
    for (int r = 0; r < 16; ++r) {
      const Block* b = reinterpret_cast<const Block*>(rows[r]) + 2 * p;
      u[r] = second ? W::pair(b) : W::single(b);
    }
    transpose16(u);
    TilePair& t = tile[p];
    for (int k = 0; k < 16; ++k) _mm512_store_si512(&t.u[k], u[k]);
    t.m[0] = t.d[1] = t.m[1] = _mm512_setzero_ps();
    if (second)
      pair_scales<W>(rows, p, t.d, t.m);
    else
      block_scales<W>(rows, 2 * p, &t.d[0], &t.m[0]);
  }
}

// One tile against NT tokens: per token and block, 8 vpdpbusd with broadcast activation dwords.
template <class W, int NT>
void tile_tokens(const TilePair* tile, int64_t nb, const uint8_t* act, size_t act_stride, const float* ad,
                 const float* ax, int64_t info_stride, float* out, int64_t ldo, __mmask16 valid) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    const TilePair& tp = tile[p];
    const int halves = 2 * p + 1 < nb ? 2 : 1;
    for (int h = 0; h < halves; ++h) {
      const int64_t b = 2 * p + h;
      __m512i u[8];
      for (int k = 0; k < 8; ++k) u[k] = _mm512_load_si512(&tp.u[8 * h + k]);
      lanes_block<W, NT>(u, tp.d[h], tp.m[h], b, act, act_stride, ad, ax, info_stride, acc);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// A few tokens (up to kGroupTokens): each pair of the 16 rows is decoded and transposed in
// registers and used at once by every token, so nothing goes through a stored tile and the
// prefetches of the next tile spread evenly over the compute. Same integer products and float steps
// as tile_tokens, so the results are bitwise those of every other path.
template <class W, int NT>
void rows16_lanes(const uint8_t* const* rows, const NextTile& next, int64_t nb, const uint8_t* act,
                  size_t act_stride, const float* ad, const float* ax, int64_t info_stride, float* out,
                  int64_t ldo, __mmask16 valid) {
  using Block = typename W::Block;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    const bool second = 2 * p + 1 < nb;
    prefetch_next(next, p, size_t(2 * p) * sizeof(Block), 2 * sizeof(Block));
    __m512i u[16];
    for (int r = 0; r < 16; ++r) {
      const Block* b = reinterpret_cast<const Block*>(rows[r]) + 2 * p;
      u[r] = second ? W::pair(b) : W::single(b);
    }
    transpose16(u);
    __m512 dw[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()},
           mw[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (second)
      pair_scales<W>(rows, p, dw, mw);
    else
      block_scales<W>(rows, 2 * p, &dw[0], &mw[0]);
    // Block b against every token, its dwords in v[0..7]. (Called with constant offsets into u so
    // that u and acc stay in registers.)
    lanes_block<W, NT>(u, dw[0], mw[0], 2 * p, act, act_stride, ad, ax, info_stride, acc);
    if (second) lanes_block<W, NT>(u + 8, dw[1], mw[1], 2 * p + 1, act, act_stride, ad, ax, info_stride, acc);
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

constexpr int kGroupTokens = 8;  // tokens per pass over a tile: 8 accumulators + the weight registers
static_assert(kGroupTokens == 8, "with_token_count (token_count.h) covers 1..8 tokens");

template <class W>
void gemm32(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
            size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nb = n / kQK, np = (nb + 1) / 2;
  // Three paths: per-row dot products summed across rows (fewer than W::kRowLanesMinTokens tokens),
  // rows transposed in registers and used at once (up to kGroupTokens), or a stored tile reused
  // by every group of kGroupTokens tokens.
  const bool row_lanes = n_tokens >= W::kRowLanesMinTokens;
  const bool stored_tile = n_tokens > kGroupTokens;
  // Scratch: the activation summaries, then (many tokens) the tile.
  const size_t info_bytes = (size_t(n_tokens * nb) * 2 * sizeof(float) + 63) & ~size_t(63);
  auto* base = static_cast<uint8_t*>(scratch(info_bytes + (stored_tile ? size_t(np) * sizeof(TilePair) : 0)));
  const ActInfo info{reinterpret_cast<float*>(base), reinterpret_cast<float*>(base) + n_tokens * nb};
  auto* tile = reinterpret_cast<TilePair*>(base + info_bytes);
  const auto* ab = static_cast<const uint8_t*>(act);
  act_info<W>(ab, act_stride, n_tokens, nb, info);
  const RowTiles tiles{static_cast<const uint8_t*>(w), w_stride, row_ids, n_rows};
  for_each_tile(
      tiles, np, [&](const uint8_t* const* rows, const NextTile& next, int64_t r0, __mmask16 valid) {
        if (stored_tile) build_tile<W>(rows, next, nb, tile);
        for (int64_t t0 = 0; t0 < n_tokens; t0 += kGroupTokens) {
          const uint8_t* a = ab + size_t(t0) * act_stride;
          const float *d = info.d + t0 * nb, *x = info.x + t0 * nb;
          float* o = out + t0 * ldo + r0;
          const int64_t g = min64(kGroupTokens, n_tokens - t0);
          if (!row_lanes) {
            with_token_count(g, [&]<int NT>() {
              if constexpr (NT < W::kRowLanesMinTokens) rows16_few<W, NT>(rows, next, nb, a, act_stride, d, x, nb, o, ldo, valid);
            });
          } else if (!stored_tile) {
            with_token_count(g, [&]<int NT>() {
              rows16_lanes<W, NT>(rows, next, nb, a, act_stride, d, x, nb, o, ldo, valid);
            });
          } else {
            with_token_count(
                g, [&]<int NT>() { tile_tokens<W, NT>(tile, nb, a, act_stride, d, x, nb, o, ldo, valid); });
          }
        }
      });
}

template <class W>
float vec_dot32(const void* w, const void* a, int64_t n) {
  float s;
  gemm32<W>(w, 0, nullptr, 1, a, 0, 1, n, &s, 1);
  return s;
}

// =============================================================================================
// 32-element formats in the interleaved layout (repack.h)

// What the interleaved kernels need of each type: the bytes per block (of 16 rows) of the quant
// and fifth-bit regions, and dwords(): block b's 8 registers of row lanes, register k = elements
// 4k..4k+3 of the 16 rows as the unsigned bytes the file path's decoders give.
struct Q8_0Tiles {
  using W = Q8_0W;
  static constexpr size_t kQuantBytes = 8 * 64, kHighBytes = 0;
  static void dwords(const uint8_t* quants, const uint8_t*, __m512i* u) {
    for (int k = 0; k < 8; ++k) u[k] = _mm512_loadu_si512(quants + 64 * k);
  }
};

// Group j of the 4-bit types: low nibbles = elements 4j..4j+3, high nibbles = 16+4j..16+4j+3.
template <class Weights>
struct Q4Tiles {
  using W = Weights;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 0;
  static void dwords(const uint8_t* quants, const uint8_t*, __m512i* u) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(quants + 64 * j);
      u[j] = _mm512_and_si512(v, low4);
      u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
  }
};

// The 5-bit types: the nibbles as Q4, plus each element's fifth bit, stored so that for register
// k the bits of elements 4k..4k+3 sit k bits below bit 4 of bytes 0..3 of the row's word.
template <class Weights>
struct Q5Tiles {
  using W = Weights;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 64;
  static void dwords(const uint8_t* quants, const uint8_t* high, __m512i* u) {
    Q4Tiles<Weights>::dwords(quants, nullptr, u);
    const __m512i h = _mm512_loadu_si512(high), bit4 = _mm512_set1_epi8(0x10);
    // u | (shifted & bit4)
    u[0] = _mm512_ternarylogic_epi32(u[0], _mm512_slli_epi32(h, 4), bit4, 0xF8);
    u[1] = _mm512_ternarylogic_epi32(u[1], _mm512_slli_epi32(h, 3), bit4, 0xF8);
    u[2] = _mm512_ternarylogic_epi32(u[2], _mm512_slli_epi32(h, 2), bit4, 0xF8);
    u[3] = _mm512_ternarylogic_epi32(u[3], _mm512_slli_epi32(h, 1), bit4, 0xF8);
    u[4] = _mm512_ternarylogic_epi32(u[4], h, bit4, 0xF8);
    u[5] = _mm512_ternarylogic_epi32(u[5], _mm512_srli_epi32(h, 1), bit4, 0xF8);
    u[6] = _mm512_ternarylogic_epi32(u[6], _mm512_srli_epi32(h, 2), bit4, 0xF8);
    u[7] = _mm512_ternarylogic_epi32(u[7], _mm512_srli_epi32(h, 3), bit4, 0xF8);
  }
};

// One tile against NT tokens: each block's 8 registers of row lanes come from the tile without a
// transpose (dwords()), and every token count takes the path of rows16_lanes from there: the same
// integer products and float steps as every other path of the type, so bitwise the same results.
template <class T, int NT>
void tile_interleaved(const uint8_t* tile, const NextTile& next, int64_t nb, const uint8_t* act, size_t act_stride,
                      const float* ad, const float* ax, int64_t info_stride, float* out, int64_t ldo,
                      __mmask16 valid) {
  using W = typename T::W;
  const uint8_t* high = tile + size_t(nb) * T::kQuantBytes;
  const auto* scales = reinterpret_cast<const fp16_t*>(high + size_t(nb) * T::kHighBytes);
  const fp16_t* mins = scales + 16 * nb;  // asymmetric types
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next(next, b, 0, 0);
    __m512i u[8];
    T::dwords(tile + size_t(b) * T::kQuantBytes, high + size_t(b) * T::kHighBytes, u);
    const __m512 dw = _mm512_cvtph_ps(loadu256(scales + 16 * b));
    const __m512 mw = W::kAsym ? _mm512_cvtph_ps(loadu256(mins + 16 * b)) : _mm512_setzero_ps();
    lanes_block<W, NT>(u, dw, mw, b, act, act_stride, ad, ax, info_stride, acc);
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// The tile loop of the interleaved kernels: f(tile, next, r0, valid, t0, n) for each tile of 16
// rows (tile_bytes each, from `tiles`) and each group of n <= kGroupTokens tokens from t0; the tile
// loop in f has n_iters iterations (blocks or superblocks), which sets the prefetch slices. Many
// tokens go in blocks over chunks of tiles (for_tile_chunks_and_token_blocks); the groups of
// tokens are the same either way, so the results are too.
static_assert(kTokenBlock % kGroupTokens == 0, "token blocks are whole groups");

template <class F>
void for_each_interleaved_tile(const void* tiles, int64_t n_rows, size_t tile_bytes, int64_t n_iters,
                               int64_t n_tokens, F&& f) {
  const auto* first = static_cast<const uint8_t*>(tiles);
  const uint8_t* next_rows[1] = {first};  // only marks that there is a next tile
  for_tile_chunks_and_token_blocks((n_rows + 15) / 16, tile_bytes, n_tokens, [&](int64_t i0, int64_t i1, int64_t b0,
                                                                                 int64_t b1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = first + size_t(i) * tile_bytes;
      // Tiles are contiguous: in a chunk's first token block, the next one (after the last, the one
      // after this call's rows: usually the same thread's next chunk) is swept into L2 a slice per
      // iteration while this one is used; later blocks find the chunk in L2.
      NextTile next;
      if (b0 == 0) {
        next.rows = next_rows;
        next.base = tile + tile_bytes;
        next.bytes = tile_bytes;
        next = next.sliced(n_iters);
      }
      const int64_t r0 = 16 * i;
      const __mmask16 valid = __mmask16((1u << min64(16, n_rows - r0)) - 1);
      // Groups of kGroupTokens tokens; the first prefetches, the others find the tile in cache and
      // decode it again (measured on Zen 4: as fast as decoding it once into a stored tile for
      // tile_tokens, 4- and 5-bit types, 16-64 tokens).
      for (int64_t t0 = b0; t0 < b1; t0 += kGroupTokens)
        f(tile, t0 == b0 ? next : NextTile{}, r0, valid, t0, min64(kGroupTokens, b1 - t0));
    }
  });
}

template <class T>
void gemm_interleaved(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                      int64_t n, float* out, int64_t ldo) {
  using W = typename T::W;
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nb = n / kQK;
  const size_t info_bytes = (size_t(n_tokens * nb) * 2 * sizeof(float) + 63) & ~size_t(63);
  auto* base = static_cast<uint8_t*>(scratch(info_bytes));
  const ActInfo info{reinterpret_cast<float*>(base), reinterpret_cast<float*>(base) + n_tokens * nb};
  const auto* ab = static_cast<const uint8_t*>(act);
  act_info<W>(ab, act_stride, n_tokens, nb, info);
  for_each_interleaved_tile(
      tiles, n_rows, interleaved_tile_bytes(W::kType, n), nb, n_tokens,
      [&](const uint8_t* tile, const NextTile& next, int64_t r0, __mmask16 valid, int64_t t0, int64_t g) {
        const uint8_t* a = ab + size_t(t0) * act_stride;
        const float *d = info.d + t0 * nb, *x = info.x + t0 * nb;
        float* o = out + t0 * ldo + r0;
        with_token_count(g, [&]<int NT>() {
          tile_interleaved<T, NT>(tile, next, nb, a, act_stride, d, x, nb, o, ldo, valid);
        });
      });
}

// =============================================================================================
// AMX int8 tiles for the 32-element formats in the interleaved layout (the "amx" table)
//
// A tile multiply TDPBSSD C += A * B takes A = 16 rows of 32 signed bytes (here: 16 tokens'
// activation quants of one block) and B = 8 rows of 64 signed bytes in the "4 bytes of each of 16
// columns" order (here: one block of a 16-row weight tile, dword k = elements 4k..4k+3 of rows
// 0..15: dwords() less the bias, so the stored signed quants), and adds to C[t][r] the exact
// integer dot product of token t with row r over the block. That integer is the one the AVX-512
// paths reach (they multiply the biased unsigned bytes and start from -bias * sum of the
// activation quants), and row t of C is token t's 16 rows in row lanes, the register that every
// other path of the type hands to accumulate_block: the float steps that follow are the same
// instructions in the same order, so the results are bitwise the AVX-512 table's (and the
// reference's). Calls of W::kAmxMinTokens (16 or 32) or more tokens take whole groups of 16 through
// the tiles; the last n_tokens % 16 tokens, and smaller calls, go through the AVX-512 kernel.
//
// Measured on the 2-core Xeon (AMX, 2026-12-02): a full-depth tile multiply issues 3250 GMAC/s
// per core, but a block of 32 elements fills only half of one, and each block's 256 products then
// take three vector instructions (convert, scale, accumulate) that do not overlap the tile work.

constexpr int64_t kAmxTokens = 16;  // tokens per tile group: the rows of A and C
// Decoded weight tiles per pass over the token groups: their B operands (nb x 512 bytes a tile)
// stay in L2 while every group of 16 tokens goes past them, and each group's activations in L1.
constexpr size_t kAmxDecodedBytes = size_t(512) << 10;

// The tile configuration (palette 1) for blocks of `depth` elements (32; Q6_K's sub-blocks: 16):
// tiles 0, 1 = C, 16 x 16 int32; 2, 3 = A, 16 tokens x depth bytes; 4, 5 = B, depth / 4 x 64
// bytes (one block of 16 rows). Two of each, so that one block's multiply runs while the other's
// results are read back.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};    // rows of tile i
};
static_assert(sizeof(AmxConfig) == 64);

AmxConfig amx_config(int depth) {
  AmxConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {2, 3}) c.rows[t] = 16, c.colsb[t] = uint16_t(depth);
  for (int t : {4, 5}) c.rows[t] = uint8_t(depth / 4), c.colsb[t] = 64;
  return c;
}

// One block through tile set 0 (tiles 0, 2, 4) or 1 (1, 3, 5): C = the 16 tokens' block quants
// (rows act_stride apart) times the decoded block (16 x depth bytes), stored to c[16][16]. GCC's tile
// intrinsics paste the tile numbers into their asm as literal tokens, so one macro writes both.
#define MICROSPEC_AMX_BLOCK(name, C, A, B)                                                                     \
  [[gnu::always_inline]] inline void name(const int8_t* act_qs, size_t act_stride, const int8_t* decoded, \
                                          int32_t* c) {                                                   \
    _tile_zero(C);                                                                                        \
    _tile_loadd(A, act_qs, long(act_stride));                                                             \
    _tile_loadd(B, decoded, 64);                                                                          \
    _tile_dpbssd(C, A, B);                                                                                \
    _tile_stored(C, c, 64);                                                                               \
  }
MICROSPEC_AMX_BLOCK(amx_block_set0, 0, 2, 4)
MICROSPEC_AMX_BLOCK(amx_block_set1, 1, 3, 5)
#undef MICROSPEC_AMX_BLOCK

// Block b's integer products (c[t * 16 + r], the integer start included) through the shared float
// steps into acc[t].
template <class W>
[[gnu::always_inline]] inline void amx_accumulate(const int32_t* c, const fp16_t* scales, const fp16_t* mins,
                                                   int64_t b, const float* ad, const float* ax, int64_t info_stride,
                                                   __m512* acc) {
  const __m512 dw = _mm512_cvtph_ps(loadu256(scales + 16 * b));
  const __m512 mw = W::kAsym ? _mm512_cvtph_ps(loadu256(mins + 16 * b)) : _mm512_setzero_ps();
  // Unrolled, so that acc[] stays in registers (a loop over it would keep it in memory).
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t)
    acc[t] = accumulate_block<W, true>(acc[t], _mm512_load_si512(c + 16 * t), dw, mw, ad + t * info_stride,
                                       ax + t * info_stride, b);
}

// A weight tile's nb blocks as B operands (512 bytes each): dwords() less the bias.
template <class T>
void amx_decode_tile(const uint8_t* tile, int64_t nb, int8_t* decoded) {
  using W = typename T::W;
  const uint8_t* high = tile + size_t(nb) * T::kQuantBytes;
  const __m512i bias = _mm512_set1_epi8(char(W::kAsym ? 0 : 1 << W::kBiasShift));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i u[8];
    T::dwords(tile + size_t(b) * T::kQuantBytes, high + size_t(b) * T::kHighBytes, u);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(decoded + 512 * b + 64 * k, _mm512_sub_epi8(u[k], bias));
  }
}

// One decoded weight tile against 16 tokens (act: token 0's row): the blocks go through the tiles
// in pairs, and each pair's products are read back while the next pair multiplies (c: two pairs'
// [2][2][16][16] int32).
template <class W>
void amx_tile_tokens(const int8_t* decoded, const fp16_t* scales, const fp16_t* mins, int64_t nb, const uint8_t* act,
                     size_t act_stride, const float* ad, const float* ax, int64_t info_stride, int32_t* c,
                     float* out, int64_t ldo, __mmask16 valid) {
  using Act = typename W::Act;
  const Act* y = reinterpret_cast<const Act*>(act);
  __m512 acc[kAmxTokens];
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb + 2; b += 2) {
    int32_t* now = c + 512 * ((b / 2) & 1);
    int32_t* before = c + 512 * (((b / 2) & 1) ^ 1);
    if (b < nb) amx_block_set0(y[b].qs, act_stride, decoded + 512 * b, now);
    if (b + 1 < nb) amx_block_set1(y[b + 1].qs, act_stride, decoded + 512 * (b + 1), now + 256);
    if (b >= 2) {
      amx_accumulate<W>(before, scales, mins, b - 2, ad, ax, info_stride, acc);
      if (b - 1 < nb) amx_accumulate<W>(before + 256, scales, mins, b - 1, ad, ax, info_stride, acc);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// Weight tiles of 16 rows per pass over the token groups (kAmxDecodedBytes of B operands).
inline int64_t amx_tiles_per_pass(int64_t n_rows, size_t decoded_tile) {
  return min64((n_rows + 15) / 16, int64_t(kAmxDecodedBytes / decoded_tile) + 1);
}

// The loop of the AMX kernels over the rows' tiles, in passes of per_pass tiles
// (amx_tiles_per_pass()): a pass's tiles are decoded once into B operands, decode(i, dst) for
// tile i (decoded_tile bytes each from `decoded`), then every group of 16 tokens from t0 < n_amx
// uses each of them, use(b_ops, i, t0).
template <class Decode, class Use>
void amx_passes(const AmxConfig& config, int64_t n_rows, int64_t per_pass, size_t decoded_tile, int64_t n_amx,
                int8_t* decoded, Decode&& decode, Use&& use) {
  _tile_loadconfig(&config);
  const int64_t n_tiles = (n_rows + 15) / 16;
  for (int64_t p0 = 0; p0 < n_tiles; p0 += per_pass) {
    const int64_t p1 = min64(n_tiles, p0 + per_pass);
    for (int64_t i = p0; i < p1; ++i) decode(i, decoded + size_t(i - p0) * decoded_tile);
    // The tile loads read the decoded bytes through asm that names no memory: keep the stores before them.
    __asm__ volatile("" ::: "memory");
    for (int64_t t0 = 0; t0 < n_amx; t0 += kAmxTokens)
      for (int64_t i = p0; i < p1; ++i) use(decoded + size_t(i - p0) * decoded_tile, i, t0);
  }
  _tile_release();
}

// The valid rows of tile i as a store mask.
inline __mmask16 tile_rows_mask(int64_t n_rows, int64_t i) {
  return __mmask16((1u << min64(16, n_rows - 16 * i)) - 1);
}

template <class T>
void gemm_interleaved_amx(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                          int64_t n, float* out, int64_t ldo) {
  using W = typename T::W;
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t n_amx = n_tokens >= W::kAmxMinTokens ? n_tokens / kAmxTokens * kAmxTokens : 0;
  const auto* ab = static_cast<const uint8_t*>(act);
  if (n_amx > 0) {
    const int64_t nb = n / kQK;
    const size_t tile_bytes = interleaved_tile_bytes(W::kType, n), decoded_tile = size_t(nb) * 512;
    // Scratch: the activation summaries [2][n_amx * nb] floats, a pass's decoded weight tiles, the
    // products of two pairs of blocks [2][2][16][16] int32.
    const size_t info_bytes = (size_t(n_amx * nb) * 2 * sizeof(float) + 63) & ~size_t(63);
    const int64_t per_pass = amx_tiles_per_pass(n_rows, decoded_tile);
    const size_t pass_bytes = size_t(per_pass) * decoded_tile;
    auto* base = static_cast<uint8_t*>(scratch(info_bytes + pass_bytes + 4096));
    const ActInfo info{reinterpret_cast<float*>(base), reinterpret_cast<float*>(base) + n_amx * nb};
    auto* decoded = reinterpret_cast<int8_t*>(base + info_bytes);
    auto* c = reinterpret_cast<int32_t*>(decoded + pass_bytes);
    act_info<W, Starts::kInTheProducts>(ab, act_stride, n_amx, nb, info);
    const auto* first = static_cast<const uint8_t*>(tiles);
    static const AmxConfig config = amx_config(32);
    amx_passes(
        config, n_rows, per_pass, decoded_tile, n_amx, decoded,
        [&](int64_t i, int8_t* dst) { amx_decode_tile<T>(first + size_t(i) * tile_bytes, nb, dst); },
        [&](const int8_t* b_ops, int64_t i, int64_t t0) {
          const uint8_t* tile = first + size_t(i) * tile_bytes;
          const auto* scales = reinterpret_cast<const fp16_t*>(tile + size_t(nb) * (T::kQuantBytes + T::kHighBytes));
          amx_tile_tokens<W>(b_ops, scales, scales + 16 * nb, nb, ab + size_t(t0) * act_stride, act_stride,
                             info.d + t0 * nb, info.x + t0 * nb, nb, c, out + t0 * ldo + 16 * i, ldo,
                             tile_rows_mask(n_rows, i));
        });
  }
  // The tokens that do not fill a group (after the tiles are done with the scratch).
  if (n_amx < n_tokens)
    gemm_interleaved<T>(tiles, n_rows, ab + size_t(n_amx) * act_stride, act_stride, n_tokens - n_amx, n,
                        out + n_amx * ldo, ldo);
}

// =============================================================================================
// K-quants against Q8_K activations

// The eight 6-bit scales (words 0-7) and mins (words 8-15) of a Q4_K/Q5_K block as int16.
inline __m256i k4_scales_mins(const uint8_t* packed) {
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, m_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  return _mm256_cvtepu8_epi16(_mm_set_epi32(int(m_hi), int(m_lo), int(sc_hi), int(sc_lo)));
}

// Q4_K / Q5_K decode: u[c] = chunk c (elements 64c..64c+63) as bytes in element order; sub-block
// 2c is its low nibbles (bytes 0-31), 2c+1 its high nibbles (bytes 32-63).
template <bool kHigh>
inline void decode_q45k(const uint8_t* blk, __m512i* u) {
  using Block = typename std::conditional<kHigh, BlockQ5_K, BlockQ4_K>::type;
  const Block& x = *reinterpret_cast<const Block*>(blk);
  // Shift the high-nibble half (bytes 32-63 = 16-bit lanes 16-31) right by 4.
  const __m512i nib_shift = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 4);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i hbits = _mm512_setzero_si512();
  if constexpr (kHigh) hbits = _mm512_broadcast_i64x4(loadu256(x.qh));
  // Bit 2c of qh[l] belongs to element l of chunk c, bit 2c+1 to element 32 + l.
  const __m512i hmask0 = _mm512_mask_set1_epi8(_mm512_set1_epi8(1), 0xFFFFFFFF00000000ull, 2);
  for (int c = 0; c < 4; ++c) {
    const __m512i q = _mm512_broadcast_i64x4(loadu256(x.qs + 32 * c));
    u[c] = _mm512_and_si512(_mm512_srlv_epi16(q, nib_shift), low4);
    if constexpr (kHigh) {
      const __mmask64 h = _mm512_test_epi8_mask(hbits, _mm512_slli_epi16(hmask0, unsigned(2 * c)));
      u[c] = _mm512_mask_add_epi8(u[c], h, u[c], _mm512_set1_epi8(16));
    }
  }
}

// Q6_K decode: u[k] = elements 64k..64k+63 as unsigned 6-bit values in element order: half k/2,
// low nibbles (k even) or high nibbles (k odd) of that half's ql[0..63], with 2-bit fields of its
// qh[0..31] on top.
inline void decode_q6k(const uint8_t* blk, __m512i* u) {
  const BlockQ6_K& x = *reinterpret_cast<const BlockQ6_K*>(blk);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  // qh bits 0-1 (low half) and 2-3 (high half) up to bits 4-5; bits 4-5 stay, 6-7 come down.
  const __m512i shl = _mm512_mask_set1_epi16(_mm512_set1_epi16(4), 0xFFFF0000u, 2);
  const __m512i shr = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 2);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(x.ql + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(loadu256(x.qh + 32 * h));
    const __m512i lo = _mm512_and_si512(ql, low4), hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4);
    // lo | (shifted & 0x30)
    u[2 * h] = _mm512_ternarylogic_epi32(lo, _mm512_sllv_epi16(qh, shl), bits45, 0xF8);
    u[2 * h + 1] = _mm512_ternarylogic_epi32(hi, _mm512_srlv_epi16(qh, shr), bits45, 0xF8);
  }
}

// What the kernels need of each K-quant type:
//   decode(blk, u[4]); scales16(blk): 16 int16 words (Q4_K/Q5_K: 8 scales then 8 mins; Q6_K: the
//   16 signed scales); chunk_scales(s16, c): int16 lane i of chunk c's vpmaddubsw pairs -> its
//   scale; scale_words(blk): d (low 16 bits) and dmin (high).
template <bool kHigh>
struct Q45KW {
  using Block = typename std::conditional<kHigh, BlockQ5_K, BlockQ4_K>::type;
  static constexpr bool kSixBit = false;
  // Measured on Zen 4 (EPYC, 1 thread): per-row products beat the stored tile up to 8 tokens.
  static constexpr int64_t kRowLanesMinTokens = kGroupTokens + 1;
  static void decode(const uint8_t* blk, __m512i* u) { decode_q45k<kHigh>(blk, u); }
  static __m256i scales16(const uint8_t* blk) {
    return k4_scales_mins(reinterpret_cast<const Block*>(blk)->scales);
  }
  static __m512i scales32(__m256i s16) { return _mm512_cvtepu16_epi32(s16); }
  // Chunk c: pairs 0-15 in sub-block 2c, 16-31 in 2c+1.
  static __m512i chunk_scales(__m512i s16, int c) {
    return _mm512_permutexvar_epi16(word_index(2 * c, 2 * c, 2 * c + 1, 2 * c + 1), s16);
  }
  static uint32_t scale_words(const uint8_t* blk) { return load_u32(blk); }
  // One token (decode) goes through rows16_k_rows (measured on Zen 4, 1 thread, Q4_K 640x1024: 40
  // against 43-48 us for rows16_k_few; with 2 tokens rows16_k_rows measured 49 against 36).
  static constexpr bool kRowSumsForOneToken = true;
  // isum[t] = sum over sub-blocks j of scale_j * <u_j, a_t,j> for one row (exact), with 256-bit
  // instructions: one sub-block of 32 elements per register. s16: scales16(blk).
  template <int NT>
  static void row_isums(const uint8_t* blk, __m256i s16, const BlockQ8_K* const* a, int32_t* isum) {
    const Block& x = *reinterpret_cast<const Block*>(blk);
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256i hbits = _mm256_setzero_si256();
    if constexpr (kHigh) hbits = loadu256(x.qh);
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = loadu256(x.qs + 32 * c);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;  // sub-block: low nibbles of chunk c, then its high nibbles
        __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, low4);
        // Bit j of qh[l] is bit 4 of element l of sub-block j.
        if constexpr (kHigh)
          u = _mm256_add_epi8(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, j), one), 4));
        const __m256i sc = _mm256_permutexvar_epi16(_mm256_set1_epi16(short(j)), s16);
        for (int t = 0; t < NT; ++t)
          acc[t] = _mm256_dpwssd_epi32(acc[t], _mm256_maddubs_epi16(u, loadu256(a[t]->qs + 32 * j)), sc);
      }
    }
    for (int t = 0; t < NT; ++t) isum[t] = hsum_i32x8(acc[t]);
  }
};
using Q4KW = Q45KW<false>;
using Q5KW = Q45KW<true>;

struct Q6KW {
  using Block = BlockQ6_K;
  static constexpr bool kSixBit = true;
  // Zen 4, 1 thread, weights in cache, CPU time (Gemma ffn_down 640x2048): per-row products 80.7 /
  // 93.7 / 113 us at 4 / 5 / 6 tokens against the stored tile's 94 / 103 / 110.
  static constexpr int64_t kRowLanesMinTokens = 6;
  static constexpr bool kRowSumsForOneToken = false;  // no row_isums: 256-bit row sums measured no faster
  static void decode(const uint8_t* blk, __m512i* u) { decode_q6k(blk, u); }
  static __m256i scales16(const uint8_t* blk) {
    return _mm256_cvtepi8_epi16(loadu128(reinterpret_cast<const BlockQ6_K*>(blk)->scales));
  }
  static __m512i scales32(__m256i s16) { return _mm512_cvtepi16_epi32(s16); }
  // Chunk k: pair i uses scale 4k + i/8.
  static __m512i chunk_scales(__m512i s16, int k) {
    return _mm512_permutexvar_epi16(word_index(4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3), s16);
  }
  static uint32_t scale_words(const uint8_t* blk) { return reinterpret_cast<const BlockQ6_K*>(blk)->d; }
};

// Per superblock and tile: the rows' scales transposed to one row per lane, for both paths.
struct alignas(64) SuperScales {
  __m512i sc[16];  // sub-block scales: 8 for Q4_K/Q5_K, 16 (signed) for Q6_K
  __m512i aux[8];  // int16 pairs against bsum pairs 2q, 2q+1: (m_q, m_q) or (-32 sc_2q, -32 sc_2q+1)
  __m512 d, dmin;
};

template <class K>
inline void super_scales(const __m256i* s16, const uint32_t* words, SuperScales* out) {
  __m512i s[16];
  for (int r = 0; r < 16; ++r) s[r] = K::scales32(s16[r]);
  transpose16(s);  // s[j]: value j of every row
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
  if constexpr (K::kSixBit) {
    for (int j = 0; j < 16; ++j) out->sc[j] = s[j];
    for (int q = 0; q < 8; ++q) {
      const __m512i a = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s[2 * q], 5));
      const __m512i b = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s[2 * q + 1], 5));
      out->aux[q] = _mm512_or_si512(_mm512_and_si512(a, lo16), _mm512_slli_epi32(b, 16));
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      out->sc[j] = s[j];
      out->aux[j] = _mm512_or_si512(s[8 + j], _mm512_slli_epi32(s[8 + j], 16));
    }
  }
  const __m512i wv = _mm512_loadu_si512(words);
  out->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(wv));
  out->dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(wv, 16)));
}

// The float steps shared by both paths, per superblock, 16 rows and one token: isum = sum of
// scale * <q, a> over the sub-blocks (exact), then the min (Q4_K/Q5_K) or -32 offset (Q6_K) term
// from the bsums.
template <class K>
inline __m512 accumulate_super(__m512 acc, __m512i isum, const SuperScales& ss, const BlockQ8_K& a) {
  const __m512 ad = _mm512_set1_ps(a.d);
  __m512i m = K::kSixBit ? isum : _mm512_setzero_si512();
  for (int q = 0; q < 8; ++q)
    m = _mm512_dpwssd_epi32(m, _mm512_load_si512(&ss.aux[q]),
                            _mm512_set1_epi32(int32_t(load_u32(a.bsums + 2 * q))));
  if constexpr (K::kSixBit) return _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(ss.d, ad), acc);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ss.d, ad), acc);
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(ss.dmin, ad), acc);
}

// Few tokens, per row: each row's exact integer sum per superblock and token with 256-bit
// instructions (K::row_isums; Zen 4 splits 512-bit instructions in two, and for one token this beats
// 512-bit products summed across the 16 rows), then the 16 rows' sums in lanes for the same float
// steps as every other path (accumulate_super), so the results are bitwise those of the others.
template <class K, int NT>
void rows16_k_rows(const uint8_t* const* rows, const NextTile& next, int64_t nsb, const uint8_t* act,
                   size_t act_stride, float* out, int64_t ldo, __mmask16 valid) {
  using Block = typename K::Block;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const size_t at = size_t(sb) * sizeof(Block);
    prefetch_next(next, sb, at, sizeof(Block));
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    __m256i s16[16];
    alignas(64) uint32_t words[16];
    alignas(64) int32_t isums[NT][16];  // [token][row]
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = rows[r] + at;
      s16[r] = K::scales16(blk);
      words[r] = K::scale_words(blk);
      int32_t isum[NT];
      K::template row_isums<NT>(blk, s16[r], a, isum);
      for (int t = 0; t < NT; ++t) isums[t][r] = isum[t];
    }
    SuperScales ss;
    super_scales<K>(s16, words, &ss);
    for (int t = 0; t < NT; ++t)
      acc[t] = accumulate_super<K>(acc[t], _mm512_load_si512(isums[t]), ss, *a[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// Few tokens: per row, 4 x (vpmaddubsw, vpdpwssd) per superblock and token, then summed across
// the 16 rows. Q6_K adds each row's -32 offset term (-32 * sum of scale_j * bsum_j, one vpdpwssd)
// before the rows are summed, so the sum is accumulate_super's whole integer m and the scales need
// no transpose: only the rows' d go into lanes (the same float steps, so the same bits).
template <class K, int NT>
void rows16_k_few(const uint8_t* const* rows, const NextTile& next, int64_t nsb, const uint8_t* act,
                  size_t act_stride, float* out, int64_t ldo, __mmask16 valid) {
  using Block = typename K::Block;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const size_t at = size_t(sb) * sizeof(Block);
    prefetch_next(next, sb, at, sizeof(Block));
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    __m256i s16[16];
    alignas(64) uint32_t words[16];
    __m512i quads[NT][4];
    for (int g = 0; g < 4; ++g) {
      __m512i pairs[NT][2];
      for (int h = 0; h < 2; ++h) {
        __m512i dots[NT][2];
        for (int e = 0; e < 2; ++e) {
          const int r = 4 * g + 2 * h + e;
          const uint8_t* blk = rows[r] + at;
          __m512i u[4];
          K::decode(blk, u);
          s16[r] = K::scales16(blk);
          words[r] = K::scale_words(blk);
          const __m512i s512 = _mm512_castsi256_si512(s16[r]);
          for (int t = 0; t < NT; ++t) dots[t][e] = _mm512_setzero_si512();
          if constexpr (K::kSixBit) {
            // Word pairs (-32 sc_2k, -32 sc_2k+1) against (bsum_2k, bsum_2k+1) in dword k < 8.
            const __m512i offset = _mm512_zextsi256_si512(_mm256_sub_epi16(_mm256_setzero_si256(),
                                                                           _mm256_slli_epi16(s16[r], 5)));
            for (int t = 0; t < NT; ++t)
              dots[t][e] = _mm512_dpwssd_epi32(dots[t][e], offset, _mm512_zextsi256_si512(loadu256(a[t]->bsums)));
          }
          for (int c = 0; c < 4; ++c) {
            const __m512i sc = K::chunk_scales(s512, c);
            for (int t = 0; t < NT; ++t) {
              const __m512i p = _mm512_maddubs_epi16(u[c], _mm512_loadu_si512(a[t]->qs + 64 * c));
              dots[t][e] = _mm512_dpwssd_epi32(dots[t][e], p, sc);
            }
          }
        }
        for (int t = 0; t < NT; ++t) pairs[t][h] = pair_sums(dots[t][0], dots[t][1]);
      }
      for (int t = 0; t < NT; ++t) quads[t][g] = quad_sums(pairs[t][0], pairs[t][1]);
    }
    if constexpr (K::kSixBit) {
      // accumulate_super's last step for Q6_K, on the finished m.
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_load_si512(words)));
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(full_sums(quads[t])), _mm512_mul_ps(d, _mm512_set1_ps(a[t]->d)),
                                 acc[t]);
    } else {
      SuperScales ss;
      super_scales<K>(s16, words, &ss);
      for (int t = 0; t < NT; ++t) acc[t] = accumulate_super<K>(acc[t], full_sums(quads[t]), ss, *a[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// Many tokens: per superblock, u[k] is dword k (4 quants) of each of the 16 rows. Per token: 64
// vpdpbusd with broadcast activation dwords, one vpmulld + add per sub-block for its scale.
struct alignas(64) TileSuper {
  __m512i u[64];  // u[k]: dword k (elements 4k..4k+3) of rows 0-15
  SuperScales ss;
};

template <class K>
void build_tile_k(const uint8_t* const* rows, const NextTile& next, int64_t nsb, TileSuper* tile) {
  using Block = typename K::Block;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const size_t at = size_t(sb) * sizeof(Block);
    prefetch_next(next, sb, at, sizeof(Block));
    TileSuper& t = tile[sb];
    __m512i u[4][16];
    __m256i s16[16];
    alignas(64) uint32_t words[16];
    for (int r = 0; r < 16; ++r) {
      __m512i q[4];
      K::decode(rows[r] + at, q);
      for (int c = 0; c < 4; ++c) u[c][r] = q[c];
      s16[r] = K::scales16(rows[r] + at);
      words[r] = K::scale_words(rows[r] + at);
    }
    for (int c = 0; c < 4; ++c) {
      transpose16(u[c]);
      for (int k = 0; k < 16; ++k) _mm512_store_si512(&t.u[16 * c + k], u[c][k]);
    }
    super_scales<K>(s16, words, &t.ss);
  }
}

template <class K, int NT>
void tile_k_tokens(const TileSuper* tile, int64_t nsb, const uint8_t* act, size_t act_stride, float* out,
                   int64_t ldo, __mmask16 valid) {
  constexpr int kSubs = K::kSixBit ? 16 : 8;  // sub-blocks per superblock
  constexpr int kDwords = 64 / kSubs;         // dwords per sub-block
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const TileSuper& ts = tile[sb];
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    __m512i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < kSubs; ++j) {
      __m512i ij[NT];
      for (int t = 0; t < NT; ++t) ij[t] = _mm512_setzero_si512();
      for (int k = 0; k < kDwords; ++k) {
        const __m512i w = _mm512_load_si512(&ts.u[j * kDwords + k]);
        for (int t = 0; t < NT; ++t)
          ij[t] =
              _mm512_dpbusd_epi32(ij[t], w, _mm512_set1_epi32(load_i32(a[t]->qs + 4 * (j * kDwords + k))));
      }
      const __m512i sc = _mm512_load_si512(&ts.ss.sc[j]);
      for (int t = 0; t < NT; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(ij[t], sc));
    }
    for (int t = 0; t < NT; ++t) acc[t] = accumulate_super<K>(acc[t], isum[t], ts.ss, *a[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

template <class K>
void gemm_k(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
            size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nsb = n / kQKK;
  // Two paths: per-row products summed across rows (fewer than K::kRowLanesMinTokens tokens), or a
  // stored tile of rows in lanes reused by every group of kGroupTokens tokens.
  const bool row_lanes = n_tokens >= K::kRowLanesMinTokens;
  auto* tile = row_lanes ? static_cast<TileSuper*>(scratch(size_t(nsb) * sizeof(TileSuper))) : nullptr;
  const auto* ab = static_cast<const uint8_t*>(act);
  const RowTiles tiles{static_cast<const uint8_t*>(w), w_stride, row_ids, n_rows};
  for_each_tile(tiles, nsb,
                [&](const uint8_t* const* rows, const NextTile& next, int64_t r0, __mmask16 valid) {
                  if (row_lanes) build_tile_k<K>(rows, next, nsb, tile);
                  for (int64_t t0 = 0; t0 < n_tokens; t0 += kGroupTokens) {
                    const uint8_t* a = ab + size_t(t0) * act_stride;
                    float* o = out + t0 * ldo + r0;
                    const int64_t g = min64(kGroupTokens, n_tokens - t0);
                    if (!row_lanes)
                      with_token_count(g, [&]<int NT>() {
                        if constexpr (NT == 1 && K::kRowSumsForOneToken)
                          rows16_k_rows<K, NT>(rows, next, nsb, a, act_stride, o, ldo, valid);
                        else if constexpr (NT < K::kRowLanesMinTokens)
                          rows16_k_few<K, NT>(rows, next, nsb, a, act_stride, o, ldo, valid);
                      });
                    else
                      with_token_count(g, [&]<int NT>() { tile_k_tokens<K, NT>(tile, nsb, a, act_stride, o, ldo, valid); });
                  }
                });
}

// K-quants in the interleaved layout (repack.h): the 16 rows' scales come in lanes without a
// transpose, and every register of quants holds 4 elements of each of the 16 rows, so per token
// one vpdpbusd with a broadcast activation dword advances 16 rows. Per sub-block the exact integer
// sum is scaled in lanes; then accumulate_super's float steps: bitwise the file layout's results.
//   scales(rec, ss): the record's SuperScales (sc, aux, d, dmin as super_scales() makes them);
//   isums<NT>(rec, ss, a, isum): isum[t] += sum over sub-blocks j of sc_j * <q_j, a_t,j>.
struct Q4KTiles {
  using K = Q4KW;
  using R = Q4KRecord;
  static void scales(const uint8_t* rec, SuperScales* ss) {
    for (int j = 0; j < 8; ++j) {
      ss->sc[j] = _mm512_cvtepu8_epi32(loadu128(rec + R::kScales + 16 * j));
      const __m512i m = _mm512_cvtepu8_epi32(loadu128(rec + R::kMins + 16 * j));
      ss->aux[j] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
    ss->d = _mm512_cvtph_ps(loadu256(rec + R::kD));
    ss->dmin = _mm512_cvtph_ps(loadu256(rec + R::kDmin));
  }
  // Group 8c + l: low nibbles = sub-block 2c, high nibbles = sub-block 2c + 1, elements 4l..4l+3.
  template <int NT>
  static void isums(const uint8_t* rec, const SuperScales& ss, const BlockQ8_K* const* a, __m512i* isum) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c)
      for (int half = 0; half < 2; ++half) {
        __m512i ij[NT];
        for (int t = 0; t < NT; ++t) ij[t] = _mm512_setzero_si512();
        for (int l = 0; l < 8; ++l) {
          const __m512i v = _mm512_loadu_si512(rec + R::kQuants + 64 * (8 * c + l));
          const __m512i u = _mm512_and_si512(half ? _mm512_srli_epi16(v, 4) : v, low4);
          for (int t = 0; t < NT; ++t)
            ij[t] = _mm512_dpbusd_epi32(ij[t], u, _mm512_set1_epi32(load_i32(a[t]->qs + 64 * c + 32 * half + 4 * l)));
        }
        const __m512i sc = _mm512_load_si512(&ss.sc[2 * c + half]);
        for (int t = 0; t < NT; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(ij[t], sc));
      }
  }
};

// f(i) for i = 0..N-1: N inlined calls with i a constant where kUnrolled, else a loop.
template <int N, bool kUnrolled, class F>
[[gnu::always_inline]] inline void repeat(F&& f) {
  if constexpr (kUnrolled)
    [&]<int... I>(std::integer_sequence<int, I...>) { (f(I), ...); }(std::make_integer_sequence<int, N>{});
  else
    for (int i = 0; i < N; ++i) f(i);
}

struct Q6KTiles {
  using K = Q6KW;
  using R = Q6KRecord;
  static void scales(const uint8_t* rec, SuperScales* ss) {
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    for (int j = 0; j < 16; ++j) ss->sc[j] = _mm512_cvtepi8_epi32(loadu128(rec + R::kScales + 16 * j));
    for (int q = 0; q < 8; ++q) {
      const __m512i lo = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(ss->sc[2 * q], 5));
      const __m512i hi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(ss->sc[2 * q + 1], 5));
      ss->aux[q] = _mm512_or_si512(_mm512_and_si512(lo, lo16), _mm512_slli_epi32(hi, 16));
    }
    ss->d = _mm512_cvtph_ps(loadu256(rec + R::kD));
    ss->dmin = _mm512_setzero_ps();
  }
  // Half h, quarter p (elements 128h + 32p..+31), dword l of the quarter: low group 16h + 8 (p & 1)
  // + l, low nibbles for p < 2, high for p >= 2, topped by bits 2p..2p+1 of high group 8h + l.
  static __m512i dword(const uint8_t* rec, int h, int p, int l) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i q = _mm512_loadu_si512(rec + R::kLow + 64 * (16 * h + 8 * (p & 1) + l));
    const __m512i hb = _mm512_loadu_si512(rec + R::kHigh + 64 * (8 * h + l));
    const __m512i nib = _mm512_and_si512(p < 2 ? q : _mm512_srli_epi16(q, 4), low4);
    const __m512i top = p == 0   ? _mm512_slli_epi16(hb, 4)
                        : p == 1 ? _mm512_slli_epi16(hb, 2)
                        : p == 2 ? hb
                                 : _mm512_srli_epi16(hb, 2);
    return _mm512_ternarylogic_epi32(nib, top, bits45, 0xF8);  // nib | (top & bits45)
  }
  // Sub-block 8h + 2p + s = dwords 4s..4s+3 of quarter p of half h. A full group of kGroupTokens
  // tokens runs the quarters and dwords unrolled, so that dword() sees p as a constant and has no
  // branches; fewer tokens keep the loops, which unrolled ran 10-20% slower at 2 and 5 tokens.
  // Against plain nested loops (which GCC left rolled for 8 tokens, one dword per iteration, its
  // branches on p inside): Zen 4, one thread, CPU time, in cache, Gemma's ffn down 640x2048, three
  // alternations, 2 / 3 / 5 / 8 / 16 / 64 tokens: 39-41 / 52-53 / 56-58 / 94-98 / 186-197 / 745-822
  // us before, 35 / 41-42 / 57-58 / 77-78 / 152-154 / 604-649 us with this.
  template <int NT>
  static void isums(const uint8_t* rec, const SuperScales& ss, const BlockQ8_K* const* a, __m512i* isum) {
    constexpr bool kUnrolled = NT == kGroupTokens;
    for (int h = 0; h < 2; ++h)
      repeat<4, kUnrolled>([&](int p) __attribute__((always_inline)) {
        for (int s = 0; s < 2; ++s) {
          __m512i ij[NT];
          for (int t = 0; t < NT; ++t) ij[t] = _mm512_setzero_si512();
          repeat<4, kUnrolled>([&](int i) __attribute__((always_inline)) {
            const int l = 4 * s + i;
            const __m512i u = dword(rec, h, p, l);
            for (int t = 0; t < NT; ++t)
              ij[t] = _mm512_dpbusd_epi32(ij[t], u,
                                          _mm512_set1_epi32(load_i32(a[t]->qs + 128 * h + 32 * p + 4 * l)));
          });
          const __m512i sc = _mm512_load_si512(&ss.sc[8 * h + 2 * p + s]);
          for (int t = 0; t < NT; ++t) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(ij[t], sc));
        }
      });
  }
};

template <class T, int NT>
void tile_k_interleaved(const uint8_t* tile, const NextTile& next, int64_t nsb, const uint8_t* act,
                        size_t act_stride, float* out, int64_t ldo, __mmask16 valid) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* rec = tile + size_t(sb) * T::R::kBytes;
    prefetch_next(next, sb, 0, 0);
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    SuperScales ss;
    T::scales(rec, &ss);
    __m512i isum[NT];
    for (int t = 0; t < NT; ++t) isum[t] = _mm512_setzero_si512();
    T::template isums<NT>(rec, ss, a, isum);
    for (int t = 0; t < NT; ++t) acc[t] = accumulate_super<typename T::K>(acc[t], isum[t], ss, *a[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

// Every group of kGroupTokens tokens reads the records in place (the first prefetching the next
// tile). Decoding each tile once into TileSuper records for tile_k_tokens instead measured no
// faster (Zen 4, 2 threads, Gemma's Q6_K 640x2048: 375-384 against 380-386 us at 64 tokens, 130
// against 106 at 16), so there is one path.
template <class T>
void gemm_interleaved_k(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                        int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nsb = n / kQKK;
  const auto* ab = static_cast<const uint8_t*>(act);
  for_each_interleaved_tile(
      tiles, n_rows, size_t(nsb) * T::R::kBytes, nsb, n_tokens,
      [&](const uint8_t* tile, const NextTile& next, int64_t r0, __mmask16 valid, int64_t t0, int64_t g) {
        with_token_count(g, [&]<int NT>() {
          tile_k_interleaved<T, NT>(tile, next, nsb, ab + size_t(t0) * act_stride, act_stride, out + t0 * ldo + r0,
                                    ldo, valid);
        });
      });
}

// Q4_K and Q6_K on AMX tiles (the "amx" table), as the 32-element formats above: each sub-block
// (Q4_K: 32 elements, Q6_K: 16) is one tile multiply of 16 tokens by 16 rows, C_j[t][r] = <q_j of
// row r, a_t,j> (exact; the unsigned 4- and 6-bit quants are below 128, so the signed product
// TDPBSSD is the unsigned one). Per token the sub-blocks' products are scaled in lanes and summed
// into the superblock's exact integer (the sum every other path of the type reaches, in any
// order), then accumulate_super's float steps: bitwise the AVX-512 table's results.
//   T::kSubs sub-blocks of T::kSubElems elements per superblock; T::decode(rec, dst): a record's
//   sub-blocks as B operands, 16 x kSubElems bytes each, in sub-block order.

// kAmxMinTokens: the tiles from 32 tokens (measured on the Xeon, 2 threads, 2026-12-02 03:15: at
// 16 tokens Q4_K ran 2-10% slower on tiles and Q6_K the same; at 32 both 9-13% faster).
struct AmxQ4K {
  using Tiles = Q4KTiles;
  static constexpr int kSubs = 8, kSubElems = 32;
  static constexpr int64_t kAmxMinTokens = 32;
  // Sub-block 2c = the low nibbles of groups 8c..8c+7 (group 8c + l: elements 4l..4l+3 of the
  // sub-block), 2c + 1 their high nibbles.
  static void decode(const uint8_t* rec, int8_t* dst) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 8; ++l) {
        const __m512i v = _mm512_loadu_si512(rec + Q4KRecord::kQuants + 64 * (8 * c + l));
        _mm512_store_si512(dst + 512 * (2 * c) + 64 * l, _mm512_and_si512(v, low4));
        _mm512_store_si512(dst + 512 * (2 * c + 1) + 64 * l, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      }
  }
};

struct AmxQ6K {
  using Tiles = Q6KTiles;
  static constexpr int kSubs = 16, kSubElems = 16;
  static constexpr int64_t kAmxMinTokens = 32;
  // Sub-block 8h + 2p + s = dwords 4s..4s+3 of quarter p of half h (Q6KTiles::dword), so dword l
  // of quarter (h, p) goes to byte 64 (32h + 8p + l).
  static void decode(const uint8_t* rec, int8_t* dst) {
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 8; ++l) _mm512_store_si512(dst + 64 * (32 * h + 8 * p + l), Q6KTiles::dword(rec, h, p, l));
  }
};

// Superblock sb's sub-blocks through the tiles, alternating the two tile sets; the products go
// to c[j][16][16].
template <class T>
[[gnu::always_inline]] inline void amx_k_products(const BlockQ8_K* a0, size_t act_stride, const int8_t* decoded,
                                                   int32_t* c) {
  constexpr int kB = 16 * T::kSubElems;  // bytes of one sub-block's B operand
  for (int j = 0; j < T::kSubs; j += 2) {
    amx_block_set0(a0->qs + T::kSubElems * j, act_stride, decoded + kB * j, c + 256 * j);
    amx_block_set1(a0->qs + T::kSubElems * (j + 1), act_stride, decoded + kB * (j + 1), c + 256 * (j + 1));
  }
}

// Superblock sb's products (c) through the scales and the shared float steps into acc[t].
template <class T>
[[gnu::always_inline]] inline void amx_k_accumulate(const int32_t* c, const uint8_t* rec, const uint8_t* act,
                                                     size_t act_stride, int64_t sb, __m512* acc) {
  SuperScales ss;
  T::Tiles::scales(rec, &ss);
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t) {
    __m512i isum = _mm512_setzero_si512();
    for (int j = 0; j < T::kSubs; ++j)
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_load_si512(c + 256 * j + 16 * t), ss.sc[j]));
    const BlockQ8_K& a = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride)[sb];
    acc[t] = accumulate_super<typename T::Tiles::K>(acc[t], isum, ss, a);
  }
}

// One decoded tile of 16 rows against 16 tokens (act: token 0's row); superblock sb's products
// are read back while sb + 1's multiply (c: two superblocks' [2][kSubs][16][16] int32).
template <class T>
void amx_k_tile_tokens(const int8_t* decoded, const uint8_t* tile, int64_t nsb, const uint8_t* act,
                       size_t act_stride, int32_t* c, float* out, int64_t ldo, __mmask16 valid) {
  constexpr int64_t kC = 256 * T::kSubs;               // int32 products per superblock
  constexpr int64_t kDecoded = 16 * T::kSubElems * T::kSubs;  // B bytes per superblock (4096)
  const auto* a0 = reinterpret_cast<const BlockQ8_K*>(act);
  __m512 acc[kAmxTokens];
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t) acc[t] = _mm512_setzero_ps();
  amx_k_products<T>(a0, act_stride, decoded, c);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    if (sb + 1 < nsb) amx_k_products<T>(a0 + sb + 1, act_stride, decoded + kDecoded * (sb + 1), c + kC * ((sb + 1) & 1));
    amx_k_accumulate<T>(c + kC * (sb & 1), tile + size_t(sb) * T::Tiles::R::kBytes, act, act_stride, sb, acc);
  }
#pragma GCC unroll 16
  for (int t = 0; t < kAmxTokens; ++t) _mm512_mask_storeu_ps(out + t * ldo, valid, acc[t]);
}

template <class T>
void gemm_interleaved_amx_k(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                            int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t n_amx = n_tokens >= T::kAmxMinTokens ? n_tokens / kAmxTokens * kAmxTokens : 0;
  const auto* ab = static_cast<const uint8_t*>(act);
  if (n_amx > 0) {
    const int64_t nsb = n / kQKK;
    const size_t record = T::Tiles::R::kBytes, tile_bytes = size_t(nsb) * record, decoded_tile = size_t(nsb) * 4096;
    // Scratch: a pass's decoded weight tiles, the products of two superblocks [2][kSubs][16][16] int32.
    const int64_t per_pass = amx_tiles_per_pass(n_rows, decoded_tile);
    const size_t pass_bytes = size_t(per_pass) * decoded_tile;
    auto* decoded = static_cast<int8_t*>(scratch(pass_bytes + 2 * 1024 * T::kSubs));
    auto* c = reinterpret_cast<int32_t*>(decoded + pass_bytes);
    const auto* first = static_cast<const uint8_t*>(tiles);
    static const AmxConfig config = amx_config(T::kSubElems);
    amx_passes(
        config, n_rows, per_pass, decoded_tile, n_amx, decoded,
        [&](int64_t i, int8_t* dst) {
          for (int64_t sb = 0; sb < nsb; ++sb) T::decode(first + size_t(i) * tile_bytes + size_t(sb) * record, dst + 4096 * sb);
        },
        [&](const int8_t* b_ops, int64_t i, int64_t t0) {
          amx_k_tile_tokens<T>(b_ops, first + size_t(i) * tile_bytes, nsb, ab + size_t(t0) * act_stride, act_stride, c,
                               out + t0 * ldo + 16 * i, ldo, tile_rows_mask(n_rows, i));
        });
  }
  // The tokens that do not fill a group (after the tiles are done with the scratch).
  if (n_amx < n_tokens)
    gemm_interleaved_k<typename T::Tiles>(tiles, n_rows, ab + size_t(n_amx) * act_stride, act_stride,
                                          n_tokens - n_amx, n, out + n_amx * ldo, ldo);
}

// --- attention on half floats, in the reference's order (kernels.h) ---------------------------
// One 16-lane accumulator holds the AVX2 version's two 8-lane ones side by side, so the results
// are bitwise the same with half the instructions.

inline __m512 load_f16x16(const fp16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 load_f16x8(const fp16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

void f16_round(const float* x, fp16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  if (i < n)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

void f16_widen(const fp16_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, load_f16x16(x + i));
  if (i < n) _mm256_storeu_ps(y + i, load_f16x8(x + i));
}

// A head's keys (values) are a strided walk through the cache, one or two lines per key, that the
// hardware prefetcher follows too late on Zen 4, as it does the weights' tiles (prefetch_next):
// each key's step asks for the key kAttentionPrefetchKeys ahead into L2. At 800 tokens of context
// a forward of 1-6 rows took 0.93-0.98x the time on SmolLM2 and 0.92-0.99x on Gemma (2 threads, the
// two versions alternated in one process; README, "Attention prefetches its keys and values"). Prefetches never fault: past the cache's end they are
// dropped.
constexpr int32_t kAttentionPrefetchKeys = 16;

[[gnu::always_inline]] inline void prefetch_key_ahead(const fp16_t* row, int64_t stride, int64_t n) {
  const char* ahead = reinterpret_cast<const char*>(row + kAttentionPrefetchKeys * stride);
  for (int64_t b = 0; b < n * int64_t(sizeof(fp16_t)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
}

// Blocks of up to NR query rows (kernels.h): each key (value) row is widened once for all of them;
// every row's arithmetic is f16_dot_reference's (f16_axpy_reference's) exactly.
template <int NR>
void scores_rows(const float* q, int64_t ldq, const fp16_t* k, int64_t k_stride, int32_t n_keys, int64_t n,
                 float* out, int64_t ldo) {
  for (int32_t j = 0; j < n_keys; ++j) {
    const fp16_t* kj = k + j * k_stride;
    prefetch_key_ahead(kj, k_stride, n);
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 kv = load_f16x16(kj + i);
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * ldq + i), kv, acc[r]);
    }
    const bool tail = i < n;
    const __m256 k8 = tail ? load_f16x8(kj + i) : _mm256_setzero_ps();
    for (int r = 0; r < NR; ++r) {
      __m256 lo = _mm512_castps512_ps256(acc[r]);
      const __m256 hi = _mm512_extractf32x8_ps(acc[r], 1);
      if (tail) lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + i), k8, lo);
      const __m256 v = _mm256_add_ps(lo, hi);
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[r * ldo + j] = _mm_cvtss_f32(s);
    }
  }
}

// Keys in blocks of kValueBlock so that a block's value rows stay in L1 while every 16-element
// column of them is summed; a row's partial sums go through `out` between blocks, which leaves
// each element's chain of fused multiply-adds, in key order, as it is.
constexpr int32_t kValueBlock = 32;

template <int NR>
void weighted_sum_rows(const float* w, int64_t ldw, const fp16_t* v, int64_t v_stride, int32_t n_keys, int64_t n,
                       float* out, int64_t ldo) {
  const __m512 zero = _mm512_setzero_ps();
  if (n_keys == 0) {
    for (int r = 0; r < NR; ++r) std::fill(out + r * ldo, out + r * ldo + n, 0.0f);
    return;
  }
  for (int32_t j0 = 0; j0 < n_keys; j0 += kValueBlock) {
    const int32_t j1 = std::min(n_keys, j0 + kValueBlock);
    // Blocks without a zero weight (all but the ones around a mask's edge) take the plain path.
    bool any_zero = false;
    for (int r = 0; r < NR; ++r)
      for (int32_t j = j0; j < j1; ++j) any_zero |= w[r * ldw + j] == 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = j0 == 0 ? zero : _mm512_loadu_ps(out + r * ldo + i);
      for (int32_t j = j0; j < j1; ++j) {
        if (i == 0) prefetch_key_ahead(v + j * v_stride, v_stride, n);  // once per value row
        const __m512 x = load_f16x16(v + j * v_stride + i);
        for (int r = 0; r < NR; ++r) {
          const __m512 wr = _mm512_set1_ps(w[r * ldw + j]);
          // A zero weight leaves the row as it is (skipped, as kernels.h says), any other adds.
          acc[r] = any_zero ? _mm512_mask3_fmadd_ps(wr, x, acc[r], _mm512_cmp_ps_mask(wr, zero, _CMP_NEQ_UQ))
                            : _mm512_fmadd_ps(wr, x, acc[r]);
        }
      }
      for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * ldo + i, acc[r]);
    }
    if (i < n) {
      const __m256 zero8 = _mm256_setzero_ps();
      __m256 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = j0 == 0 ? zero8 : _mm256_loadu_ps(out + r * ldo + i);
      for (int32_t j = j0; j < j1; ++j) {
        const __m256 x = load_f16x8(v + j * v_stride + i);
        for (int r = 0; r < NR; ++r) {
          const __m256 wr = _mm256_set1_ps(w[r * ldw + j]);
          acc[r] = _mm256_mask3_fmadd_ps(wr, x, acc[r], _mm256_cmp_ps_mask(wr, zero8, _CMP_NEQ_UQ));
        }
      }
      for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * ldo + i, acc[r]);
    }
  }
}

constexpr int32_t kAttentionRows = 8;

void f16_scores(const float* q, int64_t ldq, int32_t n_q, const fp16_t* k, int64_t k_stride, int32_t n_keys,
                int64_t n, float* out, int64_t ldo) {
  for_row_groups(n_q, kAttentionRows, [&]<int NR>(int64_t r0) {
    scores_rows<NR>(q + r0 * ldq, ldq, k, k_stride, n_keys, n, out + r0 * ldo, ldo);
  });
}

void f16_weighted_sum(const float* w, int64_t ldw, int32_t n_q, const fp16_t* v, int64_t v_stride,
                      int32_t n_keys, int64_t n, float* out, int64_t ldo) {
  for_row_groups(n_q, kAttentionRows, [&]<int NR>(int64_t r0) {
    weighted_sum_rows<NR>(w + r0 * ldw, ldw, v, v_stride, n_keys, n, out + r0 * ldo, ldo);
  });
}

template <class K>
float vec_dot_k(const void* w, const void* a, int64_t n) {
  float s;
  gemm_k<K>(w, 0, nullptr, 1, a, 0, 1, n, &s, 1);
  return s;
}

}  // namespace

namespace detail {

const KernelTable& avx512_table_unchecked() {
  static const KernelTable table = [] {
    KernelTable t = avx2_kernels();
    t.name = "avx512";
    auto set = [&t](GgmlType type, VecDotFn dot, GemmFn gemm) {
      t.vec_dot[int(type)] = dot;
      t.gemm[int(type)] = gemm;
    };
    set(GgmlType::Q8_0, vec_dot32<Q8_0W>, gemm32<Q8_0W>);
    set(GgmlType::Q4_0, vec_dot32<Q4_0W>, gemm32<Q4_0W>);
    set(GgmlType::Q5_0, vec_dot32<Q5_0W>, gemm32<Q5_0W>);
    set(GgmlType::Q4_1, vec_dot32<Q4_1W>, gemm32<Q4_1W>);
    set(GgmlType::Q5_1, vec_dot32<Q5_1W>, gemm32<Q5_1W>);
    set(GgmlType::Q4_K, vec_dot_k<Q4KW>, gemm_k<Q4KW>);
    set(GgmlType::Q5_K, vec_dot_k<Q5KW>, gemm_k<Q5KW>);
    set(GgmlType::Q6_K, vec_dot_k<Q6KW>, gemm_k<Q6KW>);
    t.gemm_interleaved[int(GgmlType::Q8_0)] = gemm_interleaved<Q8_0Tiles>;
    t.gemm_interleaved[int(GgmlType::Q4_0)] = gemm_interleaved<Q4Tiles<Q4_0W>>;
    t.gemm_interleaved[int(GgmlType::Q4_1)] = gemm_interleaved<Q4Tiles<Q4_1W>>;
    t.gemm_interleaved[int(GgmlType::Q5_0)] = gemm_interleaved<Q5Tiles<Q5_0W>>;
    t.gemm_interleaved[int(GgmlType::Q5_1)] = gemm_interleaved<Q5Tiles<Q5_1W>>;
    t.gemm_interleaved[int(GgmlType::Q4_K)] = gemm_interleaved_k<Q4KTiles>;
    t.gemm_interleaved[int(GgmlType::Q6_K)] = gemm_interleaved_k<Q6KTiles>;
    t.f16 = {f16_round, f16_widen, f16_scores, f16_weighted_sum};
    return t;
  }();
  return table;
}

const KernelTable& amx_table_unchecked() {
  static const KernelTable table = [] {
    KernelTable t = avx512_table_unchecked();
    t.name = "amx";
    t.gemm_interleaved[int(GgmlType::Q8_0)] = gemm_interleaved_amx<Q8_0Tiles>;
    t.gemm_interleaved[int(GgmlType::Q4_0)] = gemm_interleaved_amx<Q4Tiles<Q4_0W>>;
    t.gemm_interleaved[int(GgmlType::Q4_1)] = gemm_interleaved_amx<Q4Tiles<Q4_1W>>;
    t.gemm_interleaved[int(GgmlType::Q5_0)] = gemm_interleaved_amx<Q5Tiles<Q5_0W>>;
    t.gemm_interleaved[int(GgmlType::Q5_1)] = gemm_interleaved_amx<Q5Tiles<Q5_1W>>;
    t.gemm_interleaved[int(GgmlType::Q4_K)] = gemm_interleaved_amx_k<AmxQ4K>;
    t.gemm_interleaved[int(GgmlType::Q6_K)] = gemm_interleaved_amx_k<AmxQ6K>;
    return t;
  }();
  return table;
}

}  // namespace detail

}  // namespace microspec
