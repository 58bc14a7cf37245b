// End to end: the real `keel` binary on synthetic token shards.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <tuple>

#include "common/checkpoint_meta.h"
#include "common/process.h"
#include "common/run_config.h"
#include "common/workspace.h"
#include "data/loss_mask.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "train/host_memory.h"
#include "train/tensorboard.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {

using test::read_metrics;
using test::run_keel;
using test::Workspace;
using Result = test::ProcessResult;

std::vector<double> train_losses(const std::vector<nlohmann::json>& records) {
  std::vector<double> out;
  for (const auto& r : records)
    if (r.contains("loss")) out.push_back(r["loss"].get<double>());
  return out;
}

}  // namespace

TEST_CASE("keel --help and keel train --help describe the tool", "[cli]") {
  Result top = run_keel("--help");
  CHECK(top.code == 0);
  CHECK_THAT(top.output, Catch::Contains("train") && Catch::Contains("Llama"));
  Result train = run_keel("train --help");
  CHECK(train.code == 0);
  CHECK_THAT(train.output, Catch::Contains("--config") && Catch::Contains("--set") && Catch::Contains("--steps") &&
                               Catch::Contains("--out") && Catch::Contains("--seed"));
}

TEST_CASE("a mistyped subcommand is named, with the closest one and the list", "[cli]") {
  Result typo = run_keel("trian --config x.json");
  CHECK(typo.code == 2);
  CHECK_THAT(typo.output, Catch::Contains("unknown subcommand 'trian' (did you mean 'train'?); the subcommands are "
                                          "train, plan, ckpt, convert, sample, doctor, eval, tokenize"));
  Result far = run_keel("bogus");
  CHECK(far.code == 2);
  CHECK_THAT(far.output, Catch::Contains("unknown subcommand 'bogus'; the subcommands are") &&
                             !Catch::Contains("did you mean"));
}

TEST_CASE("a setting given twice on the command line says which value counts", "[cli][config]") {
  const std::string cfg = std::string(KEEL_SOURCE_DIR) + "/configs/llama-tiny.json";
  Result r = run_keel("train --config " + cfg + " --set train.steps=70 --set train.steps=80 --steps 50 --print-config");
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train.steps is set twice on the command line (70, then 80): the last one, 80, "
                                       "counts") &&
                           Catch::Contains("(80, then 50, by its flag): the last one, 50, counts") &&
                           Catch::Contains("\"steps\": 50"));
  Result same = run_keel("train --config " + cfg + " --set train.steps=50 --steps 50 --print-config");
  CHECK_THAT(same.output, !Catch::Contains("set twice"));  // the same value twice changes nothing
}

TEST_CASE("each subcommand's --help gives its own examples and exit codes, as README does", "[cli]") {
  // keel's own footer (train examples) must not leak into subcommands that set none.
  for (const char* sub : {"ckpt", "ckpt inspect", "ckpt diff", "ckpt verify", "ckpt average"}) {
    Result r = run_keel(std::string(sub) + " --help");
    INFO(sub << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("keel ckpt average") && Catch::Contains("Exit codes:") &&
                             !Catch::Contains("keel train --config"));
  }
  Result top = run_keel("--help");
  CHECK_THAT(top.output, Catch::Contains("Inspect, compare, verify and average checkpoints") &&
                             Catch::Contains("Mistral, Qwen2/Qwen3, GPT-2 and BLOOM"));
  // README's exit-code table: 4 for every early stop, and 6.
  Result train = run_keel("train --help");
  CHECK_THAT(train.output, Catch::Contains("4 stopped after saving (a signal, --stop-at or --time-limit") &&
                               Catch::Contains("6 the fp16 loss scale hit its minimum") &&
                               Catch::Contains("a checkpoints or run directory, or a latest file"));
  Result doctor = run_keel("doctor --help");
  CHECK_THAT(doctor.output, Catch::Contains("2 bad arguments") && Catch::Contains("5 a checkpoint"));
}

TEST_CASE("keel train: the loss falls, and two runs with the same seed are bit-identical", "[cli][e2e]") {
  Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}}});
  Result a = run_keel("train --config " + ws.config + " --out " + (ws.dir / "a"));
  INFO(a.output);
  REQUIRE(a.code == 0);
  CHECK_THAT(a.output, Catch::Contains("lm loss:") && Catch::Contains("grad norm:") &&
                           Catch::Contains("consumed tokens:") && Catch::Contains("no decay"));
  auto ma = read_metrics(ws.dir / "a/metrics.jsonl");
  auto la = train_losses(ma);
  REQUIRE(la.size() == 30);
  // ln(64) = 4.16 at the start; the rule next = 3t+1 is learnable to well below 2 nats.
  CHECK(la.front() > 3.5);
  CHECK(la.back() < la.front() - 1.0);
  bool has_val = false;
  for (const auto& r : ma) has_val |= r.contains("val_loss");
  CHECK(has_val);
  CHECK(fs::exists(ws.dir / "a/config.json"));

  Result b = run_keel("train --config " + ws.config + " --out " + (ws.dir / "b") + " -q");
  REQUIRE(b.code == 0);
  auto lb = train_losses(read_metrics(ws.dir / "b/metrics.jsonl"));
  CHECK(la == lb);  // exact double equality, every step

  Result c = run_keel("train --config " + ws.config + " --out " + (ws.dir / "c") + " -q --seed 99");
  REQUIRE(c.code == 0);
  CHECK(train_losses(read_metrics(ws.dir / "c/metrics.jsonl")) != la);
}

TEST_CASE("keel train on a weighted blend of two sources: start-up shows the shares, a resume is bit-identical",
          "[cli][e2e][blend]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 8}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  // A small second source (6% of the tokens), upweighted to a quarter of the samples.
  data::write_llmc_shard(ws.dir / "small.bin", test::synthetic_tokens(1200, 7), false);
  const std::string blend = " --set 'data.train=[\"" + (ws.dir / "train.bin") + "\", \"" + (ws.dir / "small.bin") +
                            "\"]' --set 'data.train_weights=[3, 1]'";
  Result straight = run_keel("train --config " + ws.config + " --out " + (ws.dir / "straight") + blend);
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  CHECK_THAT(straight.output, Catch::Contains("a blend of 2 sources") && Catch::Contains(" 75.0%  ") &&
                                  Catch::Contains(" 25.0%  ") && Catch::Contains("small.bin: 37 windows") &&
                                  Catch::Contains("about 0.43 epochs in 8 steps"));
  const auto full = train_losses(read_metrics(ws.dir / "straight/metrics.jsonl"));
  REQUIRE(full.size() == 8);
  // Without the weights the same files are one source, read in another order.
  Result pooled = run_keel("train --config " + ws.config + " --out " + (ws.dir / "pooled") + " -q --set 'data.train=[\"" +
                           (ws.dir / "train.bin") + "\", \"" + (ws.dir / "small.bin") + "\"]'");
  REQUIRE(pooled.code == 0);
  CHECK(train_losses(read_metrics(ws.dir / "pooled/metrics.jsonl")) != full);
  // Stop at step 4, resume: steps 5-8 read the same samples and give the same losses.
  Result first = run_keel("train --config " + ws.config + " --out " + (ws.dir / "resumed") + " -q --stop-at 4" + blend);
  REQUIRE(first.code == 4);
  Result second = run_keel("train --config " + ws.config + " --out " + (ws.dir / "resumed") + " -q" + blend);
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK(test::losses_by_step(read_metrics(ws.dir / "resumed/metrics.jsonl")) ==
        test::losses_by_step(read_metrics(ws.dir / "straight/metrics.jsonl")));
}

// The annealing move: 8 steps of 0.7 / 0.3, then 0.5 / 0.5 from a resume. Each source must go
// on from where it stopped. The reference is a run of one source, unshuffled, whose 160 files of
// one window each are the samples that mapping reads, computed here from the schedule's
// definition (the blend runs are unshuffled too, so source d's local sample l is its window
// l % W_d): the same tokens in the same order must give the same loss at every step.
TEST_CASE("keel train: a resume with other blend weights continues every source where it stopped",
          "[cli][e2e][blend]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 20}, {"eval_interval", 0}}},
                              {"schedule", {{"warmup_steps", 1}}},
                              {"data", {{"shuffle", false}}}});
  const int T = 32, G = 8, stop = 8, steps = 20;
  const std::vector<int64_t> windows = {50, 40};
  std::vector<std::vector<uint32_t>> tokens;
  std::string entries;
  for (size_t d = 0; d < 2; ++d) {
    tokens.push_back(test::synthetic_tokens(static_cast<size_t>(windows[d] * T + 1), 30 + static_cast<uint32_t>(d)));
    const std::string path = ws.dir / ("source" + std::to_string(d) + ".bin");
    data::write_llmc_shard(path, tokens[d], false);
    entries += (d ? "\", \"" : "[\"") + path;
  }
  const std::string sources = " --set 'data.train=" + entries + "\"]'";
  const std::string before = sources + " --set 'data.train_weights=[0.7, 0.3]'";
  const std::string after = sources + " --set 'data.train_weights=[0.5, 0.5]'";
  auto train = [&](const std::string& out, const std::string& args) {
    return run_keel("train --config " + ws.config + " --out " + (ws.dir / out) + " " + args);
  };
  auto losses = [&](const std::string& out) { return test::losses_by_step(read_metrics(ws.dir / (out + "/metrics.jsonl"))); };

  // The samples each source must give: positions 0 .. 63 by the 0.7 / 0.3 schedule, then by the
  // 0.5 / 0.5 schedule restarted at sample 64, each source counting on from its own total.
  const data::Blend first({0.7, 0.3}), second({0.5, 0.5});
  std::vector<int64_t> next(2, 0);
  nlohmann::json ref_train = nlohmann::json::array();
  bool differs_from_weights_alone = false;
  for (int64_t i = 0; i < int64_t{steps} * G; ++i) {
    const bool later = i >= int64_t{stop} * G;
    const data::Blend::Pick p = later ? second.pick(i - stop * G) : first.pick(i);
    const int64_t local = next[p.source]++;
    if (!later) REQUIRE(p.local == local);
    differs_from_weights_alone |= later && (second.pick(i).source != p.source || second.pick(i).local != local);
    const int64_t w = local % windows[p.source];
    const std::vector<uint32_t> window(tokens[p.source].begin() + w * T, tokens[p.source].begin() + (w + 1) * T + 1);
    char name[32];
    std::snprintf(name, sizeof name, "ref_%03lld.bin", static_cast<long long>(i));
    data::write_llmc_shard(ws.dir / name, window, false);
    ref_train.push_back(ws.dir / name);
  }
  REQUIRE(differs_from_weights_alone);  // the map of the new weights alone reads other samples
  nlohmann::json ref_json = ws.json;
  ref_json["data"]["train"] = ref_train;
  const std::string ref_config = ws.dir / "reference.json";
  std::ofstream(ref_config) << ref_json.dump(2);
  Result ref = run_keel("train --config " + ref_config + " --out " + (ws.dir / "reference") + " -q");
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  const auto want = losses("reference");
  REQUIRE(want.size() == static_cast<size_t>(steps));

  // Stop at step 8, resume with the new weights: the note says where each source goes on. The
  // checkpoint is made one of a keel from before data.blend: its config's weights from sample 0
  // are what it read, and the history it is taken to have.
  REQUIRE(train("changed", "-q --stop-at 8" + before).code == 4);
  test::edit_checkpoint_meta(ws.dir / "changed/checkpoints/step_00000008", [](nlohmann::json& m) {
    REQUIRE(m["data"].contains("blend"));
    m["data"].erase("blend");
  });
  Result resumed = train("changed", after);
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  const std::vector<int64_t> at = first.counts(stop * G);
  CHECK_THAT(resumed.output,
             Catch::Contains("data.train_weights changed since the checkpoint, [0.7,0.3] -> [0.5,0.5]: each source "
                             "continues where it left off, data.train[0] (" + (ws.dir / "source0.bin") +
                             ") at its sample " + std::to_string(at[0]) + " and data.train[1] (" +
                             (ws.dir / "source1.bin") + ") at its sample " + std::to_string(at[1])) &&
                 Catch::Contains("From sample 64 on the sources get 50.0% / 50.0% of the samples (70.0% / 30.0% "
                                 "before)") &&
                 Catch::Contains("the shares changed during the run (each source continuing where it was): "
                                 "70.0% / 30.0% from sample 0, 50.0% / 50.0% from sample 64") &&
                 !Catch::Contains("data.train_weights.0") && !Catch::Contains("restarts its schedule"));
  CHECK(losses("changed") == want);  // every step: the reference's samples

  // The history is in every later checkpoint: stopped again at 14 and resumed with the same
  // weights, the run goes on exactly (a resume that lost it would restart the 0.5 / 0.5 map).
  REQUIRE(train("twice", "-q --stop-at 8" + before).code == 4);
  REQUIRE(train("twice", "-q --stop-at 14" + after).code == 4);
  const nlohmann::json meta = nlohmann::json::parse(test::read_file(ws.dir / "twice/checkpoints/step_00000014/meta.json"));
  CHECK(meta["data"]["blend"] == nlohmann::json::parse(R"([{"from_sample": 0, "weights": [0.7, 0.3]},
                                                  {"from_sample": 64, "weights": [0.5, 0.5]}])"));
  Result third = train("twice", after);
  INFO(third.output);
  REQUIRE(third.code == 0);
  CHECK_THAT(third.output, !Catch::Contains("data.train_weights changed") && !Catch::Contains("restarts its schedule"));
  CHECK(losses("twice") == want);

  // A rewind to step 8 uses that checkpoint's history (0.7 / 0.3 only) and changes it again.
  Result rewind = train("twice", "-q --resume " + (ws.dir / "twice/checkpoints/step_00000008") + after);
  INFO(rewind.output);
  REQUIRE(rewind.code == 0);
  CHECK_THAT(rewind.output, Catch::Contains("each source continues where it left off"));
  CHECK(losses("twice") == want);  // steps 9-20 replayed onto the same losses

  // Other sources (a third entry): the history cannot apply, the blend restarts its schedule.
  Result other = run_keel("train --config " + ws.config + " --out " + (ws.dir / "other") + " -q --stop-at 9 --resume " +
                          (ws.dir / "changed/checkpoints/step_00000008") + " --set 'data.train=" + entries + "\", \"" +
                          (ws.dir / "train.bin") + "\"]' --set 'data.train_weights=[1, 1, 1]'");
  INFO(other.output);
  REQUIRE(other.code == 4);
  CHECK_THAT(other.output, Catch::Contains("WARNING the blend restarts its schedule: the checkpoint blended 2 sources, "
                                           "data.train now has 3 entries") &&
                               Catch::Contains("some windows are read again and others skipped"));
}

TEST_CASE("keel train with data.val_sets: each named set validated and reported beside data.val", "[cli][e2e]") {
  Workspace ws;
  // "same" is data.val again, so its losses must be data.val's bit for bit; "noise" is uniform
  // random tokens, which no model predicts better than ln 64 = 4.16 nats.
  std::mt19937 rng(11);
  std::vector<uint32_t> noise(4000);
  for (uint32_t& t : noise) t = rng() % 64;
  data::write_llmc_shard(ws.dir / "noise.bin", noise, false);
  Result r = run_keel("train --config " + ws.config + " --out " + (ws.dir / "run") + " --set log.tensorboard=true" +
                      " --set 'data.val_sets={\"same\": \"" + (ws.dir / "val.bin") + "\", \"noise\": [\"" +
                      (ws.dir / "noise.bin") + "\"]}'");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: data: validation set noise: 124 windows, 8 of them per evaluation "
                                       "(train.eval_batches 2 x train.micro_batch 4)") &&
                           Catch::Contains(" validation (same) at iteration 10 | lm loss: ") &&
                           Catch::Contains(" validation (noise) at iteration 30 | lm loss: "));
  int evaluations = 0;
  double last_val = 0, last_noise = 0;
  for (const nlohmann::json& rec : read_metrics(ws.dir / "run/metrics.jsonl")) {
    if (!rec.contains("val_loss")) continue;
    ++evaluations;
    REQUIRE(rec.contains("val_losses"));
    CHECK(rec["val_losses"]["same"].get<double>() == rec["val_loss"].get<double>());
    last_val = rec["val_loss"].get<double>();
    last_noise = rec["val_losses"]["noise"].get<double>();
  }
  CHECK(evaluations == 3);
  CHECK(last_val < 3.0);
  CHECK(last_noise > 4.0);  // learning the stream makes random tokens no easier
  // The resolved config keeps the sets.
  const nlohmann::json resolved = nlohmann::json::parse(test::read_file(ws.dir / "run/config.json"));
  CHECK(resolved["data"]["val_sets"]["noise"] == nlohmann::json::array({ws.dir / "noise.bin"}));
  // A set whose files do not exist is named before anything is written.
  Result missing = run_keel("train --config " + ws.config + " --out " + (ws.dir / "missing") +
                            " --set 'data.val_sets={\"code\": \"" + (ws.dir / "code_*.bin") + "\"}'");
  CHECK(missing.code == 3);
  CHECK_THAT(missing.output, Catch::Contains("data.val_sets.code"));
  CHECK(!fs::exists(ws.dir / "missing"));
  // So is one too short for a window, or holding an id outside the vocabulary; and data.val too.
  data::write_llmc_shard(ws.dir / "tiny.bin", std::vector<uint32_t>(20, 1), false);
  std::vector<uint32_t> late_oov(400, 1);
  late_oov.back() = 64;
  data::write_llmc_shard(ws.dir / "oov.bin", late_oov, false);
  const std::pair<std::string, std::string> bad[] = {
      {"data.val_sets={\"tiny\": \"" + (ws.dir / "tiny.bin") + "\"}", "data.val_sets.tiny: no validation windows"},
      {"data.val=" + (ws.dir / "tiny.bin"), "data.val: no validation windows"},
      {"data.val=" + (ws.dir / "tiny.bin"), "(keel tokenize --val-fraction), or leave data.val out"},
      {"data.val_sets={\"late\": \"" + (ws.dir / "oov.bin") + "\"}", "data.val_sets.late: '" + (ws.dir / "oov.bin") + "': token 64"}};
  for (const auto& [set, says] : bad) {
    Result r2 = run_keel("train --config " + ws.config + " --out " + (ws.dir / "bad") + " --set '" + set + "'");
    INFO(r2.output);
    CHECK(r2.code == 3);
    CHECK_THAT(r2.output, Catch::Contains(says) && !Catch::Contains("training windows"));
    CHECK(!fs::exists(ws.dir / "bad"));
  }
}

// A validation set whose evaluated targets are all masked has no loss. It used to read as
// "lm loss: 0.000000E+00", a perfect model; now it is named once and reported as nan everywhere.
TEST_CASE("keel train: a validation set with every target masked is named and its loss reported as nan and not 0",
          "[cli][e2e][mask]") {
  Workspace ws;
  const std::vector<uint32_t> stream = test::synthetic_tokens(4000, 2);
  data::write_llmc_shard(ws.dir / "sft.bin", stream, false);
  data::write_llmc_shard(ws.dir / "kept.bin", stream, false);
  data::write_loss_mask(ws.dir / "val.mask", std::vector<uint8_t>(4000, 0));  // data.val's sidecar
  data::write_loss_mask(ws.dir / "sft.mask", std::vector<uint8_t>(4000, 0));
  const std::string out = ws.dir / "run";
  Result r = run_keel("train --config " + ws.config + " --out " + out + " --steps 20 --set log.tensorboard=true" +
                      " --set 'data.val_sets={\"sft\": \"" + (ws.dir / "sft.bin") + "\", \"kept\": \"" +
                      (ws.dir / "kept.bin") + "\"}'");
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = r.output.find(what); at != std::string::npos; at = r.output.find(what, at + 1)) ++n;
    return n;
  };
  // Said once per set (two evaluations), naming the field, at start-up (with the data lines,
  // before the batch line), not at the first evaluation; the set with targets is not named.
  const std::string no_loss = ": no target in the windows it evaluates counts in the loss";
  CHECK(count("keel: WARNING data.val" + no_loss) == 1);
  CHECK(count("keel: WARNING data.val_sets.sft" + no_loss) == 1);
  CHECK(r.output.find("keel: WARNING data.val_sets.sft" + no_loss) < r.output.find("keel: batch: "));
  CHECK(r.output.find("keel: WARNING data.val" + no_loss) < r.output.find("keel: batch: "));
  // No evaluation reads a window (train.eval_batches 0): nothing to warn about.
  const Result none = run_keel("train --config " + ws.config + " --out " + (ws.dir / "none") +
                               " --steps 3 --set train.eval_batches=0");
  INFO(none.output);
  CHECK(none.code == 0);
  CHECK(none.output.find(no_loss) == std::string::npos);
  CHECK_THAT(r.output, !Catch::Contains("WARNING data.val_sets.kept") && !Catch::Contains("lm loss: 0.000000E+00") &&
                           Catch::Contains(" validation (sft) at iteration 10 | lm loss: NAN | lm loss PPL: nan |") &&
                           !Catch::Contains("final validation loss"));
  int evaluations = 0;
  for (const nlohmann::json& rec : read_metrics(out + "/metrics.jsonl")) {
    if (!rec.contains("val_loss")) continue;
    ++evaluations;
    CHECK(rec["val_loss"] == "nan");
    CHECK(rec["val_losses"]["sft"] == "nan");
    CHECK(rec["val_losses"]["kept"].get<double>() > 0.1);
    // TensorBoard gets the same nan (the writer turns each record into these scalars).
    for (const auto& [tag, x] : tensorboard_scalars(rec))
      if (tag == "val/loss" || tag == "val/losses/sft") CHECK(std::isnan(x));
  }
  CHECK(evaluations == 2);
  // keel doctor keeps the nan out of the set's trend and says why.
  Result doctor = run_keel("doctor metrics " + out + "/metrics.jsonl");
  INFO(doctor.output);
  CHECK_THAT(doctor.output, Catch::Contains("validation (sft): 2 evaluation(s) had no target in the loss") &&
                                Catch::Contains("validation: 2 evaluation(s) had no target in the loss") &&
                                Catch::Contains("validation (kept): 2 evaluation(s): ") &&
                                !Catch::Contains("validation (sft): 2 evaluation(s): "));
}

TEST_CASE("keel train: a validation set of fewer windows than eval_batches asks for is read once, not wrapped around",
          "[cli][e2e]") {
  Workspace ws;
  // 5 windows of 32+1 tokens. Asking for 8 micro-batches of 1, or 8 of 2, must read these 5
  // once each, as the start-up line says: the same loss as asking for exactly 5.
  const std::vector<uint32_t> stream = test::synthetic_tokens(5 * 32 + 1, 3);
  data::write_llmc_shard(ws.dir / "short.bin", stream, false);
  auto val_loss = [&](int micro_batch, int eval_batches) {
    const std::string out = ws.dir / ("mbs" + std::to_string(micro_batch) + "_eb" + std::to_string(eval_batches));
    Result r = run_keel("train --config " + ws.config + " --out " + out + " --steps 2 --set train.eval_at_start=true" +
                        " --set train.micro_batch=" + std::to_string(micro_batch) +
                        " --set train.eval_batches=" + std::to_string(eval_batches) +
                        " --set 'data.val_sets={\"short\": \"" + (ws.dir / "short.bin") + "\"}'");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("validation set short: 5 windows, " +
                                         std::to_string(std::min(5, micro_batch * eval_batches)) +
                                         " of them per evaluation"));
    for (const nlohmann::json& rec : read_metrics(out + "/metrics.jsonl"))
      if (rec.contains("val_losses") && rec["step"] == 0) return rec["val_losses"]["short"].get<double>();
    FAIL("no validation at iteration 0");
    return 0.0;
  };
  const double exact = val_loss(1, 5);
  CHECK(val_loss(1, 8) == exact);
  CHECK(val_loss(2, 8) == Approx(exact).epsilon(1e-6));  // another batching: fp32 sums in another order
  // ... and a set that covers only part of its windows still reads the first ones.
  CHECK(val_loss(1, 2) != exact);
}

TEST_CASE("keel train with sample: text at each interval, the stream's rule, and keel sample's text from the checkpoint",
          "[cli][e2e][sample]") {
  Workspace ws;
  // A byte-level tokenizer whose ids 1-63 are single characters (id 0 is <|endoftext|>).
  fs::copy_file(std::string(KEEL_FIXTURE_DIR) + "/tokenizers/gpt2.json", ws.dir / "tokenizer.json");
  const std::string sample = " --set sample.interval=10 --set sample.prompt=ABC --set sample.tokens=12 --set sample.temperature=0";
  Result r = run_keel("train --config " + ws.config + " --out " + (ws.dir / "run") + sample);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: sample: 3-token prompt, 12 tokens every 10 steps and at the end") &&
                           Catch::Contains(" sample at iteration 20 ("));
  std::vector<std::string> texts;
  for (const nlohmann::json& rec : read_metrics(ws.dir / "run/metrics.jsonl"))
    if (rec.value("event", "") == "sample") texts.push_back(rec["text"].get<std::string>());
  REQUIRE(texts.size() == 3);  // steps 10, 20, 30
  // Greedy after training follows next = 3t + 1 (mod 64) from the prompt's last id (C = 35).
  const data::Tokenizer tok = data::Tokenizer::from_file(ws.dir / "tokenizer.json");
  std::vector<int32_t> want = tok.encode("ABC");
  REQUIRE(want == std::vector<int32_t>{33, 34, 35});
  for (int i = 0; i < 12; ++i) want.push_back((3 * want.back() + 1) % 64);
  CHECK(texts.back() == tok.decode(want, true));
  // keel sample on the final checkpoint continues the prompt the same way.
  Result offline = run_keel("sample --checkpoint " + (ws.dir / "run/checkpoints") + " --prompt ABC -n 12 -t 0");
  INFO(offline.output);
  REQUIRE(offline.code == 0);
  CHECK_THAT(offline.output, Catch::Contains(texts.back() + "\n"));
  // Without -n, the default 64 tokens do not fit this model's 32 positions: it generates what
  // they leave after the prompt, and says so; an -n asked for that does not fit is refused.
  Result fitted = run_keel("sample --checkpoint " + (ws.dir / "run/checkpoints") + " --prompt ABC -t 0 --show-ids");
  INFO(fitted.output);
  REQUIRE(fitted.code == 0);
  CHECK_THAT(fitted.output, Catch::Contains("generating up to 29 tokens, what the model's 32 positions leave after the "
                                            "3-token prompt (-n to choose)") &&
                                Catch::Contains(texts.back().substr(0, 15)));
  Result too_long = run_keel("sample --checkpoint " + (ws.dir / "run/checkpoints") + " --prompt ABC -n 30 -t 0");
  CHECK(too_long.code == 2);
  CHECK_THAT(too_long.output, Catch::Contains("prompt (3 tokens) + --max-new-tokens 30 exceed the model's 32 positions: "
                                              "at most -n 29 after this prompt"));
  // The run directory (--out) stands for its latest checkpoint, also one whose config.json puts
  // the checkpoints elsewhere (checkpoint.dir).
  fs::create_directories(ws.dir / "elsewhere");
  std::ofstream(ws.dir / "elsewhere/config.json") << nlohmann::json{{"checkpoint", {{"dir", ws.dir / "run/checkpoints"}}}};
  for (const std::string& run_dir : {ws.dir / "run", ws.dir / "elsewhere"}) {
    Result from_run = run_keel("sample --checkpoint " + run_dir + " --prompt ABC -n 12 -t 0");
    INFO(from_run.output);
    CHECK(from_run.code == 0);
    CHECK_THAT(from_run.output, Catch::Contains("loaded " + (ws.dir / "run/checkpoints/step_00000030")) &&
                                    Catch::Contains(texts.back() + "\n"));
  }
  // A run whose data ends documents with a token (data.eod_token: here the 2nd new token, 63)
  // stops its samples there (the token kept), and keel sample, reading the token from the
  // checkpoint's config, stops where training's sampler did.
  REQUIRE(want[4] == 63);
  Result eod = run_keel("train --config " + ws.config + " --out " + (ws.dir / "eod") + sample +
                        " --set data.eod_token=63");
  INFO(eod.output);
  REQUIRE(eod.code == 0);
  std::string eod_text;
  for (const nlohmann::json& rec : read_metrics(ws.dir / "eod/metrics.jsonl"))
    if (rec.value("event", "") == "sample") eod_text = rec["text"].get<std::string>();
  CHECK(eod_text == tok.decode({want.begin(), want.begin() + 5}, true));
  Result eod_offline = run_keel("sample --checkpoint " + (ws.dir / "eod/checkpoints") + " --prompt ABC -n 12 -t 0");
  INFO(eod_offline.output);
  REQUIRE(eod_offline.code == 0);
  CHECK_THAT(eod_offline.output, Catch::Contains(eod_text + "\n") && Catch::Contains("stopped at end of sequence"));
  // Layouts that split the model are refused by name.
  Result split = run_keel("train --config " + ws.config + " --out " + (ws.dir / "split") + sample +
                          " --set parallel.tp=2");
  CHECK(split.code == 2);
  CHECK_THAT(split.output, Catch::Contains("sample.interval: generating during training needs the whole model"));
}

TEST_CASE("a new run in a run directory holding an earlier run's metrics marks where its own records begin",
          "[cli][e2e][metrics]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 4}, {"eval_interval", 2}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(run_keel("train --config " + ws.config + " --out " + out + " -q").code == 0);
  // Nothing to resume (checkpoints removed): a new run from step 0, appended to metrics.jsonl.
  fs::remove_all(out + "/checkpoints");
  Result again = run_keel("train --config " + ws.config + " --out " + out + " --steps 2");
  INFO(again.output);
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains(out + "/metrics.jsonl holds records of an earlier run; this run starts at step 0"));
  const std::vector<nlohmann::json> recs = read_metrics(out + "/metrics.jsonl");
  int starts = 0;
  for (size_t i = 0; i < recs.size(); ++i)
    if (recs[i].value("event", "") == "start") {
      ++starts;
      CHECK(recs[i]["step"] == 0);
      CHECK(recs[i + 1]["step"] == 1);  // the new run's first step follows it
    }
  CHECK(starts == 1);  // the first run, in an empty directory, wrote none
  Result doctor = run_keel("doctor metrics " + out + "/metrics.jsonl");
  INFO(doctor.output);
  CHECK_THAT(doctor.output, Catch::Contains("steps: 2 (1 - 2)") && Catch::Contains("4 step record(s) of earlier runs"));
}

TEST_CASE("the log shows the first step each process trains, whatever log.interval", "[cli][e2e][metrics]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 8}}}, {"log", {{"interval", 100}}}});
  const std::string run = "train --config " + ws.config + " --out " + (ws.dir / "run");
  Result first = run_keel(run + " --stop-at 3");
  INFO(first.output);
  REQUIRE(first.code == 4);
  CHECK_THAT(first.output, Catch::Contains(" iteration        1/       8 |") && !Catch::Contains(" iteration        2/"));
  // The resumed process's first loss is where a restart spike would show.
  Result second = run_keel(run);
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK_THAT(second.output, Catch::Contains(" iteration        4/       8 |") && Catch::Contains(" iteration        8/       8 |") &&
                                !Catch::Contains(" iteration        5/"));
}

TEST_CASE("keel train with document masking: the end-of-document token from meta.json, a resume is bit-identical",
          "[cli][e2e][documents]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 8}, {"eval_interval", 4}}}, {"schedule", {{"warmup_steps", 1}}}});
  const std::string masked = " --set data.document_masking=true";
  // No meta.json beside the shards and no data.eod_token: refused, saying what to set.
  Result none = run_keel("train --config " + ws.config + " --out " + (ws.dir / "none") + masked);
  CHECK(none.code == 2);
  CHECK_THAT(none.output, Catch::Contains("data.document_masking needs the token that ends a document") &&
                              Catch::Contains("Set data.eod_token"));
  CHECK_FALSE(fs::exists(ws.dir / "none"));
  // prepare_data.py's meta.json names it (token 5 ends one token in 32 of the synthetic stream).
  std::ofstream(ws.dir / "meta.json") << R"({"eot_id": 5, "eot_placement": "after every document"})";
  Result straight = run_keel("train --config " + ws.config + " --out " + (ws.dir / "straight") + masked);
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  CHECK_THAT(straight.output, Catch::Contains("document masking: documents end at token 5") &&
                                  Catch::Contains("documents per sequence"));
  const auto full = test::losses_by_step(read_metrics(ws.dir / "straight/metrics.jsonl"));
  REQUIRE(full.size() == 8);
  // The resolved token is in the run's config (and so in its checkpoints).
  std::ifstream saved(ws.dir / "straight/config.json");
  CHECK(nlohmann::json::parse(saved)["data"]["eod_token"] == 5);
  // Masking changes the losses; an explicit token that never occurs changes nothing, and says so.
  Result plain = run_keel("train --config " + ws.config + " --out " + (ws.dir / "plain") + " -q");
  REQUIRE(plain.code == 0);
  const auto unmasked = test::losses_by_step(read_metrics(ws.dir / "plain/metrics.jsonl"));
  CHECK(unmasked != full);
  Result absent = run_keel("train --config " + ws.config + " --out " + (ws.dir / "absent") + masked +
                           " --set model.vocab_size=128 --set data.eod_token=100");
  INFO(absent.output);
  REQUIRE(absent.code == 0);
  CHECK_THAT(absent.output, Catch::Contains("WARNING token 100 does not occur in the first 64 training sequences"));
  // Stop at step 4, resume (restart verification included): the same losses, step for step.
  Result first = run_keel("train --config " + ws.config + " --out " + (ws.dir / "resumed") + " -q --stop-at 4" + masked);
  REQUIRE(first.code == 4);
  Result second = run_keel("train --config " + ws.config + " --out " + (ws.dir / "resumed") + " -q" + masked);
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK(test::losses_by_step(read_metrics(ws.dir / "resumed/metrics.jsonl")) == full);
  // Folders whose meta.json files disagree are refused, naming both.
  fs::create_directories(ws.dir / "other");
  data::write_llmc_shard(ws.dir / "other/val.bin", test::synthetic_tokens(4000, 3), false);
  std::ofstream(ws.dir / "other/meta.json") << R"({"eot_id": 7})";
  Result mixed = run_keel("train --config " + ws.config + " --out " + (ws.dir / "mixed") + masked +
                          " --set data.val=" + (ws.dir / "other/val.bin"));
  CHECK(mixed.code == 2);
  CHECK_THAT(mixed.output, Catch::Contains("disagree on the end-of-document token") && Catch::Contains("other/meta.json"));
}

TEST_CASE("keel train with data.eod_mask_loss: the targets after each end-of-document token leave the loss",
          "[cli][e2e][documents]") {
  Workspace ws(nlohmann::json{{"train", {{"steps", 3}, {"eval_interval", 0}, {"eval_batches", 0}}},
                              {"schedule", {{"warmup_steps", 1}}},
                              {"data", {{"shuffle", false}}}});
  const std::string eod_mask = " --set data.eod_mask_loss=true";
  Result none = run_keel("train --config " + ws.config + " --out " + (ws.dir / "none") + eod_mask);
  CHECK(none.code == 2);
  CHECK_THAT(none.output, Catch::Contains("data.eod_mask_loss needs the token that ends a document"));
  std::ofstream(ws.dir / "meta.json") << R"({"eot_id": 5})";
  Result masked = run_keel("train --config " + ws.config + " --out " + (ws.dir / "masked") + eod_mask);
  INFO(masked.output);
  REQUIRE(masked.code == 0);
  CHECK_THAT(masked.output, Catch::Contains("eod_mask_loss: the prediction after each end-of-document token 5"));
  Result plain = run_keel("train --config " + ws.config + " --out " + (ws.dir / "plain") + " -q");
  REQUIRE(plain.code == 0);

  // Unshuffled, step s reads samples (s-1)*G .. s*G-1: every target whose input is token 5
  // leaves the loss, the others stay.
  const int64_t G = ws.json["train"]["global_batch"], T = ws.json["train"]["seq_len"];
  const data::Sampler sampler(data::TokenDataset::open({ws.dir / "train.bin"}, static_cast<int>(T),
                                                       ws.json["model"]["vocab_size"].get<uint32_t>()),
                              0, false);
  auto steps_of = [](const std::string& path) {  // the step records (not timers or validation)
    std::vector<nlohmann::json> out;
    for (const auto& r : read_metrics(path))
      if (r.contains("loss_tokens")) out.push_back(r);
    return out;
  };
  const auto m = steps_of(ws.dir / "masked/metrics.jsonl"), p = steps_of(ws.dir / "plain/metrics.jsonl");
  REQUIRE(m.size() == 3);
  REQUIRE(p.size() == 3);
  int64_t masked_total = 0;
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<int32_t> in(static_cast<size_t>(G * T)), tgt(in.size());
    sampler.fill((step - 1) * G, static_cast<int>(G), in.data(), tgt.data());
    const int64_t ends = std::count(in.begin(), in.end(), 5);
    masked_total += ends;
    INFO("step " << step);
    CHECK(p[step - 1]["loss_tokens"] == G * T);
    CHECK(m[step - 1]["loss_tokens"] == G * T - ends);
  }
  CHECK(masked_total > 0);  // token 5 ends about one token in 32 of the synthetic stream
  CHECK(m[0]["loss"] != p[0]["loss"]);

  // With document masking as well (Megatron's --reset-attention-mask --reset-position-ids --eod-mask-loss).
  Result both = run_keel("train --config " + ws.config + " --out " + (ws.dir / "both") + " -q" + eod_mask +
                         " --set data.document_masking=true");
  INFO(both.output);
  REQUIRE(both.code == 0);
  CHECK(steps_of(ws.dir / "both/metrics.jsonl")[0]["loss_tokens"] == m[0]["loss_tokens"]);
}

// A rehearsal for the GPU without one: under KEEL_GUARD_BACKEND_MEMORY the backend's memory is
// inaccessible to the host between ops (kernels/guarded_backend.h), so any code path of train,
// eval, health statistics, checkpoint save and resume, and sample that reads or writes backend
// memory directly (a device pointer on a GPU) crashes here. The numbers must not change.
TEST_CASE("keel train, resume and sample move backend memory only through backend ops", "[cli][e2e][guard]") {
  const std::string guard = "KEEL_GUARD_BACKEND_MEMORY=1";
  for (const char* family : {"llama", "gpt2"})
    for (const char* mode : {"bf16", "fp16"}) {
      INFO(family << " " << mode);
      nlohmann::json patch = {{"precision", {{"mode", mode}}},
                              {"health", {{"stats_interval", 2}}},
                              {"checkpoint", {{"interval", 3}}},
                              {"train", {{"eval_interval", 3}}}};
      patch["model"] = test::tiny_run_json(family)["model"];
      // GPT-2 also masks documents (its positions go to the backend each micro-batch).
      if (std::string(family) == "gpt2") patch["data"] = {{"document_masking", true}, {"eod_token", 5}};
      Workspace ws(patch);
      const std::string plain = "train --config " + ws.config + " --steps 6 -q --out " + (ws.dir / "plain");
      Result a = run_keel(plain);
      REQUIRE(a.code == 0);
      // the guarded run stops at step 3 and resumes from its checkpoint
      const std::string guarded = "train --config " + ws.config + " -q --out " + (ws.dir / "guarded");
      Result g1 = run_keel(guarded + " --steps 6 --stop-at 3", guard);
      INFO(g1.output);
      REQUIRE(g1.code == 4);  // stopped, resumable
      Result g2 = run_keel(guarded + " --steps 6", guard);
      INFO(g2.output);
      REQUIRE(g2.code == 0);
      const auto want = test::losses_by_step(read_metrics(ws.dir / "plain/metrics.jsonl"));
      const auto got = test::losses_by_step(read_metrics(ws.dir / "guarded/metrics.jsonl"));
      REQUIRE(want.size() == 6);
      CHECK(got == want);  // bit for bit, across the resume

      const std::string sample = "sample -c " + (ws.dir / "plain/checkpoints") + " --prompt-ids 1,4,13 -n 8 -t 0";
      Result s_plain = run_keel(sample), s_guarded = run_keel(sample, guard);
      INFO(s_guarded.output);
      REQUIRE(s_plain.code == 0);
      REQUIRE(s_guarded.code == 0);
      // the same tokens: no tokenizer here, so keel prints the ids
      const auto tokens = [](const std::string& out) {
        const size_t at = out.find("generated ids: ");
        return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
      };
      CHECK(tokens(s_guarded.output) == tokens(s_plain.output));
      CHECK(tokens(s_plain.output).size() > std::string("generated ids: ").size() + 8);  // 8 ids
    }
}

TEST_CASE("keel train --set and flags override config fields", "[cli]") {
  Workspace ws;
  Result r = run_keel("train --config " + ws.config + " --set optimizer.lr=5e-3 --set precision.mode=fp16 --steps 3 " +
                      "--out " + (ws.dir / "x") + " --print-config");
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.output);
  CHECK(j["optimizer"]["lr"].get<double>() == 5e-3);
  CHECK(j["precision"]["mode"] == "fp16");
  CHECK(j["train"]["steps"] == 3);
  CHECK_FALSE(fs::exists(ws.dir / "x"));  // --print-config writes nothing
}

// The batch line gives the global batch the run ramps up to, and with a ramp-up where it starts
// and from which step it is whole: 4 -> 8 samples over 16 samples is 4 steps of 4, then 8.
TEST_CASE("keel train's batch line says where a batch-size ramp-up starts and the step it ends", "[cli][schedule]") {
  Workspace ws;
  const std::string ramp = " --set 'schedule.rampup_batch_size=[4,4,16]' --set train.eval_interval=0";
  Result r = run_keel("train --config " + ws.config + ramp + " --steps 6 --out " + (ws.dir / "a"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: batch: global 8 samples = micro-batch 4 x 2 accumulation steps x dp 1; "
                                       "seq_len 32; after a ramp-up (schedule.rampup_batch_size) from 4 samples by 4 "
                                       "over 16 samples: whole from step 5\n"));
  // The records agree: 4 samples a step until step 5.
  std::map<int64_t, int64_t> batch;
  for (const auto& rec : test::read_metrics(ws.dir / "a/metrics.jsonl"))
    if (rec.contains("loss")) batch[rec["step"]] = rec["global_batch"];
  CHECK(batch == std::map<int64_t, int64_t>{{1, 4}, {2, 4}, {3, 4}, {4, 4}, {5, 8}, {6, 8}});
  r = run_keel("train --config " + ws.config + ramp + " --steps 3 --out " + (ws.dir / "b"));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("over 16 samples, which train.steps ends before the batch is whole\n"));
  r = run_keel("train --config " + ws.config + " --steps 3 --set train.eval_interval=0 --out " + (ws.dir / "c"));
  CHECK_THAT(r.output, Catch::Contains("seq_len 32\n"));
}

TEST_CASE("a bad config is one clear message, exit code 2, and nothing written", "[cli][errors]") {
  Workspace ws;
  const std::string out = ws.dir / "never";
  SECTION("unknown field, with a suggestion") {
    Result r = run_keel("train --config " + ws.config + " --set optimizer.lrr=1 --out " + out);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("optimizer.lrr") && Catch::Contains("unknown field") &&
                             Catch::Contains("did you mean 'lr'"));
  }
  SECTION("bad value names the field, the value and what is allowed") {
    Result r = run_keel("train --config " + ws.config + " --set precision.mode=fp8 --out " + out);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("precision.mode") && Catch::Contains("fp8") && Catch::Contains("bf16") &&
                             Catch::Contains("fp16"));
  }
  SECTION("heads not dividing d_model") {
    Result r = run_keel("train --config " + ws.config + " --set model.n_heads=5 --set model.n_kv_heads=5 --out " + out);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("model.n_heads") && Catch::Contains("d_model"));
  }
  SECTION("invalid JSON names the file") {
    std::ofstream(ws.dir / "broken.json") << "{\"model\": {";
    Result r = run_keel("train --config " + (ws.dir / "broken.json") + " --out " + out);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("broken.json") && Catch::Contains("not valid JSON"));
  }
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("keel train: a model the host cannot hold is refused up front with both sizes, exit code 2",
          "[cli][errors]") {
  Workspace ws;
  // 2^31 ids x 32 wide, embedding and head: over 2 TB of weights, gradients and Adam state.
  const std::string out = ws.dir / "huge";
  Result r = run_keel("train --config " + ws.config + " --set model.vocab_size=2147483648 --steps 2 --out " + out);
  INFO(r.output);
  CHECK(r.code == 2);
  // The limit named is this machine's: MemAvailable, or its cgroup's (in a container or a job).
  const std::string source = host_memory().source;
  CHECK_THAT(r.output, Catch::Contains("the run needs about") && Catch::Contains("GiB of host memory") &&
                           Catch::Contains(" available (" + source.substr(0, source.find(':'))) &&
                           Catch::Contains("--set health.host_memory_check=warn starts it with a warning") &&
                           !Catch::Contains("bad_alloc"));
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("keel train --out '' is refused, not taken as the default run directory", "[cli][errors]") {
  Workspace ws;
  Result r = run_keel("train --config " + ws.config + " --steps 2 --out ''");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("out: an empty path is not allowed"));
}

TEST_CASE("keel train notes fp16 loss-scale settings that a bf16 or fp32 run ignores", "[cli]") {
  Workspace ws;
  Result r = run_keel("train --config " + ws.config + " --set precision.loss_scale.initial=1024 --steps 2 -q --out " +
                      (ws.dir / "a"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: precision.loss_scale is set, but loss scaling is for precision.mode fp16 "
                                       "only: this fp32 run ignores it"));
  r = run_keel("train --config " + ws.config + " --steps 2 -q --out " + (ws.dir / "b"));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("precision.loss_scale"));
}

// lr 10 takes the loss far above a uniform guess's (ln 64) within a few steps, long before the
// spike check arms (health.spike_warmup 50): said at once, and keel doctor counts it a problem
// (was: no warning, exit 0, and doctor's validation "falling").
TEST_CASE("keel train: a loss far above a uniform guess's is called divergence at once", "[cli][health]") {
  Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}}, {"optimizer", {{"lr", 10.0}, {"min_lr", 1.0}}},
                              {"schedule", {{"warmup_steps", 0}}}, {"train", {{"steps", 6}, {"eval_interval", 0}}}});
  const std::string out = ws.dir / "a";
  const Result r = run_keel("train --config " + ws.config + " -q --out " + out);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("is more than twice a uniform guess's over the vocabulary (ln 64 = 4.159)") &&
                           Catch::Contains("the run has diverged"));
  const Result d = run_keel("doctor metrics " + out + "/metrics.jsonl");
  INFO(d.output);
  CHECK(d.code == 1);
  CHECK_THAT(d.output, Catch::Contains("was more than twice a uniform guess's over the vocabulary: the run diverged"));
  // A healthy run says nothing of the kind.
  const Result fine = run_keel("train --config " + ws.config + " -q --out " + (ws.dir / "b") +
                               " --set optimizer.lr=1e-3 --set optimizer.min_lr=1e-4");
  CHECK(fine.code == 0);
  CHECK_THAT(fine.output, !Catch::Contains("uniform guess"));
}

// A loss scale that overflows every backward skips every update: each step warned, and the end
// says so (was: "done" and nothing more, a run that changed no weight reading as a success).
TEST_CASE("keel train: a run whose updates were all skipped says so at the end", "[cli][precision]") {
  Workspace ws(nlohmann::json{{"precision", {{"mode", "fp16"}, {"loss_scale", {{"initial", 1e30}}}}},
                              {"train", {{"steps", 4}, {"eval_interval", 0}}}});
  const Result r = run_keel("train --config " + ws.config + " -q --out " + (ws.dir / "a"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("keel: WARNING 4 of this run's 4 steps skipped their update") &&
                           Catch::Contains("no update was applied, the weights are the ones the run started from"));
  const Result fine = run_keel("train --config " + ws.config + " -q --out " + (ws.dir / "b") +
                               " --set precision.loss_scale.initial=1024");
  CHECK(fine.code == 0);
  CHECK_THAT(fine.output, !Catch::Contains("skipped their update"));
}

TEST_CASE("keel train: the fp16 loss scale at its minimum stops the run with exit code 6 after saving the last good state",
          "[cli][precision]") {
  // lr 10 blows the weights up after one update: every later forward overflows fp16, and the
  // scale (4, then 2 = its minimum) cannot help. README's exit-code table promises 6 and a save.
  Workspace ws(nlohmann::json{
      {"precision", {{"mode", "fp16"}, {"loss_scale", {{"initial", 4}, {"min", 2}, {"hysteresis", 1}}}}},
      {"optimizer", {{"lr", 10.0}, {"grad_clip", 0}}},
      {"schedule", {{"warmup_steps", 0}}},
      {"train", {{"steps", 20}, {"eval_interval", 0}}}});
  Result r = run_keel("train --config " + ws.config + " -q --out " + (ws.dir / "a"));
  INFO(r.output);
  REQUIRE(r.code == 6);
  CHECK_THAT(r.output, Catch::Contains("fp16 loss scale is at its minimum"));
  // The step that stops says the scale is at its minimum (was: "stays at 2 ... hysteresis",
  // beside the ERROR that it cannot go lower), and that a forward overflow is not the scale's.
  CHECK_THAT(r.output, Catch::Contains("update skipped, fp16 loss scale at its minimum 2 (precision.loss_scale.min)") &&
                           !Catch::Contains("stays at 2"));
  CHECK_THAT(r.output, Catch::Contains("the overflow is in the forward pass, which the loss scale does not touch"));
  // The save holds the state before the overflowing steps: one applied update, the skips counted.
  const std::string latest = test::read_file(ws.dir / "a/checkpoints/latest");
  const fs::path saved = fs::path(ws.dir / "a/checkpoints") / latest.substr(0, latest.find('\n'));
  REQUIRE(fs::exists(saved / "meta.json"));
  const auto meta = nlohmann::json::parse(test::read_file((saved / "meta.json").string()));
  const int64_t iteration = meta["progress"]["iteration"], skipped = meta["progress"]["skipped_total"];
  CHECK(skipped >= 2);  // scale 4 -> 2, then the overflow at the minimum
  CHECK(meta["adam_step"] == iteration - skipped);
  Result verify = run_keel("ckpt verify " + saved.string());
  INFO(verify.output);
  CHECK(verify.code == 0);
  // Its probe forward overflowed too: JSON writes that loss null. The advised way on (bf16, a
  // lower lr) resumes it, and says the saved probe was not finite (was: a raw JSON type error).
  REQUIRE(meta["health"]["probe_loss"].is_null());
  for (const std::string& how : std::vector<std::string>{" --eval-only", " --steps " + std::to_string(iteration + 2)}) {
    Result on = run_keel("train --config " + ws.config + " -q --out " + (ws.dir / "a") +
                         " --set precision.mode=bf16 --set optimizer.lr=1e-4 --set optimizer.min_lr=1e-5" + how);
    INFO(on.output);
    CHECK(on.code == 0);
    CHECK_THAT(on.output, Catch::Contains("the probe batch's loss was not finite when saved (its forward overflowed: "
                                          "these weights overflow in fp16)"));
  }
}

TEST_CASE("missing or truncated data: one clear message naming the file, exit code 3, nothing written",
          "[cli][errors]") {
  Workspace ws;
  const std::string out = ws.dir / "never";
  SECTION("missing training file") {
    Result r = run_keel("train --config " + ws.config + " --set data.train=" + (ws.dir / "nope_*.bin") + " --out " + out);
    CHECK(r.code == 3);
    CHECK_THAT(r.output, Catch::Contains("data.train") && Catch::Contains("nope_*.bin"));
  }
  SECTION("truncated shard") {
    fs::resize_file(ws.dir / "train.bin", fs::file_size(ws.dir / "train.bin") - 100);
    Result r = run_keel("train --config " + ws.config + " --out " + out);
    CHECK(r.code == 3);
    CHECK_THAT(r.output, Catch::Contains("train.bin") && Catch::Contains("truncated"));
  }
  SECTION("token beyond the vocabulary") {
    Result r = run_keel("train --config " + ws.config + " --set model.vocab_size=32 --out " + out);
    CHECK(r.code == 3);
    CHECK_THAT(r.output, Catch::Contains("train.bin") && Catch::Contains("vocab"));
  }
  CHECK_FALSE(fs::exists(out));
}

// Windows never cross a file, so files shorter than a window give none. Here 40 files of 20
// tokens (none reach train.seq_len + 1 = 33) and one of 1000 (31 windows, 992 tokens): 808 of
// the 1800 tokens, 44.9%, are in no window. The workspace's one file of 20000 tokens loses 32.
TEST_CASE("keel train warns when a source's files are too short for its windows", "[cli][data]") {
  test::Workspace ws(nlohmann::json{{"train", {{"eval_batches", 1}}}});
  fs::create_directories(ws.dir / "tiny");
  for (int k = 0; k < 40; ++k)
    data::write_llmc_shard(ws.dir / ("tiny/part_" + std::to_string(100 + k) + ".bin"), test::synthetic_tokens(20, k), false);
  data::write_llmc_shard(ws.dir / "tiny/part_big.bin", test::synthetic_tokens(1000, 99), false);
  const std::string base = "train --config " + ws.config + " --eval-only";
  auto r = test::run_keel(base + " --set data.train=" + (ws.dir / "tiny/*.bin"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING data.train: 44.9% of its 1800 tokens are in no training window") &&
                           Catch::Contains("40 of its 41 files are shorter than one window") &&
                           Catch::Contains("train.seq_len + 1 = 33") && Catch::Contains("larger shards"));
  r = test::run_keel(base);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("in no training window"));
}

// --eval-only writes nothing, so its evaluations are its whole result: -q (which leaves out the
// per-step lines) printed none of them.
TEST_CASE("keel train --eval-only -q prints the evaluations", "[cli][eval]") {
  test::Workspace ws(nlohmann::json{{"train", {{"eval_batches", 1}}}});
  const std::string base = "train --config " + ws.config + " --eval-only";
  auto loud = test::run_keel(base), quiet = test::run_keel(base + " -q");
  INFO(loud.output << "\n---\n" << quiet.output);
  REQUIRE(loud.code == 0);
  REQUIRE(quiet.code == 0);
  auto validation_line = [](const std::string& out) {
    const size_t at = out.find(" validation at iteration 0 | lm loss: ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  CHECK_FALSE(validation_line(loud.output).empty());
  CHECK(validation_line(quiet.output) == validation_line(loud.output));
}

// A corpus with fewer windows than the batch takes samples: each step reads some windows twice.
TEST_CASE("keel train warns when a step takes more samples than the data has windows", "[cli][data]") {
  test::Workspace ws(nlohmann::json{{"train", {{"eval_batches", 1}}}});
  data::write_llmc_shard(ws.dir / "small.bin", test::synthetic_tokens(200, 5), false);  // 6 windows of 32+1
  const std::string base = "train --config " + ws.config + " --eval-only";
  auto r = test::run_keel(base + " --set data.train=" + (ws.dir / "small.bin"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING data.train: each step takes 8 samples of its 6 windows, so a batch "
                                       "holds some windows more than once (up to 2 times)"));
  r = test::run_keel(base);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("more than once"));
}

// A file listed twice in data.train is read once; the user may have meant to up-weight it, so
// keel says so, naming the file and the entries, and points at data.train_weights.
TEST_CASE("keel train warns when entries of data.train match the same file", "[cli][data]") {
  test::Workspace ws(nlohmann::json{{"train", {{"eval_batches", 1}}}});
  const std::string base = "train --config " + ws.config + " --eval-only";
  const std::string glob = ws.dir / "*.bin", train = ws.dir / "train.bin";
  auto r = test::run_keel(base + " --set 'data.train=[\"" + glob + "\", \"" + train + "\"]'");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING data.train: 1 file(s) matched by more than one entry: " + train +
                                       " (by '" + glob + "', '" + train + "'). Each file is read once") &&
                           Catch::Contains("data.train_weights"));
  CHECK_THAT(r.output, Catch::Contains("training windows of 32+1 tokens from 2 file(s)"));  // train.bin and val.bin
  // Each entry once: no warning; nor in a blend, where each entry is a source of its own.
  r = test::run_keel(base + " --set 'data.train=[\"" + train + "\"]'");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("matched by more than one entry"));
  r = test::run_keel(base + " --set 'data.train=[\"" + glob + "\", \"" + train + "\"]' --set 'data.train_weights=[1, 1]'");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("matched by more than one entry"));
}

// Instruction data read in windows that cut examples apart is reported at start-up with the
// share of in-loss targets whose example began in an earlier window. Examples of 48 tokens
// (47 and an end of example, all in the loss) in windows of 32: of every three windows the first
// starts an example (0 cut), the second starts 32 tokens into one (its first 15 targets are the
// cut example's), the third 16 into the next (31 targets). Over the 64 windows scanned:
// 21 x (15 + 31) = 966 of 64 x 32 = 2048 targets, 47.2%. Examples of 16 tokens line up with
// the windows (no warning), and so does data without masks (pretraining text, cut by design).
TEST_CASE("keel train warns when instruction data is cut by its windows, with the share of targets", "[cli][pack]") {
  test::Workspace ws(nlohmann::json{{"train", {{"eval_batches", 1}}}});
  auto shard = [&](const std::string& name, int length, bool mask) {
    fs::create_directories(ws.dir / name);
    std::vector<uint32_t> tokens;
    while (tokens.size() < 64 * 32 + 64)
      for (int k = 0; k < length; ++k) tokens.push_back(k + 1 < length ? 1 + k % 60 : 0);
    data::write_llmc_shard(ws.dir / (name + "/train_000.bin"), tokens, false);
    if (mask) data::write_loss_mask(ws.dir / (name + "/train_000.mask"), std::vector<uint8_t>(tokens.size(), 1));
    std::ofstream(ws.dir / (name + "/meta.json")) << R"({"eot_id": 0})";
    return " --set data.train=" + ws.dir / (name + "/train_000.bin");
  };
  const std::string base = "train --config " + ws.config + " --eval-only";
  auto r = test::run_keel(base + shard("cut", 48, true));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING data.train: 47.2% of the in-loss targets in its first windows belong to "
                                       "examples that began in an earlier window") &&
                           Catch::Contains("keel tokenize --pack 32"));
  for (const auto& [name, length, mask] : {std::tuple<std::string, int, bool>{"aligned", 16, true}, {"text", 48, false}}) {
    r = test::run_keel(base + shard(name, length, mask));
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, !Catch::Contains("began in an earlier window"));
  }
}
