// One rank's training engine: its share of the model (a TP shard of a pipeline stage), its
// parameter state (a ZeRO-1 shard of the optimizer), the loss scaler, and the optimizer step
// over a set of micro-batches. No files, no data loading: the run loop (train/run.cpp) feeds
// it, and tests drive it directly.
//
// One step, on every rank of the grid:
//   1. forward/backward of this rank's DP micro-batches through the pipeline, 1F1B order,
//      activations and their gradients passed between stages (send/recv on the PP group);
//   2. the tied embedding's gradient summed over its two copies (first and last stage);
//   3. gradients reduce-scattered over DP: each rank owns one shard of masters and moments;
//   4. the global gradient norm over all ranks (each parameter counted once), non-finite check;
//   5. clip and AdamW on the shard, then the updated working weights all-gathered over DP.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "model/param_table.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/optimizer.h"
#include "train/parallel/comm.h"
#include "train/parallel/grid.h"

namespace keel {

// Host-side micro-batch: micro_batch * seq_len inputs and targets (target < 0: not in the loss).
struct MicroBatch {
  std::vector<int32_t> inputs, targets;
};

struct StepStats {
  int64_t iteration = 0;      // 1-based number of this step
  double loss = 0;            // mean loss over the global batch's valid target tokens
  double grad_norm = 0;       // global L2 norm of the (unscaled) gradient, before clipping
  double lr = 0;
  float loss_scale = 1;       // scale used for this step
  int64_t global_batch = 0;   // samples, over all DP ranks
  int64_t valid_tokens = 0;   // over all DP ranks
  int64_t num_zeros = 0;      // gradient elements exactly zero (each parameter once)
  bool skipped = false;       // update not applied (overflow or non-finite)
  bool nonfinite = false;     // loss or gradient was inf/nan
};

class Trainer {
 public:
  // grid/comms: this rank's place and communicators; without them, a world of one rank.
  Trainer(const RunConfig& cfg, Backend& backend, const parallel::Grid* grid = nullptr,
          parallel::CommGroups* comms = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Fresh weights from the config's seed (the same values under every layout).
  void init_weights() { state_->init(cfg_.train.seed); }

  // One optimizer step over this DP rank's micro-batches (the same on every rank of its TP x
  // PP group). `iteration` is this step's 1-based number (drives the LR schedule).
  StepStats step(const std::vector<MicroBatch>& micro_batches, int64_t iteration);

  // Mean loss over the micro-batches of all DP ranks, without touching gradients or weights.
  double evaluate(const std::vector<MicroBatch>& micro_batches);

  // Replica consistency (seed 001): the tied embedding's two copies (first and last stage) and
  // every tensor replicated over TP ranks must hold bitwise-identical working weights. Compares
  // CRC-32C checksums across the groups (collective: every rank calls it) and throws
  // ReplicaMismatch naming the tensor, the ranks and their checksums. Returns tensors checked.
  int check_replicas();

  const RunConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  const parallel::Grid& grid() const { return grid_; }
  parallel::CommGroups& comms() { return *comms_; }
  Transformer& model() { return *model_; }
  ParamState& state() { return *state_; }
  LossScaler& scaler() { return scaler_; }
  Backend& backend() { return be_; }

 private:
  // Runs forward (and backward unless eval) over the micro-batches in 1F1B order; returns the
  // sum of this rank's losses (non-zero on the last stage only).
  double run_pipeline(const std::vector<MicroBatch>& mbs, float dloss, bool backward);
  void sync_tied_embedding();
  double all_reduce_sum(parallel::Comm& c, double x);  // in fp32 pairs: ~2^-48 relative
  int64_t all_reduce_sum(parallel::Comm& c, int64_t x);

  RunConfig cfg_;
  Backend& be_;
  parallel::Grid grid_;
  parallel::CommGroups local_comms_;
  parallel::CommGroups* comms_;
  ParamTable table_;
  std::unique_ptr<ParamState> state_;
  std::unique_ptr<Transformer> model_;
  LossScaler scaler_;
  Tensor scalar_f32_, scalar_i32_;  // device staging for scalar all-reduces
  std::vector<void*> allocations_;
};

class ReplicaMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The ModelShard of a grid position: pipeline stage layers + TP rank.
ModelShard shard_for(const RunConfig& cfg, const parallel::Grid& grid);

}  // namespace keel
