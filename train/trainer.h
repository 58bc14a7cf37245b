// One rank's training engine: the model, its parameter state, the loss scaler, and the
// optimizer step over a set of micro-batches. No files, no data loading: the run loop
// (train/run.cpp) feeds it, and tests drive it directly.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "model/param_table.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace keel {

// Host-side micro-batch: micro_batch * seq_len inputs and targets (target < 0: not in the loss).
struct MicroBatch {
  std::vector<int32_t> inputs, targets;
};

struct StepStats {
  int64_t iteration = 0;      // 1-based number of this step
  double loss = 0;            // mean loss over the step's valid target tokens
  double grad_norm = 0;       // global L2 norm of the (unscaled) gradient, before clipping
  double lr = 0;
  float loss_scale = 1;       // scale used for this step
  int64_t global_batch = 0;   // samples
  int64_t valid_tokens = 0;
  int64_t num_zeros = 0;      // gradient elements exactly zero
  bool skipped = false;       // update not applied (overflow or non-finite)
  bool nonfinite = false;     // loss or gradient was inf/nan
};

class Trainer {
 public:
  Trainer(const RunConfig& cfg, Backend& backend);

  // Fresh weights from the config's seed.
  void init_weights() { state_->init(cfg_.train.seed); }

  // Forward + backward over the micro-batches, then (unless the gradient is non-finite)
  // clip and AdamW. `iteration` is this step's 1-based number (drives the LR schedule).
  StepStats step(const std::vector<MicroBatch>& micro_batches, int64_t iteration);

  // Mean loss over the micro-batches without touching gradients or weights.
  double evaluate(const std::vector<MicroBatch>& micro_batches);

  const RunConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  Transformer& model() { return *model_; }
  ParamState& state() { return *state_; }
  LossScaler& scaler() { return scaler_; }
  Backend& backend() { return be_; }

 private:
  RunConfig cfg_;
  Backend& be_;
  ParamTable table_;
  std::unique_ptr<ParamState> state_;
  std::unique_ptr<Transformer> model_;
  LossScaler scaler_;
};

}  // namespace keel
