// The warpgroup tensor-core path (kernels/cuda/wgmma.cuh) seen from the host: whether a device
// runs it, and one product per operand form for the tests (test/gpu/test_gpu_attention.cpp),
// which check the shared-memory layouts and descriptors against the CPU before any kernel
// builds on them. No CUDA headers.
#pragma once

#include "kernels/tensor.h"

namespace keel {
class CudaBackend;
namespace cuda {

// Whether a device runs keel's sm_90a code (an H100 or H200 with a build for 90a; always in the
// CUDA emulator). Probed by one launch the first time per device, which it makes current.
bool wgmma_available(int device);

// c [64, N] (f32) = a [64, 64] b with one warpgroup, k-step by k-step: b is [N, 64] (K-major:
// each row one n) or, with b_n_major, [64, N] (each row one k); a comes to the instruction from
// shared memory or, with a_from_registers, from registers. a and b both bf16 or both f16;
// N 32, 64 or 128. Throws where the device has no wgmma.
void wgmma_tile_product(CudaBackend& be, const Tensor& c, const Tensor& a, const Tensor& b, bool a_from_registers,
                        bool b_n_major);

}  // namespace cuda
}  // namespace keel
