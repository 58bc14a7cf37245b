// Fused causal attention on the tensor cores (attention_flash.cu), for bf16 / fp16 storage and
// head_dim 64, 128 or 160, and any other up to 160 on copies zero-padded to the next of those
// (the tiny configs' 32, BLOOM's 145 and 150). attention.cu decides when to use it and falls
// back to the plain fp32 kernels otherwise.
#pragma once

#include "kernels/cuda/cuda_common.cuh"

namespace keel::cuda {

// Can the fused kernels run this call (the forward, or with `backward` the dq and dk/dv
// kernels)? dtype bf16 or f16 shared by all operands, head_dim up to 160, every base
// pointer 16-byte aligned (unless padded copies are made), and the kernels' shared memory
// within the device's per-block opt-in limit.
bool flash_supported(const CudaBackend& be, const AttnShape& s, DType dtype,
                     std::initializer_list<const Tensor*> operands, bool backward);

// out [B*T, nh*hd] and lse [B, nh, T] from qkv (after RoPE); with ALiBi when s.alibi_slopes is
// given (checked by the op).
void flash_forward(CudaBackend& be, const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s);

// dqkv (written in full) from dout, qkv, lse and delta[B, nh, T] = rowsum(dout * out).
void flash_backward(CudaBackend& be, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                    const float* delta, const AttnShape& s);

}  // namespace keel::cuda
