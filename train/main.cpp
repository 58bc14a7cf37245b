// keel: one binary, subcommands (train/cmd_*.cpp).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <vector>

#include "data/token_file.h"
#include "train/checkpoint.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/run.h"

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

  std::vector<keel::Command> commands = {keel::add_train_command(app), keel::add_plan_command(app),
                                         keel::add_ckpt_command(app)};

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : keel::kExitConfigError;
  }

  try {
    for (auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const keel::ConfigError& e) {
    std::fprintf(stderr, "keel: error: %s\n", e.what());
    return keel::kExitConfigError;
  } catch (const keel::CheckpointError& e) {
    std::fprintf(stderr, "keel: checkpoint error: %s\n", e.what());
    return keel::kExitCheckpointError;
  } catch (const keel::data::DataError& e) {
    std::fprintf(stderr, "keel: data error: %s\n", e.what());
    return keel::kExitDataError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel: error: %s\n", e.what());
    return keel::kExitFailure;
  }
  return keel::kExitOk;
}
