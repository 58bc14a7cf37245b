// Run configuration: a JSON file (configs/*.json), then --set key=value overrides, then flags.
// Every field is validated; an error names the field, the bad value and what is allowed, and
// unknown fields are errors (a typo must never silently fall back to a default).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model_config.h"

namespace keel {

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// fp32: everything fp32. bf16 (default): bf16 weights/activations, fp32 masters, grads, moments.
// fp16: like bf16 but fp16 storage and dynamic loss scaling. bf16-unsafe-no-master: parameters
// exist only in bf16 (no fp32 master): small updates round away. Kept so the failure can be
// reproduced and detected; never use it to train.
enum class PrecisionMode { FP32, BF16, FP16, BF16UnsafeNoMaster };
std::string precision_name(PrecisionMode m);
// The mode of a precision_name ("bf16", ...); nullopt for any other text.
std::optional<PrecisionMode> precision_from_name(const std::string& name);

struct LossScaleConfig {
  double initial = 65536.0;     // 2^16
  int64_t growth_interval = 1000;  // good steps before the scale doubles
  int64_t hysteresis = 2;          // overflowing steps tolerated before the scale is cut
  double min = 1.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  bool operator==(const LossScaleConfig&) const = default;
};

struct PrecisionConfig {
  PrecisionMode mode = PrecisionMode::BF16;
  LossScaleConfig loss_scale;
  // bf16 mode: write the bf16 working copy from the fp32 master by stochastic rounding
  // instead of round-to-nearest (kernels/stochastic_rounding.h). Off by default.
  bool stochastic_rounding = false;
};

struct OptimizerConfig {
  double lr = 3e-4;
  double min_lr = 3e-5;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global grad norm; 0 disables clipping
};

// WSD: warmup, then stable at lr, then a cooldown to min_lr over the last wsd_decay_steps of
// the decay window (Hu et al. 2024, MiniCPM; Hägele et al. 2024). A run can be extended, or
// cooled down from any checkpoint of the stable phase, without changing the steps before.
enum class DecayStyle { Cosine, Linear, Constant, WSD };
enum class CooldownShape { Linear, Cosine, OneMinusSqrt };

struct RampupConfig {  // Megatron's --rampup-batch-size <start> <increment> <samples>
  int64_t start = 0, increment = 0, samples = 0;
};

struct ScheduleConfig {
  int64_t warmup_steps = 0;
  DecayStyle decay = DecayStyle::Cosine;
  // Steps after the warmup over which lr goes to min_lr (0: until train.steps). Unlike
  // Megatron's --lr-decay-iters, which counts from step 0, the warmup is not part of it.
  int64_t decay_steps = 0;
  // WSD only: the cooldown's length (0: a fifth of the decay window) and shape.
  int64_t wsd_decay_steps = 0;
  CooldownShape wsd_decay_style = CooldownShape::Linear;
  std::optional<RampupConfig> rampup;
};

struct TrainConfig {
  int64_t steps = 0;
  int64_t global_batch = 0;  // samples per optimizer step (after ramp-up)
  int64_t micro_batch = 0;   // samples per forward/backward on one rank
  int64_t seq_len = 0;
  uint64_t seed = 1234;
  int64_t eval_interval = 0;  // 0: validate only at the end (if a validation set is given)
  int64_t eval_batches = 8;   // micro-batches per validation
  // Also validate (and run choice_eval) before the first step this run trains: the loaded
  // model's numbers, e.g. a finetune's starting loss next to the pretrained model's.
  bool eval_at_start = false;
  // The weights a fresh run starts from (the config twin of --init-from, which overrides it): a
  // keel checkpoint or hf:DIR. A resume ignores it. A relative path in a config file is read from
  // that file's folder (keel convert writes "." beside the weights, so the folder may move); one
  // given by --set, like the flag, from the current directory.
  std::string init_from;
  // Activation recomputation (model/transformer.h): "none"; "selective": every layer drops its
  // norm outputs and MLP activation and rebuilds them in backward; or "full": a layer keeps
  // only its input and runs its forward again in backward. recompute_layers: with "full", how
  // many layers of each pipeline stage, from its first (Megatron's block method); 0: all of them.
  std::string recompute = "none";
  int64_t recompute_layers = 0;
  // Token rows of the head's logits computed at once (model/transformer.h, chunked head):
  // 0 (auto): all of them while the [tokens, vocab/tp] logits fit in 1 GiB, else chunks
  // within 1 GiB; micro_batch * seq_len or more: never chunk.
  int64_t logits_chunk_rows = 0;
  bool selective_recompute() const { return recompute == "selective"; }
  // Layers of a stage to recompute, for the Transformer: 0 for none, INT32_MAX for all.
  int recomputed_layers_per_stage() const {
    if (recompute != "full") return 0;
    return recompute_layers > 0 ? static_cast<int>(recompute_layers) : std::numeric_limits<int>::max();
  }
};

struct DataConfig {
  std::vector<std::string> train;  // files or glob patterns
  // Empty: every train file is one source. Else one weight per entry of `train`, each entry (a
  // file or a glob) a source of its own, read in those proportions (data/sampler.h: Blend).
  std::vector<double> train_weights;
  std::vector<std::string> val;
  // Named validation sets besides `val` (Megatron's multiple validation sets), each validated
  // like `val` and reported under its name: a blend's sources one by one, for instance.
  std::vector<std::pair<std::string, std::vector<std::string>>> val_sets;
  bool shuffle = true;
  // Packed documents attend only within themselves, and positions restart at each document
  // (Megatron's reset_attention_mask + reset_position_ids; kernels/document_positions.h).
  bool document_masking = false;
  // Megatron's --eod-mask-loss: the prediction made at an end-of-document token (the next
  // document's first token, from the one before) is left out of the loss.
  bool eod_mask_loss = false;
  // The token that ends a document. -1: the "eot_id" that prepare_data.py records in meta.json
  // beside the shards (with_eod_token in run.cpp, when an option above needs it).
  int64_t eod_token = -1;
  bool validates() const { return !val.empty() || !val_sets.empty(); }
  bool needs_eod() const { return document_masking || eod_mask_loss; }
  // The token that ends a document when document masking is on, else -1 (no masking).
  int64_t masking_eod() const { return document_masking ? eod_token : -1; }
  // The token whose predictions leave the loss (eod_mask_loss), else -1.
  int64_t loss_mask_eod() const { return eod_mask_loss ? eod_token : -1; }
};

// Text generated during training, as llm.c does: every `interval` steps the lead rank samples
// a continuation of `prompt` from its working weights (model/generator.h). The whole model must
// be on each rank (tp = pp = 1); keel sample covers a checkpoint of any layout.
struct SampleConfig {
  int64_t interval = 0;      // steps between samples (and at the end); 0: off
  std::string prompt;        // encoded with special tokens (a BOS); empty: the end-of-text token
  int64_t tokens = 64;       // new tokens per sample
  double temperature = 0.8;  // 0: greedy
  double top_p = 0.95;
  int64_t top_k = 0;
  int64_t seed = 0;          // the same random stream every time, so samples differ by the model only
  std::string tokenizer;     // tokenizer.json (or its directory); empty: beside data.train
};

// Multiple-choice accuracy during training (train/choice_eval.h: HellaSwag-style items scored
// by the training forward, under any layout).
struct ChoiceEvalConfig {
  std::string file;        // JSONL items (keel eval's format); empty: off
  int64_t interval = 0;    // steps between evaluations; 0: train.eval_interval (and at the end,
                           // and with train.eval_at_start before the first step)
  int64_t items = 0;       // the first N items; 0: all
  std::string tokenizer;   // tokenizer.json (or its directory) for text items; empty: beside data.train
  bool write_scores = false;  // <out>/choice_scores/step_<N>.jsonl: each item's log-likelihoods and picks
};

struct LogConfig {
  int64_t interval = 1;  // steps between log lines
  // Phase and communication timers (train/step_timers.h): a step is timed when at least
  // timers_interval_s seconds have passed since the last timed one (and the second step of
  // every run), and one line shows the spread over ranks. 0: every step is timed.
  bool timers = true;
  double timers_interval_s = 60;
  // Also write every metrics record as TensorBoard scalars to OUT/tensorboard (train/tensorboard.h).
  bool tensorboard = false;
};

struct CheckpointConfig {
  int64_t interval = 0;  // steps between saves (0: only at the end / on signal)
  int64_t keep_last = 3;
  int64_t keep_every = 0;  // additionally keep every K-th step's checkpoint (0: none)
  bool save_at_end = true;
  // Interval saves are written by a background thread from a host copy of the state, and
  // published at a later step boundary once every rank's files are on disk (Megatron's
  // --async-save). Costs host memory the size of the rank's part of the checkpoint.
  bool async = false;
  std::string dir;         // default <out>/checkpoints
};

// Training health checks (see ../shared/seeds: bugs that stayed silent for days).
struct HealthConfig {
  // Every N steps (and after a load), compare checksums of the tied embedding copies and of
  // the tensors replicated over TP ranks; a mismatch stops the run naming tensor and ranks.
  int64_t replica_check_interval = 100;
  // Optimizer groups: a norm or bias with weight decay, or a matrix without, is an "error"
  // (the run does not start) or a "warn"ing.
  std::string param_group_audit = "error";
  // CPU backend: a run that needs more host memory than this host (or its cgroup: a container,
  // a Slurm job) has available is refused before anything is allocated ("error"), or only
  // warned about ("warn": swap, or an estimate that is too high for it).
  std::string host_memory_check = "error";
  // Frozen parameters: every frozen_check_interval steps, sampled elements of each tensor
  // (its fp32 master, or the stored weights without one) are compared with the previous check;
  // a tensor whose elements with non-zero gradients did not move (at least frozen_fraction of
  // them) at frozen_window checks in a row is reported. 0 disables.
  int64_t frozen_check_interval = 10;
  int64_t frozen_window = 5;
  double frozen_fraction = 0.5;
  // Per-layer max |activation| and max |activation gradient| in the metrics every N steps.
  int64_t stats_interval = 10;
  // Re-run a non-finite step with per-op checks and name the first op that overflowed.
  bool localize_nonfinite = true;
  // Loss / grad-norm spikes: z-score against running statistics (armed after spike_warmup
  // steps); action "warn", "skip" (no update) or "rewind" (reload the last checkpoint and
  // skip the data since). A loss spike also needs a relative jump of spike_min_jump, a
  // grad-norm spike a norm of at least spike_norm_ratio times its running mean (healthy runs
  // see grad norms wander by 1.5x).
  double spike_zscore = 6.0;
  int64_t spike_warmup = 50;
  double spike_min_jump = 0.1;
  double spike_norm_ratio = 3.0;
  std::string spike_action = "warn";
  // Stragglers: on timed steps (log.timers), a rank whose compute takes at least this many
  // times that of a typical rank of its pipeline stage, at two timed steps in a row, is named
  // with its host. 0 disables.
  double straggler_ratio = 1.25;
  // After a load: recompute the probe-batch loss and per-tensor norms saved with the
  // checkpoint, and check that the fp32 masters round to the stored weights.
  bool verify_restart = true;
};

struct ParallelConfig {
  int64_t tp = 1, pp = 1, dp = 1;
  // Give the embedding and the head a pipeline slot each, like a transformer layer (balances
  // a large vocabulary: the first and last stage get fewer layers).
  bool embedding_slot = false;
  // Layers per (virtual) stage in model order (pp * virtual_stages counts that sum to n_layers),
  // for an uneven split such as Megatron's lighter first and last stages; only the first and last
  // stage may hold none. Empty: the even split (or embedding_slot's).
  std::vector<int> pipeline_layers;
  PipelineSplit pipeline_split() const { return {embedding_slot, pipeline_layers}; }
  // Megatron's sequence parallelism with TP (model/transformer.h): the residual stream, norms
  // and stage outputs are split by token rows over the TP ranks.
  bool sequence_parallel = false;
  // Model chunks per pipeline rank: the interleaved 1F1B schedule (train/pipeline_schedule.h)
  // with pp * virtual_stages virtual stages, rank s holding stages s, s + pp, ... A bubble 1 /
  // virtual_stages as long, for virtual_stages times the point-to-point messages. 1: plain 1F1B.
  int64_t virtual_stages = 1;
  // Reduce the DP gradients in buckets while the step's last backward runs (Megatron's
  // --overlap-grad-reduce; train/parallel/grad_buckets.h), each bucket once it holds
  // grad_bucket_size elements (0: Megatron's max(40M, 1M * dp)). Same shards, same sums.
  bool overlap_grad_reduce = false;
  int64_t grad_bucket_size = 0;
  // Gather the updated weights over DP in buckets of grad_bucket_size elements as the next
  // step's forward reaches them, instead of in one all_gather after the optimizer (Megatron's
  // --overlap-param-gather; train/parallel/param_gather.h). The same weights, bit for bit.
  bool overlap_param_gather = false;
  int64_t world() const { return tp * pp * dp; }
};

// Whether a task run every `interval` steps (0: never) and after the last step runs at `step`.
inline bool due_every(int64_t step, int64_t interval, int64_t last_step) {
  return (interval > 0 && step % interval == 0) || step == last_step;
}

struct RunConfig {
  std::string source;  // where it came from (file path), for messages
  std::string name;    // config file stem
  ModelConfig model;
  PrecisionConfig precision;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainConfig train;
  DataConfig data;
  ChoiceEvalConfig choice_eval;
  SampleConfig sample;
  LogConfig log;
  CheckpointConfig checkpoint;
  ParallelConfig parallel;
  HealthConfig health;
  std::string device = "auto";  // auto | cpu | cuda
  std::string out;              // run directory: logs, metrics, checkpoints
  std::string description;

  // Whether the model takes document positions: data.document_masking's packed documents, and
  // choice_eval's packed endings (train/choice_eval.h).
  bool takes_document_positions() const { return data.document_masking || !choice_eval.file.empty(); }
  int64_t grad_accum_steps(int64_t global_batch) const {
    return global_batch / (train.micro_batch * parallel.dp);
  }
  // The micro-batches per DP rank a training step can have, with micro-batches of `micro_batch`
  // over `dp` ranks: the whole global batch's, first, then each batch size of the ramp-up's.
  std::vector<int> step_micro_batch_counts(int64_t micro_batch, int64_t dp) const;
};

// Read a config file, apply "key.path=value" overrides (value parsed as JSON when it parses,
// else taken as a string), validate. Throws ConfigError listing every problem.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Levenshtein distance, for "did you mean" hints (unknown config fields, subcommands).
size_t edit_distance(const std::string& a, const std::string& b);
// Validate an already-parsed JSON document.
RunConfig parse_config(const nlohmann::json& doc, const std::string& source);
// The run's paths (out, checkpoint.dir, the data files and patterns, the tokenizers and the
// choice file) with relative ones resolved against the current directory, so that what a run
// records (config.json, meta.json) still finds them from another directory: a resume, keel
// sample or keel eval looking for the tokenizer beside the data. Empty ones (off) stay empty.
void resolve_paths(RunConfig& cfg);
// Apply one "a.b.c=value" override to a JSON document.
void apply_override(nlohmann::json& doc, const std::string& assignment);
// The fully resolved config (defaults filled in) as JSON: what the run really used.
nlohmann::json to_json(const RunConfig& cfg);
// Every field (leaf) whose value differs between two config documents or sections, with its
// dotted path under `prefix` ("optimizer" + "lr" -> "optimizer.lr") and both values as JSON text
// ("-" where one side lacks it), in path order.
struct FieldChange {
  std::string field, a, b;
};
std::vector<FieldChange> field_changes(const nlohmann::json& a, const nlohmann::json& b, const std::string& prefix = "");
// The model options beyond the family's defaults (position_embedding "alibi", embedding_norm,
// qkv_bias, qk_norm, head_dim, sliding_window) added to a "model" object, each only when set,
// so configs and checkpoints from before an option still compare equal.
void add_model_options(nlohmann::json& model, const ModelConfig& m);
// model.rope_scaling as keel's config writes it (null for none). HF names the type field
// "rope_type" and otherwise uses the same names: type_key chooses.
nlohmann::json rope_scaling_json(const RopeScaling& s, const char* type_key = "type");

}  // namespace keel
