// Parameter state of one rank and the AdamW update over it.
//
// Flat buffers laid out by the ParamTable (one per dtype):
//   working  weights the model computes with (bf16 / fp16 / fp32)
//   grads    fp32, accumulated over micro-batches
//   master   fp32 copy the optimizer updates (aliases `working` in fp32 mode; absent in the
//            unsafe bf16-only mode, where updates smaller than bf16's spacing round away)
//   m, v     fp32 Adam moments
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "model/param_table.h"
#include "train/config.h"

namespace keel {

DType working_dtype(PrecisionMode mode);
DType activation_dtype(PrecisionMode mode);

class ParamState {
 public:
  ParamState(const ParamTable& table, Backend& backend, PrecisionMode mode);
  ~ParamState();
  ParamState(const ParamState&) = delete;
  ParamState& operator=(const ParamState&) = delete;

  // Fresh initialisation (ParamTable init rules, counter-based RNG keyed by seed): masters
  // get the fp32 values, working weights their rounding, moments zero, Adam step 0.
  void init(uint64_t seed);
  // Load fp32 values of every local tensor from host memory laid out like the table
  // (`values` has local_numel floats); masters by exact copy, working by rounding.
  void load_fp32(const float* values);
  // Working weights -> fp32 host buffer (what a forward pass really uses).
  void working_to_host(float* out) const;
  // Master (or working, in the unsafe mode) -> fp32 host buffer.
  void master_to_host(float* out) const;

  // Slice of a flat buffer holding one parameter, shaped as its local shard.
  Tensor slice(const Tensor& flat, const ParamSpec& p) const;

  bool has_master() const { return !master.empty(); }

  Tensor working, grads, master, m, v;
  int64_t adam_step = 0;  // applied updates so far (Adam's bias correction uses it)

 private:
  const ParamTable& table_;
  Backend& be_;
  std::vector<void*> allocations_;
};

// One AdamW update of every parameter: grads are multiplied by grad_scale (loss-scale removal
// times the clip coefficient); weight decay only where the table's role says so.
void adamw_update(ParamState& state, const ParamTable& table, Backend& backend, const OptimizerConfig& opt,
                  double lr, float grad_scale);

// Dynamic loss scaling for fp16 (Megatron's rules). Disabled => scale 1, never changes.
class LossScaler {
 public:
  LossScaler(const LossScaleConfig& cfg, bool enabled);
  float scale() const { return static_cast<float>(scale_); }
  bool enabled() const { return enabled_; }
  // Record a step's outcome. On overflow: the step is skipped; after `hysteresis` overflows
  // the scale is multiplied by backoff (not below min). After growth_interval good steps in a
  // row it grows. Returns true when this overflow happened with the scale already at its
  // minimum and the hysteresis used up: it cannot back off any further.
  bool update(bool overflow);
  // State for checkpoints.
  double scale_value() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  void restore(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);

 private:
  LossScaleConfig cfg_;
  bool enabled_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

}  // namespace keel
