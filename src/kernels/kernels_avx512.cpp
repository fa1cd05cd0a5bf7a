// AVX-512 kernels (in progress: currently the AVX2 entries).
#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"

namespace microspec::detail {

const KernelTable& avx512_table_unchecked() {
  static const KernelTable table = [] {
    KernelTable t = avx2_kernels();
    t.name = "avx512";
    return t;
  }();
  return table;
}

}  // namespace microspec::detail
