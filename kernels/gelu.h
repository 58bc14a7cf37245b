// GELU, tanh approximation (GPT-2's "gelu_new", PyTorch's approximate="tanh"), and its
// derivative: one definition for the CPU reference, the CUDA kernels and the CUDA emulator's
// cuBLASLt GELU epilogues.
//   gelu(x)  = 0.5 x (1 + t),  t = tanh(u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// tanhf is the C library's on the host and CUDA's accurate one (<= 2 ulp) on the device, so
// the backends agree to a few fp32 ulps before their output rounding.
#pragma once

#include <cmath>

#include "kernels/host_device.h"

namespace keel {

constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

KEEL_HOST_DEVICE float gelu(float x) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * (x * x * x));
  return 0.5f * x * (1.0f + tanhf(u));
}

KEEL_HOST_DEVICE float gelu_grad(float x) {
  const float u = kGeluSqrt2OverPi * (x + kGeluCubic * (x * x * x));
  const float t = tanhf(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
}

}  // namespace keel
