// The hang watchdog through the real binary: `mpirun -np 4 keel train` (dp 4) where world rank 2
// skips its second dp reduce-scatter (KEEL_FAULT_SKIP_COLLECTIVE, test-only) and goes on to the
// grad-norm all-reduce on the world while the others wait for it: a deadlock, as in seed 001.
// The job must end within the watchdog timeout (plus the answer wait), every rank must dump
// (all four wait in keel), and `keel doctor hang <run dir>` must name rank 2 and the
// reduce-scatter in the live report's words.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <sys/wait.h>

#include "common/process.h"
#include "common/workspace.h"
#include "train/parallel/hang_report.h"
#include "train/run.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {

using test::run_shell;

// The complete "keel hang report: ..." lines of a job's output (a rank killed by the abort may
// leave half a line), without their "(stuck ...)" tail.
std::vector<std::string> live_reports(const std::string& output) {
  std::vector<std::string> out;
  const std::string tag = "keel hang report: ", tail = " ranks waiting)";
  for (size_t at = output.find(tag); at != std::string::npos; at = output.find(tag, at + 1)) {
    const std::string line = output.substr(at + tag.size(), output.find('\n', at) - at - tag.size());
    const size_t stuck = line.rfind(" (stuck ");
    if (stuck == std::string::npos || line.size() < tail.size() || line.compare(line.size() - tail.size(), tail.size(), tail) != 0)
      continue;
    out.push_back(line.substr(0, stuck));
  }
  return out;
}

}  // namespace

TEST_CASE("mpirun keel train: a rank that skips a collective ends the job within the timeout, named by keel doctor hang",
          "[mpi][hang]") {
  test::Workspace ws({{"parallel", {{"dp", 4}}},
                      {"train", {{"steps", 4}, {"global_batch", 8}, {"micro_batch", 2}, {"eval_interval", 0},
                                 {"eval_batches", 0}}},
                      {"checkpoint", {{"save_at_end", false}}}});
  const std::string out = ws.dir / "out";
  const int timeout = 3;
  const std::string cmd = "env OMP_NUM_THREADS=1 KEEL_COMM_TIMEOUT=" + std::to_string(timeout) +
                          " KEEL_FAULT_SKIP_COLLECTIVE=rank=2,op=reduce_scatter,group=dp,call=2"
                          " KEEL_HANG_DUMP_DIR=" + out + "/hang " + std::string(KEEL_MPIEXEC) + " -np 4 " +
                          KEEL_BINARY + " train --config " + ws.config + " --out " + out + " -q";
  const auto t0 = std::chrono::steady_clock::now();
  const test::ProcessResult job = run_shell(cmd);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(job.output);
  WARN("the hung job ended after " << secs << " s (watchdog timeout " << timeout << " s)");
  CHECK(job.code != 0);
  REQUIRE(job.output.find("world rank 2 skips reduce_scatter #") != std::string::npos);
  // Start-up and one step take a second or two; then the timeout, the answer wait, the abort.
  CHECK(secs < timeout + 15);
  for (int r = 0; r < 4; ++r) CHECK(fs::exists(out + "/hang/" + parallel::hang_dump_file_name(r)));

  const std::vector<std::string> live = live_reports(job.output);
  REQUIRE(!live.empty());
  const test::ProcessResult doc = test::run_keel("doctor hang " + out);  // the run directory: finds hang/
  INFO(doc.output);
  CHECK(doc.code == 0);
  const std::regex first("hang: (reduce_scatter #[0-9]+ of dp group 0) \\[world ranks 0-3\\]: world rank 2 never arrived; "
                         "it last completed all_reduce #[0-9]+ of dp group 0 and is now waiting in all_reduce #[0-9]+ of "
                         "world group 0 \\(stuck ([0-9.]+) s, 3 of 4 ranks waiting\\)");
  std::smatch m;
  REQUIRE(std::regex_search(doc.output, m, first));
  const double stuck = std::stod(m[2]);
  CHECK(stuck >= timeout);
  CHECK(stuck < timeout + 3);
  CHECK(doc.output.find("world rank 2 skipped it: after all_reduce #") != std::string::npos);
  // Whichever ranks printed their live report before the abort: the dumps' report has the same words.
  for (const std::string& line : live) CHECK(doc.output.find(line + " (stuck ") != std::string::npos);
}

TEST_CASE("mpirun keel train: an error on one rank alone is printed by that rank, a shared one once by rank 0",
          "[mpi][errors]") {
  // A node whose data is missing: rank 1 alone is given a pattern that matches no file (mpirun's
  // multi-program form). The job must not end with only MPI's abort banner.
  test::Workspace ws({{"train", {{"steps", 2}, {"global_batch", 4}, {"micro_batch", 2}}}, {"parallel", {{"dp", 2}}}});
  const std::string keel = std::string(KEEL_BINARY) + " train --config " + ws.config + " -q --out " +
                           (ws.dir / "out");
  const std::string missing = " --set 'data.train=[\"" + (ws.dir / "gone_*.bin") + "\"]'";
  const std::string mpi = "env OMP_NUM_THREADS=1 " + std::string(KEEL_MPIEXEC);
  const test::ProcessResult lone = run_shell(mpi + " -np 1 " + keel + " : -np 1 " + keel + missing);
  INFO(lone.output);
  CHECK(lone.code == int(kExitDataError));
  const std::regex named("keel: \\[rank 1 of 2 on [^\\]]+\\] data error: data.train: pattern '[^']*gone_\\*\\.bin' "
                         "matches no file");
  CHECK(std::regex_search(lone.output, named));
  CHECK(lone.output.find("[rank 0 of 2") == std::string::npos);
  CHECK(!fs::exists(ws.dir / "out/checkpoints"));

  // Every rank's error: rank 0 says it, and the others are taken down before their grace ends.
  const test::ProcessResult shared = run_shell(mpi + " -np 2 " + keel + missing);
  INFO(shared.output);
  CHECK(shared.code == int(kExitDataError));
  CHECK(shared.output.find("keel: [rank 0 of 2 on ") != std::string::npos);
  CHECK(shared.output.find("[rank 1 of 2") == std::string::npos);
}

TEST_CASE("mpirun keel train: ranks given different configs are refused before anything runs, the fields named",
          "[mpi][errors]") {
  test::Workspace ws({{"train", {{"steps", 2}, {"global_batch", 4}, {"micro_batch", 2}}}, {"parallel", {{"dp", 2}}}});
  const std::string keel = std::string(KEEL_BINARY) + " train --config " + ws.config + " -q --out " + (ws.dir / "out");
  const std::string mpi = "env OMP_NUM_THREADS=1 " + std::string(KEEL_MPIEXEC);
  // Under pure DP nothing else would notice: the weights are all-gathered, so the replicas agree.
  const test::ProcessResult r =
      run_shell(mpi + " -np 1 " + keel + " : -np 1 " + keel + " --set optimizer.lr=0.5 --stop-at 1");
  INFO(r.output);
  CHECK(r.code == int(kExitConfigError));
  CHECK_THAT(r.output, Catch::Contains("world rank 1 runs another config than world rank 0") &&
                           Catch::Contains("optimizer.lr: 0.01 on world rank 0, 0.5 on world rank 1") &&
                           Catch::Contains("command line.--stop-at: \"not given\" on world rank 0, 1 on world rank 1"));
  CHECK(!fs::exists(ws.dir / "out"));
}
