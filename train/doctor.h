// keel doctor: offline checks on a run's artefacts, for the investigations the seeds did by hand.
//
//   compare_frozen(A, B)    which tensors did not move between two checkpoints, and whether it
//                           is precision (seed 002: bf16 norms frozen for 754 steps)
//   audit_checkpoint(C)     optimizer state, Adam step, masters vs working weights (seed 000: masters
//                           left at a fresh init), weight-decay groups by role (seed 001: a misfiled norm)
//   summarize_metrics(F)    a metrics.jsonl's health: loss / grad-norm spikes, skipped and nan
//                           steps, fp16 loss-scale history, resumes and rewinds, validation trend
//                           (after a resume at S or a rewind to S, the earlier records of steps
//                           past S are the abandoned trajectory's and do not count)
//   (hang dumps: train/parallel/hang_report.h, keel doctor hang)
//
// Each returns the text `keel doctor` prints and the problems found, one line each naming the
// tensor (or step) and what to do; a healthy artefact has none.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "model/param_table.h"
#include "train/checkpoint.h"

namespace keel::doctor {

struct Report {
  std::string text;                   // what the command prints
  std::vector<std::string> problems;  // also in text
};

// ---- frozen tensors ------------------------------------------------------------------------

struct FrozenOptions {
  double threshold = 0.99;  // a tensor with at least this fraction of unchanged elements is frozen
  int max_moving = 20;      // moving tensors listed (the least-moving first: most elements unchanged,
                            // then the smallest mean change relative to mean |A|)
};

struct TensorMotion {
  std::string name;
  std::string state;        // compared state: "master" when both have it, else "weight"
  std::string dtype;        // its stored dtype (in B)
  int64_t numel = 0;
  double unchanged = 0;     // fraction of elements bitwise unchanged
  double max_change = 0;    // max |B - A|
  double mean_change = 0;   // mean |B - A|
  double typical = 0;       // mean |A|: the tensor's typical magnitude
  bool frozen = false;
  bool precision = false;   // frozen, and the update is below the storage format's resolution
  std::string hint;         // why it is frozen and what to do (frozen tensors only)
};

struct FrozenReport : Report {
  std::vector<TensorMotion> tensors;  // frozen first, then the others, each least-moving first
  int frozen = 0;
};

FrozenReport compare_frozen(const Checkpoint& a, const Checkpoint& b, const FrozenOptions& opt = {});

// ---- checkpoint audit ------------------------------------------------------------------------

struct CkptReport : Report {
  std::vector<std::string> master_mismatch;  // tensors whose master does not round to the weight
  std::vector<std::string> zero_moments;     // tensors whose Adam moments are all zero
  std::vector<std::string> nonfinite;        // "state/tensor"
};

CkptReport audit_checkpoint(const Checkpoint& ck);

// Weight decay by role: a norm or bias (or any 1-D tensor) with decay, or a matrix or embedding
// without it. One line per misfiled tensor. (The table derives decay from the role, so this
// guards the table itself, and any code that builds groups another way.)
std::vector<std::string> decay_group_problems(const std::vector<ParamSpec>& params);

// ---- metrics --------------------------------------------------------------------------------

struct MetricsOptions {
  int window = 50;       // running statistics over the last `window` good steps
  int min_history = 10;  // steps needed before a spike can be called
  double z = 4.0;        // a value this many standard deviations above the running mean is a spike
};

struct Spike {
  int64_t step = 0;
  double value = 0, mean = 0, z = 0;
};

struct ScaleChange {
  int64_t step = 0;
  double from = 0, to = 0;
};

struct MetricsReport : Report {
  int64_t steps = 0;                    // steps of the trajectory the run went on with
  std::vector<Spike> loss_spikes, grad_norm_spikes;
  std::vector<int64_t> skipped_steps, nan_steps;
  std::vector<ScaleChange> scale_changes;
  double min_scale = 0;                 // 0 when no record has a loss scale
  std::vector<int64_t> resumes;         // steps the run resumed at
  std::vector<std::pair<int64_t, int64_t>> rewinds;  // (the spike's step, the step it went back to)
  int64_t timed_steps = 0;              // timers records (log.timers)
  std::map<int, int64_t> stragglers;    // world rank -> timed steps at which it was named slow
  std::vector<int> pipeline_layers;     // the split the run's measured pipeline balance suggested
};

// Reads one metrics.jsonl. Throws std::runtime_error when the file cannot be read.
MetricsReport summarize_metrics(const std::string& path, const MetricsOptions& opt = {});

}  // namespace keel::doctor
