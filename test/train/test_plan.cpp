// keel plan (train/plan.h): the seed's own arithmetic (../shared/seeds/001), exact parameter
// counts against the ParamTable, activation bytes against what the Transformer allocates, and
// the BLOOM 200B benchmark tables (measured memory, OOMs, seconds per iteration) against the
// planner's memory verdicts and ranking.
#include <catch2/catch.hpp>

#include "common/process.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <set>

#include "common/run_config.h"
#include "common/scoped_env.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/transformer.h"
#include "train/parallel/comm.h"
#include "train/pipeline_schedule.h"
#include "train/plan.h"

using namespace keel;
using namespace keel::plan;

namespace {

std::string grouped_for_test(int64_t n) {  // 1234567 -> "1,234,567"
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

RunConfig shipped(const std::string& name) { return load_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name); }

// A GPT-style model as the seed benchmarked it: vocab 250680 (BLOOM's tokenizer) padded to a
// multiple of 128*tp (Megatron's make-vocab-size-divisible-by 128 -> 250880 at tp 2..8),
// seq 2048, tied head, no batch ramp-up (the benchmark tables ignored it).
RunConfig seed_model(int h, int layers, int heads, int64_t gbs) {
  nlohmann::json j = {
      {"model",
       {{"family", "gpt2"},
        {"vocab_size", 250680},
        {"pad_vocab_to_multiple_of", 128},
        {"d_model", h},
        {"n_layers", layers},
        {"n_heads", heads},
        {"ffn_hidden", 4 * h},
        {"max_seq_len", 2048},
        {"tied_embeddings", true}}},
      {"precision", {{"mode", "bf16"}}},
      {"train", {{"steps", 10}, {"global_batch", gbs}, {"micro_batch", 1}, {"seq_len", 2048}}},
      {"data", {{"train", "unused.bin"}}},
  };
  return parse_config(j, "seed.json");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the seed's arithmetic

TEST_CASE("plan: memory sizes parse with binary and decimal units", "[plan]") {
  CHECK(parse_memory_size("80GiB") == 80ll << 30);
  CHECK(parse_memory_size("80GB") == 80'000'000'000ll);
  CHECK(parse_memory_size("40G") == 40ll << 30);          // bare G: powers of 2 (nvidia-smi, Slurm)
  CHECK(parse_memory_size("81920MiB") == 80ll << 30);
  CHECK(parse_memory_size("81920mib") == 80ll << 30);
  CHECK(parse_memory_size("1.5 GiB") == 3ll << 29);
  CHECK(parse_memory_size("512M") == 512ll << 20);
  CHECK(parse_memory_size("2TB") == 2'000'000'000'000ll);
  CHECK(parse_memory_size("1048576") == 1048576);
  CHECK_THROWS_AS(parse_memory_size("80 GiBs"), ConfigError);
  CHECK_THROWS_AS(parse_memory_size("GiB"), ConfigError);
  CHECK_THROWS_AS(parse_memory_size("-4G"), ConfigError);
  CHECK_THROWS_AS(parse_memory_size("0"), ConfigError);
  // From 2^63 bytes on the size does not fit an int64_t: refused, not wrapped to a negative one.
  CHECK(parse_memory_size("8388607TiB") == 8388607ll << 40);
  for (const char* huge : {"8388608TiB", "9999999999TiB", "1e30", "99999999999999999999", "1e400"})
    CHECK_THROWS_WITH(parse_memory_size(huge), Catch::Contains("memory size '" + std::string(huge) + "' is too large"));
}

TEST_CASE("plan: the seed's model-size formula", "[plan]") {
  using seed_formula::model_params;
  // "Model size: 104B / 146B / 199B / 206B" (seed 001, Size and Possible 200B models)
  CHECK(std::lround(model_params(64, 11600, 2048, 50257) / 1e9) == 104);
  CHECK(std::lround(model_params(80, 12288, 2048, 50257) / 1e9) == 146);
  CHECK(std::lround(model_params(80, 14336, 2048, 150257) / 1e9) == 199);
  CHECK(std::lround(model_params(96, 13312, 2048, 150257) / 1e9) == 206);
  CHECK(std::lround(model_params(96, 16384, 2048, 50257) / 1e9) == 310);
  // "one layer size: 12*h**2 + 13*h: 1_614_870_800" and "2_126_685_184"
  CHECK(seed_formula::layer_params(11600) == 1'614'870'800.0);
  CHECK(seed_formula::layer_params(13312) == 2'126'685'184.0);
}

TEST_CASE("plan: per-GPU embedding and block sizes of the 145B and 310B examples", "[plan]") {
  // seed: "emb size: 617.56M ... per gpu 77.19M; blk size: 1812.10M ... per gpu 226.51M" (h=12288, TP=8)
  //       "emb size: 823.41M ... per gpu 102.93M; blk size: 3221.44M ... per gpu 402.68M" (h=16384, TP=8)
  auto millions = [](double x) { return std::round(x / 1e4) / 100; };  // the seed's {:.2f}M
  ModelConfig m;
  m.family = Family::GPT2;
  m.vocab_size = 50257;
  m.n_layers = 80;
  m.d_model = 12288;
  SeedAccounting a = seed_accounting(m, Layout{8, 8, 1, 1});
  CHECK(millions(a.embedding_per_gpu * 8) == Approx(617.56));
  CHECK(millions(a.embedding_per_gpu) == Approx(77.19));
  CHECK(millions(a.layer_per_gpu * 8) == Approx(1812.10));
  CHECK(millions(a.layer_per_gpu) == Approx(226.51));
  CHECK(a.layers_per_stage == 10);  // "80/8=10 PP stages per gpu"
  m.d_model = 16384;
  m.n_layers = 96;
  a = seed_accounting(m, Layout{8, 16, 1, 1});
  CHECK(millions(a.embedding_per_gpu * 8) == Approx(823.41));
  CHECK(millions(a.embedding_per_gpu) == Approx(102.93));
  CHECK(millions(a.layer_per_gpu * 8) == Approx(3221.44));
  CHECK(millions(a.layer_per_gpu) == Approx(402.68));
  CHECK(a.layers_per_stage == 6);  // "96/16=6 PP stages per gpu"
}

TEST_CASE("plan: 104B at TP=4 PP=32, seed accounting and keel's exact count", "[plan]") {
  const RunConfig cfg = shipped("bloom-104b.json");  // 64 x 11600, vocab 50257 padded by 128*tp
  const ModelConfig& m = cfg.model;
  const Layout l{4, 32, 1, 1};

  // The seed: "gpu w/ emb: 2*403_717_700 + 145_745_300 = 953_180_700 params * 18 bytes =
  // 17_157_252_600 bytes"; "gpu w/o emb: 2*403_717_700 = 807_435_400 params * 18 bytes = 14_533_837_200".
  const SeedAccounting sa = seed_accounting(m, l);
  CHECK(sa.layer_per_gpu == 403'717'700.0);
  CHECK(sa.embedding_per_gpu == 145'745'300.0);
  CHECK(sa.with_embedding == 953'180'700.0);
  CHECK(sa.without_embedding == 807'435'400.0);
  CHECK(sa.with_embedding * 18 == 17'157'252'600.0);
  CHECK(sa.without_embedding * 18 == 14'533'837'200.0);
  CHECK(std::round(sa.with_embedding * 18 / 1e7) / 100 == Approx(17.16));
  CHECK(std::round(sa.without_embedding * 18 / 1e7) / 100 == Approx(14.53));
  // keel keeps 2 (bf16 weights) + 4 (fp32 grads) + 4 (fp32 master) + 8 (Adam m, v) = 18 B/param
  // unsharded: the seed's 18.
  const MemoryModel keel_mem = keel_memory_model(PrecisionMode::BF16);
  CHECK(keel_mem.state.per_param(1) == 18);
  CHECK(keel_mem.state.per_param(4) == 6 + 12.0 / 4);  // ZeRO-1 shards master + moments

  // keel's exact count differs from the seed's by named terms only.
  PlanOptions opt;
  opt.memory = keel_mem;
  REQUIRE(layout_problem(cfg, l, opt).empty());
  const LayoutPlan p = plan_layout(cfg, l, opt);
  REQUIRE(p.stages.size() == 32);
  const int64_t h = m.d_model, t = l.tp;
  const int64_t padded = model_for_tp(m, t).embed_rows();
  CHECK(padded == 50688);  // 50257 up to a multiple of 128*4
  const int64_t padding_rows = (padded - m.vocab_size) * h / t;  // 1,249,900
  const int64_t positions = int64_t{m.max_seq_len} * h;            // pos_embed, replicated over TP
  // Per layer the seed divides all of 12h^2+13h by tp; keel replicates attn_norm/mlp_norm
  // (weight+bias: 4h) and the bo/b_proj biases (2h) on every TP rank.
  const int64_t replicated_per_layer = 6 * h - 6 * h / t;  // 52,200
  const int64_t final_norm = 2 * h;
  CHECK(p.stages[0].params == 953'180'700 + padding_rows + positions + 2 * replicated_per_layer);
  CHECK(p.stages[0].params == 978'291'800);
  CHECK(p.stages[15].params == 807'435'400 + 2 * replicated_per_layer);
  // The last stage holds the tied embedding copy for its head, and the final norm.
  CHECK(p.stages[31].tied_copy == padded * h / t);
  CHECK(p.stages[31].params == 953'180'700 + padding_rows + final_norm + 2 * replicated_per_layer);
  // Bytes at 18 B/param (dp=1): keel's first stage needs 17.61 GB where the seed counted 17.16.
  CHECK(p.stages[0].state() == Approx(978'291'800.0 * 18));
  CHECK(std::round(p.stages[0].state() / 1e7) / 100 == Approx(17.61));
}

TEST_CASE("plan: the exact count is the ParamTable's for every shipped config", "[plan]") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(KEEL_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".json") continue;
    INFO(e.path());
    const RunConfig cfg = load_config(e.path().string());
    const ModelCount c = count_model(cfg);
    CHECK(c.exact == ParamTable(cfg.model).logical_numel());
    CHECK(c.embedding + c.layers + c.head == c.exact);
    if (cfg.model.is_gpt2()) {
      // The closed form l(12h^2+13h) + v h + s h + 2h is exact but for the vocab padding.
      REQUIRE(c.gpt_formula);
      CHECK(double(c.exact) - *c.gpt_formula == double(c.padded_vocab - cfg.model.vocab_size) * cfg.model.d_model);
    }
    ++n;
  }
  CHECK(n >= 6);
}

TEST_CASE("plan: per-rank parameters over all ranks add up to the model", "[plan]") {
  // Every TP rank of every stage, replicas counted once: split tensors contribute each rank's
  // shard, replicated ones (norms, some biases, positions) rank 0 only, and the last stage's tied
  // embedding copy not at all.
  struct Case {
    const char* config;
    Layout layout;
    bool own_slot;
  };
  const Case cases[] = {{"bloom-104b.json", {4, 32, 1, 1}, false}, {"bloom-104b.json", {4, 2, 1, 1}, false},
                        {"bloom-200b.json", {8, 10, 4, 1}, false}, {"bloom-200b.json", {4, 41, 1, 1}, true},
                        {"llama2-7b.json", {2, 4, 1, 1}, false},   {"llama2-7b.json", {4, 2, 1, 1}, true},
                        {"gpt2-124m.json", {4, 3, 2, 1}, false},   {"gpt2-124m.json", {2, 7, 1, 1}, true}};
  for (const Case& c : cases) {
    INFO(c.config << " " << c.layout.str() << (c.own_slot ? " own slot" : ""));
    const RunConfig cfg = shipped(c.config);
    PlanOptions opt;
    opt.embedding_own_slot = c.own_slot;
    opt.hw.gpus_per_node = 8;
    Layout l = c.layout;
    l.mbs = 1;
    const ModelConfig m = model_for_tp(cfg.model, l.tp);
    const auto spans = stage_spans(m.n_layers, l.pp, PipelineSplit{c.own_slot, {}});
    REQUIRE(spans.size() == size_t(l.pp));
    int64_t sum = 0, layers_seen = 0;
    for (const StageSpan& sp : spans) {
      layers_seen += sp.layers();
      for (int r = 0; r < l.tp; ++r) {
        const ParamTable shard(m, ModelShard{r, int(l.tp), sp.first_layer, sp.end_layer, sp.has_embedding, sp.has_head});
        for (const ParamSpec& p : shard.params())
          if (shard.is_primary(p)) sum += p.numel;
      }
    }
    CHECK(layers_seen == m.n_layers);
    CHECK(sum == ParamTable(m).logical_numel());
    // And the planner's per-stage counts are those shards (plus the tied copy on the last stage).
    RunConfig pinned = cfg;
    pinned.train.global_batch = l.dp * 8;
    pinned.schedule.rampup.reset();
    REQUIRE(layout_problem(pinned, l, opt).empty());
    const LayoutPlan p = plan_layout(pinned, l, opt);
    int64_t planner_sum = 0;
    for (const StageMemory& s : p.stages) {
      const int64_t replicated = [&] {
        const ParamTable shard(
            m, ModelShard{0, int(l.tp), s.span.first_layer, s.span.end_layer, s.span.has_embedding, s.span.has_head});
        int64_t n = 0;
        for (const ParamSpec& q : shard.params())
          if (q.split == TpSplit::None && !q.tied_copy) n += q.numel;
        return n;
      }();
      planner_sum += (s.params - s.tied_copy - replicated) * l.tp + replicated;
      CHECK(s.embedding_params + s.layer_params + s.head_params == s.params);
      // (the planner adds one layer's count per layer: exactly TP rank 0's table of the stage)
      CHECK(s.params == ParamTable(m, ModelShard{0, int(l.tp), s.span.first_layer, s.span.end_layer,
                                                 s.span.has_embedding, s.span.has_head})
                            .local_numel());
    }
    CHECK(planner_sum == ParamTable(m).logical_numel());
  }
}

TEST_CASE("plan: stage spans, with and without embedding slots", "[plan]") {
  auto spans = stage_spans(80, 10, PipelineSplit{});
  REQUIRE(spans.size() == 10);
  CHECK(spans[0].first_layer == 0);
  CHECK(spans[0].end_layer == 8);
  CHECK(spans[0].has_embedding);
  CHECK(spans[9].has_head);
  // Uneven, as the trainer splits them: the first 80 % 12 = 8 stages take 7 layers, the rest 6.
  spans = stage_spans(80, 12, PipelineSplit{});
  REQUIRE(spans.size() == 12);
  CHECK(spans[7].layers() == 7);
  CHECK(spans[8].layers() == 6);
  CHECK(spans[11].end_layer == 80);
  CHECK(stage_spans(4, 5, PipelineSplit{}).empty());  // a stage without a layer (parallel.pp above the layers)
  // The seed's 'type:transformer|embedding': 94 layers + 2 slots over PP=24 -> 4 slots each,
  // the first and last stage hold 3 blocks next to the embedding / head.
  spans = stage_spans(94, 24, PipelineSplit{true, {}});
  REQUIRE(spans.size() == 24);
  CHECK(spans[0].layers() == 3);
  CHECK(spans[1].layers() == 4);
  CHECK(spans[23].layers() == 3);
  CHECK(spans[23].end_layer == 94);
  CHECK(stage_spans(4, 7, PipelineSplit{true, {}}).empty());  // 6 slots for 7 stages
  // TP=1, PP=96 from the seed ("emb | transf | ... | transf | emb") with 94 blocks.
  spans = stage_spans(94, 96, PipelineSplit{true, {}});
  REQUIRE(spans.size() == 96);
  CHECK(spans[0].layers() == 0);
  CHECK(spans[95].layers() == 0);
  // Every split is the trainer's (model/param_table.h), even or not, with slots or without, and
  // what the trainer refuses (parallel.pp above the layers, or a stage left empty) is empty.
  for (const bool own_slot : {false, true})
    for (const int layers : {1, 4, 7, 80, 94})
      for (int pp = 1; pp <= layers + 3; ++pp) {
        ModelConfig m;
        m.n_layers = layers;
        const bool slots = own_slot && pp > 1;
        bool buildable = pp <= layers + (slots ? 2 : 0);
        std::vector<ModelShard> want;
        for (int s = 0; s < pp && buildable; ++s) {
          try {
            want.push_back(pipeline_stage(m, pp, s, PipelineSplit{slots, {}}));
          } catch (const std::invalid_argument&) {
            buildable = false;
          }
        }
        const auto got = stage_spans(layers, pp, PipelineSplit{own_slot, {}});
        INFO(layers << " layers, pp=" << pp << (own_slot ? ", own slots" : ""));
        if (!buildable) {
          CHECK(got.empty());
          continue;
        }
        REQUIRE(got.size() == size_t(pp));
        for (int s = 0; s < pp; ++s) {
          CHECK(got[s].first_layer == want[s].first_layer);
          CHECK(got[s].end_layer == want[s].end_layer);
          CHECK(got[s].has_embedding == want[s].has_embedding);
          CHECK(got[s].has_head == want[s].has_head);
        }
      }
}

TEST_CASE("plan: an uneven pipeline is planned as the trainer runs it, the heaviest stage counting", "[plan]") {
  // llama-tiny (4 layers, 4 heads, 2 kv heads, global batch 16) on 3 GPUs: keel train runs pp=3
  // (2 + 1 + 1 layers), so the plan offers it.
  const RunConfig cfg = shipped("llama-tiny.json");
  PlanOptions opt;
  opt.gpus = 3;
  const PlanResult r = plan_all(cfg, opt);
  const auto pp3 = std::find_if(r.ranked.begin(), r.ranked.end(), [](const LayoutPlan& p) { return p.layout.pp == 3; });
  REQUIRE(pp3 != r.ranked.end());
  REQUIRE(pp3->stages.size() == 3);
  CHECK(pp3->stages[0].span.layers() == 2);
  CHECK(pp3->stages[1].span.layers() == 1);
  CHECK(pp3->stages[2].span.layers() == 1);
  CHECK(pp3->stages[0].layer_params == 2 * pp3->stages[1].layer_params);
  double heaviest = 0;
  for (const StageMemory& st : pp3->stages) heaviest = std::max(heaviest, st.total(pp3->recompute));
  CHECK(pp3->peak_bytes == heaviest);
  // tp=3 breaks the node rule and the model's: both are named.
  bool tp3_named = false;
  for (const Rejection& x : r.rejected)
    if (x.layout.tp == 3) {
      CHECK_THAT(x.reason, Catch::Contains("does not divide the 8 GPUs of a node") &&
                               Catch::Contains("heads 4 not divisible by tp=3"));
      tp3_named = true;
    }
  CHECK(tp3_named);
  // Pinned to dp=3, only the global batch stands in the way: the closest changes say which fit.
  PlanOptions dp3 = opt;
  dp3.tp = 1, dp3.pp = 1;
  REQUIRE(plan_all(cfg, dp3).ranked.empty());
  const std::vector<Alternative> alts = alternatives(cfg, dp3);
  REQUIRE(alts.size() >= 2);
  CHECK(alts[0].change == "train.global_batch 15");
  CHECK(alts[0].global_batch == 15);
  CHECK(alts[0].best.layout.dp == 3);
  CHECK(alts[1].change == "train.global_batch 18");
}

TEST_CASE("plan: parallel.pipeline_layers cuts the stages the user's way, and a stage without layers holds no layer's "
          "buffers",
          "[plan][pipeline]") {
  auto spans = stage_spans(8, 4, PipelineSplit{false, {0, 3, 4, 1}});
  REQUIRE(spans.size() == 4);
  CHECK((spans[0].layers() == 0 && spans[0].has_embedding && !spans[0].has_head));
  CHECK((spans[1].first_layer == 0 && spans[1].end_layer == 3));
  CHECK((spans[2].first_layer == 3 && spans[2].end_layer == 7));
  CHECK((spans[3].first_layer == 7 && spans[3].end_layer == 8 && spans[3].has_head));
  CHECK(stage_spans(8, 2, PipelineSplit{false, {0, 3, 4, 1}}).empty());  // not one count per stage
  CHECK(stage_spans(8, 4, PipelineSplit{false, {2, 0, 3, 3}}).empty());  // a middle stage with nothing

  // The 1B Llama's 16 layers over pp=4, the head's stage lighter, on the GPU's default attention.
  const RunConfig cfg = shipped("llama-1b.json");
  PlanOptions opt;
  opt.memory = keel_memory_model(cfg.precision.mode);
  opt.memory.gpu_attention = AttentionSettings{};
  opt.pipeline_layers = {5, 4, 4, 3};
  const Layout l{1, 4, 1, 2};
  REQUIRE(layout_problem(cfg, l, opt).empty());
  const LayoutPlan p = plan_layout(cfg, l, opt);
  REQUIRE(p.stages.size() == 4);
  for (size_t s = 0; s < 4; ++s) CHECK(p.stages[s].span.layers() == opt.pipeline_layers[s]);
  CHECK_THAT(layout_text(cfg, p, opt), Catch::Contains("layers per stage [5,4,4,3] (parallel.pipeline_layers)"));
  CHECK(layout_json(p)["pipeline_layers"] == nlohmann::json{5, 4, 4, 3});
  // Other stage counts are refused naming the field; the search plans only layouts of 4 stages.
  CHECK(layout_problem(cfg, Layout{1, 2, 2, 2}, opt) == "parallel.pipeline_layers gives 4 stages their layers, not pp=2");
  PlanOptions short_by_one = opt;  // (keel plan --pipeline-layers is not checked by the config)
  short_by_one.pipeline_layers = {5, 4, 4, 2};
  CHECK(layout_problem(cfg, l, short_by_one) ==
        "parallel.pipeline_layers [5,4,4,2] does not split the 16 layers (the counts add up to them, with one or more "
        "on every stage but the first and last)");
  short_by_one.pipeline_layers = {15};
  CHECK(!layout_problem(cfg, Layout{1, 1, 4, 2}, short_by_one).empty());  // one stage too
  opt.gpus = 8;
  opt.virtual_stages = 0;  // auto: pp=2 with 2 chunks also has 4 virtual stages
  const PlanResult r = plan_all(cfg, opt);
  REQUIRE(!r.ranked.empty());
  bool two_by_two = false;
  for (const LayoutPlan& lp : r.ranked) {
    CHECK(lp.layout.pp * lp.virtual_stages == 4);
    two_by_two = two_by_two || lp.layout.pp == 2;
  }
  CHECK(two_by_two);
  bool refused_pp8 = false;
  for (const Rejection& rej : r.rejected)
    refused_pp8 = refused_pp8 || (rej.layout.pp == 8 && rej.reason.find("parallel.pipeline_layers gives 4 stages") == 0);
  CHECK(refused_pp8);

  // A first stage that holds only the embedding keeps a stage output and the token ids per
  // micro-batch in flight and the residual stream's gradients, but no layer's gradient buffers
  // and no attention scratch (the trainer allocates neither there: test/multirank checks rank 0's
  // peak against this).
  opt.virtual_stages = 1;
  opt.pipeline_layers = {0, 6, 6, 4};
  const LayoutPlan e = plan_layout(cfg, l, opt);
  const Activations act = activation_bytes(cfg.model, opt.memory, 1, 2, cfg.train.seq_len, false,
                                           cfg.train.logits_chunk_rows);
  const StageMemory& s0 = e.stages[0];
  CHECK(s0.act_full == static_cast<double>(s0.in_flight) * (act.stage_output + act.token_ids) + act.backward_scratch);
  const double attention = static_cast<double>(attention_backward_scratch_bytes(
      AttentionSettings{}, 2, cfg.train.seq_len, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.head_dim()));
  REQUIRE(attention > 0);
  CHECK(e.stages[1].overhead - s0.overhead == attention);
  CHECK(e.stages[1].act_full - e.stages[1].in_flight * (act.stage_output + 6 * (act.per_layer_full + act.attn_scores)) ==
        act.backward_scratch + act.layer_backward_scratch);

  // keel plan --pipeline-layers replaces the config's split; bad lists are refused naming the flag.
  const std::string tiny = std::string(KEEL_SOURCE_DIR) + "/configs/llama-tiny.json";
  const test::ProcessResult text =
      test::run_keel("plan --config " + tiny + " --cpu --gpus 4 --tp 1 --pp 4 --dp 1 --pipeline-layers 0,2,2,0");
  INFO(text.output);
  CHECK(text.code == 0);
  CHECK_THAT(text.output, Catch::Contains("layers per stage [0,2,2,0] (parallel.pipeline_layers)") &&
                              Catch::Contains("emb + none"));
  // (CLI11 splits the list and keel's integer check takes each count, naming the flag)
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"0,2,x,0", "--pipeline-layers: 'x' is not an integer"},
           {"0,2,-2,4", "--pipeline-layers: -2 must be an integer in [0, 1048576]"},
           {"0,,4,0", "parallel.pipeline_layers gives 3 stages their layers, not pp=4"}}) {  // an empty item is no count
    const test::ProcessResult r =
        test::run_keel("plan --config " + tiny + " --gpus 4 --tp 1 --pp 4 --dp 1 --pipeline-layers " + bad);
    INFO(r.output);
    CHECK(r.code != 0);
    CHECK_THAT(r.output, Catch::Contains(why));
  }
  const test::ProcessResult both =
      test::run_keel("plan --config " + tiny + " --gpus 4 --pipeline-layers 1,1,1,1 --embedding-slot");
  CHECK(both.code != 0);
  CHECK_THAT(both.output, Catch::Contains("--pipeline-layers and --embedding-slot both choose the pipeline split"));
}

TEST_CASE("plan: a pipeline whose head stage is slowest is told the split that evens it", "[plan][pipeline]") {
  // The 1B Llama's 128K-vocabulary head costs its stage about as much as 3-4 layers: over pp=4
  // the even split (4 layers each) waits on the last stage at every micro-batch.
  const RunConfig cfg = shipped("llama-1b.json");
  PlanOptions opt;
  opt.gpus = 8, opt.tp = 1, opt.pp = 4, opt.mbs = 4;
  const PlanResult r = plan_all(cfg, opt);
  REQUIRE(r.ranked.size() == 1);
  const LayoutPlan& p = r.ranked[0];
  REQUIRE(p.stage_seconds.size() == 4);
  CHECK(std::max_element(p.stage_seconds.begin(), p.stage_seconds.end()) - p.stage_seconds.begin() == 3);
  REQUIRE(p.balance);
  const std::vector<int>& split = p.balance->layers;
  CHECK(std::accumulate(split.begin(), split.end(), 0) == 16);
  CHECK(split.back() < 4);
  // The suggestion is the plan of that split, which is faster and fits ...
  PlanOptions with = opt;
  with.pipeline_layers = split;
  const LayoutPlan q = plan_layout(cfg, p.layout, with);
  CHECK(q.time.step_s == p.balance->step_s);
  CHECK(q.peak_bytes == p.balance->peak_bytes);
  CHECK(q.fits);
  CHECK(q.time.step_s < 0.99 * p.time.step_s);
  const double slowest = *std::max_element(q.stage_seconds.begin(), q.stage_seconds.end());
  CHECK(slowest < *std::max_element(p.stage_seconds.begin(), p.stage_seconds.end()));
  // ... no single layer moved elsewhere paces it faster (each stage is linear in its layers) ...
  for (size_t a = 0; a < 4; ++a)
    for (size_t b = 0; b < 4; ++b) {
      if (a == b || split[a] == 0 || (split[a] == 1 && a != 0 && a != 3)) continue;
      std::vector<double> t = q.stage_seconds;
      t[a] -= q.layer_seconds, t[b] += q.layer_seconds;
      INFO("a layer from stage " << a << " to " << b);
      CHECK(*std::max_element(t.begin(), t.end()) >= slowest * (1 - 1e-12));
    }
  // ... and that split is its own balance.
  CHECK(!balance_pipeline(cfg, q, with));
  CHECK_THAT(layout_text(cfg, p, opt), Catch::Contains("parallel.pipeline_layers " + nlohmann::json(split).dump() +
                                                       " evens them: estimated step"));
  const nlohmann::json j = layout_json(p);
  CHECK(j["pipeline_balance"]["pipeline_layers"] == nlohmann::json(split));
  CHECK(j["stage_seconds"].size() == 4);

  // BLOOM 200B at tp=8 pp=10: 8 layers a stage, the head's extra under a layer: nothing to move.
  PlanOptions bloom;
  bloom.gpus = 320, bloom.tp = 8, bloom.pp = 10;
  const PlanResult b = plan_all(shipped("bloom-200b.json"), bloom);
  REQUIRE(!b.ranked.empty());
  CHECK(!b.ranked[0].balance);
  CHECK(layout_json(b.ranked[0])["pipeline_balance"].is_null());
  // Interleaved (2 chunks a rank): the ranks are evened, each rank's layers spread over its
  // chunks; the list names every virtual stage in model order, and the model's last one, beside
  // the head, may hold none.
  opt.virtual_stages = 2;
  const PlanResult v = plan_all(cfg, opt);
  REQUIRE(v.ranked.size() == 1);
  const LayoutPlan& iv = v.ranked[0];
  REQUIRE(iv.balance);
  const std::vector<int>& chunks = iv.balance->layers;
  CHECK(chunks == std::vector<int>{2, 2, 2, 1, 3, 3, 3, 0});  // ranks 5, 5, 5, 1: the 1F1B advice's
  PlanOptions vwith = opt;
  vwith.pipeline_layers = chunks;
  const LayoutPlan vq = plan_layout(cfg, iv.layout, vwith);
  CHECK(vq.fits);
  CHECK(vq.time.step_s == iv.balance->step_s);
  CHECK(vq.time.step_s < 0.99 * iv.time.step_s);
  CHECK(!balance_pipeline(cfg, vq, vwith));
}

TEST_CASE("plan: the layers each stage's memory holds, and a split that fits a layout the even split does not",
          "[plan][pipeline]") {
  // The 1B Llama over pp=4 at micro-batch 4 in 16 GiB: under 1F1B stage 0 keeps 4 micro-batches
  // in flight beside the embedding, and the even split (4 layers a stage) does not fit there.
  const RunConfig cfg = shipped("llama-1b.json");
  PlanOptions opt;
  opt.gpus = 8, opt.tp = 1, opt.pp = 4, opt.dp = 2, opt.mbs = 4;
  opt.hw.gpu_mem_bytes = 16 * kGiB;
  opt.recompute = Recompute::Never;
  const Layout l{1, 4, 2, 4};
  const LayoutPlan even = plan_layout(cfg, l, opt);
  REQUIRE(!even.fits);
  CHECK(even.peak_stage == 0);

  // Each cap is the most layers with which the stage's own memory fits: checked by planning
  // splits that give the stage its cap and one more (the other stages take the rest).
  const std::vector<int> caps = pipeline_layer_caps(cfg, l, opt, false);
  REQUIRE(caps.size() == 4);
  CHECK(caps[0] < 4);
  CHECK(caps[1] < caps[2]);  // fewer micro-batches in flight, more layers
  for (int s = 0; s < 4; ++s)
    for (int layers : {caps[s], caps[s] + 1}) {
      if (layers > 16 - 2 || layers < (s == 0 || s == 3 ? 0 : 1)) continue;
      std::vector<int> split(4, 0);
      split[1] = split[2] = 1;
      split[static_cast<size_t>(s)] = layers;
      split[s == 2 ? 1 : 2] += 16 - std::accumulate(split.begin(), split.end(), 0);
      PlanOptions o = opt;
      o.pipeline_layers = split;
      const LayoutPlan q = plan_layout(cfg, l, o);
      INFO("stage " << s << ", split " << nlohmann::json(split).dump());
      CHECK((q.stages[static_cast<size_t>(s)].total(false) <= q.usable_bytes) == (layers == caps[s]));
    }

  // keel plan offers the split that fits, evening the stages' times within those caps.
  const PlanResult r = plan_all(cfg, opt);
  REQUIRE(r.ranked.empty());
  REQUIRE(r.rejected.size() == 1);
  const Rejection& x = r.rejected[0];
  REQUIRE(x.fitting);
  const std::vector<int>& split = x.fitting->layers;
  CHECK(std::accumulate(split.begin(), split.end(), 0) == 16);
  for (size_t s = 0; s < 4; ++s) CHECK(split[s] <= caps[s]);
  CHECK(!x.fitting->recompute);
  PlanOptions with = opt;
  with.pipeline_layers = split;
  const LayoutPlan q = plan_layout(cfg, l, with);
  CHECK(q.fits);
  CHECK(q.time.step_s == x.fitting->step_s);
  CHECK(q.peak_bytes == x.fitting->peak_bytes);
  CHECK_THAT(x.reason, Catch::StartsWith("out of memory: 17.58 GiB on stage 0 > 15.20 GiB usable; fits with "
                                         "parallel.pipeline_layers " + nlohmann::json(split).dump()));
  std::string listed;
  for (int n : split) listed += std::string(listed.empty() ? "" : ",") + std::to_string(n);
  CHECK_THAT(plan_text(cfg, r, opt),
             Catch::Contains("no layout fits 8 GPUs.\n  with a split of its own: tp=1 pp=4 dp=2 mbs=4 runs out of "
                             "memory split as configured, but fits with parallel.pipeline_layers " +
                             nlohmann::json(split).dump()) &&
                 Catch::Contains("(details: keel plan --tp 1 --pp 4 --dp 2 --mbs 4 --pipeline-layers " + listed + ")"));
  const nlohmann::json j = plan_json(cfg, r, opt);
  CHECK(j["rejected"][0]["fitting_split"]["pipeline_layers"] == nlohmann::json(split));
  CHECK(j["rejected"][0]["fitting_split"]["recompute"] == false);

  // Where no split fits (4 GiB: not even the middle stages' single layers), none is offered.
  PlanOptions small = opt;
  small.hw.gpu_mem_bytes = 4 * kGiB;
  const PlanResult none = plan_all(cfg, small);
  REQUIRE(none.rejected.size() == 1);
  CHECK(!none.rejected[0].fitting);
  CHECK(none.rejected[0].reason.find("fits with") == std::string::npos);
  CHECK(plan_text(cfg, none, small).find("split of its own") == std::string::npos);

  // When recomputation is allowed, the even split fits only with it; a split that spares it is
  // the advice, though the even split's stages take about the same time.
  PlanOptions any = opt;
  any.recompute = Recompute::Auto;
  const PlanResult a = plan_all(cfg, any);
  REQUIRE(a.ranked.size() == 1);
  const LayoutPlan& p = a.ranked[0];
  CHECK(p.recompute);
  REQUIRE(p.balance);
  CHECK(!p.balance->recompute);
  CHECK(p.balance->step_s < 0.8 * p.time.step_s);
  CHECK_THAT(layout_text(cfg, p, any), Catch::Contains("without recomputation\n"));
  CHECK(layout_json(p)["pipeline_balance"]["recompute"] == false);

  // A GPU run's measured balance advice takes its caps from the run's own layout and policies;
  // none on the CPU or for an interleaved run.
  const std::string path = std::string(KEEL_SOURCE_DIR) + "/configs/llama-1b.json";
  const std::vector<std::string> sets = {"parallel.tp=1", "parallel.pp=4", "parallel.dp=2", "train.micro_batch=4"};
  const RunConfig run = load_config(path, sets);
  const std::vector<int> run_caps = run_pipeline_layer_caps(run, 16 * kGiB);
  REQUIRE(run_caps.size() == 4);
  CHECK(run_caps[0] < 4);
  CHECK(run_caps[0] < run_caps[1]);
  CHECK(run_pipeline_layer_caps(run, 0).empty());
  std::vector<std::string> interleaved = sets;
  interleaved.push_back("parallel.virtual_stages=2");
  CHECK(run_pipeline_layer_caps(load_config(path, interleaved), 16 * kGiB).empty());
}

TEST_CASE("plan: the detail table shows the peak stage that the verdict names", "[plan]") {
  // 104B at tp=4 pp=16 dp=2 with embedding slots: 66 slots over 16 stages put a fifth slot on
  // stages 7 and 15, and stage 7 (9 micro-batches in flight, 5 layers) is the peak. The table's
  // first, middle (8) and last stages alone would not show the verdict's figure.
  const RunConfig cfg = shipped("bloom-104b.json");
  PlanOptions opt;
  opt.tp = 4, opt.pp = 16, opt.dp = 2, opt.mbs = 1;
  opt.embedding_own_slot = true;
  opt.hw.gpu_mem_bytes = 32 * kGiB;
  const LayoutPlan p = plan_layout(cfg, Layout{4, 16, 2, 1}, opt);
  REQUIRE(p.peak_stage == 7);
  const std::string text = layout_text(cfg, p, opt);
  INFO(text);
  const size_t header = text.find("  per rank");
  REQUIRE(header != std::string::npos);
  CHECK_THAT(text.substr(header, text.find('\n', header) - header), Catch::Contains("stage 7") && Catch::Contains("stage 8"));
  CHECK_THAT(text, Catch::Contains("peak " + format_bytes(p.peak_bytes) + " on stage 7"));
  REQUIRE(p.recompute);
  const size_t row = text.find("  total, full recompute");
  REQUIRE(row != std::string::npos);
  CHECK_THAT(text.substr(row, text.find('\n', row) - row), Catch::Contains(format_bytes(p.peak_bytes)));
}

TEST_CASE("plan: a model too big for its GPUs' memory is told the fewest GPUs that hold it", "[plan]") {
  // Llama 2 7B on 2 GPUs of 24 GiB: 18 B/param needs a split of at least 8 (tp=8, or pp=8 with
  // recomputation). Fewer GPUs cannot help; the closest change is more of them.
  const RunConfig cfg = shipped("llama2-7b.json");
  PlanOptions opt;
  opt.gpus = 2;
  opt.hw.gpu_mem_bytes = 24 * kGiB;
  REQUIRE(plan_all(cfg, opt).ranked.empty());
  const std::vector<Alternative> alts = alternatives(cfg, opt);
  REQUIRE_FALSE(alts.empty());
  CHECK(alts[0].change == "8 GPUs (1 node)");
  CHECK(alts[0].gpus == 8);
  CHECK(alts[0].best.peak_bytes <= 24 * kGiB * 0.95);
  opt.gpus = 4;  // 4 GPUs do not fit either: 4 is no answer
  CHECK(plan_all(cfg, opt).ranked.empty());
  CHECK_THAT(alternatives_text(alts), Catch::Contains("8 GPUs (1 node)"));
}

namespace {

// A TP group of `n` that the Transformer only asks for its size while it allocates.
class SizeOnlyComm final : public parallel::Comm {
 public:
  explicit SizeOnlyComm(int n) : n_(n) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  std::string_view name() const override { return "tp"; }
  Device device() const override { return Device::CPU; }
  void all_reduce(const Tensor&, parallel::ReduceOp) override { fail(); }
  void reduce_scatter(const Tensor&, const Tensor&) override { fail(); }
  void reduce(const Tensor&, int) override { fail(); }
  void all_gather(const Tensor&, const Tensor&) override { fail(); }
  void broadcast(const Tensor&, int) override { fail(); }
  void send(const Tensor&, int) override { fail(); }
  void recv(const Tensor&, int) override { fail(); }
  void sendrecv(const Tensor&, int, const Tensor&, int) override { fail(); }
  void barrier() override { fail(); }

 private:
  [[noreturn]] static void fail() { throw std::logic_error("SizeOnlyComm: no communication in this test"); }
  int n_;
};

}  // namespace

TEST_CASE("plan: the activation list is what the Transformer allocates", "[plan]") {
  // What constructing a Transformer allocates on the CPU backend against the planner's list:
  // one stage and the first of two pipeline stages (two slots in flight); without
  // recomputation, recomputing one of the stage's layers, and all of them; tp=1, and tp=2 with
  // and without sequence parallelism; on the stage with the head, its logits whole and chunked;
  // for GPT-2, Llama and BLOOM's block (the embedding norm's input and stats per slot). The
  // backend's count rounds each allocation up to 64 bytes: a 1% tolerance.
  // bloom: gpt2 + ALiBi + the embedding norm; qwen3: llama + q/k norms (their kept inputs and
  // scratch) with heads of 48 (q 192 wide on a d_model of 128)
  for (const char* family : {"gpt2", "llama", "bloom", "qwen3"}) {
    const bool bloom = std::string(family) == "bloom", qwen3 = std::string(family) == "qwen3";
    nlohmann::json j = test::tiny_run_json(bloom ? "gpt2" : qwen3 ? "llama" : family);
    if (bloom) {
      j["model"]["position_embedding"] = "alibi";
      j["model"]["embedding_norm"] = true;
    }
    j["model"]["d_model"] = 128;
    j["model"]["n_layers"] = 4;
    j["model"]["n_heads"] = 4;
    const bool llama = j["model"]["family"] == "llama";
    j["model"]["n_kv_heads"] = llama ? 2 : 4;
    j["model"]["ffn_hidden"] = llama ? 256 : 512;
    if (qwen3) {
      j["model"]["qk_norm"] = true;
      j["model"]["head_dim"] = 48;
    }
    j["model"]["vocab_size"] = 512;
    j["model"]["max_seq_len"] = 64;
    j["train"]["seq_len"] = 64;
    j["train"]["micro_batch"] = 8;
    j["train"]["global_batch"] = 32;  // 4 micro-batches: stage 0 of pp=2 holds 2
    j["precision"]["mode"] = "bf16";
    const RunConfig cfg = test::make_config(j);
    for (int tp : {1, 2})
      for (bool sp : {false, true}) {
        if (tp == 1 && sp) continue;
        SizeOnlyComm tp_comm(tp);
        for (int pp : {1, 2}) {
          ModelShard shard = pipeline_stage(cfg.model, pp, 0, {});
          shard.tp_size = tp;
          const ParamTable table(cfg.model, shard);
          const int stage_layers = 4 / pp;
          for (int recompute : {0, 1, stage_layers})
            for (bool selective : {false, true})
              for (int64_t chunk : {int64_t{0}, int64_t{100}}) {
                if (chunk > 0 && pp > 1) continue;  // the chunked head: on the stage holding the head
                INFO(family << " tp=" << tp << (sp ? " sequence parallel" : "") << " pp=" << pp
                            << " stage 0, recompute_layers " << recompute << (selective ? ", selective" : "")
                            << ", logits_chunk_rows " << chunk);
                CpuBackend be;
                auto model = std::make_unique<Transformer>(table, be, DType::BF16, 8, 64, pp, tp > 1 ? &tp_comm : nullptr,
                                                           RecomputePolicy{recompute, selective}, sp, chunk);
                REQUIRE(model->sequence_parallel() == sp);
                REQUIRE(model->head_chunked() == (chunk > 0));
                REQUIRE(model->selective_recompute() == (selective && recompute < stage_layers));
                const double allocated = double(be.used_bytes());
                PlanOptions opt;
                opt.recompute_layers = recompute == stage_layers ? 0 : recompute;  // 0: all
                opt.selective = selective;
                opt.sequence_parallel = sp;
                opt.logits_chunk_rows = chunk;
                const LayoutPlan p = plan_layout(cfg, Layout{tp, pp, 1, 8}, opt);
                REQUIRE(p.stages[0].in_flight == pp);
                const double planned = recompute == 0 ? p.stages[0].act_full : p.stages[0].act_recompute;
                CHECK(planned == Approx(allocated).epsilon(0.01));
                // The scratch set is one layer's intermediates: recomputation saves memory only when
                // it replaces more than one layer's (several layers, or several slots).
                if (!selective && recompute * pp > 1) CHECK(p.stages[0].act_recompute < p.stages[0].act_full);
                if (!selective && recompute * pp == 1) CHECK(p.stages[0].act_recompute == Approx(p.stages[0].act_full));
                if (selective) {  // several layers' or slots' three tensors against one scratch pair
                  PlanOptions kept = opt;
                  kept.selective = false;
                  CHECK(p.stages[0].act_full < plan_layout(cfg, Layout{tp, pp, 1, 8}, kept).stages[0].act_full);
                }
              }
        }
      }
  }
  // Sequence parallelism shrinks what TP replicates: at tp=8 on the 200B shape, the first
  // stage's activations fall to well under half.
  const RunConfig big = shipped("bloom-200b.json");
  PlanOptions opt;
  const double plain = plan_layout(big, Layout{8, 10, 4, 1}, opt).stages[0].act_full;
  opt.sequence_parallel = true;
  const double split = plan_layout(big, Layout{8, 10, 4, 1}, opt).stages[0].act_full;
  CHECK(split < 0.5 * plain);
}

TEST_CASE("plan: activation memory follows 1F1B and recomputation", "[plan]") {
  const RunConfig cfg = shipped("bloom-200b.json");
  PlanOptions opt;
  const LayoutPlan p = plan_layout(cfg, Layout{8, 10, 4, 1}, opt);
  // Stage s holds pp - s micro-batches: the first stage the most, the last one.
  for (const auto& s : p.stages) CHECK(s.in_flight == 10 - s.stage);
  // Kept per micro-batch in flight: the layer inputs (bf16) and the stage's own buffers.
  const Activations a = activation_bytes(model_for_tp(cfg.model, 8), keel_memory_model(PrecisionMode::BF16), 8, 1, 2048);
  CHECK(a.per_layer_input == 2048.0 * 14400 * 2);
  CHECK(p.stages[0].act_stored_recompute == Approx(10 * (8 * a.per_layer_input + a.stage_output + a.token_ids)));
  CHECK(p.stages[9].act_stored_recompute ==
        Approx(1 * (8 * a.per_layer_input + a.stage_output + 2 * a.token_ids + a.head)));
  for (const auto& s : p.stages) CHECK(s.act_recompute < s.act_full);
  // Doubling the micro-batch doubles every activation (all are per token here).
  const LayoutPlan p2 = plan_layout(cfg, Layout{8, 10, 4, 2}, opt);
  CHECK(p2.stages[0].act_full == Approx(2 * p.stages[0].act_full));
  // ZeRO-1: the sharded part of the state shrinks with dp, the rest does not.
  const LayoutPlan p8 = plan_layout(cfg, Layout{8, 10, 8, 1}, opt);
  CHECK(p8.stages[0].weights == p.stages[0].weights);
  CHECK(p8.stages[0].grads == p.stages[0].grads);
  CHECK(p8.stages[0].master == Approx(p.stages[0].master / 2));
  CHECK(p8.stages[0].moments == Approx(p.stages[0].moments / 2));
  CHECK(p.bubble == Approx(9.0 / (512 + 9)));
}

TEST_CASE("plan: the interleaved pipeline's chunks, activations and bubble", "[plan]") {
  // bloom-200b: 80 layers, tp=8 pp=10 dp=4: m = 512 micro-batches. With 2 chunks per rank the
  // layers are cut into 20 spans of 4; rank s holds spans s and s + 10.
  const RunConfig cfg = shipped("bloom-200b.json");
  PlanOptions opt;
  const LayoutPlan one = plan_layout(cfg, Layout{8, 10, 4, 1}, opt);
  opt.virtual_stages = 2;
  REQUIRE(layout_problem(cfg, Layout{8, 10, 4, 1}, opt).empty());
  const LayoutPlan two = plan_layout(cfg, Layout{8, 10, 4, 1}, opt);
  REQUIRE(two.stages.size() == 10);
  const StageMemory& r0 = two.stages[0];
  REQUIRE(r0.chunks.size() == 2);
  CHECK((r0.chunks[0].first_layer == 0 && r0.chunks[0].end_layer == 4 && r0.chunks[0].has_embedding));
  CHECK((r0.chunks[1].first_layer == 40 && r0.chunks[1].end_layer == 44 && !r0.chunks[1].has_head));
  CHECK(two.stages[9].chunks[1].has_head);
  // Same parameters per rank as without interleaving (8 layers each, embedding / head alike).
  for (int s = 0; s < 10; ++s) CHECK(two.stages[size_t(s)].params == one.stages[size_t(s)].params);
  // In flight: what the run's schedules need, chunk by chunk, as the trainer allocates it. The
  // config ramps the batch up from 16 samples by 16 (4, 8, ..., 508 micro-batches at dp=4 before
  // the whole 512). A small step's larger groups (28 micro-batches in two groups of 14) would
  // keep 28 in flight on rank 0's first chunk; its capped order (pipeline_step_schedule) stays
  // within the whole batch's 22.
  const PipeSlots slots = pipeline_slots(10, 2, cfg.step_micro_batch_counts(1, 4));
  for (int s = 0; s < 10; ++s)
    for (int c = 0; c < 2; ++c)
      CHECK(two.stages[size_t(s)].chunk_in_flight[size_t(c)] == slots.activation[size_t(s)][size_t(c)]);
  CHECK(pipeline_schedule(10, 2, 28, true).activation_slots[0][0] == 28);
  CHECK(pipeline_schedule(10, 2, 512, true).activation_slots[0][0] == 22);
  CHECK(r0.chunk_in_flight[0] == 22);
  // Half-size chunks, but more of them in flight on the first rank: more activation memory
  // there (the price of the shorter bubble), while the bubble halves.
  CHECK(r0.act_full > one.stages[0].act_full);
  CHECK(two.bubble == Approx(9.0 / (2 * 512 + 9)));
  CHECK(two.comm.pp > one.comm.pp);
  // Layers that do not divide into pp * virtual_stages spans are spread as the trainer spreads
  // them; only more spans than layers are a layout problem.
  opt.virtual_stages = 3;
  CHECK(layout_problem(cfg, Layout{8, 10, 4, 1}, opt).empty());
  // 30 spans: the first 20 of 3 layers, the last 10 of 2; rank 0 holds spans 0, 10 and 20.
  CHECK(plan_layout(cfg, Layout{8, 10, 4, 1}, opt).stages[0].span.layers() == 3 + 3 + 2);
  opt.virtual_stages = 9;
  CHECK_THAT(layout_problem(cfg, Layout{8, 10, 4, 1}, opt),
             Catch::Contains("pp*virtual_stages=90 stages for 80 layers (each needs at least one)"));
}

TEST_CASE("plan: an overlapped DP gradient reduction hides behind the last backward, down to one group's share",
          "[plan][overlap]") {
  // GPT-2 124M at dp=64 over 8 nodes (one micro-batch per step: the gradients' reduce-scatter,
  // 0.47 GB at 12.5 GB/s, is most of the step's DP time) and the 1B Llama at dp=8 in one node:
  // in both the last backward is longer than the reduction, so what stays is its floor, the
  // share of the group finished last (1 of layers + 1), plus the weights' all-gather.
  for (const auto& [name, layout] : std::vector<std::pair<std::string, Layout>>{{"gpt2-124m.json", Layout{1, 1, 64, 8}},
                                                                                {"llama-1b.json", Layout{1, 1, 8, 1}}}) {
    INFO(name);
    const RunConfig cfg = shipped(name);
    PlanOptions opt;
    const LayoutPlan plain = plan_layout(cfg, layout, opt);
    opt.overlap_grad_reduce = true;
    const LayoutPlan overlapped = plan_layout(cfg, layout, opt);
    CHECK(overlapped.comm.dp == plain.comm.dp);  // the same bytes, at another time
    CHECK(overlapped.time.compute_s == plain.time.compute_s);
    CHECK(overlapped.time.dp_comm_s < plain.time.dp_comm_s);
    CHECK(overlapped.time.step_s == Approx(plain.time.step_s - (plain.time.dp_comm_s - overlapped.time.dp_comm_s)));
    // The weights' all-gather plus one group's share of the gradients' reduction (the gradients'
    // part of plain's DP time: 4 bytes per parameter against 2 for the gather).
    const double grad_s = plain.time.dp_comm_s * 4.0 / 6.0, gather_s = plain.time.dp_comm_s - grad_s;
    const double groups = static_cast<double>(cfg.model.n_layers) + 1;
    CHECK(overlapped.time.dp_comm_s == Approx(gather_s + grad_s / groups).epsilon(1e-9));
  }
  // Without DP there is nothing to overlap.
  const RunConfig cfg = shipped("gpt2-124m.json");
  PlanOptions opt;
  const LayoutPlan plain = plan_layout(cfg, Layout{1, 1, 1, 8}, opt);
  opt.overlap_grad_reduce = true;
  CHECK(plan_layout(cfg, Layout{1, 1, 1, 8}, opt).time.step_s == plain.time.step_s);
}

TEST_CASE("plan: an overlapped DP weight gather hides behind the next forward, down to its first bucket",
          "[plan][overlap]") {
  // The 1B Llama at dp=8 in one node: one micro-batch's forward (about a third of the step's
  // compute) outlasts the gather of 2.5 GB, so what stays is the first bucket's share: 40M of
  // the rank's 1.24B weights by default, 200M with grad_bucket_size 200M.
  const RunConfig cfg = shipped("llama-1b.json");
  const Layout layout{1, 1, 8, 1};
  PlanOptions opt;
  const LayoutPlan plain = plan_layout(cfg, layout, opt);
  const double grad_s = plain.time.dp_comm_s * 4.0 / 6.0, gather_s = plain.time.dp_comm_s - grad_s;
  const double params = static_cast<double>(plain.stages[0].params);
  opt.overlap_param_gather = true;
  for (int64_t bucket : {int64_t{0}, int64_t{200'000'000}}) {
    INFO("bucket " << bucket);
    opt.grad_bucket_size = bucket;
    const LayoutPlan overlapped = plan_layout(cfg, layout, opt);
    CHECK(overlapped.comm.dp == plain.comm.dp);  // the same bytes, at another time
    CHECK(overlapped.time.compute_s == plain.time.compute_s);
    const double first = static_cast<double>(bucket > 0 ? bucket : 40'000'000) / params;
    CHECK(overlapped.time.dp_comm_s == Approx(grad_s + gather_s * first).epsilon(1e-9));
    CHECK(overlapped.time.step_s == Approx(plain.time.step_s - (plain.time.dp_comm_s - overlapped.time.dp_comm_s)));
    CHECK_THAT(layout_text(cfg, overlapped, opt, true), Catch::Contains(" with the weight gather overlapped), "));
  }
  CHECK_THAT(layout_text(cfg, plain, PlanOptions{}, true), !Catch::Contains("overlapped"));
  // A bucket of everything: nothing moves ahead of its need.
  opt.grad_bucket_size = int64_t{1} << 40;
  CHECK(plan_layout(cfg, layout, opt).time.dp_comm_s == Approx(plain.time.dp_comm_s).epsilon(1e-12));
  // Without DP there is nothing to overlap.
  opt.grad_bucket_size = 0;
  const Layout single{1, 1, 1, 8};
  CHECK(plan_layout(cfg, single, opt).time.step_s == plan_layout(cfg, single, PlanOptions{}).time.step_s);
}

TEST_CASE("plan: --virtual-stages auto gives each pipeline layout its fastest chunk count", "[plan]") {
  // bloom-104b (64 layers) on 128 GPUs with a global batch of only 64: few micro-batches per
  // step, where the 1F1B bubble is long and interleaving pays.
  RunConfig cfg = shipped("bloom-104b.json");
  cfg.train.global_batch = 64;
  PlanOptions fixed;
  fixed.gpus = 128;
  PlanOptions search = fixed;
  search.virtual_stages = 0;
  const PlanResult plain = plan_all(cfg, fixed), best = plan_all(cfg, search);
  REQUIRE(!plain.ranked.empty());
  REQUIRE(!best.ranked.empty());
  // The same layouts are feasible (v = 1 is always a candidate); each is at least as fast.
  CHECK(best.ranked.size() == plain.ranked.size());
  for (const LayoutPlan& p : best.ranked) {
    const Layout& l = p.layout;
    INFO(l.str() << " v=" << p.virtual_stages);
    if (l.pp == 1) CHECK(p.virtual_stages == 1);
    CHECK(p.virtual_stages <= kMaxAutoVirtualStages);
    CHECK(l.pp * p.virtual_stages <= cfg.model.n_layers);  // every chunk holds a layer
    // What plan_layout gives for that count, and no other count of the search is faster.
    PlanOptions at = fixed;
    at.virtual_stages = p.virtual_stages;
    CHECK(plan_layout(cfg, l, at).time.step_s == p.time.step_s);
    for (int64_t v = 1; v <= kMaxAutoVirtualStages; ++v) {
      at.virtual_stages = v;
      if (l.pp == 1 || !layout_problem(cfg, l, at).empty()) continue;
      const LayoutPlan other = plan_layout(cfg, l, at);
      if (other.fits) CHECK(other.time.step_s >= p.time.step_s);
    }
  }
  // Here the fastest layout interleaves, and beats the fastest plain 1F1B layout.
  CHECK(best.ranked.front().virtual_stages > 1);
  CHECK(best.ranked.front().time.step_s < plain.ranked.front().time.step_s);
  WARN("104B, 128 GPUs, global batch 64: " << best.ranked.front().layout.str() << " v="
                                            << best.ranked.front().virtual_stages << " "
                                            << best.ranked.front().time.step_s << " s/step vs "
                                            << plain.ranked.front().layout.str() << " "
                                            << plain.ranked.front().time.step_s << " s/step without interleaving");
  // The table shows the chunk count.
  const std::string text = plan_text(cfg, best, search, 5, false);
  CHECK_THAT(text, Catch::Contains("#  tp  pp  v  dp") && Catch::Contains("v: model chunks per pipeline rank"));
  CHECK_THAT(plan_text(cfg, plain, fixed, 5, false), !Catch::Contains("v: model chunks"));
}

// ---------------------------------------------------------------------------------------------
// the BLOOM 200B benchmark tables (seed 001, "A100 experiments", Feb 2022, 8 x A100 80GB nodes)

namespace {

enum class Era {
  Fp16,       // up to 02-27: Megatron-DeepSpeed, half-precision gradients, ZeRO-1
  Bf16Optim,  // 02-28: the new BF16 optimizer (fp32 gradient accumulation, unsharded) and
              // --pp-partition-method 'type:transformer|embedding' (embedding in its own slot)
};

struct SeedRun {
  const char* table;  // where in seed 001 the row is
  int h, layers, heads;
  int64_t dp, tp, pp, mbs, gbs;
  const char* mem;  // the Mem column as written: "47GB" (nvidia-smi, read as thousands of MiB), "OOM", "" none
  double sec_it;    // 0: not measured
  Era era = Era::Fp16;
  bool own_slot = false;
  bool zero1 = true;
};

// Layers are the seed's where given; for the 02-20 table (NHIDDEN=14400, sizes only) they are
// inferred from the size column and PP: 200B = 80, 194B = 78, 191B = 77, 205B = 81, 195B = 77,
// 183B = 72 (l*(12h^2+13h) + 250880 h; 194B/191B are not exact: the first stage holds 13 / 11
// blocks either way). Heads: 96 for the 14400/13824 runs of 02-17..02-20 (the 200B script of
// 02-17), 64 from 02-21 on ("all NHEADS=64 (above too)") unless the row says otherwise.
// Rows whose layers do not divide PP (78 layers over PP=12, 02-26) are left out: keel does
// not split layers unevenly.
const SeedRun kSeedRuns[] = {
    // "Best TFLOPs", fp16, 02-17
    {"02-17 best TFLOPs fp16", 14400, 8, 32, 1, 8, 1, 1, 2048, "67GB", 769.99},
    {"02-17 best TFLOPs fp16", 14400, 80, 96, 1, 8, 10, 1, 2048, "73GB", 844.81},
    {"02-17 best TFLOPs fp16", 14400, 80, 96, 2, 8, 10, 1, 2048, "51GB", 430.21},
    // "Choosing the fastest 3D Topology", 02-20
    {"02-20 choosing 3D topology", 14400, 80, 96, 12, 8, 4, 1, 2040, "47GB", 189.06},
    {"02-20 choosing 3D topology", 14400, 80, 96, 9, 8, 5, 1, 2043, "44GB", 208.40},
    {"02-20 choosing 3D topology", 14400, 78, 96, 8, 8, 6, 1, 2048, "39GB", 183.64},
    {"02-20 choosing 3D topology", 14400, 77, 96, 6, 8, 7, 1, 2046, "39GB", 202.99},
    {"02-20 choosing 3D topology", 14400, 80, 96, 6, 8, 8, 1, 2046, "36GB", 185.75},
    {"02-20 choosing 3D topology", 14400, 81, 96, 5, 8, 9, 1, 2045, "37GB", 199.14},
    {"02-20 choosing 3D topology", 14400, 80, 96, 4, 8, 10, 1, 2048, "35GB", 221.21},
    {"02-20 choosing 3D topology", 14400, 77, 96, 4, 8, 11, 1, 2048, "32GB", 197.15},
    {"02-20 choosing 3D topology", 14400, 72, 96, 4, 8, 12, 1, 2048, "30GB", 172.40},
    // same section, the MBS tables
    {"02-20 MBS, PP=6", 14400, 78, 96, 8, 8, 6, 2, 2048, "45GB", 172.36},
    {"02-20 MBS, PP=6", 14400, 78, 96, 8, 8, 6, 4, 2048, "56GB", 173.92},
    {"02-20 MBS, PP=6", 14400, 78, 96, 8, 8, 6, 8, 2048, "75GB", 192.42},
    {"02-20 MBS, PP=10", 14400, 80, 96, 4, 8, 10, 2, 2048, "43GB", 207.92},
    {"02-20 MBS, PP=10", 14400, 80, 96, 4, 8, 10, 4, 2048, "55GB", 208.18},
    {"02-20 MBS, PP=10 (too close to OOM)", 14400, 80, 96, 4, 8, 10, 8, 2048, "76GB", 229.69},
    {"02-20 MBS, PP=11", 14400, 77, 96, 4, 8, 11, 2, 2048, "41GB", 186.65},
    {"02-20 MBS, PP=11", 14400, 77, 96, 4, 8, 11, 4, 2048, "53GB", 185.79},
    {"02-20 MBS, PP=11", 14400, 77, 96, 4, 8, 11, 8, 2048, "75GB", 206.62},
    {"02-20 MBS, PP=12", 14400, 72, 96, 4, 8, 12, 2, 2048, "39GB", 161.96},
    {"02-20 MBS, PP=12", 14400, 72, 96, 4, 8, 12, 4, 2048, "50GB", 163.32},
    // "tile and wave quantization", 02-20
    {"02-20 tile/wave 13824", 13824, 80, 96, 4, 8, 10, 1, 2048, "33GB", 160.29},
    {"02-20 tile/wave 13824", 13824, 80, 96, 4, 8, 10, 2, 2048, "39GB", 151.07},
    {"02-20 tile/wave 13824", 13824, 80, 96, 4, 8, 10, 4, 2048, "53GB", 147.43},
    {"02-20 tile/wave 13824", 13824, 80, 96, 4, 8, 10, 8, 2048, "73GB", 152.51},
    // "48 node contenders", 02-21, NHIDDEN=14336 / NLAYERS=72
    {"02-21 48 node contenders", 14336, 72, 64, 4, 8, 12, 1, 2048, "29GB", 143.31},
    {"02-21 48 node contenders", 14336, 72, 64, 4, 8, 12, 2, 2048, "37GB", 134.02},
    {"02-21 48 node contenders", 14336, 72, 64, 4, 8, 12, 4, 2048, "49GB", 123.69},
    {"02-21 48 node contenders", 14336, 72, 64, 4, 8, 12, 8, 2048, "69GB", 129.26},
    {"02-21 48 node contenders", 14336, 72, 64, 8, 8, 6, 1, 2048, "38GB", 139.82},
    {"02-21 48 node contenders", 14336, 72, 64, 8, 8, 6, 2, 2048, "44GB", 131.02},
    {"02-21 48 node contenders", 14336, 72, 64, 8, 8, 6, 4, 2048, "56GB", 121.48},
    // same section, NHIDDEN=13824 / NLAYERS=84 (the PP=6 MBS=2 row reads 65GB, above its MBS=4 56GB)
    {"02-21 contenders 13824x84", 13824, 84, 64, 4, 8, 12, 2, 2048, "39GB", 143.89},
    {"02-21 contenders 13824x84", 13824, 84, 64, 4, 8, 12, 4, 2048, "52GB", 133.12},
    {"02-21 contenders 13824x84", 13824, 84, 64, 8, 8, 6, 2, 2048, "65GB", 141.41},
    {"02-21 contenders 13824x84", 13824, 84, 64, 8, 8, 6, 4, 2048, "56GB", 130.31},
    // same section, one node ("Max possible TFLOPs check", 18B)
    {"02-21 max TFLOPs 1 node", 14336, 6, 64, 1, 8, 1, 2, 512, "54GB", 130.43},
    {"02-21 max TFLOPs 1 node", 14336, 10, 64, 1, 8, 1, 1, 512, "80GB", 205.52},
    // same section, "Trying with ZeRO_STAGE=0/1"
    {"02-21 ZeRO stage 1", 14336, 72, 64, 4, 8, 12, 2, 2048, "37GB", 120.29},
    {"02-21 ZeRO stage 0", 14336, 72, 64, 4, 8, 12, 2, 2048, "72GB", 137.34, Era::Fp16, false, false},
    // "GBS Variations" and "some more configs with lower PP", 02-25, 14336 x 72
    {"02-25 GBS variations", 14336, 72, 64, 8, 8, 6, 4, 1568, "56GB", 113.01},
    {"02-25 GBS variations", 14336, 72, 64, 8, 8, 6, 4, 2048, "55GB", 114.11},
    {"02-25 GBS variations", 14336, 72, 64, 8, 8, 6, 6, 2016, "66GB", 123.57},
    {"02-25 GBS variations", 14336, 72, 64, 4, 8, 12, 4, 1568, "", 92.75},
    {"02-25 GBS variations", 14336, 72, 64, 4, 8, 12, 4, 2048, "49GB", 117.07},
    {"02-25 GBS variations", 14336, 72, 64, 4, 8, 12, 2, 1568, "", 99.93},
    {"02-25 GBS variations", 14336, 72, 64, 4, 8, 12, 2, 2048, "", 128.82},
    {"02-25 lower PP", 14336, 72, 64, 6, 8, 8, 4, 2016, "52GB", 113.16},
    {"02-25 lower PP", 14336, 72, 64, 12, 8, 4, 2, 2016, "53GB", 125.52},
    {"02-25 lower PP", 14336, 72, 64, 12, 8, 4, 4, 2016, "59GB", 114.81},
    {"02-25 lower PP", 14336, 72, 64, 24, 8, 2, 1, 2016, "65GB", 145.45},
    {"02-25 lower PP", 14336, 72, 64, 24, 8, 2, 2, 2016, "76GB", 136.13},
    {"02-25 lower PP", 14336, 72, 64, 48, 8, 1, 1, 2016, "OOM", 0},
    // "Tweaking TP for the first time", 02-25 (the tp=4 pp=12 mbs=2 layout is listed twice)
    {"02-25 tweaking TP", 14336, 72, 64, 8, 4, 12, 4, 2048, "60GB", 111.89},
    {"02-25 tweaking TP", 14336, 72, 64, 8, 4, 12, 2, 2048, "44GB", 110.48},
    {"02-25 tweaking TP", 14336, 72, 64, 8, 4, 12, 2, 2048, "38GB", 113.54},
    {"02-25 tweaking TP", 14336, 72, 64, 16, 4, 6, 4, 2048, "75GB", 117.11},
    {"02-25 tweaking TP", 14336, 72, 64, 16, 4, 6, 2, 2048, "57GB", 111.71},
    {"02-25 tweaking TP", 14336, 72, 64, 16, 2, 12, 2, 2048, "63GB", 112.50},
    {"02-25 tweaking TP", 14336, 72, 64, 32, 2, 6, 2, 2048, "OOM", 0},
    {"02-25 tweaking TP", 14336, 72, 64, 32, 2, 6, 1, 2048, "OOM", 0},
    {"02-25 tweaking TP", 14336, 72, 64, 8, 2, 24, 1, 2048, "44GB", 119.53},
    {"02-25 tweaking TP", 14336, 72, 64, 8, 2, 24, 2, 2048, "53GB", 122.75},
    {"02-25 tweaking TP", 14336, 72, 64, 4, 4, 24, 1, 2048, "", 130.60},
    {"02-25 TP=1 12288x96", 12288, 96, 64, 8, 1, 48, 1, 2048, "58GB", 142.17},
    // "Re-do", 02-27
    {"02-27 re-do 13824x78", 13824, 78, 96, 8, 8, 6, 4, 2048, "59GB", 118.24},
    {"02-27 re-do 13824x78", 13824, 78, 96, 16, 4, 6, 4, 2048, "75GB", 115.55},
    {"02-27 12288x106 emb slots", 12288, 106, 96, 8, 4, 12, 2, 2048, "44GB", 112.69, Era::Fp16, true},
    // "Rebalancing layers", 02-28: BF16 optimizer and embedding slots
    {"02-28 12288x106", 12288, 106, 64, 8, 4, 12, 2, 2048, "67GB", 116.54, Era::Bf16Optim, true},
    {"02-28 12288x106", 12288, 106, 96, 8, 4, 12, 2, 2048, "65GB", 118.79, Era::Bf16Optim, true},
    {"02-28 12288x106", 12288, 106, 128, 8, 4, 12, 2, 2048, "67GB", 121.42, Era::Bf16Optim, true},
    {"02-28 12288x106", 12288, 106, 96, 8, 4, 12, 4, 2048, "79GB", 120.34, Era::Bf16Optim, true},
    {"02-28 12288x100", 12288, 100, 64, 16, 4, 6, 2, 2048, "OOM", 0, Era::Bf16Optim, true},
    {"02-28 12288x100", 12288, 100, 64, 16, 4, 6, 1, 2048, "OOM", 0, Era::Bf16Optim, true},
    {"02-28 12288x100", 12288, 100, 64, 8, 8, 6, 2, 2048, "61GB", 139.72, Era::Bf16Optim, true},
    {"02-28 12288x100", 12288, 100, 64, 8, 8, 6, 4, 2048, "72GB", 120.96, Era::Bf16Optim, true},
    {"02-28 13312x82", 13312, 82, 64, 4, 8, 12, 4, 2048, "52GB", 111.79, Era::Bf16Optim, true},
    {"02-28 13312x82", 13312, 82, 64, 8, 4, 12, 2, 2048, "63GB", 104.45, Era::Bf16Optim, true},
    {"02-28 13312x82", 13312, 82, 104, 8, 4, 12, 2, 2048, "62GB", 123.71, Era::Bf16Optim, true},
    {"02-28 13312x82", 13312, 82, 128, 8, 4, 12, 2, 2048, "60GB", 108.78, Era::Bf16Optim, true},
    {"02-28 13312x82", 13312, 82, 64, 8, 4, 12, 4, 2048, "74GB", 104.82, Era::Bf16Optim, true},
    {"02-28 13312x94", 13312, 94, 128, 8, 4, 12, 2, 2048, "67GB", 124.10, Era::Bf16Optim, true},
    {"02-28 14336x70", 14336, 70, 64, 4, 8, 12, 2, 2048, "40GB", 121.63, Era::Bf16Optim, true},
    {"02-28 14336x70", 14336, 70, 64, 8, 4, 12, 2, 2048, "59GB", 102.03, Era::Bf16Optim, true},
    {"02-28 14336x70", 14336, 70, 112, 8, 4, 12, 2, 2048, "59GB", 104.50, Era::Bf16Optim, true},
    {"02-28 14336x70", 14336, 70, 128, 8, 4, 12, 2, 2048, "60GB", 105.89, Era::Bf16Optim, true},
    {"02-28 14336x70", 14336, 70, 64, 8, 4, 12, 4, 2048, "73GB", 102.27, Era::Bf16Optim, true},
    {"02-28 14336x82", 14336, 82, 128, 8, 4, 12, 2, 2048, "OOM", 0, Era::Bf16Optim, true},
};

// The seed's Mem column: nvidia-smi's MiB read as GB ("47GB" ~ 47,000 MiB), in GiB.
double seed_mem_gib(const SeedRun& r) { return std::atof(r.mem) * 1000.0 / 1024.0; }
bool seed_oom(const SeedRun& r) { return std::string(r.mem) == "OOM"; }
bool seed_has_mem(const SeedRun& r) { return std::atof(r.mem) > 0; }

// The planner set up as the seed's runs were: Megatron-DeepSpeed's memory model for the era,
// full activation recomputation (Megatron-DeepSpeed's --checkpoint-activations; the seed does not
// say so, the measured memory does: without it a 14336-wide layer keeps ~0.46 GiB per micro-batch
// at TP=8 and the first of 12 stages would need ~55 GiB in all at MBS=1, against 28 GiB measured),
// A100 80GB nodes of 8 GPUs.
PlanOptions seed_options(const SeedRun& r) {
  PlanOptions o;
  o.memory = megatron_deepspeed_memory_model(r.era == Era::Bf16Optim);
  o.memory.state.zero1 = r.zero1;
  o.recompute = Recompute::Always;
  o.embedding_own_slot = r.own_slot;
  o.hw.gpus_per_node = 8;
  o.hw.gpu_mem_bytes = 80 * kGiB;
  return o;
}

struct SeedComparison {
  const SeedRun* run;
  LayoutPlan plan;
};

std::vector<SeedComparison> compare_seed_runs() {
  std::vector<SeedComparison> out;
  for (const SeedRun& r : kSeedRuns) {
    const RunConfig cfg = seed_model(r.h, r.layers, r.heads, r.gbs);
    const Layout l{r.tp, r.pp, r.dp, r.mbs};
    const PlanOptions o = seed_options(r);
    INFO(r.table << " " << l.str());
    REQUIRE(layout_problem(cfg, l, o).empty());
    out.push_back({&r, plan_layout(cfg, l, o)});
  }
  return out;
}

// Rows are comparable for speed when they ran the same model on the same day with the same
// global batch (and heads): one group. The ZeRO rows ran on another branch ("need to retest the
// above on the same branch") and are left out of every group.
std::string rank_group(const SeedRun& r) {
  if (r.sec_it <= 0 || std::string(r.table).find("ZeRO") != std::string::npos) return "";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.5s %dx%d h%d gbs%lld", r.table, r.h, r.layers, r.heads, (long long)r.gbs);
  return buf;
}

// 1-based rank of each value (ties share the mean rank).
std::vector<double> ranks_of(const std::vector<double>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    double less = 0, equal = 0;
    for (double x : v) less += x < v[i], equal += x == v[i];
    r[i] = less + (equal + 1) / 2;
  }
  return r;
}

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const auto ra = ranks_of(a), rb = ranks_of(b);
  double ma = 0, mb = 0;
  for (size_t i = 0; i < ra.size(); ++i) ma += ra[i] / ra.size(), mb += rb[i] / rb.size();
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < ra.size(); ++i)
    ab += (ra[i] - ma) * (rb[i] - mb), aa += (ra[i] - ma) * (ra[i] - ma), bb += (rb[i] - mb) * (rb[i] - mb);
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0;
}

struct GroupRanks {
  std::map<const SeedRun*, std::pair<double, double>> rank;  // measured, planned (within the group)
  std::map<std::string, double> rho;                         // Spearman per group
  std::map<std::string, size_t> size;
};

GroupRanks group_ranks(const std::vector<SeedComparison>& rows) {
  std::map<std::string, std::vector<const SeedComparison*>> groups;
  for (const auto& c : rows)
    if (std::string g = rank_group(*c.run); !g.empty()) groups[g].push_back(&c);
  GroupRanks out;
  for (const auto& [g, list] : groups) {
    if (list.size() < 2) continue;
    std::vector<double> measured, planned;
    for (const auto* c : list) measured.push_back(c->run->sec_it), planned.push_back(c->plan.time.step_s);
    const auto rm = ranks_of(measured), rp = ranks_of(planned);
    for (size_t i = 0; i < list.size(); ++i) out.rank[list[i]->run] = {rm[i], rp[i]};
    out.rho[g] = spearman(measured, planned);
    out.size[g] = list.size();
  }
  return out;
}

std::string seed_table_markdown(const std::vector<SeedComparison>& rows) {
  const GroupRanks gr = group_ranks(rows);
  std::string s =
      "| seed table (date) | h x layers | heads | DP | TP | PP | MBS | GBS | seed Mem | planner peak | verdict | "
      "seed s/it | planner s/it | rank seed / planner |\n"
      "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|\n";
  char buf[512];
  for (const auto& c : rows) {
    const SeedRun& r = *c.run;
    std::string mem = *r.mem ? r.mem : "-";
    if (seed_has_mem(r)) mem += (std::snprintf(buf, sizeof buf, " (%.1f GiB)", seed_mem_gib(r)), std::string(buf));
    std::string sec = r.sec_it > 0 ? (std::snprintf(buf, sizeof buf, "%.2f", r.sec_it), std::string(buf)) : "-";
    std::string rank = "-";
    if (auto it = gr.rank.find(&r); it != gr.rank.end())
      rank = (std::snprintf(buf, sizeof buf, "%g / %g", it->second.first, it->second.second), std::string(buf));
    std::snprintf(buf, sizeof buf, "| %s | %dx%d | %d | %lld | %lld | %lld | %lld | %lld | %s | %.1f GiB | %s | %s | %.1f | %s |\n",
                  r.table, r.h, r.layers, r.heads, (long long)r.dp, (long long)r.tp, (long long)r.pp, (long long)r.mbs,
                  (long long)r.gbs, mem.c_str(), c.plan.peak_bytes / kGiB, c.plan.fits ? "fits" : "OOM", sec.c_str(),
                  c.plan.time.step_s, rank.c_str());
    s += buf;
  }
  s += "\nSpearman rank correlation of seconds per iteration, measured vs planned, per group:\n";
  for (const auto& [g, rho] : gr.rho) {
    std::snprintf(buf, sizeof buf, "  %-34s %2zu rows  %+.2f\n", g.c_str(), gr.size.at(g), rho);
    s += buf;
  }
  return s;
}

const SeedRun* find_run(const char* table, int h, int layers, int heads, int64_t dp, int64_t tp, int64_t pp,
                        int64_t mbs, int64_t gbs) {
  for (const SeedRun& r : kSeedRuns)
    if (std::string(r.table).rfind(table, 0) == 0 && r.h == h && r.layers == layers && r.heads == heads &&
        r.dp == dp && r.tp == tp && r.pp == pp && r.mbs == mbs && r.gbs == gbs)
      return &r;
  return nullptr;
}

}  // namespace

// The comparison table of the notes: one row per transcribed seed run, with the planner's
// verdict. KEEL_PRINT_SEED_TABLE=1 prints it (test_train "[plan-seed-table]").
TEST_CASE("plan: seed 200B benchmark rows against the planner, as a table", "[plan][plan-seed-table]") {
  const auto rows = compare_seed_runs();
  const std::string table = seed_table_markdown(rows);
  int lines = 0, fits = 0, oom = 0;
  for (size_t at = 0; (at = table.find("\n| ", at)) != std::string::npos; ++at) ++lines;
  for (const auto& c : rows) (c.plan.fits ? fits : oom) += 1;
  CHECK(lines == static_cast<int>(rows.size()));  // one table line per run after the header
  CHECK(rows.size() >= 85);
  // Every verdict in the table is the planner's.
  size_t n_fits = 0, n_oom = 0;
  for (size_t at = 0; (at = table.find("GiB | fits |", at)) != std::string::npos; ++at) ++n_fits;
  for (size_t at = 0; (at = table.find("GiB | OOM |", at)) != std::string::npos; ++at) ++n_oom;
  CHECK(static_cast<int>(n_fits) == fits);
  CHECK(static_cast<int>(n_oom) == oom);
  if (std::getenv("KEEL_PRINT_SEED_TABLE")) std::printf("%s", table.c_str());
}

TEST_CASE("plan: seed 200B runs, memory: verdicts and size", "[plan]") {
  const auto rows = compare_seed_runs();
  int fits_checked = 0, oom_checked = 0;
  for (const auto& c : rows) {
    const SeedRun& r = *c.run;
    INFO(r.table << " " << r.h << "x" << r.layers << " heads " << r.heads << " " << c.plan.layout.str() << ": seed "
                 << r.mem << ", planner " << c.plan.peak_bytes / kGiB << " GiB");
    if (seed_oom(r)) {
      // Known disagreement: 14336 x 82 (02-28) ran out of memory where 13312 x 94 with 128 heads
      // ran at 67GB on the same layout; its first stage holds 1% more parameters and 7% wider
      // activations, which no monotone model turns into 13+ GB. The planner says it fits.
      if (r.h == 14336 && r.layers == 82) {
        CHECK(c.plan.fits);
        continue;
      }
      CHECK_FALSE(c.plan.fits);
      ++oom_checked;
    } else if (seed_has_mem(r)) {
      CHECK(c.plan.fits);  // every run that reported its memory ran: it fit in 80GB
      ++fits_checked;
      // The planner counts live tensors; nvidia-smi shows PyTorch's caching-allocator pool and
      // NCCL's buffers on top: measured / planned stays within 0.9..1.25, except the 13824 x 84
      // PP=6 MBS=2 row, which reads 65GB against 56GB for MBS=4 of the same layout.
      const double ratio = seed_mem_gib(r) / (c.plan.peak_bytes / kGiB);
      if (r.h == 13824 && r.layers == 84 && r.pp == 6 && r.mbs == 2) CHECK(ratio > 1.5);
      else CHECK((ratio >= 0.9 && ratio <= 1.25));
    }
  }
  CHECK(fits_checked >= 60);
  CHECK(oom_checked == 5);

  // Memory grows with the micro-batch exactly where the seed saw it grow: every layout measured
  // at several MBS, same model and day.
  for (const auto& a : rows)
    for (const auto& b : rows) {
      const SeedRun &ra = *a.run, &rb = *b.run;
      if (&ra == &rb || ra.h != rb.h || ra.layers != rb.layers || ra.heads != rb.heads || ra.dp != rb.dp ||
          ra.tp != rb.tp || ra.pp != rb.pp || ra.era != rb.era || ra.zero1 != rb.zero1 || ra.mbs >= rb.mbs)
        continue;
      INFO(ra.table << " " << a.plan.layout.str() << " vs mbs=" << rb.mbs);
      CHECK(a.plan.peak_bytes < b.plan.peak_bytes);
    }
  // ZeRO-1 over DP: the seed's DP=1 -> DP=2 (02-17: 73GB -> 51GB) and ZeRO stage 0 -> 1 (02-21:
  // 72GB -> 37GB) savings, within 25%.
  auto peak_of = [&](const SeedRun* r) {
    for (const auto& c : rows)
      if (c.run == r) return c.plan.peak_bytes / kGiB;
    FAIL("row not found");
    return 0.0;
  };
  const SeedRun* dp1 = find_run("02-17", 14400, 80, 96, 1, 8, 10, 1, 2048);
  const SeedRun* dp2 = find_run("02-17", 14400, 80, 96, 2, 8, 10, 1, 2048);
  const SeedRun* zs0 = find_run("02-21 ZeRO stage 0", 14336, 72, 64, 4, 8, 12, 2, 2048);
  const SeedRun* zs1 = find_run("02-21 ZeRO stage 1", 14336, 72, 64, 4, 8, 12, 2, 2048);
  REQUIRE((dp1 && dp2 && zs0 && zs1));
  CHECK(peak_of(dp1) - peak_of(dp2) == Approx(seed_mem_gib(*dp1) - seed_mem_gib(*dp2)).epsilon(0.25));
  CHECK(peak_of(zs0) - peak_of(zs1) == Approx(seed_mem_gib(*zs0) - seed_mem_gib(*zs1)).epsilon(0.25));
}

TEST_CASE("plan: seed 200B runs, speed: what the cost model reproduces", "[plan]") {
  const auto rows = compare_seed_runs();
  const GroupRanks gr = group_ranks(rows);
  // 02-20, one layout at MBS 1, 2, 4, 8 (four tables): the cost model orders them as measured
  // (MBS 2-4 fastest, 8 slowest: tile/wave efficiency against the 1F1B bubble).
  for (const char* g : {"02-20 14400x78 h96 gbs2048", "02-20 14400x80 h96 gbs2048", "02-20 14400x77 h96 gbs2048",
                        "02-20 14400x72 h96 gbs2048"}) {
    INFO(g);
    REQUIRE(gr.rho.count(g));
    CHECK(gr.rho.at(g) >= 0.8);
  }
  // 02-25, the 181B model on 48 nodes, GBS 2048, thirteen layouts over TP 2/4/8, PP 6/12/24 and
  // MBS 1/2/4: the ranking tracks the measurement (TP=4 and PP<=12 fast, PP=24 and TP=8 with
  // DP=4 slow), though not row by row: measured differences of 1-3% are within the seed's
  // repeat-to-repeat spread (the same layout ran 110.48 s and 113.54 s).
  REQUIRE(gr.rho.count("02-25 14336x72 h64 gbs2048"));
  CHECK(gr.rho.at("02-25 14336x72 h64 gbs2048") >= 0.5);
  // 02-28: TP=4 / DP=8 beats TP=8 / DP=4 on both models (measured 7-16%).
  auto step = [&](const SeedRun* r) {
    REQUIRE(r);
    for (const auto& c : rows)
      if (c.run == r) return c.plan.time.step_s;
    return 0.0;
  };
  CHECK(step(find_run("02-28", 13312, 82, 64, 8, 4, 12, 2, 2048)) < step(find_run("02-28", 13312, 82, 64, 4, 8, 12, 4, 2048)));
  CHECK(step(find_run("02-28", 14336, 70, 64, 8, 4, 12, 2, 2048)) < step(find_run("02-28", 14336, 70, 64, 4, 8, 12, 2, 2048)));
  // 02-20, "tile and wave quantization": 13824 instead of 14400 hidden (96 heads) made the same
  // layout 1.38x faster. The planner gets 1.4x, but for another reason than the seed guessed:
  // head_dim 14400/96 = 150 is not a multiple of 8, so attention misses the tensor cores (the
  // seed's 13824 with 128 heads, head_dim 108, was 34% slower than with 64 heads).
  const double measured = 221.21 / 160.29;
  const double planned = step(find_run("02-20 choosing", 14400, 80, 96, 4, 8, 10, 1, 2048)) /
                         step(find_run("02-20 tile/wave", 13824, 80, 96, 4, 8, 10, 1, 2048));
  CHECK(planned == Approx(measured).epsilon(0.15));
  // Not reproduced (documented, not asserted): before the 02-25 PCIe/NUMA fix, MBS=4 beat MBS=2
  // by 5-8% (02-21 contenders, 02-20 13824 x 80); the cost model has MBS 2 and 4 within 2% and
  // puts MBS=2 first. After the fix the seed's own MBS 2 vs 4 difference is gone (02-25, 02-28).
}

TEST_CASE("plan: the layouts fastest in the seed rank near the top of the planner's search", "[plan]") {
  // Every layout of the 181B model (14336 x 72, 64 heads) on 48 nodes at GBS 2048, planned as
  // the seed ran it (Megatron-DeepSpeed fp16, ZeRO-1, full recomputation) on default hardware.
  const RunConfig cfg = seed_model(14336, 72, 64, 2048);
  SeedRun as_run{"02-25", 14336, 72, 64, 8, 4, 12, 2, 2048, "", 0};
  PlanOptions o = seed_options(as_run);
  o.gpus = 384;
  const PlanResult res = plan_all(cfg, o);
  REQUIRE(res.ranked.size() >= 20);
  auto rank_of = [&](int64_t tp, int64_t pp, int64_t dp, int64_t mbs) {
    for (size_t i = 0; i < res.ranked.size(); ++i) {
      const Layout& l = res.ranked[i].layout;
      if (l.tp == tp && l.pp == pp && l.dp == dp && l.mbs == mbs) return int(i) + 1;
    }
    return 1000;
  };
  const int n = int(res.ranked.size());
  // Measured on 02-25 (s/it): tp4 pp12 dp8 mbs2 110.48, tp4 pp6 dp16 mbs2 111.71, tp4 pp12 dp8
  // mbs4 111.89, tp2 pp12 dp16 mbs2 112.50 ... tp8 pp12 dp4 mbs2 128.82, tp4 pp24 dp4 mbs1 130.60.
  const int fastest[] = {rank_of(4, 12, 8, 2), rank_of(4, 6, 16, 2), rank_of(4, 12, 8, 4), rank_of(2, 12, 16, 2)};
  INFO("ranks of the measured four fastest: " << fastest[0] << ", " << fastest[1] << ", " << fastest[2] << ", "
                                              << fastest[3] << " of " << n);
  CHECK(fastest[0] <= n / 3);
  CHECK(fastest[1] <= n / 3);
  for (int r : fastest) CHECK(r <= n / 2);
  CHECK(rank_of(8, 12, 4, 2) > fastest[0]);
  CHECK(rank_of(4, 24, 4, 1) > fastest[0]);
  // The seed's out-of-memory layout in this search (tp2 pp6 dp32, MBS 1 and 2) is rejected for
  // memory (tp8 pp1 dp48, the other OOM, ran at GBS 2016 and is not a divisor layout here).
  int oom = 0;
  for (const auto& x : res.rejected)
    if (x.layout.tp == 2 && x.layout.pp == 6 && x.layout.dp == 32 && x.layout.mbs <= 2) {
      CHECK(x.peak_bytes > 80 * kGiB * 0.95);
      ++oom;
    }
  CHECK(oom == 2);
}

// ---------------------------------------------------------------------------------------------
// the trainer's start-up breakdown and the CLI

TEST_CASE("plan: a run's own layout has a memory figure even where keel plan's node rule would reject its tp",
          "[plan]") {
  // tp=3 does not divide a node of 8 GPUs, which keel plan holds against a layout it proposes;
  // a run given tp=3 still needs its figure (the start-up table, the host-memory check).
  const RunConfig cfg = test::make_config(
      test::tiny_run_json(),
      {{"model", {{"d_model", 48}, {"n_heads", 6}, {"n_kv_heads", 3}, {"ffn_hidden", 96}, {"vocab_size", 66}}},
       {"parallel", {{"tp", 3}}}});
  CHECK(planned_backend_bytes(cfg, 0, false) > 0);
  CHECK_THAT(memory_breakdown_text(cfg), !Catch::Contains("does not divide") && Catch::Contains("weights"));
}

TEST_CASE("plan: the trainer's memory breakdown for its own layout", "[plan]") {
  const RunConfig tiny = test::make_config(test::tiny_run_json());
  const std::string t = memory_breakdown_text(tiny);
  CHECK(t.find("tp=1 pp=1 dp=1 mbs=4") != std::string::npos);
  CHECK(t.find("parameters (exact)") != std::string::npos);
  CHECK(t.find(grouped_for_test(ParamTable(tiny.model).logical_numel())) != std::string::npos);
  CHECK(t.find("verdict") == std::string::npos);  // no GPU given: nothing to compare against
  const std::string big = memory_breakdown_text(shipped("bloom-200b.json"), 80 * kGiB);
  CHECK(big.find("tp=8 pp=10 dp=4 mbs=1") != std::string::npos);
  CHECK(big.find("first stage") != std::string::npos);
  CHECK(big.find("last stage") != std::string::npos);
  CHECK(big.find("verdict: fits with no recompute") != std::string::npos);
  CHECK(big.find("this run: no recompute") != std::string::npos);
  // A run that will not fit is told what recomputation would need; with it set, the verdict and
  // the policy line follow the config.
  const std::string path = std::string(KEEL_SOURCE_DIR) + "/configs/bloom-200b.json";
  const std::string tight = memory_breakdown_text(load_config(path, {"train.micro_batch=2"}), 80 * kGiB);
  INFO(tight);
  CHECK(tight.find("verdict: DOES NOT FIT with no recompute: peak 76.49 GiB on stage 0") != std::string::npos);
  CHECK(tight.find("hint: with train.recompute \"full\" the peak would be 37.42 GiB (fits)") != std::string::npos);
  CHECK(tight.find("hint: with parallel.sequence_parallel true the peak would be 44.79 GiB (fits)") != std::string::npos);
  // Seed 001's layout over 10 stages: one layer fewer on stage 0, which keeps 10 micro-batches in
  // flight, and it fits as it is.
  const std::string moved = "[7,8,8,8,8,8,8,8,9,8]";
  CHECK(tight.find("hint: with parallel.pipeline_layers " + moved + " the peak would be") != std::string::npos);
  const std::string split = memory_breakdown_text(
      load_config(path, {"train.micro_batch=2", "parallel.pipeline_layers=" + moved}), 80 * kGiB);
  INFO(split);
  CHECK(split.find("verdict: fits with no recompute") != std::string::npos);
  CHECK(split.find("hint") == std::string::npos);
  CHECK(tight.find("hint: with train.recompute \"selective\" the peak would be 54.68 GiB (fits)") != std::string::npos);
  const std::string rc =
      memory_breakdown_text(load_config(path, {"train.micro_batch=2", "train.recompute=full"}), 80 * kGiB);
  INFO(rc);
  CHECK(rc.find("verdict: fits with full recompute: peak 37.42 GiB") != std::string::npos);
  CHECK(rc.find("this run: full recompute (train.recompute), activations") != std::string::npos);
  CHECK(rc.find("hint") == std::string::npos);
  const std::string sel =
      memory_breakdown_text(load_config(path, {"train.micro_batch=2", "train.recompute=selective"}), 80 * kGiB);
  INFO(sel);
  CHECK(sel.find("verdict: fits with selective recompute: peak 54.68 GiB") != std::string::npos);
  CHECK(sel.find("this run: selective recompute (train.recompute), activations") != std::string::npos);
  CHECK(sel.find("activations, selective recompute") != std::string::npos);  // the table's row
}

TEST_CASE("plan: the attention backward's scratch follows the environment the CUDA backend reads", "[plan][attention]") {
  // The 1B Llama at micro-batch 8 x 2048: 32 heads in 8 kv groups. keel's staged dS is 528 causal
  // 64x64 tiles per head, 16.5 MiB per kv group and sequence: the 1 GiB budget takes all 8 groups
  // of 7 sequences at once (924 MiB), beside delta, 8 x 2048 x 32 fp32 (2 MiB). cuDNN's
  // deterministic backward stages dP, 8 x 32 x 2048^2 x 2 bytes (2 GiB), and no delta. The GPU
  // plan less the CPU's (no CUDA context in either) is that scratch.
  const test::ScopedEnv kernels("KEEL_ATTENTION"), ds("KEEL_ATTN_DS_MB"), ws("KEEL_CUDNN_WORKSPACE_MB");
  kernels.set(nullptr), ds.set(nullptr), ws.set(nullptr);
  const RunConfig cfg = shipped("llama-1b.json");
  const double MiB = 1 << 20;
  const auto scratch = [&] { return planned_backend_bytes(cfg, 0, true) - planned_backend_bytes(cfg, 0, false); };
  CHECK(scratch() == 56 * 16.5 * MiB + 2 * MiB);
  ds.set("100");  // 6 kv groups of one sequence per launch
  CHECK(scratch() == 6 * 16.5 * MiB + 2 * MiB);
  ds.set("0");  // recomputed, nothing staged
  CHECK(scratch() == 2 * MiB);
  kernels.set("simple");
  CHECK(scratch() == 2 * MiB);
  kernels.set("cudnn");
  ds.set(nullptr);
  CHECK(scratch() == 2048 * MiB);
  ws.set("2047");  // cuDNN does not take the shape: keel's kernels run it
  CHECK(scratch() == 56 * 16.5 * MiB + 2 * MiB);
  // a bad value is refused by the plan as by the backend, naming the variable
  kernels.set("flash");
  CHECK_THROWS_WITH(planned_backend_bytes(cfg, 0, true), Catch::Contains("KEEL_ATTENTION must be fused"));
  CHECK(planned_backend_bytes(cfg, 0, false) > 0);  // the CPU backend does not read it

  // the run's start-up breakdown says which it counted (a GPU run's: with the GPU's memory)
  kernels.set(nullptr);
  CHECK_THAT(memory_breakdown_text(cfg, 80 * kGiB),
             Catch::Contains("this run: attention: keel's fused kernels, staged dS at most 1024 MiB (KEEL_ATTN_DS_MB): "
                             "926.0 MiB of scratch in a layer's backward"));
  CHECK_THAT(memory_breakdown_text(cfg), !Catch::Contains("attention:"));  // the CPU's

  // keel plan counts what the job's environment sets, and says which
  kernels.set("cudnn"), ws.set(nullptr);
  const std::string path = std::string(KEEL_SOURCE_DIR) + "/configs/llama-1b.json";
  const test::ProcessResult text = test::run_keel("plan --config " + path + " --gpus 1 --tp 1 --pp 1 --dp 1 --mbs 8");
  INFO(text.output);
  REQUIRE(text.code == 0);
  CHECK_THAT(text.output, Catch::Contains("attention: cuDNN (KEEL_ATTENTION=cudnn), workspace at most 4096 MiB") &&
                              Catch::Contains("CUDA context, comm buffers, attention scratch"));
  const test::ProcessResult js =
      test::run_keel("plan --config " + path + " --gpus 1 --tp 1 --pp 1 --dp 1 --mbs 8 --headroom 0 --json");
  REQUIRE(js.code == 0);
  const auto j = nlohmann::json::parse(js.output);
  CHECK(j["memory_model"]["attention"]["kernels"] == "cudnn");
  CHECK(j["memory_model"]["attention"]["cudnn_workspace_cap_bytes"] == 4096 * MiB);
  kernels.set(nullptr);
  const auto fused = nlohmann::json::parse(
      test::run_keel("plan --config " + path + " --gpus 1 --tp 1 --pp 1 --dp 1 --mbs 8 --headroom 0 --json").output);
  CHECK(fused["memory_model"]["attention"]["kernels"] == "fused");
  CHECK(j["ranked"][0]["peak_bytes"].get<double>() - fused["ranked"][0]["peak_bytes"].get<double>() ==
        2048 * MiB - 56 * 16.5 * MiB - 2 * MiB);
  const auto cpu = nlohmann::json::parse(
      test::run_keel("plan --config " + path + " --cpu --gpus 1 --tp 1 --pp 1 --dp 1 --mbs 8 --json").output);
  CHECK(cpu["memory_model"]["attention"].is_null());
  kernels.set("flash");
  const test::ProcessResult bad = test::run_keel("plan --config " + path + " --gpus 1");
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("KEEL_ATTENTION must be fused"));
  // --cpu plans the CPU backend, which does not read them
  CHECK(test::run_keel("plan --config " + path + " --cpu --gpus 1 --tp 1 --pp 1 --dp 1 --mbs 8").code == 0);
}

TEST_CASE("plan: selective recomputation drops each layer's norm outputs and MLP activation and pays their rebuild",
          "[plan]") {
  // The 1B Llama at 4 x 2048 tokens: a layer's two norm outputs [8192, 2048] and its SwiGLU
  // output [8192, 8192] in bf16 are 192 MiB; one of each is the scratch that rebuilds them.
  const RunConfig cfg = load_config(std::string(KEEL_SOURCE_DIR) + "/configs/llama-1b.json",
                                    {"train.micro_batch=4", "train.global_batch=4"});
  const MemoryModel mem = keel_memory_model(cfg.precision.mode);
  const Activations a = activation_bytes(cfg.model, mem, 1, 4, 2048);
  const double MiB = 1024.0 * 1024.0;
  CHECK(a.per_layer_rebuilt == 192 * MiB);
  CHECK(a.rebuild_scratch == (32 + 128) * MiB);
  CHECK(a.rebuild_moved == (4 * 32 + 128) * MiB);  // both norms read and write; the activation is written
  // GPT-2's GELU, apart from its matmul, also reads its input in forward and again to rebuild.
  const RunConfig gpt2 = load_config(std::string(KEEL_SOURCE_DIR) + "/configs/gpt2-124m.json",
                                     {"train.micro_batch=32", "train.global_batch=32"});
  const Activations g = activation_bytes(gpt2.model, mem, 1, 32, 1024);
  CHECK(g.rebuild_moved == (4 * 48 + 3 * 192) * MiB);  // [32768, 768] and [32768, 3072] in bf16
  PlanOptions kept, selective;
  kept.recompute = selective.recompute = Recompute::Never;
  selective.selective = true;
  const Layout l{1, 1, 1, 4};
  const LayoutPlan pk = plan_layout(cfg, l, kept), ps = plan_layout(cfg, l, selective);
  CHECK(pk.stages[0].act_full - ps.stages[0].act_full == Approx(16 * a.per_layer_rebuilt - a.rebuild_scratch));
  CHECK(ps.peak_bytes < pk.peak_bytes);
  CHECK(ps.time.compute_s - pk.time.compute_s == Approx(16 * a.rebuild_moved / (kept.hw.hbm_gbps * 1e9)));
  // Full recomputation rebuilds everything; the selective figures then do not apply.
  PlanOptions full = selective;
  full.recompute = Recompute::Always;
  const LayoutPlan pf = plan_layout(cfg, l, full);
  CHECK(pf.stages[0].act_recompute == Approx(plan_layout(cfg, l, [&] {
                                               PlanOptions o = full;
                                               o.selective = false;
                                               return o;
                                             }()).stages[0].act_recompute));
  // The step time pays a second forward for each layer recomputed whole, and the rebuild for each
  // other layer: recomputing 4 of the 16 layers costs a quarter of recomputing them all.
  PlanOptions four = full;
  four.recompute_layers = 4;
  const LayoutPlan p4 = plan_layout(cfg, l, four);
  CHECK(p4.stages[0].recomputed_layers == 4);
  CHECK(pf.stages[0].recomputed_layers == 16);
  PlanOptions four_kept = four, full_kept = full;
  four_kept.selective = full_kept.selective = false;
  const double second_forwards = plan_layout(cfg, l, full_kept).time.compute_s - pk.time.compute_s;
  CHECK(second_forwards > 0);
  CHECK(plan_layout(cfg, l, four_kept).time.compute_s - pk.time.compute_s == Approx(second_forwards / 4));
  CHECK(p4.time.compute_s - pk.time.compute_s ==
        Approx(second_forwards / 4 + 12 * a.rebuild_moved / (kept.hw.hbm_gbps * 1e9)));
  CHECK(pf.time.compute_s - pk.time.compute_s == Approx(second_forwards));
  // auto with selective: selective where it fits, full recomputation where it does not.
  PlanOptions autos = selective;
  autos.recompute = Recompute::Auto;
  CHECK(!plan_layout(cfg, l, autos).recompute);
  autos.hw.gpu_mem_bytes = ps.peak_bytes;  // the headroom leaves less than the selective peak usable
  CHECK(plan_layout(cfg, l, autos).recompute);
}

namespace {

struct Ran {
  int code = -1;
  std::string out;
};

Ran keel_cli(const std::string& args) {
  const test::ProcessResult r = test::run_keel(args);
  return {r.code, r.output};
}

}  // namespace

TEST_CASE("plan: keel plan on the command line", "[plan]") {
  const std::string cfg = std::string(KEEL_SOURCE_DIR) + "/configs/bloom-200b.json";
  SECTION("a table of layouts, best first") {
    const Ran r = keel_cli("plan --config " + cfg + " --gpus 320");
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK(r.out.find("parameters (exact, the trainer's ParamTable): 202,722,768,000") != std::string::npos);
    CHECK(r.out.find("feasible layouts, fastest first") != std::string::npos);
    CHECK(r.out.find("rejected") != std::string::npos);
  }
  SECTION("--json, pinned sizes") {
    const Ran r = keel_cli("plan --config " + cfg + " --gpus 320 --tp 8 --pp 10 --json");
    INFO(r.out);
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.out);
    CHECK(j["parameters"]["exact"] == 202722768000ll);
    REQUIRE(!j["ranked"].empty());
    for (const auto& p : j["ranked"]) {
      CHECK(p["layout"]["tp"] == 8);
      CHECK(p["layout"]["pp"] == 10);
      CHECK(p["layout"]["dp"] == 4);
      CHECK(p["stages"].size() == 10);
    }
    CHECK(j["memory_model"]["bytes_per_param"]["unsharded_total"] == 18);
    CHECK(j["selective_recompute"] == false);
    // Selective recomputation lowers every stage's figures without full recomputation.
    const Ran sel = keel_cli("plan --config " + cfg + " --gpus 320 --tp 8 --pp 10 --mbs 1 --json --selective-recompute");
    REQUIRE(sel.code == 0);
    const auto js = nlohmann::json::parse(sel.out);
    CHECK(js["selective_recompute"] == true);
    REQUIRE(js["ranked"].size() == 1);
    const auto mbs1 = std::find_if(j["ranked"].begin(), j["ranked"].end(),
                                   [](const nlohmann::json& p) { return p["layout"]["mbs"] == 1; });
    REQUIRE(mbs1 != j["ranked"].end());
    const auto& first = (*mbs1)["stages"][0]["bytes"];
    const auto& first_sel = js["ranked"][0]["stages"][0]["bytes"];
    CHECK(first_sel["activations_no_recompute"].get<double>() < first["activations_no_recompute"].get<double>());
    CHECK(first_sel["activations_recompute"].get<double>() == first["activations_recompute"].get<double>());
  }
  SECTION("384 GPUs: the 80 layers spread over pp=12 as the trainer spreads them (7 or 6 per stage)") {
    const Ran r = keel_cli("plan --config " + cfg + " --gpus 384");
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Catch::Contains("best: layout tp=4 pp=12 dp=8 mbs=1") && Catch::Contains("emb + 0-6"));
  }
  SECTION("56 GPUs: nothing fits; closest changes") {
    const Ran r = keel_cli("plan --config " + cfg + " --gpus 56");
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains("no layout fits 56 GPUs") && Catch::Contains("closest changes that fit") &&
                          Catch::Contains("n_layers 77"));
  }
  SECTION("the config's own micro-batch is searched above --max-mbs: gpt2-124m's mbs 64 gets a rank") {
    const std::string gpt2 = std::string(KEEL_SOURCE_DIR) + "/configs/gpt2-124m.json";
    REQUIRE(load_config(gpt2).train.micro_batch > 16);  // above the default --max-mbs
    const Ran r = keel_cli("plan --config " + gpt2);
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Catch::Contains("the config's own layout tp=1 pp=1 dp=1 mbs=64: rank ") &&
                          Catch::Contains("s per step"));
    // Other sizes above --max-mbs still are not tried.
    const Ran js = keel_cli("plan --config " + gpt2 + " --json");
    REQUIRE(js.code == 0);
    std::set<int64_t> tried;
    const auto j = nlohmann::json::parse(js.out);
    for (const auto& p : j["ranked"]) tried.insert(p["layout"]["mbs"].get<int64_t>());
    CHECK(tried == std::set<int64_t>{1, 2, 4, 8, 16, 64});
  }
  SECTION("a global batch that does not divide over dp: closest changes that do") {
    const std::string tiny = std::string(KEEL_SOURCE_DIR) + "/configs/llama-tiny.json";
    const Ran r = keel_cli("plan --config " + tiny + " --gpus 3 --tp 1 --pp 1");
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains("global batch 16 not divisible by dp=3") &&
                          Catch::Contains("train.global_batch 15") && Catch::Contains("train.global_batch 18"));
  }
  SECTION("--cpu: the figure keel train checks against host memory, for the run's layout as for the others") {
    // keel train's refusal points here (check_host_memory): the plan of the run's own layout is
    // the figure it compared, and with a share of host memory below it, other micro-batches fit.
    const std::string tiny = std::string(KEEL_SOURCE_DIR) + "/configs/llama-tiny.json";
    const RunConfig run = load_config(tiny);
    const double needs = planned_backend_bytes(run, 0, false);
    const std::string pin = " --tp 1 --pp 1 --dp 1 --mbs " + std::to_string(run.train.micro_batch);
    const Ran r = keel_cli("plan --config " + tiny + " --cpu --gpus 1 --headroom 0 --recompute never --json" + pin);
    INFO(r.out);
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["ranked"].size() == 1);
    CHECK(j["ranked"][0]["peak_bytes"].get<double>() == needs);
    CHECK(j["memory_model"]["cuda_context_bytes"] == 0);
    const std::string share = std::to_string(static_cast<int64_t>(0.8 * needs)) + " --headroom 0";
    const Ran fits = keel_cli("plan --config " + tiny + " --cpu --gpus 1 --gpu-mem " + share);
    INFO(fits.out);
    CHECK(fits.code == 0);
    CHECK(fits.out.find("feasible layouts, fastest first") != std::string::npos);
    // --cuda-context 0 is the same as --cpu's context; a negative size is still refused.
    const Ran zero = keel_cli("plan --config " + tiny + " --cuda-context 0 --gpus 1 --json" + pin);
    REQUIRE(zero.code == 0);
    CHECK(nlohmann::json::parse(zero.out)["memory_model"]["cuda_context_bytes"] == 0);
    CHECK(keel_cli("plan --config " + tiny + " --cuda-context -1G").code == 2);
  }
  SECTION("bad arguments") {
    CHECK(keel_cli("plan --config " + cfg + " --gpu-mem 80XB").code == 2);
    const Ran tp3 = keel_cli("plan --config " + cfg + " --gpus 320 --tp 3");  // was "no layout fits", no reason
    CHECK(tp3.code == 2);
    CHECK_THAT(tp3.out, Catch::Contains("--tp 3 = 3 does not divide --gpus 320"));
    const Ran nodes = keel_cli("plan --config " + cfg + " --gpus 320 --gpus-per-node 3");
    CHECK(nodes.code == 2);
    CHECK_THAT(nodes.out, Catch::Contains("--gpus 320 is not a whole number of nodes of --gpus-per-node 3"));
    const Ran bare = keel_cli("plan --config " + cfg + " --gpu-mem 80");  // bytes, and surely meant GiB
    CHECK(bare.code == 2);
    CHECK_THAT(bare.out, Catch::Contains("--gpu-mem 80: a number without a unit is bytes") &&
                             Catch::Contains("did you mean 80GiB?"));
    CHECK(keel_cli("plan --config " + cfg + " --gpus 320 --tp 8 --pp 10 --dp 8").code == 2);
    const Ran v = keel_cli("plan --config " + cfg + " --virtual-stages two");
    CHECK(v.code == 2);
    CHECK_THAT(v.out, Catch::Contains("--virtual-stages: \"two\" is not allowed (allowed: a count >= 1, or auto"));
  }
  SECTION("--virtual-stages auto: a v column, each layout with its fastest chunk count") {
    const Ran r = keel_cli("plan --config " + cfg + " --gpus 320 --virtual-stages auto --json");
    REQUIRE(r.code == 0);
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(!j["ranked"].empty());
    for (const auto& p : j["ranked"]) CHECK(p["layout"]["pp"].get<int>() * p["virtual_stages"].get<int>() <= 80);
  }
}
