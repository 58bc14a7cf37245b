// NcclComm on one GPU (a group of one: NCCL still runs every collective). Multi-rank NCCL
// needs one GPU per rank: test_parallel_mpi's "nccl" mode under mpirun covers it.
// Skipped (with a warning) where keel was built without NCCL or no GPU is present.
#include <catch2/catch.hpp>

#include <vector>

#include "kernels/device.h"
#include "train/parallel/nccl_comm.h"

#ifdef KEEL_HAVE_NCCL
#include <cuda_runtime.h>
#endif

using namespace keel;
using namespace keel::parallel;

TEST_CASE("nccl comm: collectives of one rank on the GPU", "[parallel][comm][gpu]") {
  if (!nccl_built()) {
    WARN("skipped: keel was built without NCCL");
    return;
  }
  if (cuda_device_count() == 0) {
    WARN("skipped: no GPU");
    return;
  }
#ifdef KEEL_HAVE_NCCL
  cudaSetDevice(0);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  {
    LocalComm boot("tp");
    NcclComm c(boot, stream);
    CHECK(c.rank() == 0);
    CHECK(c.size() == 1);
    CHECK(c.name() == "tp");
    CHECK(c.device() == Device::CUDA);

    const std::vector<float> host{1.f, -2.f, 3.5f, 0.25f};
    float *a = nullptr, *b = nullptr;
    REQUIRE(cudaMalloc(&a, 4 * sizeof(float)) == cudaSuccess);
    REQUIRE(cudaMalloc(&b, 4 * sizeof(float)) == cudaSuccess);
    cudaMemcpy(a, host.data(), 4 * sizeof(float), cudaMemcpyHostToDevice);
    Tensor ta(a, DType::F32, {4}, Device::CUDA), tb(b, DType::F32, {4}, Device::CUDA);
    c.all_reduce(ta, ReduceOp::Sum);
    c.all_reduce(ta, ReduceOp::Max);
    c.reduce_scatter(tb, ta);
    c.broadcast(tb, 0);
    c.barrier();
    c.synchronize();
    std::vector<float> got(4);
    cudaMemcpy(got.data(), b, 4 * sizeof(float), cudaMemcpyDeviceToHost);
    CHECK(got == host);
    cudaMemset(b, 0, 4 * sizeof(float));
    c.all_gather(tb, ta);
    c.synchronize();
    cudaMemcpy(got.data(), b, 4 * sizeof(float), cudaMemcpyDeviceToHost);
    CHECK(got == host);
    CHECK(c.calls() == 6);
    // Host tensors are refused with a message naming the group.
    std::vector<float> h(4);
    CHECK_THROWS_WITH(c.all_reduce(Tensor(h.data(), DType::F32, {4})), Catch::Contains("host memory"));
    cudaFree(a);
    cudaFree(b);
  }
  cudaStreamDestroy(stream);
#endif
}
