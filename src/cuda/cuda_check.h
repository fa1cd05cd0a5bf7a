#pragma once
// Error checking for CUDA runtime calls and the device queries the rest of the backend needs.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace microspec::cuda {

// Throws Error("<what> failed at file:line: <CUDA's message>") when e is not cudaSuccess.
void check(cudaError_t e, const char* what, const char* file, int line);

// Whether a CUDA device can be used here (driver present and at least one device).
bool device_available();
// "NVIDIA H200 (sm_90, 132 SMs, 140 GiB)" for device 0; throws when there is none.
std::string device_description();

// Copies `bytes` from host memory to the device and returns once they are there. A cudaMemcpy
// from pageable memory may return as soon as the bytes are staged, with the transfer still on the
// legacy default stream; the backend's streams are non-blocking (they do not wait for that stream),
// so a kernel launched on one of them next could read the destination before the copy lands.
void upload(void* dst, const void* src, size_t bytes);

// A number no other object of this process has had (1, 2, ...): what a cache of captured graphs
// keys an object by, since a freed object's address may be reused.
uint64_t next_object_serial();

// Device allocations owned together and freed together (also when the owner's constructor throws
// halfway: a member of this type is destroyed with what it holds). The owner synchronizes the
// streams that use them before they go.
class DeviceAllocations {
 public:
  DeviceAllocations() = default;
  ~DeviceAllocations();
  DeviceAllocations(const DeviceAllocations&) = delete;
  DeviceAllocations& operator=(const DeviceAllocations&) = delete;
  // cudaMalloc of max(bytes, 16) bytes, kept until destruction.
  void* alloc(size_t bytes);

 private:
  std::vector<void*> blocks_;
};

}  // namespace microspec::cuda

#define MS_CUDA(call) ::microspec::cuda::check((call), #call, __FILE__, __LINE__)
// After a kernel launch: the launch's own error (bad configuration), not the kernel's outcome.
#define MS_CUDA_LAUNCH() ::microspec::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
