// `keel train`: a whole run from a validated config. Everything that can be checked (config,
// data files, model shape) is checked before anything is written to the run directory.
#pragma once

#include <string>
#include <vector>

#include "train/config.h"

namespace keel {

// Process exit codes, distinct so launch scripts can tell what happened.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // training failed (non-finite loss with no way out, I/O error, ...)
  kExitConfigError = 2,  // bad config or command line
  kExitDataError = 3,    // missing, corrupt or mismatching data files
  kExitStopped = 4,      // stopped before the end (signal, --stop-at, --time-limit) after saving: run again to resume
  kExitCheckpointError = 5,  // a checkpoint could not be read or written (nothing was lost)
  kExitDiverged = 6,     // training cannot continue (fp16 loss scale exhausted); the last good state was saved
};

namespace parallel {
class MpiRuntime;
}

struct RunOptions {
  const parallel::MpiRuntime* mpi = nullptr;  // set when launched by mpirun/srun
  bool quiet = false;       // no per-step lines on stdout (metrics are still written)
  std::string resume;       // checkpoint to resume (default: the latest in checkpoint.dir, if any)
  std::string init_from;    // weights-only initialisation for a fresh run (finetuning)
  int64_t stop_at = 0;      // save and stop after this iteration (0: run to train.steps)
  double time_limit_s = 0;  // save and stop before this much wall time since the process started has passed (0: none)
  // Evaluate the model the run would start from (validation sets, choice_eval, sample) under
  // the config's layout, print the numbers, and stop: nothing is trained or written (Megatron's
  // --skip-train). The model-parallel way to evaluate a model too large for keel eval.
  bool eval_only = false;
};

int run_training(const RunConfig& cfg, const RunOptions& opts = {});
// keel train's SIGTERM / SIGUSR1 / SIGINT handlers, from the process's start (before MPI and the
// config checks across ranks): a signal then stops the run at its first step boundary with a
// save and exit 4, as one during the rest of start-up does. run_training installs them itself
// when this was not called. Only the launcher's rank 0 (by its environment) announces it.
void install_stop_handlers();

// The config's settings that change nothing in this run (sequence_parallel at tp 1, ...) and the
// schedules the run ends inside of (a warmup longer than train.steps, ...), each with what the
// run does instead: printed at start-up and by --print-config.
std::vector<std::string> config_notes(const RunConfig& cfg);

// --time-limit: whether a run `elapsed_s` into its process (start-up included) must stop now to
// save before `limit_s`. The room kept is the next step (`step_s`, with the evaluations due at it)
// and a save: the longest this run has made (`save_s`, 0 before its first), at least a step's time.
bool time_limit_near(double elapsed_s, double step_s, double save_s, double limit_s);

// What comes after a save, for the free-space warning.
enum class AfterSave {
  Training,  // the run goes on: its next save
  Stop,      // the run stops (signal, --stop-at, --time-limit): a resumed run's next save
  End,       // the run's last step: no next save
  Resumed,   // no save yet: a resume's start-up, warned of its first save (the disk may have filled since)
};

// After a save of `save_bytes` into `dir`, which has `free_bytes` left: a warning when the next
// save, about as large, will not fit (rotation frees space only once a new save is complete);
// empty when it fits, or when no save follows. With AfterSave::Resumed, `save_bytes` is the size
// of the checkpoint resumed from.
std::string low_space_warning(const std::string& dir, int64_t save_bytes, int64_t free_bytes,
                              AfterSave after = AfterSave::Training);

// The process's MPI runtime (created first thing in main), for the subcommands that need it.
void set_process_runtime(const parallel::MpiRuntime* runtime);
const parallel::MpiRuntime* process_runtime();

}  // namespace keel
