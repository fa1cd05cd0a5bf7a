#include "cuda/cuda_check.h"

#include "util/error.h"

namespace microspec::cuda {

void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  throw Error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

bool device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return false;
  }
  return n > 0;
}

std::string device_description() {
  if (!device_available()) throw Error("no CUDA device is available");
  cudaDeviceProp p{};
  MS_CUDA(cudaGetDeviceProperties(&p, 0));
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " +
         std::to_string(p.totalGlobalMem >> 30) + " GiB)";
}

}  // namespace microspec::cuda
