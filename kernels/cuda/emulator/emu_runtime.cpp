// The CUDA emulator's runtime: the part of the CUDA runtime API that keel calls, on host memory.
// One emulated device ("keel CUDA emulator", sm_90, 8 GiB). Every call completes before it
// returns (a stream is in order anyway, so results are the same); events read the host clock.
// Device allocations are tracked, so that a copy whose direction does not match its pointers
// (a host pointer given as device memory, or the reverse) fails with cudaErrorInvalidValue as a
// bad pointer would on a GPU, instead of silently working on shared host memory.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/emulator/emu_device.h"

struct CUstream_st {
  int id;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point at;
};
struct CUmemPoolHandle_st {
  int id;
};

namespace {

constexpr size_t kDeviceBytes = size_t{8} << 30;
constexpr int kMultiprocessors = 132;
constexpr size_t kDefaultDynamicShared = 48 << 10;
constexpr int kMaxDynamicShared = 227 << 10;  // sm_90's opt-in maximum

struct Memory {
  std::mutex mutex;
  std::map<const char*, size_t> device;  // start -> bytes
  std::map<const char*, size_t> pinned;
  size_t device_bytes = 0;
  cudaError_t last_error = cudaSuccess;
  CUmemPoolHandle_st pool{0};
  std::map<const void*, int> max_dynamic_shared;  // kernel -> cudaFuncAttributeMaxDynamicSharedMemorySize
  std::string last_failure;                        // fail_launch's latest message
};

Memory& mem() {
  static Memory m;
  return m;
}

cudaError_t record(cudaError_t e) {
  if (e != cudaSuccess) mem().last_error = e;
  return e;
}

// True when [p, p + bytes) lies inside one of the allocations (start -> bytes). Under the mutex.
bool inside(const std::map<const char*, size_t>& allocations, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = allocations.upper_bound(c);
  if (it == allocations.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}

bool is_device(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mem().mutex);
  return inside(mem().device, p, bytes);
}

// An allocation's host block: whole 256-byte units, 256-byte aligned as cudaMalloc's.
size_t block_bytes(size_t bytes) { return (std::max<size_t>(bytes, 1) + 255) / 256 * 256; }

cudaError_t device_alloc(void** p, size_t bytes) {
  Memory& m = mem();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (m.device_bytes + bytes > kDeviceBytes) return cudaErrorMemoryAllocation;
  char* q = static_cast<char*>(std::aligned_alloc(256, block_bytes(bytes)));
  if (!q) return cudaErrorMemoryAllocation;
  // device memory starts as garbage, not zeros: all-ones bytes, NaN in every float type, so a
  // kernel that reads what nothing wrote (and does not mask it out) makes its result NaN
  std::memset(q, 0xFF, block_bytes(bytes));
  m.device[q] = bytes;
  m.device_bytes += bytes;
  *p = q;
  return cudaSuccess;
}

cudaError_t device_free(void* p) {
  if (!p) return cudaSuccess;
  Memory& m = mem();
  std::lock_guard<std::mutex> lock(m.mutex);
  auto it = m.device.find(static_cast<const char*>(p));
  if (it == m.device.end()) return cudaErrorInvalidValue;
  m.device_bytes -= it->second;
  m.device.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  const bool dst_dev = is_device(dst, bytes), src_dev = is_device(src, bytes);
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice: ok = dst_dev && !src_dev; break;
    case cudaMemcpyDeviceToHost: ok = !dst_dev && src_dev; break;
    case cudaMemcpyDeviceToDevice: ok = dst_dev && src_dev; break;
    case cudaMemcpyHostToHost: ok = !dst_dev && !src_dev; break;
    default: break;  // cudaMemcpyDefault: any
  }
  if (!ok) return cudaErrorInvalidValue;
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return record(device == 0 ? cudaSuccess : cudaErrorInvalidDevice); }
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "keel CUDA emulator");
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = kDeviceBytes;
  prop->multiProcessorCount = kMultiprocessors;
  prop->sharedMemPerBlock = kDefaultDynamicShared;
  prop->sharedMemPerBlockOptin = kMaxDynamicShared;
  prop->l2CacheSize = 50 << 20;  // an H100's
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMultiProcessorCount: *value = kMultiprocessors; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = kMaxDynamicShared; break;
    default: *value = 0; break;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  std::lock_guard<std::mutex> lock(mem().mutex);
  *total = kDeviceBytes;
  *free_bytes = kDeviceBytes - mem().device_bytes;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = mem().last_error;
  mem().last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return mem().last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    default: return "cudaError (emulator)";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "emulated CUDA error";
  }
}

cudaError_t cudaMalloc(void** p, size_t bytes) { return record(device_alloc(p, bytes)); }
cudaError_t cudaFree(void* p) { return record(device_free(p)); }
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return record(device_alloc(p, bytes)); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return record(device_free(p)); }
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = std::aligned_alloc(256, block_bytes(bytes));
  if (!*p) return record(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().pinned[static_cast<const char*>(*p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().pinned.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  *pool = &mem().pool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) { return cudaSuccess; }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return record(copy(dst, src, bytes, kind));
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return record(copy(dst, src, bytes, kind));
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (bytes && !is_device(p, bytes)) return record(cudaErrorInvalidValue);
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, nullptr); }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  *attr = cudaPointerAttributes{};
  if (is_device(p, 1)) {
    attr->type = cudaMemoryTypeDevice;
    attr->devicePointer = const_cast<void*>(p);
  } else {
    std::lock_guard<std::mutex> lock(mem().mutex);
    const bool is_pinned = inside(mem().pinned, p, 1);
    attr->type = is_pinned ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
    if (is_pinned) attr->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st{1};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st{std::chrono::steady_clock::now()};
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  e->at = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || value > kMaxDynamicShared) return record(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().max_dynamic_shared[kernel] = value;
  return cudaSuccess;
}

}  // extern "C"

bool keel_emu::launch_dims_allowed(dim3 grid, dim3 block) {
  const unsigned long long threads = static_cast<unsigned long long>(block.x) * block.y * block.z;
  const bool grid_ok = grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 &&
                       grid.z <= 65535;
  const bool block_ok = block.x >= 1 && block.x <= 1024 && block.y >= 1 && block.y <= 1024 && block.z >= 1 &&
                        block.z <= 64 && threads <= 1024;
  if (grid_ok && block_ok) return true;
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().last_error = cudaErrorInvalidConfiguration;
  return false;
}

int keel_emu::max_dynamic_shared_attribute(const void* kernel) {
  std::lock_guard<std::mutex> lock(mem().mutex);
  auto it = mem().max_dynamic_shared.find(kernel);
  return it == mem().max_dynamic_shared.end() ? -1 : it->second;
}

bool keel_emu::dynamic_shared_allowed(const void* kernel, size_t smem_bytes) {
  const int attr = max_dynamic_shared_attribute(kernel);
  if (smem_bytes <= (attr < 0 ? kDefaultDynamicShared : static_cast<size_t>(attr))) return true;
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().last_error = cudaErrorInvalidValue;
  return false;
}

void keel_emu::fail_launch(cudaError_t error, const char* message) {
  std::fprintf(stderr, "keel CUDA emulator: %s\n", message);
  std::lock_guard<std::mutex> lock(mem().mutex);
  mem().last_error = error;
  mem().last_failure = message;
}

const char* keel_emu::last_launch_failure() {
  std::lock_guard<std::mutex> lock(mem().mutex);
  return mem().last_failure.c_str();
}
