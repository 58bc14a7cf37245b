// keel: one binary, subcommands (train/cmd_*.cpp).
#include <CLI/CLI.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "data/file_io.h"
#include "data/token_file.h"
#include "train/checkpoint.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/parallel/mpi_comm.h"
#include "train/run.h"

namespace {
constexpr double kLoneErrorGraceSeconds = 3;
}  // namespace

int main(int argc, char** argv) {
  // Each line reaches the log as it is printed, also when stdout is a file (a SLURM job's): a
  // warning must not wait in a buffer for a kill -9 or the OOM killer to lose it.
  std::setvbuf(stdout, nullptr, _IOLBF, 1 << 16);
  // A file-size limit (ulimit -f) must surface as a write error naming the file, not kill us.
  std::signal(SIGXFSZ, SIG_IGN);
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
                                         keel::add_ckpt_command(app), keel::add_convert_command(app),
                                         keel::add_sample_command(app), keel::add_doctor_command(app),
                                         keel::add_eval_command(app), keel::add_tokenize_command(app)};

  // A first word that is no subcommand (a typo: keel trian) would otherwise read "A subcommand
  // is required".
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    std::string names, best;
    size_t best_d = 3;  // only suggest close names
    for (const auto& c : commands) {
      const std::string name = c.app->get_name();
      if (name == word) best_d = 0;
      names += (names.empty() ? "" : ", ") + name;
      if (const size_t d = keel::edit_distance(word, name); d < best_d) best_d = d, best = name;
    }
    if (best_d > 0) {
      std::fprintf(stderr, "keel: unknown subcommand '%s'%s; the subcommands are %s (keel --help)\n", word.c_str(),
                   best.empty() ? "" : (" (did you mean '" + best + "'?)").c_str(), names.c_str());
      return keel::kExitConfigError;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : keel::kExitConfigError;
  }

  // Under mpirun/srun every rank runs this same binary. MPI is started before anything else;
  // a single process (no launcher) never touches MPI.
  std::unique_ptr<keel::parallel::MpiRuntime> mpi;
  int world_rank = 0, world_size = 1;
  // Config, data and checkpoint errors are usually every rank's (the same config and files): rank
  // 0 prints them once. Another rank prints its own only when rank 0 has not taken the job down
  // within a grace period, i.e. when it is that rank's alone (a node's missing data, a config
  // given to some ranks): otherwise the job would end with nothing to say which rank or why.
  auto fail = [&](int code, const char* kind, const char* what, bool every_rank) {
    if (world_size > 1 && world_rank != 0 && !every_rank) {
      std::signal(SIGTERM, SIG_DFL);  // the launcher's teardown after rank 0's abort ends us here
      std::this_thread::sleep_for(std::chrono::duration<double>(kLoneErrorGraceSeconds));
    }
    if (world_size > 1)
      std::fprintf(stderr, "keel: [rank %d of %d on %s] %s: %s\n", world_rank, world_size,
                   keel::data::detail::this_host().c_str(), kind, what);
    else
      std::fprintf(stderr, "keel: %s: %s\n", kind, what);
    // With several ranks, take the whole job down rather than leave the others waiting.
    if (world_size > 1) keel::parallel::MpiRuntime::abort(code);
    return code;
  };
  if (app.got_subcommand("train")) {
    keel::install_stop_handlers();
    // Test hook: a signal at the earliest moment of start-up, before MPI (test_cli "[signal]").
    if (std::getenv("KEEL_FAULT_SIGNAL_AT_STARTUP")) std::raise(SIGUSR1);
  }
  try {
    mpi = std::make_unique<keel::parallel::MpiRuntime>(&argc, &argv);
    world_rank = mpi->world_rank();
    world_size = mpi->world_size();
    keel::set_process_runtime(mpi.get());
    for (auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const keel::parallel::CommTimeout&) {
    // The watchdog already printed the hang report (and wrote the dumps): end the job.
    keel::parallel::MpiRuntime::abort(keel::kExitFailure);
  } catch (const keel::ConfigError& e) {
    return fail(keel::kExitConfigError, "error", e.what(), false);
  } catch (const keel::CheckpointError& e) {
    return fail(keel::kExitCheckpointError, "checkpoint error", e.what(), false);
  } catch (const keel::data::DataError& e) {
    return fail(keel::kExitDataError, "data error", e.what(), false);
  } catch (const std::bad_alloc&) {
    return fail(keel::kExitFailure, "error",
                "out of host memory: an allocation failed (std::bad_alloc). For keel train, the start-up memory "
                "table and keel plan show what each rank needs",
                true);
  } catch (const std::exception& e) {
    return fail(keel::kExitFailure, "error", e.what(), true);
  }
  return keel::kExitOk;
}
