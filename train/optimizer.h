// Parameter state of one rank and the AdamW update over it.
//
// Flat buffers laid out by the ParamTable (one per dtype), padded to a multiple of the DP size:
//   working  weights the model computes with (bf16 / fp16 / fp32), all of the rank's tensors
//   grads    fp32, accumulated over micro-batches (after the DP reduce-scatter only this
//            rank's shard is meaningful)
//   master   fp32 copy the optimizer updates, for this rank's ZeRO-1 shard [optim_begin,
//            optim_end) of the flat space (a view of `working` in fp32 mode; absent in the
//            unsafe bf16-only mode, where updates smaller than bf16's spacing round away)
//   m, v     fp32 Adam moments of the shard
// With one DP rank the shard is everything. A state for evaluation only (optimizer = false) has
// no grads and no moments: working weights and masters, which loading and restart verification use.
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
  ParamState(const ParamTable& table, Backend& backend, PrecisionMode mode, int dp_size = 1, int dp_rank = 0,
             bool optimizer = true);
  ~ParamState();
  ParamState(const ParamState&) = delete;
  ParamState& operator=(const ParamState&) = delete;

  // Fresh initialisation (ParamTable init rules, counter-based RNG keyed by seed): masters
  // get the fp32 values, working weights their rounding, moments zero, Adam step 0.
  void init(uint64_t seed);
  // Load fp32 values of every local tensor from host memory laid out like the table
  // (`values` has table.local_numel() floats); masters by exact copy, working by rounding.
  void load_fp32(const float* values);
  // Working weights -> fp32 host buffer of table.local_numel() floats.
  void working_to_host(float* out) const;
  // Master values (the working weights in the unsafe mode) -> fp32 host buffer laid out like
  // the table; only the shard [optim_begin, optim_end) is written.
  void master_to_host(float* out) const;

  // Elements [flat_begin, flat_begin + n) of the flat space: of a full buffer (working,
  // grads), or of a shard buffer (master, m, v), which starts at optim_begin().
  Tensor flat_view(const Tensor& buffer, int64_t flat_begin, int64_t n) const;

  bool has_master() const { return !master.empty(); }
  bool master_is_working() const { return master_is_working_; }
  int64_t optim_begin() const { return optim_begin_; }
  int64_t optim_end() const { return optim_end_; }
  int64_t padded_numel() const { return padded_; }

  Tensor working, grads, master, m, v;
  int64_t adam_step = 0;  // applied updates so far (Adam's bias correction uses it)

 private:
  const ParamTable& table_;
  Backend& be_;
  int64_t padded_ = 0, optim_begin_ = 0, optim_end_ = 0;
  bool master_is_working_ = false;
  std::vector<void*> allocations_;
};

// Working copies written by stochastic rounding (bf16 working with fp32 masters only): each
// tensor's random stream is keyed by (seed, its name, its TP shard), counted by the element's
// index within the tensor and the Adam step, so it does not depend on the ZeRO-1 sharding,
// replicated copies (TP-replicated norms, tied embedding copies) round identically, and a
// resume continues the same stream.
struct WorkingRounding {
  bool stochastic = false;
  uint64_t seed = 0;
};

// One AdamW update of this rank's shard: grads are multiplied by grad_scale (loss-scale
// removal times the clip coefficient); weight decay only where the table's role says so.
void adamw_update(ParamState& state, const ParamTable& table, Backend& backend, const OptimizerConfig& opt,
                  double lr, float grad_scale, const WorkingRounding& rounding = {});

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
