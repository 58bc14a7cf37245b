// Subcommands of the `keel` binary. Each lives in its own train/cmd_<name>.cpp and registers
// itself on the CLI11 app; main() parses and runs the one the user picked.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace keel {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the process exit code; may throw (main maps errors)
};

Command add_train_command(CLI::App& app);
Command add_ckpt_command(CLI::App& app);
Command add_plan_command(CLI::App& app);  // train/cmd_plan.cpp
Command add_convert_command(CLI::App& app);  // train/cmd_convert.cpp
Command add_sample_command(CLI::App& app);   // train/cmd_sample.cpp
Command add_doctor_command(CLI::App& app);   // train/cmd_doctor.cpp
Command add_eval_command(CLI::App& app);     // train/cmd_eval.cpp
Command add_tokenize_command(CLI::App& app); // train/cmd_tokenize.cpp

}  // namespace keel
