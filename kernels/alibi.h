// ALiBi (Press et al., "Train Short, Test Long", 2022): no position embedding; each query head h
// adds a fixed linear penalty to its attention scores, S_ij += m_h * (j - i) for key j <= i.
// BLOOM trains with it. The slopes are a geometric sequence per head:
//   n a power of two:  m_h = 2^(-8 (h + 1) / n),  h = 0 .. n-1
//   otherwise, with p = the largest power of two below n: the p slopes of p heads, then the
//   slopes of 2p heads at even h (2^(-4 (2k + 1) / p), k = 0 .. n-p-1), in that order.
// Computed once on the host in double and rounded to fp32, so every backend reads the same
// bits; a softmax is unchanged by a per-row constant, so m_h (j - i) and BLOOM's m_h * j agree.
#pragma once

#include <vector>

namespace keel {

// The slopes of all n_heads heads of the model (tensor parallelism takes a contiguous slice).
std::vector<float> alibi_slopes(int n_heads);

}  // namespace keel
