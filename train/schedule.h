// Learning-rate and batch-size schedules: pure functions of the step / consumed samples, so a
// resumed run continues them exactly.
#pragma once

#include <cstdint>

#include "train/config.h"

namespace keel {

// Learning rate for optimizer update number `step` (1-based):
//   warmup:  lr * step / warmup_steps                       for step <= warmup_steps
//   decay:   progress p = min(1, (step - warmup) / decay_steps), decay_steps defaulting to
//            total steps - warmup; cosine: min + (lr - min) (1 + cos(pi p)) / 2;
//            linear: lr - (lr - min) p; constant: lr.
//   wsd:     lr until the last C = wsd_decay_steps (default decay_steps / 5, at least 1) steps
//            of the decay window, then p = progress through those C steps and
//            linear: lr - (lr - min) p; cosine: as above; 1-sqrt: min + (lr - min) (1 - sqrt(p)).
double learning_rate(const RunConfig& cfg, int64_t step);

// Global batch size after `consumed_samples`, Megatron's ramp-up: start at `start`, add
// `increment` every samples / ((global - start) / increment) consumed samples, up to global.
int64_t global_batch_size(const RunConfig& cfg, int64_t consumed_samples);

}  // namespace keel
