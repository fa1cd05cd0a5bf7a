// AVX2 kernels for the quantized weight types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K,
// in the file's layout, and all but Q5_K in the interleaved layout too (repack.h).
//
// A register holds 4 consecutive quants of each of 8 rows ("row lanes": rows 8h..8h+7 of a 16-row
// tile, or 8 rows of the file gathered and transposed). Each token takes its 4 activation quants
// as a 32-bit broadcast, so one vpmaddubsw advances 8 rows; the products stay in int16 for as many
// groups as cannot overflow (below), then vpmaddwd widens them (times 1, or times the K-quants'
// sub-block scales). So each (row, block) gets its exact integer dot product, and then the float
// steps of the AVX-512 table's kernels, in the same order, one row per lane:
//   32-element formats, per block b: acc = fma(float(i) * d_act[b], d_w[b], acc), then for the
//     asymmetric Q4_1/Q5_1 acc = fma(m_w[b], s_act[b], acc);
//   Q4_K, per superblock: acc = fma(float(isum), d_w * d_act, acc), acc = fnmadd(float(m), dmin_w *
//     d_act, acc), m = sum of the mins times the bsums;
//   Q6_K, per superblock: acc = fma(float(isum + offset), d_w * d_act, acc), offset = -32 times the sum
//     of the scales times the bsums.
// Every path (file layout, interleaved layout, any token count, any row grouping) reaches the same
// integers and takes these steps, so a row's result does not depend on the call: batched
// verification reproduces one-token decoding bit for bit, repacked or not.
//
// int16 bounds of vpmaddubsw (unsigned weight byte u <= U times an activation byte |a| <= 127, two
// products per int16): a pair is at most 254 U, so sums of 8 pairs of 4-bit quants (U = 15, 30480),
// of 4 of 5-bit quants (U = 31, 31496) and of 2 of 6-bit quants (U = 63, 32004) stay below 32768.
// Q8_0's signed weights go through the sign trick (|w| times a with w's sign, at most 2 x 128 x 127
// = 32512 per pair), one group at a time.
#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "kernels/repack.h"
#include "kernels/simd_common.h"
#include "kernels/token_count.h"

namespace microspec {

namespace {

constexpr int kLaneRows = 8;  // rows per register of row lanes

// 4 activation quants (or two int16 bsums) in every 32-bit lane.
inline __m256i bcast32(const void* p) {
  return _mm256_set1_epi32(load_i32(p));
}

// int16 lanes summed in pairs into int32 lanes (times 1: exact).
inline __m256i widen16(__m256i p) {
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Keeps v in a register where it stands. Without it GCC reassociates a chain of integer adds over
// the groups (the sum is the same in any order) into all the products first and their sum after,
// and spills the products to the stack. Pinned where it measured faster (Zen 3, one thread, hot
// 2048-row matrices, half-tile passes of 3 or more tokens): Q5_0's int16 sums at 3 to 8 tokens
// (5 tokens 108 -> 98 us, 8 tokens 192 -> 165 us), Q4_1's at 3 to 5 (5 tokens 99 -> 91 us; at 6
// to 8, pinning 8 more registers spills the float accumulators: 118 -> 152 us at 6). Pinning
// Q8_0's int32 sums or the K-quants' made them slower.
[[gnu::always_inline]] inline void pin(__m256i& v) {
  __asm__("" : "+x"(v));
}

// Per-thread scratch (activation summaries); grows to the largest call and stays.
float* info_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// In-register transpose of an 8x8 matrix of dwords: r[i] dword j <-> r[j] dword i.
[[gnu::always_inline]] inline void transpose8(__m256i* r) {
  __m256i t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(s[i], s[i + 4], 0x31);
  }
}

// 8 rows of the file: pointers (a short last group repeats its last row; only valid lanes are
// stored), and the store mask of the valid ones.
struct RowGroup {
  const uint8_t* rows[kLaneRows];
  __m256i valid;
};

inline RowGroup row_group(const uint8_t* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, int64_t r0) {
  RowGroup g;
  alignas(32) int32_t mask[kLaneRows];
  for (int r = 0; r < kLaneRows; ++r) {
    const int64_t row = min64(r0 + r, n_rows - 1);
    g.rows[r] = w + size_t(row_ids ? row_ids[row] : row) * w_stride;
    mask[r] = r0 + r < n_rows ? -1 : 0;
  }
  g.valid = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask));
  return g;
}

inline __m256i first_rows_mask(int64_t count) {
  alignas(32) int32_t mask[kLaneRows];
  for (int r = 0; r < kLaneRows; ++r) mask[r] = r < count ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(mask));
}

// The f16 field at byte `offset` of each of 8 rows' block, as 8 floats.
inline __m256 row_halves(const RowGroup& g, size_t offset) {
  alignas(16) fp16_t h[kLaneRows];
  for (int r = 0; r < kLaneRows; ++r) std::memcpy(&h[r], g.rows[r] + offset, 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// The next group of rows is prefetched into L2 while this one works, one slice per iteration of
// its loop over blocks: 8 row streams in the file's layout, or the two passes over a tile's halves,
// defeat the hardware prefetcher (measured on Zen 3, SmolLM2's LM head, one token: the loads of
// the tile's bytes held most samples). Contiguous rows (matmul, and every tile): a sequential
// sweep of `bytes` from `base`; rows by id (matmul_rows): in each iteration, the part of each
// next row that the same iteration reads.
struct NextRows {
  const uint8_t* base = nullptr;
  size_t bytes = 0;
  const uint8_t* const* rows = nullptr;
  size_t slice = 0;  // bytes per iteration of the sweep

  NextRows sliced(int64_t n_iters) const {
    NextRows p = *this;
    p.slice = ((bytes + size_t(n_iters) - 1) / size_t(n_iters) + 63) & ~size_t(63);
    return p;
  }
};

// Always inlined: GCC treats a function made only of prefetches as free of side effects.
[[gnu::always_inline]] inline void prefetch_next(const NextRows& next, int64_t i, size_t at, size_t len) {
  if (next.base) {
    const size_t b = next.slice * size_t(i), e = b + next.slice < next.bytes ? b + next.slice : next.bytes;
    for (size_t o = b; o < e; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next.base + o), _MM_HINT_T1);
  } else if (next.rows) {
    for (int r = 0; r < kLaneRows; ++r)
      for (size_t o = 0; o < len; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next.rows[r] + at + o), _MM_HINT_T1);
  }
}

// All of a first group's bytes at once, so that their misses overlap.
inline void prefetch_all(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// The file's layout: calls f(group, next, r0) for each group of 8 rows from row r0, next: what to
// prefetch.
template <class F>
void for_each_row_group(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, F&& f) {
  const auto* wb = static_cast<const uint8_t*>(w);
  RowGroup g = row_group(wb, w_stride, row_ids, n_rows, 0);
  if (!row_ids) prefetch_all(wb, size_t(min64(kLaneRows, n_rows)) * w_stride);
  for (int64_t r0 = 0; r0 < n_rows; r0 += kLaneRows) {
    NextRows next;
    RowGroup after;
    if (!row_ids) {
      // After the last group: the rows that follow (usually this thread's next chunk; prefetches
      // past the matrix's end never fault).
      next.base = wb + size_t(r0 + kLaneRows) * w_stride;
      next.bytes = kLaneRows * w_stride;
    } else if (r0 + kLaneRows < n_rows) {
      after = row_group(wb, w_stride, row_ids, n_rows, r0 + kLaneRows);
      next.rows = after.rows;
    }
    f(g, next, r0);
    if (r0 + kLaneRows < n_rows) g = row_ids ? after : row_group(wb, w_stride, row_ids, n_rows, r0 + kLaneRows);
  }
}

// The file's layout in passes: part<NT>(group, next, r0, t0) for each group of 8 rows and each
// group of NT <= kTokens tokens from t0 (the first pass over a row group prefetches the next).
template <int kTokens, class Part>
void for_each_row_pass(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, int64_t n_tokens,
                       Part&& part) {
  for_each_row_group(w, w_stride, row_ids, n_rows, [&](const RowGroup& g, const NextRows& next, int64_t r0) {
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kTokens)
      with_token_count(min64(kTokens, n_tokens - t0), [&]<int NT>() {
        if constexpr (NT <= kTokens) part.template operator()<NT>(g, t0 == 0 ? next : NextRows{}, r0, t0);
      });
  });
}

// vec_dot as the table's gemm on one row and one token.
template <GemmFn kGemm>
float vec_dot(const void* w, const void* a, int64_t n) {
  float s;
  kGemm(w, 0, nullptr, 1, a, 0, 1, n, &s, 1);
  return s;
}

// =============================================================================================
// 32-element formats

// What the kernels need of each type:
//   Block/Act: the weight and activation blocks; kAsym: value = q d + m (else q d, q signed for
//   Q8_0 or q - bias); kBiasShift: log2 of the bias of the unsigned quants; kSum16: groups whose
//   products are summed in int16 (0: Q8_0's sign trick);
//   file(g, b, u): block b of the 8 rows of g in row lanes, u[k] = elements 4k..4k+3 (Q8_0: the
//   signed quants; the others unsigned); kWholeTileTokens: the most tokens that take whole tiles
//   (for_each_tile_pass); kMaxTokens: the most tokens of one pass over a half tile (all three
//   measured, see for_each_tile_pass); kPinTokens: the most tokens whose int16 sums stay pinned
//   in registers (pin);
//   tile(quants, high, half, k): register k of the same from an interleaved tile's block (repack.h),
//   rows 8 half..8 half+7;
//   kQuantBytes / kHighBytes: a tile block's bytes of quants and of fifth bits (16 rows).
struct Q8_0L {
  using Block = BlockQ8_0;
  using Act = BlockQ8_0;
  static constexpr GgmlType kType = GgmlType::Q8_0;
  static constexpr bool kAsym = false;
  static constexpr int kBiasShift = -1;
  static constexpr int kSum16 = 0;
  static constexpr int64_t kWholeTileTokens = 2;
  static constexpr int64_t kMaxTokens = 8;
  static constexpr size_t kQuantBytes = 8 * 64, kHighBytes = 0;
  static void file(const RowGroup& g, int64_t b, __m256i* u) {
    for (int r = 0; r < kLaneRows; ++r) u[r] = loadu256(reinterpret_cast<const Block*>(g.rows[r])[b].qs);
    transpose8(u);
  }
  // Stored as w + 128.
  static __m256i tile(const uint8_t* quants, const uint8_t*, int half, int k) {
    return _mm256_xor_si256(loadu256(quants + 64 * k + 32 * half), _mm256_set1_epi8(char(0x80)));
  }
};

// The 4-bit types: a row's 16 bytes of quants, dword j = low nibbles of elements 4j..4j+3 and high
// nibbles of 16+4j..16+4j+3; 4 registers of [rows 0-3 | rows 4-7] transposed in their 128-bit
// halves give the interleaved layout's groups.
inline void nibble_groups(const __m256i* g, __m256i* u) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    u[j] = _mm256_and_si256(g[j], low4);
    u[4 + j] = _mm256_and_si256(_mm256_srli_epi16(g[j], 4), low4);
  }
}

template <class B>
inline void file_nibble_groups(const RowGroup& g, int64_t b, __m256i* u) {
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_set_m128i(loadu128(reinterpret_cast<const B*>(g.rows[i + 4])[b].qs),
                            loadu128(reinterpret_cast<const B*>(g.rows[i])[b].qs));
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i grp[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  nibble_groups(grp, u);
}

inline __m256i tile_nibble_group(const uint8_t* quants, int half, int k) {
  const __m256i v = loadu256(quants + 64 * (k % 4) + 32 * half);
  return _mm256_and_si256(k < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

// The 5-bit types in the file: each row's 32 quants in element order (nibbles, fifth bits from
// qh on top), transposed.
template <class B>
inline void file_five_bits(const RowGroup& g, int64_t b, __m256i* u) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  for (int r = 0; r < kLaneRows; ++r) {
    const B& x = reinterpret_cast<const B*>(g.rows[r])[b];
    const __m128i q = loadu128(x.qs);
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
    // Bit j of qh -> byte j: 0x10 where set.
    const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32(load_i32(x.qh)), spread);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), bit4);
    u[r] = _mm256_or_si256(nib, high);
  }
  transpose8(u);
}

// In a tile, the fifth bits of elements 4k..4k+3 sit k bits below bit 4 of bytes 0..3 of each
// row's word (repack.h).
inline __m256i tile_five_bit_group(const uint8_t* quants, const uint8_t* high, int half, int k) {
  const __m256i h = loadu256(high + 32 * half);
  const __m256i shifted = k < 4 ? _mm256_slli_epi32(h, 4 - k) : _mm256_srli_epi32(h, k - 4);
  return _mm256_or_si256(tile_nibble_group(quants, half, k), _mm256_and_si256(shifted, _mm256_set1_epi8(0x10)));
}

template <class B, class A, bool kAsymmetric, int kShift, int kSum>
struct NibbleL {
  using Block = B;
  using Act = A;
  static constexpr bool kAsym = kAsymmetric;
  static constexpr int kBiasShift = kShift;
  static constexpr int kSum16 = kSum;
  static constexpr int64_t kWholeTileTokens = 2;
  static constexpr int64_t kMaxTokens = 8;
  static constexpr int kPinTokens = kSum == 4 ? 8 : 5;
};

struct Q4_0L : NibbleL<BlockQ4_0, BlockQ8_0, false, 3, 8> {
  static constexpr GgmlType kType = GgmlType::Q4_0;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 0;
  static void file(const RowGroup& g, int64_t b, __m256i* u) { file_nibble_groups<Block>(g, b, u); }
  static __m256i tile(const uint8_t* q, const uint8_t*, int half, int k) { return tile_nibble_group(q, half, k); }
};
struct Q4_1L : NibbleL<BlockQ4_1, BlockQ8_1, true, -1, 8> {
  static constexpr GgmlType kType = GgmlType::Q4_1;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 0;
  static void file(const RowGroup& g, int64_t b, __m256i* u) { file_nibble_groups<Block>(g, b, u); }
  static __m256i tile(const uint8_t* q, const uint8_t*, int half, int k) { return tile_nibble_group(q, half, k); }
};
struct Q5_0L : NibbleL<BlockQ5_0, BlockQ8_0, false, 4, 4> {
  static constexpr GgmlType kType = GgmlType::Q5_0;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 64;
  static void file(const RowGroup& g, int64_t b, __m256i* u) { file_five_bits<Block>(g, b, u); }
  static __m256i tile(const uint8_t* q, const uint8_t* h, int half, int k) { return tile_five_bit_group(q, h, half, k); }
};
struct Q5_1L : NibbleL<BlockQ5_1, BlockQ8_1, true, -1, 4> {
  static constexpr GgmlType kType = GgmlType::Q5_1;
  static constexpr size_t kQuantBytes = 4 * 64, kHighBytes = 64;
  static void file(const RowGroup& g, int64_t b, __m256i* u) { file_five_bits<Block>(g, b, u); }
  static __m256i tile(const uint8_t* q, const uint8_t* h, int half, int k) { return tile_five_bit_group(q, h, half, k); }
};

// The float steps of block b for one token (d, x: its activation summaries).
template <class W>
[[gnu::always_inline]] inline __m256 accumulate_block(__m256 acc, __m256i i, __m256 dw, __m256 mw, const float* d,
                                                      const float* x, int64_t b) {
  acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d[b])), dw, acc);
  if constexpr (W::kAsym) acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(x[b]), acc);
  return acc;
}

// Block b in row lanes against NT tokens (token t's quants at act + t * act_stride): group(k) gives
// register k (elements 4k..4k+3 of the 8 rows, as W::file / W::tile give it). Per token the exact
// integer (the start, then the products), then the float steps.
template <class W, int NT, class Group>
[[gnu::always_inline]] inline void lanes_block(Group&& group, __m256 dw, __m256 mw, int64_t b, const uint8_t* act,
                                               size_t act_stride, const float* ad, const float* ax, int64_t info_stride,
                                               __m256* acc) {
  const int8_t* q[NT];
  __m256i i[NT];
  for (int t = 0; t < NT; ++t) {
    q[t] = reinterpret_cast<const typename W::Act*>(act + size_t(t) * act_stride)[b].qs;
    i[t] = W::kAsym || W::kBiasShift < 0 ? _mm256_setzero_si256() : _mm256_set1_epi32(load_i32(&ax[t * info_stride + b]));
  }
  if constexpr (W::kSum16 == 0) {
    // Signed quants: |w| times a with w's sign.
    for (int k = 0; k < 8; ++k) {
      const __m256i u = group(k), ua = _mm256_sign_epi8(u, u);
      for (int t = 0; t < NT; ++t)
        i[t] = _mm256_add_epi32(i[t], widen16(_mm256_maddubs_epi16(ua, _mm256_sign_epi8(bcast32(q[t] + 4 * k), u))));
    }
  } else {
    for (int k0 = 0; k0 < 8; k0 += W::kSum16) {
      __m256i p[NT];
      const __m256i u0 = group(k0);
      for (int t = 0; t < NT; ++t) p[t] = _mm256_maddubs_epi16(u0, bcast32(q[t] + 4 * k0));
      for (int k = k0 + 1; k < k0 + W::kSum16; ++k) {
        const __m256i u = group(k);
        for (int t = 0; t < NT; ++t) {
          p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(u, bcast32(q[t] + 4 * k)));
          if constexpr (NT > W::kWholeTileTokens && NT <= W::kPinTokens) pin(p[t]);
        }
      }
      for (int t = 0; t < NT; ++t) i[t] = _mm256_add_epi32(i[t], widen16(p[t]));
    }
  }
  for (int t = 0; t < NT; ++t) acc[t] = accumulate_block<W>(acc[t], i[t], dw, mw, ad + t * info_stride, ax + t * info_stride, b);
}

constexpr int kGroupTokens = 8;  // tokens per pass over a row group
static_assert(kGroupTokens == 8, "with_token_count (token_count.h) covers 1..8 tokens");
static_assert(kTokenBlock % kGroupTokens == 0, "token blocks are whole groups");

// The file's layout: 8 rows against NT tokens.
template <class W, int NT>
void rows8_tokens(const RowGroup& g, const NextRows& next, int64_t nb, const uint8_t* act, size_t act_stride,
                  const float* ad, const float* ax, int64_t info_stride, float* out, int64_t ldo) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const size_t at = size_t(b) * sizeof(typename W::Block);
    prefetch_next(next, b, at, sizeof(typename W::Block));
    __m256i u[8];
    W::file(g, b, u);
    const __m256 dw = row_halves(g, at);
    const __m256 mw = W::kAsym ? row_halves(g, at + 2) : _mm256_setzero_ps();
    lanes_block<W, NT>([&](int k) { return u[k]; }, dw, mw, b, act, act_stride, ad, ax, info_stride, acc);
  }
  for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(out + t * ldo, g.valid, acc[t]);
}

template <class W>
void gemm32(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
            size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nb = n / kQK;
  float* base = info_scratch(size_t(n_tokens * nb) * 2);
  const ActInfo info{base, base + n_tokens * nb};
  const auto* ab = static_cast<const uint8_t*>(act);
  act_info<W>(ab, act_stride, n_tokens, nb, info);
  for_each_row_pass<kGroupTokens>(w, w_stride, row_ids, n_rows, n_tokens,
                                  [&]<int NT>(const RowGroup& g, const NextRows& next, int64_t r0, int64_t t0) {
                                    rows8_tokens<W, NT>(g, next.sliced(nb), nb, ab + size_t(t0) * act_stride, act_stride,
                                                        info.d + t0 * nb, info.x + t0 * nb, nb, out + t0 * ldo + r0, ldo);
                                  });
}

// The interleaved layout: kHalves halves of a 16-row tile (rows 8 h..8 h+7 for half h from
// first_half) against NT tokens, one register of row lanes per half.
template <class W, int NT, int kHalves>
void tile_tokens(const uint8_t* tile, const NextRows& next, int first_half, int64_t nb, const uint8_t* act,
                 size_t act_stride, const float* ad, const float* ax, int64_t info_stride, float* out, int64_t ldo,
                 const __m256i* valid) {
  const uint8_t* high = tile + size_t(nb) * W::kQuantBytes;
  const auto* scales = reinterpret_cast<const fp16_t*>(high + size_t(nb) * W::kHighBytes);
  const fp16_t* mins = scales + 16 * nb;  // asymmetric types
  __m256 acc[kHalves][NT];
  for (int h = 0; h < kHalves; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next(next, b, 0, 0);
    const uint8_t* quants = tile + size_t(b) * W::kQuantBytes;
    const uint8_t* fifth = high + size_t(b) * W::kHighBytes;
    for (int h = 0; h < kHalves; ++h) {
      const int half = first_half + h;
      const __m256 dw = _mm256_cvtph_ps(loadu128(scales + 16 * b + 8 * half));
      const __m256 mw = W::kAsym ? _mm256_cvtph_ps(loadu128(mins + 16 * b + 8 * half)) : _mm256_setzero_ps();
      lanes_block<W, NT>([&](int k) { return W::tile(quants, fifth, half, k); }, dw, mw, b, act, act_stride, ad, ax,
                         info_stride, acc[h]);
    }
  }
  for (int h = 0; h < kHalves; ++h)
    for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(out + t * ldo + 8 * h, valid[h], acc[h][t]);
}

// Calls with up to kWholeTileTokens tokens take both halves of a tile in one pass over its bytes
// (in order, and each block's scales and prefetches once); more tokens take a half at a time, so
// that their accumulators fit in the 16 registers. Measured on Zen 3 (2 threads, medians of 3): the
// 32-element formats gain from whole tiles at 1 and 2 tokens (SmolLM2's LM head, 1 token: 1.61
// against 1.67-1.82 ms); the K-quants lose (Q6_K 640x2048, 1 token: 95-98 against 78 us), so
// kWholeTileTokens is a property of the type.

// The tiles of rows [0, n_rows) (a multiple of 16 from `tiles`, tile_bytes each) in parts of
// kHalves halves: f(tile, next, first_half, r0, valid) for each part that holds a valid row
// (valid: the store masks of its halves). Each part prefetches its share of the next tile (after
// the last: the tile that follows, usually this thread's next chunk).
template <int kHalves, class F>
void for_each_tile_part(const void* tiles, int64_t n_rows, size_t tile_bytes, F&& f) {
  const auto* first = static_cast<const uint8_t*>(tiles);
  prefetch_all(first, tile_bytes);
  const size_t first_half_bytes = (tile_bytes / 2 + 63) & ~size_t(63);
  for (int64_t r0 = 0; r0 < n_rows; r0 += kLaneRows * kHalves) {
    const uint8_t* tile = first + size_t(r0 / kInterleavedRows) * tile_bytes;
    const int first_half = int(r0 / kLaneRows % 2);
    NextRows next;
    next.base = tile + tile_bytes + (kHalves == 1 && first_half ? first_half_bytes : 0);
    next.bytes = kHalves == 2 ? tile_bytes : first_half ? tile_bytes - first_half_bytes : first_half_bytes;
    const __m256i valid[2] = {first_rows_mask(n_rows - r0), first_rows_mask(n_rows - r0 - kLaneRows)};
    f(tile, next, first_half, r0, valid);
  }
}

// f<NT>(t0) on tokens [b0, b1) in the fewest groups of at most kMax, their sizes as even as can be
// (5 tokens with kMax 4: 3 and 2): a group's accumulators must fit in the 16 registers.
template <class F>
void for_balanced_token_groups(int64_t b0, int64_t b1, int64_t kMax, F&& f) {
  for (int64_t t0 = b0; t0 < b1;) {
    const int64_t left = b1 - t0, groups = (left + kMax - 1) / kMax, nt = (left + groups - 1) / groups;
    with_token_count(nt, [&]<int NT>() { f.template operator()<NT>(t0); });
    t0 += nt;
  }
}

// part<NT, kHalves>(tile, next, first_half, r0, valid, t0) on every part of the tiles and group of
// tokens from t0: whole tiles (kHalves 2) for up to kWholeTileTokens tokens, otherwise halves and
// balanced groups of up to kMaxTokens. A group's accumulators (float and int32 per token, and the
// int16 sums of the 4- and 5-bit types) must fit in the 16 registers beside the weights: Q4_K
// loses a tenth past 5 tokens, so its 6 to 8 tokens run as two groups (Zen 3, one thread, a hot
// 2048x1024 matrix: 8 tokens 248 us as one group, 218 us as 4 + 4); the other types measured best
// at 8 (Q6_K at 8 tokens: 571 us as one group, 601 us as 4 + 4).
template <int64_t kWholeTileTokens, int64_t kMaxTokens, class Part>
void for_each_tile_pass(const void* tiles, int64_t n_rows, size_t tile_bytes, int64_t n_tokens, Part&& part) {
  static_assert(kWholeTileTokens <= 2);
  static_assert(kMaxTokens >= 1 && kMaxTokens <= 8, "with_token_count (token_count.h) covers 1..8 tokens");
  if (n_tokens <= kWholeTileTokens) {
    for_each_tile_part<2>(tiles, n_rows, tile_bytes, [&](const uint8_t* tile, const NextRows& next, int, int64_t r0,
                                                          const __m256i* valid) {
      if constexpr (kWholeTileTokens >= 1)
        if (n_tokens == 1) return part.template operator()<1, 2>(tile, next, 0, r0, valid, 0);
      if constexpr (kWholeTileTokens >= 2) part.template operator()<2, 2>(tile, next, 0, r0, valid, 0);
    });
    return;
  }
  // Many tokens in blocks over chunks of tiles (for_tile_chunks_and_token_blocks): a chunk's first
  // block prefetches the next half tile, later blocks find the chunk in L2.
  const auto* first = static_cast<const uint8_t*>(tiles);
  const int64_t n_tiles = (n_rows + kInterleavedRows - 1) / kInterleavedRows;
  for_tile_chunks_and_token_blocks(n_tiles, tile_bytes, n_tokens, [&](int64_t i0, int64_t i1, int64_t b0, int64_t b1) {
    const int64_t c0 = i0 * kInterleavedRows;  // the chunk's first row
    const int64_t chunk_rows = min64(n_rows, i1 * kInterleavedRows) - c0;
    auto block_on_part = [&](const uint8_t* tile, const NextRows& next, int first_half, int64_t r0,
                             const __m256i* valid) {
      for_balanced_token_groups(b0, b1, kMaxTokens, [&]<int NT>(int64_t t0) {
        part.template operator()<NT, 1>(tile, t0 == 0 ? next : NextRows{}, first_half, c0 + r0, valid, t0);
      });
    };
    for_each_tile_part<1>(first + size_t(i0) * tile_bytes, chunk_rows, tile_bytes, block_on_part);
  });
}

template <class W>
void gemm_interleaved32(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                        int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nb = n / kQK;
  float* base = info_scratch(size_t(n_tokens * nb) * 2);
  const ActInfo info{base, base + n_tokens * nb};
  const auto* ab = static_cast<const uint8_t*>(act);
  act_info<W>(ab, act_stride, n_tokens, nb, info);
  for_each_tile_pass<W::kWholeTileTokens, W::kMaxTokens>(tiles, n_rows, interleaved_tile_bytes(W::kType, n), n_tokens,
                     [&]<int NT, int kHalves>(const uint8_t* tile, const NextRows& next, int first_half, int64_t r0,
                                              const __m256i* valid, int64_t t0) {
                       tile_tokens<W, NT, kHalves>(tile, next.sliced(nb), first_half, nb, ab + size_t(t0) * act_stride,
                                                   act_stride, info.d + t0 * nb, info.x + t0 * nb, nb,
                                                   out + t0 * ldo + r0, ldo, valid);
                     });
}

// =============================================================================================
// K-quants against Q8_K

// The 6-bit scales and mins of a Q4_K block, as bytes.
[[gnu::always_inline]] inline void k4_scales(const uint8_t* packed, uint8_t* sc, uint8_t* m) {
  uint32_t u[3];
  std::memcpy(u, packed, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, m_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

// Per superblock and 8 rows: the float parts in lanes, and the integer pairs against the bsum
// pairs (2q, 2q + 1): Q4_K (m_q, m_q), so that their sum is m; Q6_K (-32 sc_2q, -32 sc_2q+1), the
// offset.
struct SuperLanes {
  __m256i aux[8];
  __m256 d, dmin;
};

// Both K-quants' float steps (see the top of the file); m: the mins' sum (Q4_K) or the offset (Q6_K).
template <bool kSixBit>
[[gnu::always_inline]] inline __m256 accumulate_super(__m256 acc, __m256i isum, __m256i m, const SuperLanes& sl,
                                                      float ad) {
  const __m256 vad = _mm256_set1_ps(ad);
  if constexpr (kSixBit) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum, m)), _mm256_mul_ps(sl.d, vad), acc);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sl.d, vad), acc);
  return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(sl.dmin, vad), acc);
}

inline __m256i aux_sum(const SuperLanes& sl, const BlockQ8_K& a) {
  __m256i m = _mm256_setzero_si256();
  for (int q = 0; q < 8; ++q) m = _mm256_add_epi32(m, _mm256_madd_epi16(sl.aux[q], bcast32(a.bsums + 2 * q)));
  return m;
}

// int32 lanes v -> the int16 pairs (v, v) (v fits in int16).
inline __m256i word_pairs(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// The file's layout. Each row's exact integers per superblock and token with 256-bit
// instructions (one sub-block of 32 elements per register); then the 8 rows' integers in lanes.
// Q4_K and Q5_K (kHigh: the fifth bits of qh); only Q4_K has the interleaved layout.
template <bool kHigh>
struct Q45KL {
  using Block = std::conditional_t<kHigh, BlockQ5_K, BlockQ4_K>;
  using R = Q4KRecord;
  static constexpr bool kSixBit = false;
  static constexpr int kRowTokens = 4;  // tokens per row pass: two accumulators each
  static constexpr int64_t kWholeTileTokens = 0;
  static constexpr int64_t kMaxTokens = 5;
  // isum[t] = sum_j sc_j <q_j, a_t,j>, m[t] = sum_j m_j (bsum_2j + bsum_2j+1), for one row.
  template <int NT>
  static void row_ints(const uint8_t* blk, const BlockQ8_K* const* a, int32_t* isum, int32_t* m) {
    const Block& x = *reinterpret_cast<const Block*>(blk);
    uint8_t sc[8], mn[8];
    k4_scales(x.scales, sc, mn);
    uint64_t m8;
    std::memcpy(&m8, mn, 8);
    const __m128i mw = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(m8)));
    const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mw, mw), _mm_unpacklo_epi16(mw, mw));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i hbits = _mm256_setzero_si256();
    if constexpr (kHigh) hbits = loadu256(x.qh);
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = loadu256(x.qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kHigh) {
        // Bit 2c of qh[l] is the fifth bit of low-nibble element l, bit 2c+1 of the high one.
        const __m256i b16 = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), b16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hbits, 3), b16));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
      for (int t = 0; t < NT; ++t) {
        const __m256i p_lo = _mm256_maddubs_epi16(lo, loadu256(a[t]->qs + 64 * c));
        const __m256i p_hi = _mm256_maddubs_epi16(hi, loadu256(a[t]->qs + 64 * c + 32));
        acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi)));
      }
    }
    for (int t = 0; t < NT; ++t) {
      isum[t] = hsum_i32x8(acc[t]);
      m[t] = hsum_i32x8(_mm256_madd_epi16(loadu256(a[t]->bsums), mins));
    }
  }
  static void file_floats(const RowGroup& g, size_t at, SuperLanes* sl) {
    sl->d = row_halves(g, at + offsetof(Block, d));
    sl->dmin = row_halves(g, at + offsetof(Block, dmin));
  }

  // The interleaved layout, half `half` of a record: scales and mins in lanes.
  static void tile_lanes(const uint8_t* rec, int half, __m256i* scw, SuperLanes* sl) {
    for (int j = 0; j < 8; ++j) {
      scw[j] = word_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + R::kScales + 16 * j + 8 * half))));
      sl->aux[j] = word_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + R::kMins + 16 * j + 8 * half))));
    }
    sl->d = _mm256_cvtph_ps(loadu128(rec + R::kD + 16 * half));
    sl->dmin = _mm256_cvtph_ps(loadu128(rec + R::kDmin + 16 * half));
  }
  // isum[t] += sum_j sc_j <q_j, a_t,j> for the 8 rows of the half. Group 8c + l: low nibbles =
  // sub-block 2c, high nibbles = 2c + 1, elements 4l..4l+3 of the sub-block.
  template <int NT>
  static void tile_isums(const uint8_t* rec, int half, const __m256i* scw, const BlockQ8_K* const* a, __m256i* isum) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 8; ++j) {
      const int c = j / 2, nib = j % 2;
      auto group = [&](int l) {
        const __m256i v = loadu256(rec + R::kQuants + 64 * (8 * c + l) + 32 * half);
        return _mm256_and_si256(nib ? _mm256_srli_epi16(v, 4) : v, low4);
      };
      __m256i p[NT];
      const __m256i u0 = group(0);
      for (int t = 0; t < NT; ++t) p[t] = _mm256_maddubs_epi16(u0, bcast32(a[t]->qs + 32 * j));
      for (int l = 1; l < 8; ++l) {
        const __m256i u = group(l);
        for (int t = 0; t < NT; ++t) p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(u, bcast32(a[t]->qs + 32 * j + 4 * l)));
      }
      for (int t = 0; t < NT; ++t) isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p[t], scw[j]));
    }
  }
};

struct Q6KL {
  using Block = BlockQ6_K;
  using R = Q6KRecord;
  static constexpr bool kSixBit = true;
  static constexpr int kRowTokens = 8;
  static constexpr int64_t kWholeTileTokens = 0;
  static constexpr int64_t kMaxTokens = 8;
  // isum[t] = sum_j sc_j <q_j, a_t,j> with the quants unsigned, m[t] = the offset -32 sum_j sc_j bsum_j.
  template <int NT>
  static void row_ints(const uint8_t* blk, const BlockQ8_K* const* a, int32_t* isum, int32_t* m) {
    const Block& x = *reinterpret_cast<const Block*>(blk);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i sc16 = _mm256_cvtepi8_epi16(loadu128(x.scales));
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x.ql + 64 * half;
      const __m256i ql0 = loadu256(ql), ql1 = loadu256(ql + 32), qh = loadu256(x.qh + 32 * half);
      // Elements 0-31, 32-63, 64-95, 96-127 of this half, as unsigned 6-bit values.
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, _mm256_set1_epi8(48)));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(char(0xC0))), 2));
      for (int k = 0; k < 4; ++k) {
        // Elements 32k..32k+31 of the half use scales 8 half + 2k (first 16) and + 2k + 1.
        const int8_t* scp = x.scales + 8 * half + 2 * k;
        const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(scp[1]), _mm_set1_epi16(scp[0]));
        for (int t = 0; t < NT; ++t) {
          const __m256i p = _mm256_maddubs_epi16(q[k], loadu256(a[t]->qs + 128 * half + 32 * k));
          acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, sv));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      isum[t] = hsum_i32x8(acc[t]);
      m[t] = -32 * hsum_i32x8(_mm256_madd_epi16(loadu256(a[t]->bsums), sc16));
    }
  }
  static void file_floats(const RowGroup& g, size_t at, SuperLanes* sl) {
    sl->d = row_halves(g, at + offsetof(Block, d));
    sl->dmin = _mm256_setzero_ps();
  }

  static void tile_lanes(const uint8_t* rec, int half, __m256i* scw, SuperLanes* sl) {
    __m256i s32[16];
    for (int j = 0; j < 16; ++j) {
      s32[j] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + R::kScales + 16 * j + 8 * half)));
      scw[j] = word_pairs(s32[j]);
    }
    for (int q = 0; q < 8; ++q) {
      const __m256i lo = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s32[2 * q], 5));
      const __m256i hi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s32[2 * q + 1], 5));
      sl->aux[q] = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
    }
    sl->d = _mm256_cvtph_ps(loadu128(rec + R::kD + 16 * half));
    sl->dmin = _mm256_setzero_ps();
  }
  // Half hh (elements 128 hh..), quarter p (+32 p..+31), dword l of the quarter: low group 16 hh +
  // 8 (p & 1) + l, low nibbles for p < 2, high for p >= 2, topped by bits 2p..2p+1 of high group
  // 8 hh + l (repack.h). Sub-block 8 hh + 2p + s = dwords 4s..4s+3 of the quarter.
  static __m256i dword(const uint8_t* rec, int half, int hh, int p, int l) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i q = loadu256(rec + R::kLow + 64 * (16 * hh + 8 * (p & 1) + l) + 32 * half);
    const __m256i hb = loadu256(rec + R::kHigh + 64 * (8 * hh + l) + 32 * half);
    const __m256i nib = _mm256_and_si256(p < 2 ? q : _mm256_srli_epi16(q, 4), low4);
    const __m256i top = p == 0   ? _mm256_slli_epi16(hb, 4)
                        : p == 1 ? _mm256_slli_epi16(hb, 2)
                        : p == 2 ? hb
                                 : _mm256_srli_epi16(hb, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(top, bits45));
  }
  template <int NT>
  static void tile_isums(const uint8_t* rec, int half, const __m256i* scw, const BlockQ8_K* const* a, __m256i* isum) {
    for (int hh = 0; hh < 2; ++hh)
      for (int p = 0; p < 4; ++p)
        for (int s = 0; s < 2; ++s) {
          __m256i u[4];
          for (int l = 0; l < 4; ++l) u[l] = dword(rec, half, hh, p, 4 * s + l);
          for (int t = 0; t < NT; ++t) {
            const int8_t* q = a[t]->qs + 128 * hh + 32 * p + 16 * s;
            const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], bcast32(q)), _mm256_maddubs_epi16(u[1], bcast32(q + 4)));
            const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], bcast32(q + 8)), _mm256_maddubs_epi16(u[3], bcast32(q + 12)));
            const __m256i sc = scw[8 * hh + 2 * p + s];
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc)));
          }
        }
  }
};

// The file's layout: 8 rows against NT tokens.
template <class K, int NT>
void rows8_k(const RowGroup& g, const NextRows& next, int64_t nsb, const uint8_t* act, size_t act_stride, float* out,
             int64_t ldo) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const size_t at = size_t(sb) * sizeof(typename K::Block);
    prefetch_next(next, sb, at, sizeof(typename K::Block));
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    alignas(32) int32_t isums[NT][kLaneRows], ms[NT][kLaneRows];  // [token][row]
    for (int r = 0; r < kLaneRows; ++r) {
      int32_t isum[NT], m[NT];
      K::template row_ints<NT>(g.rows[r] + at, a, isum, m);
      for (int t = 0; t < NT; ++t) isums[t][r] = isum[t], ms[t][r] = m[t];
    }
    SuperLanes sl;
    K::file_floats(g, at, &sl);
    for (int t = 0; t < NT; ++t)
      acc[t] = accumulate_super<K::kSixBit>(acc[t], _mm256_load_si256(reinterpret_cast<const __m256i*>(isums[t])),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ms[t])), sl, a[t]->d);
  }
  for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(out + t * ldo, g.valid, acc[t]);
}

template <class K>
void gemm_k(const void* w, size_t w_stride, const int32_t* row_ids, int64_t n_rows, const void* act,
            size_t act_stride, int64_t n_tokens, int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nsb = n / kQKK;
  const auto* ab = static_cast<const uint8_t*>(act);
  for_each_row_pass<K::kRowTokens>(w, w_stride, row_ids, n_rows, n_tokens,
                                   [&]<int NT>(const RowGroup& g, const NextRows& next, int64_t r0, int64_t t0) {
                                     rows8_k<K, NT>(g, next.sliced(nsb), nsb, ab + size_t(t0) * act_stride, act_stride,
                                                    out + t0 * ldo + r0, ldo);
                                   });
}

// The interleaved layout: kHalves halves of a 16-row tile from first_half against NT tokens.
template <class K, int NT, int kHalves>
void tile_k(const uint8_t* tile, const NextRows& next, int first_half, int64_t nsb, const uint8_t* act,
            size_t act_stride, float* out, int64_t ldo, const __m256i* valid) {
  __m256 acc[kHalves][NT];
  for (int h = 0; h < kHalves; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_next(next, sb, 0, 0);
    const uint8_t* rec = tile + size_t(sb) * K::R::kBytes;
    const BlockQ8_K* a[NT];
    for (int t = 0; t < NT; ++t) a[t] = reinterpret_cast<const BlockQ8_K*>(act + size_t(t) * act_stride) + sb;
    for (int h = 0; h < kHalves; ++h) {
      const int half = first_half + h;
      __m256i scw[16];
      SuperLanes sl;
      K::tile_lanes(rec, half, scw, &sl);
      __m256i isum[NT];
      for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
      K::template tile_isums<NT>(rec, half, scw, a, isum);
      for (int t = 0; t < NT; ++t)
        acc[h][t] = accumulate_super<K::kSixBit>(acc[h][t], isum[t], aux_sum(sl, *a[t]), sl, a[t]->d);
    }
  }
  for (int h = 0; h < kHalves; ++h)
    for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(out + t * ldo + 8 * h, valid[h], acc[h][t]);
}

template <class K>
void gemm_interleaved_k(const void* tiles, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tokens,
                        int64_t n, float* out, int64_t ldo) {
  if (n_rows <= 0 || n_tokens <= 0) return;
  const int64_t nsb = n / kQKK;
  const auto* ab = static_cast<const uint8_t*>(act);
  for_each_tile_pass<K::kWholeTileTokens, K::kMaxTokens>(tiles, n_rows, size_t(nsb) * K::R::kBytes, n_tokens,
                     [&]<int NT, int kHalves>(const uint8_t* tile, const NextRows& next, int first_half, int64_t r0,
                                              const __m256i* valid, int64_t t0) {
                       tile_k<K, NT, kHalves>(tile, next.sliced(nsb), first_half, nsb, ab + size_t(t0) * act_stride,
                                              act_stride, out + t0 * ldo + r0, ldo, valid);
                     });
}

template <class W>
void set32(KernelTable& t) {
  t.vec_dot[int(W::kType)] = vec_dot<gemm32<W>>;
  t.gemm[int(W::kType)] = gemm32<W>;
  t.gemm_interleaved[int(W::kType)] = gemm_interleaved32<W>;
}

template <class K>
void set_k(KernelTable& t, GgmlType type) {
  t.vec_dot[int(type)] = vec_dot<gemm_k<K>>;
  t.gemm[int(type)] = gemm_k<K>;
  t.gemm_interleaved[int(type)] = gemm_interleaved_k<K>;
}

}  // namespace

void detail::set_avx2_quantized_kernels(KernelTable& t) {
  set32<Q8_0L>(t);
  set32<Q4_0L>(t);
  set32<Q4_1L>(t);
  set32<Q5_0L>(t);
  set32<Q5_1L>(t);
  set_k<Q45KL<false>>(t, GgmlType::Q4_K);
  t.vec_dot[int(GgmlType::Q5_K)] = vec_dot<gemm_k<Q45KL<true>>>;
  t.gemm[int(GgmlType::Q5_K)] = gemm_k<Q45KL<true>>;
  set_k<Q6KL>(t, GgmlType::Q6_K);
}

}  // namespace microspec
