// The keys a query row attends in causal self-attention, shared by the CPU reference and the
// CUDA kernels.
//
// Row i of a sequence attends keys first_key(i) .. i, where first_key(i) is
//   - its document's first row, i - pos[i], under document masking (AttnShape::positions),
//   - and at least i - window + 1 with a sliding window (AttnShape::window > 0: Mistral's
//     sliding_window, Megatron's --window-size; the window keys ending at the row itself),
//   - else 0.
// Both bounds never decrease with i, so neither does first_key: the rows that attend key j are
// j .. (the last row whose first key is at most j), a contiguous range. The kernels rely on that.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace keel {

// seq_pos: the document positions of row i's sequence (pos + b * T), or null without masking.
KEEL_HOST_DEVICE int64_t attention_first_key(const int32_t* seq_pos, int64_t i, int64_t window) {
  int64_t first = seq_pos ? i - seq_pos[i] : 0;
  if (window > 0 && i - window + 1 > first) first = i - window + 1;
  return first;
}

}  // namespace keel
