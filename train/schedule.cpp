#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace keel {

double learning_rate(const RunConfig& cfg, int64_t step) {
  const ScheduleConfig& s = cfg.schedule;
  const double max_lr = cfg.optimizer.lr, min_lr = cfg.optimizer.min_lr;
  if (s.warmup_steps > 0 && step <= s.warmup_steps) return max_lr * static_cast<double>(step) / s.warmup_steps;
  if (s.decay == DecayStyle::Constant) return max_lr;
  const int64_t decay_steps = s.decay_steps > 0 ? s.decay_steps : std::max<int64_t>(1, cfg.train.steps - s.warmup_steps);
  const int64_t into = step - s.warmup_steps;  // steps into the decay window
  auto cosine = [&](double p) { return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p)); };
  if (s.decay == DecayStyle::WSD) {
    const int64_t cooldown =
        std::min(decay_steps, s.wsd_decay_steps > 0 ? s.wsd_decay_steps : std::max<int64_t>(1, decay_steps / 5));
    const int64_t stable = decay_steps - cooldown;
    if (into <= stable) return max_lr;
    const double p = std::min(1.0, static_cast<double>(into - stable) / static_cast<double>(cooldown));
    switch (s.wsd_decay_style) {
      case CooldownShape::Linear: return max_lr - (max_lr - min_lr) * p;
      case CooldownShape::Cosine: return cosine(p);
      case CooldownShape::OneMinusSqrt: return min_lr + (max_lr - min_lr) * (1.0 - std::sqrt(p));
    }
  }
  const double p = std::min(1.0, static_cast<double>(into) / decay_steps);
  if (s.decay == DecayStyle::Linear) return max_lr - (max_lr - min_lr) * p;
  return cosine(p);
}

int64_t global_batch_size(const RunConfig& cfg, int64_t consumed_samples) {
  const int64_t full = cfg.train.global_batch;
  if (!cfg.schedule.rampup) return full;
  const RampupConfig& r = *cfg.schedule.rampup;
  // Megatron adds an increment every samples / increments consumed samples, a real number:
  // floor(consumed / (samples / increments)) = floor(consumed * increments / samples), exact in
  // integers. (Rounding samples / increments down first ramped early: 4 -> 16 by 4 over 100
  // samples reached 8 at 33 samples instead of 34.)
  const int64_t increments = (full - r.start) / r.increment;
  const int64_t done = consumed_samples * increments / r.samples;
  return std::min(full, r.start + done * r.increment);
}

}  // namespace keel
