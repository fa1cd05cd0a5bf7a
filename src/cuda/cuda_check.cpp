#include "cuda/cuda_check.h"

#include <algorithm>
#include <atomic>

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

void upload(void* dst, const void* src, size_t bytes) {
  MS_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  MS_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
}

uint64_t next_object_serial() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

DeviceAllocations::~DeviceAllocations() {
  for (void* p : blocks_) cudaFree(p);
}

void* DeviceAllocations::alloc(size_t bytes) {
  void* p = nullptr;
  MS_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  blocks_.push_back(p);
  return p;
}

}  // namespace microspec::cuda
