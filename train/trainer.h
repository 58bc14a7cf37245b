// One rank's training engine: its share of the model (a TP shard of a pipeline stage), its
// parameter state (a ZeRO-1 shard of the optimizer), the loss scaler, and the optimizer step
// over a set of micro-batches. No files, no data loading: the run loop (train/run.cpp) feeds
// it, and tests drive it directly.
//
// One step, on every rank of the grid:
//   1. forward/backward of this rank's DP micro-batches through the pipeline, 1F1B order
//      (interleaved over the rank's model chunks with parallel.virtual_stages > 1),
//      activations and their gradients passed between stages (send/recv on the PP group);
//      each parameter gradient's first contribution stores it, later ones add, and what no op
//      wrote is zero-filled after (model/grad_writes.h: no fill of the whole buffer);
//   2. the tied embedding's gradient summed over its two copies (first and last stage);
//   3. gradients reduce-scattered over DP: each rank owns one shard of masters and moments;
//   4. the global gradient norm over all ranks (each parameter counted once), non-finite check;
//   5. clip and AdamW on the shard, then the updated working weights all-gathered over DP
//      (with parallel.overlap_param_gather, bucket by bucket as the next forward needs them).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "model/param_table.h"
#include "model/transformer.h"
#include "train/config.h"
#include "train/health.h"
#include "train/optimizer.h"
#include "train/pipeline_schedule.h"
#include "train/step_timers.h"
#include "train/parallel/comm.h"
#include "train/parallel/grad_buckets.h"
#include "train/parallel/grid.h"
#include "train/parallel/param_gather.h"

namespace keel {

// Host-side micro-batch: micro_batch * seq_len inputs and targets (target < 0: not in the loss).
struct MicroBatch {
  std::vector<int32_t> inputs, targets;
  // data.document_masking: the inputs' document positions (kernels/document_positions.h);
  // empty: plain causal attention over each sequence.
  std::vector<int32_t> positions;
};

struct StepStats {
  int64_t iteration = 0;      // 1-based number of this step
  double loss = 0;            // mean loss over the global batch's valid target tokens (NaN: none)
  double grad_norm = 0;       // global L2 norm of the (unscaled) gradient, before clipping
  double lr = 0;
  float loss_scale = 1;       // scale used for this step
  int64_t global_batch = 0;   // samples, over all DP ranks
  int64_t valid_tokens = 0;   // over all DP ranks
  int64_t num_zeros = 0;      // gradient elements exactly zero (each parameter once)
  bool skipped = false;       // update not applied (overflow, non-finite, no loss tokens, or a spike with
                              // action skip/rewind)
  bool nonfinite = false;     // loss or gradient was inf/nan
  bool scale_exhausted = false;   // fp16: overflow with the loss scale already at its minimum
  std::string nonfinite_report;   // the first op that went non-finite (health.localize_nonfinite)
  bool spike = false;             // loss or grad-norm spike (health.spike_*)
  std::string spike_text;
  std::vector<float> act_max, grad_max;    // per layer max |layer output| and |layer input gradient|
  std::vector<std::string> frozen;         // newly frozen tensors, explained (health.frozen_*)
};

// What a checkpoint records to verify a restart: the loss of a fixed probe batch and the
// per-tensor sums of squares of the working weights and the fp32 masters (in the order of the
// full model's parameter table), computed over all ranks.
struct HealthSnapshot {
  double probe_loss = 0;
  // Which batch the probe was: "<rows>x<seq_len> crc32c <hex of inputs and targets>". Another
  // batch (a finetune on other data, another seq_len or micro_batch) has another loss, so the
  // probe losses are compared only when this matches (or a checkpoint predates the field).
  std::string probe_batch;
  // Whether a saved snapshot measured the same probe batch (yes when it does not say).
  bool same_probe(const nlohmann::json& saved) const { return saved.value("probe_batch", probe_batch) == probe_batch; }
  std::vector<double> working_sumsq, master_sumsq;
  // A saved snapshot's probe loss. JSON has no inf or nan (an overflowing probe, as fp16's stop
  // at the smallest loss scale saves, is written null): then from its bits, else nan.
  static double saved_probe_loss(const nlohmann::json& saved);
};

class Trainer {
 public:
  // grid/comms: this rank's place and communicators; without them, a world of one rank.
  // forward_only: for evaluation (keel train --eval-only): no gradients and no Adam moments are
  // allocated, so a model takes 6 bytes per parameter in bf16 (weights and masters), not 18;
  // step() is refused.
  Trainer(const RunConfig& cfg, Backend& backend, const parallel::Grid* grid = nullptr,
          parallel::CommGroups* comms = nullptr, bool forward_only = false);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Fresh weights from the config's seed (the same values under every layout).
  void init_weights() { state().init(cfg_.train.seed); }

  // One optimizer step over this DP rank's micro-batches (the same on every rank of its TP x
  // PP group). `iteration` is this step's 1-based number (drives the LR schedule).
  // With collect_stats, the per-layer activation / gradient magnitudes are gathered too.
  StepStats step(const std::vector<MicroBatch>& micro_batches, int64_t iteration, bool collect_stats = false);

  // Mean loss over the micro-batches of all DP ranks, without touching gradients or weights.
  // With every target masked there is no mean: it returns 0 (a number the restart probe can
  // compare for equality) and `loss_tokens`, the count of targets in the loss, tells the case.
  double evaluate(const std::vector<MicroBatch>& micro_batches, int64_t* loss_tokens = nullptr);
  // Per token of this DP rank's micro-batches (micro-batch, row, position order): its loss,
  // -log p(target), 0 where the target is < 0; every stage gets them (collective over PP).
  // Gradients and weights are untouched.
  std::vector<double> token_losses(const std::vector<MicroBatch>& micro_batches);

  // Replica consistency (seed 001): the tied embedding's two copies (first and last stage) and
  // every tensor replicated over TP ranks must hold bitwise-identical working weights. Compares
  // CRC-32C checksums across the groups (collective: every rank calls it) and throws
  // ReplicaMismatch naming the tensor, the ranks and their checksums. Returns tensors checked.
  int check_replicas();

  // Restart verification (collective). The snapshot of the current state; the comparison
  // with one saved in a checkpoint (problems, empty when sound): same topology and weights
  // restored bit for bit => identical probe loss bits; otherwise within rounding.
  HealthSnapshot snapshot(const MicroBatch& probe);
  nlohmann::json snapshot_json(const HealthSnapshot& s) const;
  // The spike check's running statistics, saved in a checkpoint's health record and restored on
  // resume and rewind (SpikeDetector::restore: a rewind keeps the count of flagged steps).
  SpikeDetector& spikes() { return spikes_; }
  // bitwise: the same layout and arithmetic (Backend::arithmetic) as the save, so the probe
  // loss must have the same bits; else it must agree within rounding. saved_precision: the
  // checkpoint's precision.mode; when it is not this run's, the weights are compared in the
  // copy this run continues from (its masters, else its working weights) against the saved
  // copy that one was loaded from. compare_probe false: only the weights (a weights-only load
  // into a model that computes another function of them, whose probe loss is another).
  std::vector<std::string> compare_snapshot(const nlohmann::json& saved, const HealthSnapshot& now, bool bitwise,
                                            bool compare_masters, const std::string& saved_precision,
                                            bool compare_probe = true) const;
  // Tensors whose fp32 masters do not round to the stored working weights (collective):
  // masters that did not come from these weights (a stale or random master copy). `stochastic`:
  // the weights were written by stochastic rounding, so either bf16 neighbour of the master
  // is consistent (round-to-nearest otherwise, bit for bit).
  std::vector<std::string> check_master_consistency(bool stochastic = false);

  const RunConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  const parallel::Grid& grid() const { return grid_; }
  parallel::CommGroups& comms() { return *comms_; }
  // The first of this rank's model chunks (the only one without virtual_stages): model-wide
  // facts (FLOPs per token, sequence length) and the chunk's own tensors.
  Transformer& model() { return *chunks_.front(); }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  // The pipeline schedule of a step of `micro_batches` (or an evaluation of them); the last
  // one of each kind is kept.
  const PipeSchedule& schedule(int micro_batches, bool training);
  // The parameters, gradients and optimizer state. Refused (std::logic_error) while the DP
  // weight gather of parallel.overlap_param_gather is pending: call settle_params() first.
  ParamState& state();
  // parallel.overlap_param_gather: completes the DP gather of the last update's weights, which
  // otherwise waits for the next step's forward. Collective over DP: every rank calls it at the
  // same point. The collective methods here that read the weights (evaluate, token_losses,
  // check_replicas, snapshot through evaluate, check_master_consistency) call it themselves.
  void settle_params() {
    if (param_gather_) param_gather_->settle();
  }
  LossScaler& scaler() { return scaler_; }
  Backend& backend() { return be_; }
  // Phase and communication timers (train/step_timers.h): the run loop starts each step timed
  // or not, and times its data loading as a phase of the step.
  StepTimers& timers() { return timers_; }
  // The DP reduction's buckets (parallel.overlap_grad_reduce with dp > 1), else nullptr; its
  // counts are the last step's.
  const parallel::GradBuckets* grad_buckets() const { return grad_buckets_.get(); }
  // The DP weight gather's buckets (parallel.overlap_param_gather with dp > 1), else nullptr;
  // its counts are the last update's.
  const parallel::ParamGather* param_gather() const { return param_gather_.get(); }
  // Collective over the world: every rank's sample of the timed step just finished (step_ms:
  // its wall time as the run loop measured it), with grid coordinates and host names.
  // Stops the timing, so the gather itself is not measured.
  std::vector<RankTimes> gather_timers(double step_ms);

 private:
  // Runs forward (and backward unless eval) over the micro-batches in 1F1B order (interleaved
  // with several chunks); returns the sum of this rank's losses (non-zero on the last stage only).
  // token_losses (evaluation only): where the last stage adds each token's loss, micro_batch *
  // seq_len entries per micro-batch.
  double run_pipeline(const std::vector<MicroBatch>& mbs, float dloss, bool backward, double* token_losses = nullptr);
  double run_1f1b(const std::vector<MicroBatch>& mbs, float dloss, bool backward, double* token_losses);
  double run_interleaved(const MicroBatch* mbs, int M, float dloss, bool backward, double* token_losses);
  // Adds the slot's per-token losses to out[0 .. micro_batch * seq_len).
  void add_token_losses(const Transformer& m, int slot, double* out);
  // The same probe on every chunk (told which chunk called); nullptr clears it.
  void set_probe(const std::function<void(int chunk, const Transformer::OpProbe&)>& fn);
  void sync_tied_embedding();
  // A tied embedding split over the pipeline, and this rank holds one of its two copies (the
  // first stage's tok_embed, or the last stage's copy for the head).
  bool holds_tied_copy() const {
    return cfg_.model.tied_embeddings && grid_.pp_size() > 1 && grid_.holds_embedding();
  }
  // Test hook for the straggler report: KEEL_FAULT_SLOW_RANK="rank=R,ms=N" makes world rank R
  // sleep N ms per micro-batch of a training step, as a slow GPU would compute.
  void slow_rank_fault(int micro_batches);
  double all_reduce_sum(parallel::Comm& c, double x);  // in fp32 pairs: see parallel::sum_over_ranks
  int64_t all_reduce_sum(parallel::Comm& c, int64_t x);
  std::string localize_nonfinite(const std::vector<MicroBatch>& mbs, float dloss);
  void check_frozen(StepStats& st);

  RunConfig cfg_;
  Backend& be_;
  parallel::Grid grid_;
  parallel::CommGroups local_comms_;
  StepTimers timers_;
  parallel::CommGroups timed_comms_;  // the given communicators (or local_comms_), each behind a TimedComm
  parallel::CommGroups* comms_;       // &timed_comms_: what every step uses
  ParamTable table_;
  std::unique_ptr<ParamState> state_;
  std::unique_ptr<GradWrites> grad_writes_;  // over state_->grads (training only)
  // parallel.overlap_grad_reduce with dp > 1: the DP reduction's buckets, and, during a training
  // step's pipeline, what the chunks' last backward reports final gradients to.
  std::unique_ptr<parallel::GradBuckets> grad_buckets_;
  Transformer::GradsReadyFn grads_ready_;
  // parallel.overlap_param_gather with dp > 1: gathers the updated weights as the next forward
  // reaches them (every chunk's forward asks it for each group's weights).
  std::unique_ptr<parallel::ParamGather> param_gather_;
  // This rank's model chunks (one without virtual_stages); chunks after the first share its
  // backward scratch.
  std::vector<std::unique_ptr<Transformer>> chunks_;
  // Interleaved schedule: per chunk, where received output gradients wait for their backward.
  std::vector<std::vector<Tensor>> grad_pool_;
  // The schedule of the last training step and of the last evaluation (micro-batch counts
  // change only with the batch ramp-up).
  std::optional<PipeSchedule> training_schedule_, eval_schedule_;
  // Interleaved: the whole batch's activation slots, within which every step runs (schedule()).
  std::vector<std::vector<int>> step_cap_;
  LossScaler scaler_;
  SpikeDetector spikes_;
  std::unique_ptr<FrozenDetector> frozen_;
  int64_t applied_since_frozen_check_ = 0;
  std::vector<std::string> full_names_;  // every logical tensor of the model, table order
  // Flat ranges of this rank's optimizer shard that hold primary copies (grad norm, zeros).
  std::vector<std::pair<int64_t, int64_t>> primary_ranges_;
  Tensor scalar_f32_, scalar_i32_;  // device staging for scalar all-reduces
  std::vector<void*> allocations_;
};

class ReplicaMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The model chunks of a grid position: its pipeline stage's layers (one chunk per virtual
// stage) + TP rank.
std::vector<ModelShard> chunks_for(const RunConfig& cfg, const parallel::Grid& grid);

}  // namespace keel
