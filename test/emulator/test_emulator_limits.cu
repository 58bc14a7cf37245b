// The CUDA emulator's launch checks (kernels/cuda/emulator): a launch that a GPU refuses fails on
// the emulator too, with the error a GPU gives and a message naming the kernel, instead of
// running. Built on the emulator only: translate_launches.py turns this file into C++ as it
// does the backend's kernels. Also the emulator's injected library faults, as the ops report them.
#include <catch2/catch.hpp>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace {

constexpr int kBound = 64;

__global__ void __launch_bounds__(kBound) bounded_kernel(int* out) { out[threadIdx.x] = 1; }

// 48 KiB + 4 bytes of static shared memory: ptxas refuses it.
__global__ void too_much_static_kernel(int* out) {
  __shared__ float big[12 * 1024 + 1];
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = static_cast<int>(big[threadIdx.x]);
}

// 32 KiB static, plus the launch's dynamic shared memory.
__global__ void static_and_dynamic_kernel(int* out) {
  __shared__ float part[8 * 1024];
  part[threadIdx.x] = 2.0f;
  out[threadIdx.x] = static_cast<int>(part[threadIdx.x]);
}

// Device memory of n ints, zeroed, and a way back to the host.
struct Ints {
  int* p = nullptr;
  int n;
  explicit Ints(int count) : n(count) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(int)) == cudaSuccess);
    REQUIRE(cudaMemset(p, 0, n * sizeof(int)) == cudaSuccess);
  }
  ~Ints() { cudaFree(p); }
  std::vector<int> host() const {
    std::vector<int> h(static_cast<size_t>(n));
    REQUIRE(cudaMemcpy(h.data(), p, n * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

int sum(const std::vector<int>& v) {
  int s = 0;
  for (int x : v) s += x;
  return s;
}

}  // namespace

TEST_CASE("emulator: a block larger than the kernel's __launch_bounds__ fails the launch", "[emulator]") {
  cudaGetLastError();
  Ints out(128);
  bounded_kernel<<<1, kBound>>>(out.p);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  CHECK(sum(out.host()) == kBound);

  Ints out2(128);
  bounded_kernel<<<1, 2 * kBound>>>(out2.p);
  CHECK(cudaGetLastError() == cudaErrorLaunchOutOfResources);
  CHECK(sum(out2.host()) == 0);  // nothing of it ran
  const std::string msg = keel_emu::last_launch_failure();
  CHECK(msg.find("bounded_kernel") != std::string::npos);
  CHECK(msg.find("a block of 128 threads is more than its __launch_bounds__ of 64") != std::string::npos);
}

TEST_CASE("emulator: more than 48 KiB of static shared memory fails the launch", "[emulator]") {
  cudaGetLastError();
  Ints out(32);
  too_much_static_kernel<<<1, 32>>>(out.p);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  const std::string msg = keel_emu::last_launch_failure();
  CHECK(msg.find("too_much_static_kernel") != std::string::npos);
  CHECK(msg.find("49156 bytes of static __shared__ memory") != std::string::npos);
}

TEST_CASE("emulator: static and dynamic shared memory together are held to the kernel's limit", "[emulator]") {
  cudaGetLastError();
  Ints out(32);
  // 32 KiB static + 16 KiB dynamic: exactly the 48 KiB a kernel has without the attribute.
  static_and_dynamic_kernel<<<1, 32, 16 << 10>>>(out.p);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  CHECK(sum(out.host()) == 64);

  // 4 bytes more fail without the attribute...
  static_and_dynamic_kernel<<<1, 32, (16 << 10) + 4>>>(out.p);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  const std::string msg = keel_emu::last_launch_failure();
  CHECK(msg.find("static_and_dynamic_kernel") != std::string::npos);
  CHECK(msg.find("32768 bytes of static __shared__ memory and 16388 of dynamic, more than the 49152") !=
        std::string::npos);

  // ...and pass with it, up to 227 KiB with the static bytes.
  REQUIRE(cudaFuncSetAttribute(static_and_dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (227 - 32) << 10) == cudaSuccess);
  static_and_dynamic_kernel<<<1, 32, (227 - 32) << 10>>>(out.p);
  CHECK(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaFuncSetAttribute(static_and_dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               ((227 - 32) << 10) + 4) == cudaSuccess);
  // (A GPU refuses that call already; the emulator learns the static bytes at the launch.)
  static_and_dynamic_kernel<<<1, 32, 16 << 10>>>(out.p);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(std::string(keel_emu::last_launch_failure()).find("32768 bytes of static __shared__ memory and its "
                                                          "MaxDynamicSharedMemorySize of 199684") != std::string::npos);
}

// A cuBLASLt call that fails (the emulator's cublasLtMatmul made to, as a real one may after a
// device fault) is reported by the op that made it, with its shapes: each fused matmul op was
// reported as CudaBackend::matmul, hiding which one failed.
TEST_CASE("emulator: a failing cuBLASLt call is reported by the matmul op that made it, with its shapes",
          "[emulator]") {
  using keel::DType;
  using keel::Tensor;
  std::unique_ptr<keel::Backend> be = keel::make_cuda_backend(0);
  std::vector<void*> held;
  const auto tensor = [&](DType dt, std::initializer_list<int64_t> shape) {
    const Tensor shaped(nullptr, dt, shape, keel::Device::CUDA);
    held.push_back(be->allocate(shaped.bytes()));
    return Tensor(held.back(), dt, shape, keel::Device::CUDA);
  };
  const Tensor a = tensor(DType::BF16, {8, 32}), b = tensor(DType::BF16, {32, 16});
  const Tensor out = tensor(DType::BF16, {8, 16}), side = tensor(DType::BF16, {8, 16});
  const Tensor dweight = tensor(DType::F32, {16, 32}), dbias = tensor(DType::F32, {16});
  const auto fails_naming = [&](const char* op, const std::function<void()>& call) {
    INFO(op);
    keel_emu::set_cublaslt_matmul_failure(true);
    try {
      call();
      FAIL("no error");
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      CHECK(msg.find(std::string("CudaBackend::") + op + ": cublasLtMatmul failed: CUBLAS_STATUS_EXECUTION_FAILED") !=
            std::string::npos);
      CHECK(msg.find("[8, 16] bf16") != std::string::npos);
    }
    keel_emu::set_cublaslt_matmul_failure(false);
    call();  // the op itself is sound
    be->synchronize();
  };
  fails_naming("matmul", [&] { be->matmul(out, a, b, false, false); });
  fails_naming("matmul_gelu", [&] { be->matmul_gelu(out, side, a, b, false, false); });
  fails_naming("matmul_residual", [&] { be->matmul_residual(out, side, a, b, false, false); });
  fails_naming("matmul_bias_grad", [&] { be->matmul_bias_grad(dweight, dbias, side, a, false, false); });
  for (void* p : held) be->release(p);
}
