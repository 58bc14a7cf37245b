// `keel train`: a whole run from a validated config. Everything that can be checked (config,
// data files, model shape) is checked before anything is written to the run directory.
#pragma once

#include <string>

#include "train/config.h"

namespace keel {

// Process exit codes, distinct so launch scripts can tell what happened.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // training failed (non-finite loss with no way out, I/O error, ...)
  kExitConfigError = 2,  // bad config or command line
  kExitDataError = 3,    // missing, corrupt or mismatching data files
};

struct RunOptions {
  bool quiet = false;  // no per-step lines on stdout (metrics are still written)
};

int run_training(const RunConfig& cfg, const RunOptions& opts = {});

}  // namespace keel
