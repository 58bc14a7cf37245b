// Where a rank's step time goes, and which rank holds the job up (in the spirit of Megatron's
// timers and straggler detector).
//
// On a timed step the trainer brackets its phases (forward-backward, gradient reduction, norm,
// optimizer, parameter gather) with device drains, and every communicator call of a group of
// more than one rank runs through a TimedComm that drains before and after the call. The host's
// wall clock then measures what the device did, on the CPU and on a GPU alike, and each
// phase's time splits into communication (per group) and the rest. The rest of forward-backward
// is the rank's own work, "compute": a slow GPU or a busy node shows there, while the ranks
// that wait for it show the wait in their communication. Untimed steps pay one branch per
// call. The run loop times a step about once a minute (log.timers_interval_s) and reports the
// spread over ranks (summarize_timers).
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/profile_range.h"
#include "train/parallel/comm.h"
#include "train/parallel/grid.h"

namespace keel {

class StepTimers {
 public:
  enum Phase : int { Data, ForwardBackward, GradReduce, GradNorm, Optimizer, ParamGather, kPhases };
  static constexpr int kGroups = 5;  // parallel::kAllGroups

  // drain: waits for the device's queued work (Backend::synchronize).
  explicit StepTimers(std::function<void()> drain) : drain_(std::move(drain)) {}

  // Clears the counters; a timed step measures, an untimed one does not.
  void start_step(bool timed);
  bool timed() const { return timed_; }

  // Times a phase from construction to destruction (nothing when the step is not timed).
  class Scope {
   public:
    Scope(StepTimers& t, Phase p);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ProfileRange range_;  // on the profiler's timeline, timed step or not
    StepTimers* t_;
    Phase p_;
    std::chrono::steady_clock::time_point start_;
  };
  Scope phase(Phase p) { return Scope(*this, p); }

  // A communicator call of `seconds` on a group (TimedComm), booked to the current phase too.
  void add_comm(parallel::GroupKind g, double seconds);

  // This rank's sample of the step, in milliseconds, in the order of columns(): step (the run
  // loop's wall time), the phases, compute (forward-backward without its communication), and
  // the communication per group.
  std::vector<double> sample(double step_ms) const;
  static const std::vector<std::string>& columns();
  static const char* phase_name(Phase p);

 private:
  std::function<void()> drain_;
  bool timed_ = false;
  int current_ = -1;  // the phase being timed, -1 outside phases
  std::array<double, kPhases> phase_s_{};
  std::array<double, kPhases> phase_comm_s_{};  // communication inside each phase
  std::array<double, kGroups> group_s_{};
};

// A communicator that books the time of each call to a StepTimers while its step is timed
// (waiting for the device before and after the call), and otherwise just forwards.
class TimedComm final : public parallel::Comm {
 public:
  TimedComm(parallel::Comm& inner, parallel::GroupKind group, StepTimers& timers)
      : inner_(inner), group_(group), timers_(timers) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view name() const override { return inner_.name(); }
  Device device() const override { return inner_.device(); }

  void all_reduce(const Tensor& t, parallel::ReduceOp op = parallel::ReduceOp::Sum) override;
  void reduce_scatter(const Tensor& out, const Tensor& in) override;
  void reduce(const Tensor& t, int root) override;
  void all_gather(const Tensor& out, const Tensor& in) override;
  void broadcast(const Tensor& t, int root) override;
  void send(const Tensor& t, int peer) override;
  void recv(const Tensor& t, int peer) override;
  void sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) override;
  void barrier() override;
  void wait_idle() override { inner_.wait_idle(); }
  // On a timed step they are timed like blocking ones (they then overlap nothing); otherwise
  // they are handed on asynchronously.
  void reduce_async(const Tensor& t, int root) override;
  void broadcast_async(const Tensor& t, int root) override;
  void join_async() override { inner_.join_async(); }

 private:
  enum Op : int { AllReduce, ReduceScatter, Reduce, AllGather, Broadcast, Send, Recv, SendRecv, Barrier, kOps };
  template <class F>
  void timed(Op op, F&& call);
  parallel::Comm& inner_;
  parallel::GroupKind group_;
  StepTimers& timers_;
};

// TimedComms over every group of `comms` (a group of one rank is never timed: it does not
// communicate).
parallel::CommGroups timed_comms(const parallel::CommGroups& comms, StepTimers& timers);

// One rank's sample as the lead rank sees it.
struct RankTimes {
  int world_rank = 0;
  int tp = 0, pp = 0, dp = 0;
  std::string host;
  std::vector<double> ms;  // StepTimers::columns() order
};

// A rank whose compute stands out among the ranks of its pipeline stage (which all do the same
// work: TP shards and DP replicas of the same layers).
struct Straggler {
  int world_rank = 0;
  double compute_ms = 0, median_ms = 0;  // the stage's lower median (its peers' typical time)
  int peers = 0;                          // ranks of the stage, this one included
  std::string text;                       // who, where, how much slower
};

struct TimersSummary {
  std::string line;       // "timers at step N (ms, min-max over R ranks): step ... | compute ... | ..."
  nlohmann::json record;  // for metrics.jsonl: per column min, max and the slowest rank
  std::vector<Straggler> stragglers;
};

// The spread of every column over the ranks, and the ranks whose compute is at least `ratio`
// times (and 1 ms above) the lower median of their pipeline stage (0: no straggler check).
// Stages of one rank have no peers to compare with.
TimersSummary summarize_timers(const std::vector<RankTimes>& ranks, int64_t step, double ratio);

// The layers per stage (parallel.pipeline_layers) that would even the pipeline stages' measured
// compute, with at least 3 stages. stage_layers lists every virtual stage's layers in model order:
// with chunks > 1 (interleaved 1F1B) a stage is a pipeline rank holding `chunks` of them, and the
// split spreads its layers over them. A stage's compute is the median of its ranks';
// a layer's is the median over the middle stages of compute / layers, and the rest of a stage's
// compute (the embedding, the head) stays with it (balanced_pipeline_layers spreads the layers).
// Given when that split differs from `stage_layers` and would cut the slowest stage's compute by
// at least 10% (less is within a timed step's noise). max_layers (empty: no bound) caps each
// stage's layers at what its memory holds (plan::pipeline_layer_caps on a GPU).
struct PipelineBalance {
  std::vector<int> layers;
  std::vector<double> stage_ms;  // measured compute per stage
  double slowest_after_ms = 0;   // the slowest stage's compute under `layers`, by the same fit
  std::string text;              // for the log: the measurement and the split
};
std::optional<PipelineBalance> pipeline_balance(const std::vector<RankTimes>& ranks, const std::vector<int>& stage_layers,
                                                const std::vector<int>& max_layers = {}, int chunks = 1);

}  // namespace keel
