// keel doctor (train/doctor.h): each check on a miniature of the seed bug it exists for, and on a
// healthy artefact where it must stay quiet.
//   frozen   seed 002: bf16-only parameters, small lr: the norm gains never move
//   ckpt     seed 000: masters left at a fresh init; a lost Adam step; moments never restored;
//            seed 001: a norm misfiled in the weight-decay group
//   metrics  a loss spike, a restart spike, overflow skips and fp16 scale cuts
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/process.h"
#include "common/run_config.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "train/doctor.h"
#include "train/trainer.h"

using namespace keel;

namespace {

std::vector<MicroBatch> batches_at(const std::vector<uint32_t>& tokens, size_t start) {
  const int n_micro = 2, mbs = 4, T = 32;
  std::vector<MicroBatch> out(n_micro);
  size_t at = start;
  for (auto& mb : out)
    for (int b = 0; b < mbs; ++b, at += T)
      for (int t = 0; t < T; ++t) {
        mb.inputs.push_back(static_cast<int32_t>(tokens[at + t]));
        mb.targets.push_back(static_cast<int32_t>(tokens[at + t + 1]));
      }
  return out;
}

RunConfig config_for(const std::string& mode, double lr) {
  return test::make_config(test::tiny_run_json(),
                           {{"precision", {{"mode", mode}}},
                            {"optimizer", {{"lr", lr}, {"min_lr", lr}}},
                            {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}}});
}

// Trains `steps` steps (numbered from first_step) on synthetic tokens.
void train(Trainer& tr, int first_step, int steps) {
  static const auto tokens = test::synthetic_tokens(8000, 7);
  for (int s = first_step; s < first_step + steps; ++s) tr.step(batches_at(tokens, 300 * static_cast<size_t>(s)), s);
}

std::string save(Trainer& tr, const RunConfig& cfg, Backend& be, const std::string& dir, int64_t iteration) {
  CheckpointManager mgr(dir, cfg.checkpoint);
  TrainProgress p{iteration, iteration * 8, iteration * 8 * 32, 0, 0};
  return mgr.save(cfg, tr.table(), tr.state(), be, p, tr.scaler(), {}).path;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST_CASE("doctor frozen: bf16-only norms at lr 1e-4 are frozen with the precision hint, with fp32 masters nothing is",
          "[doctor][frozen]") {
  auto be = make_cpu_backend();
  for (const std::string mode : {"bf16-unsafe-no-master", "bf16"}) {
    INFO(mode);
    test::TempDir dir("doctor-frozen");
    const RunConfig cfg = config_for(mode, 1e-4);
    Trainer tr(cfg, *be);
    tr.init_weights();
    train(tr, 1, 2);
    const std::string a = save(tr, cfg, *be, dir / "ck", 2);
    train(tr, 3, 4);
    const std::string b = save(tr, cfg, *be, dir / "ck", 6);
    const doctor::FrozenReport r = doctor::compare_frozen(Checkpoint::open(a), Checkpoint::open(b));
    INFO(r.text);
    std::vector<std::string> frozen;
    for (const auto& t : r.tensors)
      if (t.frozen) frozen.push_back(t.name);
    if (mode == "bf16") {
      CHECK(frozen.empty());
      CHECK(r.problems.empty());
      CHECK(r.text.find("no frozen tensors") != std::string::npos);
      // Least-moving first: most elements unchanged, then the smallest change for the tensor's size.
      for (size_t i = 1; i < r.tensors.size(); ++i) {
        const doctor::TensorMotion &x = r.tensors[i - 1], &y = r.tensors[i];
        INFO(x.name << " before " << y.name);
        CHECK(x.unchanged >= y.unchanged);
        if (x.unchanged == y.unchanged) CHECK(x.mean_change / x.typical <= y.mean_change / y.typical);
      }
      // A checkpoint against itself, or the later one first: nothing can have moved, so every
      // tensor would look frozen. Refused, not reported as a problem.
      for (const auto& [first, second] : {std::pair{a, a}, std::pair{b, a}})
        CHECK_THROWS_WITH(doctor::compare_frozen(Checkpoint::open(first), Checkpoint::open(second)),
                          Catch::Contains("B must be a later checkpoint than A") &&
                              Catch::Contains("give the earlier checkpoint first"));
      const auto cli = test::run_keel("doctor frozen " + a + " " + a);
      INFO(cli.output);
      CHECK(cli.code == 2);
      CHECK(cli.output.find("FROZEN") == std::string::npos);
      // Checkpoints of two runs: compared, with a note that it says nothing of either's training.
      RunConfig other = cfg;
      other.out = "/elsewhere/run";
      const std::string c = save(tr, other, *be, dir / "other", 8);
      const doctor::FrozenReport across = doctor::compare_frozen(Checkpoint::open(a), Checkpoint::open(c));
      CHECK_THAT(across.text, Catch::Contains("note: A and B were saved by different runs") &&
                                  Catch::Contains("/elsewhere/run"));
      continue;
    }
    // Every norm gain (init 1.0) and nothing else.
    std::vector<std::string> norms;
    for (const ParamSpec& p : tr.table().params())
      if (p.role == Role::Norm) norms.push_back(p.name);
    std::sort(norms.begin(), norms.end());
    std::sort(frozen.begin(), frozen.end());
    CHECK(frozen == norms);
    REQUIRE(r.frozen == static_cast<int>(norms.size()));
    for (int i = 0; i < r.frozen; ++i) {
      const doctor::TensorMotion& t = r.tensors[static_cast<size_t>(i)];  // frozen ones come first
      CHECK(t.frozen);
      CHECK(t.state == "weight");
      CHECK(t.dtype == "bf16");
      CHECK(t.unchanged == 1.0);
      CHECK(t.precision);
    }
    CHECK(r.text.find("FROZEN: " + std::to_string(norms.size()) + " of ") != std::string::npos);
    CHECK(r.text.find("(NO fp32 master copy)") != std::string::npos);
    CHECK(r.text.find("precision: values around 1 stored in bf16 with no fp32 master copy") != std::string::npos);
    CHECK(r.text.find("spacing there is 2^-7 = 0.0078") != std::string::npos);
    CHECK(r.text.find("precision.mode = \"bf16\"") != std::string::npos);
    CHECK(r.problems.size() == norms.size());
    // The checkpoint alone is no healthy one either: trained with no masters at all.
    const doctor::CkptReport audit = doctor::audit_checkpoint(Checkpoint::open(b));
    INFO(audit.text);
    CHECK_THAT(audit.text, Catch::Contains("no fp32 masters: bf16-unsafe-no-master") && Catch::Contains("PROBLEM"));
    REQUIRE(audit.problems.size() == 1);
    CHECK_THAT(audit.problems[0], Catch::Contains("trained without fp32 master weights") &&
                                      Catch::Contains("--init-from " + b + " --set precision.mode=bf16"));
  }
}

TEST_CASE("doctor ckpt: a healthy checkpoint passes, masters from a fresh init are named tensor by tensor",
          "[doctor][ckpt]") {
  auto be = make_cpu_backend();
  test::TempDir dir("doctor-ckpt");
  const RunConfig cfg = config_for("bf16", 1e-2);
  Trainer tr(cfg, *be);
  tr.init_weights();
  train(tr, 1, 3);

  const doctor::CkptReport healthy = doctor::audit_checkpoint(Checkpoint::open(save(tr, cfg, *be, dir / "ok", 3)));
  INFO(healthy.text);
  CHECK(healthy.problems.empty());
  CHECK(healthy.text.find("round(master) to bf16 equals the working weights everywhere") != std::string::npos);
  CHECK(healthy.text.find("Adam step 3 = iteration 3 - 0 skipped: consistent") != std::string::npos);
  CHECK(healthy.text.find("verdict: no problems found") != std::string::npos);

  SECTION("seed 000: masters replaced by a fresh init (another seed) while the weights stay trained") {
    ParamState fresh(tr.table(), *be, cfg.precision.mode);
    fresh.init(999);
    std::vector<char> host(fresh.master.bytes());
    be->copy_to_host(host.data(), fresh.master);
    be->copy_from_host(tr.state().master, host.data());
    const doctor::CkptReport r = doctor::audit_checkpoint(Checkpoint::open(save(tr, cfg, *be, dir / "stale", 3)));
    INFO(r.text);
    // Every tensor: the matrices differ by the init, the norms (init 1.0) by the 3 trained steps.
    CHECK(r.master_mismatch.size() == tr.table().params().size());
    CHECK(contains(r.master_mismatch, "layers.0.attn.wq"));
    CHECK(contains(r.master_mismatch, "final_norm.weight"));
    CHECK(r.text.find("PROBLEM: " + std::to_string(tr.table().params().size()) + " of ") != std::string::npos);
    CHECK(r.text.find("seed 000") != std::string::npos);
    bool named = false;
    for (const auto& p : r.problems)
      named = named || p.rfind("layers.0.attn.wq: master and working weights disagree in ", 0) == 0;
    CHECK(named);
  }
  SECTION("a resume that lost Adam's step, and moments that were never restored") {
    tr.state().adam_step = 1;
    const doctor::CkptReport lost = doctor::audit_checkpoint(Checkpoint::open(save(tr, cfg, *be, dir / "lost", 3)));
    INFO(lost.text);
    REQUIRE(!lost.problems.empty());
    CHECK(lost.problems[0].rfind("Adam step is 1 but the run applied 3 updates", 0) == 0);

    tr.state().adam_step = 3;
    be->fill(tr.state().m, 0.0f);
    be->fill(tr.state().v, 0.0f);
    const doctor::CkptReport zero = doctor::audit_checkpoint(Checkpoint::open(save(tr, cfg, *be, dir / "zero", 3)));
    INFO(zero.text);
    CHECK(zero.zero_moments.size() == tr.table().params().size());
    REQUIRE(zero.problems.size() == 1);
    CHECK(zero.problems[0].rfind("Adam moments are all zero in every tensor, yet Adam step is 3", 0) == 0);
  }
}

TEST_CASE("doctor ckpt: weight-decay groups by role flag a misfiled norm and an undecayed matrix",
          "[doctor][ckpt][decay]") {
  const RunConfig cfg = test::make_config(test::tiny_run_json("gpt2"));
  std::vector<ParamSpec> params = ParamTable(cfg.model).params();
  CHECK(doctor::decay_group_problems(params).empty());
  for (ParamSpec& p : params) {
    if (p.name == "layers.1.mlp_norm.weight") p.decay = true;  // seed 001: a norm in the decay group
    if (p.name == "layers.0.attn.bq") p.decay = true;
    if (p.name == "layers.0.mlp.w_fc") p.decay = false;
  }
  const auto problems = doctor::decay_group_problems(params);
  REQUIRE(problems.size() == 3);
  CHECK(problems[0].rfind("layers.0.attn.bq (bias, [32]) is in the weight-decay group: decay pulls a bias", 0) == 0);
  CHECK(problems[1].rfind("layers.0.mlp.w_fc (matrix, [128, 32]) has no weight decay", 0) == 0);
  CHECK(problems[2].rfind("layers.1.mlp_norm.weight (norm, [32]) is in the weight-decay group: decay pulls a norm gain",
                          0) == 0);
}

namespace {

// A metrics.jsonl of `steps` steps: a smooth falling loss with small noise; `sick` adds a loss
// and grad-norm spike at 120, fp16 overflows at 30, 31 and 90 (skipped, scale cut after them),
// and a resume at 150 whose first step jumps (a restart spike).
std::string write_metrics(const std::string& path, int steps, bool sick) {
  std::ofstream out(path);
  std::mt19937 rng(11);
  std::normal_distribution<double> noise(0.0, 0.01);
  double scale = 65536;
  int64_t nan_total = 0, skipped_total = 0;
  for (int s = 1; s <= steps; ++s) {
    if (sick && s == 151) out << nlohmann::json{{"event", "resume"}, {"step", 150}, {"checkpoint", "ck/step_00000150"}}.dump() << "\n";
    double loss = 2.0 + 4.0 * std::exp(-s / 50.0) + noise(rng);
    double norm = 1.0 + 0.05 * std::sin(s) + noise(rng);
    bool skipped = false;
    if (sick && (s == 30 || s == 31 || s == 90)) skipped = true, ++nan_total, ++skipped_total;
    if (sick && s == 120) loss = 9.0, norm = 40.0;
    if (sick && s == 151) loss += 1.5;
    nlohmann::json rec = {{"step", s}, {"loss", loss}, {"lr", 1e-4}, {"grad_norm", norm}, {"loss_scale", sick ? scale : 1.0},
                          {"skipped", skipped}, {"skipped_total", skipped_total}, {"nan_total", nan_total}};
    if (skipped) rec["grad_norm"] = "nan";
    out << rec.dump() << "\n";
    if (sick && (s == 31 || s == 90)) scale /= 2;  // the scaler's hysteresis: cut after the second overflow
    // A named validation set (data.val_sets) that falls, or in the sick run turns up after step 100.
    const double code = sick && s > 100 ? 1.0 + 0.01 * s : 1.5 + 2.0 * std::exp(-s / 50.0);
    if (s % 50 == 0)
      out << nlohmann::json{{"step", s}, {"val_loss", 2.1 + 4.0 * std::exp(-s / 50.0)}, {"val_losses", {{"code", code}}}}.dump()
          << "\n";
  }
  return path;
}

}  // namespace

TEST_CASE("doctor metrics: spikes, restart spikes, skipped and nan steps, loss-scale cuts, a healthy run is quiet",
          "[doctor][metrics]") {
  test::TempDir dir("doctor-metrics");
  const doctor::MetricsReport healthy = doctor::summarize_metrics(write_metrics(dir / "healthy.jsonl", 300, false));
  INFO(healthy.text);
  CHECK(healthy.steps == 300);
  CHECK(healthy.problems.empty());
  CHECK(healthy.loss_spikes.empty());
  CHECK(healthy.grad_norm_spikes.empty());
  CHECK(healthy.text.find("verdict: healthy") != std::string::npos);
  CHECK(healthy.text.find("validation: 6 evaluation(s)") != std::string::npos);
  CHECK(healthy.text.find("(falling)") != std::string::npos);
  CHECK(healthy.text.find("validation (code): 6 evaluation(s)") != std::string::npos);
  CHECK(healthy.text.find("rising") == std::string::npos);

  // An empty file, or one that is not metrics at all, is no healthy run: a check built on it fails.
  std::ofstream(dir / "empty.jsonl").close();
  std::ofstream(dir / "other.jsonl") << "not json\n{\"event\": \"memory\"}\n";
  for (const char* name : {"empty.jsonl", "other.jsonl"}) {
    const doctor::MetricsReport none = doctor::summarize_metrics(dir / name);
    INFO(none.text);
    CHECK(none.steps == 0);
    REQUIRE(none.problems.size() == 1);
    CHECK_THAT(none.problems[0], Catch::Contains(std::string(name) + " holds no step records"));
  }

  const doctor::MetricsReport sick = doctor::summarize_metrics(write_metrics(dir / "sick.jsonl", 300, true));
  INFO(sick.text);
  CHECK(sick.text.find("validation (code): 6 evaluation(s): 2.236 at step 50 -> 4 at step 300, best 1.771 at step 100 "
                       "(rising since step 100: +2.229, overfitting or diverging)") != std::string::npos);
  REQUIRE(sick.loss_spikes.size() == 2);
  CHECK(sick.loss_spikes[0].step == 120);
  CHECK(sick.loss_spikes[0].value == 9.0);
  CHECK(sick.loss_spikes[1].step == 151);
  REQUIRE(sick.grad_norm_spikes.size() == 1);
  CHECK(sick.grad_norm_spikes[0].step == 120);
  CHECK(sick.skipped_steps == std::vector<int64_t>{30, 31, 90});
  CHECK(sick.nan_steps == std::vector<int64_t>{30, 31, 90});
  REQUIRE(sick.scale_changes.size() == 2);
  CHECK(sick.scale_changes[0].step == 32);
  CHECK(sick.scale_changes[0].from == 65536);
  CHECK(sick.scale_changes[0].to == 32768);
  CHECK(sick.scale_changes[1].step == 91);
  CHECK(sick.min_scale == 16384);
  CHECK(sick.resumes == std::vector<int64_t>{150});
  CHECK(sick.text.find("skipped steps: 3 (30-31, 90)") != std::string::npos);
  CHECK(sick.text.find("loss scale: 65536 at step 1, 2 cut(s), 0 growth(s), min 16384 from step 91, final 16384") !=
        std::string::npos);
  CHECK(sick.text.find("    step 120: 9 (running mean ") != std::string::npos);
  CHECK(sick.text.find("at step 150 from ck/step_00000150: loss ") != std::string::npos);
  CHECK(sick.text.find("RESTART SPIKE") != std::string::npos);
  // Problems: the two loss spikes, the grad-norm spike, the restart spike. The fp16 skips are
  // the scaler calibrating (3 of 300 steps, scale far above 1): reported, not a problem.
  CHECK(sick.problems.size() == 4);
}

// The demo run (configs/llama-tiny.json, 600 steps) was called sick for 16 grad norms of 1.2-1.6x
// their running mean: late in a run the norm varies so little that its wander is many deviations.
// A spike must also clear the live check's ratios (3x for the grad norm, +10% for the loss).
// A nan validation loss is no target in the loss (an SFT set of prompts only: a note) or an
// overflow (a problem); val_loss_tokens beside it says which (was: every nan called "all masked").
TEST_CASE("doctor metrics: a nan validation loss with targets in the loss is an overflow, without them a note",
          "[doctor][metrics]") {
  test::TempDir dir("doctor-val-nan");
  const std::string path = dir / "metrics.jsonl";
  {
    std::ofstream f(path);
    for (int step = 1; step <= 4; ++step) f << nlohmann::json{{"step", step}, {"loss", 5.0 - 0.1 * step}}.dump() << "\n";
    f << nlohmann::json{{"step", 2}, {"val_loss", "nan"}, {"val_loss_tokens", 120},
                        {"val_losses", {{"sft", "nan"}}}, {"val_loss_tokens_by_set", {{"sft", 0}}}}.dump() << "\n";
    f << nlohmann::json{{"step", 4}, {"val_loss", "nan"}}.dump() << "\n";  // an older keel's record
  }
  const doctor::MetricsReport r = doctor::summarize_metrics(path);
  INFO(r.text);
  REQUIRE(r.problems.size() == 1);
  CHECK_THAT(r.problems[0], Catch::Contains("validation: 1 evaluation(s) gave a non-finite loss with targets in the "
                                            "loss: the forward overflowed"));
  CHECK_THAT(r.text, Catch::Contains("validation (sft): 1 evaluation(s) had no target in the loss (all masked)") &&
                         Catch::Contains("validation: 1 evaluation(s) reported as nan: no target in the loss (all "
                                         "masked), or a forward that overflowed"));
}

TEST_CASE("doctor metrics: the ordinary wander of a steady grad norm or loss is no spike, a jump past the ratio is",
          "[doctor][metrics]") {
  test::TempDir dir("doctor-wander");
  auto write = [&](const std::string& name, double norm_jump, double loss_jump) {
    std::ofstream out(dir / name);
    std::mt19937 rng(5);
    std::normal_distribution<double> noise(0.0, 0.003);
    for (int s = 1; s <= 200; ++s) {
      double loss = 4.2 + noise(rng), norm = 0.55 + noise(rng);
      if (s % 40 == 0) norm *= norm_jump, loss *= loss_jump;  // z far above 4 either way
      out << nlohmann::json{{"step", s}, {"loss", loss}, {"grad_norm", norm}, {"skipped", false}}.dump() << "\n";
    }
    return dir / name;
  };
  const doctor::MetricsReport wander = doctor::summarize_metrics(write("wander.jsonl", 1.4, 1.05));
  INFO(wander.text);
  CHECK(wander.grad_norm_spikes.empty());
  CHECK(wander.loss_spikes.empty());
  CHECK(wander.problems.empty());
  const doctor::MetricsReport jumps = doctor::summarize_metrics(write("jumps.jsonl", 3.5, 1.2));
  INFO(jumps.text);
  CHECK(jumps.grad_norm_spikes.size() == 5);
  CHECK(jumps.loss_spikes.size() == 5);
}

// A run that set its own health ratios is judged by them: doctor reads the config.json that
// keel train --out writes beside metrics.jsonl, and says whose ratios it used.
TEST_CASE("doctor metrics takes the spike ratios from the run's config.json beside the file or else the defaults",
          "[doctor][metrics]") {
  test::TempDir dir("doctor-ratios");
  // Grad-norm jumps of 3.5x and loss jumps of 20% every 40 steps: spikes under the defaults (3x, +10%).
  auto write = [&](const std::string& sub) {
    std::filesystem::create_directories(dir / sub);
    std::ofstream out(dir / (sub + "/metrics.jsonl"));
    std::mt19937 rng(5);
    std::normal_distribution<double> noise(0.0, 0.003);
    for (int s = 1; s <= 200; ++s) {
      double loss = 4.2 + noise(rng), norm = 0.55 + noise(rng);
      if (s % 40 == 0) norm *= 3.5, loss *= 1.2;
      out << nlohmann::json{{"step", s}, {"loss", loss}, {"grad_norm", norm}, {"skipped", false}}.dump() << "\n";
    }
    return dir / (sub + "/metrics.jsonl");
  };
  const doctor::MetricsReport plain = doctor::summarize_metrics(write("plain"));
  INFO(plain.text);
  CHECK(plain.grad_norm_spikes.size() == 5);
  CHECK(plain.loss_spikes.size() == 5);
  CHECK_THAT(plain.text, Catch::Contains("  spike ratios: health.spike_min_jump 0.1, health.spike_norm_ratio 3, from "
                                         "keel's defaults (no config.json beside the file)\n"));

  // The same records in a run directory whose run allowed 4x and +25%: no spikes.
  const std::string metrics = write("run");
  std::ofstream(dir / "run/config.json")
      << to_json(test::make_config(test::tiny_run_json(),
                                   {{"health", {{"spike_norm_ratio", 4.0}, {"spike_min_jump", 0.25}}}}))
             .dump(2);
  const doctor::MetricsReport own = doctor::summarize_metrics(metrics);
  INFO(own.text);
  CHECK(own.grad_norm_spikes.empty());
  CHECK(own.loss_spikes.empty());
  CHECK(own.problems.empty());
  CHECK_THAT(own.text, Catch::Contains("  spike ratios: health.spike_min_jump 0.25, health.spike_norm_ratio 4, from "
                                       "the run's " + dir / "run/config.json" + "\n"));

  // A config.json that is not a keel config: the defaults, and why.
  std::ofstream(dir / "run/config.json") << "{\"health\": {\"spike_norm_ratio\": 0.5}}";
  const doctor::MetricsReport broken = doctor::summarize_metrics(metrics);
  INFO(broken.text);
  CHECK(broken.grad_norm_spikes.size() == 5);
  CHECK_THAT(broken.text, Catch::Contains("health.spike_norm_ratio 3, from keel's defaults (" + dir / "run/config.json" +
                                          " could not be read: "));
}

TEST_CASE("keel doctor on the command line: exit 0 when healthy, 1 with problems, 2 for a path that is not there",
          "[doctor][cli]") {
  test::TempDir dir("doctor-cli");
  auto ok = test::run_keel("doctor metrics " + write_metrics(dir / "healthy.jsonl", 100, false));
  INFO(ok.output);
  CHECK(ok.code == 0);
  CHECK(ok.output.find("verdict: healthy") != std::string::npos);
  auto bad = test::run_keel("doctor metrics " + write_metrics(dir / "sick.jsonl", 200, true));
  INFO(bad.output);
  CHECK(bad.code == 1);
  CHECK(bad.output.find("loss spike at step 120") != std::string::npos);
  // A mistyped path is a bad argument, not a problem found in the run: a script testing for 1
  // must not take a typo for a sick run.
  auto missing = test::run_keel("doctor hang " + dir / "nothing-here");
  INFO(missing.output);
  CHECK(missing.code == 2);
  CHECK(missing.output.find(dir / "nothing-here") != std::string::npos);
  auto no_metrics = test::run_keel("doctor metrics " + dir / "healthy.jsonl" + " " + dir / "no-such.jsonl");
  INFO(no_metrics.output);
  CHECK(no_metrics.code == 2);
  CHECK(no_metrics.output.find(dir / "no-such.jsonl") != std::string::npos);
}

TEST_CASE("doctor metrics: a rank named slow at two or more timed steps is a straggler problem", "[doctor][metrics][timers]") {
  test::TempDir dir("doctor-timers");
  const std::string path = dir / "metrics.jsonl";
  {
    std::ofstream out(path);
    for (int s = 1; s <= 10; ++s)
      out << nlohmann::json{{"step", s}, {"loss", 5.0 - 0.1 * s}, {"grad_norm", 1.0}}.dump() << "\n";
    // Timed steps 2, 4, 6, 8: rank 3 slow at three of them, rank 5 once (a hiccup).
    for (int s : {2, 4, 6, 8}) {
      nlohmann::json rec = {{"event", "timers"}, {"step", s}, {"ranks", 8}};
      if (s != 2)
        rec["stragglers"].push_back({{"rank", 3}, {"host", "node0"}, {"compute_ms", s == 6 ? 200.0 : 150.0},
                                     {"stage_median_ms", 100.0}});
      if (s == 4) rec["stragglers"].push_back({{"rank", 5}, {"host", "node1"}, {"compute_ms", 130.0}, {"stage_median_ms", 100.0}});
      out << rec.dump() << "\n";
    }
  }
  const doctor::MetricsReport r = doctor::summarize_metrics(path);
  INFO(r.text);
  CHECK(r.timed_steps == 4);
  CHECK(r.stragglers == std::map<int, int64_t>{{3, 3}, {5, 1}});
  CHECK(r.text.find("  timers: 4 timed step(s), stragglers: 2") != std::string::npos);
  CHECK(r.text.find("    world rank 3 on host node0 was slow at 3 of 4 timed steps (steps 4 to 8), up to 2.00x a typical "
                    "rank of its pipeline stage") != std::string::npos);
  REQUIRE(r.problems.size() == 1);
  CHECK(r.problems[0].rfind("straggler: world rank 3 on host node0", 0) == 0);
  CHECK(r.pipeline_layers.empty());

  // The run's measured pipeline balance advice is repeated, and is no problem.
  std::ofstream(path, std::ios::app) << nlohmann::json{{"event", "pipeline_balance"},
                                                       {"step", 6},
                                                       {"stage_compute_ms", {80.25, 81.0, 79.5, 160.0}},
                                                       {"pipeline_layers_now", {2, 2, 2, 2}},
                                                       {"pipeline_layers", {2, 2, 3, 1}},
                                                       {"slowest_after_ms", 120.5}}
                                                .dump()
                                         << "\n";
  const doctor::MetricsReport b = doctor::summarize_metrics(path);
  INFO(b.text);
  CHECK(b.pipeline_layers == std::vector<int>{2, 2, 3, 1});
  CHECK(b.text.find("  pipeline balance at step 6: the stages computed [80.2, 81.0, 79.5, 160.0] ms a step with "
                    "parallel.pipeline_layers [2,2,2,2]; the run suggested [2,2,3,1] (slowest stage about 120.5 ms)") !=
        std::string::npos);
  CHECK(b.problems.size() == 1);
}

TEST_CASE("doctor metrics: after a resume or a rewind, the abandoned trajectory's records do not count",
          "[doctor][metrics][resume]") {
  test::TempDir dir("doctor-replay");
  auto step = [](int s, double loss, bool skipped = false) {
    return nlohmann::json{{"step", s}, {"loss", loss}, {"grad_norm", 1.0}, {"skipped", skipped}}.dump() + "\n";
  };
  auto val = [](int s, double loss) { return nlohmann::json{{"step", s}, {"val_loss", loss}}.dump() + "\n"; };

  // Ran to step 10 (validation at 4, 8 and 10), then resumed from step 4's checkpoint with
  // --steps 6: eval_at_start validated step 4 again, and the run ended at step 6.
  const std::string resumed = dir / "resumed.jsonl";
  {
    std::ofstream out(resumed);
    for (int s = 1; s <= 10; ++s) {
      out << step(s, 5.0 - 0.1 * s);
      if (s == 4 || s == 8 || s == 10) out << val(s, 5.0 - 0.1 * s);
    }
    out << nlohmann::json{{"event", "resume"}, {"step", 4}, {"checkpoint", "ck/step_00000004"}}.dump() << "\n";
    out << val(4, 4.6);
    for (int s = 5; s <= 6; ++s) out << step(s, 4.7 - 0.05 * s);
    out << val(6, 4.5);
  }
  const doctor::MetricsReport r = doctor::summarize_metrics(resumed);
  INFO(r.text);
  CHECK(r.steps == 6);
  CHECK(r.resumes == std::vector<int64_t>{4});
  CHECK(r.text.find("steps: 6 (1 - 6), 6 earlier record(s) superseded by a resume or rewind") != std::string::npos);
  CHECK(r.text.find("loss: 4.9 at step 1 -> 4.4 at step 6, min 4.4 at step 6") != std::string::npos);
  CHECK(r.text.find("validation: 2 evaluation(s): 4.6 at step 4 -> 4.5 at step 6, best 4.5 at step 6 (falling)") !=
        std::string::npos);

  // A loss spike at step 12 rewound the run to step 10's checkpoint; steps 11 and 12 were trained
  // again on the data after the spike's.
  const std::string rewound = dir / "rewound.jsonl";
  {
    std::ofstream out(rewound);
    for (int s = 1; s <= 11; ++s) out << step(s, 3.0);
    out << step(12, 9.0, true);
    out << nlohmann::json{{"event", "rewind"}, {"step", 12}, {"to", 10}, {"checkpoint", "ck/step_00000010"}}.dump() << "\n";
    for (int s = 11; s <= 14; ++s) out << step(s, 3.0);
  }
  const doctor::MetricsReport w = doctor::summarize_metrics(rewound);
  INFO(w.text);
  CHECK(w.steps == 14);
  CHECK(w.rewinds == std::vector<std::pair<int64_t, int64_t>>{{12, 10}});
  CHECK(w.resumes.empty());
  CHECK(w.skipped_steps.empty());
  CHECK(w.loss_spikes.empty());
  CHECK(w.text.find("rewinds: 1\n    at step 12 (loss 9) back to step 10 from ck/step_00000010: a spike") !=
        std::string::npos);
  CHECK(w.text.find("2 earlier record(s) superseded") != std::string::npos);

  // A new run from step 0 in the same directory (its checkpoints removed): the earlier run's
  // steps are not this run's.
  const std::string restarted = dir / "restarted.jsonl";
  {
    std::ofstream out(restarted);
    for (int s = 1; s <= 10; ++s) out << step(s, 9.0) << (s % 5 == 0 ? val(s, 9.0) : "");
    out << nlohmann::json{{"event", "start"}, {"step", 0}}.dump() << "\n";
    for (int s = 1; s <= 3; ++s) out << step(s, 3.0);
  }
  const doctor::MetricsReport n = doctor::summarize_metrics(restarted);
  INFO(n.text);
  CHECK(n.steps == 3);
  CHECK(n.text.find("steps: 3 (1 - 3)\n  10 step record(s) of earlier runs in this directory") != std::string::npos);
  CHECK(n.text.find("loss: 3 at step 1 -> 3 at step 3") != std::string::npos);
  CHECK(n.text.find("validation: none") != std::string::npos);
}

// Seed 002 end to end: the live check's frozen-parameter warnings go to metrics.jsonl too, so
// keel doctor metrics names them afterwards (it called such a run healthy: the warnings had
// scrolled by in the log and nothing of them was in the file).
TEST_CASE("doctor metrics names the parameters the live check found frozen", "[doctor][metrics][frozen][cli]") {
  test::Workspace ws(nlohmann::json{{"precision", {{"mode", "bf16-unsafe-no-master"}}},
                                    {"optimizer", {{"lr", 1e-4}, {"min_lr", 1e-5}}},
                                    {"train", {{"steps", 12}}},
                                    {"health", {{"frozen_check_interval", 2}, {"frozen_window", 3}}}});
  const std::string out = ws.dir / "run";
  auto r = test::run_keel("train --config " + ws.config + " --out " + out);
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE_THAT(r.output, Catch::Contains("WARNING frozen parameter: layers.0.attn_norm.weight"));
  int events = 0;
  for (const auto& rec : test::read_metrics(out + "/metrics.jsonl"))
    if (rec.value("event", "") == "frozen") ++events;
  CHECK(events >= 1);
  const doctor::MetricsReport m = doctor::summarize_metrics(out + "/metrics.jsonl");
  INFO(m.text);
  CHECK_THAT(m.text, Catch::Contains("frozen parameters (live check): ") && !Catch::Contains("verdict: healthy"));
  CHECK(std::any_of(m.problems.begin(), m.problems.end(), [](const std::string& p) {
    return p.find("frozen parameter at step ") != std::string::npos && p.find("layers.0.attn_norm.weight") != std::string::npos;
  }));
}
