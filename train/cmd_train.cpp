// `keel train`: run or resume a training run from a JSON config.
#include <omp.h>

#include <iostream>
#include <map>
#include <optional>

#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/parallel/mpi_comm.h"
#include "train/run.h"

namespace keel {

namespace {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  int64_t steps = 0;
  std::optional<std::string> out;  // given: even empty, which the config check refuses
  int64_t seed = -1;
  std::string device;
  int threads = 0;
  bool print_config = false;
  bool quiet = false;
  std::string resume;
  std::string init_from;
  int64_t stop_at = 0;
  double time_limit_min = 0;
  bool eval_only = false;
};

int cmd_train(const TrainArgs& a) {
  std::vector<std::string> overrides = a.sets;
  // Flags are shorthands for --set and win over it.
  if (a.steps > 0) overrides.push_back("train.steps=" + std::to_string(a.steps));
  if (a.out) overrides.push_back("out=" + nlohmann::json(*a.out).dump());
  if (a.seed >= 0) overrides.push_back("train.seed=" + std::to_string(a.seed));
  if (!a.device.empty()) overrides.push_back("device=" + nlohmann::json(a.device).dump());
  // A key set twice on the command line takes its last value (scripts append overrides on
  // purpose), but say which: "--steps 50 --set train.steps=70" trained 50 steps without a word.
  const bool lead = !process_runtime() || process_runtime()->world_rank() == 0;
  std::map<std::string, std::string> given;  // key -> its last value, as given
  for (size_t i = 0; i < overrides.size(); ++i) {
    const size_t eq = overrides[i].find('=');
    if (eq == std::string::npos) continue;  // load_config names the malformed one
    const std::string key = overrides[i].substr(0, eq), value = overrides[i].substr(eq + 1);
    const auto was = given.find(key);
    if (was != given.end() && was->second != value && lead)
      std::cerr << "keel: note: " << key << " is set twice on the command line (" << was->second << ", then "
                << value << (i >= a.sets.size() ? ", by its flag" : "") << "): the last one, " << value << ", counts\n";
    given[key] = value;
  }
  RunConfig cfg = load_config(a.config, overrides);
  if (a.print_config) {
    std::cout << to_json(cfg).dump(2) << '\n';
    for (const std::string& n : config_notes(cfg)) std::cerr << "keel: note: " << n << '\n';  // stdout stays JSON
    return kExitOk;
  }
  resolve_paths(cfg);  // recorded as used: a resume from another directory finds them
  if (a.threads > 0) omp_set_num_threads(a.threads);
  RunOptions opts;
  opts.mpi = process_runtime();
  opts.quiet = a.quiet;
  opts.resume = a.resume;
  opts.init_from = a.init_from;
  opts.stop_at = a.stop_at;
  opts.time_limit_s = a.time_limit_min * 60;
  opts.eval_only = a.eval_only;
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
  train->add_option("--steps", ta.steps, "Number of optimizer steps (train.steps)")->check(cli::integer<int64_t>(1));
  train->add_option("--out", ta.out, "Run directory for logs, metrics and checkpoints (default out/<config name>)");
  train->add_option("--seed", ta.seed, "Seed for initialisation and data order (train.seed)")
      ->check(cli::integer<int64_t>(0));
  train->add_option("--device", ta.device, "auto, cpu or cuda (device)");
  train->add_option("--threads", ta.threads, "CPU threads (default: OMP_NUM_THREADS or all cores)")
      ->check(cli::integer<int>(1));
  train->add_option("--resume", ta.resume,
                    "Resume from this checkpoint (a step_* directory; a checkpoints or run directory, or a latest file: the one latest names). Default: the "
                    "latest checkpoint in checkpoint.dir (<out>/checkpoints), if there is one");
  train->add_option("--init-from", ta.init_from,
                    "Start a new run from a checkpoint's weights only (finetuning): fp32 masters from the weights, "
                    "Adam moments zero, step 0. Ignored when the run resumes");
  train->add_option("--stop-at", ta.stop_at, "Save a checkpoint after this iteration and stop (exit code 4); must be after the iteration the run resumes at")
      ->check(cli::integer<int64_t>(1));
  train->add_option("--time-limit", ta.time_limit_min,
                    "Minutes of wall time this job may use, counted from keel's start: save and stop (exit code 4) before they run out, keeping room for one more step and the longest save so far")
      ->check(cli::positive_number());
  train->add_flag("--eval-only", ta.eval_only,
                  "Evaluate the model this run would start from (latest checkpoint, --resume, --init-from, or the "
                  "initialisation) on data.val, data.val_sets and choice_eval under the config's layout, print the "
                  "numbers and exit; nothing is trained or written");
  train->add_flag("--print-config", ta.print_config, "Validate the config, print it fully resolved, and exit");
  train->add_flag("-q,--quiet", ta.quiet, "No per-step log lines (metrics.jsonl is still written)");
  train->footer(
      "The log line per step follows Megatron-LM: iteration, consumed samples/tokens, ms per\n"
      "iteration, learning rate, global batch size, lm loss, loss scale, grad norm, num zeros,\n"
      "skipped and nan iterations, tokens per second and model TFLOP/s. The same numbers go to\n"
      "<out>/metrics.jsonl (plot with scripts/plot_metrics.py).\n"
      "Checkpoints go to <out>/checkpoints every checkpoint.interval steps and at the end; SIGTERM,\n"
      "SIGUSR1 (SLURM's warning before the time limit) and Ctrl-C save one at the next step boundary\n"
      "and stop. Running the same command again resumes from the latest checkpoint.\n"
      "Exit codes: 0 done, 1 training failed, 2 bad config or arguments, 3 bad data,\n"
      "4 stopped after saving (a signal, --stop-at or --time-limit; run again to resume),\n"
      "5 checkpoint unreadable or unwritable, 6 the fp16 loss scale hit its minimum (last good state saved).");
  return {train, [args] { return cmd_train(*args); }};
}

}  // namespace keel
