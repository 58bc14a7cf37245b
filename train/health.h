// Training health: the checks that would have caught the bugs in ../shared/seeds/ while the
// runs were young, each naming what is wrong, where, and what to do.
//
//   audit_param_groups   a norm or bias in the weight-decay group, a matrix outside it (seed 001)
//   FrozenDetector       tensors whose values stop moving although their gradients do not
//                        vanish, with the precision explanation (seed 002)
//   SpikeDetector        loss / grad-norm spikes by running z-score
// Non-finite localisation, per-layer statistics, replica checks and restart verification
// live in the Trainer (they need the model and the communicators).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "model/param_table.h"
#include "train/config.h"

namespace keel {

class ParamState;

// ---- optimizer groups ----
// The start-up table of weight-decay groups (by role: tensors, parameters, example names).
std::string param_group_table(const ParamTable& table, double weight_decay);
// Problems: a tensor whose name says norm or bias but that decays, a 2-D weight that does not,
// a role that contradicts the name. Empty when sound.
std::vector<std::string> audit_param_groups(const std::vector<ParamSpec>& params);

// ---- frozen parameters ----
// Every check compares a fixed sample of each tensor's elements (up to 64 contiguous ones
// inside this rank's optimizer shard) with the previous check. Elements whose gradient is
// non-zero but whose value did not change are "stuck"; a tensor with at least `fraction` of its
// sampled, gradient-carrying elements stuck at `window` checks in a row is frozen.
class FrozenDetector {
 public:
  FrozenDetector(const ParamTable& table, const ParamState& state, const HealthConfig& cfg);
  ~FrozenDetector();
  FrozenDetector(const FrozenDetector&) = delete;
  FrozenDetector& operator=(const FrozenDetector&) = delete;
  // Reads the samples (masters when the state has them, else the working weights) and the
  // gradients of the last step. Returns, per local tensor index in the table, whether it is
  // frozen (reported once) and its typical |value|; call after an applied update.
  struct Result {
    std::vector<std::pair<std::string, float>> newly_frozen;  // name, typical |value|
  };
  Result check(const ParamState& state, Backend& be);

 private:
  struct Track {
    std::string name;
    int64_t begin = 0, n = 0;  // the sample: flat elements [begin, begin + n)
    int64_t staged_at = 0;     // where its values sit in staging_ (its gradients: + samples_)
    std::vector<float> prev;
    int64_t frozen_checks = 0;
    bool reported = false, primed = false;
  };
  std::vector<Track> tracks_;
  HealthConfig cfg_;
  // The samples' values and then their gradients, gathered as F32 on the state's device and
  // read back in one copy: one host sync per check, not two per tensor (hundreds on a GPU).
  Backend* staging_backend_ = nullptr;
  Tensor staging_;
  int64_t samples_ = 0;
};

// The explanation of a frozen tensor: the typical update (Adam moves by about lr per step)
// against the smallest change the storage format can hold at the tensor's magnitude.
std::string explain_frozen(const std::string& name, float typical_abs, double lr, DType stored, bool has_master);

// ---- spikes ----
// A step is judged against running statistics of the steps before it that were not spikes: a
// flagged step stays out of them (as keel doctor's scan keeps it out), so a spike, and the steps
// after a rewind, are judged against the level before it. A loss that stays flagged for
// kLevelShiftSteps steps in a row is a new level rather than a spike (other data, a changed lr):
// the statistics then start again from that step and re-arm after health.spike_warmup steps. The
// state is saved with every checkpoint (to_json) and restored on resume, so the check is armed
// from the first step after a restart (seed 001's restart spike) and a resume makes the same
// skip decisions as the run that did not stop.
class SpikeDetector {
 public:
  static constexpr int64_t kLevelShiftSteps = 10;
  explicit SpikeDetector(const HealthConfig& cfg) : cfg_(cfg) {}
  struct Verdict {
    bool loss_spike = false, norm_spike = false;
    double loss_z = 0, norm_z = 0;
    bool level_shift = false;  // the kLevelShiftSteps-th flagged step in a row: statistics restarted
    bool any() const { return loss_spike || norm_spike; }
  };
  // Judge a step's (finite) loss and grad norm against the running statistics, then fold them
  // in unless they were flagged.
  Verdict observe(double loss, double grad_norm);
  std::string describe(const Verdict& v, double loss, double grad_norm) const;
  // The statistics, exactly (doubles round-trip through JSON), and back. restore with
  // keep_streak (a rewind) keeps the count of flagged steps in a row: it counts the data seen,
  // which a rewind does not take back, so that data that stays bad cannot rewind forever.
  nlohmann::json to_json() const;
  void restore(const nlohmann::json& j, bool keep_streak);

 private:
  struct Running {
    double mean = 0, var = 0;
    int64_t n = 0;
    double z(double x) const;
    void add(double x);
  };
  HealthConfig cfg_;
  Running loss_, norm_;
  int64_t streak_ = 0;  // flagged steps in a row
};

}  // namespace keel
