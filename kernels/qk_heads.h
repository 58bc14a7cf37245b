// Backend::qk_heads_copy's layout, shared by the CPU reference and the CUDA kernel: the q and k
// heads of qkv one per row, all q heads first, then all k heads.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace keel {

// The row of head h (h < nh: a q head, else k head h - nh) of token row n, of `rows` token rows.
KEEL_HOST_DEVICE int64_t qk_head_row(int64_t n, int64_t h, int64_t rows, int64_t nh, int64_t nkv) {
  return h < nh ? n * nh + h : rows * nh + n * nkv + (h - nh);
}

}  // namespace keel
