// Run configs: every shipped config validates; errors name the field, the value and what is
// allowed; unknown fields are errors; overrides work; schedules follow their formulas.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>

#include "common/run_config.h"
#include "common/temp_dir.h"
#include "model/param_table.h"
#include "train/run.h"
#include "train/schedule.h"

using namespace keel;

TEST_CASE("every shipped config validates and round-trips through to_json", "[config]") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(KEEL_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".json") continue;
    INFO(e.path());
    RunConfig c = load_config(e.path().string());
    RunConfig again = parse_config(to_json(c), "again");
    CHECK(to_json(again) == to_json(c));
    ++n;
  }
  CHECK(n >= 6);
}

TEST_CASE("shipped shapes have the sizes their names promise", "[config]") {
  auto params = [](const char* name) {
    return ParamTable(load_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name).model).logical_numel();
  };
  CHECK(params("gpt2-124m.json") == 124475904);  // llm.c's 124M with the vocab padded to 50304
  CHECK(params("llama2-7b.json") == 6738415616);  // Llama-2-7B
  CHECK(std::llround(params("bloom-104b.json") / 1e9) == 104);
  CHECK(std::llround(params("bloom-200b.json") / 1e9) == 203);
}

TEST_CASE("model.rope_scaling: Llama 3's scaling round-trips, GPT-2 has no RoPE to scale", "[config]") {
  const RunConfig c = test::make_config(test::tiny_run_json("llama"),
                                        {{"model", {{"rope_scaling", {{"type", "llama3"}, {"factor", 32},
                                                                      {"original_max_position_embeddings", 8192}}}}}});
  CHECK(c.model.rope_scaling.kind == RopeScaling::Kind::Llama3);
  CHECK(c.model.rope_scaling.factor == 32.0);
  CHECK(c.model.rope_scaling.low_freq_factor == 1.0);  // Llama 3.1's values by default
  CHECK(c.model.rope_scaling.high_freq_factor == 4.0);
  CHECK(parse_config(to_json(c), "again").model.rope_scaling == c.model.rope_scaling);
  CHECK_FALSE(to_json(test::make_config(test::tiny_run_json("llama"))).at("model").contains("rope_scaling"));
  CHECK_THROWS_WITH(test::make_config(test::tiny_run_json("gpt2"), {{"model", {{"rope_scaling", {{"type", "llama3"}}}}}}),
                    Catch::Contains("model.rope_scaling: gpt2 has learned positions"));
}

namespace {
// A tiny config of `family` with `model` merged into its model section must be refused, the
// error mentioning `needle`.
void model_fails_with(const std::string& family, const nlohmann::json& model, const std::string& needle) {
  INFO(family << " " << model.dump() << " should fail mentioning " << needle);
  CHECK_THROWS_WITH(test::make_config(test::tiny_run_json(family), {{"model", model}}), Catch::Contains(needle));
}
}  // namespace

TEST_CASE("model.position_embedding and model.embedding_norm: per family, round trip, errors", "[config][alibi]") {
  const RunConfig bloom = test::make_config(test::tiny_run_json("gpt2"),
                                            {{"model", {{"position_embedding", "alibi"}, {"embedding_norm", true}}}});
  CHECK(bloom.model.alibi);
  CHECK(bloom.model.embedding_norm);
  CHECK_FALSE(bloom.model.learned_positions());
  CHECK_FALSE(bloom.model.rope().rotates());
  const RunConfig again = parse_config(to_json(bloom), "again");
  CHECK((again.model.alibi && again.model.embedding_norm));
  // The family's default is not written, so older checkpoints' configs compare equal.
  const nlohmann::json plain = to_json(test::make_config(test::tiny_run_json("llama")));
  CHECK_FALSE(plain.at("model").contains("position_embedding"));
  CHECK_FALSE(plain.at("model").contains("embedding_norm"));
  CHECK(test::make_config(test::tiny_run_json("llama"), {{"model", {{"position_embedding", "rope"}}}}).model.rope().rotates());
  CHECK_FALSE(
      test::make_config(test::tiny_run_json("llama"), {{"model", {{"position_embedding", "alibi"}}}}).model.rope().rotates());
  // The tensors follow: no pos_embed with ALiBi, an embed_norm (never decayed) with the option.
  const ParamTable t(bloom.model);
  CHECK_FALSE(t.contains("pos_embed"));
  CHECK(t.at("embed_norm.weight").role == Role::Norm);
  CHECK_FALSE(t.at("embed_norm.weight").decay);
  CHECK_FALSE(t.at("embed_norm.bias").decay);

  model_fails_with("gpt2", {{"position_embedding", "rope"}}, "model.position_embedding: gpt2 takes \"learned\" or \"alibi\"");
  model_fails_with("llama", {{"position_embedding", "learned"}}, "model.position_embedding: llama takes \"rope\" or \"alibi\"");
  model_fails_with("llama", {{"position_embedding", "sinusoidal"}},
             "model.position_embedding: \"sinusoidal\" is not allowed (allowed: learned, rope, alibi)");
  model_fails_with("llama", {{"position_embedding", "alibi"}, {"rope_scaling", {{"type", "llama3"}}}},
             "model.rope_scaling: position_embedding \"alibi\" has no RoPE to scale");
  model_fails_with("gpt2", {{"embedding_norm", "yes"}}, "model.embedding_norm");
}

TEST_CASE("model.qkv_bias (Qwen2): llama's option, round trip, tensors, errors", "[config][qwen]") {
  const RunConfig q = test::make_config(test::tiny_run_json("llama"), {{"model", {{"qkv_bias", true}}}});
  CHECK(q.model.has_qkv_bias());
  CHECK(parse_config(to_json(q), "again").model.qkv_bias);
  CHECK_FALSE(to_json(test::make_config(test::tiny_run_json("llama"))).at("model").contains("qkv_bias"));
  // gpt2 always has them; the field may say so but not the opposite.
  const RunConfig g = test::make_config(test::tiny_run_json("gpt2"), {{"model", {{"qkv_bias", true}}}});
  CHECK(g.model.has_qkv_bias());
  CHECK_FALSE(to_json(g).at("model").contains("qkv_bias"));
  model_fails_with("gpt2", {{"qkv_bias", false}}, "model.qkv_bias: gpt2 always has q/k/v biases");
  // The biases: split over TP with their projections' rows, never decayed.
  const ParamTable t(q.model, ModelShard{1, 2});
  for (const char* b : {"layers.0.attn.bq", "layers.0.attn.bk", "layers.0.attn.bv"}) {
    CHECK(t.at(b).role == Role::Bias);
    CHECK_FALSE(t.at(b).decay);
    CHECK(t.at(b).split == TpSplit::Rows);
  }
  CHECK(t.at("layers.0.attn.bk").local_shape[0] * 2 == q.model.kv_dim());
  CHECK(t.at("layers.0.attn.bq").shard_begin == q.model.q_dim() / 2);
}

TEST_CASE("model.qk_norm and model.head_dim (Qwen3): llama's options, round trip, tensors, errors", "[config][qwen]") {
  const RunConfig q = test::make_config(test::tiny_run_json("llama"),
                                        {{"model", {{"qk_norm", true}, {"head_dim", 24}, {"n_heads", 4}, {"n_kv_heads", 2}}}});
  CHECK(q.model.head_dim() == 24);
  CHECK(q.model.q_dim() == 96);
  const RunConfig again = parse_config(to_json(q), "again");
  CHECK((again.model.qk_norm && again.model.head_dim() == 24));
  // The derived size, written out, is no option (checkpoints compare equal).
  const int derived = q.model.d_model / 4;
  CHECK_FALSE(to_json(test::make_config(test::tiny_run_json("llama"), {{"model", {{"head_dim", derived}, {"n_heads", 4}}}}))
                  .at("model")
                  .contains("head_dim"));
  // The norms: one weight of head_dim, whole on every TP rank, never decayed; wq / wo widen.
  const ParamTable t(q.model, ModelShard{0, 2});
  for (const char* n : {"layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight"}) {
    CHECK(t.at(n).role == Role::Norm);
    CHECK_FALSE(t.at(n).decay);
    CHECK(t.at(n).split == TpSplit::None);
    CHECK(t.at(n).local_shape == std::vector<int64_t>{24});
  }
  CHECK(t.at("layers.0.attn.wq").shape == std::vector<int64_t>{96, q.model.d_model});
  CHECK(t.at("layers.0.attn.wo").shape == std::vector<int64_t>{q.model.d_model, 96});
  model_fails_with("gpt2", {{"qk_norm", true}}, "model.qk_norm: true is a llama option");
  model_fails_with("gpt2", {{"head_dim", 16}}, "model.head_dim: gpt2's heads are d_model / n_heads wide");
  model_fails_with("llama", {{"head_dim", 7}}, "model.head_dim: RoPE needs an even head dimension, got 7");
  // without RoPE (ALiBi) any head_dim will do
  CHECK(test::make_config(test::tiny_run_json("llama"), {{"model", {{"head_dim", 7}, {"position_embedding", "alibi"}}}})
            .model.head_dim() == 7);
  model_fails_with("llama", {{"head_dim", 0}}, "model.head_dim");
  model_fails_with("llama", {{"n_heads", 5}}, "set model.head_dim for heads of another size");
}

TEST_CASE("model.sliding_window: either family, round trip, FLOP count, errors", "[config][window]") {
  for (const char* family : {"llama", "gpt2"}) {
    INFO(family);
    const RunConfig w = test::make_config(test::tiny_run_json(family), {{"model", {{"sliding_window", 4}}}});
    CHECK(w.model.sliding_window == 4);
    CHECK(parse_config(to_json(w), "again").model.sliding_window == 4);
    CHECK_THAT(option_names(w.model), Catch::Contains("sliding window 4"));
    // attention counts at most the window's keys per query
    CHECK(w.model.attended_keys(16) == 4);
    CHECK(w.model.attended_keys(3) == 3);
    const RunConfig plain = test::make_config(test::tiny_run_json(family));
    CHECK(plain.model.sliding_window == 0);
    CHECK(plain.model.attended_keys(16) == 16);
    CHECK_FALSE(to_json(plain).at("model").contains("sliding_window"));  // older checkpoints compare equal
  }
  model_fails_with("llama", {{"sliding_window", 0}}, "model.sliding_window");
  model_fails_with("llama", {{"sliding_window", -3}}, "model.sliding_window");
  model_fails_with("gpt2", {{"sliding_window", "4k"}}, "model.sliding_window");
}

TEST_CASE("config errors name the field, the bad value and the allowed values", "[config]") {
  auto base = test::tiny_run_json();
  auto fails_with = [&](const nlohmann::json& patch, const std::string& needle) {
    INFO(patch.dump() << " should fail mentioning " << needle);
    CHECK_THROWS_WITH(test::make_config(base, patch), Catch::Contains(needle));
  };
  fails_with({{"model", {{"family", "bert"}}}}, "model.family: \"bert\" is not allowed (allowed: gpt2, llama)");
  fails_with({{"model", {{"d_model", "big"}}}}, "model.d_model: expected an integer, got \"big\"");
  fails_with({{"model", {{"n_layers", 0}}}}, "model.n_layers: 0 is out of range");
  // Past int64: quoted as given (it was wrapped to a negative number first).
  fails_with({{"train", {{"seed", 18446744073709551615ull}}}},
             "train.seed: 18446744073709551615 is out of range (allowed: >= 0)");
  fails_with({{"train", {{"steps", 9223372036854775808ull}}}}, "train.steps: 9223372036854775808 is out of range");
  fails_with({{"model", {{"n_kv_heads", 3}}}}, "model.n_kv_heads: 3 does not divide model.n_heads (4)");
  fails_with({{"model", {{"rope_scaling", {{"type", "yarn"}}}}}},
             "model.rope_scaling.type: \"yarn\" is not allowed (allowed: none, llama3)");
  fails_with({{"model", {{"rope_scaling", {{"type", "llama3"}, {"low_freq_factor", 4}, {"high_freq_factor", 1}}}}}},
             "model.rope_scaling.high_freq_factor: 1.0 must exceed low_freq_factor (4.0)");
  fails_with({{"model", {{"rope_scaling", {{"type", "llama3"}, {"factr", 8}}}}}}, "did you mean 'factor'");
  fails_with({{"optimizer", {{"beta2", 1.5}}}}, "optimizer.beta2");
  // An open end is shown open: 1.0 itself is what the range leaves out.
  fails_with({{"optimizer", {{"beta2", 1.0}}}}, "optimizer.beta2: 1.0 is out of range (allowed: [0, 1))");
  fails_with({{"precision", {{"mode", "fp16"}, {"loss_scale", {{"backoff_factor", 1}}}}}},
             "precision.loss_scale.backoff_factor: 1 is out of range (allowed: (0, 1))");
  CHECK(test::make_config(base, {{"optimizer", {{"beta2", 0.99999}}}}).optimizer.beta2 == 0.99999);
  fails_with({{"optimizer", {{"lr", -1}}}}, "optimizer.lr");
  fails_with({{"optimizer", {{"weight_decy", 0.1}}}}, "did you mean 'weight_decay'");
  fails_with({{"trian", {{"steps", 1}}}}, "trian: unknown field (did you mean 'train'?)");
  fails_with({{"train", {{"global_batch", 6}}}}, "train.global_batch: 6 is not a multiple of train.micro_batch");
  fails_with({{"train", {{"seq_len", 64}}}}, "train.seq_len: 64 exceeds model.max_seq_len (32)");
  fails_with({{"parallel", {{"tp", 8}}}}, "parallel.tp: 8 does not divide model.n_heads (4)");
  fails_with({{"parallel", {{"pp", 4}}}}, "parallel.pp: 4 stages for 2 layers");
  fails_with({{"parallel", {{"virtual_stages", 2}}}},
             "parallel.virtual_stages: 2 model chunks per rank interleave a pipeline; with parallel.pp = 1 there is none");
  fails_with({{"parallel", {{"pp", 2}, {"virtual_stages", 2}}}},
             "parallel.virtual_stages: pp * virtual_stages = 4 virtual stages for 2 layers (each needs at least one)");
  fails_with({{"parallel", {{"pp", 2}, {"virtual_stages", 0}}}}, "parallel.virtual_stages: 0 is out of range");
  fails_with({{"parallel", {{"overlap_grad_reduce", "yes"}}}}, "parallel.overlap_grad_reduce: expected true or false");
  fails_with({{"parallel", {{"grad_bucket_size", -1}}}}, "parallel.grad_bucket_size: -1 is out of range");
  // An out-of-range size is refused by name, and never reaches the checks that divide by it.
  for (const char* field : {"tp", "pp", "dp"})
    for (const int64_t bad : {int64_t{0}, std::numeric_limits<int64_t>::min()})
      fails_with({{"parallel", {{field, bad}}}}, "parallel." + std::string(field) + ": " + std::to_string(bad) +
                                                     " is out of range");
  fails_with({{"parallel", {{"overlap_param_gather", 1}}}}, "parallel.overlap_param_gather: expected true or false");
  fails_with({{"parallel", {{"tp", 4}, {"sequence_parallel", true}}}, {"train", {{"micro_batch", 1}, {"global_batch", 8}, {"seq_len", 30}}}},
             "parallel.sequence_parallel: the 30 token rows of a micro-batch (train.micro_batch * train.seq_len) do not "
             "divide over tp=4");
  fails_with({{"precision", {{"mode", "fp8"}}}}, "allowed: bf16, fp32, fp16, bf16-unsafe-no-master");
  fails_with({{"precision", {{"mode", "fp16"}, {"stochastic_rounding", true}}}},
             "precision.stochastic_rounding: true needs precision.mode \"bf16\"");
  fails_with({{"precision", {{"stochastic_rounding", "yes"}}}}, "precision.stochastic_rounding: expected");
  fails_with({{"schedule", {{"decay", "exp"}}}}, "schedule.decay");
  fails_with({{"schedule", {{"wsd_decay_steps", 5}}}}, "schedule.wsd_decay_steps / wsd_decay_style: need schedule.decay \"wsd\"");
  fails_with({{"schedule", {{"decay", "wsd"}, {"wsd_decay_style", "exp"}}}},
             "schedule.wsd_decay_style: \"exp\" is not allowed (allowed: linear, cosine, 1-sqrt)");
  fails_with({{"schedule", {{"decay", "wsd"}, {"decay_steps", 10}, {"wsd_decay_steps", 20}}}},
             "schedule.wsd_decay_steps: 20 exceeds schedule.decay_steps (10)");
  fails_with({{"schedule", {{"rampup_batch_size", {2, 2, 100}}}}}, "multiples of micro_batch * dp (4)");
  fails_with({{"data", {{"train", 5}}}}, "data.train: expected a path or a list of paths");
  fails_with({{"data", {{"train", {"a.bin", "b.bin"}}, {"train_weights", {1}}}}},
             "data.train_weights: 1 weights for 2 data.train entries (one weight per entry)");
  fails_with({{"data", {{"train", {"a.bin", "b.bin"}}, {"train_weights", {1, 0}}}}},
             "data.train_weights[1]: 0 is out of range (allowed: > 0)");
  fails_with({{"data", {{"train", {"a.bin", "b.bin"}}, {"train_weights", "1,1"}}}},
             "data.train_weights: expected a list of numbers");
  fails_with({{"data", {{"train", {"a.bin", "b.bin"}}, {"train_weights", {1e6, 1}}}}},
             "data.train_weights[1]: 1 is 1e-06 of the total, below the smallest share a blend gives (1/65536)");
  fails_with({{"data", {{"train", {"a.bin", "b.bin"}}, {"train_weights", {1e8, 1}}}}},
             "data.train_weights[1]: 1 is 1e-08 of the total");  // not "0.000000"
  fails_with({{"data", {{"val_sets", "val.bin"}}}}, "data.val_sets: expected an object {...}, got \"val.bin\"");
  fails_with({{"data", {{"val_sets", {{"web site", "w.bin"}}}}}},
             "data.val_sets.web site: the name is not allowed (allowed: letters, digits, '_', '-' and '.';");
  fails_with({{"data", {{"val_sets", {{"code", 3}}}}}}, "data.val_sets.code: expected a path or a list of paths, got 3");
  fails_with({{"data", {{"val_sets", {{"code", nlohmann::json::array()}}}}}},
             "data.val_sets.code: no files (expected a path or a list of paths)");
  fails_with({{"log", {{"tensorboard", "yes"}}}}, "log.tensorboard: expected true or false, got \"yes\"");
  fails_with({{"data", {{"document_masking", "yes"}}}}, "data.document_masking: expected");
  fails_with({{"data", {{"eod_mask_loss", 1}}}}, "data.eod_mask_loss: expected");
  fails_with({{"checkpoint", {{"async", "on"}}}}, "checkpoint.async: expected");
  fails_with({{"data", {{"eod_token", 64}}}}, "data.eod_token: 64 is out of range (allowed: in [-1, 63])");
  fails_with({{"device", "tpu"}}, "device: \"tpu\" is not allowed (allowed: auto, cpu, cuda)");
  fails_with({{"train", {{"recompute", "attention"}}}},
             "train.recompute: \"attention\" is not allowed (allowed: none, selective, full)");
  fails_with({{"train", {{"recompute_layers", 2}}}}, "train.recompute_layers: 2 needs train.recompute \"full\"");
  fails_with({{"train", {{"recompute", "selective"}, {"recompute_layers", 2}}}},
             "train.recompute_layers: 2 needs train.recompute \"full\" (it is \"selective\")");
  fails_with({{"health", {{"straggler_ratio", 0.9}}}},
             "health.straggler_ratio: 0.9 would call typical ranks slow (allowed: 0 to turn the check off, or a ratio "
             "above 1 such as 1.25)");
  fails_with({{"log", {{"timers_interval_s", -1}}}}, "log.timers_interval_s: -1 is out of range (allowed: [0, 1e+09])");
  fails_with({{"log", {{"timers", 1}}}}, "log.timers: expected true or false, got 1");
  fails_with({{"train", {{"recompute", "full"}, {"recompute_layers", -1}}}}, "train.recompute_layers: -1 is out of range");
  // Several problems are all reported at once.
  try {
    test::make_config(base, {{"model", {{"n_layers", 0}}}, {"optimizer", {{"eps", 0}}}});
    FAIL("expected a ConfigError");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("model.n_layers") && Catch::Contains("optimizer.eps"));
  }
}

// A wrong field is reported once: the checks that relate it to others skip it instead of
// quoting the default that stands in for it (values the user never gave).
TEST_CASE("parallel.pipeline_layers: the user's split, stages of the embedding or head only, round trip, errors",
          "[config][pipeline]") {
  auto base = test::tiny_run_json();  // 2 layers
  auto split_of = [&](const nlohmann::json& parallel) {
    const RunConfig c = test::make_config(base, {{"parallel", parallel}});
    CHECK(to_json(parse_config(to_json(c), "again")) == to_json(c));
    std::vector<std::pair<int, int>> spans;  // [first, end) of every (virtual) stage in model order
    const int stages = static_cast<int>(c.parallel.pp * c.parallel.virtual_stages);
    for (int s = 0; s < stages; ++s) {
      const ModelShard sh = pipeline_stage(c.model, stages, s, c.parallel.pipeline_split());
      CHECK(sh.has_embedding == (s == 0));
      CHECK(sh.has_head == (s == stages - 1));
      spans.emplace_back(sh.first_layer, sh.end_layer);
    }
    return spans;
  };
  using Spans = std::vector<std::pair<int, int>>;
  CHECK(split_of({{"pp", 1}, {"pipeline_layers", {2}}}) == Spans{{0, 2}});
  CHECK(split_of({{"pp", 2}, {"pipeline_layers", {0, 2}}}) == Spans{{0, 0}, {0, 2}});
  CHECK(split_of({{"pp", 2}, {"pipeline_layers", {2, 0}}}) == Spans{{0, 2}, {2, 2}});
  // More stages than layers, when the extra ones hold the embedding and the head.
  CHECK(split_of({{"pp", 4}, {"pipeline_layers", {0, 1, 1, 0}}}) == Spans{{0, 0}, {0, 1}, {1, 2}, {2, 2}});
  CHECK(split_of({{"pp", 2}, {"virtual_stages", 2}, {"pipeline_layers", {0, 1, 1, 0}}}) ==
        Spans{{0, 0}, {0, 1}, {1, 2}, {2, 2}});
  CHECK(split_of({{"pp", 2}, {"pipeline_layers", nlohmann::json::array()}}) == Spans{{0, 1}, {1, 2}});  // even

  auto fails_with = [&](const nlohmann::json& parallel, const std::string& needle) {
    INFO(parallel.dump() << " should fail mentioning " << needle);
    CHECK_THROWS_WITH(test::make_config(base, {{"parallel", parallel}}), Catch::Contains(needle));
  };
  for (const nlohmann::json& bad : {nlohmann::json(2), nlohmann::json{1, -1}, nlohmann::json{1.5, 0.5},
                                   nlohmann::json{"1", "1"}})
    fails_with({{"pp", 2}, {"pipeline_layers", bad}},
               "parallel.pipeline_layers: expected a list of layer counts >= 0, one per pipeline stage, got " +
                   bad.dump());
  fails_with({{"pp", 2}, {"pipeline_layers", {2}}},
             "parallel.pipeline_layers: 1 layer count for 2 pipeline stages (parallel.pp; one count per stage, in "
             "model order)");
  fails_with({{"pp", 2}, {"virtual_stages", 2}, {"pipeline_layers", {1, 1}}},
             "parallel.pipeline_layers: 2 layer counts for 4 pipeline stages (parallel.pp * parallel.virtual_stages;");
  fails_with({{"pp", 2}, {"pipeline_layers", {1, 2}}},
             "parallel.pipeline_layers: the counts add up to 3 layers, but model.n_layers is 2");
  fails_with({{"pp", 3}, {"pipeline_layers", {1, 0, 1}}},
             "parallel.pipeline_layers: stage 1 would hold no layer (only the first stage, which holds the "
             "embedding, and the last, which holds the head, may hold none)");
  fails_with({{"pp", 2}, {"virtual_stages", 2}, {"pipeline_layers", {1, 0, 0, 1}}},
             "parallel.pipeline_layers: virtual stages 1, 2 would hold no layer");
  fails_with({{"pp", 2}, {"embedding_slot", true}, {"pipeline_layers", {1, 1}}},
             "parallel.pipeline_layers: set, and so is parallel.embedding_slot");
  // The trainer's split refuses what the config would (a direct caller gets the same checks).
  ModelConfig m = test::make_config(base, nlohmann::json::object()).model;
  CHECK_THROWS_WITH(pipeline_stage(m, 2, 0, PipelineSplit{false, {1, 1, 0}}), Catch::Contains("3 stages, not 2"));
  CHECK_THROWS_WITH(pipeline_stage(m, 2, 0, PipelineSplit{false, {1, 2}}), Catch::Contains("3 layers are not the model's 2"));
  CHECK_THROWS_WITH(pipeline_stage(m, 3, 1, PipelineSplit{false, {1, 0, 1}}), Catch::Contains("stage 1 of 3 would hold no layer"));
}

TEST_CASE("config errors do not cascade into checks on a field that already failed", "[config]") {
  auto base = test::tiny_run_json();
  base["sample"] = {{"interval", 0}, {"tokens", 8}};
  auto errors_of = [&](const nlohmann::json& patch) {
    try {
      test::make_config(base, patch);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto only = [&](const nlohmann::json& patch, const std::string& expected, const std::vector<std::string>& absent) {
    const std::string msg = errors_of(patch);
    INFO(patch.dump() << "\n" << msg);
    CHECK_THAT(msg, Catch::Contains(expected));
    for (const std::string& a : absent) CHECK_THAT(msg, !Catch::Contains(a));
  };
  only({{"model", {{"n_heads", "4"}}}}, "model.n_heads: expected an integer, got \"4\"", {"does not divide"});
  only({{"train", {{"global_batch", 16.0000000001}}}}, "train.global_batch: expected an integer",
       {"is not a multiple"});
  only({{"model", {{"family", "mamba"}}}}, "model.family: \"mamba\" is not allowed",
       {"gpt2 has no grouped-query attention", "gpt2 ties its head", "position_embedding"});
  only({{"model", {{"max_seq_len", 0}}}}, "model.max_seq_len: 0 is out of range", {"sample.tokens", "train.seq_len"});
  only({{"optimizer", {{"lr", 0}, {"min_lr", 3e-4}}}}, "optimizer.lr: 0", {"optimizer.min_lr"});
  only({{"model", {{"vocab_size", 0}}}, {"data", {{"eod_token", 5}}}}, "model.vocab_size: 0 is out of range",
       {"data.eod_token"});
  only({{"train", {{"steps", -1}}}, {"schedule", {{"warmup_steps", 5}}}}, "train.steps: -1 is out of range",
       {"schedule.warmup_steps"});
  only({{"model", {{"n_layers", 0}}}, {"parallel", {{"pp", 2}}}}, "model.n_layers: 0 is out of range",
       {"parallel.pp"});
  only({{"precision", {{"loss_scale", {{"initial", -1}}}}}}, "precision.loss_scale.initial: -1",
       {"precision.loss_scale.min"});
  // The checks still run between fields that are valid.
  only({{"model", {{"n_kv_heads", 3}}}, {"optimizer", {{"lr", 0}}}}, "model.n_kv_heads: 3 does not divide model.n_heads (4)",
       {});
}

// A field left out whose default derives from a field that failed (ffn_hidden from d_model,
// n_kv_heads from n_heads) holds a stand-in too: the checks across fields skip it as well.
TEST_CASE("config errors do not cascade through a default derived from a field that failed", "[config]") {
  auto base = test::tiny_run_json();
  // tp = 3 divides the heads, kv heads and vocab given here, and the default ffn_hidden of
  // d_model 240 (768), but not the 256 of the stand-in for a bad d_model (1).
  const nlohmann::json model = {
      {"d_model", 240}, {"ffn_hidden", nullptr}, {"n_heads", 6}, {"n_kv_heads", 3}, {"vocab_size", 66}};
  CHECK_NOTHROW(test::make_config(base, {{"model", model}, {"parallel", {{"tp", 3}}}}));
  for (const nlohmann::json& bad : {nlohmann::json(0), nlohmann::json("big"), nlohmann::json(1 << 21)}) {
    nlohmann::json patch = {{"model", model}, {"parallel", {{"tp", 3}}}};
    patch["model"]["d_model"] = bad;
    std::string msg;
    try {
      test::make_config(base, patch);
    } catch (const ConfigError& e) {
      msg = e.what();
    }
    INFO(patch.dump() << "\n" << msg);
    size_t naming_d_model = 0;
    for (size_t at = msg.find("d_model"); at != std::string::npos; at = msg.find("d_model", at + 1)) ++naming_d_model;
    CHECK(naming_d_model == 1);
    CHECK_THAT(msg, Catch::Contains("model.d_model: ") && !Catch::Contains("ffn_hidden"));
  }
  // n_kv_heads left out is n_heads: with n_heads out of range, tp = 2 has nothing real to divide.
  std::string msg;
  try {
    test::make_config(base, {{"model", {{"n_heads", 0}, {"n_kv_heads", nullptr}}}, {"parallel", {{"tp", 2}}}});
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK_THAT(msg, Catch::Contains("model.n_heads: 0 is out of range") && !Catch::Contains("n_kv_heads"));
}

TEST_CASE("a config key given twice in one object is an error naming it and the file", "[config]") {
  test::TempDir tmp("dupkeys");
  const std::string path = tmp / "dup.json";
  std::string text = test::tiny_run_json().dump(2);
  // "lr" twice in optimizer, and "n_layers" twice in model.
  text.replace(text.find("\"lr\""), 4, "\"lr\": 3e-3, \"lr\"");
  text.replace(text.find("\"n_layers\""), 10, "\"n_layers\": 4, \"n_layers\"");
  std::ofstream(path) << text;
  CHECK_THROWS_WITH(load_config(path, {}), Catch::Contains("config file " + path) &&
                                               Catch::Contains("model.n_layers, optimizer.lr are given twice") &&
                                               Catch::Contains("JSON keeps only the last"));
  // The same key in different objects is no duplicate.
  std::ofstream(path) << test::tiny_run_json().dump(2);
  CHECK_NOTHROW(load_config(path, {}));
  nlohmann::json doc = test::tiny_run_json();
  CHECK_THROWS_WITH(apply_override(doc, "sample={\"seed\": 1, \"seed\": 2}"), Catch::Contains("sample.seed is given twice"));
}

TEST_CASE("config overrides (--set) set any field, typed as JSON, bare words as strings", "[config]") {
  nlohmann::json doc = test::tiny_run_json();
  apply_override(doc, "optimizer.lr=3e-4");
  apply_override(doc, "optimizer.min_lr=3e-5");
  apply_override(doc, "precision.mode=fp16");
  apply_override(doc, "schedule.rampup_batch_size=[4,4,64]");
  RunConfig c = parse_config(doc, "x.json");
  CHECK(c.optimizer.lr == 3e-4);
  CHECK(c.precision.mode == PrecisionMode::FP16);
  REQUIRE(c.schedule.rampup);
  CHECK(c.schedule.rampup->increment == 4);
  CHECK_THROWS_WITH(apply_override(doc, "no-equals-sign"), Catch::Contains("key.path=value"));
  // A list or object that is not JSON would become a string (then a glob pattern): refused.
  CHECK_THROWS_WITH(apply_override(doc, "data.train=[/tmp/a.bin]"),
                    Catch::Contains("--set data.train=[/tmp/a.bin]: the value starts like a JSON list or object but is "
                                    "not valid JSON") &&
                        Catch::Contains("--set 'data.train=[\"a.bin\", \"b.bin\"]'"));
  CHECK_THROWS_WITH(apply_override(doc, "sample={interval: 5}"), Catch::Contains("not valid JSON"));
  apply_override(doc, "sample.prompt=\"[INST] hi\"");  // quoted, a string may start with [
  CHECK(doc["sample"]["prompt"] == "[INST] hi");
  apply_override(doc, "description=a [b] c");  // a bare word containing brackets is still a string
  CHECK(doc["description"] == "a [b] c");
  // An empty run directory would fall back to a relative default without a word.
  apply_override(doc, "out=\"\"");
  CHECK_THROWS_WITH(parse_config(doc, "x.json"), Catch::Contains("out: an empty path is not allowed"));
}

// An empty file list turns validation off, as an empty choice_eval.file turns that off: not a
// glob pattern '' that matches no file. Without training files there is nothing to run.
TEST_CASE("config: an empty data.val (--set data.val=) turns validation off, an empty data.train is missing", "[config]") {
  nlohmann::json doc = test::tiny_run_json();
  doc["data"]["val"] = "val_*.bin";
  REQUIRE(parse_config(doc, "x.json").data.val == std::vector<std::string>{"val_*.bin"});
  apply_override(doc, "data.val=");
  CHECK(parse_config(doc, "x.json").data.val.empty());
  apply_override(doc, "data.train=");
  CHECK_THROWS_WITH(parse_config(doc, "x.json"), Catch::Contains("data.train: missing"));
}

// keel convert writes train.init_from "." into the config beside the weights: read from the
// file's folder, the pair may move together. A --set value is a path from the current directory
// like the flag's, and resolve_paths records it absolute.
TEST_CASE("train.init_from: relative in a config file to its folder, from --set to the current directory", "[config][finetune]") {
  namespace fs = std::filesystem;
  test::TempDir tmp("initfrom");
  fs::create_directories(tmp / "ckpt");
  nlohmann::json doc = test::tiny_run_json();
  CHECK(parse_config(doc, "x.json").train.init_from.empty());
  CHECK_FALSE(to_json(parse_config(doc, "x.json"))["train"].contains("init_from"));  // older configs compare equal
  doc["train"]["init_from"] = ".";
  std::ofstream(tmp / "ckpt/config.json") << doc.dump(2);
  const std::string dir = fs::absolute(tmp / "ckpt").lexically_normal().string();
  const RunConfig c = load_config(tmp / "ckpt/config.json");
  CHECK(c.train.init_from == dir);
  CHECK(to_json(c)["train"]["init_from"] == dir);
  CHECK(parse_config(to_json(c), "again").train.init_from == dir);
  // The folder moved: the config still names the weights beside it.
  fs::rename(tmp / "ckpt", tmp / "moved");
  CHECK(load_config(tmp / "moved/config.json").train.init_from ==
        fs::absolute(tmp / "moved").lexically_normal().string());
  // hf:DIR keeps its prefix, its folder read the same way; absolute paths stay as written.
  doc["train"]["init_from"] = "hf:../models/llama";
  std::ofstream(tmp / "moved/config.json") << doc.dump(2);
  CHECK(load_config(tmp / "moved/config.json").train.init_from ==
        "hf:" + fs::absolute(tmp / "models/llama").lexically_normal().string());
  doc["train"]["init_from"] = "/abs/ckpt";
  std::ofstream(tmp / "moved/config.json") << doc.dump(2);
  CHECK(load_config(tmp / "moved/config.json").train.init_from == "/abs/ckpt");
  // --set: relative to where keel starts, as every other path given there.
  RunConfig s = load_config(tmp / "moved/config.json", {"train.init_from=rel/ckpt"});
  CHECK(s.train.init_from == "rel/ckpt");
  resolve_paths(s);
  CHECK(s.train.init_from == fs::absolute("rel/ckpt").lexically_normal().string());
  s = load_config(tmp / "moved/config.json", {"train.init_from=hf:rel/hf"});
  resolve_paths(s);
  CHECK(s.train.init_from == "hf:" + fs::absolute("rel/hf").lexically_normal().string());
  doc["train"]["init_from"] = 3;
  CHECK_THROWS_WITH(parse_config(doc, "x.json"), Catch::Contains("train.init_from: expected a string, got 3"));
}

TEST_CASE("vocab padding: Megatron's make-vocab-size-divisible-by times tp", "[config]") {
  auto c = test::make_config(test::tiny_run_json(), {{"model", {{"vocab_size", 50}, {"pad_vocab_to_multiple_of", 16}}},
                                                      {"parallel", {{"tp", 2}}}});
  CHECK(c.model.vocab_size == 50);
  CHECK(c.model.embed_rows() == 64);
  CHECK_THROWS_WITH(test::make_config(test::tiny_run_json(), {{"model", {{"vocab_size", 63}}}, {"parallel", {{"tp", 2}}}}),
                    Catch::Contains("pad_vocab_to_multiple_of"));
}

TEST_CASE("learning-rate schedule: linear warmup, then cosine / linear / constant decay", "[schedule]") {
  auto c = test::make_config(test::tiny_run_json(), {{"optimizer", {{"lr", 1.0}, {"min_lr", 0.1}}},
                                                      {"schedule", {{"warmup_steps", 10}, {"decay", "cosine"}}},
                                                      {"train", {{"steps", 110}}}});
  CHECK(learning_rate(c, 1) == Approx(0.1));
  CHECK(learning_rate(c, 5) == Approx(0.5));
  CHECK(learning_rate(c, 10) == Approx(1.0));
  CHECK(learning_rate(c, 60) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.5))));
  CHECK(learning_rate(c, 110) == Approx(0.1));
  CHECK(learning_rate(c, 500) == Approx(0.1));  // past the end: stays at min_lr
  c.schedule.decay = DecayStyle::Linear;
  CHECK(learning_rate(c, 60) == Approx(1.0 - 0.9 * 0.5));
  c.schedule.decay = DecayStyle::Constant;
  CHECK(learning_rate(c, 60) == Approx(1.0));
  c.schedule.decay = DecayStyle::Linear;
  c.schedule.decay_steps = 50;
  CHECK(learning_rate(c, 35) == Approx(1.0 - 0.9 * 0.5));
}

TEST_CASE("WSD schedule: warmup, stable at lr, then a cooldown of the chosen shape to min_lr", "[schedule]") {
  // lr 1, min 0.1, warmup 10, 110 steps: the decay window is steps 11-110; the cooldown its last
  // 20 steps (the default fifth), so the lr is 1 through step 90 and p = (step - 90) / 20.
  const nlohmann::json patch = {{"optimizer", {{"lr", 1.0}, {"min_lr", 0.1}}},
                                {"schedule", {{"warmup_steps", 10}, {"decay", "wsd"}}},
                                {"train", {{"steps", 110}}}};
  auto c = test::make_config(test::tiny_run_json(), patch);
  CHECK(c.schedule.decay == DecayStyle::WSD);
  CHECK(learning_rate(c, 5) == Approx(0.5));
  CHECK(learning_rate(c, 11) == 1.0);
  CHECK(learning_rate(c, 90) == 1.0);
  CHECK(learning_rate(c, 95) == Approx(1.0 - 0.9 * 0.25));  // linear by default
  CHECK(learning_rate(c, 100) == Approx(0.55));
  CHECK(learning_rate(c, 110) == Approx(0.1));
  CHECK(learning_rate(c, 300) == Approx(0.1));
  c.schedule.wsd_decay_style = CooldownShape::OneMinusSqrt;
  CHECK(learning_rate(c, 95) == Approx(0.1 + 0.9 * (1 - std::sqrt(0.25))));
  c.schedule.wsd_decay_style = CooldownShape::Cosine;
  CHECK(learning_rate(c, 95) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25))));
  // An explicit cooldown length; extending the run moves only the cooldown, so every step a
  // checkpoint of the stable phase already took keeps its lr.
  nlohmann::json longer = patch;
  longer["schedule"]["wsd_decay_steps"] = 40;
  longer["schedule"]["wsd_decay_style"] = "1-sqrt";
  const auto a = test::make_config(test::tiny_run_json(), longer);
  longer["train"]["steps"] = 1000;
  const auto b = test::make_config(test::tiny_run_json(), longer);
  for (int64_t step = 1; step <= 70; ++step) CHECK(learning_rate(a, step) == learning_rate(b, step));
  CHECK(learning_rate(a, 71) < 1.0);
  CHECK(learning_rate(b, 960) == 1.0);
  CHECK(learning_rate(b, 1000) == Approx(0.1));
  // The resolved config keeps the WSD fields.
  const nlohmann::json j = to_json(a);
  CHECK(j["schedule"]["decay"] == "wsd");
  CHECK(j["schedule"]["wsd_decay_steps"] == 40);
  CHECK(j["schedule"]["wsd_decay_style"] == "1-sqrt");
  CHECK(parse_config(j, "resolved").schedule.wsd_decay_style == CooldownShape::OneMinusSqrt);
}

TEST_CASE("batch-size ramp-up follows Megatron's --rampup-batch-size start incr samples", "[schedule]") {
  // 4 -> 16 in steps of 4 over 120 samples: 3 increments, one every 40 samples.
  auto c = test::make_config(test::tiny_run_json(),
                             {{"train", {{"global_batch", 16}}}, {"schedule", {{"rampup_batch_size", {4, 4, 120}}}}});
  CHECK(global_batch_size(c, 0) == 4);
  CHECK(global_batch_size(c, 39) == 4);
  CHECK(global_batch_size(c, 40) == 8);
  CHECK(global_batch_size(c, 80) == 12);
  CHECK(global_batch_size(c, 120) == 16);
  CHECK(global_batch_size(c, 100000) == 16);
  // 100 samples over 3 increments: one every 33.33 samples, not every 33.
  c.schedule.rampup->samples = 100;
  CHECK(global_batch_size(c, 33) == 4);
  CHECK(global_batch_size(c, 34) == 8);
  CHECK(global_batch_size(c, 66) == 8);
  CHECK(global_batch_size(c, 67) == 12);
  CHECK(global_batch_size(c, 99) == 12);
  CHECK(global_batch_size(c, 100) == 16);
  c.schedule.rampup.reset();
  CHECK(global_batch_size(c, 0) == 16);
}

TEST_CASE("train.recompute: none by default, selective, or full for every layer or the first recompute_layers",
          "[config]") {
  const auto base = test::tiny_run_json();
  const RunConfig none = test::make_config(base);
  CHECK(none.train.recompute == "none");
  CHECK(none.train.recomputed_layers_per_stage() == 0);
  const RunConfig all = test::make_config(base, {{"train", {{"recompute", "full"}}}});
  CHECK(all.train.recomputed_layers_per_stage() == std::numeric_limits<int>::max());
  const RunConfig some = test::make_config(base, {{"train", {{"recompute", "full"}, {"recompute_layers", 1}}}});
  CHECK(some.train.recomputed_layers_per_stage() == 1);
  const nlohmann::json j = to_json(some);
  CHECK(j["train"]["recompute"] == "full");
  CHECK(j["train"]["recompute_layers"] == 1);
  CHECK(parse_config(j, "resolved").train.recomputed_layers_per_stage() == 1);
  const RunConfig selective = test::make_config(base, {{"train", {{"recompute", "selective"}}}});
  CHECK(selective.train.recomputed_layers_per_stage() == 0);  // no layer recomputed whole
  CHECK(parse_config(to_json(selective), "resolved").train.recompute == "selective");
}

// Settings that change nothing in a run are said, not silently ignored; a schedule the run ends
// inside of is allowed (a short trial of a long run's config) and said with where it ends.
TEST_CASE("config notes: settings that change nothing here, and schedules the run ends inside of", "[config]") {
  auto notes_of = [](const nlohmann::json& patch) {
    std::string all;
    for (const std::string& n : config_notes(test::make_config(test::tiny_run_json(), patch))) all += n + "\n";
    return all;
  };
  CHECK(notes_of(nlohmann::json::object()).empty());  // the tiny run: nothing to say
  CHECK_THAT(notes_of({{"parallel", {{"sequence_parallel", true}}}}),
             Catch::Contains("parallel.sequence_parallel is set") && Catch::Contains("parallel.tp is 1"));
  CHECK_THAT(notes_of({{"parallel", {{"embedding_slot", true}}}}),
             Catch::Contains("parallel.embedding_slot is set") && Catch::Contains("parallel.pp is 1"));
  CHECK_THAT(notes_of({{"train", {{"recompute", "full"}, {"recompute_layers", 9}}}}),
             Catch::Contains("train.recompute_layers is 9, more than the at most 2 layers"));
  CHECK(notes_of({{"train", {{"recompute", "full"}, {"recompute_layers", 2}}}}).empty());
  // tiny_run_json: 30 steps, lr 1e-2
  CHECK_THAT(notes_of({{"schedule", {{"warmup_steps", 50}}}}),
             Catch::Contains("schedule.warmup_steps 50 is more than train.steps 30: the run ends inside the warmup, "
                             "at learning rate 0.006 of optimizer.lr's 0.01"));
  CHECK_THAT(notes_of({{"schedule", {{"warmup_steps", 4}, {"decay_steps", 100}}}}),
             Catch::Contains("schedule.decay_steps 100 reach past train.steps 30"));
  CHECK_THAT(notes_of({{"schedule", {{"decay", "wsd"}, {"wsd_decay_steps", 1000}}}}),
             Catch::Contains("schedule.wsd_decay_steps 1000 is longer than the decay window"));
  CHECK_THAT(notes_of({{"precision", {{"loss_scale", {{"initial", 1024}}}}}}),
             Catch::Contains("precision.loss_scale is set"));
}
