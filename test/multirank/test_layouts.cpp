// 3D parallelism end to end: `mpirun -np N keel train` under every layout of 8 ranks (tp, pp,
// dp in {1, 2, 4, 8}, product 8) and some of 2 and 4, against the single-process run of the
// same config, for the tiny Llama (GQA) and the tiny GPT-2 (tied head, biases).
//
// Tolerances (fp32): the layouts compute the same math with different summation splits (TP
// partial sums, DP reductions, micro-batch grouping), so they differ by fp32 roundoff:
//   step 1: loss and grad norm within 1e-5 relative (forward/backward only);
//   later steps: loss within 1e-5, grad norm within 1e-4: AdamW's m / sqrt(v) divides by
//   tiny second moments for near-zero gradients and amplifies roundoff into the trajectory
//   (test/train/test_adamw_oracle.cpp measures the same effect for PyTorch itself).
// bf16: activations are rounded to 8 bits of mantissa after every op, so reordered sums move
// the loss by a few 2^-8 relative: within 2e-2 over a few steps.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <chrono>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "common/process.h"
#include "common/workspace.h"
#include "data/loss_mask.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {

struct Layout {
  int tp, pp, dp;
  int world() const { return tp * pp * dp; }
  // A run directory name: prefix + "tp pp dp" digits.
  std::string dir(const std::string& prefix) const {
    std::string d = prefix;
    for (int x : {tp, pp, dp}) d += std::to_string(x);
    return d;
  }
  std::string str() const { return "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " dp=" + std::to_string(dp); }
};

// Models divisible enough for tp 8, pp 8 and dp 8: 8 layers, 16 query / 8 kv heads (llama),
// vocab 64, ffn divisible by 8, global batch 16 = micro-batch 2 x 8.
nlohmann::json model_patch(const std::string& family) {
  nlohmann::json m = family == "llama"
                         ? nlohmann::json{{"family", "llama"}, {"vocab_size", 64},  {"d_model", 64},  {"n_layers", 8},
                                          {"n_heads", 16},     {"n_kv_heads", 8},   {"ffn_hidden", 128}, {"max_seq_len", 32}}
                         : nlohmann::json{{"family", "gpt2"}, {"vocab_size", 64},  {"d_model", 64},  {"n_layers", 8},
                                          {"n_heads", 8},     {"n_kv_heads", 8},   {"ffn_hidden", 256}, {"max_seq_len", 32}};
  return {{"model", m},
          {"train", {{"steps", 6}, {"global_batch", 16}, {"micro_batch", 2}, {"seq_len", 16}, {"eval_interval", 0},
                     {"eval_batches", 0}}},
          {"checkpoint", {{"save_at_end", false}}},
          {"health", {{"replica_check_interval", 1}}}};
}

struct Run {
  int code;
  std::string output;
  std::vector<nlohmann::json> records;
  nlohmann::json memory;  // rank 0's memory report after its first step
  nlohmann::json overlap;  // rank 0's DP reduction report (parallel.overlap_grad_reduce)
  nlohmann::json gather;   // rank 0's DP weight gather report (parallel.overlap_param_gather)
  std::vector<double> val;  // validation losses, in order
};

Run train(const test::Workspace& ws, const std::string& out, const Layout& l, const std::string& extra = "") {
  std::string cmd = "train --config " + ws.config + " --out " + out + " -q --set parallel.tp=" + std::to_string(l.tp) +
                    " --set parallel.pp=" + std::to_string(l.pp) + " --set parallel.dp=" + std::to_string(l.dp) + " " +
                    extra;
  const test::ProcessResult r = l.world() == 1 ? test::run_keel(cmd) : test::run_keel_mpi(l.world(), cmd);
  Run run{r.code, r.output, {}, {}, {}, {}, {}};
  if (fs::exists(out + "/metrics.jsonl"))
    for (const auto& rec : test::read_metrics(out + "/metrics.jsonl")) {
      if (rec.contains("loss")) run.records.push_back(rec);
      else if (rec.value("event", "") == "memory") run.memory = rec;
      else if (rec.value("event", "") == "grad_overlap") run.overlap = rec;
      else if (rec.value("event", "") == "param_gather") run.gather = rec;
      if (rec.contains("val_loss")) run.val.push_back(rec["val_loss"]);
    }
  return run;
}

// Rank 0 (tp 0, the first pipeline stage, dp 0) held what keel plan says that stage needs: its
// shards of the weights, gradients, masters and moments, and the activations of the micro-batches
// 1F1B keeps in flight there. Allocations round up to 64 bytes and the plan's small tensors do
// not: 2%. (Every rank warns on its own where it needs over 5% + 64 MiB more: no such line.)
void check_memory(const Run& run) {
  REQUIRE(run.memory.is_object());
  const double peak = run.memory["peak_bytes"], planned = run.memory["planned_bytes"];
  INFO("rank 0: peak " << peak << " B, planned " << planned << " B");
  CHECK(peak <= 1.02 * planned);
  CHECK(peak >= 0.98 * planned);
  CHECK(run.output.find("WARNING memory") == std::string::npos);
}

void compare(const Run& ref, const Run& got, double loss_tol, double norm_tol_first, double norm_tol_later) {
  REQUIRE(got.records.size() == ref.records.size());
  double worst_loss = 0, worst_norm = 0;
  for (size_t i = 0; i < ref.records.size(); ++i) {
    const double l0 = ref.records[i]["loss"], l1 = got.records[i]["loss"];
    const double g0 = ref.records[i]["grad_norm"], g1 = got.records[i]["grad_norm"];
    INFO("step " << i + 1 << ": loss " << l1 << " vs " << l0 << ", grad norm " << g1 << " vs " << g0);
    CHECK(std::abs(l1 - l0) <= loss_tol * l0);
    CHECK(std::abs(g1 - g0) <= (i == 0 ? norm_tol_first : norm_tol_later) * g0);
    worst_loss = std::max(worst_loss, std::abs(l1 - l0) / l0);
    worst_norm = std::max(worst_norm, std::abs(g1 - g0) / g0);
  }
  WARN("worst relative difference: loss " << worst_loss << ", grad norm " << worst_norm);
}

// The same arithmetic in another schedule: losses and grad norms equal, not close.
void check_same_bits(const Run& ref, const Run& got) {
  REQUIRE(got.records.size() == ref.records.size());
  for (size_t i = 0; i < ref.records.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(got.records[i]["loss"].get<double>() == ref.records[i]["loss"].get<double>());
    CHECK(got.records[i]["grad_norm"].get<double>() == ref.records[i]["grad_norm"].get<double>());
  }
}

// A run resumed under another layout (its metrics hold every step, from both parts) tracks the
// straight run's loss at every step within fp32's 1e-5.
void check_tracks(const Run& straight, const Run& resumed) {
  std::map<int64_t, double> got;
  for (const auto& rec : resumed.records) got[rec["step"].get<int64_t>()] = rec["loss"].get<double>();
  REQUIRE(got.size() == straight.records.size());
  for (const auto& rec : straight.records) {
    const int64_t step = rec["step"];
    INFO("step " << step);
    CHECK(std::abs(got[step] - rec["loss"].get<double>()) <= 1e-5 * rec["loss"].get<double>());
  }
}

// A DP overlap case: family, layout, more settings, parallel.grad_bucket_size.
struct OverlapCase {
  std::string family;
  Layout l;
  std::string extra;
  int64_t bucket;
};

const std::vector<Layout> kLayouts8 = {{8, 1, 1}, {1, 8, 1}, {1, 1, 8}, {4, 2, 1}, {4, 1, 2},
                                       {2, 4, 1}, {1, 4, 2}, {2, 1, 4}, {1, 2, 4}, {2, 2, 2}};
const std::vector<Layout> kLayouts24 = {{2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 1}, {1, 2, 2}, {4, 1, 1}, {1, 4, 1}};

void check_family(const std::string& family, const std::vector<Layout>& layouts) {
  test::Workspace ws(model_patch(family));
  const Run ref = train(ws, ws.dir / "single", {1, 1, 1});
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  REQUIRE(ref.records.size() == 6);
  check_memory(ref);
  for (const Layout& l : layouts) {
    INFO(family << " " << l.str());
    const Run got = train(ws, ws.dir / l.dir("l"), l);
    INFO(got.output);
    REQUIRE(got.code == 0);
    compare(ref, got, 1e-5, 1e-5, 1e-4);
    check_memory(got);
  }
}

}  // namespace

TEST_CASE("every layout of 8 ranks trains the tiny Llama like one process (fp32)", "[mpi][layouts]") {
  check_family("llama", kLayouts8);
}

TEST_CASE("every layout of 8 ranks trains the tiny GPT-2 like one process (fp32)", "[mpi][layouts]") {
  check_family("gpt2", kLayouts8);
}

TEST_CASE("layouts of 2 and 4 ranks track the single-process run (fp32, both families)", "[mpi][layouts]") {
  check_family("llama", kLayouts24);
  check_family("gpt2", kLayouts24);
}

TEST_CASE("bf16 under 3D parallelism stays within bf16 rounding of the single-process run", "[mpi][layouts]") {
  nlohmann::json patch = model_patch("llama");
  patch["precision"] = {{"mode", "bf16"}};
  patch["optimizer"] = {{"lr", 3e-3}, {"min_lr", 3e-4}};  // a smooth stretch of training, not an unstable one
  test::Workspace ws(patch);
  const Run ref = train(ws, ws.dir / "single", {1, 1, 1});
  REQUIRE(ref.code == 0);
  for (const Layout& l : std::vector<Layout>{{2, 2, 2}, {8, 1, 1}, {1, 4, 2}}) {
    INFO(l.str());
    const Run got = train(ws, ws.dir / l.dir("b"), l);
    INFO(got.output);
    REQUIRE(got.code == 0);
    // Step 1 within bf16's half spacing (2^-8 relative); after that the rounding differences
    // compound through the updates: the loss within 2%, the grad norm within 5%.
    compare(ref, got, 2e-2, 3.9e-3, 5e-2);
    check_memory(got);
  }
}

TEST_CASE("activation recomputation under tp=2 pp=2 dp=2 trains bit-identically to the same run without it",
          "[mpi][layouts][recompute]") {
  // Recomputed layers rerun their forward (with its TP all-reduce) in backward from the kept
  // input; the CPU backend and MPI reductions are deterministic, so the losses and gradient
  // norms must be equal, not close. bf16, both families; all layers, 1 of each stage's 4, and
  // selective recomputation (every layer rebuilds its norm outputs and MLP activation).
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    nlohmann::json patch = model_patch(family);
    patch["precision"] = {{"mode", "bf16"}};
    test::Workspace ws(patch);
    const Layout l{2, 2, 2};
    const Run ref = train(ws, ws.dir / "plain", l);
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    REQUIRE(ref.records.size() == 6);
    struct Policy {
      std::string extra, shown, dir;
    };
    const std::vector<Policy> policies = {
        {"--set train.recompute=full", "this run: full recompute", "rc_all"},
        {"--set train.recompute=full --set train.recompute_layers=1", "this run: recompute of 1 layer per stage",
         "rc_first"},
        {"--set train.recompute=selective", "this run: selective recompute", "rc_selective"}};
    CHECK_THAT(ref.output, Catch::Contains("this run: no recompute"));
    for (const Policy& p : policies) {
      INFO(p.extra);
      const Run got = train(ws, ws.dir / p.dir, l, p.extra);
      INFO(got.output);
      REQUIRE(got.code == 0);
      CHECK_THAT(got.output, Catch::Contains(p.shown));  // the start-up memory table names the policy
      check_same_bits(ref, got);
      check_memory(got);
    }
    // Under sequence parallelism a rebuilt norm output is this rank's rows, gathered again for
    // its weight gradient. With an interleaved pipeline a rank's model chunks share one pair of
    // rebuild buffers (test_model "[recompute]" checks the sharing byte for byte).
    for (const std::string more : {"--set parallel.sequence_parallel=true", "--set parallel.virtual_stages=2"}) {
      INFO(more);
      const std::string dir = more.find("sequence") != std::string::npos ? "sp" : "interleaved";
      const Run plain = train(ws, ws.dir / dir, l, more);
      const Run selective = train(ws, ws.dir / (dir + "_selective"), l, more + " --set train.recompute=selective");
      INFO(plain.output << selective.output);
      REQUIRE(plain.code == 0);
      REQUIRE(selective.code == 0);
      check_same_bits(plain, selective);
      check_memory(selective);
    }
  }
}

TEST_CASE("DP gradient reduction overlapped with the backward trains bit-identically to one reduce_scatter after it",
          "[mpi][layouts][overlap]") {
  // The buckets reduce each element on its owning rank, in rank order, with reduce_scatter's
  // arithmetic (train/parallel/grad_buckets.h), so losses and grad norms must be equal, not
  // close. The cases cover what completes a group before it is reduced: TP partial sums of the
  // norms under SP and of Qwen3's q/k norms, a chunked head (its gradient written in forward),
  // the interleaved pipeline (a chunk's last backward mid-schedule), and the tied embedding's
  // copies (deferred to after the pipeline); buckets of one group, of a few, and the default
  // (40M: nothing fills, all of it at the end).
  const std::vector<OverlapCase> cases = {
      {"llama", {2, 2, 2}, "--set precision.mode=bf16 --set parallel.sequence_parallel=true", 1},
      {"llama", {2, 1, 2}, "--set model.qk_norm=true --set model.head_dim=8 --set train.logits_chunk_rows=5", 20000},
      {"llama", {1, 1, 4}, "--set train.recompute=full", 0},
      {"gpt2", {1, 2, 2}, "--set parallel.virtual_stages=2", 5000},
      {"gpt2", {2, 2, 2}, "--set precision.mode=bf16", 1}};
  for (const OverlapCase& c : cases) {
    INFO(c.family << " " << c.l.str() << " " << c.extra << ", bucket " << c.bucket);
    test::Workspace ws(model_patch(c.family));
    const Run ref = train(ws, ws.dir / "ref", c.l, c.extra);
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    REQUIRE(ref.records.size() == 6);
    CHECK(ref.overlap.is_null());  // off by default
    const Run got = train(ws, ws.dir / "overlap", c.l,
                          c.extra + " --set parallel.overlap_grad_reduce=true --set parallel.grad_bucket_size=" +
                              std::to_string(c.bucket));
    INFO(got.output);
    REQUIRE(got.code == 0);
    check_same_bits(ref, got);
    // Rank 0 (tp 0, stage 0, dp 0) did reduce during its backward, unless no bucket could fill.
    REQUIRE(got.overlap.is_object());
    const int64_t early = got.overlap["early_elements"], all = got.overlap["elements"];
    CHECK(got.overlap["bucket"].get<int64_t>() == (c.bucket > 0 ? c.bucket : 40'000'000));
    if (c.bucket == 0) {
      CHECK(early == 0);
    } else {
      CHECK(early > 0);
      CHECK(early <= all);
      CHECK(got.overlap["reductions"].get<int64_t>() >= 2);
    }
    if (c.family == "gpt2" && c.l.pp > 1) CHECK(early < all);  // the tied tok_embed waits for its copy's gradient
  }
}

TEST_CASE("DP weight gather overlapped with the next forward trains bit-identically to one all_gather",
          "[mpi][layouts][overlap]") {
  // The buckets broadcast each part of the weights from the rank that updated it
  // (train/parallel/param_gather.h): bytes moved, not computed, so losses, grad norms,
  // validation losses and the final checkpoint (weights, masters, moments) must be equal. A read
  // of a weight before its bucket arrived would use the last step's value and show. Between
  // steps the run validates, checks the replicas and saves a checkpoint at some steps (each
  // settles the gather first) and not at others (the gather waits for the next forward); a
  // resume from the mid-run checkpoint continues bit for bit. The
  // cases: every group its own bucket with both overlaps (3D, SP, bf16); the interleaved
  // pipeline with the tied copy; a chunked head with Qwen3 q/k norms; the default bucket (one
  // bucket: nothing moves ahead).
  const std::string between = " --set train.eval_interval=2 --set train.eval_batches=1 --set checkpoint.interval=3"
                              " --set health.replica_check_interval=4 --set checkpoint.save_at_end=true";
  const std::vector<OverlapCase> cases = {
      {"llama", {2, 2, 2},
       "--set precision.mode=bf16 --set parallel.sequence_parallel=true --set parallel.overlap_grad_reduce=true", 1},
      {"gpt2", {1, 2, 2}, "--set parallel.virtual_stages=2", 5000},
      {"llama", {2, 1, 2}, "--set model.qk_norm=true --set model.head_dim=8 --set train.logits_chunk_rows=5", 20000},
      {"llama", {1, 1, 4}, "--set train.recompute=full", 0}};
  for (const OverlapCase& c : cases) {
    INFO(c.family << " " << c.l.str() << " " << c.extra << ", bucket " << c.bucket);
    test::Workspace ws(model_patch(c.family));
    const std::string extra = c.extra + between + " --set parallel.grad_bucket_size=" + std::to_string(c.bucket);
    const Run ref = train(ws, ws.dir / "ref", c.l, extra);
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    REQUIRE(ref.records.size() == 6);
    CHECK(ref.gather.is_null());  // off by default
    const Run got = train(ws, ws.dir / "gather", c.l, extra + " --set parallel.overlap_param_gather=true");
    INFO(got.output);
    REQUIRE(got.code == 0);
    check_same_bits(ref, got);
    REQUIRE(ref.val.size() == 3);  // steps 2, 4, 6
    CHECK(got.val == ref.val);
    const test::ProcessResult diff = test::run_keel("ckpt diff " + (ws.dir / "ref/checkpoints/step_00000006") +
                                                    " " + (ws.dir / "gather/checkpoints/step_00000006"));
    INFO(diff.output);
    CHECK(diff.code == 0);
    // Resumed from its step-3 checkpoint (saved with the gather settled), steps 4 to 6 again.
    const Run resumed = train(ws, ws.dir / "resumed", c.l,
                              extra + " --set parallel.overlap_param_gather=true --resume " +
                                  (ws.dir / "gather/checkpoints/step_00000003"));
    INFO(resumed.output);
    REQUIRE(resumed.code == 0);
    REQUIRE(resumed.records.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      INFO("resumed step " << i + 4);
      CHECK(resumed.records[i]["loss"].get<double>() == ref.records[i + 3]["loss"].get<double>());
      CHECK(resumed.records[i]["grad_norm"].get<double>() == ref.records[i + 3]["grad_norm"].get<double>());
    }
    // Rank 0's report after step 2: buckets moved ahead of their need, unless there was one.
    REQUIRE(got.gather.is_object());
    CHECK(got.gather["step"].get<int64_t>() == 2);
    CHECK(got.gather["bucket"].get<int64_t>() == (c.bucket > 0 ? c.bucket : 40'000'000));
    const int64_t ahead = got.gather["overlapped_elements"], all = got.gather["elements"];
    if (c.bucket == 0) {
      CHECK(got.gather["buckets"].get<int64_t>() == 1);
      CHECK(ahead == 0);
    } else {
      CHECK(got.gather["buckets"].get<int64_t>() >= 2);
      CHECK(ahead > 0);
      CHECK(ahead < all);  // the first bucket is waited for at once
    }
    CHECK(got.gather["broadcasts"].get<int64_t>() >= got.gather["buckets"].get<int64_t>());
  }
}

TEST_CASE("sequence parallelism trains like tensor parallelism without it (bf16, both families)",
          "[mpi][layouts][sequence]") {
  // SP moves the same partial sums with reduce-scatter / all-gather instead of all-reduce, and
  // computes each row's norm on the rank that holds it: the forward is the same arithmetic, so
  // the losses must be equal. Only the norm weights' gradients are summed in another order
  // (per rank, then over TP), which moves the grad norm by fp32 roundoff (bound: 1e-9 relative)
  // and through the updates may move the loss, within 1e-6.
  for (const std::string family : {"llama", "gpt2"}) {
    nlohmann::json patch = model_patch(family);
    patch["precision"] = {{"mode", "bf16"}};
    test::Workspace ws(patch);
    for (const Layout& l : std::vector<Layout>{{2, 2, 2}, {8, 1, 1}, {4, 2, 1}}) {
      INFO(family << " " << l.str());
      const Run ref = train(ws, ws.dir / l.dir("tp"), l);
      INFO(ref.output);
      REQUIRE(ref.code == 0);
      const Run sp = train(ws, ws.dir / l.dir("sp"), l, "--set parallel.sequence_parallel=true");
      INFO(sp.output);
      REQUIRE(sp.code == 0);
      CHECK_THAT(sp.output, Catch::Contains("replica check"));  // the norms stayed identical over TP
      REQUIRE(sp.records.size() == ref.records.size());
      CHECK(sp.records[0]["loss"].get<double>() == ref.records[0]["loss"].get<double>());
      compare(ref, sp, 1e-6, 1e-9, 1e-6);
    }
  }
}

TEST_CASE("a chunked head trains like the whole head under TP, SP and PP (fp32, both families)",
          "[mpi][layouts][chunked_head]") {
  // Chunks of 5 of the 32 rows of a micro-batch (a remainder of 2), the loss statistics
  // combined over TP per chunk, and the head's backward run inside forward. Every row's loss
  // is the same arithmetic, so step 1's loss must be equal; the head weight's gradient is
  // summed per chunk (fp32 re-association, ~1e-7 relative on one process, see
  // test/model/test_memory_savers.cpp), which moves the grad norm by less than 1e-6, and
  // later steps' losses by less than 1e-6 and grad norms by less than 1e-5 (measured: 6e-8 and
  // 3e-7; AdamW amplifies roundoff in near-zero gradients, see the top). fp32, not bf16: in bf16 a 1e-7 change of an
  // fp32 master flips the rounding of its bf16 copy now and then, a 2^-8 step that makes any
  // bound loose enough to miss a real error.
  for (const std::string family : {"llama", "gpt2"}) {
    test::Workspace ws(model_patch(family));
    for (const auto& [l, extra] : std::vector<std::pair<Layout, std::string>>{
             {{2, 2, 2}, ""}, {{4, 2, 1}, "--set parallel.sequence_parallel=true"}}) {
      INFO(family << " " << l.str() << " " << extra);
      const Run ref = train(ws, ws.dir / l.dir("whole"), l, extra);
      INFO(ref.output);
      REQUIRE(ref.code == 0);
      const Run got = train(ws, ws.dir / l.dir("chunked"), l, extra + " --set train.logits_chunk_rows=5");
      INFO(got.output);
      REQUIRE(got.code == 0);
      REQUIRE(got.records.size() == ref.records.size());
      CHECK(got.records[0]["loss"].get<double>() == ref.records[0]["loss"].get<double>());
      compare(ref, got, 1e-6, 1e-6, 1e-5);
    }
  }
}

namespace {

// An option that changes the computation (`option`: --set flags), for one family: the
// single-process run with it differs from the one without by the last step (the option is on;
// zero-initialised biases change nothing before the first update), and each layout
// with it tracks the single process with it (fp32 bounds of check_family).
void check_option_layouts(const std::string& family, const std::string& option,
                          const std::vector<std::pair<Layout, std::string>>& layouts) {
  test::Workspace ws(model_patch(family));
  const Run ref = train(ws, ws.dir / "single", {1, 1, 1}, option);
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  REQUIRE(ref.records.size() == 6);
  const Run plain = train(ws, ws.dir / "plain", {1, 1, 1});
  REQUIRE(plain.code == 0);
  CHECK(plain.records.back()["loss"].get<double>() != ref.records.back()["loss"].get<double>());
  for (const auto& [l, extra] : layouts) {
    INFO(family << " " << l.str() << " " << option << " " << extra);
    const Run got = train(ws, ws.dir / l.dir("opt"), l, option + " " + extra);
    INFO(got.output);
    REQUIRE(got.code == 0);
    compare(ref, got, 1e-5, 1e-5, 1e-4);
  }
}

const std::string kSequenceParallel = "--set parallel.sequence_parallel=true";

}  // namespace

TEST_CASE("document masking trains alike under TP, SP, PP and DP (fp32, both families)", "[mpi][layouts][documents]") {
  // Every rank derives the micro-batches' document positions from the same tokens, and the
  // stages without the embedding need them too (attention). Token 5 ends a document: one token
  // in 32 of the synthetic stream, so about 40% of the sequences of 16 hold two documents.
  for (const std::string family : {"llama", "gpt2"})
    check_option_layouts(family, "--set data.document_masking=true --set data.eod_token=5",
                         {{{2, 2, 2}, ""}, {{4, 2, 1}, kSequenceParallel}, {{1, 4, 2}, ""}});
}

// A batch-size ramp-up (the BLOOM configs' schedule.rampup_batch_size) changes the micro-batch
// count from step to step: 1F1B and interleaved schedules of each count (2, 4, 6 and 8 at pp=4
// with 2 chunks: fewer than the stages, as many, a count they do not divide, a multiple; 1 to 4
// at pp=2 dp=2), the slots sized for the largest, and the loss averaged over each step's batch.
// At the tiny models' lr of 1e-2, batches of 4 make the steps chaotic: TP's other fp32 summation
// order (1e-7) grew tenfold a step, to 7e-4 in step 5's grad norm (measured); at 3e-3 it stays
// within 2e-6, so the usual fp32 bounds still tell a wrong batch or scale from rounding.
TEST_CASE("a batch-size ramp-up trains alike under TP, PP (also interleaved) and DP (fp32, both families)",
          "[mpi][layouts][rampup]") {
  const std::string ramp = "--set 'schedule.rampup_batch_size=[4,4,32]' --set optimizer.lr=3e-3 --set optimizer.min_lr=3e-4";
  for (const std::string family : {"llama", "gpt2"}) {
    check_option_layouts(family, ramp,
                         {{{1, 2, 2}, ""},
                          {{1, 4, 1}, "--set parallel.virtual_stages=2"},
                          {{2, 2, 2}, "--set parallel.virtual_stages=2"}});
  }
  // The ramp-up ran: 4, 8 and 12 samples before the whole 16. At 12 samples (6 micro-batches in
  // one group) rank 0's second chunk would keep 6 in flight, against 4 at 16 (two groups of 4):
  // the step runs the capped order (pipeline_step_schedule) within the whole batch's slots, and
  // rank 0 holds what keel plan counts.
  test::Workspace ws(model_patch("llama"));
  const Run run = train(ws, ws.dir / "ramp", {1, 4, 1}, ramp + " --set parallel.virtual_stages=2");
  INFO(run.output);
  REQUIRE(run.code == 0);
  check_memory(run);
  std::vector<int64_t> batches;
  for (const auto& rec : run.records) batches.push_back(rec["global_batch"]);
  CHECK(batches == std::vector<int64_t>{4, 4, 4, 8, 8, 12});
}

// Loss masks (SFT data): each DP rank's micro-batches hold another count of in-loss targets, and
// the step's loss is the mean over the global batch's, so a rank that divided by its own count,
// or a stage that saw other targets than the head's, would show here. The sidecar masks runs of
// 1 to 40 tokens, about half of them (some micro-batches have no target in the loss at all).
TEST_CASE("loss-masked data trains alike under DP, TP, SP and PP (fp32)", "[mpi][layouts][mask]") {
  test::Workspace ws(model_patch("llama"));
  const std::vector<uint32_t> tokens = test::synthetic_tokens(20000, 1);
  data::write_llmc_shard(ws.dir / "sft.bin", tokens, false);
  std::vector<uint8_t> mask;
  std::mt19937 rng(3);
  for (uint8_t in_loss = 1; mask.size() < tokens.size(); in_loss ^= 1)
    mask.insert(mask.end(), 1 + rng() % 40, in_loss);
  mask.resize(tokens.size());
  data::write_loss_mask(ws.dir / "sft.mask", mask);
  const std::string sft = "--set data.train=" + ws.dir / "sft.bin";
  const Run ref = train(ws, ws.dir / "single", {1, 1, 1}, sft);
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  REQUIRE(ref.records.size() == 6);
  // The masks were read: fewer targets than the 16 x 16 of a batch, and another loss than without.
  for (const auto& rec : ref.records) CHECK(rec["loss_tokens"].get<int64_t>() < 16 * 16);
  const Run plain = train(ws, ws.dir / "plain", {1, 1, 1});
  REQUIRE(plain.code == 0);
  CHECK(plain.records[0]["loss"].get<double>() != ref.records[0]["loss"].get<double>());
  for (const auto& [l, extra] : std::vector<std::pair<Layout, std::string>>{
           {{1, 1, 2}, ""}, {{2, 2, 2}, ""}, {{4, 2, 1}, kSequenceParallel}, {{1, 2, 4}, ""}}) {
    INFO(l.str() << " " << extra);
    const Run got = train(ws, ws.dir / l.dir("mask"), l, sft + " " + extra);
    INFO(got.output);
    REQUIRE(got.code == 0);
    REQUIRE(got.records.size() == ref.records.size());
    for (size_t i = 0; i < ref.records.size(); ++i)
      CHECK(got.records[i]["loss_tokens"] == ref.records[i]["loss_tokens"]);
    compare(ref, got, 1e-5, 1e-5, 1e-4);
  }
}

TEST_CASE("ALiBi and the embedding norm (BLOOM's options) train alike under TP, SP, PP and DP (fp32)",
          "[mpi][layouts][alibi]") {
  // TP ranks hold slices of the heads, so each must take its heads' slopes; the embedding norm
  // lives on the first stage, and under SP its gradient is a partial sum over TP like the other
  // norms'. gpt2 + both options is BLOOM's block; llama takes them too (RMSNorm, GQA).
  const std::string bloom = "--set model.position_embedding=alibi --set model.embedding_norm=true";
  check_option_layouts("gpt2", bloom, {{{4, 2, 1}, kSequenceParallel}, {{2, 2, 2}, ""}, {{1, 4, 2}, ""}});
  check_option_layouts("llama", bloom, {{{4, 2, 1}, kSequenceParallel}});
}

TEST_CASE("Qwen2's q/k/v biases and Qwen3's q/k norms with head_dim train alike under TP, SP, PP and DP (fp32)",
          "[mpi][layouts][qwen]") {
  // The biases are split over TP with their projections' rows (each rank its heads' part). The
  // q/k norm weights are shared by the heads, which TP splits: each rank's gradient is a partial
  // sum over its heads, all-reduced over TP after the micro-batches.
  check_option_layouts("llama", "--set model.qkv_bias=true",
                       {{{4, 2, 1}, kSequenceParallel}, {{2, 2, 2}, ""}, {{8, 1, 1}, ""}});
  check_option_layouts("llama", "--set model.qk_norm=true --set model.head_dim=8",
                       {{{4, 2, 1}, kSequenceParallel}, {{2, 2, 2}, ""}, {{8, 1, 1}, ""}});
}

TEST_CASE("a sliding window with document masking trains alike under TP, SP, PP and DP (fp32)",
          "[mpi][layouts][window]") {
  // Each row's first key is the later of its document's start and the window's: per row, so TP
  // (heads), SP (rows gathered before attention), PP and DP see the single process's attention.
  check_option_layouts("llama",
                       "--set model.sliding_window=3 --set data.document_masking=true --set data.eod_token=5",
                       {{{4, 2, 1}, kSequenceParallel}, {{2, 2, 2}, ""}});
  // gpt2 at lr 3e-3: at the tiny config's 1e-2 a window of 3 makes steps 4-6 unstable (loss up,
  // grad norm up), and any layout's fp32 rounding grows tenfold per step there (1.7e-4 at step 6
  // for tp=2 alone); at 3e-3 layouts agree to ~4e-7, as without the window.
  check_option_layouts("gpt2", "--set model.sliding_window=3 --set optimizer.lr=0.003",
                       {{{2, 2, 2}, kSequenceParallel}, {{2, 1, 4}, ""}});
}

TEST_CASE("HF GPT-2, BLOOM and Qwen2 weights (--init-from hf:DIR) train alike under TP, SP, PP and DP (fp32)",
          "[mpi][layouts][hf]") {
  // Each rank reads its own rectangles straight from the HF file: slices of GPT-2's transposed
  // Conv1D weights and fused c_attn, of BLOOM's per-head query_key_value (6 heads, so tp=3
  // too), and of Qwen2's q/k/v biases. A wrong slice shows in the step-1 loss.
  struct Case {
    const char* name;
    std::vector<std::pair<Layout, std::string>> layouts;
  };
  for (const Case& c : {Case{"gpt2_tied", {{{4, 2, 1}, kSequenceParallel}, {{2, 2, 2}, ""}}},
                        Case{"bloom_bf16", {{{2, 2, 2}, kSequenceParallel}, {{3, 2, 1}, ""}}},
                        Case{"qwen2_bf16", {{{2, 2, 2}, kSequenceParallel}}}}) {
    const std::string hf = std::string(KEEL_FIXTURE_DIR) + "/hf/" + c.name;
    const test::ProcessResult printed = test::run_keel("convert --print-config hf:" + hf);
    REQUIRE(printed.code == 0);
    const nlohmann::json model = nlohmann::json::parse(printed.output).at("model");
    nlohmann::json patch = model_patch(model.at("family"));
    patch["model"] = model;
    if (!model.contains("n_kv_heads")) patch["model"]["n_kv_heads"] = model["n_heads"];  // merged over the tiny config's
    test::Workspace ws(patch);
    const std::string init = "--init-from hf:" + hf;
    const Run ref = train(ws, ws.dir / "single", {1, 1, 1}, init);
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    REQUIRE(ref.records.size() == 6);
    const Run fresh = train(ws, ws.dir / "fresh", {1, 1, 1});  // the same model from a random init
    REQUIRE(fresh.code == 0);
    CHECK(fresh.records[0]["loss"].get<double>() != ref.records[0]["loss"].get<double>());
    for (const auto& [l, extra] : c.layouts) {
      INFO(c.name << " " << l.str() << " " << extra);
      const Run got = train(ws, ws.dir / l.dir("hf"), l, init + " " + extra);
      INFO(got.output);
      REQUIRE(got.code == 0);
      compare(ref, got, 1e-5, 1e-5, 1e-4);
    }
  }
}

TEST_CASE("multiple-choice scores during training agree under TP, SP, PP (also interleaved) and DP (fp32)",
          "[mpi][layouts][choice_train]") {
  // Each ending is a row of the training forward: the last stage sums its token losses, PP
  // shares them, and DP ranks score different micro-batches. Every ending's log-likelihood
  // must match the single process: before training (the same weights: 1e-5 relative, the
  // fp32 bound of a forward) and after the 6 steps (1e-4, the bound on later steps' trajectory).
  for (const std::string family : {"llama", "gpt2"}) {
    test::Workspace ws(model_patch(family));
    test::write_stream_choice_items(ws.dir / "choices.jsonl", 21);  // 84 rows: a partial last micro-batch
    const std::string choices = "--set choice_eval.file=" + (ws.dir / "choices.jsonl") +
                                " --set train.eval_at_start=true --set choice_eval.write_scores=true";
    auto scores = [](const std::string& out, int step) {
      std::vector<double> lp;
      std::ifstream in(out + "/choice_scores/step_" + std::to_string(step) + ".jsonl");
      std::string line;
      while (std::getline(in, line)) {
        const nlohmann::json rec = nlohmann::json::parse(line);
        for (const auto& x : rec.at("logprob")) lp.push_back(x.get<double>());
      }
      return lp;
    };
    const std::string single = ws.dir / "single";
    const Run ref = train(ws, single, {1, 1, 1}, choices);
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    REQUIRE(scores(single, 0).size() == 84);
    const std::vector<std::pair<Layout, std::string>> layouts =
        family == "llama" ? std::vector<std::pair<Layout, std::string>>{{{2, 2, 2}, kSequenceParallel},
                                                                         {{1, 2, 2}, "--set parallel.virtual_stages=2"},
                                                                         {{4, 1, 2}, ""}}
                          : std::vector<std::pair<Layout, std::string>>{{{2, 2, 2}, ""}, {{1, 4, 2}, ""}};
    for (const auto& [l, extra] : layouts) {
      INFO(family << " " << l.str() << " " << extra);
      const std::string out = ws.dir / l.dir("choice");
      const Run got = train(ws, out, l, choices + " " + extra);
      INFO(got.output);
      REQUIRE(got.code == 0);
      for (const auto& [step, tol] : {std::pair<int, double>{0, 1e-5}, {6, 1e-4}}) {
        const std::vector<double> a = scores(single, step), b = scores(out, step);
        REQUIRE(b.size() == a.size());
        double worst = 0;
        for (size_t k = 0; k < a.size(); ++k) {
          const double rel = std::abs(b[k] - a[k]) / std::abs(a[k]);
          worst = std::max(worst, rel);
          CHECK(rel <= tol);
        }
        WARN(family << " " << l.str() << " " << extra << " step " << step << ": worst relative difference " << worst);
      }
    }
  }
}

TEST_CASE("the interleaved pipeline (virtual stages) trains like plain 1F1B, and its checkpoints resume under 1F1B",
          "[mpi][layouts][interleaved]") {
  // The same layers, the same micro-batch order per layer and the same reductions: the losses
  // are the plain schedule's bit for bit. Only the grad norm's fp32 partial sums run over the
  // flat buffer in another tensor order (a rank holds layers 0, 2 instead of 0, 1), so it may
  // differ in its last bits, and through the clip coefficient so may later steps (the usual
  // 1e-5 / 1e-4 bounds). 8 layers: pp=2 x 4 chunks puts one layer in each virtual stage.
  // Micro-batch counts that pp does not divide take groups of pp or more (micro_batch_groups: 5
  // at pp=2 in groups of 3 and 2, 9 at pp=4 in groups of 5 and 4), with the same bits.
  struct Case {
    Layout l;
    int chunks;
    std::string extra;
    int global_batch = 16;
  };
  for (const std::string family : {"llama", "gpt2"}) {
    nlohmann::json patch = model_patch(family);
    patch["checkpoint"] = {{"interval", 3}, {"save_at_end", false}};
    test::Workspace ws(patch);
    for (const Case& c : std::vector<Case>{{{1, 2, 1}, 2, ""},
                                           {{1, 2, 1}, 4, ""},
                                           {{1, 4, 2}, 2, ""},
                                           {{1, 2, 1}, 2, "", 10},
                                           {{1, 4, 1}, 2, "", 18},
                                           {{2, 2, 2}, 2, "--set precision.mode=bf16 --set train.recompute=full "
                                                          "--set parallel.sequence_parallel=true"}}) {
      INFO(family << " " << c.l.str() << " virtual_stages " << c.chunks << " global batch " << c.global_batch << " "
                  << c.extra);
      // (the run of 16 keeps the plain name: the resume below starts from its checkpoint)
      std::string name = std::to_string(c.chunks);
      if (c.global_batch != 16) name.append("_").append(std::to_string(c.global_batch));
      const std::string extra = c.extra + " --set train.global_batch=" + std::to_string(c.global_batch);
      const Run plain = train(ws, ws.dir / c.l.dir("plain" + name), c.l, extra);
      INFO(plain.output);
      REQUIRE(plain.code == 0);
      const std::string dir = ws.dir / c.l.dir("vs" + name);
      const Run got = train(ws, dir, c.l, extra + " --set parallel.virtual_stages=" + std::to_string(c.chunks));
      INFO(got.output);
      REQUIRE(got.code == 0);
      // M micro-batches of 2 on each DP rank in 2 M v + 2 (pp - 1) ticks, whether pp divides M or not
      const int M = c.global_batch / 2 / c.l.dp, P = c.l.pp;
      CHECK_THAT(got.output, Catch::Contains("interleaved 1F1B: " + std::to_string(P) + " stages x " +
                                             std::to_string(c.chunks) + " chunks, " + std::to_string(M) +
                                             " micro-batches: " + std::to_string(2 * M * c.chunks + 2 * (P - 1)) +
                                             " ticks of " + std::to_string(2 * M * c.chunks) + " ops"));
      REQUIRE(got.records.size() == plain.records.size());
      CHECK(got.records[0]["loss"].get<double>() == plain.records[0]["loss"].get<double>());
      const bool bf16 = c.extra.find("bf16") != std::string::npos;
      compare(plain, got, bf16 ? 2e-2 : 1e-5, 1e-5, bf16 ? 2e-2 : 1e-4);
    }
    // Resume the interleaved run's step-3 checkpoint under plain 1F1B (pp=2): steps 4-6 track it.
    const std::string interleaved = ws.dir / Layout{1, 2, 1}.dir("vs2");
    const std::string resumed = ws.dir / "resumed_plain";
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(interleaved + "/checkpoints/step_00000003", resumed + "/checkpoints/step_00000003",
             fs::copy_options::recursive);
    const Run r = train(ws, resumed, {1, 2, 1});
    INFO(r.output);
    REQUIRE(r.code == 0);
    const Run ref = train(ws, ws.dir / "vs2_again", {1, 2, 1}, "--set parallel.virtual_stages=2");
    REQUIRE(ref.code == 0);
    std::map<int64_t, double> got;
    for (const auto& rec : r.records) got[rec["step"].get<int64_t>()] = rec["loss"].get<double>();
    REQUIRE(got.size() == 3);
    for (const auto& rec : ref.records) {
      const int64_t step = rec["step"];
      if (step <= 3) continue;
      CHECK(std::abs(got[step] - rec["loss"].get<double>()) <= 1e-5 * rec["loss"].get<double>());
    }
  }
}

TEST_CASE("uneven pipeline splits (parallel.pipeline_layers, embedding_slot) train like one process and resume evenly",
          "[mpi][layouts][pipeline]") {
  // Stages that hold only the embedding or only the head (GPT-2's: the final norm and the tied
  // copy beside no layer), embedding_slot's split, an SP embedding stage whose rows are summed
  // over TP and scattered without a layer, and an interleaved split: the single process's math
  // (fp32 1e-5 / 1e-4), with the memory keel plan gives rank 0. 8 layers.
  struct Case {
    Layout l;
    std::string extra;
  };
  const std::vector<Case> cases = {
      {{1, 4, 1}, "--set parallel.pipeline_layers=[0,3,4,1]"},
      {{1, 4, 1}, "--set parallel.pipeline_layers=[2,3,3,0]"},
      {{1, 4, 1}, "--set parallel.embedding_slot=true"},
      {{2, 2, 1}, "--set parallel.sequence_parallel=true --set parallel.pipeline_layers=[0,8]"},
      {{1, 2, 2}, "--set parallel.virtual_stages=2 --set parallel.pipeline_layers=[0,4,3,1]"}};
  for (const std::string family : {"llama", "gpt2"}) {
    nlohmann::json patch = model_patch(family);
    patch["checkpoint"] = {{"interval", 3}, {"save_at_end", false}};
    test::Workspace ws(patch);
    const Run ref = train(ws, ws.dir / "single", {1, 1, 1});
    INFO(ref.output);
    REQUIRE(ref.code == 0);
    for (size_t k = 0; k < cases.size(); ++k) {
      INFO(family << " " << cases[k].l.str() << " " << cases[k].extra);
      const Run got = train(ws, ws.dir / ("split" + std::to_string(k)), cases[k].l, cases[k].extra);
      INFO(got.output);
      REQUIRE(got.code == 0);
      compare(ref, got, 1e-5, 1e-5, 1e-4);
      check_memory(got);
    }
    // The embedding-only first stage's step-3 checkpoint resumes under pp=4's even split: the same
    // per-layer arithmetic, so its probe loss and norms are checked bit for bit, and pass.
    const std::string same_pp = ws.dir / "resumed_pp4";
    fs::create_directories(same_pp + "/checkpoints");
    fs::copy(ws.dir / "split0/checkpoints/step_00000003", same_pp + "/checkpoints/step_00000003",
             fs::copy_options::recursive);
    std::string cmd = "train --config " + ws.config + " --out " + same_pp + " --set parallel.pp=4";
    const test::ProcessResult r4 = test::run_keel_mpi(4, cmd);
    INFO(r4.output);
    REQUIRE(r4.code == 0);
    CHECK_THAT(r4.output, Catch::Contains("(saved under tp=1 pp=4 dp=1, layers per stage [0,3,4,1])") &&
                              Catch::Contains("restart verification passed: masters consistent with the weights, "
                                              "probe loss and per-tensor norms as saved"));
    for (const std::string& tool : {std::string("ckpt inspect "), std::string("doctor ckpt ")}) {
      const test::ProcessResult shown = test::run_keel(tool + (ws.dir / "split0/checkpoints/step_00000003"));
      INFO(shown.output);
      CHECK_THAT(shown.output, Catch::Contains("saved under tp=1 pp=4 dp=1, layers per stage [0,3,4,1]"));
    }
    // ... and under the even split of pp=2.
    const std::string resumed = ws.dir / "resumed_even";
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(ws.dir / "split0/checkpoints/step_00000003", resumed + "/checkpoints/step_00000003",
             fs::copy_options::recursive);
    const Run r = train(ws, resumed, {1, 2, 1});
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.records.front()["step"].get<int64_t>() == 4);
    std::map<int64_t, double> got;
    for (const auto& rec : r.records) got[rec["step"].get<int64_t>()] = rec["loss"].get<double>();
    for (const auto& rec : ref.records)
      if (rec["step"].get<int64_t>() > 3) {
        INFO("step " << rec["step"]);
        CHECK(std::abs(got[rec["step"]] - rec["loss"].get<double>()) <= 1e-5 * rec["loss"].get<double>());
      }
  }
  // A split the run cannot build is refused before any rank starts, naming the field.
  test::Workspace ws(model_patch("llama"));
  const Run bad = train(ws, ws.dir / "bad", {1, 4, 1}, "--set parallel.pipeline_layers=[2,0,3,3]");
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("parallel.pipeline_layers: stage 1 would hold no layer"));
  CHECK(!fs::exists(ws.dir / "bad/checkpoints"));
}

TEST_CASE("tied embedding copies stay bitwise identical over many steps, and a drift is caught by name",
          "[mpi][tied]") {
  nlohmann::json patch = model_patch("gpt2");
  patch["train"]["steps"] = 60;
  patch["precision"] = {{"mode", "bf16"}};
  test::Workspace ws(patch);
  // The replica check runs after every step (health.replica_check_interval = 1) and compares
  // the checksums of the first stage's tok_embed and the last stage's copy.
  for (const Layout& l : std::vector<Layout>{{1, 2, 1}, {2, 4, 1}, {1, 2, 4}}) {
    INFO(l.str());
    const Run r = train(ws, ws.dir / l.dir("tied"), l);
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(r.records.size() == 60);
    CHECK_THAT(r.output, Catch::Contains("replica check"));
  }
  // With one copy nudged (test hook), the check stops the run naming the tensor and the ranks.
  const auto drift = test::run_keel_mpi(
      2, "train --config " + ws.config + " --out " + (ws.dir / "drift") + " -q --set parallel.pp=2",
      "KEEL_FAULT_TIED_DRIFT=1");
  INFO(drift.output);
  CHECK(drift.code != 0);
  CHECK_THAT(drift.output, Catch::Contains("replica mismatch") && Catch::Contains("tok_embed") &&
                      Catch::Contains("world rank 0") && Catch::Contains("world rank 1"));
}

// Stochastic rounding draws per (tensor, TP shard, element, step): copies of one tensor on
// different ranks (TP-replicated norms and biases, the tied head on the last stage) round
// alike, so the replica check after every step stays quiet.
TEST_CASE("stochastic rounding keeps replicated and tied copies bitwise identical", "[mpi][tied][stochastic]") {
  nlohmann::json patch = model_patch("gpt2");
  patch["train"]["steps"] = 10;
  patch["precision"] = {{"mode", "bf16"}, {"stochastic_rounding", true}};
  test::Workspace ws(patch);
  const Run r = train(ws, ws.dir / "sr222", {2, 2, 2});
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.records.size() == 10);
  CHECK_THAT(r.output, Catch::Contains("replica check"));
}

TEST_CASE("a checkpoint saved under tp=2 pp=2 dp=2 resumes under tp=1 pp=1 dp=1 and tp=2 pp=1 dp=4",
          "[mpi][reshard]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    nlohmann::json patch = model_patch(family);
    patch["train"]["steps"] = 10;
    patch["checkpoint"] = {{"save_at_end", true}};
    test::Workspace ws(patch);
    const Run straight = train(ws, ws.dir / "straight", {1, 1, 1});
    REQUIRE(straight.code == 0);
    const Run first = train(ws, ws.dir / "half", {2, 2, 2}, "--stop-at 5");
    INFO(first.output);
    REQUIRE(first.code == 4);
    // The save's line gives the whole checkpoint's size (every rank's files), not rank 0's part.
    int64_t bytes = 0;
    for (const auto& e : fs::directory_iterator(ws.dir / "half/checkpoints/step_00000005"))
      if (e.path().extension() == ".safetensors") bytes += static_cast<int64_t>(fs::file_size(e.path()));
    char size[32];
    std::snprintf(size, sizeof size, " (%.1f MB in ", static_cast<double>(bytes) / 1e6);
    CHECK_THAT(first.output, Catch::Contains("step_00000005" + std::string(size)));
    for (const Layout& l : std::vector<Layout>{{1, 1, 1}, {2, 1, 4}}) {
      INFO("resumed under " << l.str());
      const std::string out = ws.dir / l.dir("resumed");
      fs::copy(ws.dir / "half", out, fs::copy_options::recursive);
      const Run r = train(ws, out, l);
      INFO(r.output);
      REQUIRE(r.code == 0);
      CHECK_THAT(r.output, Catch::Contains("saved under tp=2 pp=2 dp=2"));
      // Steps 1-5 ran under 2x2x2, 6-10 under the new layout: all track the straight run.
      check_tracks(straight, r);
    }
  }
}

// A padded vocabulary pads to model.pad_vocab_to_multiple_of x parallel.tp: 64 tokens pad to 72
// rows at tp=1 and to 96 at tp=2 (multiple 24). A checkpoint moves between them with its real
// rows; the padding rows are no token's and stay zero, so the run tracks the straight one (fp32,
// within 1e-5 as every layout).
TEST_CASE("a padded vocabulary's checkpoint resumes under another tp, which pads it otherwise (both directions)",
          "[mpi][reshard][vocab]") {
  for (const std::string family : {"llama", "gpt2"}) {
    INFO(family);
    nlohmann::json patch = model_patch(family);
    patch["model"]["pad_vocab_to_multiple_of"] = 24;
    patch["train"]["steps"] = 8;
    patch["checkpoint"] = {{"save_at_end", true}};
    test::Workspace ws(patch);
    const Run straight = train(ws, ws.dir / "straight", {1, 1, 1});
    REQUIRE(straight.code == 0);
    REQUIRE(straight.records.size() == 8);
    // Into one process; into ZeRO shards that cut rows; into a last stage holding GPT-2's tied copy.
    for (const auto& [before, after, rows] : {std::tuple{Layout{2, 2, 2}, Layout{1, 1, 1}, "96 rows, this run to 72"},
                                             std::tuple{Layout{1, 1, 1}, Layout{2, 1, 4}, "72 rows, this run to 96"},
                                             std::tuple{Layout{1, 2, 1}, Layout{2, 2, 2}, "72 rows, this run to 96"}}) {
      INFO(before.str() << " -> " << after.str());
      const std::string out = ws.dir / (before.dir("from") + after.dir("to"));
      REQUIRE(train(ws, out, before, "--stop-at 4").code == 4);
      const Run r = train(ws, out, after);
      INFO(r.output);
      REQUIRE(r.code == 0);
      CHECK_THAT(r.output, Catch::Contains(std::string("the checkpoint pads the vocabulary to ") + rows) &&
                               Catch::Contains("restart verification passed"));
      CHECK(r.output.find("were not zero") == std::string::npos);
      check_tracks(straight, r);
    }
  }
}

TEST_CASE("a world size that does not match tp*pp*dp is one clear error", "[mpi][errors]") {
  test::Workspace ws(model_patch("llama"));
  const auto r = test::run_keel_mpi(
      3, "train --config " + ws.config + " --out " + (ws.dir / "x") + " --set parallel.tp=2 --set parallel.pp=2");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("tp*pp*dp = 2*2*1 = 4 ranks, but 3 processes were launched") &&
                           Catch::Contains("launch a multiple of tp*pp = 4 processes"));
  CHECK_FALSE(fs::exists(ws.dir / "x"));
  // A dp the launch would fit but the batch does not divide over: the hint says what else to change.
  const auto dp3 = test::run_keel_mpi(3, "train --config " + ws.config + " --out " + (ws.dir / "y"));
  INFO(dp3.output);
  CHECK(dp3.code == 2);
  CHECK_THAT(dp3.output, Catch::Contains("or change parallel.dp to 3 with a train.global_batch that is a multiple of "
                                         "train.micro_batch x dp = 6 (it is 16)"));
}

// The start-up summary counted the parameters and weight-decay groups of world rank 0's table:
// under pp > 1 that is the first stage only (norms looked absent from the no-decay group).
TEST_CASE("the start-up summary counts the whole model under every layout", "[mpi][summary]") {
  test::Workspace ws(model_patch("llama"));
  auto summary = [](const std::string& out) {
    const size_t a = out.find("keel: llama model, "), b = out.find("keel: data: ");
    const size_t backend = out.find("keel: backend ", a), optimizer = out.find("optimizer groups", a);
    if (a == std::string::npos || b == std::string::npos || backend == std::string::npos) return std::string();
    return out.substr(a, out.find('\n', a) - a) + "\n" + out.substr(optimizer, b - optimizer);
  };
  const std::string args = "train --config " + ws.config + " -q --steps 1 --out ";
  const auto one = test::run_keel(args + (ws.dir / "one"));
  REQUIRE(one.code == 0);
  const std::string want = summary(one.output);
  REQUIRE_FALSE(want.empty());
  for (const std::string layout : {"--set parallel.pp=2", "--set parallel.pp=2 --set parallel.tp=2",
                                   "--set parallel.pp=4 --set 'parallel.pipeline_layers=[0,4,4,0]'"}) {
    const int np = layout.find("tp=2") != std::string::npos || layout.find("pp=4") != std::string::npos ? 4 : 2;
    const auto r = test::run_keel_mpi(np, args + (ws.dir / "pp") + " " + layout);
    INFO(layout << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK(summary(r.output) == want);
  }
}

// A node with its own, stale copy of the data trained its share on other windows, unseen (the
// checkpoint records rank 0's files). Here the data path goes through /proc/self/cwd, the same
// text in both ranks' configs, and each rank starts in a folder of its own (mpirun -wdir): world
// rank 1's train.bin is half world rank 0's, and its validation folder holds one file more.
TEST_CASE("ranks that see other data files behind the same config are refused, the files named", "[mpi][errors][data]") {
  test::Workspace ws(model_patch("llama"));
  for (const char* node : {"node0", "node1"}) fs::create_directories(ws.dir / (std::string(node) + "/data"));
  const std::vector<uint32_t> tokens = test::synthetic_tokens(20000, 1);
  data::write_llmc_shard(ws.dir / "node0/data/train.bin", tokens, false);
  data::write_llmc_shard(ws.dir / "node1/data/train.bin", std::vector<uint32_t>(tokens.begin(), tokens.begin() + 10000), false);
  for (const char* node : {"node0", "node1"})
    data::write_llmc_shard(ws.dir / (std::string(node) + "/data/val_0.bin"), test::synthetic_tokens(4000, 2), false);
  data::write_llmc_shard(ws.dir / "node1/data/val_1.bin", test::synthetic_tokens(4000, 3), false);
  const std::string args = " -x OMP_NUM_THREADS=1 " + std::string(KEEL_BINARY) + " train --config " + ws.config + " --out " +
                           (ws.dir / "out") + " -q --set parallel.dp=2 --set data.train=/proc/self/cwd/data/train.bin" +
                           " --set 'data.val=/proc/self/cwd/data/val_*.bin' --set train.eval_batches=1";
  auto launch = [&](const std::string& second_node) {
    return test::run_shell(std::string(KEEL_MPIEXEC) + " -np 1 -wdir " + (ws.dir / "node0") + args + " : -np 1 -wdir " +
                           (ws.dir / second_node) + args);
  };
  const auto r = launch("node1");
  INFO(r.output);
  CHECK(r.code == 3);
  CHECK_THAT(r.output, Catch::Contains("world rank 1 reads other data files than world rank 0") &&
                           Catch::Contains("data.train: /proc/self/cwd/data/train.bin holds 20000 tokens on world rank 0, "
                                           "10000 on world rank 1") &&
                           Catch::Contains("data.val: /proc/self/cwd/data/val_1.bin (4000 tokens) is there only on world "
                                           "rank 1"));
  CHECK_FALSE(fs::exists(ws.dir / "out/config.json"));
  // The same files in both folders: the run goes ahead.
  const auto same = launch("node0");
  INFO(same.output);
  CHECK(same.code == 0);
}

TEST_CASE("under mpirun, stop-and-resume (with background saves) and kill -9-and-resume continue bit-identically "
          "(same layout)",
          "[mpi][resume]") {
  nlohmann::json patch = model_patch("gpt2");
  patch["train"]["steps"] = 12;
  patch["precision"] = {{"mode", "bf16"}};
  patch["checkpoint"] = {{"interval", 2}, {"save_at_end", true}};
  test::Workspace ws(patch);
  const Layout l{2, 2, 2};
  const Run straight = train(ws, ws.dir / "straight", l);
  REQUIRE(straight.code == 0);
  auto by_step = [](const std::string& metrics) {
    return test::losses_by_step(test::read_metrics(metrics));
  };
  const auto expected = by_step(ws.dir / "straight/metrics.jsonl");
  REQUIRE(expected.size() == 12);

  // Stop at step 5 (a checkpoint is written there), resume. These runs write their interval
  // saves in the background (checkpoint.async): each of the 8 ranks' writer threads, published
  // once no rank is still writing. Their checkpoints hold the same bits as the straight run's.
  const std::string async = "--set checkpoint.async=true";
  const Run stopped = train(ws, ws.dir / "stopped", l, async + " --stop-at 5");
  INFO(stopped.output);
  REQUIRE(stopped.code == 4);
  CHECK_THAT(stopped.output, Catch::Contains("step_00000004 (") && Catch::Contains("written in the background"));
  const Run resumed = train(ws, ws.dir / "stopped", l, async);
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(by_step(ws.dir / "stopped/metrics.jsonl") == expected);
  for (const char* step : {"step_00000010", "step_00000012"}) {
    const auto diff = test::run_keel("ckpt diff " + (ws.dir / "straight/checkpoints/") + step + " " +
                                     (ws.dir / "stopped/checkpoints/") + step);
    INFO(diff.output);
    CHECK(diff.code == 0);
    CHECK_THAT(diff.output, Catch::Contains("bitwise equal"));
  }

  // kill -9 every rank once the run is under way, then resume from whatever was saved last.
  // (A 400-step schedule, so the kill lands mid-run; the reference is its first 16 steps, well
  // past where the kill lands: a --stop-at the resumed checkpoint has passed is refused.)
  REQUIRE(train(ws, ws.dir / "long", l, "--set train.steps=400 --stop-at 16").code == 4);
  const auto expected_long = by_step(ws.dir / "long/metrics.jsonl");
  const std::string out = ws.dir / "killed";
  const std::string cmd = std::string(KEEL_MPIEXEC) + " -np 8 -x OMP_NUM_THREADS=1 " + KEEL_BINARY + " train --config " +
                          ws.config + " --out " + out + " -q --set parallel.tp=2 --set parallel.pp=2 --set parallel.dp=2" +
                          " --set train.steps=400 > " + out + ".log 2>&1 &";
  REQUIRE(std::system(cmd.c_str()) == 0);
  for (int i = 0; i < 600 && test::losses_by_step(fs::exists(out + "/metrics.jsonl") ? test::read_metrics(out + "/metrics.jsonl")
                                                                                      : std::vector<nlohmann::json>{})
                                     .size() < 7;
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::system(("pkill -9 -f -- '--out " + out + " ' ; sleep 0.5; pkill -9 -f -- '--out " + out + " '").c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Run again = train(ws, out, l, "--set train.steps=400 --stop-at 16");  // from the last complete save
  INFO(again.output);
  REQUIRE(again.code == 4);
  CHECK_THAT(again.output, Catch::Contains("resuming from"));
  auto got = by_step(out + "/metrics.jsonl");
  for (auto it = got.begin(); it != got.end();) it = it->first > 16 ? got.erase(it) : std::next(it);
  CHECK(got == expected_long);
}
