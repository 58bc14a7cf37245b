// `keel doctor frozen|ckpt|metrics|hang`: offline checks on run artefacts (train/doctor.h and
// train/parallel/hang_report.h do the work; this file is the command line).
// Exit codes: 0 healthy (hang: a report was built), 1 problems found, 2 bad arguments, 5 unreadable checkpoint.
#include <cstdio>

#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/doctor.h"
#include "train/parallel/hang_report.h"
#include "train/run.h"

namespace keel {

namespace {

struct DoctorArgs {
  std::string a, b, path;
  std::vector<std::string> files;
  doctor::FrozenOptions frozen;
  doctor::MetricsOptions metrics;
};

int print(const doctor::Report& r) {
  std::fputs(r.text.c_str(), stdout);
  return r.problems.empty() ? kExitOk : kExitFailure;
}

int cmd_hang(const std::string& dir) {
  const parallel::HangDumps dumps = parallel::read_hang_dumps(dir);
  const parallel::HangAnalysis analysis = parallel::analyze_hang(dumps.dumps);
  std::fputs(parallel::format_hang_analysis(analysis, dumps).c_str(), stdout);
  return kExitOk;
}

}  // namespace

Command add_doctor_command(CLI::App& app) {
  auto args = std::make_shared<DoctorArgs>();
  CLI::App* doc = app.add_subcommand("doctor", "Offline health checks on checkpoints, metrics and hang dumps");
  doc->require_subcommand(1);
  doc->footer(
      "Exit codes: 0 healthy (hang: a report was built), 1 problems found (listed at the end),\n"
      "2 bad arguments (a file or folder that does not exist), 5 a checkpoint that cannot be read.\n"
      "Examples:\n"
      "  keel doctor frozen runs/a/checkpoints/step_00001000 runs/a/checkpoints/step_00002000\n"
      "  keel doctor ckpt runs/a/checkpoints\n"
      "  keel doctor metrics runs/a/metrics.jsonl\n"
      "  keel doctor hang runs/a              (or runs/a/hang: the hang-rank*.json dumps)");
  CLI::App* frozen = doc->add_subcommand("frozen", "Tensors that did not move between two checkpoints, and why");
  frozen->add_option("a", args->a, "Earlier checkpoint (step_* directory, or a checkpoints or run directory: the one its latest names)")->required();
  frozen->add_option("b", args->b, "Later checkpoint")->required();
  frozen->add_option("--threshold", args->frozen.threshold,
                     "Fraction of unchanged elements that makes a tensor frozen (default 0.99)")
      ->check(cli::number(0, 1));
  frozen->add_option("--max", args->frozen.max_moving, "Moving tensors to list (least-moving first)")
      ->check(cli::integer<int>(0));
  CLI::App* ckpt = doc->add_subcommand("ckpt", "Audit optimizer state, masters vs weights, weight-decay groups");
  ckpt->add_option("path", args->path, "Checkpoint (step_* directory, or a checkpoints or run directory: the one its latest names)")->required();
  CLI::App* metrics = doc->add_subcommand("metrics", "Spikes, skipped/nan steps, loss-scale history, resumes, validation");
  // A mistyped path is a bad argument (exit 2), not a problem found in the run (exit 1).
  metrics->add_option("files", args->files, "metrics.jsonl file(s)")->required()->check(CLI::ExistingFile);
  metrics->add_option("--z", args->metrics.z, "Spike threshold in standard deviations (default 4)")
      ->check(cli::positive_number());
  metrics->add_option("--window", args->metrics.window, "Steps in the running statistics (default 50)")
      ->check(cli::integer<int>(1));
  CLI::App* hang = doc->add_subcommand("hang", "Which ranks a hung job waited for, from its hang-rank*.json dumps");
  hang->add_option("dir", args->path, "Dump directory, or the run directory holding hang/")
      ->required()
      ->check(CLI::ExistingDirectory);
  return {doc, [args, frozen, ckpt, metrics, hang]() -> int {
            if (frozen->parsed())
              return print(doctor::compare_frozen(Checkpoint::open(args->a), Checkpoint::open(args->b), args->frozen));
            if (ckpt->parsed()) return print(doctor::audit_checkpoint(Checkpoint::open(args->path)));
            if (metrics->parsed()) {
              int code = kExitOk;
              for (size_t i = 0; i < args->files.size(); ++i) {
                if (i) std::printf("\n");
                code = std::max(code, print(doctor::summarize_metrics(args->files[i], args->metrics)));
              }
              return code;
            }
            if (hang->parsed()) return cmd_hang(args->path);
            return kExitConfigError;
          }};
}

}  // namespace keel
