// keel: one binary, subcommands. `train` runs or resumes a training run from a JSON config.
#include <CLI/CLI.hpp>

#include <omp.h>

#include <cstdio>
#include <iostream>

#include "data/token_file.h"
#include "train/config.h"
#include "train/run.h"

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
  keel::RunConfig cfg = keel::load_config(a.config, overrides);
  if (a.print_config) {
    std::cout << keel::to_json(cfg).dump(2) << '\n';
    return keel::kExitOk;
  }
  if (a.threads > 0) omp_set_num_threads(a.threads);
  keel::RunOptions opts;
  opts.quiet = a.quiet;
  return keel::run_training(cfg, opts);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "keel: a trainer for Llama- and GPT-style language models.\n"
      "Hand-written kernels, bf16 with fp32 master weights, JSON run configs.\n"
      "Runs on the CPU (reference backend) or on NVIDIA GPUs."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "keel 0.1");
  app.footer(
      "Examples:\n"
      "  keel train --config configs/llama-tiny.json\n"
      "  keel train --config configs/gpt2-124m.json --set optimizer.lr=6e-4 --steps 5000 --out runs/a\n"
      "Run `keel <subcommand> --help` for the options of each subcommand.");

  TrainArgs ta;
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : keel::kExitConfigError;
  }

  try {
    if (*train) return cmd_train(ta);
  } catch (const keel::ConfigError& e) {
    std::fprintf(stderr, "keel: error: %s\n", e.what());
    return keel::kExitConfigError;
  } catch (const keel::data::DataError& e) {
    std::fprintf(stderr, "keel: data error: %s\n", e.what());
    return keel::kExitDataError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel: error: %s\n", e.what());
    return keel::kExitFailure;
  }
  return keel::kExitOk;
}
