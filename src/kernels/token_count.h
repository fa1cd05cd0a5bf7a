#pragma once
// Private to src/kernels: a call's token count (1..8) turned into a compile-time constant for the
// kernels' templates, and row groups of such counts.
//
// In an unnamed namespace on purpose: each kernel file is compiled with its own target flags
// (kernels_avx512.cpp with AVX-512), so every file must get its own copy. A shared inline
// function would let the linker keep the AVX-512 file's copy for the AVX2 file too.
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

}  // namespace
}  // namespace microspec
