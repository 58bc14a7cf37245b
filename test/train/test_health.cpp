// Training health: one regression test per seed bug, each a miniature of the real one, and
// healthy runs where nothing fires.
#include <catch2/catch.hpp>

#include <fstream>
#include <random>

#include "common/batches.h"
#include "common/checkpoint_meta.h"
#include "common/process.h"
#include "common/run_config.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "data/token_file.h"
#include "train/checkpoint.h"
#include "train/health.h"
#include "train/trainer.h"

using namespace keel;

using test::learnable_batches;
using test::noise_batches;

TEST_CASE("seed 002: norms frozen by bf16-only parameters are reported by name with the precision reason",
          "[health][frozen]") {
  const nlohmann::json patch = {{"optimizer", {{"lr", 1e-4}, {"min_lr", 1e-4}, {"weight_decay", 0.0}}},
                                {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}},
                                {"health", {{"frozen_check_interval", 5}, {"frozen_window", 3}}}};
  auto be = make_cpu_backend();
  for (const char* mode : {"bf16-unsafe-no-master", "bf16"}) {
    INFO(mode);
    nlohmann::json p = patch;
    p["precision"] = {{"mode", mode}};
    Trainer tr(test::make_config(test::tiny_run_json(), p), *be);
    tr.init_weights();
    std::vector<std::string> reports;
    int first_report_step = -1;
    for (int s = 1; s <= 60; ++s) {
      StepStats st = tr.step(learnable_batches(2, 4, 32, static_cast<uint32_t>(s)), s);
      for (auto& f : st.frozen) {
        reports.push_back(f);
        if (first_report_step < 0) first_report_step = s;
      }
    }
    if (std::string(mode) == "bf16") {
      CHECK(reports.empty());  // with fp32 masters the gains train: no false alarm
      continue;
    }
    // Every norm gain (and nothing else) is reported, within the window: 3 checks of 5 steps
    // after the first sample (step 5) -> by step 20.
    REQUIRE(!reports.empty());
    CHECK(first_report_step <= 20);
    for (const auto& r : reports) {
      INFO(r);
      CHECK_THAT(r, Catch::Contains("norm.weight") && Catch::Contains("round away") &&
                        Catch::Contains("spacing") && Catch::Contains("precision.mode = \"bf16\""));
    }
    CHECK(reports.size() == 5);  // attn_norm and mlp_norm of 2 layers, final_norm
  }
}

TEST_CASE("seed 001: a norm misfiled into the weight-decay group is caught by the audit", "[health][audit]") {
  ModelConfig m = test::make_config(test::tiny_run_json("gpt2")).model;
  std::vector<ParamSpec> params = ParamTable(m).params();
  CHECK(audit_param_groups(params).empty());
  for (auto& p : params)
    if (p.name == "layers.1.mlp_norm.weight") p.decay = true;  // the BLOOM embed-norm bug, in miniature
  for (auto& p : params)
    if (p.name == "layers.0.attn.wq") p.decay = false;
  auto problems = audit_param_groups(params);
  REQUIRE(problems.size() == 2);
  CHECK_THAT(problems[0], Catch::Contains("layers.0.attn.wq") && Catch::Contains("not in the weight-decay group"));
  CHECK_THAT(problems[1], Catch::Contains("layers.1.mlp_norm.weight") && Catch::Contains("must not decay"));
  CHECK_THAT(param_group_table(ParamTable(m), 0.1), Catch::Contains("decay 0.1") && Catch::Contains("no decay"));
}

TEST_CASE("seed 003: fp16 overflow in a known layer is localised to that layer and op", "[health][fp16]") {
  auto be = make_cpu_backend();
  RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "fp16"}, {"loss_scale", {{"initial", 1.0}}}}}});
  // One weight made huge: the report of the first step, whose forward overflows fp16 there.
  auto report_with_huge = [&](const std::string& tensor, float scale) {
    Trainer tr(cfg, *be);
    tr.init_weights();
    std::vector<float> w(static_cast<size_t>(tr.table().local_numel()));
    tr.state().master_to_host(w.data());
    const ParamSpec& p = tr.table().at(tensor);
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) w[static_cast<size_t>(i)] *= scale;
    tr.state().load_fp32(w.data());
    const StepStats st = tr.step(learnable_batches(2, 4, 32, 1), 1);
    CHECK(st.nonfinite);
    return st.nonfinite_report;
  };
  // Layer 1's MLP input projection: its output exceeds fp16's 65504 there first.
  const std::string gate = report_with_huge("layers.1.mlp.w_gate", 3e5f);
  INFO(gate);
  CHECK_THAT(gate, Catch::Contains("forward, layer 1, mlp gate/up projection") && Catch::Contains("inf") &&
                       Catch::Contains("65504"));
  // The attention output projection: without TP it is one op with the residual add, and the
  // report names both (it named the residual add alone, hiding wo).
  const std::string wo = report_with_huge("layers.1.attn.wo", 3e6f);
  INFO(wo);
  CHECK_THAT(wo, Catch::Contains("forward, layer 1, attention output projection (wo) + residual add"));
}

TEST_CASE("per-layer activation and gradient magnitudes are collected on request", "[health][stats]") {
  auto be = make_cpu_backend();
  Trainer tr(test::make_config(test::tiny_run_json()), *be);
  tr.init_weights();
  StepStats plain = tr.step(learnable_batches(2, 4, 32, 1), 1);
  CHECK(plain.act_max.empty());
  StepStats st = tr.step(learnable_batches(2, 4, 32, 2), 2, true);
  REQUIRE(st.act_max.size() == 2);
  REQUIRE(st.grad_max.size() == 2);
  for (size_t l = 0; l < 2; ++l) {
    CHECK(st.act_max[l] > 0.01f);
    CHECK(st.act_max[l] < 100.0f);
    CHECK(st.grad_max[l] > 0.0f);
  }
}

TEST_CASE("spikes: a running z-score flags a jump, not a healthy falling curve, action skip skips the update",
          "[health][spike]") {
  HealthConfig h;
  SpikeDetector healthy(h);
  for (int s = 0; s < 300; ++s) {
    const double loss = 2.0 + 3.0 * std::exp(-s / 40.0) + 0.02 * std::sin(s * 1.3);
    CHECK_FALSE(healthy.observe(loss, 1.0 + 0.1 * std::cos(s * 0.7)).any());
  }
  SpikeDetector spiky(h);
  for (int s = 0; s < 100; ++s) spiky.observe(2.0 + 0.01 * std::sin(s), 1.0);
  auto v = spiky.observe(3.0, 1.0);
  CHECK(v.loss_spike);
  CHECK(v.loss_z > 6);

  auto be = make_cpu_backend();
  Trainer tr(test::make_config(test::tiny_run_json(), {{"health", {{"spike_action", "skip"}, {"spike_warmup", 20}}}}), *be);
  tr.init_weights();
  for (int s = 1; s <= 60; ++s) {
    StepStats h = tr.step(learnable_batches(2, 4, 32, static_cast<uint32_t>(s)), s);
    INFO("step " << s << " loss " << h.loss << " " << h.spike_text);
    CHECK_FALSE(h.spike);
  }
  const int64_t adam_before = tr.state().adam_step;
  StepStats st = tr.step(noise_batches(2, 4, 32, 7), 61);  // pure noise: the loss jumps
  INFO(st.spike_text << " loss " << st.loss << " grad norm " << st.grad_norm);
  CHECK(st.spike);
  CHECK(st.skipped);
  CHECK(tr.state().adam_step == adam_before);
}

// A flagged step stays out of the statistics: the same jump again (data that stays bad, or the
// steps after a rewind) is judged against the level before it, not one it raised. Ten flagged
// steps in a row are a new level: the statistics restart there and re-arm after the warmup.
TEST_CASE("spikes: flagged steps stay out of the statistics, ten in a row are a new level", "[health][spike]") {
  HealthConfig h;
  h.spike_warmup = 20;
  SpikeDetector d(h);
  for (int s = 0; s < 100; ++s) CHECK_FALSE(d.observe(2.0 + 0.01 * std::sin(s), 1.0).any());
  const nlohmann::json before = d.to_json();
  for (int k = 1; k < SpikeDetector::kLevelShiftSteps; ++k) {
    INFO("flagged step " << k);
    const SpikeDetector::Verdict v = d.observe(3.0, 1.0);
    CHECK(v.loss_spike);
    CHECK_FALSE(v.level_shift);
    // the statistics are those of the healthy steps: only the count of flagged steps moved
    nlohmann::json now = d.to_json();
    CHECK(now["streak"] == k);
    now["streak"] = 0;
    CHECK(now == before);
  }
  const SpikeDetector::Verdict shift = d.observe(3.0, 1.0);
  CHECK(shift.loss_spike);
  CHECK(shift.level_shift);
  CHECK_THAT(d.describe(shift, 3.0, 1.0), Catch::Contains("10 steps in a row were flagged: taken as a new level"));
  // The new level: not flagged while the check re-arms, nor once it has (3.0 is its mean now).
  for (int s = 0; s < 40; ++s) CHECK_FALSE(d.observe(3.0 + 0.01 * std::sin(s), 1.0).any());
  CHECK(d.observe(4.5, 1.0).loss_spike);  // and a jump from it is a spike again

  // The state round-trips exactly: a restored detector makes the same calls, bit for bit.
  SpikeDetector a(h), b(h);
  for (int s = 0; s < 60; ++s) a.observe(2.0 + std::exp(-s / 10.0), 1.0 + 0.1 * std::cos(s));
  a.observe(9.0, 1.0);  // one flagged step in the streak
  b.restore(nlohmann::json::parse(a.to_json().dump()), false);
  CHECK(b.to_json() == a.to_json());
  for (double loss : {2.01, 2.02, 5.0, 2.0}) {
    const auto va = a.observe(loss, 1.0), vb = b.observe(loss, 1.0);
    CHECK(va.any() == vb.any());
    CHECK(va.loss_z == vb.loss_z);
  }
  // A rewind keeps the flagged steps' count of the detector it restores into.
  SpikeDetector c(h);
  c.observe(1.0, 1.0);
  nlohmann::json saved = c.to_json();
  saved["streak"] = 7;
  c.restore(saved, true);
  CHECK(c.to_json()["streak"] == 0);
  c.restore(saved, false);
  CHECK(c.to_json()["streak"] == 7);
}

TEST_CASE("seed 000: a weights-only load whose masters are not the loaded weights is refused before step 1",
          "[health][restart][cli]") {
  test::Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}}, {"train", {{"steps", 20}}}});
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "pre") + " -q").code == 0);
  const std::string ck = ws.dir / "pre/checkpoints";
  auto good = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "ft") + " --init-from " + ck);
  INFO(good.output);
  CHECK(good.code == 0);
  CHECK_THAT(good.output, Catch::Contains("restart verification passed") && Catch::Contains("probe loss"));
  auto broken = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "ft2") + " --init-from " + ck,
                               "KEEL_FAULT_MASTERS_FROM_INIT=1");
  INFO(broken.output);
  CHECK(broken.code == 5);
  CHECK_THAT(broken.output, Catch::Contains("restart verification failed") &&
                                Catch::Contains("did not come from the loaded weights") &&
                                Catch::Contains("layers.0.attn.wq"));
  CHECK_FALSE(std::filesystem::exists(ws.dir / "ft2/metrics.jsonl"));
}

TEST_CASE("a resume verifies the probe loss bit for bit, a tampered tensor is named", "[health][restart][cli]") {
  test::Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}}, {"train", {{"steps", 20}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 10").code == 4);
  auto ok = test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 12");
  INFO(ok.output);
  CHECK_THAT(ok.output, Catch::Contains("restart verification passed"));
  // Pretend the save recorded other numbers for one tensor: the resume names it and refuses.
  const std::string meta_path = out + "/checkpoints/step_00000012/meta.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  meta["health"]["tensor_sumsq"]["layers.1.mlp_norm.weight"][0] = 1.0;
  test::write_checkpoint_meta(meta_path, meta);
  auto bad = test::run_keel("train --config " + ws.config + " --out " + out);
  INFO(bad.output);
  CHECK(bad.code == 5);
  CHECK_THAT(bad.output, Catch::Contains("restart verification failed") && Catch::Contains("layers.1.mlp_norm.weight"));
}

// A GPU model, cuBLASLt or NCCL version sums in its own order, and another keel build may have
// other kernels, so a resume on another one (the same layout) cannot reproduce the probe loss's
// bits: it must agree within rounding instead.
TEST_CASE("a resume on another arithmetic (device, libraries) or keel build verifies within rounding",
          "[health][restart][cli]") {
  test::Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}}, {"train", {{"steps", 20}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 10").code == 4);
  const std::string meta_path = out + "/checkpoints/step_00000010/meta.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  CHECK(meta["health"]["arithmetic"] == "cpu");
  // What another device might have saved: the same loss to 1e-4, other bits.
  meta["health"]["probe_loss"] = meta["health"]["probe_loss"].get<double>() * (1 + 1e-4);
  meta["health"]["probe_loss_bits"] = "0000000000000000";
  test::write_checkpoint_meta(meta_path, meta);
  auto same = test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 12");
  INFO(same.output);
  CHECK(same.code == 5);  // recorded as this arithmetic: the bits must match
  CHECK_THAT(same.output, Catch::Contains("same layout and arithmetic: the bits must match"));

  meta["health"]["arithmetic"] = "cuda NVIDIA H100 80GB HBM3 sm_90 cublasLt 130000";
  test::write_checkpoint_meta(meta_path, meta);
  auto other = test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 12");
  INFO(other.output);
  CHECK(other.code == 4);
  CHECK_THAT(other.output, Catch::Contains("computed by cuda NVIDIA H100 80GB HBM3 sm_90 cublasLt 130000, this run by cpu") &&
                               Catch::Contains("restart verification passed"));
  // A checkpoint of another keel build (or one from before builds were recorded) on the same
  // arithmetic: kernels may have changed, so within rounding too.
  meta["health"]["arithmetic"] = "cpu";
  const std::string this_build = meta["health"]["build"];
  CHECK_THAT(this_build, Catch::StartsWith("crc32c "));
  for (const nlohmann::json& build : {nlohmann::json("crc32c 00000000"), nlohmann::json()}) {
    if (build.is_null()) meta["health"].erase("build");
    else meta["health"]["build"] = build;
    test::write_checkpoint_meta(meta_path, meta);
    auto rebuilt = test::run_keel("train --config " + ws.config + " --out " + out + " --resume " + out +
                                  "/checkpoints/step_00000010 --stop-at 12");
    INFO(rebuilt.output);
    CHECK(rebuilt.code == 4);
    CHECK_THAT(rebuilt.output, Catch::Contains("saved by another keel build (" +
                                               (build.is_null() ? std::string("unrecorded") : build.get<std::string>()) +
                                               ", this one " + this_build + ")") &&
                                   Catch::Contains("restart verification passed"));
  }
  // ... but a real difference is still caught
  meta["health"]["probe_loss"] = meta["health"]["probe_loss"].get<double>() * 1.1;
  test::write_checkpoint_meta(meta_path, meta);
  auto off = test::run_keel("train --config " + ws.config + " --out " + out + " --resume " + out + "/checkpoints/step_00000010");
  INFO(off.output);
  CHECK(off.code == 5);
  CHECK_THAT(off.output, Catch::Contains("another layout or arithmetic: must agree within rounding"));
}

// "Switch to fp32 to debug" (and back): another precision rounds the working weights differently,
// so the probe loss agrees within rounding, and the weights are compared in the copy the run
// continues from (its masters, else its working weights) against the saved copy it came from.
TEST_CASE("a resume under another precision.mode verifies within rounding, in the copy it continues from",
          "[health][restart][cli]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 20}}}});
  for (const std::string from : {"bf16", "fp32"}) {
    const std::string out = ws.dir / ("from_" + from);
    REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 10 --set precision.mode=" +
                           from).code == 4);
    for (const std::string to : {"bf16", "fp32", "fp16", "bf16-unsafe-no-master"}) {
      if (to == from) continue;
      const std::string ck = out + "/checkpoints/step_00000010";
      auto r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / (from + "_" + to)) +
                              " --resume " + ck + " --stop-at 11 --set precision.mode=" + to);
      INFO(from << " -> " << to << "\n" << r.output);
      CHECK(r.code == 4);
      CHECK_THAT(r.output, Catch::Contains("the checkpoint was trained in " + from + ", this run in " + to) &&
                               Catch::Contains("restart verification passed"));
    }
  }
  // A real difference in the copy the run continues from is still named: bf16 -> fp32 continues
  // from the bf16 run's masters.
  const std::string meta_path = ws.dir / "from_bf16/checkpoints/step_00000010/meta.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  meta["health"]["tensor_sumsq"]["layers.1.mlp_norm.weight"][1] = 1.0;
  test::write_checkpoint_meta(meta_path, meta);
  auto bad = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "bad") + " --resume " +
                            (ws.dir / "from_bf16/checkpoints/step_00000010") + " --set precision.mode=fp32");
  INFO(bad.output);
  CHECK(bad.code == 5);
  CHECK_THAT(bad.output, Catch::Contains("layers.1.mlp_norm.weight: |weights|^2 = ") &&
                             Catch::Contains("after loading (fp32), |fp32 master|^2 = 1 when saved (bf16)"));
}

// The skip warning said "fp16 loss scale backs off" at every overflow, also those the hysteresis
// absorbs with the scale unchanged.
TEST_CASE("an fp16 overflow says whether the loss scale backed off or the hysteresis kept it", "[health][cli][precision]") {
  test::Workspace ws(nlohmann::json{
      {"precision",
       {{"mode", "fp16"}, {"loss_scale", {{"initial", 1099511627776.0}, {"hysteresis", 2}, {"growth_interval", 1000}}}}},
      {"train", {{"steps", 3}}}});
  auto r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "run") + " -q");
  INFO(r.output);
  CHECK(r.code == 0);
  // 2^40 overflows at once: step 1 uses up the hysteresis, step 2 halves the scale.
  CHECK_THAT(r.output, Catch::Contains("step 1: non-finite gradient (update skipped, fp16 loss scale stays at "
                                       "1.09951e+12 (precision.loss_scale.hysteresis 2): the next overflow cuts it "
                                       "unless it grows first)") &&
                           Catch::Contains("step 2: non-finite gradient (update skipped, fp16 loss scale backs off "
                                           "from 1.09951e+12 to 5.49756e+11)"));
}

TEST_CASE("a healthy run raises no health warning", "[health][cli]") {
  test::Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16"}}},
                                    {"train", {{"steps", 200}, {"eval_interval", 50}}},
                                    {"optimizer", {{"lr", 3e-3}, {"min_lr", 3e-4}}},
                                    {"checkpoint", {{"interval", 50}}},
                                    {"health", {{"replica_check_interval", 10}, {"stats_interval", 5}}}});
  auto r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "run") + " -q");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("WARNING") == std::string::npos);
  int with_stats = 0;
  for (const auto& rec : test::read_metrics(ws.dir / "run/metrics.jsonl"))
    if (rec.contains("act_max")) {
      ++with_stats;
      CHECK(rec["act_max"].size() == 2);
    }
  CHECK(with_stats == 40);
}

// dir/run.json: 60 steps of the tiny model with spike_action rewind and a save every 10 steps,
// on sequential data (no shuffle) whose stretch for steps 41-43 is pure noise.
namespace {
void write_rewind_run(const test::TempDir& dir) {
  auto tokens = test::synthetic_tokens(20000, 3);
  std::mt19937 rng(5);
  const size_t per_step = 8 * 32;  // global batch 8 x seq 32 (non-overlapping windows)
  for (size_t i = 40 * per_step; i < 43 * per_step; ++i) tokens[i] = rng() % 64;
  data::write_llmc_shard(dir / "train.bin", tokens, false);
  nlohmann::json j = test::tiny_run_json();
  j["data"] = {{"train", dir / "train.bin"}, {"shuffle", false}};
  j["train"]["steps"] = 60;
  j["checkpoint"] = {{"interval", 10}};
  j["health"] = {{"spike_action", "rewind"}, {"spike_warmup", 20}};
  std::ofstream(dir / "run.json") << j.dump(2);
}
}  // namespace

TEST_CASE("spike action rewind: back to the last checkpoint, the offending data skipped", "[health][spike][cli]") {
  test::TempDir dir("rewind");
  write_rewind_run(dir);
  auto r = test::run_keel("train --config " + (dir / "run.json") + " --out " + (dir / "out") + " -q");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("spike (loss") && Catch::Contains("rewound to") &&
                           Catch::Contains("step_00000040") && Catch::Contains("are skipped"));
  int rewinds = 0;
  for (const auto& rec : test::read_metrics(dir / "out/metrics.jsonl"))
    if (rec.value("event", "") == "rewind") {
      ++rewinds;
      CHECK(rec["to"] == 40);
    }
  CHECK(rewinds >= 1);
  CHECK(rewinds <= 3);
  // The steps of the abandoned trajectory (the skipped spike among them) are not the final
  // checkpoint's: its skipped count is the rewound-to checkpoint's plus what came after, so
  // Adam's step equals iteration - skipped and keel doctor finds the checkpoint consistent.
  const auto final_ck = Checkpoint::open(dir / "out/checkpoints/step_00000060");
  CHECK(final_ck.adam_step() == final_ck.progress().iteration - final_ck.progress().skipped_total);
  auto doc = test::run_keel("doctor ckpt " + (dir / "out/checkpoints/step_00000060"));
  INFO(doc.output);
  CHECK(doc.code == 0);
  CHECK_THAT(doc.output, Catch::Contains("skipped: consistent"));
  // The spikes were on the abandoned stretches, so the trajectory kept skipped nothing.
  CHECK(final_ck.progress().skipped_total == 0);
  CHECK(final_ck.progress().nan_total == 0);
}

// A rewind loads a checkpoint as a resume does: verified first. A damaged one (here flipped on
// disk once saved) was loaded unverified, or ended the run with exit 5 when it failed to open;
// now the spike is skipped instead and the run goes on.
TEST_CASE("spike action rewind to a damaged checkpoint: refused by name, the update skipped, training goes on",
          "[health][spike][cli]") {
  test::TempDir dir("rewind-damaged");
  write_rewind_run(dir);
  auto r = test::run_keel("train --config " + (dir / "run.json") + " --out " + (dir / "out") + " -q",
                          "KEEL_FAULT_DAMAGE_SAVE=step_00000040");
  INFO(r.output);
  CHECK(r.code == 0);
  const std::string damaged = dir / "out/checkpoints/step_00000040";
  CHECK_THAT(r.output, Catch::Contains("spike (loss") && Catch::Contains("cannot rewind: refusing to rewind to") &&
                           Catch::Contains(damaged) && Catch::Contains("is corrupt") &&
                           Catch::Contains("the update was skipped instead and training goes on"));
  CHECK(r.output.find("keel: rewound to") == std::string::npos);
  int refused = 0, rewinds = 0, trained = 0;
  for (const auto& rec : test::read_metrics(dir / "out/metrics.jsonl")) {
    if (rec.value("event", "") == "rewind_refused") {
      ++refused;
      CHECK(rec["checkpoint"] == damaged);
    }
    if (rec.value("event", "") == "rewind") ++rewinds;
    if (rec.contains("loss")) ++trained;
  }
  CHECK(refused == 1);  // verified once: later spikes say so in a line
  CHECK(rewinds == 0);
  CHECK(trained == 60);
  const auto final_ck = Checkpoint::open(dir / "out/checkpoints/step_00000060");
  CHECK(final_ck.verify().empty());
  CHECK(final_ck.progress().skipped_total >= 1);  // the spikes' updates
  CHECK(final_ck.adam_step() == 60 - final_ck.progress().skipped_total);
  // keel doctor metrics counts the refusal among the run's problems.
  auto doc = test::run_keel("doctor metrics " + (dir / "out/metrics.jsonl"));
  INFO(doc.output);
  CHECK(doc.code == 1);
  CHECK_THAT(doc.output, Catch::Contains("at step 41 a spike's rewind refused " + damaged));
}

// The spike check's statistics are in every checkpoint: a run stopped just before a spike and
// resumed flags it at the same step as the run that did not stop (before, the resumed check was
// unarmed for health.spike_warmup steps: blind to a restart spike, and skipping other steps).
TEST_CASE("a resume restores the spike check: the same spike is flagged and skipped at the same step",
          "[health][spike][cli]") {
  test::TempDir dir("spike-resume");
  auto tokens = test::synthetic_tokens(20000, 3);
  std::mt19937 rng(5);
  const size_t per_step = 8 * 32;  // global batch 8 x seq 32 (non-overlapping windows)
  for (size_t i = 60 * per_step; i < 61 * per_step; ++i) tokens[i] = rng() % 64;  // step 61 reads noise
  data::write_llmc_shard(dir / "train.bin", tokens, false);
  nlohmann::json j = test::tiny_run_json();
  j["data"] = {{"train", dir / "train.bin"}, {"shuffle", false}};
  j["train"]["steps"] = 65;
  j["checkpoint"] = {{"interval", 0}, {"save_at_end", false}};
  j["health"] = {{"spike_action", "skip"}, {"spike_warmup", 20}};
  std::ofstream(dir / "run.json") << j.dump(2);
  const std::string cmd = "train --config " + (dir / "run.json") + " -q --out ";
  auto straight = test::run_keel(cmd + (dir / "straight"));
  INFO(straight.output);
  REQUIRE(straight.code == 0);
  REQUIRE(test::run_keel(cmd + (dir / "resumed") + " --stop-at 60").code == 4);
  const auto saved = Checkpoint::open(dir / "resumed/checkpoints/step_00000060").meta();
  CHECK(saved["health"]["spike_detector"]["loss"][2] == 60);  // 60 steps in its statistics
  auto resumed = test::run_keel(cmd + (dir / "resumed"));
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  auto steps = [](const std::string& metrics) {
    std::map<int64_t, nlohmann::json> by_step;
    for (const auto& rec : test::read_metrics(metrics))
      if (rec.contains("loss")) by_step[rec["step"].get<int64_t>()] = rec;
    return by_step;
  };
  const auto a = steps(dir / "straight/metrics.jsonl"), b = steps(dir / "resumed/metrics.jsonl");
  REQUIRE(a.size() == 65);
  REQUIRE(b.size() == 65);
  CHECK(a.at(61).contains("spike"));
  CHECK(a.at(61)["skipped_total"] == 1);
  for (int64_t s = 61; s <= 65; ++s) {
    INFO("step " << s);
    CHECK(b.at(s).contains("spike") == a.at(s).contains("spike"));
    CHECK(b.at(s)["loss"].get<double>() == a.at(s)["loss"].get<double>());
    CHECK(b.at(s)["skipped_total"] == a.at(s)["skipped_total"]);
  }
}
