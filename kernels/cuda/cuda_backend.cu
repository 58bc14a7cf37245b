// CudaBackend: construction, memory, host<->device copies, convert / fill / add / scale, the
// dtype staging helper and the RoPE table cache. The other ops live in their own files.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cublasLt.h>

#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/wgmma_check.h"
#include "kernels/device.h"
#include "kernels/op_time_table.h"

namespace keel {

using cuda::check_cuda;
using cuda::Named;

// ---- elementwise kernels (grid-stride loops; each element independent, so the grid size
// never changes a result) ----

namespace cuda {
namespace {

// dst[i] = round_Tout(float(src[i]))
template <class Tout, class Tin>
__global__ void convert_kernel(Tout* __restrict__ dst, const Tin* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_f32<Tout>(to_f32(src[i]));
}

// dst[i] = value (already rounded to T by the caller)
template <class T>
__global__ void fill_kernel(T* __restrict__ dst, T value, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}

// out[i] = round_T(float(a[i]) + float(b[i]))   (out may alias a or b), in packs of V
template <class T, int V>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  map_packs<V>(n, out, [](float x, float y) { return x + y; }, a, b);
}

// x[i] = round_T(float(x[i]) * s), in packs of V
template <class T, int V>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  map_packs<V>(n, x, [s](float v) { return v * s; }, x);
}

constexpr int kThreads = 256;

}  // namespace

void launch_convert(CudaBackend& be, void* dst, DType d, const void* src, DType s, int64_t n, const char* op) {
  if (n <= 0) return;
  cudaStream_t stream = be.stream();
  if (d == s) {
    check_cuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(d), cudaMemcpyDeviceToDevice, stream), op,
               "cudaMemcpyAsync (device to device)");
    return;
  }
  const unsigned blocks = grid_for(n, kThreads, 4);
  KEEL_DISPATCH_FLOAT(d, op, Tout, {
    KEEL_DISPATCH_FLOAT(s, op, Tin, {
      convert_kernel<Tout, Tin><<<blocks, kThreads, 0, stream>>>(static_cast<Tout*>(dst), static_cast<const Tin*>(src), n);
    });
  });
}

SameDType::SameDType(CudaBackend& be, const char* op, std::initializer_list<Io> ops) : be_(be), op_(op), ops_(ops) {
  bool first = true;
  for (const Io& io : ops_) {
    if (io.t->empty()) continue;
    if (first) dtype_ = io.t->dtype, first = false;
    else if (io.t->dtype != dtype_) staged_ = true;
  }
  views_.reserve(ops_.size());
  if (!staged_) {
    for (const Io& io : ops_) views_.push_back(*io.t);
    return;
  }
  dtype_ = DType::F32;
  for (const Io& io : ops_) {
    Tensor v = *io.t;
    void* mem = nullptr;
    if (!io.t->empty() && io.t->dtype != DType::F32) {
      mem = be_.scratch(static_cast<size_t>(io.t->numel()) * 4, op_);
      v.data = mem;
      v.dtype = DType::F32;
      if (io.read) launch_convert(be_, mem, DType::F32, io.t->data, io.t->dtype, io.t->numel(), op_);
    }
    scratch_.push_back(mem);
    views_.push_back(v);
  }
}

void SameDType::finish() {
  if (!staged_) return;
  for (size_t i = 0; i < ops_.size(); ++i)
    if (scratch_[i] && ops_[i].write)
      launch_convert(be_, ops_[i].t->data, ops_[i].t->dtype, scratch_[i], DType::F32, ops_[i].t->numel(), op_);
}

SameDType::~SameDType() {
  for (void* p : scratch_)
    if (p) be_.release(p);
}

}  // namespace cuda

// ---- KEEL_CUDA_PROFILE: device time per op ----
//
// One event is recorded after each op's last launch. On one stream the ops run in order, so
// an op's device time is the time between the previous op's event and its own. Events are read
// when the stream has drained (wait_for_stream). After such a drain the GPU idles while the host
// works; the first op's interval then holds that idle time, estimated as the host time from the
// end of the drain to the op's mark, which is booked as "(idle after a host sync)" instead.
struct CudaBackend::Profiler {
  struct Mark {
    std::string op, shapes;
    cudaEvent_t event;
    double idle_ms;  // host time since the last drain (first mark after one), else 0
  };
  std::string path;                // empty: stderr
  std::vector<cudaEvent_t> spare;  // recycled events
  std::vector<Mark> marks;         // recorded, not yet read
  cudaEvent_t base = nullptr;      // the interval start of the first pending mark
  bool after_drain = true;
  bool restarted = false;  // the table starts after the trainer's first step
  std::chrono::steady_clock::time_point drained_at = std::chrono::steady_clock::now();
  OpTimeTable table;

  cudaEvent_t take_event() {
    if (!spare.empty()) {
      cudaEvent_t e = spare.back();
      spare.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreate(&e), "profile", "cudaEventCreate");
    return e;
  }
  ~Profiler() {
    for (const Mark& m : marks) cudaEventDestroy(m.event);
    for (cudaEvent_t e : spare) cudaEventDestroy(e);
    if (base) cudaEventDestroy(base);
  }
};

void CudaBackend::profile_mark(const char* op, const std::string& shapes) {
  Profiler& p = *profiler_;
  cudaEvent_t e = p.take_event();
  check_cuda(cudaEventRecord(e, stream_), op, "cudaEventRecord (KEEL_CUDA_PROFILE)");
  double idle_ms = 0;
  if (p.after_drain) {
    idle_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p.drained_at).count();
    p.after_drain = false;
  }
  p.marks.push_back({op, shapes, e, idle_ms});
}

void CudaBackend::profile_harvest() {
  Profiler& p = *profiler_;
  cudaEvent_t prev = p.base;
  for (const Profiler::Mark& m : p.marks) {
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, prev, m.event), "profile", "cudaEventElapsedTime");
    const double idle = std::min<double>(m.idle_ms, ms);
    if (idle > 0) p.table.add("(idle after a host sync)", "", idle);
    p.table.add(m.op, m.shapes, ms - idle);
    if (prev != p.base) p.spare.push_back(prev);
    prev = m.event;
  }
  if (prev != p.base) p.spare.push_back(prev);
  p.marks.clear();
  // The stream is empty: the next interval starts now.
  check_cuda(cudaEventRecord(p.base, stream_), "profile", "cudaEventRecord (KEEL_CUDA_PROFILE)");
  p.after_drain = true;
  p.drained_at = std::chrono::steady_clock::now();
}

void CudaBackend::set_attention_wgmma(bool on) { attn_wgmma_ = on && cuda::wgmma_available(device_); }

void CudaBackend::profile_restart() {
  if (!profiler_) return;
  wait_for_stream("profile_restart");  // books the pending marks, then they are dropped
  profiler_->table = OpTimeTable();
  profiler_->restarted = true;
}

// ---- construction ----

int64_t CudaBackend::cudnn_attention_calls() const { return cuda::cudnn_attention_calls(cudnn_); }

// KEEL_ATTN_WGMMA: unset, empty or 0 off, 1 on; anything else is refused naming the variable.
static bool attention_wgmma_from_env() {
  const char* v = std::getenv("KEEL_ATTN_WGMMA");
  if (!v || !*v || std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw std::invalid_argument(std::string("KEEL_ATTN_WGMMA must be 0 or 1 (the fused attention kernels on Hopper's "
                                          "warpgroup instructions), got '") +
                              v + "'");
}

CudaBackend::CudaBackend(int device) : device_(device) {
  const char* op = "CudaBackend";
  // the environment first, before anything is taken: a bad value throws
  const AttentionSettings settings = attention_settings_from_env();  // the ones keel plan counts
  attn_ds_budget_ = settings.ds_budget;
  const AttentionKernels attn = settings.kernels;
  const bool wgmma = attention_wgmma_from_env();
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("CudaBackend: no usable CUDA device (") + cudaGetErrorString(e) + ")");
  }
  if (device < 0 || device >= count)
    throw std::runtime_error("CudaBackend: device " + std::to_string(device) + " requested, " + std::to_string(count) +
                             " visible (check CUDA_VISIBLE_DEVICES and the local rank)");
  check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), op, "cudaGetDeviceProperties");
  if (prop.major < 8)
    throw std::runtime_error("CudaBackend: device " + std::to_string(device) + " (" + prop.name + ", sm_" +
                             std::to_string(prop.major * 10 + prop.minor) +
                             ") is older than sm_80: keel's kernels need Ampere (A100) or newer");
  smem_optin_ = prop.sharedMemPerBlockOptin;
  l2_bytes_ = static_cast<size_t>(prop.l2CacheSize);
  sm_count_ = std::max(1, prop.multiProcessorCount);
  cudaStream_t s = nullptr;
  // A blocking stream: work on the legacy default stream (a LocalComm made without this stream)
  // waits for it and it for them.
  check_cuda(cudaStreamCreate(&s), op, "cudaStreamCreate");
  stream_ = s;
  int pools = 0;
  check_cuda(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device), op, "cudaDeviceGetAttribute");
  use_pool_ = pools != 0;
  if (use_pool_) {
    cudaMemPool_t pool;
    check_cuda(cudaDeviceGetDefaultMemPool(&pool, device), op, "cudaDeviceGetDefaultMemPool");
    uint64_t keep = UINT64_MAX;  // keep freed memory in the pool (no trips to the driver per step)
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), op, "cudaMemPoolSetAttribute");
  }
  check_cuda(cudaMallocHost(&host_scalar_, 64), op, "cudaMallocHost");
  const char* sync = std::getenv("KEEL_CUDA_SYNC");
  sync_each_op_ = sync && *sync && std::strcmp(sync, "0") != 0;
  simple_attention_ = attn == AttentionKernels::Simple;
  auto not_off = [](const char* var) {
    const char* v = std::getenv(var);
    return !(v && std::strcmp(v, "0") == 0);
  };
  gelu_epilogue_ = not_off("KEEL_GELU_EPILOGUE");
  residual_epilogue_ = not_off("KEEL_RESIDUAL_EPILOGUE");
  bgrad_epilogue_ = not_off("KEEL_BGRAD_EPILOGUE");
  xent_fused_ = not_off("KEEL_XENT_FUSED");
  splitk_any_ = not_off("KEEL_SPLITK_ANY");
  set_attention_wgmma(wgmma);
  matmul_ = cuda::create_matmul_cache(*this);
  if (attn == AttentionKernels::Cudnn) {
    std::string why_not;
    cudnn_ = cuda::create_cudnn_attention(*this, static_cast<int64_t>(settings.cudnn_workspace_cap), &why_not);
    if (!cudnn_) std::fprintf(stderr, "keel: KEEL_ATTENTION=cudnn: no cuDNN (%s): keel's fused kernels run attention\n",
                              why_not.c_str());
  }
  if (const char* prof = std::getenv("KEEL_CUDA_PROFILE"); prof && *prof && std::strcmp(prof, "0") != 0) {
    profiler_ = std::make_unique<Profiler>();
    if (std::strcmp(prof, "1") != 0) profiler_->path = prof;
    check_cuda(cudaEventCreate(&profiler_->base), op, "cudaEventCreate (KEEL_CUDA_PROFILE)");
    check_cuda(cudaStreamSynchronize(stream_), op, "cudaStreamSynchronize");
    check_cuda(cudaEventRecord(profiler_->base, stream_), op, "cudaEventRecord (KEEL_CUDA_PROFILE)");
  }
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(stream_);
  for (auto& [key, p] : rope_tables_) release(p);
  rope_tables_.clear();
  cuda::destroy_matmul_cache(matmul_);
  cuda::destroy_cudnn_attention(cudnn_);
  cudaStreamSynchronize(stream_);
  if (profiler_) {
    try {
      profile_harvest();
      const std::string report = "keel cuda profile (device " + std::to_string(device_) + ")" +
                                 (profiler_->restarted ? ", steps after the first" : "") + "\n" +
                                 profiler_->table.report();
      FILE* f = profiler_->path.empty() ? stderr : std::fopen(profiler_->path.c_str(), "w");
      if (f) {
        std::fputs(report.c_str(), f);
        if (f != stderr) std::fclose(f);
      } else {
        std::fprintf(stderr, "keel cuda: cannot write the profile to %s\n%s", profiler_->path.c_str(), report.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "keel cuda: no profile: %s\n", e.what());
    }
    profiler_.reset();
  }
  if (const char* stats = std::getenv("KEEL_CUDA_MEMSTATS"); stats && *stats && std::strcmp(stats, "0") != 0)
    std::fprintf(stderr, "keel cuda: peak device memory held by keel %.3f GiB (device %d)\n",
                 static_cast<double>(peak_bytes_) / (1024.0 * 1024.0 * 1024.0), device_);
  if (host_scalar_) cudaFreeHost(host_scalar_);
  if (stream_) cudaStreamDestroy(stream_);
}

std::string CudaBackend::name() const {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_) != cudaSuccess) {
    cudaGetLastError();  // not sticky: keep it from being reported by the next op's launch check
    return "cuda (device " + std::to_string(device_) + ")";
  }
  char buf[512];
  std::snprintf(buf, sizeof buf, "cuda (device %d: %s, sm_%d%d, %d SMs, %.1f GiB)", device_, prop.name, prop.major,
                prop.minor, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

std::string CudaBackend::arithmetic() const {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_) != cudaSuccess) {
    cudaGetLastError();
    return "cuda (unknown device)";
  }
  // cuBLASLt's version decides which algorithm (and so which summation order) each matmul gets.
  // Settings that give other bits follow in brackets; the defaults add nothing, so checkpoints
  // from before they were recorded still resume bit for bit.
  std::string knobs;
  auto add = [&](const std::string& what) { knobs += (knobs.empty() ? "" : ", ") + what; };
  if (cudnn_) add("attention " + cuda::cudnn_attention_describe(cudnn_));
  else if (simple_attention_) add("attention simple");
  if (attn_wgmma_) add("attention wgmma");
  if (attn_ds_budget_ != kDefaultAttentionDsBudget) add("attention dS " + std::to_string(attn_ds_budget_ >> 20) + " MiB");
  if (!gelu_epilogue_) add("no gelu epilogue");
  if (!residual_epilogue_) add("no residual epilogue");
  if (!bgrad_epilogue_) add("no bgrad epilogue");
  if (!xent_fused_) add("xent unfused");
  if (!splitk_any_) add("split-k restricted");
  return std::string("cuda ") + prop.name + " sm_" + std::to_string(prop.major * 10 + prop.minor) + " cublasLt " +
         std::to_string(cublasLtGetVersion()) + (knobs.empty() ? "" : " [" + knobs + "]");
}

size_t CudaBackend::peak_bytes() const { return peak_bytes_; }
size_t CudaBackend::used_bytes() const { return live_bytes_; }

// ---- memory ----

void* CudaBackend::raw_alloc(size_t bytes, const char* op, bool null_if_out_of_memory) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = nullptr;
  cudaError_t e = use_pool_ ? cudaMallocAsync(&p, rounded, stream_) : cudaMalloc(&p, rounded);
  if (e != cudaSuccess) {
    cudaGetLastError();  // out of memory is not sticky: clear it
    if (null_if_out_of_memory && e == cudaErrorMemoryAllocation) return nullptr;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "CudaBackend::%s: cannot allocate %.1f MiB on device %d (%s): keel holds %.1f MiB, the device "
                  "has %.1f MiB free of %.1f MiB",
                  op, rounded / 1048576.0, device_, cudaGetErrorString(e), live_bytes_ / 1048576.0, free_b / 1048576.0,
                  total_b / 1048576.0);
    throw std::runtime_error(buf);
  }
  if (reinterpret_cast<uintptr_t>(p) % 256 != 0) {
    // Never seen; kernels and cuBLASLt rely on it.
    throw std::runtime_error("CudaBackend::" + std::string(op) + ": the allocator returned memory not 256-byte aligned");
  }
  sizes_[p] = rounded;
  live_bytes_ += rounded;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  return p;
}

void* CudaBackend::allocate(size_t bytes) {
  void* p = raw_alloc(bytes, "allocate");
  check_cuda(cudaMemsetAsync(p, 0, (std::max<size_t>(bytes, 1) + 255) / 256 * 256, stream_), "allocate",
             "cudaMemsetAsync");
  return p;
}

void* CudaBackend::scratch(size_t bytes, const char* op) { return raw_alloc(bytes, op); }
void* CudaBackend::scratch_if_free(size_t bytes, const char* op) { return raw_alloc(bytes, op, true); }

void CudaBackend::release(void* p) {
  if (!p) return;
  auto it = sizes_.find(p);
  if (it != sizes_.end()) {
    live_bytes_ -= it->second;
    sizes_.erase(it);
  }
  // Stream-ordered: the memory is reused only by work enqueued after this point. Not thrown
  // (release runs in destructors); reported instead.
  cudaError_t e = use_pool_ ? cudaFreeAsync(p, stream_) : cudaFree(p);
  if (e == cudaErrorCudartUnloading) return;  // process exit: the runtime frees everything
  if (e != cudaSuccess)
    std::fprintf(stderr, "keel: CudaBackend::release: %s (%s)\n", cudaGetErrorName(e), cudaGetErrorString(e));
}

void CudaBackend::copy_to_host(void* dst, const Tensor& src) {
  const char* op = "copy_to_host";
  cuda::check_present(op, {"src", src});
  if (src.bytes() == 0) return;
  check_cuda(cudaMemcpyAsync(dst, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_), op, "cudaMemcpyAsync",
             src.shape_str());
  if (profiler_) profile_mark(op, src.shape_str());
  wait_for_stream(op, src.shape_str());
}

void CudaBackend::copy_from_host(const Tensor& dst, const void* src) {
  const char* op = "copy_from_host";
  cuda::check_present(op, {"dst", dst});
  if (dst.bytes() == 0) return;
  check_cuda(cudaMemcpyAsync(dst.data, src, dst.bytes(), cudaMemcpyHostToDevice, stream_), op, "cudaMemcpyAsync",
             dst.shape_str());
  if (profiler_) profile_mark(op, dst.shape_str());
  // From pageable memory the call returns once `src` is staged, so the caller may reuse it. From
  // page-locked memory the copy is truly asynchronous: wait, so that the same holds.
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, src) == cudaSuccess && attr.type != cudaMemoryTypeUnregistered)
    wait_for_stream(op, dst.shape_str());
  cudaGetLastError();  // cudaPointerGetAttributes may leave an error for unknown pointers on old drivers
}

void CudaBackend::read_back(void* dst, const void* src, size_t bytes, const char* op) {
  if (bytes > 64) throw std::logic_error("CudaBackend::read_back: at most 64 bytes");
  check_cuda(cudaMemcpyAsync(host_scalar_, src, bytes, cudaMemcpyDeviceToHost, stream_), op, "cudaMemcpyAsync");
  wait_for_stream(op);
  std::memcpy(dst, host_scalar_, bytes);
}

void CudaBackend::synchronize() { wait_for_stream("synchronize"); }

void CudaBackend::wait_for_stream(const char* op, const std::string& shapes) {
  const DeviceWaitHook hook = device_wait_hook();
  if (!hook) {
    check_cuda(cudaStreamSynchronize(stream_), op, "cudaStreamSynchronize", shapes);
    if (profiler_) profile_harvest();
    return;
  }
  // Poll: spin briefly (most waits at a step's end are short), then sleep between queries;
  // the hook runs about every millisecond.
  auto last_hook = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) {
      if (profiler_) profile_harvest();
      return;
    }
    if (e != cudaErrorNotReady) check_cuda(e, op, "cudaStreamQuery", shapes);
    const auto now = std::chrono::steady_clock::now();
    if (now - last_hook >= std::chrono::milliseconds(1)) {
      hook();
      last_hook = now;
    }
    if (i >= 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// ---- elementwise ----

void CudaBackend::convert(const Tensor& dst, const Tensor& src) {
  const char* op = "convert";
  cuda::check_float(op, {"dst", dst});
  cuda::check_float(op, {"src", src});
  cuda::require(dst.numel() == src.numel(), op, "dst and src differ in element count", {{"dst", dst}, {"src", src}});
  if (dst.data == src.data) {
    cuda::require(dst.dtype == src.dtype, op, "in-place conversion between dtypes", {{"dst", dst}, {"src", src}});
    return;
  }
  cuda::launch_convert(*this, dst.data, dst.dtype, src.data, src.dtype, dst.numel(), op);
  cuda::check_launch(*this, op, {{"dst", dst}, {"src", src}});
}

void CudaBackend::fill(const Tensor& dst, float value) {
  const char* op = "fill";
  cuda::check_float(op, {"dst", dst});
  const int64_t n = dst.numel();
  if (n == 0) return;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (bits == 0) {  // +0.0 is all-zero bits in every float format
    check_cuda(cudaMemsetAsync(dst.data, 0, dst.bytes(), stream_), op, "cudaMemsetAsync", dst.shape_str());
    return;
  }
  const unsigned blocks = cuda::grid_for(n, cuda::kThreads, 4);
  switch (dst.dtype) {
    case DType::BF16: {
      __nv_bfloat16_raw r;
      r.x = f32_to_bf16(value);
      const __nv_bfloat16 v(r);
      cuda::fill_kernel<__nv_bfloat16><<<blocks, cuda::kThreads, 0, stream_>>>(dst.as<__nv_bfloat16>(), v, n);
      break;
    }
    case DType::F16: {
      __half_raw r;
      r.x = f32_to_f16(value);
      const __half v(r);
      cuda::fill_kernel<__half><<<blocks, cuda::kThreads, 0, stream_>>>(dst.as<__half>(), v, n);
      break;
    }
    default: cuda::fill_kernel<float><<<blocks, cuda::kThreads, 0, stream_>>>(dst.as<float>(), value, n); break;
  }
  cuda::check_launch(*this, op, {{"dst", dst}});
}

void CudaBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* op = "add";
  cuda::check_float(op, {"out", out});
  cuda::check_float(op, {"a", a});
  cuda::check_float(op, {"b", b});
  cuda::require(out.numel() == a.numel() && out.numel() == b.numel(), op, "element counts differ",
                {{"out", out}, {"a", a}, {"b", b}});
  const int64_t n = out.numel();
  if (n == 0) return;
  cuda::SameDType u(*this, op, {cuda::out(out), cuda::in(a), cuda::in(b)});
  KEEL_DISPATCH_FLOAT(u.dtype(), op, T, {
    cuda::with_pack_width<T>(cuda::aligned16({u[0].data, u[1].data, u[2].data}), [&](auto v) {
      cuda::add_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(n, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(
              u[0].as<T>(), u[1].as<const T>(), u[2].as<const T>(), n);
    });
  });
  u.finish();
  cuda::check_launch(*this, op, {{"out", out}, {"a", a}, {"b", b}});
}

void CudaBackend::scale(const Tensor& x, float s) {
  const char* op = "scale";
  cuda::check_float(op, {"x", x});
  const int64_t n = x.numel();
  if (n == 0) return;
  KEEL_DISPATCH_FLOAT(x.dtype, op, T, {
    cuda::with_pack_width<T>(cuda::aligned16({x.data}), [&](auto v) {
      cuda::scale_kernel<T, decltype(v)::value>
          <<<cuda::grid_for(cuda::ceil_div(n, int64_t{v}), cuda::kThreads), cuda::kThreads, 0, stream_>>>(x.as<T>(), s, n);
    });
  });
  cuda::check_launch(*this, op, {{"x", x}});
}

// ---- RoPE tables ----

const float* CudaBackend::rope_table(int T, int head_dim, const Rope& rope) {
  const RopeTableKey key = rope_table_key(T, head_dim, rope);
  auto it = rope_tables_.find(key);
  if (it != rope_tables_.end()) return static_cast<const float*>(it->second);
  // The same host computation as the CPU reference's, so the tables are equal bit for bit.
  const std::vector<float> table = rope_cos_sin(rope_inv_freq(head_dim, rope), 0, T);
  void* d = scratch(table.size() * sizeof(float), "rope_table");
  check_cuda(cudaMemcpyAsync(d, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice, stream_), "rope_table",
             "cudaMemcpyAsync");
  rope_tables_[key] = d;
  return static_cast<const float*>(d);
}

// ---- factory ----

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

void cuda_profile_restart(Backend& backend) {
  if (auto* cuda_be = dynamic_cast<CudaBackend*>(&backend)) cuda_be->profile_restart();
}

CUstream_st* cuda_stream_of(Backend& backend) {
  auto* cuda_be = dynamic_cast<CudaBackend*>(&backend);
  if (!cuda_be) throw std::invalid_argument("cuda_stream_of: backend " + backend.name() + " is not a CudaBackend");
  return cuda_be->stream();
}

}  // namespace keel
