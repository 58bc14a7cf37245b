// `keel train`: run or resume a training run from a JSON config.
#include <omp.h>

#include <iostream>

#include "train/commands.h"
#include "train/config.h"
#include "train/run.h"

namespace keel {

namespace {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  int64_t steps = 0;
  std::string out;
  int64_t seed = -1;
  std::string device;
  int threads = 0;
  bool print_config = false;
  bool quiet = false;
};

int cmd_train(const TrainArgs& a) {
  std::vector<std::string> overrides = a.sets;
  // Flags are shorthands for --set and win over it.
  if (a.steps > 0) overrides.push_back("train.steps=" + std::to_string(a.steps));
  if (!a.out.empty()) overrides.push_back("out=" + nlohmann::json(a.out).dump());
  if (a.seed >= 0) overrides.push_back("train.seed=" + std::to_string(a.seed));
  if (!a.device.empty()) overrides.push_back("device=" + nlohmann::json(a.device).dump());
  RunConfig cfg = load_config(a.config, overrides);
  if (a.print_config) {
    std::cout << to_json(cfg).dump(2) << '\n';
    return kExitOk;
  }
  if (a.threads > 0) omp_set_num_threads(a.threads);
  RunOptions opts;
  opts.quiet = a.quiet;
  return run_training(cfg, opts);
}

}  // namespace


Command add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  TrainArgs& ta = *args;
  CLI::App* train = app.add_subcommand("train", "Train a model from a JSON run config");
  train->add_option("-c,--config", ta.config, "JSON run config (see configs/)")->required()->check(CLI::ExistingFile);
  train->add_option("--set", ta.sets,
                    "Override any config field: --set optimizer.lr=3e-4 --set precision.mode=fp32 (repeatable; "
                    "values are JSON, bare words are strings)")
      ->type_name("KEY=VALUE")
      ->take_all();
  train->add_option("--steps", ta.steps, "Number of optimizer steps (train.steps)")->check(CLI::PositiveNumber);
  train->add_option("--out", ta.out, "Run directory for logs, metrics and checkpoints (default out/<config name>)");
  train->add_option("--seed", ta.seed, "Seed for initialisation and data order (train.seed)")->check(CLI::NonNegativeNumber);
  train->add_option("--device", ta.device, "auto, cpu or cuda (device)");
  train->add_option("--threads", ta.threads, "CPU threads (default: OMP_NUM_THREADS or all cores)")
      ->check(CLI::PositiveNumber);
  train->add_flag("--print-config", ta.print_config, "Validate the config, print it fully resolved, and exit");
  train->add_flag("-q,--quiet", ta.quiet, "No per-step log lines (metrics.jsonl is still written)");
  train->footer(
      "The log line per step follows Megatron-LM: iteration, consumed samples/tokens, ms per\n"
      "iteration, learning rate, global batch size, lm loss, loss scale, grad norm, num zeros,\n"
      "skipped and nan iterations, tokens per second and model TFLOP/s. The same numbers go to\n"
      "<out>/metrics.jsonl (plot with scripts/plot_metrics.py).\n"
      "Exit codes: 0 done, 1 training failed, 2 bad config or arguments, 3 bad data.");
  return {train, [args] { return cmd_train(*args); }};
}

}  // namespace keel
