#include "cli/version.h"

#include "kernels/kernels.h"
#include "microspec_version.h"  // generated in the build folder: MICROSPEC_VERSION, MICROSPEC_GIT_COMMIT
#ifdef MICROSPEC_HAS_CUDA
#include "cuda/cuda_check.h"
#endif

namespace microspec::cli {

namespace {

std::string cuda_text() {
#ifdef MICROSPEC_HAS_CUDA
  if (!cuda::device_available()) return "on (no usable device here)";
  return "on (" + cuda::device_description() + ")";
#else
  return "off (built without MICROSPEC_CUDA)";
#endif
}

}  // namespace

std::string version_text() {
  return std::string("microspec ") + MICROSPEC_VERSION + "\n" +  //
         "commit: " + MICROSPEC_GIT_COMMIT + "\n" +             //
         "kernels: " + best_kernels().name + " (--kernels auto on this CPU)\n" +  //
         "cuda: " + cuda_text();
}

}  // namespace microspec::cli
