#pragma once
// Private to src/kernels: how the kernel files reach each other's tables.
#include "kernels/kernels.h"

namespace microspec::detail {

// The AVX-512 table. Defined in kernels_avx512.cpp, which is compiled with AVX-512 flags: even
// building the table may execute AVX-512 instructions, so only avx512_kernels() calls it, after
// checking cpu_features().
const KernelTable& avx512_table_unchecked();

}  // namespace microspec::detail
