// Device discovery. A machine without a GPU (or without a driver) simply has zero devices.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace keel::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();  // clear it: the next op's launch check would report it as its own
    return "";
  }
  return prop.name;
}

int64_t current_device_memory() {
  int index = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&index) != cudaSuccess || cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(prop.totalGlobalMem);
}

}  // namespace keel::cuda
