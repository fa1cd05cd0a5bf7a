// Run-time CPU feature detection and the choice of kernel table.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>

#include "kernels/kernels.h"
#include "kernels/kernels_internal.h"
#include "util/error.h"

namespace microspec {

namespace {

uint64_t read_xcr0() {
  uint32_t lo, hi;
  // xgetbv with ecx = 0: which register states the OS saves on context switches.
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// Linux gives a process the AMX tile data state (XFEATURE 18) only after it asks for it; without
// the permission the first tile instruction raises SIGILL.
bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE and AVX registers
  const bool zmm_state = (xcr0 & 0xE0) == 0xE0;  // opmask, upper ZMM0-15, ZMM16-31
  if (!ymm_state) return f;
  f.fma = fma;
  f.f16c = f16c;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = b & (1u << 5);
  if (zmm_state) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512vnni = c & (1u << 11);
  }
  const bool amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA
  f.amx_int8 = amx_tile && amx_int8 && tile_state && request_amx_permission();
  return f;
}

bool has_avx512_table() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni && f.avx2 && f.fma && f.f16c;
}

const KernelTable& choose() {
  if (const KernelTable* t = amx_kernels()) return *t;
  if (const KernelTable* t = avx512_kernels()) return *t;
  // The whole binary is built for AVX2/FMA/F16C, so without them nothing runs anyway.
  return avx2_kernels();
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const KernelTable* avx512_kernels() {
  if (!has_avx512_table()) return nullptr;
  return &detail::avx512_table_unchecked();
}

const KernelTable* amx_kernels() {
  if (!has_avx512_table() || !cpu_features().amx_int8) return nullptr;
  return &detail::amx_table_unchecked();
}

const KernelTable& best_kernels() {
  static const KernelTable& table = choose();
  return table;
}

const KernelTable& kernels_by_name(std::string_view name) {
  if (name == "auto") return best_kernels();
  if (name == "reference") return reference_kernels();
  if (name == "avx2") return avx2_kernels();
  if (name == "avx512") {
    if (const KernelTable* t = avx512_kernels()) return *t;
    throw Error("kernels 'avx512': this CPU lacks AVX-512 F/BW/VL/DQ/VNNI");
  }
  if (name == "amx") {
    if (const KernelTable* t = amx_kernels()) return *t;
    throw Error("kernels 'amx': this CPU or OS gives no AMX int8 tiles (or lacks AVX-512 F/BW/VL/DQ/VNNI)");
  }
  throw Error("kernels '" + std::string(name) + "': expected auto, reference, avx2, avx512 or amx");
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(std::min(line.size(), colon + 2));
    }
  return "unknown CPU";
}

}  // namespace microspec
