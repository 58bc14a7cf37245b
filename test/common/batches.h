// Host micro-batches for driving a Trainer directly in tests.
#pragma once

#include <random>
#include <vector>

#include "common/workspace.h"
#include "train/trainer.h"

namespace keel::test {

// Micro-batches cut from a token stream: consecutive windows of T+1 tokens from `start`.
inline std::vector<MicroBatch> batches_from(const std::vector<uint32_t>& tokens, size_t start, int n_micro, int mbs,
                                            int T) {
  std::vector<MicroBatch> out(static_cast<size_t>(n_micro));
  size_t at = start;
  for (auto& mb : out)
    for (int b = 0; b < mbs; ++b, at += static_cast<size_t>(T))
      for (int t = 0; t < T; ++t) {
        mb.inputs.push_back(static_cast<int32_t>(tokens[at + t]));
        mb.targets.push_back(static_cast<int32_t>(tokens[at + t + 1]));
      }
  return out;
}

// A learnable batch (next = 3 * token + 1 mod 64, 1 in 8 tokens random), different per seed.
inline std::vector<MicroBatch> learnable_batches(int n_micro, int mbs, int T, uint32_t seed) {
  return batches_from(synthetic_tokens(static_cast<size_t>(n_micro * mbs * T) + 1, seed), 0, n_micro, mbs, T);
}

// Pure noise over a 64-token vocabulary: a batch nothing can predict.
inline std::vector<MicroBatch> noise_batches(int n_micro, int mbs, int T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<MicroBatch> out(static_cast<size_t>(n_micro));
  for (auto& mb : out)
    for (int i = 0; i < mbs * T; ++i) {
      mb.inputs.push_back(static_cast<int32_t>(rng() % 64));
      mb.targets.push_back(static_cast<int32_t>(rng() % 64));
    }
  return out;
}

}  // namespace keel::test
