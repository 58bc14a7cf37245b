// Checkpoints end to end with the real binary: stop and resume is invisible in the loss curve,
// kill -9 at any moment (including mid-save) loses nothing but the steps since the last save,
// damaged checkpoints are refused by name, and I/O errors leave earlier checkpoints intact.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "common/checkpoint_meta.h"
#include "common/process.h"
#include "common/scoped_env.h"
#include "common/workspace.h"
#include "data/safetensors.h"
#include "kernels/dtype.h"
#include "train/checkpoint.h"
#include "train/run.h"

using namespace keel;
namespace fs = std::filesystem;
using test::run_keel;

namespace {

const nlohmann::json kRun = {{"precision", {{"mode", "bf16"}}},
                             {"train", {{"steps", 40}, {"eval_interval", 0}, {"eval_batches", 0}}},
                             {"checkpoint", {{"interval", 4}, {"keep_last", 2}}}};

std::string train_args(const test::Workspace& ws, const std::string& out, const std::string& extra = "") {
  return "train --config " + ws.config + " --out " + out + " -q " + extra;
}

// Flips one byte in the middle of a tensor's data inside a safetensors file.
void flip_byte_in(const std::string& file, const std::string& tensor) {
  const auto [offset, size] = test::entry_span_in_file(file, tensor);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset + size / 2);
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(offset + size / 2);
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("stop at N/2, resume, N/2 more: the same losses bit for bit and bitwise-equal checkpoints",
          "[ckpt][cli][resume]") {
  test::Workspace ws(kRun);
  auto straight = run_keel(train_args(ws, ws.dir / "straight"));
  REQUIRE(straight.code == 0);

  auto first = run_keel(train_args(ws, ws.dir / "split", "--stop-at 20"));
  INFO(first.output);
  REQUIRE(first.code == 4);
  CHECK_THAT(first.output, Catch::Contains("--stop-at 20 reached"));
  auto second = run_keel(train_args(ws, ws.dir / "split"));
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK_THAT(second.output, Catch::Contains("resuming from") && Catch::Contains("step_00000020"));

  auto a = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  auto b = test::losses_by_step(test::read_metrics(ws.dir / "split/metrics.jsonl"));
  REQUIRE(a.size() == 40);
  CHECK(a == b);  // exact double equality at every step

  auto diff = run_keel("ckpt diff " + (ws.dir / "straight/checkpoints") + " " + (ws.dir / "split/checkpoints"));
  INFO(diff.output);
  CHECK(diff.code == 0);
  CHECK_THAT(diff.output, Catch::Contains("bitwise equal"));
  // Rotation kept the newest two.
  CHECK(fs::exists(ws.dir / "split/checkpoints/step_00000040"));
  CHECK(fs::exists(ws.dir / "split/checkpoints/step_00000036"));
  CHECK_FALSE(fs::exists(ws.dir / "split/checkpoints/step_00000032"));
}

// Inside a batch-size ramp-up the batch of the next step follows from the samples consumed: a
// run stopped there, and one stopped where the ramp-up has just ended, resume on the same
// batches and losses bit for bit (4, 8, 12, then 16 samples a step over 48).
TEST_CASE("a resume inside a batch-size ramp-up continues it bit for bit", "[ckpt][cli][resume][schedule]") {
  test::Workspace ws({{"precision", {{"mode", "bf16"}}},
                      {"train", {{"steps", 12}, {"global_batch", 16}, {"eval_interval", 0}, {"eval_batches", 0}}},
                      {"schedule", {{"rampup_batch_size", {4, 4, 48}}}},
                      {"checkpoint", {{"interval", 0}}}});
  auto straight = run_keel(train_args(ws, ws.dir / "straight"));
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  const auto records = test::read_metrics(ws.dir / "straight/metrics.jsonl");
  std::vector<int64_t> batches;
  for (const auto& rec : records)
    if (rec.contains("loss")) batches.push_back(rec["global_batch"]);
  REQUIRE(batches == std::vector<int64_t>{4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16});
  for (int stop : {3, 6, 8}) {
    INFO("stopped at step " << stop);
    const std::string out = ws.dir / ("split" + std::to_string(stop));
    auto first = run_keel(train_args(ws, out, "--stop-at " + std::to_string(stop)));
    INFO(first.output);
    REQUIRE(first.code == 4);
    auto second = run_keel(train_args(ws, out));
    INFO(second.output);
    REQUIRE(second.code == 0);
    const auto resumed = test::read_metrics(out + "/metrics.jsonl");
    CHECK(test::losses_by_step(resumed) == test::losses_by_step(records));
    std::vector<int64_t> got;
    for (const auto& rec : resumed)
      if (rec.contains("loss")) got.push_back(rec["global_batch"]);
    CHECK(got == batches);
  }
}

// A sliding window changes no tensor but the network: a run with one resumes exactly, a
// checkpoint is not resumed without it (naming the field), and --init-from across it says so.
TEST_CASE("a sliding window resumes exactly, and a checkpoint is not resumed across it", "[ckpt][cli][resume][window]") {
  test::Workspace ws(kRun);
  const std::string window = "--set model.sliding_window=5 --steps 8 ";
  auto straight = run_keel(train_args(ws, ws.dir / "straight", window));
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  CHECK_THAT(straight.output, Catch::Contains("sliding window 5"));
  REQUIRE(run_keel(train_args(ws, ws.dir / "split", window + "--stop-at 4")).code == 4);
  auto second = run_keel(train_args(ws, ws.dir / "split", window));
  INFO(second.output);
  REQUIRE(second.code == 0);
  const auto a = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  REQUIRE(a.size() == 8);
  CHECK(a == test::losses_by_step(test::read_metrics(ws.dir / "split/metrics.jsonl")));
  // The window matters: without it the same run's losses differ.
  REQUIRE(run_keel(train_args(ws, ws.dir / "plain", "--steps 8")).code == 0);
  CHECK(a != test::losses_by_step(test::read_metrics(ws.dir / "plain/metrics.jsonl")));

  const std::string ck = ws.dir / "straight/checkpoints/step_00000008";
  auto refused = run_keel(train_args(ws, ws.dir / "nowindow", "--steps 12 --resume " + ck));
  INFO(refused.output);
  CHECK(refused.code == 5);
  CHECK_THAT(refused.output, Catch::Contains("saved for another model") &&
                                 Catch::Contains("model.sliding_window: checkpoint 5, config -"));
  CHECK(run_keel("ckpt verify " + ck).code == 0);
  auto init = run_keel(train_args(ws, ws.dir / "init", "--set model.sliding_window=3 --steps 2 --init-from " + ck));
  INFO(init.output);
  CHECK(init.code == 0);
  CHECK_THAT(init.output,
             Catch::Contains("NOTE: the checkpoint was trained with model.sliding_window 5, this run uses 3"));
}

// model.init_std draws only a fresh run's weights, and a Llama's max_seq_len is no tensor's shape
// (RoPE: a longer context continues the run): a resume takes both, with a note (was: refused as
// "another model", with no way on but --init-from and a fresh optimizer). GPT-2's learned
// positions are a tensor: refused by its shapes.
TEST_CASE("a resume takes another model.init_std, and another max_seq_len where no tensor depends on it",
          "[ckpt][cli][resume]") {
  test::Workspace ws(kRun);
  REQUIRE(run_keel(train_args(ws, ws.dir / "run", "--stop-at 4")).code == 4);
  const auto r = run_keel(train_args(ws, ws.dir / "run", "--stop-at 6 --set model.init_std=0.05 --set model.max_seq_len=64"));
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("model.init_std: checkpoint") && Catch::Contains("no change to a resumed one") &&
                           Catch::Contains("model.max_seq_len: checkpoint 32, config 64 (no tensor's shape here"));
  test::Workspace gpt2(nlohmann::json{{"model", test::tiny_run_json("gpt2")["model"]}});
  REQUIRE(run_keel(train_args(gpt2, gpt2.dir / "run", "--stop-at 2")).code == 4);
  const auto g = run_keel(train_args(gpt2, gpt2.dir / "run", "--stop-at 4 --set model.max_seq_len=64"));
  INFO(g.output);
  CHECK(g.code == 5);
  CHECK_THAT(g.output, Catch::Contains("pos_embed") && Catch::Contains("[32, 32]") && Catch::Contains("[64, 32]"));
}

// BLOOM's options change the network (ALiBi has no position table in gpt2 and no RoPE in llama:
// the same tensors): resuming across them is refused by field, in both directions.
TEST_CASE("ALiBi and the embedding norm resume exactly, and a checkpoint is not resumed across them",
          "[ckpt][cli][resume][alibi]") {
  test::Workspace ws(kRun);
  const std::string bloom = "--set model.position_embedding=alibi --set model.embedding_norm=true --steps 12 ";
  auto straight = run_keel(train_args(ws, ws.dir / "straight", bloom));
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  auto first = run_keel(train_args(ws, ws.dir / "split", bloom + "--stop-at 6"));
  REQUIRE(first.code == 4);
  auto second = run_keel(train_args(ws, ws.dir / "split", bloom));
  INFO(second.output);
  REQUIRE(second.code == 0);
  auto a = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  auto b = test::losses_by_step(test::read_metrics(ws.dir / "split/metrics.jsonl"));
  REQUIRE(a.size() == 12);
  CHECK(a == b);

  // Without the options: refused, naming both fields; the checkpoint is left as it was.
  const std::string ck = ws.dir / "straight/checkpoints/step_00000012";
  auto plain = run_keel(train_args(ws, ws.dir / "plain", "--steps 12 --resume " + ck));
  INFO(plain.output);
  CHECK(plain.code == 5);
  CHECK_THAT(plain.output, Catch::Contains("saved for another model") &&
                               Catch::Contains("model.position_embedding: checkpoint \"alibi\", config -") &&
                               Catch::Contains("model.embedding_norm: checkpoint true, config -"));
  CHECK(run_keel("ckpt verify " + ck).code == 0);
  // And the other way: a plain checkpoint is not resumed with ALiBi.
  REQUIRE(run_keel(train_args(ws, ws.dir / "p", "--steps 4")).code == 0);
  auto other = run_keel(train_args(ws, ws.dir / "q", "--set model.position_embedding=alibi --steps 4 --resume " +
                                                        (ws.dir / "p/checkpoints/step_00000004")));
  CHECK(other.code == 5);
  CHECK_THAT(other.output, Catch::Contains("model.position_embedding: checkpoint -, config \"alibi\""));
  // Llama's RoPE weights may start an ALiBi run (the same tensors), and the run says what changed.
  auto init = run_keel(train_args(ws, ws.dir / "r", "--set model.position_embedding=alibi --steps 4 --init-from " +
                                                       (ws.dir / "p/checkpoints/step_00000004")));
  INFO(init.output);
  CHECK(init.code == 0);
  CHECK_THAT(init.output, Catch::Contains("NOTE: the checkpoint was trained with model.position_embedding \"rope\", "
                                          "this run uses \"alibi\""));
}

TEST_CASE("checkpoint.async: background saves hold the bits of foreground ones, and a resume from them is exact",
          "[ckpt][cli][resume][async]") {
  test::Workspace ws(kRun);
  auto straight = run_keel(train_args(ws, ws.dir / "straight"));
  REQUIRE(straight.code == 0);
  const std::string async = "--set checkpoint.async=true";
  auto first = run_keel(train_args(ws, ws.dir / "async", async + " --stop-at 22"));
  INFO(first.output);
  REQUIRE(first.code == 4);
  // Interval saves are published at a later step boundary; the stop's save is written at once.
  CHECK_THAT(first.output, Catch::Contains("step_00000020 (") && Catch::Contains("written in the background") &&
                               Catch::Contains("training waited"));
  CHECK_THAT(first.output, Catch::Contains("step_00000022 (") && Catch::Contains(" MB/s)"));
  auto second = run_keel(train_args(ws, ws.dir / "async", async));
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK_THAT(second.output, Catch::Contains("restart verification passed"));

  auto a = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  auto b = test::losses_by_step(test::read_metrics(ws.dir / "async/metrics.jsonl"));
  REQUIRE(a.size() == 40);
  CHECK(a == b);
  for (const char* step : {"step_00000036", "step_00000040"}) {
    auto diff = run_keel("ckpt diff " + (ws.dir / "straight/checkpoints/") + step + " " +
                         (ws.dir / "async/checkpoints/") + step);
    INFO(diff.output);
    CHECK(diff.code == 0);
    CHECK_THAT(diff.output, Catch::Contains("bitwise equal"));
  }
  // Rotation runs as each save is published: the newest two.
  CHECK_FALSE(fs::exists(ws.dir / "async/checkpoints/step_00000032"));
  CHECK(run_keel("ckpt verify " + (ws.dir / "async/checkpoints")).code == 0);
}

// precision.stochastic_rounding: the working copy is a random bf16 neighbour of the master, so
// the restart check must accept either neighbour, and the random stream must continue exactly.
TEST_CASE("stochastic rounding: reproducible, and a resume is exact and passes restart verification",
          "[ckpt][cli][resume][stochastic]") {
  test::Workspace ws(kRun);
  const std::string sr = "--set precision.stochastic_rounding=true --steps 16";
  auto straight = run_keel(train_args(ws, ws.dir / "straight", sr));
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  auto nearest = run_keel(train_args(ws, ws.dir / "nearest", "--steps 16"));
  REQUIRE(nearest.code == 0);
  auto first = run_keel(train_args(ws, ws.dir / "split", sr + " --stop-at 8"));
  REQUIRE(first.code == 4);
  auto second = run_keel(train_args(ws, ws.dir / "split", sr));
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK_THAT(second.output, Catch::Contains("restart verification passed"));

  auto a = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  auto b = test::losses_by_step(test::read_metrics(ws.dir / "split/metrics.jsonl"));
  auto c = test::losses_by_step(test::read_metrics(ws.dir / "nearest/metrics.jsonl"));
  REQUIRE(a.size() == 16);
  CHECK(a == b);  // the rounding stream is a function of (seed, tensor, step, element)
  CHECK(a != c);  // and it is really used: round-to-nearest trains other weights
  CHECK(run_keel("ckpt diff " + (ws.dir / "straight/checkpoints") + " " + (ws.dir / "split/checkpoints")).code == 0);

  // A checkpoint written with stochastic rounding, resumed without it: the loaded weights are
  // neighbours of their masters, not their nearest roundings, and the check knows it.
  auto third = run_keel(train_args(ws, ws.dir / "split", "--steps 20"));
  INFO(third.output);
  CHECK(third.code == 0);
  CHECK_THAT(third.output, Catch::Contains("restart verification passed"));
}

// A job whose saves take longer than its steps (a large model, a slow filesystem) used to stop with
// two steps' time to spare, and the scheduler killed it in the middle of its stop save.
TEST_CASE("the time limit keeps room for one more step and the run's longest save", "[ckpt][signal]") {
  // 1 s steps, 60 s saves, a 1000 s limit.
  CHECK_FALSE(time_limit_near(900, 1, 60, 1000));
  CHECK(time_limit_near(940, 1, 60, 1000));  // 940 + 1 + 60 > 1000: a save begun after the next step would not end
  CHECK_FALSE(time_limit_near(938, 1, 60, 1000));
  // Before the first save its time is not known: a step's time stands for it.
  CHECK_FALSE(time_limit_near(997, 1, 0, 1000));
  CHECK(time_limit_near(998, 1, 0, 1000));
  // The next step with its evaluations (30 s) is longer than the save.
  CHECK(time_limit_near(941, 30, 20, 1000));
  CHECK_FALSE(time_limit_near(939, 30, 20, 1000));
}

TEST_CASE("a run under --time-limit stops with a save and says how long the next step would take",
          "[ckpt][cli][signal]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 100000}, {"eval_interval", 0}, {"eval_batches", 0}}},
                                    {"checkpoint", {{"interval", 0}}}});
  const auto r = run_keel("train --config " + ws.config + " --out " + (ws.dir / "out") + " -q --time-limit 0.01");  // minutes: 0.6 s
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK(fs::exists(ws.dir / "out/checkpoints/latest"));
  // A tiny model's steps take milliseconds: the estimate keeps three digits (it read "0.0 s").
  // No save timed yet in a fresh run: said, not a step's time printed as the save's.
  const std::regex near(R"(time limit of 0.6 s is near \(([0-9.]+) s since keel started; the next step would take )"
                        R"(about ([0-9.e+-]+) s; no save timed yet, so room for a step is kept for it\))");
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, near));
  CHECK(std::stod(m[2].str()) > 0);
  // The save records how long it took; a resumed run keeps room for that before it times its own.
  const nlohmann::json meta =
      nlohmann::json::parse(test::read_file(Checkpoint::find_latest(ws.dir / "out/checkpoints").value() + "/meta.json"));
  REQUIRE(meta.contains("save_seconds"));
  CHECK(meta["save_seconds"].get<double>() > 0);
  const auto resumed = run_keel("train --config " + ws.config + " --out " + (ws.dir / "out") + " -q --time-limit 0.01");
  INFO(resumed.output);
  CHECK(resumed.code == 4);
  const std::regex resumed_near(R"(the next step would take about [0-9.e+-]+ s and a save ([0-9.e+-]+) s, the resumed )"
                                R"(checkpoint's save\))");
  REQUIRE(std::regex_search(resumed.output, m, resumed_near));
  CHECK(std::stod(m[1].str()) > 0);
}

// keel checks the free space of checkpoint.dir after each save (statvfs; a full tmpfs shows it:
// FINDINGS of the operations hunt), and warns when the next save cannot fit.
TEST_CASE("a save that leaves less free space than one more save warns with both numbers", "[ckpt][io]") {
  CHECK(low_space_warning("/ck", 18'400'000, 18'400'000).empty());
  CHECK(low_space_warning("/ck", 18'400'000, 50'000'000).empty());
  const std::string w = low_space_warning("/ck", 18'400'000, 13'000'000);
  CHECK_THAT(w, Catch::Contains("the next checkpoint save will not fit: /ck has 13.0 MB free, and the next save "
                                "needs about 18.4 MB"));
  // After the save at a stop, the next save is a resumed run's; after the run's last, there is none.
  CHECK_THAT(low_space_warning("/ck", 18'400'000, 13'000'000, AfterSave::Stop),
             Catch::StartsWith("WARNING a resumed run's first checkpoint save will not fit: /ck has 13.0 MB free") &&
                 Catch::Contains("Free some space there before resuming,"));
  CHECK(low_space_warning("/ck", 18'400'000, 13'000'000, AfterSave::End).empty());
  // At a resume's start-up (the disk filled while the job waited in the queue): said before the
  // steps up to the first save are trained, with the resumed checkpoint's size as the estimate.
  CHECK_THAT(low_space_warning("/ck", 18'400'000, 13'000'000, AfterSave::Resumed),
             Catch::StartsWith("WARNING this run's first checkpoint save will not fit: /ck has 13.0 MB free, and a "
                               "save needs about 18.4 MB (the size of the checkpoint resumed from;") &&
                 Catch::Contains("Free some space there, or the steps up to the first save are trained for nothing"));
}

TEST_CASE("SIGTERM / SIGUSR1 save at the next step boundary and exit with code 4", "[ckpt][cli][signal]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 100000}, {"eval_interval", 0}, {"eval_batches", 0}}},
                                    {"checkpoint", {{"interval", 0}}}});
  for (int sig : {SIGTERM, SIGUSR1}) {
    const std::string out = ws.dir / ("sig" + std::to_string(sig));
    pid_t pid = test::spawn_keel({"train", "--config", ws.config, "--out", out, "-q"}, out + ".log");
    // Wait until training is under way, then signal.
    for (int i = 0; i < 400 && !fs::exists(out + "/metrics.jsonl"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill(pid, sig);
    const int code = test::wait_for(pid);
    const std::string text = test::read_file(out + ".log");
    INFO(text);
    CHECK(code == 4);
    CHECK_THAT(text, Catch::Contains(sig == SIGTERM ? "SIGTERM received" : "SIGUSR1 received"));
    // A launcher may kill keel before the save (mpirun's teardown when a rank fails sends the
    // same SIGTERM): the announcement says what a resume would then have.
    CHECK_THAT(text, Catch::Contains("if keel is killed before the save (as mpirun kills every rank when one fails), "
                                     "this run leaves no checkpoint to resume from"));
    auto verify = run_keel("ckpt verify " + out + "/checkpoints");
    CHECK(verify.code == 0);
  }
  // Resumed, the run has a checkpoint until its next save: the one it resumed from.
  const std::string out = ws.dir / ("sig" + std::to_string(SIGTERM));
  std::string latest = test::read_file(out + "/checkpoints/latest");
  latest.pop_back();  // the newline
  pid_t pid = test::spawn_keel({"train", "--config", ws.config, "--out", out, "-q"}, out + ".resumed.log");
  for (int i = 0; i < 400 && test::read_file(out + "/metrics.jsonl").find("\"resume\"") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(pid, SIGUSR1);
  CHECK(test::wait_for(pid) == 4);
  const std::string text = test::read_file(out + ".resumed.log");
  INFO(text);
  CHECK_THAT(text, Catch::Contains("if keel is killed before the save (as mpirun kills every rank when one fails), "
                                   "a resume starts from " + out + "/checkpoints/" + latest + ", the newest checkpoint"));
}

// Whether process `pid` catches signal `sig` (SigCgt in /proc/PID/status).
static bool catches_signal(pid_t pid, int sig) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("SigCgt:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  return false;
}

// Under Slurm a SIGTERM (preemption) or SIGUSR1 (--signal) can come while a large model's checkpoint
// is still loading; keel then died of the signal (exit 138), and the requeue script, which waits for
// exit 4, gave up on the job. The handlers are now in place before the checkpoint is read. The
// evaluations due at the stop are skipped: the grace before the deadline is for the save.
TEST_CASE("a signal during start-up stops the run at its first step boundary with a save and exit 4",
          "[ckpt][cli][signal]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  const size_t metrics_before = test::read_file(out + "/metrics.jsonl").size();
  // Validation is due at every step: a signal skips it, so that the save starts at once.
  pid_t pid = test::spawn_keel({"train", "--config", ws.config, "--out", out, "-q", "--set", "train.eval_interval=1",
                                "--set", "train.eval_batches=2"},
                               out + ".log");
  bool caught = false;
  for (int i = 0; i < 2000 && !(caught = catches_signal(pid, SIGUSR1)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(caught);
  // Start-up is not over: the resume has not been recorded yet.
  CHECK(test::read_file(out + "/metrics.jsonl").size() == metrics_before);
  kill(pid, SIGUSR1);
  const int code = test::wait_for(pid);
  const std::string text = test::read_file(out + ".log");
  INFO(text);
  CHECK(code == 4);
  CHECK_THAT(text, Catch::Contains("SIGUSR1 received: saving a checkpoint at iteration 5") &&
                       Catch::Contains("the evaluations due at iteration 5 are skipped"));
  CHECK(test::read_file(out + "/checkpoints/latest") == "step_00000005\n");
  for (const auto& rec : test::read_metrics(out + "/metrics.jsonl")) CHECK_FALSE(rec.contains("val_loss"));

  // At the earliest moment, before MPI starts and the ranks compare their configs (a second and
  // more on a busy node): the same stop (was: killed by the signal, exit 138).
  test::ScopedEnv early("KEEL_FAULT_SIGNAL_AT_STARTUP");
  early.set("1");
  const auto r = run_keel(train_args(ws, out, "--stop-at 8"));
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("SIGUSR1 received"));
  CHECK(test::read_file(out + "/checkpoints/latest") == "step_00000006\n");
}

// scripts/keel.sbatch under stand-ins for srun (exits as keel would) and scontrol (records the
// requeue): only a stop the job did not ask for is continued.
TEST_CASE("keel.sbatch requeues after a signal stop, not after --stop-at, done or an error", "[ckpt][signal][scripts]") {
  test::Workspace ws(kRun);
  const std::string bin = ws.dir / "bin", log = ws.dir / "calls.log";
  fs::create_directories(bin);
  std::ofstream(bin + "/srun") << "#!/bin/bash\necho \"srun $*\" >> " << log << "\nexit $KEEL_TEST_RC\n";
  std::ofstream(bin + "/scontrol") << "#!/bin/bash\necho \"scontrol $*\" >> " << log << "\n";
  fs::permissions(bin + "/srun", fs::perms::owner_all);
  fs::permissions(bin + "/scontrol", fs::perms::owner_all);
  auto sbatch = [&](int keel_code, const std::string& args, int restarts = 0) {
    fs::remove(log);
    const auto r = test::run_shell("env PATH=" + bin + ":$PATH SLURM_JOB_ID=77 SLURM_SUBMIT_DIR=" + ws.dir.path.string() +
                                   " SLURM_RESTART_COUNT=" + std::to_string(restarts) +
                                   " KEEL_TEST_RC=" + std::to_string(keel_code) + " bash " + KEEL_SOURCE_DIR +
                                   "/scripts/keel.sbatch " + args);
    return std::make_pair(r.code, test::read_file(log));
  };
  auto [code, calls] = sbatch(4, "configs/c.json");
  CHECK(code == 4);
  CHECK_THAT(calls, Catch::Contains("train --config configs/c.json") && Catch::Contains("scontrol requeue 77"));
  std::tie(code, calls) = sbatch(4, "configs/c.json --stop-at 500");
  CHECK(code == 4);
  CHECK_THAT(calls, Catch::Contains("--stop-at 500") && !Catch::Contains("requeue"));
  std::tie(code, calls) = sbatch(4, "configs/c.json --stop-at=500");
  CHECK_THAT(calls, !Catch::Contains("requeue"));
  for (int done_or_error : {0, 2, 5}) {
    std::tie(code, calls) = sbatch(done_or_error, "configs/c.json");
    CHECK(code == done_or_error);
    CHECK_THAT(calls, !Catch::Contains("requeue"));
  }
  // The first job resumes where it was told; its requeues continue from latest, not from there
  // again (each would rewind to it and redo the same stretch forever).
  std::tie(code, calls) = sbatch(4, "configs/c.json --resume ck/step_00000016 -q");
  CHECK_THAT(calls, Catch::Contains("train --config configs/c.json --resume ck/step_00000016 -q") &&
                        Catch::Contains("scontrol requeue 77"));
  for (const std::string resume : {"--resume ck/step_00000016", "--resume=ck/step_00000016"}) {
    std::tie(code, calls) = sbatch(4, "configs/c.json " + resume + " -q", 1);
    INFO(calls);
    CHECK(code == 4);
    CHECK_THAT(calls, Catch::Contains("train --config configs/c.json -q\n") && !Catch::Contains("step_00000016") &&
                          Catch::Contains("scontrol requeue 77"));
  }
}

TEST_CASE("kill -9 at random moments, and crashes inside each phase of a save: every resume is exact",
          "[ckpt][cli][crash]") {
  test::Workspace ws(kRun);
  // Saves every step, so random kills often land inside a save.
  const std::string every_step = "--set checkpoint.interval=1";
  REQUIRE(run_keel(train_args(ws, ws.dir / "ref", every_step)).code == 0);
  const auto reference = test::losses_by_step(test::read_metrics(ws.dir / "ref/metrics.jsonl"));
  REQUIRE(reference.size() == 40);

  SECTION("deterministic crashes at each phase of the first save, written in the foreground or the background") {
    // In the background, "files" ends the process from the writer thread while training goes
    // on, and the other phases at the step boundary that publishes the save.
    for (const std::string mode : {"", " --set checkpoint.async=true"})
    // "prune": keep_last removing the oldest save (at the third save), which must never leave a
    // step_* directory missing some of its files.
    for (const char* phase : {"files", "meta", "rename", "latest", "prune"}) {
      INFO("crash during save phase " << phase << mode);
      const std::string out = ws.dir / (std::string("phase-") + phase + (mode.empty() ? "" : "-async"));
      auto crashed = run_keel(train_args(ws, out, every_step + mode), std::string("KEEL_CRASH_DURING_SAVE=") + phase);
      CHECK(crashed.code == 137);
      for (const auto& e : fs::directory_iterator(out + "/checkpoints"))
        if (e.path().filename().string().rfind("step_", 0) == 0) CHECK(fs::exists(e.path() / "meta.json"));
      auto resumed = run_keel(train_args(ws, out, every_step));
      INFO(resumed.output);
      REQUIRE(resumed.code == 0);
      // A crash before the rename leaves the save's .tmp- folder: named as it goes.
      if (std::string(phase) == "files" || std::string(phase) == "meta")
        CHECK_THAT(resumed.output, Catch::Contains("removed what an interrupted run left in " + out + "/checkpoints: .tmp-"));
      CHECK(test::losses_by_step(test::read_metrics(out + "/metrics.jsonl")) == reference);
      CHECK(run_keel("ckpt diff " + (ws.dir / "ref/checkpoints") + " " + out + "/checkpoints").code == 0);
      for (const auto& e : fs::directory_iterator(out + "/checkpoints"))
        CHECK((e.path().filename().string().rfind(".tmp-", 0) != 0 &&
               e.path().filename().string().rfind(".old-", 0) != 0));  // leftovers cleaned up
    }
  }

  SECTION("kill -9 at random times, again and again, until the run completes") {
    const std::string out = ws.dir / "killed";
    const std::string metrics = out + "/metrics.jsonl";
    auto steps_done = [&] {
      std::ifstream in(metrics);
      return static_cast<int>(std::count(std::istreambuf_iterator<char>(in), {}, '\n'));
    };
    std::mt19937 rng(12345);
    int kills = 0;
    for (int attempt = 0; attempt < 12; ++attempt) {
      // Kill once the run has made a random amount of further progress, plus a random 0-4 ms
      // (a step and a save take a few ms here): the moment is random, and never after the end.
      const int target = steps_done() + 1 + static_cast<int>(rng() % 6);
      // Every other run saves in the background, so kills also land while a writer thread runs.
      pid_t pid = test::spawn_keel({"train", "--config", ws.config, "--out", out, "-q", "--set", "checkpoint.interval=1",
                                    "--set", attempt % 2 ? "checkpoint.async=true" : "checkpoint.async=false"},
                                   out + ".log");
      bool exited = false;
      for (int i = 0; i < 20000 && steps_done() < target; ++i) {
        if (waitpid(pid, nullptr, WNOHANG) == pid) {
          exited = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      if (exited) break;  // finished before reaching the target
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 4000));
      kill(pid, SIGKILL);
      if (test::wait_for(pid) == 0) break;
      ++kills;
      // Whatever the moment, the directory holds a sound latest checkpoint (or none yet).
      if (fs::exists(out + "/checkpoints/latest")) {
        auto v = run_keel("ckpt verify " + out + "/checkpoints");
        INFO(v.output);
        REQUIRE(v.code == 0);
      }
    }
    auto last = run_keel(train_args(ws, out, every_step));  // finish (a no-op if already done)
    INFO(last.output);
    REQUIRE(last.code == 0);
    WARN("killed the run " << kills << " times");
    CHECK(kills >= 2);
    CHECK(test::losses_by_step(test::read_metrics(out + "/metrics.jsonl")) == reference);
    CHECK(run_keel("ckpt diff " + (ws.dir / "ref/checkpoints") + " " + out + "/checkpoints").code == 0);
  }
}

TEST_CASE("damaged checkpoints are refused by name, the run's other checkpoints are untouched", "[ckpt][cli][corrupt]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 8")).code == 4);  // saves step 4 and step 8
  const std::string good = out + "/checkpoints/step_00000004", bad = out + "/checkpoints/step_00000008";
  REQUIRE(fs::exists(good));

  SECTION("a flipped byte names the file and the tensor") {
    flip_byte_in(bad + "/optim-tp00-pp00-dp00.safetensors", "adam_m/layers.0.attn.wq");
    auto v = run_keel("ckpt verify " + bad);
    CHECK(v.code == 5);
    CHECK_THAT(v.output, Catch::Contains("optim-tp00-pp00-dp00.safetensors") &&
                             Catch::Contains("adam_m/layers.0.attn.wq is corrupt"));
    auto r = run_keel(train_args(ws, out));
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains("refusing to resume") && Catch::Contains("adam_m/layers.0.attn.wq"));
    // ckpt diff and inspect say so too, naming the side and the tensor (exit 5).
    auto d = run_keel("ckpt diff " + good + " " + bad);
    INFO(d.output);
    CHECK(d.code == 5);
    CHECK_THAT(d.output, Catch::Contains("DAMAGED: the second checkpoint, " + bad + ":\n") &&
                             Catch::Contains("adam_m/layers.0.attn.wq is corrupt") &&
                             Catch::Contains("(and verification fails: see above)"));
    auto i = run_keel("ckpt inspect " + bad);
    INFO(i.output);
    CHECK(i.code == 5);
    CHECK_THAT(i.output,
               Catch::Contains("DAMAGED: " + bad + ":\n") && Catch::Contains("adam_m/layers.0.attn.wq is corrupt"));
    CHECK_THAT(run_keel("ckpt inspect " + good).output,
               Catch::Contains("every checksum matches and every value is finite"));
    // --no-verify reads meta.json and the headers only: no data, so it neither finds the damage
    // (in the weights too now) nor prints statistics, and it says so.
    flip_byte_in(bad + "/model-tp00-pp00.safetensors", "weight/layers.0.attn.wq");
    auto n = run_keel("ckpt inspect --no-verify " + bad);
    INFO(n.output);
    CHECK(n.code == 0);
    CHECK_THAT(n.output, Catch::Contains("iteration 8,") && Catch::Contains("states present: adam_m, adam_v, master, weight"));
    CHECK_THAT(n.output, Catch::Contains("\n  layers.0.attn.wq                   [32, 32]         bf16   yes yes yes\n"));
    CHECK_THAT(n.output, Catch::Contains("\n  data not verified (--no-verify): only meta.json and the files' sizes and "
                                         "headers were read; no checksum, value or statistic"));
    CHECK_THAT(n.output, !Catch::Contains("norm          min") && !Catch::Contains("DAMAGED") && !Catch::Contains("every checksum"));
    // So does diff --no-verify: the same tensors, shapes and dtypes, another progress (a
    // difference: exit 1), and not a word on the data, which it neither compared nor verified.
    auto nd = run_keel("ckpt diff --no-verify " + good + " " + bad);
    INFO(nd.output);
    CHECK(nd.code == 1);
    CHECK_THAT(nd.output, Catch::Contains("progress differs: iteration 4 vs 8") &&
                              Catch::Contains("\nheaders differ: ") &&
                              Catch::Contains(" compared by name, shape and stored dtype, but the progress differs "
                                              "(above); data not read or verified (--no-verify)"));
    CHECK_THAT(nd.output, !Catch::Contains("DAMAGED") && !Catch::Contains("bitwise") && !Catch::Contains("differs in"));
  }
  SECTION("a damaged checkpoint outside the run: nothing there to turn to") {
    const std::string copy = ws.dir / "copy";
    fs::copy(bad, copy, fs::copy_options::recursive);
    flip_byte_in(copy + "/optim-tp00-pp00-dp00.safetensors", "adam_v/layers.0.attn.wq");
    for (const std::string flag : {"--resume", "--init-from"}) {
      auto r = run_keel(train_args(ws, ws.dir / "fresh", flag + " " + copy));
      INFO(r.output);
      CHECK(r.code == 5);
      CHECK_THAT(r.output, Catch::Contains("adam_v/layers.0.attn.wq is corrupt") &&
                               Catch::Contains("Nothing was changed; pass another checkpoint with " + flag + "."));
      CHECK_THAT(r.output, !Catch::Contains("other checkpoints in"));
      CHECK_FALSE(fs::exists(ws.dir / "fresh"));
    }
  }
  SECTION("a flipped byte in a file's header: the file's checksum says it is damaged") {
    const std::string file = bad + "/model-tp00-pp00.safetensors";
    std::string bytes = test::read_file(file);
    uint64_t header = 0;
    std::memcpy(&header, bytes.data(), 8);
    const size_t at = bytes.find("final_norm");
    REQUIRE(at < 8 + header);  // a name in the header
    bytes[at + 5] = '^';
    std::ofstream(file, std::ios::binary) << bytes;
    auto v = run_keel("ckpt verify " + bad);
    INFO(v.output);
    CHECK(v.code == 5);
    CHECK_THAT(v.output, Catch::Contains("checkpoint file " + file + " is damaged: its checksum is ") &&
                             Catch::Contains("(reading its header: the chunk table names"));
    // The headers are read without --no-verify's data, so a damaged one is refused all the same.
    auto n = run_keel("ckpt inspect --no-verify " + bad);
    CHECK(n.code == 5);
    CHECK_THAT(n.output, Catch::Contains("checkpoint file " + file + " is damaged"));
  }
  SECTION("a published checkpoint without meta.json lost it: it was not interrupted") {
    fs::remove(bad + "/meta.json");
    auto r = run_keel(train_args(ws, out, "--resume " + bad));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(bad + " is not a complete checkpoint: its meta.json is missing (deleted"));
    CHECK_THAT(r.output, !Catch::Contains("interrupted"));
  }
  // Intact files holding inf or NaN were saved so: no checksum catches them, verify does (and
  // so every load), naming each tensor with its counts.
  SECTION("values saved as NaN or inf: verify, inspect and a resume refuse, naming the tensor and the count") {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    test::set_saved_value(bad, "optim-tp00-pp00-dp00.safetensors", "adam_v/layers.1.mlp.w_up", 3, nan);
    test::set_saved_value(bad, "optim-tp00-pp00-dp00.safetensors", "adam_v/layers.1.mlp.w_up", 5, inf);
    test::set_saved_value(bad, "model-tp00-pp00.safetensors", "weight/final_norm.weight", 0, -inf);
    for (const std::string cmd : {"verify", "inspect"}) {
      auto v = run_keel("ckpt " + cmd + " " + bad);
      INFO(v.output);
      CHECK(v.code == 5);
      CHECK_THAT(v.output, Catch::Contains("NON-FINITE: " + bad + ":\n") &&
                               Catch::Contains("adam_v/layers.1.mlp.w_up holds 1 NaN and 1 inf among its 2048 "
                                               "values") &&
                               Catch::Contains("weight/final_norm.weight holds 0 NaN and 1 inf among its 32 values") &&
                               Catch::Contains("the values were saved so"));
      CHECK_THAT(v.output, !Catch::Contains("DAMAGED") && !Catch::Contains("corrupt"));
    }
    auto r = run_keel(train_args(ws, out, "--resume " + bad));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output,
               Catch::Contains("refusing to resume from checkpoint " + bad + ", which holds non-finite values:") &&
                   Catch::Contains("adam_v/layers.1.mlp.w_up holds 1 NaN"));
  }
  SECTION("a truncated file names the file") {
    fs::resize_file(bad + "/model-tp00-pp00.safetensors", fs::file_size(bad + "/model-tp00-pp00.safetensors") - 64);
    auto v = run_keel("ckpt verify " + bad);
    CHECK(v.code == 5);
    CHECK_THAT(v.output, Catch::Contains("DAMAGED: " + bad + ":") && Catch::Contains("model-tp00-pp00.safetensors") &&
                             Catch::Contains("truncated"));
    CHECK(run_keel(train_args(ws, out)).code == 5);
  }
  SECTION("a missing file names the file") {
    fs::remove(bad + "/optim-tp00-pp00-dp00.safetensors");
    auto v = run_keel("ckpt verify " + bad);
    CHECK(v.code == 5);
    CHECK_THAT(v.output, Catch::Contains("DAMAGED: " + bad + ":") &&
                             Catch::Contains("optim-tp00-pp00-dp00.safetensors is missing"));
    auto r = run_keel(train_args(ws, out, "--resume " + bad));
    CHECK(r.code == 5);
  }
  // The older checkpoint is intact and still resumes.
  CHECK(run_keel("ckpt verify " + good).code == 0);
  auto r = run_keel(train_args(ws, ws.dir / "from-good", "--resume " + good));
  INFO(r.output);
  CHECK(r.code == 0);
}

// The `latest` pointer is the only record of which trajectory is current: after a rewind the
// highest step_* belongs to the abandoned one. A pointer that cannot be followed is refused with
// what it says and the checkpoints there, never replaced by a guess.
TEST_CASE("a latest pointer that cannot be followed is refused by name, never replaced by the highest step",
          "[ckpt][cli][latest]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 8")).code == 4);  // step 4 and step 8, latest = step 8
  auto refused = [&](const std::string& says) {
    auto r = run_keel(train_args(ws, out, "--stop-at 12"));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(dir + "/latest " + says) && Catch::Contains("step_00000004") &&
                             Catch::Contains("--resume " + dir + "/step_0000000"));
    CHECK_FALSE(fs::exists(dir + "/step_00000012"));
    CHECK(fs::exists(dir + "/step_00000004"));
  };
  SECTION("garbage") {
    std::ofstream(dir + "/latest") << "garb\x01" "age\n";
    refused("names \"garb\\x01age\", which is not a step_* checkpoint in " + dir);
  }
  SECTION("empty") {
    std::ofstream(dir + "/latest") << "";
    refused("is empty");
  }
  SECTION("a missing checkpoint") {
    fs::remove_all(dir + "/step_00000008");
    refused("names \"step_00000008\", which does not exist");
  }
  SECTION("an incomplete checkpoint") {
    fs::remove(dir + "/step_00000008/meta.json");
    refused("names \"step_00000008\", which is not a complete checkpoint");
    CHECK(fs::exists(dir + "/step_00000008/model-tp00-pp00.safetensors"));
  }
  // Only the name of a step_* directory beside the pointer is followed: not another run's
  // checkpoint by a relative or absolute path, not another folder of the directory.
  SECTION("a checkpoint outside the directory") {
    std::ofstream(dir + "/latest") << "../../elsewhere/checkpoints/step_00000004\n";
    refused("names \"../../elsewhere/checkpoints/step_00000004\", which is not a step_* checkpoint in " + dir);
  }
  SECTION("an absolute path, even to a checkpoint of this directory") {
    std::ofstream(dir + "/latest") << dir + "/step_00000004\n";
    refused("names \"" + dir + "/step_00000004\", which is not a step_* checkpoint in " + dir +
            " (keel only follows a pointer to one beside it: the file holds its name, e.g. step_00000004)");
  }
  SECTION("a complete checkpoint not named step_*") {
    fs::copy(dir + "/step_00000004", dir + "/elsewhere", fs::copy_options::recursive);
    std::ofstream(dir + "/latest") << "elsewhere\n";
    refused("names \"elsewhere\", which is not a step_* checkpoint in " + dir);
  }
  SECTION("no pointer at all: the newest complete checkpoint, with a note") {
    fs::remove(dir + "/latest");
    auto r = run_keel(train_args(ws, out, "--stop-at 12"));
    INFO(r.output);
    CHECK(r.code == 4);
    CHECK_THAT(r.output, Catch::Contains("no `latest` pointer in " + dir) &&
                             Catch::Contains("resuming from " + dir + "/step_00000008"));
  }
  SECTION("--resume given the pointer file follows it") {
    auto r = run_keel(train_args(ws, ws.dir / "other", "--stop-at 12 --resume " + dir + "/latest"));
    INFO(r.output);
    CHECK(r.code == 4);
    CHECK_THAT(r.output, Catch::Contains("resuming from " + dir + "/step_00000008"));
  }
}

// Rewinding (--resume of an earlier step) starts a new trajectory. The abandoned run's higher
// steps are moved, whole, into one folder beside the others (said at start-up): this run's saves
// of the same steps never replace them, rotation never sees them, and one rm -r removes them.
// keep_last counts the new trajectory's saves: the checkpoint rewound to stays until keep_last
// newer saves exist.
TEST_CASE("after a rewind the abandoned run's steps are set aside whole and keep_last keeps the point rewound to",
          "[ckpt][cli][rotate]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  auto names_in = [&](const std::string& d) {  // but the runs' lock file (.lock)
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().filename() != ".lock") names.insert(e.path().filename().string());
    return names;
  };
  const std::string every = "--steps 10 --set checkpoint.interval=2 --set checkpoint.keep_last=2 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--set checkpoint.keep_last=3 --stop-at 6")).code == 4);
  REQUIRE(names_in(dir) == std::set<std::string>{"latest", "step_00000002", "step_00000004", "step_00000006"});
  const std::string saved_step4 = test::read_file(dir + "/step_00000004/meta.json");

  // Rewound to step 2 and stopped at once, before any save: the abandoned 4 and 6 are in one
  // folder, and `latest` names step 2, so a restart (a requeue) resumes where this run did.
  auto r = run_keel(train_args(ws, out, every + "--set optimizer.lr=1e-3 --resume " + dir + "/step_00000002 --stop-at 3"));
  INFO(r.output);
  REQUIRE(r.code == 4);
  const std::string said = "resuming at step 2 abandons the 2 later checkpoints step_00000004 step_00000006 in " + dir +
                           ": moved, whole, to " + dir + "/abandoned-after-step_00000002-";
  REQUIRE_THAT(r.output, Catch::Contains(said));
  const size_t at = r.output.find(said) + said.size() - std::string("abandoned-after-step_00000002-").size();
  const std::string folder = r.output.substr(at, r.output.find(' ', at) - at);
  CHECK_THAT(r.output, Catch::Contains("Remove it when they are no longer wanted: rm -r " + dir + "/" + folder));
  CHECK(names_in(dir + "/" + folder) == std::set<std::string>{"step_00000004", "step_00000006"});
  CHECK(names_in(dir) == std::set<std::string>{"latest", "step_00000002", "step_00000003", folder});

  // Continued to step 8: the new trajectory's saves of steps 4 and 6 leave the abandoned ones
  // as they were, and keep_last=2 holds its last two saves (6 and 8); 2, 3 and 4 go.
  auto c = run_keel(train_args(ws, out, every + "--set optimizer.lr=1e-3 --stop-at 8"));
  INFO(c.output);
  REQUIRE(c.code == 4);
  CHECK_THAT(c.output, !Catch::Contains("abandons"));
  CHECK(names_in(dir) == std::set<std::string>{"latest", "step_00000006", "step_00000008", folder});
  CHECK(test::read_file(dir + "/" + folder + "/step_00000004/meta.json") == saved_step4);
  // The saves in order, across the three runs and the set-aside: 2, 4, 6 (0 to 2), then 3, then
  // 4, 6, 8 of the new trajectory (save_seq orders them, whatever the clocks of their nodes say).
  auto save_seq = [](const std::string& ck) {
    return nlohmann::json::parse(test::read_file(ck + "/meta.json")).at("save_seq").get<int64_t>();
  };
  CHECK(save_seq(dir + "/" + folder + "/step_00000004") == 1);
  CHECK(save_seq(dir + "/" + folder + "/step_00000006") == 2);
  CHECK(save_seq(dir + "/step_00000006") == 5);
  CHECK(save_seq(dir + "/step_00000008") == 6);
  // The abandoned checkpoints are whole: one of them still verifies.
  CHECK(run_keel("ckpt verify " + dir + "/" + folder + "/step_00000006").code == 0);
}

// A resume from a checkpoint outside the run's directory (another run's; one a rewind set aside)
// has no known past among the directory's checkpoints: keep_last would remove them, `latest` and
// all, as if they were. They are set aside whole, as a rewind's later steps are.
TEST_CASE("a resume from another run's checkpoint sets the directory's own checkpoints aside, never rotates them away",
          "[ckpt][cli][rotate]") {
  test::Workspace ws(kRun);
  const std::string mine = ws.dir / "mine", theirs = ws.dir / "theirs", dir = mine + "/checkpoints";
  const std::string every = "--set checkpoint.interval=2 --set checkpoint.keep_last=2 ";
  REQUIRE(run_keel(train_args(ws, mine, every + "--steps 4")).code == 0);
  REQUIRE(run_keel(train_args(ws, theirs, every + "--steps 6")).code == 0);
  const std::string kept4 = test::read_file(dir + "/step_00000004/meta.json");
  auto r = run_keel(train_args(ws, mine, every + "--steps 12 --resume " + theirs + "/checkpoints/step_00000006"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::string said = "resuming at step 6 from " + theirs + "/checkpoints/step_00000006, which is not one of " +
                           dir + "'s checkpoints, abandons the 2 checkpoints step_00000002 step_00000004 there "
                           "(nothing says which of them are its past): moved, whole, to " + dir +
                           "/abandoned-after-step_00000006-";
  REQUIRE_THAT(r.output, Catch::Contains(said));
  const size_t at = r.output.find(said) + said.size() - std::string("abandoned-after-step_00000006-").size();
  const std::string folder = dir + "/" + r.output.substr(at, r.output.find(' ', at) - at);
  CHECK(test::read_file(folder + "/step_00000004/meta.json") == kept4);
  CHECK(fs::exists(folder + "/step_00000002/meta.json"));
  CHECK(test::read_file(dir + "/latest") == "step_00000012\n");
  CHECK(fs::exists(dir + "/step_00000010") + fs::exists(dir + "/step_00000012") == 2);
  CHECK_FALSE(fs::exists(dir + "/step_00000008"));  // this run's own saves rotate as ever

  // Resumed from the directory's own checkpoint, a save of a lower step made after it (none
  // here: save order) is not its past either; its earlier saves are, and rotate.
  auto again = run_keel(train_args(ws, mine, every + "--steps 14"));
  INFO(again.output);
  CHECK(again.code == 0);
  CHECK_THAT(again.output, !Catch::Contains("abandons"));
}

// A kill between a save's rename into place and the update of `latest` leaves `latest` one save
// behind. The newer checkpoint is complete and numbered after it (save_seq): the restart resumes
// from it, and says why, rather than take it for an abandoned run and set it aside.
TEST_CASE("a save published but not yet named by latest (a kill between the two) is resumed from, not abandoned",
          "[ckpt][cli][rotate]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  const std::string every = "--steps 12 --set checkpoint.interval=4 --set checkpoint.keep_last=5 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--stop-at 8")).code == 4);
  std::ofstream(dir + "/latest") << "step_00000004\n";  // as the kill left it
  auto r = run_keel(train_args(ws, out, every));
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains(dir + "/latest names step_00000004, but step_00000008 was saved after it and is "
                                             "complete") &&
                           Catch::Contains("resuming from " + dir + "/step_00000008") && !Catch::Contains("abandons"));
  CHECK(test::read_file(dir + "/latest") == "step_00000012\n");
  // Two later saves are not what an interrupted save leaves: `latest` is followed as it is.
  std::ofstream(dir + "/latest") << "step_00000004\n";
  auto told = run_keel(train_args(ws, out, "--steps 14 --set checkpoint.interval=4 --set checkpoint.keep_last=5"));
  INFO(told.output);
  CHECK_THAT(told.output, Catch::Contains("resuming from " + dir + "/step_00000004") && Catch::Contains("abandons"));
}

// A resume refused for damage in the run's newest checkpoint (a flipped byte, a file truncated by
// a full disk or a copy) says which of the run's other checkpoints to continue from: the newest
// intact one, with the damaged ones marked, whichever check found the damage.
TEST_CASE("a refused resume from a damaged checkpoint names the newest intact one to continue from",
          "[ckpt][cli][corrupt]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  const std::string every = "--steps 16 --set checkpoint.interval=4 --set checkpoint.keep_last=5 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--stop-at 12")).code == 4);  // steps 4, 8 and 12, latest = 12
  const std::string optim = "/optim-tp00-pp00-dp00.safetensors";
  SECTION("a flipped byte") {
    flip_byte_in(dir + "/step_00000012" + optim, "adam_m/layers.0.attn.wq");
    auto r = run_keel(train_args(ws, out, every));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains("adam_m/layers.0.attn.wq is corrupt") &&
                             Catch::Contains("--resume " + dir + "/step_00000008"));
  }
  SECTION("a truncated file, and a damaged older one passed over") {
    fs::resize_file(dir + "/step_00000012" + optim, 1000);
    fs::resize_file(dir + "/step_00000008" + optim, 1000);
    auto r = run_keel(train_args(ws, out, every));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(dir + "/step_00000012" + optim + " has 1000 bytes") &&
                             Catch::Contains("step_00000004 step_00000008 (damaged: " + optim.substr(1) +
                                             " has 1000 bytes") &&
                             Catch::Contains("--resume " + dir + "/step_00000004"));
  }
  CHECK_FALSE(fs::exists(dir + "/step_00000016"));
  CHECK(test::read_file(dir + "/latest") == "step_00000012\n");
}

// A damaged meta.json says nothing reliable about when its checkpoint was saved: the checkpoint
// `latest` names is refused by name when its meta.json is damaged, not passed over for an older
// one "saved after it" (which trained the steps since again and set the newest aside), and a
// damaged save_seq of an older one does not make it the one to continue from.
TEST_CASE("the checkpoint latest names with a damaged meta.json is refused and not taken for an older save",
          "[ckpt][cli][corrupt][latest]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  const std::string every = "--steps 12 --set checkpoint.interval=4 --set checkpoint.keep_last=5 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--stop-at 8")).code == 4);  // step 4 and step 8, latest = step 8
  SECTION("the newest one's meta.json truncated") {
    fs::resize_file(dir + "/step_00000008/meta.json", 4000);
    auto r = run_keel(train_args(ws, out, every));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(dir + "/step_00000008/meta.json is corrupt (not valid JSON)") &&
                             !Catch::Contains("saved after it") && !Catch::Contains("abandons"));
    CHECK(fs::exists(dir + "/step_00000008/model-tp00-pp00.safetensors"));
    CHECK_FALSE(fs::exists(dir + "/step_00000012"));
    CHECK(test::read_file(dir + "/latest") == "step_00000008\n");
  }
  SECTION("an older one's save_seq changed without its checksum") {
    nlohmann::json meta = nlohmann::json::parse(test::read_file(dir + "/step_00000004/meta.json"));
    meta["save_seq"] = 7;
    std::ofstream(dir + "/step_00000004/meta.json") << meta.dump(2);
    auto r = run_keel(train_args(ws, out, every));
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("resuming from " + dir + "/step_00000008") && !Catch::Contains("saved after it"));
  }
}

// A checkpoint copied in from another run can be numbered after the one `latest` names (that run
// saved more often): it is not this run's interrupted save, which is always of a later step and
// saved into this directory (or the one latest's was saved into, for a run directory moved since).
TEST_CASE("a checkpoint copied in from another run is not taken for this run's save interrupted before latest",
          "[ckpt][cli][latest]") {
  test::Workspace ws(kRun);
  const std::string other = ws.dir / "other", out = ws.dir / "run", dir = out + "/checkpoints";
  REQUIRE(run_keel(train_args(ws, other, "--set checkpoint.interval=2 --set checkpoint.keep_last=10 --stop-at 12")).code ==
          4);  // save_seq 0 to 5
  const std::string every = "--steps 16 --set checkpoint.keep_last=5 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--stop-at 8")).code == 4);  // step 4 and step 8 (save_seq 1), latest
  const std::string step = GENERATE(as<std::string>{}, "step_00000006", "step_00000012");
  INFO("copied: " << step);
  fs::copy(other + "/checkpoints/" + step, dir + "/" + step, fs::copy_options::recursive);
  auto r = run_keel(train_args(ws, out, every + "--stop-at 12"));
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("resuming from " + dir + "/step_00000008") && !Catch::Contains("saved after it"));
}

// A damaged checkpoint (a truncated copy, a full disk) is no checkpoint to suggest or fall back
// on: with `latest` unreadable the list marks it and suggests the newest intact one; with no
// `latest` at all the run continues from that one and names the damaged newer one.
TEST_CASE("a damaged checkpoint is marked in the list and passed over when there is no latest to follow",
          "[ckpt][cli][corrupt]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  const std::string every = "--steps 12 --set checkpoint.interval=4 --set checkpoint.keep_last=5 ";
  REQUIRE(run_keel(train_args(ws, out, every + "--stop-at 8")).code == 4);
  const std::string file = dir + "/step_00000008/model-tp00-pp00.safetensors";
  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 1000);
  const std::string damage = "(damaged: model-tp00-pp00.safetensors has " + std::to_string(size - 1000) +
                             " bytes, not the " + std::to_string(size) + " saved)";
  std::ofstream(dir + "/latest") << "";
  auto r = run_keel(train_args(ws, out, every));
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("step_00000004 step_00000008 " + damage) &&
                           Catch::Contains("--resume " + dir + "/step_00000004 (or another of them)"));
  fs::remove(dir + "/latest");
  r = run_keel(train_args(ws, out, every));
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("continuing from the newest complete checkpoint there, step_00000004, past the "
                                       "damaged newer step_00000008 (model-tp00-pp00.safetensors has") &&
                           Catch::Contains("resuming from " + dir + "/step_00000004"));
}

// A rewind past many saves names the first few abandoned checkpoints and their count.
TEST_CASE("after a rewind past many checkpoints the abandoned ones are named in short and set aside together",
          "[ckpt][cli][rotate]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  REQUIRE(run_keel(train_args(ws, out, "--steps 40 --set checkpoint.interval=1 --set checkpoint.keep_last=100")).code == 0);
  auto r = run_keel(train_args(ws, out, "--steps 40 --set checkpoint.interval=1 --set checkpoint.keep_last=100 --resume " +
                                            dir + "/step_00000002 --stop-at 3"));
  INFO(r.output);
  REQUIRE(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("resuming at step 2 abandons the 38 later checkpoints step_00000003 step_00000004 "
                                       "step_00000005 ... and 35 more up to step_00000040 in " + dir + ": moved"));
  std::set<std::string> names;
  std::string folder;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with("abandoned-")) folder = n;
    else if (n != ".lock") names.insert(n);  // the runs' lock file aside
  }
  CHECK(names == std::set<std::string>{"latest", "step_00000001", "step_00000002", "step_00000003"});
  REQUIRE_FALSE(folder.empty());
  CHECK(std::distance(fs::directory_iterator(dir + "/" + folder), fs::directory_iterator()) == 38);
}

// A run started with relative paths records them resolved against its directory: its
// config.json and meta.json name the run directory and the data from anywhere, so the run
// resumes from another directory with its own config.json.
TEST_CASE("relative --out and data paths are recorded resolved, and the run resumes from another directory",
          "[ckpt][cli][resume]") {
  test::Workspace ws(kRun);
  fs::create_directories(ws.dir / "a/data");
  fs::create_directories(ws.dir / "b");
  fs::copy_file(ws.dir / "train.bin", ws.dir / "a/data/train.bin");
  nlohmann::json j = ws.json;
  j["data"] = {{"train", "data/train.bin"}};
  std::ofstream(ws.dir / "a/rel.json") << j.dump(2);
  auto first = test::run_shell("cd " + (ws.dir / "a") + " && " + KEEL_BINARY +
                               " train --config rel.json --out ./run -q --stop-at 8");
  INFO(first.output);
  REQUIRE(first.code == 4);
  const std::string run = ws.dir / "a/run", data = ws.dir / "a/data/train.bin";
  const nlohmann::json recorded = nlohmann::json::parse(std::ifstream(run + "/config.json"));
  CHECK(recorded["out"] == run);
  CHECK_FALSE(recorded["checkpoint"].contains("dir"));  // the default, <out>/checkpoints, follows out
  CHECK(recorded["data"]["train"] == nlohmann::json::array({data}));
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(run + "/checkpoints/step_00000008/meta.json"));
  CHECK(meta["config"]["out"] == run);
  CHECK(meta["config"]["data"]["train"] == nlohmann::json::array({data}));

  auto second = test::run_shell("cd " + (ws.dir / "b") + " && " + KEEL_BINARY + " train --config " + run +
                                "/config.json --steps 12");
  INFO(second.output);
  CHECK(second.code == 0);
  CHECK_THAT(second.output, Catch::Contains("resuming from " + run + "/checkpoints/step_00000008"));
  CHECK(fs::exists(run + "/checkpoints/step_00000012"));
  CHECK(fs::is_empty(ws.dir / "b"));

  // The recorded config run with another --out is a new run: it neither resumes from nor saves
  // into (nor prunes) the first run's checkpoints.
  const std::string other = ws.dir / "c";
  auto third = run_keel("train --config " + run + "/config.json --out " + other + " --steps 2");
  INFO(third.output);
  CHECK(third.code == 0);
  CHECK_THAT(third.output, !Catch::Contains("resuming from"));
  CHECK(fs::exists(other + "/checkpoints/step_00000002"));
  CHECK_FALSE(fs::exists(run + "/checkpoints/step_00000002"));
  CHECK(test::read_file(run + "/checkpoints/latest") == "step_00000012\n");
}

// After more fp16 overflows than precision.loss_scale.hysteresis with no growth in between, keels
// before this fix saved a negative hysteresis tracker, which their own loader then refused (exit
// 5): the save at an exhausted scale (exit 6) could not be resumed. Such checkpoints must load.
TEST_CASE("an fp16 checkpoint whose loss scaler's hysteresis tracker went below zero verifies and resumes",
          "[ckpt][cli][meta][precision]") {
  nlohmann::json run = kRun;
  run["precision"]["mode"] = "fp16";
  test::Workspace ws(run);
  const std::string out = ws.dir / "run", ck = out + "/checkpoints/step_00000004";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["loss_scaler"]["hysteresis_tracker"] = -2; });
  auto v = run_keel("ckpt verify " + ck);
  INFO(v.output);
  CHECK(v.code == 0);
  auto r = run_keel(train_args(ws, out, "--resume " + ck + " --steps 6"));
  INFO(r.output);
  CHECK(r.code == 0);
}

// meta.json holds where the run is (iteration, data position, Adam step) and every file's
// checksum: a flipped bit in it is caught by its own checksum, and a field of the wrong type or
// range (even with a valid checksum) is named, with exit code 5, by verify and by a resume.
TEST_CASE("meta.json has a checksum of its own, and a malformed field is named with the file", "[ckpt][cli][meta]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", ck = out + "/checkpoints/step_00000004";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  const std::string meta_path = ck + "/meta.json";
  auto refused = [&](const std::string& says) {
    auto v = run_keel("ckpt verify " + ck);
    INFO(v.output);
    CHECK(v.code == 5);
    CHECK_THAT(v.output, Catch::Contains(meta_path) && Catch::Contains(says));
    auto r = run_keel(train_args(ws, ws.dir / "resumed", "--resume " + ck));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(meta_path) && Catch::Contains(says));
    CHECK_FALSE(fs::exists(ws.dir / "resumed/metrics.jsonl"));
  };
  SECTION("one flipped bit in the iteration") {
    std::string text = test::read_file(meta_path);
    const size_t at = text.find("\"iteration\": 4");
    REQUIRE(at != std::string::npos);
    text[at + 13] ^= 1;  // 4 -> 5
    std::ofstream(meta_path, std::ios::binary) << text;
    refused("is damaged or was edited after the save");
  }
  SECTION("a negative iteration") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["progress"]["iteration"] = -3; });
    refused("field progress.iteration: is -3, which is negative");
  }
  SECTION("more Adam steps than iterations") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["adam_step"] = 9; });
    refused("field adam_step: is 9, more than progress.iteration 4");
  }
  SECTION("a field of the wrong type") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["adam_step"] = "six"; });
    refused("field adam_step: expected an integer, got a string \"six\"");
  }
  SECTION("a missing section") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m.erase("progress"); });
    refused("field progress: missing");
  }
  // Global batch and seq_len may change on resume and a rewind skips samples, so no schedule
  // fixes the count; but the data section repeats it, and no iteration reads less than a sample.
  SECTION("a data position that disagrees with itself") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["data"]["consumed_samples"] = 40; });
    refused("field data.consumed_samples: is 40, progress.consumed_samples 32 (both record the data position");
  }
  // A blend's history (data.blend) maps every sample to its source: a segment after the data
  // position, one that goes back, or a weight a blend cannot take would read other data.
  SECTION("a blend history that does not hold together") {
    const auto blend = [&](const char* history) {
      test::edit_checkpoint_meta(ck, [&](nlohmann::json& m) { m["data"]["blend"] = nlohmann::json::parse(history); });
    };
    blend(R"([{"from_sample": 0, "weights": [1, 1]}, {"from_sample": 40, "weights": [1, 2]}])");
    refused("field data.blend[1].from_sample: is 40, after progress.consumed_samples 32");
    blend(R"([{"from_sample": 0, "weights": [1, 1]}, {"from_sample": 16, "weights": [1, 2]}, {"from_sample": 8, "weights": [1, 2]}])");
    refused("field data.blend[2].from_sample: is 8, not after the previous segment's 16");
    blend(R"([{"from_sample": 0, "weights": [1, -1]}])");
    refused("field data.blend[0].weights: expected two or more positive numbers, got [1,-1]");
    blend(R"([{"from_sample": 0, "weights": [1, 1]}, {"from_sample": 8, "weights": [1, 2, 3]}])");
    refused("field data.blend[1].weights: has 3 weights, the first segment 2");
  }
  SECTION("fewer samples consumed than iterations") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) {
      m["progress"]["consumed_samples"] = 3;
      m["data"]["consumed_samples"] = 3;
    });
    refused("field progress.consumed_samples: is 3, fewer than progress.iteration 4");
  }
  SECTION("fewer tokens consumed than samples") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["progress"]["consumed_tokens"] = 31; });
    refused("field progress.consumed_tokens: is 31, fewer than progress.consumed_samples 32");
  }
  // A meta.json whose model was edited to another shape (to resume a changed model): each
  // tensor is named once, with both shapes, not once per state and element count.
  SECTION("a model edited to another shape") {
    test::edit_checkpoint_meta(ck, [](nlohmann::json& m) { m["config"]["model"]["ffn_hidden"] = 96; });
    auto v = run_keel("ckpt verify " + ck);
    INFO(v.output);
    CHECK(v.code == 5);
    const std::string line = "does not match the model in its meta.json: tensor layers.0.mlp.w_gate: checkpoint has "
                             "shape [64, 32], the model expects [96, 32]";
    CHECK_THAT(v.output, Catch::Contains(line) && Catch::Contains("tensor layers.1.mlp.w_down: checkpoint has shape"));
    CHECK_THAT(v.output, !Catch::Contains("elements"));
    size_t lines = 0;
    for (size_t at = v.output.find("layers.0.mlp.w_gate"); at != std::string::npos;
         at = v.output.find("layers.0.mlp.w_gate", at + 1))
      ++lines;
    CHECK(lines == 1);
    auto r = run_keel(train_args(ws, ws.dir / "resumed", "--set model.ffn_hidden=96 --resume " + ck));
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains(line));
  }
  SECTION("a checkpoint saved before meta.json had a checksum still loads, and verify says so") {
    nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
    REQUIRE(meta.contains("meta_crc32c"));
    meta.erase("meta_crc32c");
    std::ofstream(meta_path) << meta.dump(2);
    auto v = run_keel("ckpt verify " + ck);
    INFO(v.output);
    CHECK(v.code == 0);
    CHECK_THAT(v.output, Catch::Contains("no checksum of its own"));
    auto r = run_keel(train_args(ws, ws.dir / "resumed", "--resume " + ck + " --stop-at 6"));
    INFO(r.output);
    CHECK(r.code == 4);
  }
}

// Two runs with one --out (a Slurm requeue while the old job is still tearing down) would
// overwrite each other's checkpoints: the second is refused while the first holds the lock.
TEST_CASE("a second run in a run directory whose lock is held is refused, naming the holder", "[ckpt][cli][lock]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  fs::create_directories(out);
  // Another process holds the lock, as a running keel would (flock locks belong to the open file).
  const int fd = ::open((out + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  const std::string record = R"({"host": "node17", "pid": 4242, "started": "2025-01-01T00:00:00Z"})";
  REQUIRE(::write(fd, record.data(), record.size()) == static_cast<ssize_t>(record.size()));
  auto r = run_keel(train_args(ws, out, "--stop-at 4"));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("another run is using the run directory " + out) &&
                           Catch::Contains("keel pid 4242 on node17"));
  CHECK_FALSE(fs::exists(out + "/metrics.jsonl"));
  CHECK_FALSE(fs::exists(out + "/checkpoints"));
  ::close(fd);  // the holder ends
  auto ok = run_keel(train_args(ws, out, "--stop-at 4"));
  INFO(ok.output);
  CHECK(ok.code == 4);
  const auto held = nlohmann::json::parse(test::read_file(out + "/.lock"));
  CHECK(held["pid"].get<int64_t>() != 4242);
  CHECK(held["host"] != "node17");
}

// A double-submitted job: the run going on publishes and rotates while the second one starts.
// The second is refused by the lock before it reads a checkpoint, not by the state of one the
// holder is removing ("incomplete: file ... is missing", as if the checkpoint were damaged).
TEST_CASE("a second run is refused by the lock before it reads the checkpoints the holder is rotating",
          "[ckpt][cli][lock]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  const std::string ckdir = GENERATE(as<std::string>{}, "", "shared_checkpoints");
  const std::string dir = ckdir.empty() ? out + "/checkpoints" : ws.dir / ckdir;
  const std::string set_dir = ckdir.empty() ? "" : "--set checkpoint.dir=" + dir + " ";
  REQUIRE(run_keel(train_args(ws, out, set_dir + "--stop-at 8")).code == 4);  // step 4 and step 8, latest = step 8
  // The holder's lock (of --out, or of the checkpoint.dir outside it), as a running keel holds it.
  const std::string held = ckdir.empty() ? out : dir;
  const int fd = ::open((held + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  // The holder is removing step 8 (rotation after a save the pointer does not name yet).
  fs::remove(dir + "/step_00000008/optim-tp00-pp00-dp00.safetensors");
  const std::string second_out = ckdir.empty() ? out : std::string(ws.dir / "second");
  auto r = run_keel(train_args(ws, second_out, set_dir + "--stop-at 12"));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("another run is using the " +
                                       std::string(ckdir.empty() ? "run directory " + out
                                                                 : "checkpoint directory " + dir)) &&
                           !Catch::Contains("is missing"));
  CHECK_FALSE(fs::exists(dir + "/step_00000012"));
  ::close(fd);
}

// Two runs with their own --out and one checkpoint.dir (shared storage, a copied config) would
// resume from each other's checkpoints and replace them: the checkpoint.dir has a lock too.
TEST_CASE("a second run whose checkpoint.dir outside --out is locked is refused before it writes a checkpoint",
          "[ckpt][cli][lock]") {
  test::Workspace ws(kRun);
  const std::string ckdir = ws.dir / "shared_checkpoints";
  REQUIRE(run_keel(train_args(ws, ws.dir / "first", "--stop-at 4 --set checkpoint.dir=" + ckdir)).code == 4);
  const int fd = ::open((ckdir + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  const std::string record = R"({"host": "node17", "pid": 4242, "started": "2025-01-01T00:00:00Z"})";
  REQUIRE(::write(fd, record.data(), record.size()) == static_cast<ssize_t>(record.size()));
  const std::string second = ws.dir / "second";
  auto r = run_keel(train_args(ws, second, "--stop-at 8 --set checkpoint.dir=" + ckdir));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("another run is using the checkpoint directory " + ckdir + " (checkpoint.dir)") &&
                           Catch::Contains("keel pid 4242 on node17") &&
                           Catch::Contains("give this run another checkpoint.dir"));
  CHECK_FALSE(fs::exists(second + "/metrics.jsonl"));
  CHECK_FALSE(fs::exists(ckdir + "/step_00000008"));
  CHECK(test::read_file(ckdir + "/latest") == "step_00000004\n");
  ::close(fd);
  auto ok = run_keel(train_args(ws, second, "--stop-at 8 --set checkpoint.dir=" + ckdir));
  INFO(ok.output);
  CHECK(ok.code == 4);
  CHECK(fs::exists(ckdir + "/step_00000008"));
  // Once free, the folder is the second run's to continue: it says whose checkpoints they were.
  CHECK_THAT(ok.output, Catch::Contains("checkpoint.dir " + ckdir + " holds the checkpoints of the run with --out " +
                                        (ws.dir / "first") + " (this run's is " + second + ")"));
}

// The default checkpoint directory (<out>/checkpoints) has its lock too: a run whose
// checkpoint.dir names another run's, or whose --out holds the checkpoint.dir of a run going on
// elsewhere, is refused while that run holds it (both resumed from and pruned the other's saves).
TEST_CASE("a run is refused the default checkpoint directory of a run that holds it, either way round",
          "[ckpt][cli][lock]") {
  test::Workspace ws(kRun);
  const std::string first = ws.dir / "first", ckdir = first + "/checkpoints";
  REQUIRE(run_keel(train_args(ws, first, "--stop-at 4")).code == 4);
  REQUIRE(fs::exists(ckdir + "/.lock"));
  // The first run goes on: it holds its checkpoint directory's lock (here, for it, this process).
  const int fd = ::open((ckdir + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
  const std::string record = R"({"host": "node17", "pid": 4242, "started": "2025-01-01T00:00:00Z"})";
  REQUIRE(::write(fd, record.data(), record.size()) == static_cast<ssize_t>(record.size()));
  SECTION("checkpoint.dir set to the other run's default one") {
    auto r = run_keel(train_args(ws, ws.dir / "second", "--stop-at 8 --set checkpoint.dir=" + ckdir));
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("another run is using the checkpoint directory " + ckdir) &&
                             Catch::Contains("keel pid 4242 on node17"));
  }
  SECTION("--out that holds the checkpoint.dir another run set") {
    // (the first run's --out lock is free: as if it ran with --out elsewhere and this checkpoint.dir)
    auto r = run_keel(train_args(ws, first, "--stop-at 8"));
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("another run is using the checkpoint directory " + ckdir));
  }
  CHECK_FALSE(fs::exists(ckdir + "/step_00000008"));
  CHECK(test::read_file(ckdir + "/latest") == "step_00000004\n");
  ::close(fd);
}

TEST_CASE("keel sample and keel eval refuse a checkpoint whose checksums fail, naming the tensor",
          "[ckpt][cli][corrupt]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", ck = out + "/checkpoints/step_00000004";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  test::write_stream_choice_items(ws.dir / "choices.jsonl", 4);
  const std::string sample = "sample --prompt-ids 1,2,3 -n 4 --checkpoint ";
  const std::string eval = "eval --choices " + (ws.dir / "choices.jsonl") + " --checkpoint ";
  REQUIRE(run_keel(sample + ck).code == 0);
  REQUIRE(run_keel(eval + ck).code == 0);
  flip_byte_in(ck + "/model-tp00-pp00.safetensors", "weight/lm_head");
  for (const std::string& cmd : {sample, eval}) {
    auto r = run_keel(cmd + ck);
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK_THAT(r.output, Catch::Contains("refusing to load a damaged checkpoint " + ck) &&
                             Catch::Contains("tensor weight/lm_head is corrupt"));
  }
}

TEST_CASE("an unwritable checkpoint.dir is refused before the first step", "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  std::ofstream(ws.dir / "a-file") << "not a directory";
  const std::string dir = ws.dir / "a-file/checkpoints";
  auto r = run_keel(train_args(ws, out, "--set checkpoint.dir=" + dir));
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("checkpoint.dir " + dir + " is not writable") &&
                           Catch::Contains("Not a directory") && Catch::Contains("nothing was trained"));
  CHECK(test::losses_by_step(test::read_metrics(out + "/metrics.jsonl")).empty());
}

TEST_CASE("a --stop-at the resumed run has passed is refused, and a stop after --resume says to drop it",
          "[ckpt][cli][stop]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 8")).code == 4);
  for (const char* at : {"6", "8"}) {
    auto r = run_keel(train_args(ws, out, std::string("--stop-at ") + at));
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(std::string("--stop-at ") + at + " is not after the checkpoint's iteration 8"));
    CHECK_FALSE(fs::exists(out + "/checkpoints/step_00000009"));
  }
  const std::string ck = out + "/checkpoints/step_00000004";
  auto rewound = run_keel(train_args(ws, out, "--resume " + ck + " --stop-at 6"));
  INFO(rewound.output);
  CHECK(rewound.code == 4);
  CHECK_THAT(rewound.output, Catch::Contains("run the same command without --resume " + ck +
                                             " and --stop-at 6 (or with a later --stop-at); it then resumes from the "
                                             "checkpoint just saved"));
  // The same command with the --stop-at just reached is refused: the advice leaves it out.
  auto plain = run_keel(train_args(ws, out, "--stop-at 7"));
  INFO(plain.output);
  CHECK(plain.code == 4);
  CHECK_THAT(plain.output, Catch::Contains("to continue, run the same command without --stop-at 7 (or with a later "
                                           "--stop-at) (exit code 4)"));
  CHECK(run_keel(train_args(ws, out, "--stop-at 9")).code == 4);
  // Stopped by a time limit (or a signal) before its --stop-at: the same command continues.
  auto limited = run_keel(train_args(ws, out, "--stop-at 40 --time-limit 0.0001"));
  INFO(limited.output);
  CHECK(limited.code == 4);
  CHECK_THAT(limited.output, Catch::Contains("run the same command again to resume"));
}

TEST_CASE("a checkpoint without optimizer state cannot be resumed, and says to use --init-from", "[ckpt][cli]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  // Make it a weights-only checkpoint, as a converted model would be.
  const std::string ck = out + "/checkpoints/step_00000004";
  fs::remove(ck + "/optim-tp00-pp00-dp00.safetensors");
  test::edit_checkpoint_meta(ck, [](nlohmann::json& meta) {
    meta["files"].erase("optim-tp00-pp00-dp00.safetensors");
    meta["states"] = {"weight"};
  });

  auto r = run_keel(train_args(ws, ws.dir / "resume", "--resume " + ck));
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("optimizer state is missing") && Catch::Contains("--init-from " + ck));
  auto f = run_keel(train_args(ws, ws.dir / "finetune", "--init-from " + ck));
  INFO(f.output);
  CHECK(f.code == 0);
  CHECK_THAT(f.output, Catch::Contains("initialised from") && Catch::Contains("Adam moments zero"));
}

// --init-from was not recorded in <out>/config.json: the config run again before the first save
// (a job preempted early, resubmitted from its run directory) started from a random initialisation.
TEST_CASE("a fresh run records --init-from in config.json: the run directory's config starts from the same weights",
          "[ckpt][cli][finetune]") {
  test::Workspace ws(kRun);
  REQUIRE(run_keel(train_args(ws, ws.dir / "pretrain", "--stop-at 4")).code == 4);
  const std::string ck = ws.dir / "pretrain/checkpoints/step_00000004";
  const std::string out = ws.dir / "finetune";
  const std::string no_saves = " --steps 2 --set checkpoint.interval=0 --set checkpoint.save_at_end=false";
  auto first = run_keel(train_args(ws, out, "--init-from " + ck + no_saves));
  INFO(first.output);
  REQUIRE(first.code == 0);
  const nlohmann::json recorded = nlohmann::json::parse(test::read_file(out + "/config.json"));
  CHECK(recorded["train"]["init_from"] == ck);
  // From another directory, with the recorded config only: the same weights, the same losses.
  auto again = run_keel("train --config " + out + "/config.json -q" + no_saves);
  INFO(again.output);
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("initialised from " + ck));
  const auto a = test::read_metrics(out + "/metrics.jsonl");
  std::vector<double> losses;
  for (const auto& rec : a)
    if (rec.contains("loss")) losses.push_back(rec["loss"].get<double>());
  REQUIRE(losses.size() == 4);  // both runs' two steps, appended
  CHECK(losses[0] == losses[2]);
  CHECK(losses[1] == losses[3]);
}

// Finetuning from a pretraining checkpoint reads other data, often at another seq_len: the
// probe batch is then another batch with another loss. Restart verification compares the probe
// loss only for the batch the checkpoint measured, and still checks the masters and norms.
TEST_CASE("finetuning from a checkpoint on other data or another seq_len is verified without the probe loss, and a "
          "tampered weight is still caught", "[ckpt][cli][health]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "pretrain";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  const std::string ck = out + "/checkpoints/step_00000004";
  data::write_llmc_shard(ws.dir / "sft.bin", test::synthetic_tokens(6000, 9), false);
  const std::string other = "--set data.train=" + (ws.dir / "sft.bin") + " --set train.seq_len=8 --steps 6 ";
  auto f = run_keel(train_args(ws, ws.dir / "finetune", other + "--init-from " + ck));
  INFO(f.output);
  CHECK(f.code == 0);
  CHECK_THAT(f.output, Catch::Contains("the probe batch is not the one the checkpoint measured") &&
                           Catch::Contains("restart verification passed: masters consistent with the weights, "
                                           "per-tensor norms as saved"));
  // The same data and shape: the probe loss is compared.
  auto same = run_keel(train_args(ws, ws.dir / "same", "--steps 6 --init-from " + ck));
  CHECK(same.code == 0);
  CHECK_THAT(same.output, Catch::Contains("probe loss and per-tensor norms as saved"));
  // A weight changed behind the checkpoint's back (its checksums rewritten, so that only the
  // verification can see it) is refused on other data too: its norm is not what was saved.
  test::edit_checkpoint_meta(ck, [](nlohmann::json& meta) {
    auto& sumsq = meta["health"]["tensor_sumsq"]["final_norm.weight"][0];
    sumsq = 1.5 * sumsq.get<double>();
  });
  auto bad = run_keel(train_args(ws, ws.dir / "bad", other + "--init-from " + ck));
  CHECK(bad.code == 5);
  CHECK_THAT(bad.output, Catch::Contains("final_norm.weight: |weights|^2"));
}

TEST_CASE("a save that hits a write error reports it, removes its partial files and keeps older checkpoints",
          "[ckpt][cli][io]") {
  // In the background (checkpoint.async) the writer thread meets the error; it is reported
  // when the save would be published, at the next step boundary.
  const std::string mode = GENERATE(as<std::string>{}, "", " --set checkpoint.async=true");
  INFO("mode:" << mode);
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  // A file-size limit below one optimizer file (~390 KB): writing the next save fails with EFBIG.
  const auto limited = test::run_shell("bash -c 'ulimit -f 200; exec " + std::string(KEEL_BINARY) + " " +
                                       train_args(ws, out, mode) + "'");
  INFO(limited.output);
  CHECK(limited.code == 5);
  CHECK_THAT(limited.output, Catch::Contains("saving checkpoint step_00000008") && Catch::Contains("File too large") &&
                         Catch::Contains("previous checkpoints are untouched"));
  CHECK(run_keel("ckpt verify " + out + "/checkpoints/step_00000004").code == 0);
  CHECK_FALSE(fs::exists(out + "/checkpoints/step_00000008"));
  CHECK_FALSE(fs::exists(out + "/checkpoints/.tmp-step_00000008"));
  CHECK(test::read_file(out + "/checkpoints/latest") == "step_00000004\n");
}

// A full disk when the run directory's config.json is written: the reason and the file are
// named (exit 2) and the config.json of the run before is whole (it is written aside, renamed).
TEST_CASE("a config.json that cannot be written is named with the reason and the earlier one is kept",
          "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  const std::string before = test::read_file(out + "/config.json");
  REQUIRE(before.size() > 1024);
  // A file-size limit of 1 KiB, below config.json: its write fails with EFBIG.
  const auto limited = test::run_shell("bash -c 'ulimit -f 1; exec " + std::string(KEEL_BINARY) + " " +
                                       train_args(ws, out, "--stop-at 8") + "'");
  INFO(limited.output);
  CHECK(limited.code == 2);
  CHECK_THAT(limited.output, Catch::Contains("cannot write '" + out + "/.config.json.tmp': File too large") &&
                                 Catch::Contains("nothing was trained"));
  CHECK(test::read_file(out + "/config.json") == before);
  CHECK_FALSE(fs::exists(out + "/checkpoints/step_00000008"));
}

// A full disk under the run directory: the metrics records that do not fit are dropped whole with
// a warning and the run goes on (a save fails on its own); the file holds only whole lines. A partial last line (left by a kill mid-write) is ended before new records are appended.
TEST_CASE("a metrics record that cannot be written is dropped whole and the run goes on", "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  fs::create_directories(out);
  std::ofstream(out + "/metrics.jsonl") << R"({"step": 3, "loss": 7.2, "lr)";  // cut short, no newline
  // A file-size limit of 4 KiB: config.json fits, metrics.jsonl fills up after a few steps (and a
  // checkpoint would not fit either: none is saved).
  const auto limited = test::run_shell("bash -c 'ulimit -f 4; exec " + std::string(KEEL_BINARY) + " " +
                                       train_args(ws, out, "--steps 12 --set checkpoint.interval=0 "
                                                           "--set checkpoint.save_at_end=false") + "'");
  INFO(limited.output);
  CHECK(limited.code == 0);
  CHECK_THAT(limited.output, Catch::Contains("WARNING cannot write " + out + "/metrics.jsonl: File too large") &&
                                 Catch::Contains("keel: done: 12 steps") &&
                                 Catch::Contains("metrics record(s) could not be written to " + out + "/metrics.jsonl"));
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  std::getline(in, line);
  CHECK(line == R"({"step": 3, "loss": 7.2, "lr)");
  int records = 0;
  while (std::getline(in, line)) {
    INFO(line);
    CHECK(nlohmann::json::accept(line));
    ++records;
  }
  CHECK(records > 0);
  CHECK(fs::file_size(out + "/metrics.jsonl") <= 4096);
}

TEST_CASE("keel eval --scores on a full disk fails naming the file, not exit 0 with the scores lost",
          "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  test::write_stream_choice_items(ws.dir / "choices.jsonl", 4);
  // /dev/full accepts the open and fails every write with ENOSPC.
  auto r = run_keel("eval --choices " + (ws.dir / "choices.jsonl") + " --checkpoint " + out +
                    "/checkpoints --scores /dev/full");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--scores /dev/full could not be written: No space left on device"));
}

// The scores file was opened (truncated) before the items were scored: an item refused then
// left an earlier scores file empty. It is now written beside and renamed over at the end.
TEST_CASE("keel eval that fails on an item leaves an earlier --scores file as it was", "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4")).code == 4);
  test::write_stream_choice_items(ws.dir / "choices.jsonl", 4);
  const std::string scores = ws.dir / "scores.jsonl";
  const std::string eval = "eval --checkpoint " + out + "/checkpoints --scores " + scores + " --choices ";
  REQUIRE(run_keel(eval + (ws.dir / "choices.jsonl")).code == 0);
  const std::string earlier = test::read_file(scores);
  REQUIRE(std::count(earlier.begin(), earlier.end(), '\n') == 4);
  // A context longer than the model's positions is refused once the scoring reaches it.
  std::ofstream(ws.dir / "long.jsonl") << nlohmann::json{{"context_ids", std::vector<uint32_t>(500, 3)},
                                                         {"ending_ids", {{1}, {2}}},
                                                         {"label", 0}}.dump()
                                       << '\n';
  auto r = run_keel(eval + (ws.dir / "long.jsonl"));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("beyond the model's"));
  CHECK(test::read_file(scores) == earlier);
  for (const auto& e : fs::directory_iterator(ws.dir.path)) CHECK(e.path().filename().string().find(".tmp-") == std::string::npos);
}

// keel ckpt average: each element is the mean of the inputs' fp32 masters, summed in double and
// rounded once (bit for bit, in fp32 and in bf16); the result is a weights-only checkpoint that
// verifies and loads; bad inputs and outputs are refused before anything is written.
TEST_CASE("keel ckpt average: the element-wise mean of the masters, as a checkpoint that loads", "[ckpt][cli][average]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 12 --set checkpoint.keep_last=3")).code == 4);
  std::vector<std::string> in;
  for (const char* step : {"00000004", "00000008", "00000012"}) in.push_back(out + "/checkpoints/step_" + step);
  const std::string list = in[0] + " " + in[1] + " " + in[2];
  for (const std::string dtype : {"fp32", "bf16"}) {
    INFO(dtype);
    const std::string avg = ws.dir / ("avg_" + dtype);
    const auto r = run_keel("ckpt average " + list + " --out " + avg + " --dtype " + dtype);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("averaged 3 checkpoints") && Catch::Contains("(iteration 8, fp32 masters)"));
    CHECK(run_keel("ckpt verify " + avg).code == 0);
    const Checkpoint a = Checkpoint::open(avg);
    const nlohmann::json& source = a.meta()["source"];
    REQUIRE(source["average"].size() == 3);
    for (size_t k = 0; k < 3; ++k) {
      CHECK(source["average"][k]["path"] == Checkpoint::open(in[k]).path());
      CHECK(source["init_from"][k] == fs::absolute(Checkpoint::open(in[k]).path()).lexically_normal().string());
    }
    std::vector<Checkpoint> cks;
    for (const std::string& p : in) cks.push_back(Checkpoint::open(p));
    const ParamTable table(parse_config(a.meta().at("config"), "meta.json").model);
    int64_t wrong = 0, elements = 0;
    for (const ParamSpec& p : table.params()) {
      CHECK(a.stored_dtype("weight", p.name) == (dtype == "fp32" ? DType::F32 : DType::BF16));
      const std::vector<float> got = a.read_full("weight", p.name);
      std::vector<double> sum(got.size(), 0.0);
      for (const Checkpoint& ck : cks) {
        const std::vector<float> m = ck.read_full("master", p.name);
        for (size_t i = 0; i < m.size(); ++i) sum[i] += m[i];
      }
      for (size_t i = 0; i < got.size(); ++i, ++elements)
        wrong += got[i] != round_to(dtype == "fp32" ? DType::F32 : DType::BF16, static_cast<float>(sum[i] / 3.0));
    }
    CHECK(elements == table.logical_numel());
    CHECK(wrong == 0);
    // It loads: a new run from it (restart verification: masters = the stored values).
    const auto e = run_keel(train_args(ws, ws.dir / ("from_" + dtype), "--init-from " + avg + " --eval-only --set train.eval_batches=2"));
    INFO(e.output);
    CHECK(e.code == 0);
  }
  // Refused, with nothing written: one checkpoint, an existing --out, an --out that is an input
  // (even with --force), another model, a damaged input.
  auto refused = [&](const std::string& args, int code, const std::string& says) {
    const auto r = run_keel("ckpt average " + args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    CHECK_THAT(r.output, Catch::Contains(says));
  };
  refused(in[0] + " --out " + ws.dir / "one", 2, "at least two checkpoints");
  CHECK(!fs::exists(ws.dir / "one"));
  refused(list + " --out " + ws.dir / "avg_fp32", 2, "already exists (pass --force");
  refused(list + " --out " + in[1] + " --force", 2, "would replace the input");
  CHECK(run_keel("ckpt verify " + in[1]).code == 0);
  // --force replaces an earlier checkpoint only: not a run directory (nor any other folder or
  // file), and nothing inside an input, which rotation would delete with it.
  refused(list + " --out " + in[1] + "/sub", 2, "is inside the input " + in[1]);
  CHECK(!fs::exists(in[1] + "/sub"));
  // Nor a step_* folder among the run's checkpoints: keep_last could delete it, and a resume
  // without `latest` continue from it.
  const std::string named = out + "/checkpoints/step_00000999";
  refused(list + " --out " + named, 2,
          "the output " + named + " is named like a checkpoint (step_*) of the run whose checkpoints are in " +
              fs::absolute(out + "/checkpoints").string() + ": that run would take it for one of its own saves");
  CHECK(!fs::exists(named));
  const auto again = run_keel("ckpt average " + list + " --out " + ws.dir / "avg_fp32" + " --force");
  INFO(again.output);
  CHECK(again.code == 0);
  test::Workspace other(nlohmann::json{{"model", {{"d_model", 48}}}, {"train", {{"steps", 2}}}});
  REQUIRE(run_keel(train_args(other, other.dir / "run")).code == 0);
  refused(list + " --out " + other.dir / "run --force", 2,
          "exists and is a folder holding .lock, checkpoints/, config.json, metrics.jsonl: --force replaces only an "
          "earlier keel checkpoint");
  CHECK(run_keel("ckpt verify " + other.dir / "run/checkpoints/step_00000002").code == 0);
  refused(in[0] + " " + other.dir / "run/checkpoints/step_00000002 --out " + ws.dir / "mixed", 5, "model.d_model: this one 48, the first 32");
  CHECK(!fs::exists(ws.dir / "mixed"));
  flip_byte_in(in[2] + "/model-tp00-pp00.safetensors", "weight/layers.1.attn.wq");
  refused(list + " --out " + ws.dir / "damaged", 5, "refusing to average a damaged checkpoint");
  CHECK(!fs::exists(ws.dir / "damaged"));
}

// A run resumed under another vocabulary padding (another parallel.tp, or pad_vocab_to_multiple_of)
// saves tok_embed with another row count: its checkpoints average over the real rows, as a resume
// or ckpt diff reads them (was: refused as a shape mismatch, with exit 5, "damaged").
TEST_CASE("keel ckpt average: checkpoints of one run padded otherwise average their real rows", "[ckpt][cli][average][vocab]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", dir = out + "/checkpoints";
  const int64_t vocab = test::tiny_run_json()["model"]["vocab_size"].get<int64_t>();
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 4 --set checkpoint.interval=4 --set model.pad_vocab_to_multiple_of=48")).code == 4);
  REQUIRE(run_keel(train_args(ws, out, "--stop-at 8 --set checkpoint.interval=4 --set model.pad_vocab_to_multiple_of=1")).code == 4);
  const Checkpoint a = Checkpoint::open(dir + "/step_00000004"), b = Checkpoint::open(dir + "/step_00000008");
  REQUIRE(a.shape("master", "tok_embed")[0] != b.shape("master", "tok_embed")[0]);
  const auto r = run_keel("ckpt average " + dir + "/step_00000004 " + dir + "/step_00000008 --dtype fp32 --out " + ws.dir / "avg");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const Checkpoint avg = Checkpoint::open(ws.dir / "avg");
  const std::vector<float> got = avg.read_full("weight", "tok_embed"), x = a.read_full("master", "tok_embed"),
                           y = b.read_full("master", "tok_embed");
  const int64_t cols = avg.shape("weight", "tok_embed")[1];
  REQUIRE(avg.shape("weight", "tok_embed")[0] == a.shape("master", "tok_embed")[0]);  // the first one's rows
  int64_t wrong = 0;
  for (int64_t i = 0; i < vocab * cols; ++i)
    wrong += got[static_cast<size_t>(i)] != static_cast<float>((double(x[static_cast<size_t>(i)]) + y[static_cast<size_t>(i)]) / 2);
  for (size_t i = static_cast<size_t>(vocab * cols); i < got.size(); ++i) wrong += got[i] != 0.0f;  // padding rows
  CHECK(wrong == 0);
}

// ckpt diff compares the tensors the two checkpoints hold in one shape; those whose shapes
// differ are listed and counted apart, not as compared tensors that differ. A vocabulary padded
// otherwise (tok_embed and lm_head in every state) is compared in its real rows, with the padding
// rows required to be zero: the same run padded otherwise trains the same bits there.
TEST_CASE("keel ckpt diff compares differently padded vocabularies in their real rows, other shapes apart",
          "[ckpt][cli][diff][vocab]") {
  test::Workspace ws(kRun);
  REQUIRE(run_keel(train_args(ws, ws.dir / "a", "--steps 2")).code == 0);
  REQUIRE(run_keel(train_args(ws, ws.dir / "b", "--steps 2 --set model.pad_vocab_to_multiple_of=128")).code == 0);
  const std::string padded = " (the vocabulary is padded to 64 vs 128 rows: tok_embed and lm_head compared in their "
                             "64 real rows";
  auto d = run_keel("ckpt diff " + ws.dir / "a/checkpoints " + ws.dir / "b/checkpoints");
  INFO(d.output);
  CHECK(d.code == 0);
  CHECK_THAT(d.output, Catch::Contains("bitwise equal: 84 tensors compared across 4 states" + padded +
                                       ", their padding rows zero)"));
  d = run_keel("ckpt diff --no-verify " + ws.dir / "a/checkpoints " + ws.dir / "b/checkpoints");
  CHECK(d.code == 0);
  CHECK_THAT(d.output, Catch::Contains("headers agree: 84 tensors across 4 states compared by name, shape and stored "
                                       "dtype" + padded + ")"));
  // Another step: the real rows differ and are named.
  REQUIRE(run_keel(train_args(ws, ws.dir / "c", "--steps 3 --set model.pad_vocab_to_multiple_of=128")).code == 0);
  d = run_keel("ckpt diff " + ws.dir / "a/checkpoints " + ws.dir / "c/checkpoints");
  CHECK(d.code == 1);
  CHECK_THAT(d.output, Catch::Contains(" of 84 tensors compared differ") && Catch::Contains(padded + ", their padding rows zero)"));
  // Another width is another shape: listed apart, not compared.
  REQUIRE(run_keel(train_args(ws, ws.dir / "w", "--steps 2 --set model.d_model=48 --set model.n_heads=4")).code == 0);
  d = run_keel("ckpt diff " + ws.dir / "a/checkpoints " + ws.dir / "w/checkpoints");
  CHECK(d.code == 1);
  CHECK_THAT(d.output, Catch::Contains("shape differs: weight/tok_embed: [64, 32] vs [64, 48]") &&
                           Catch::Contains("more have other shapes and were not compared"));
}

// The progress is state: equal tensors with another Adam step (bias correction) or data position
// continue otherwise. It was printed, then "bitwise equal" / "headers agree" with exit 0.
TEST_CASE("keel ckpt diff counts a progress that differs as a difference", "[ckpt][cli][diff]") {
  test::Workspace ws(kRun);
  REQUIRE(run_keel(train_args(ws, ws.dir / "a", "--stop-at 4")).code == 4);
  const std::string a = ws.dir / "a/checkpoints/step_00000004", b = ws.dir / "b";
  fs::copy(a, b, fs::copy_options::recursive);
  test::edit_checkpoint_meta(b, [](nlohmann::json& meta) { meta["adam_step"] = 3; });
  for (const std::string flags : {"", "--no-verify "}) {
    auto d = run_keel("ckpt diff " + flags + a + " " + b);
    INFO(d.output);
    CHECK(d.code == 1);
    CHECK_THAT(d.output, Catch::Contains("progress differs: iteration 4 vs 4, consumed samples 32 vs 32, Adam step 4 vs 3") &&
                             Catch::Contains(flags.empty() ? "bitwise equal: " : "headers differ: ") &&
                             Catch::Contains(", but the progress differs (above)"));
  }
  CHECK(run_keel("ckpt diff " + a + " " + a).code == 0);
}

// An --out that cannot be made or written is the argument's fault (exit 2), said with the OS's
// reason, before anything is trained.
TEST_CASE("a run directory that cannot be written is refused with the reason, exit 2", "[ckpt][cli][io]") {
  test::Workspace ws(kRun);
  std::ofstream(ws.dir / "a-file") << "not a directory";
  auto r = run_keel(train_args(ws, ws.dir / "a-file/run", "--steps 2"));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("cannot create the run directory " + ws.dir / "a-file/run" +
                                       " (--out): Not a directory; nothing was trained"));
  const std::string out = ws.dir / "run";
  fs::create_directories(out + "/metrics.jsonl");  // a folder where the metrics file goes
  r = run_keel(train_args(ws, out, "--steps 2"));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("cannot open metrics file " + out + "/metrics.jsonl for writing: Is a directory "
                                       "(the run directory --out " + out + " must be writable); nothing was trained"));
  CHECK_FALSE(fs::exists(out + "/checkpoints/step_00000002"));
}

TEST_CASE("keel train --init-from into a run that is already complete says that it is ignored", "[ckpt][cli]") {
  test::Workspace ws(kRun);
  const std::string out = ws.dir / "run", ck = out + "/checkpoints/step_00000004";
  REQUIRE(run_keel(train_args(ws, out, "--steps 4")).code == 0);
  const auto r = run_keel(train_args(ws, out, "--steps 4 --init-from " + ck));
  INFO(r.output);
  CHECK(r.code == 0);
  // Loud: the flag given by hand over a run's checkpoints more likely meant a new finetune.
  CHECK_THAT(r.output, Catch::Contains("WARNING --init-from " + ck + " is ignored: " + out +
                                       "/checkpoints already holds a run's checkpoints, and this run resumes it. To "
                                       "start a new run from " + ck + ", give it another --out") &&
                           Catch::Contains("train.steps is 4: nothing to do"));
}
