// The CPU check that runs before any other code of the binary. Everything else is compiled for
// x86-64-v3 (AVX2, FMA, F16C, BMI2) and would die of SIGILL on an older CPU; this file alone is
// compiled without those instruction sets (CMakeLists.txt), and its constructor runs before every
// C++ static initializer (priority 101, the first one free for programs), so such a CPU gets one
// line on stderr and exit status 1 instead.
#include <unistd.h>

#include <cstring>

namespace {

struct Feature {
  const char* name;
  bool present;
};

__attribute__((constructor(101))) void require_x86_64_v3() {
  __builtin_cpu_init();
  // __builtin_cpu_supports counts AVX features only where the OS saves the YMM registers too.
  const Feature features[] = {{"AVX2", bool(__builtin_cpu_supports("avx2"))},
                              {"FMA", bool(__builtin_cpu_supports("fma"))},
                              {"F16C", bool(__builtin_cpu_supports("f16c"))},
                              {"BMI2", bool(__builtin_cpu_supports("bmi2"))}};
  char missing[64] = "";
  for (const Feature& f : features) {
    if (f.present) continue;
    if (missing[0]) std::strcat(missing, ", ");
    std::strcat(missing, f.name);
  }
  if (!missing[0]) return;
  char line[256] = "error: microspec needs an x86-64 CPU with AVX2, FMA, F16C and BMI2 (x86-64-v3: Intel Haswell, "
                   "AMD Excavator or newer); this one lacks ";
  std::strcat(line, missing);
  std::strcat(line, "\n");
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line, std::strlen(line));
  _exit(1);
}

}  // namespace
