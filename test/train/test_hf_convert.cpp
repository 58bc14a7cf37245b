// Hugging Face checkpoints in and out of keel (train/hf_format.h), against the fixtures of
// scripts/make_hf_fixtures.py: tiny LlamaForCausalLM models saved by transformers (trained fp32
// with GQA and an untied head; random bf16 with tied embeddings and one kv head; random fp16 in
// three shards; Llama 3.1 RoPE scaling), a GPT2LMHeadModel (fp32; Conv1D weights and a fused
// c_attn) and a BloomForCausalLM (bf16; ALiBi over 6 heads, embedding LayerNorm, per-head fused
// query_key_value), with their float64 logits and greedy continuations.
//
// Tolerances: logits ||keel - HF|| / ||HF|| <= 1e-5 per model (keel computes in fp32 from the
// stored weights, HF's oracle in float64: a few 1e-7 in practice); greedy tokens exactly (the
// fixture guarantees a top-1/top-2 gap > 1e-3 at every step). The round trip HF -> keel -> HF
// is compared byte for byte, tensor by tensor.
//
// q_proj / k_proj are copied without any permutation: the logits agreeing proves that keel's
// RoPE pairs dims (i, i + head_dim/2) exactly as HF's rotate_half does.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/checkpoint_meta.h"
#include "common/error_of.h"
#include "common/fixture.h"
#include "common/hf_weights.h"
#include "common/workspace.h"
#include "common/temp_dir.h"
#include "data/sampler.h"
#include "model/generator.h"
#include "train/hf_format.h"
#include "train/trainer.h"

using namespace keel;
namespace fs = std::filesystem;
using json = nlohmann::json;
using test::error_of;

namespace {

const std::string kHf = test::hf_fixture_dir();
using Expected = test::HfExpected;
using test::hf_expected;

using test::hf_weights;

std::vector<float> weights_from_keel(const Checkpoint& ck, const ParamTable& table) {
  std::vector<float> w(static_cast<size_t>(table.local_numel()));
  for (const ParamSpec& p : table.params()) {
    auto v = ck.read_full("weight", p.name);
    std::copy(v.begin(), v.end(), w.begin() + p.offset);
  }
  return w;
}

// keel's logits for the fixture tokens and its greedy continuation, against HF's.
void check_outputs(const std::string& name, const ParamTable& table, std::vector<float>& weights) {
  const Expected e = hf_expected(name);
  auto be = make_cpu_backend();
  Generator gen(table, *be, Tensor(weights.data(), DType::F32, {table.local_numel()}), 64);
  const auto ids = e.meta["logits_tokens"].get<std::vector<int32_t>>();
  const auto logits = gen.forward(ids.data(), static_cast<int>(ids.size()), /*all_rows=*/true);
  REQUIRE(logits.size() == e.logits.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    num += (static_cast<double>(logits[i]) - e.logits[i]) * (static_cast<double>(logits[i]) - e.logits[i]);
    den += static_cast<double>(e.logits[i]) * e.logits[i];
  }
  const double rel = std::sqrt(num / den);
  INFO(name << ": logits relative error vs HF float64 " << rel);
  CHECK(rel <= 1e-5);

  GenerateOptions g;
  g.max_new_tokens = 16;
  g.sampling.temperature = 0;
  const auto prompt = e.meta["greedy"]["prompt_ids"].get<std::vector<int32_t>>();
  CHECK(generate(gen, prompt, g) == e.meta["greedy"]["new_ids"].get<std::vector<int32_t>>());
}

// Every tensor of an HF directory: name -> (dtype, shape, bytes).
struct TensorBytes {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};
std::map<std::string, TensorBytes> all_tensors(const std::string& dir) {
  std::map<std::string, TensorBytes> out;
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".safetensors") continue;
    auto r = data::SafetensorsReader::open(f.path().string());
    for (const auto& t : r.tensors()) {
      auto b = r.bytes(t);
      out[t.name] = {std::string(data::safetensors_dtype_name(t.dtype)), t.shape,
                     std::vector<char>(reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(b.data()) + b.size())};
    }
  }
  return out;
}


}  // namespace

TEST_CASE("hf: config.json maps to keel's model (GQA, tied head, rope_theta, eps, shards)", "[hf]") {
  const HfCheckpoint a = HfCheckpoint::open("hf:" + kHf + "llama_trained");
  CHECK(a.model().n_heads == 4);
  CHECK(a.model().n_kv_heads == 2);
  CHECK(a.model().d_model == 48);
  CHECK_FALSE(a.model().tied_embeddings);
  CHECK(a.model().vocab_size == 512);
  CHECK(a.common_dtype() == DType::F32);
  CHECK(a.hf_name("layers.1.attn.wk") == "model.layers.1.self_attn.k_proj.weight");
  const HfCheckpoint b = HfCheckpoint::open(kHf + "llama_tied");
  CHECK(b.model().tied_embeddings);
  CHECK(b.model().n_kv_heads == 1);
  CHECK(b.model().rope_theta == 500000.0f);
  CHECK(b.model().norm_eps == 1e-6f);
  CHECK(b.common_dtype() == DType::BF16);
  const HfCheckpoint c = HfCheckpoint::open(kHf + "llama_sharded");
  CHECK(c.num_files() == 3);
  CHECK(c.common_dtype() == DType::F16);
  CHECK(c.model().n_layers == 3);
  CHECK(c.model().rope_scaling.kind == RopeScaling::Kind::None);
  const HfCheckpoint d = HfCheckpoint::open(kHf + "llama3_rope");
  const RopeScaling& s = d.model().rope_scaling;
  CHECK(s.kind == RopeScaling::Kind::Llama3);
  CHECK(s.factor == 8.0);
  CHECK(s.low_freq_factor == 1.0);
  CHECK(s.high_freq_factor == 4.0);
  CHECK(s.original_max_position == 64);

  const HfCheckpoint g = HfCheckpoint::open(kHf + "gpt2_tied");
  CHECK(g.arch() == HfArch::GPT2);
  CHECK(g.model().is_gpt2());
  CHECK(g.model().learned_positions());
  CHECK(g.model().tied_embeddings);
  CHECK(g.model().max_seq_len == 64);
  CHECK(g.model().ffn_hidden == 128);  // n_inner null: 4 x n_embd
  CHECK(g.model().n_kv_heads == 4);
  CHECK(g.hf_name("layers.1.attn.wk") == "transformer.h.1.attn.c_attn.weight");
  CHECK(g.hf_name("pos_embed") == "transformer.wpe.weight");
  const HfCheckpoint bl = HfCheckpoint::open(kHf + "bloom_bf16");
  CHECK(bl.arch() == HfArch::Bloom);
  CHECK(bl.model().alibi);
  CHECK(bl.model().embedding_norm);
  CHECK(bl.model().ffn_hidden == 192);
  CHECK(bl.model().n_heads == 6);
  CHECK(bl.model().max_seq_len == 2048);
  CHECK(bl.common_dtype() == DType::BF16);
  CHECK(bl.hf_name("embed_norm.bias") == "transformer.word_embeddings_layernorm.bias");
  CHECK(bl.hf_name("layers.0.attn.bv") == "transformer.h.0.self_attention.query_key_value.bias");
  REQUIRE(bl.notes().size() == 1);
  CHECK_THAT(bl.notes()[0], Catch::Contains("ALiBi has no position limit: model.max_seq_len 2048"));
  const HfCheckpoint q2 = HfCheckpoint::open(kHf + "qwen2_bf16");
  CHECK(q2.arch() == HfArch::Qwen2);
  CHECK(q2.model().is_llama());
  CHECK(q2.model().qkv_bias);
  CHECK(q2.model().tied_embeddings);
  CHECK(q2.model().rope_theta == 1e6f);
  CHECK(q2.model().n_kv_heads == 2);
  CHECK(q2.hf_name("layers.1.attn.bk") == "model.layers.1.self_attn.k_proj.bias");
  CHECK(q2.common_dtype() == DType::BF16);
  const HfCheckpoint q3 = HfCheckpoint::open(kHf + "qwen3_fp32");
  CHECK(q3.arch() == HfArch::Qwen3);
  CHECK(q3.model().qk_norm);
  CHECK_FALSE(q3.model().qkv_bias);
  CHECK(q3.model().head_dim() == 16);  // 4 heads of 16 on a hidden size of 32
  CHECK(q3.model().q_dim() == 64);
  CHECK(q3.hf_name("layers.0.attn.k_norm.weight") == "model.layers.0.self_attn.k_norm.weight");
  CHECK(q3.model().sliding_window == 0);  // use_sliding_window false
  const HfCheckpoint mi = HfCheckpoint::open(kHf + "mistral_bf16");
  CHECK(mi.arch() == HfArch::Mistral);
  CHECK(mi.model().is_llama());
  CHECK(mi.model().sliding_window == 6);
  CHECK_FALSE(mi.model().qkv_bias);
  CHECK(mi.hf_name("layers.1.attn.wk") == "model.layers.1.self_attn.k_proj.weight");
}

// Which HF configs give keel's sliding window (every layer, or none) and which are refused: a
// Mistral's sliding_window (null: none); a Qwen's only with use_sliding_window, in the layers
// layer_types marks (else those from max_window_layers on); and exported configs read back.
TEST_CASE("hf: sliding windows from Mistral and Qwen configs, and back", "[hf][window]") {
  auto open = [](const std::string& name, const std::function<void(json&)>& f) {
    std::ifstream in(kHf + name + "/config.json");
    json c = json::parse(in);
    f(c);
    return c;
  };
  auto window_of = [&](const std::string& name, const std::function<void(json&)>& f) {
    return model_config_from_hf(open(name, f), "config.json").sliding_window;
  };
  auto error = [&](const std::string& name, const std::function<void(json&)>& f) {
    return error_of([&] { model_config_from_hf(open(name, f), "config.json"); });
  };
  CHECK(window_of("mistral_bf16", [](json&) {}) == 6);
  CHECK(window_of("mistral_bf16", [](json& c) { c["sliding_window"] = nullptr; }) == 0);  // Mistral v0.2 on
  CHECK(window_of("mistral_bf16", [](json& c) { c.erase("sliding_window"); }) == 0);
  CHECK_THAT(error("mistral_bf16", [](json& c) { c["sliding_window"] = 0; }),
             Catch::Contains("sliding_window 0 is not a positive integer"));
  // A Llama ignores the field in transformers: refused rather than silently dropped or applied.
  CHECK_THAT(error("llama_tied", [](json& c) { c["sliding_window"] = 4096; }),
             Catch::Contains("(LlamaForCausalLM)") && Catch::Contains("sliding_window 4096") &&
                 Catch::Contains("MistralForCausalLM"));
  for (const char* qwen : {"qwen2_bf16", "qwen3_fp32"}) {
    INFO(qwen);
    CHECK(window_of(qwen, [](json& c) { c["sliding_window"] = 64; }) == 0);  // use_sliding_window false
    CHECK(window_of(qwen, [](json& c) {
            c["use_sliding_window"] = true;
            c["sliding_window"] = 64;
            c["layer_types"] = {"sliding_attention", "sliding_attention"};
          }) == 64);
    CHECK(window_of(qwen, [](json& c) {
            c["use_sliding_window"] = true;
            c["sliding_window"] = 64;
            c["layer_types"] = {"full_attention", "full_attention"};
          }) == 0);
    CHECK(window_of(qwen, [](json& c) {  // no layer_types: layers >= max_window_layers
            c["use_sliding_window"] = true;
            c["sliding_window"] = 64;
            c.erase("layer_types");
            c["max_window_layers"] = 0;
          }) == 64);
    CHECK(window_of(qwen, [](json& c) {
            c["use_sliding_window"] = true;
            c["sliding_window"] = 64;
            c.erase("layer_types");
            c["max_window_layers"] = 28;  // transformers' default: beyond these 2 layers
          }) == 0);
    CHECK_THAT(error(qwen, [](json& c) {
                 c["use_sliding_window"] = true;
                 c["sliding_window"] = 4096;
                 c["layer_types"] = {"full_attention", "sliding_attention"};
               }),
               Catch::Contains("sliding_window attention in 1 of 2 layers") &&
                   Catch::Contains("applies to every layer"));
    CHECK_THAT(error(qwen, [](json& c) {
                 c["use_sliding_window"] = true;
                 c["sliding_window"] = 64;
                 c.erase("layer_types");
                 c["max_window_layers"] = 1;
               }),
               Catch::Contains("sliding_window attention in 1 of 2 layers"));
    CHECK_THAT(error(qwen, [](json& c) {
                 c["use_sliding_window"] = true;
                 c["layer_types"] = {"chunked_attention", "full_attention"};
               }),
               Catch::Contains("layer_types holds \"chunked_attention\" layers"));
  }

  // Export: the architecture that carries the window, and a config that reads back with it.
  for (const char* name : {"llama_tied", "qwen2_bf16", "qwen3_fp32"}) {
    INFO(name);
    ModelConfig m = HfCheckpoint::open(kHf + name).model();
    m.sliding_window = 7;
    const HfArch arch = hf_arch_for(m, "checkpoint X");
    CHECK(arch == (m.qkv_bias ? HfArch::Qwen2 : m.qk_norm ? HfArch::Qwen3 : HfArch::Mistral));
    const json c = hf_config_json(m, arch, json(), DType::BF16);
    CHECK(model_config_from_hf(c, "exported").sliding_window == 7);
    if (arch != HfArch::Mistral) {
      CHECK(c["use_sliding_window"] == true);
      CHECK(c["layer_types"] == json({"sliding_attention", "sliding_attention"}));
    }
    m.sliding_window = 0;
    CHECK(hf_arch_for(m, "checkpoint X") == (m.qkv_bias ? HfArch::Qwen2 : m.qk_norm ? HfArch::Qwen3 : HfArch::Llama));
    CHECK(model_config_from_hf(hf_config_json(m, hf_arch_for(m, "X"), json(), DType::BF16), "exported")
              .sliding_window == 0);
  }
  // Mistral v0.2 on (no window) is a Llama to keel, and goes back as the Mistral it was.
  test::TempDir tmp("hfwin");
  fs::copy(kHf + "mistral_bf16", tmp / "v02", fs::copy_options::recursive);
  {
    json c = open("mistral_bf16", [](json& c) { c["sliding_window"] = nullptr; });
    std::ofstream(tmp / "v02/config.json") << c.dump(2);
  }
  convert_hf_to_keel(tmp / "v02", tmp / "keel", std::nullopt, false);
  export_keel_to_hf(tmp / "keel", tmp / "back", ExportOptions{});
  std::ifstream back_in(tmp / "back/config.json");
  const json back = json::parse(back_in);
  CHECK(back["architectures"] == json({"MistralForCausalLM"}));
  CHECK(back["model_type"] == "mistral");
  CHECK(back["sliding_window"].is_null());

  ModelConfig g = HfCheckpoint::open(kHf + "gpt2_tied").model();
  g.sliding_window = 7;
  CHECK_THAT(error_of([&] { hf_arch_for(g, "checkpoint X"); }),
             Catch::Contains("checkpoint X holds a gpt2 model with a sliding window (model.sliding_window 7)"));
}

// GPT-2's Conv1D weights (read transposed, a column block of c_attn) and BLOOM's per-head fused
// query_key_value: every keel tensor read whole equals the HF tensor taken apart by hand, and
// every rectangle a tensor-parallel rank or a flat ZeRO range asks for is the same slice of it.
TEST_CASE("hf: fused and transposed tensors read as keel's, whole and by TP rectangles", "[hf]") {
  auto hf_tensor = [](const std::string& dir, const std::string& name) {  // as stored, in fp32
    auto r = data::SafetensorsReader::open(kHf + dir + "/model.safetensors");
    for (const auto& t : r.tensors())
      if (t.name == name) {
        const bool bf16 = t.dtype == data::SafetensorsDtype::BF16;
        auto b = r.bytes(t);
        std::vector<float> v(b.size() / (bf16 ? 2 : 4));
        for (size_t i = 0; i < v.size(); ++i) {
          uint16_t h;
          if (bf16) std::memcpy(&h, b.data() + 2 * i, 2), v[i] = bf16_to_f32(h);
          else std::memcpy(&v[i], b.data() + 4 * i, 4);
        }
        return v;
      }
    FAIL("no tensor " << name);
    return std::vector<float>{};
  };
  auto read_keel = [](const HfCheckpoint& hf, const std::string& name, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    hf.read_full(name, shape, DType::F32, v.data());
    return v;
  };

  {  // GPT-2: wk = columns [d, 2d) of c_attn [d, 3d], transposed; bk = bias[d:2d]; w_fc = c_fc^T.
    const HfCheckpoint hf = HfCheckpoint::open(kHf + "gpt2_tied");
    const int64_t d = 32, f = 128;
    const auto c_attn = hf_tensor("gpt2_tied", "transformer.h.1.attn.c_attn.weight");
    const auto c_attn_b = hf_tensor("gpt2_tied", "transformer.h.1.attn.c_attn.bias");
    const auto c_fc = hf_tensor("gpt2_tied", "transformer.h.1.mlp.c_fc.weight");
    const auto wk = read_keel(hf, "layers.1.attn.wk", {d, d});
    const auto bk = read_keel(hf, "layers.1.attn.bk", {d});
    const auto w_fc = read_keel(hf, "layers.1.mlp.w_fc", {f, d});
    int bad = 0;
    for (int64_t r = 0; r < d; ++r) {
      bad += bk[r] != c_attn_b[d + r];
      for (int64_t c = 0; c < d; ++c) bad += wk[r * d + c] != c_attn[c * 3 * d + d + r];
    }
    for (int64_t r = 0; r < f; ++r)
      for (int64_t c = 0; c < d; ++c) bad += w_fc[r * d + c] != c_fc[c * f + r];
    CHECK(bad == 0);
  }
  {  // BLOOM: wv row (n, i) = query_key_value row (3n + 2) hd + i.
    const HfCheckpoint hf = HfCheckpoint::open(kHf + "bloom_bf16");
    const int64_t d = 48, hd = 8;
    const auto qkv = hf_tensor("bloom_bf16", "transformer.h.0.self_attention.query_key_value.weight");
    const auto qkv_b = hf_tensor("bloom_bf16", "transformer.h.0.self_attention.query_key_value.bias");
    const auto wv = read_keel(hf, "layers.0.attn.wv", {d, d});
    const auto bq = read_keel(hf, "layers.0.attn.bq", {d});
    int bad = 0;
    for (int64_t n = 0; n < 6; ++n)
      for (int64_t i = 0; i < hd; ++i) {
        bad += bq[n * hd + i] != qkv_b[3 * n * hd + i];
        for (int64_t c = 0; c < d; ++c) bad += wv[(n * hd + i) * d + c] != qkv[((3 * n + 2) * hd + i) * d + c];
      }
    CHECK(bad == 0);
  }

  // Every TP rank's shard (rows or columns) and ZeRO-style flat ranges cutting rows in two: the
  // rectangles read are the same elements as the whole tensor's.
  for (const char* name : {"gpt2_tied", "bloom_bf16", "llama_trained"}) {
    const HfCheckpoint hf = HfCheckpoint::open(kHf + name);
    const ParamTable full(hf.model());
    const std::vector<float> whole = hf_weights(hf, full);
    for (int tp : {2, 4}) {
      if (hf.model().n_heads % tp != 0 || hf.model().n_kv_heads % tp != 0 || hf.model().vocab_size % tp != 0) continue;
      for (int rank = 0; rank < tp; ++rank) {
        ModelShard shard;
        shard.tp_rank = rank;
        shard.tp_size = tp;
        const ParamTable table(hf.model(), shard);
        std::vector<float> local(static_cast<size_t>(table.local_numel()), NAN);
        for (const ParamSpec& p : table.params()) {
          const int64_t cut = p.offset + p.numel / 3 + 1;  // two flat ranges meeting mid-row
          for (auto [begin, end] : {std::pair{p.offset, cut}, std::pair{cut, p.offset + p.numel}})
            for (const TensorRegion& r : flat_range_regions(p, begin, end))
              hf.read(p.name, r, DType::F32, local.data() + r.flat_begin);
        }
        int bad = 0;
        for (const ParamSpec& p : table.params()) {
          const ParamSpec& q = full.at(p.name);
          const int64_t rows = p.local_shape[0], cols = p.local_shape.size() > 1 ? p.local_shape[1] : 1;
          const int64_t full_cols = q.shape.size() > 1 ? q.shape[1] : 1;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
              const int64_t fr = p.split == TpSplit::Rows ? p.shard_begin + r : r;
              const int64_t fc = p.split == TpSplit::Cols ? p.shard_begin + c : c;
              bad += local[p.offset + r * cols + c] != whole[q.offset + fr * full_cols + fc];
            }
        }
        INFO(name << " tp=" << tp << " rank " << rank);
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("hf: keel's Llama 3 RoPE frequencies are HF's fp32 bits", "[hf][rope]") {
  // The fixture's head_dim 16 puts its 8 frequencies in all three bands: kept (wavelength
  // under 64/4), interpolated, and divided by the factor (over 64/1).
  const HfCheckpoint hf = HfCheckpoint::open(kHf + "llama3_rope");
  const std::vector<float> ours = rope_inv_freq(hf.model().head_dim(), hf.model().rope());
  const json bits = hf_expected("llama3_rope").meta.at("rope_inv_freq_fp32_bits");
  REQUIRE(ours.size() == bits.size());
  REQUIRE(ours.size() == 8);
  for (size_t i = 0; i < ours.size(); ++i) {
    INFO("inv_freq[" << i << "] = " << ours[i]);
    CHECK(std::bit_cast<int32_t>(ours[i]) == bits[i].get<int32_t>());
  }
  // Not the unscaled frequencies: the low band is divided by 8, the middle one interpolated.
  const std::vector<float> plain = rope_inv_freq(hf.model().head_dim(), Rope(hf.model().rope_theta));
  CHECK(ours[0] == plain[0]);
  CHECK(ours[7] == plain[7] / 8.0f);
  CHECK((ours[1] < plain[1] && ours[1] > plain[1] / 8.0f));
}

TEST_CASE("hf: converted models reproduce HF's logits and greedy tokens", "[hf]") {
  for (const char* name :
       {"llama_trained", "llama_tied", "llama_sharded", "llama3_rope", "gpt2_tied", "bloom_bf16", "qwen2_bf16",
        "qwen3_fp32", "mistral_bf16"}) {
    SECTION(name) {
      const HfCheckpoint hf = HfCheckpoint::open(kHf + name);
      const ParamTable table(hf.model());
      auto direct = hf_weights(hf, table);
      check_outputs(name, table, direct);

      // Through a keel checkpoint on disk: the same values, so the same outputs.
      test::TempDir tmp("hfconv");
      const std::string out = tmp / "ckpt";
      const ConvertStats st = convert_hf_to_keel(kHf + name, out, std::nullopt, false);
      CHECK(st.tensors == static_cast<int64_t>(table.params().size()));
      CHECK(st.dtype == hf.common_dtype());
      const Checkpoint ck = Checkpoint::open(out);
      CHECK(ck.verify().empty());
      CHECK(ck.states() == std::vector<std::string>{"weight"});
      CHECK(ck.stored_dtype("weight", "tok_embed") == hf.common_dtype());
      auto via_keel = weights_from_keel(ck, table);
      CHECK(via_keel == direct);
      check_outputs(name, table, via_keel);
      for (const char* f : {"config.json", "hf_config.json", "tokenizer.json", "generation_config.json"})
        CHECK(fs::exists(fs::path(out) / f));
      // The run config it wrote is valid and describes the model.
      RunConfig cfg = load_config(out + "/config.json");
      CHECK(cfg.train.init_from == fs::absolute(out).lexically_normal().string());  // "." beside the weights
      CHECK(cfg.model.d_model == hf.model().d_model);
      CHECK(cfg.model.tied_embeddings == hf.model().tied_embeddings);
      CHECK(cfg.model.rope_theta == hf.model().rope_theta);
      CHECK(cfg.model.rope_scaling == hf.model().rope_scaling);
      CHECK(cfg.model.norm_eps == hf.model().norm_eps);
      CHECK(cfg.model.family == hf.model().family);
      CHECK(cfg.model.ffn_hidden == hf.model().ffn_hidden);
      CHECK(cfg.model.max_seq_len == hf.model().max_seq_len);
      CHECK(cfg.model.position_embedding() == hf.model().position_embedding());
      CHECK(cfg.model.embedding_norm == hf.model().embedding_norm);
      CHECK(cfg.model.qkv_bias == hf.model().qkv_bias);
      CHECK(cfg.model.qk_norm == hf.model().qk_norm);
      CHECK(cfg.model.head_dim() == hf.model().head_dim());
      CHECK(cfg.model.sliding_window == hf.model().sliding_window);
    }
  }
}

// Export with the default dtype (--dtype auto) writes the HF model's own dtype back: fp32, bf16
// and fp16 sources all come back bit for bit.
TEST_CASE("hf: HF -> keel -> HF is bit for bit, sharded or not", "[hf]") {
  struct Case {
    const char* name;
    DType dtype;  // the HF model's
    int64_t shard;
  };
  for (Case c : {Case{"llama_trained", DType::F32, int64_t{5} << 30}, Case{"llama_tied", DType::BF16, int64_t{5} << 30},
                 Case{"llama_sharded", DType::F16, 30000}, Case{"llama3_rope", DType::F32, int64_t{5} << 30},
                 Case{"gpt2_tied", DType::F32, int64_t{5} << 30}, Case{"bloom_bf16", DType::BF16, 20000},
                 Case{"qwen2_bf16", DType::BF16, int64_t{5} << 30}, Case{"qwen3_fp32", DType::F32, 40000},
                 Case{"mistral_bf16", DType::BF16, int64_t{5} << 30}}) {
    SECTION(c.name) {
      test::TempDir tmp("hfrt");
      convert_hf_to_keel(kHf + c.name, tmp / "keel", std::nullopt, false);
      ExportOptions opts;  // dtype auto
      opts.max_shard_bytes = c.shard;
      const ConvertStats st = export_keel_to_hf(tmp / "keel", tmp / "hf", opts);
      CHECK(st.dtype == c.dtype);
      const auto before = all_tensors(kHf + c.name), after = all_tensors(tmp / "hf");
      REQUIRE(before.size() == after.size());
      for (const auto& [name, t] : before) {
        INFO(c.name << ": " << name);
        REQUIRE(after.count(name));
        CHECK(after.at(name).dtype == t.dtype);
        CHECK(after.at(name).shape == t.shape);
        CHECK(after.at(name).bytes == t.bytes);
      }
      CHECK(fs::exists(tmp / "hf/tokenizer.json"));
      const bool sharded = c.shard < (int64_t{1} << 20);
      CHECK(fs::exists(tmp / "hf/model.safetensors.index.json") == sharded);
      // The exported config is the HF one with the model fields: it opens as the same model,
      // and every field transformers reads is as it was.
      const HfCheckpoint back = HfCheckpoint::open(tmp / "hf"), orig = HfCheckpoint::open(kHf + c.name);
      CHECK(back.arch() == orig.arch());
      CHECK(back.model().rope_theta == orig.model().rope_theta);
      CHECK(back.model().rope_scaling == orig.model().rope_scaling);
      CHECK(back.model().max_seq_len == orig.model().max_seq_len);
      json a = back.config_json(), b = orig.config_json();
      for (json* j : {&a, &b})
        for (const char* volatile_field : {"torch_dtype", "transformers_version", "seq_length"}) j->erase(volatile_field);
      CHECK(a.dump(1) == b.dump(1));
      CHECK(st.tensors == static_cast<int64_t>(before.size()));
    }
  }
}

TEST_CASE("hf: unsupported configs, missing, unexpected and misshapen tensors give errors naming them", "[hf]") {
  test::TempDir tmp("hferr");
  auto copy = [&](const std::string& to) {
    fs::copy(kHf + "llama_tied", tmp / to, fs::copy_options::recursive);
    return tmp / to;
  };
  auto edit_config = [&](const std::string& dir, const std::function<void(json&)>& f) {
    std::ifstream in(dir + "/config.json");
    json c = json::parse(in);
    f(c);
    std::ofstream(dir + "/config.json") << c.dump(2);
  };

  std::string d = copy("gemma");
  edit_config(d, [](json& c) { c["architectures"] = {"GemmaForCausalLM"}; c["model_type"] = "gemma"; });
  CHECK_THAT(error_of([&] { HfCheckpoint::open(d); }),
             Catch::Contains("GemmaForCausalLM") && Catch::Contains("gemma") && Catch::Contains("not supported"));
  // Qwen2 with a sliding window in some layers only (the whole matrix: "[window]" above).
  d = copy("qwen2_swa");
  edit_config(d, [](json& c) {
    c["architectures"] = {"Qwen2ForCausalLM"};
    c["model_type"] = "qwen2";
    c["use_sliding_window"] = true;
    c["sliding_window"] = 4096;
    c["layer_types"] = {"full_attention", "sliding_attention"};
  });
  CHECK_THAT(error_of([&] { HfCheckpoint::open(d); }), Catch::Contains("sliding_window attention in 1 of 2 layers"));

  d = copy("scaled");
  edit_config(d, [](json& c) {
    c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 500000.0}, {"factor", 8.0}};
    c["attention_bias"] = true;
  });
  std::string msg = error_of([&] { HfCheckpoint::open(d); });
  CHECK_THAT(msg, Catch::Contains("\"yarn\" (RoPE scaling) is not supported") && Catch::Contains("attention_bias"));
  // A rope_scaling beside transformers 5's "default" rope_parameters is applied by transformers:
  // read too (was: ignored, a model converted without its scaling).
  d = copy("scaled_both");
  edit_config(d, [](json& c) {
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
    c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  });
  CHECK_THAT(error_of([&] { HfCheckpoint::open(d); }),
             Catch::Contains("rope_scaling type \"linear\" (RoPE scaling) is not supported"));
  edit_config(d, [](json& c) {
    c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  });
  CHECK(HfCheckpoint::open(d).model().rope_scaling.kind == RopeScaling::Kind::Llama3);
  edit_config(d, [](json& c) {  // two scalings that disagree: neither is picked
    c["rope_parameters"] = c["rope_scaling"];
    c["rope_parameters"]["factor"] = 4.0;
  });
  CHECK_THAT(error_of([&] { HfCheckpoint::open(d); }),
             Catch::Contains("rope_parameters and rope_scaling give two different RoPE scalings"));
  d = copy("llama3_partial");  // llama3 scaling without its parameters: named, not defaulted
  edit_config(d, [](json& c) { c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}}; });
  msg = error_of([&] { HfCheckpoint::open(d); });
  CHECK_THAT(msg, Catch::Contains("lacks the number \"low_freq_factor\"") &&
                      Catch::Contains("lacks the number \"original_max_position_embeddings\""));
  CHECK_THAT(msg, !Catch::Contains("lacks the number \"factor\""));

  d = copy("shape");
  edit_config(d, [](json& c) { c["intermediate_size"] = 80; });
  msg = error_of([&] { HfCheckpoint::open(d); });
  CHECK_THAT(msg, Catch::Contains("model.layers.0.mlp.gate_proj.weight (keel layers.0.mlp.w_gate) has shape [64, 32], "
                                  "the config implies [80, 32]"));

  // A file without one tensor and with one the model has no place for.
  d = copy("tensors");
  {
    auto r = data::SafetensorsReader::open(d + "/model.safetensors");
    std::vector<data::SafetensorsTensorToWrite> ts;
    std::vector<float> bias(32, 0.0f);
    for (const auto& t : r.tensors())
      if (t.name != "model.layers.1.mlp.up_proj.weight") ts.push_back({t.name, t.dtype, t.shape, r.bytes(t).data()});
    ts.push_back({"model.layers.0.self_attn.q_proj.bias", data::SafetensorsDtype::F32, {32}, bias.data()});
    data::write_safetensors(d + "/model.safetensors.new", ts, {{"format", "pt"}});
  }
  fs::rename(d + "/model.safetensors.new", d + "/model.safetensors");
  msg = error_of([&] { HfCheckpoint::open(d); });
  CHECK_THAT(msg, Catch::Contains("tensor model.layers.1.mlp.up_proj.weight [64, 32] is missing") &&
                      Catch::Contains("unexpected tensor model.layers.0.self_attn.q_proj.bias [32]"));

  CHECK_THAT(error_of([&] { HfCheckpoint::open(tmp / "nothing"); }), Catch::Contains("no such directory"));
  fs::create_directories(tmp / "empty");
  CHECK_THAT(error_of([&] { HfCheckpoint::open(tmp / "empty"); }), Catch::Contains("no config.json"));

  // The destination is never overwritten silently.
  fs::create_directories(tmp / "taken");
  CHECK_THAT(error_of([&] { convert_hf_to_keel(kHf + "llama_tied", tmp / "taken", std::nullopt, false); }),
             Catch::Contains("already exists"));
  // Nor replaced when it is the input (or holds it), even with force: that would destroy it.
  d = copy("self");
  CHECK_THAT(error_of([&] { convert_hf_to_keel(d, d, std::nullopt, true); }), Catch::Contains("would replace the input"));
  CHECK_THAT(error_of([&] { convert_hf_to_keel(d, tmp.path.string(), std::nullopt, true); }), Catch::Contains("would replace the input"));
  CHECK(fs::exists(d + "/model.safetensors"));
  ExportOptions over;
  over.force = true;
  over.like = d;
  convert_hf_to_keel(d, tmp / "self_keel", std::nullopt, false);
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", d, over); }), Catch::Contains("would replace the input"));
  CHECK(fs::exists(d + "/model.safetensors"));
  // Without --like, the folder the checkpoint was converted from (meta.json source.path) is an
  // input all the same: "put it back where it came from" would replace the original weights.
  const auto original = all_tensors(d);
  over.like.clear();
  over.dtype = DType::F32;  // an overwrite would show as F32 tensors
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", d, over); }),
             Catch::Contains("would replace the Hugging Face model") && Catch::Contains("comes from"));
  const auto after = all_tensors(d);
  REQUIRE(after.size() == original.size());
  for (const auto& [name, t] : original) CHECK(after.at(name).bytes == t.bytes);
  CHECK(after.begin()->second.dtype == "BF16");

  // --force replaces an earlier output of the same kind, never other files (a run directory, a
  // typo for a folder in one), and never writes inside an input.
  std::ofstream(tmp / "taken/notes.txt") << "mine";
  CHECK_THAT(error_of([&] { convert_hf_to_keel(kHf + "llama_tied", tmp / "taken", std::nullopt, true); }),
             Catch::Contains("exists and is a folder holding notes.txt: --force replaces only an earlier keel "
                             "checkpoint"));
  CHECK(fs::exists(tmp / "taken/notes.txt"));
  CHECK_THAT(error_of([&] { convert_hf_to_keel(d, d + "/sub", std::nullopt, true); }),
             Catch::Contains("is inside the input " + d));
  over.like = d;
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", tmp / "self_keel/sub", over); }),
             Catch::Contains("is inside the input"));
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", tmp / "taken", over); }),
             Catch::Contains("--force replaces only an earlier Hugging Face model folder"));
  CHECK(fs::exists(tmp / "taken/notes.txt"));
  convert_hf_to_keel(d, tmp / "self_keel", std::nullopt, true);  // an earlier checkpoint: replaced
  export_keel_to_hf(tmp / "self_keel", tmp / "exported", over);
  export_keel_to_hf(tmp / "self_keel", tmp / "exported", over);  // an earlier export: replaced
  // An earlier output that the user added to (a model card, an adapter, results) is theirs now:
  // refused, naming what keel would not have written (was: all of it removed with the output).
  std::ofstream(tmp / "exported/README.md") << "card";
  std::ofstream(tmp / "exported/adapter_model.safetensors") << "lora";
  fs::create_directories(tmp / "exported/eval_results");
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", tmp / "exported", over); }),
             Catch::Contains("--force replaces only an earlier Hugging Face model folder (config.json and "
                             "*.safetensors), holding nothing keel does not write there (not README.md, "
                             "adapter_model.safetensors, eval_results/)"));
  CHECK(fs::exists(tmp / "exported/README.md"));
  CHECK(fs::exists(tmp / "exported/adapter_model.safetensors"));
  CHECK(fs::exists(tmp / "exported/model.safetensors"));
  std::ofstream(tmp / "self_keel/NOTES.md") << "mine";
  CHECK_THAT(error_of([&] { convert_hf_to_keel(d, tmp / "self_keel", std::nullopt, true); }),
             Catch::Contains("holding nothing keel does not write there (not NOTES.md)"));
  CHECK(fs::exists(tmp / "self_keel/NOTES.md"));
  fs::remove(tmp / "self_keel/NOTES.md");
  for (const char* f : {"README.md", "adapter_model.safetensors", "eval_results"}) fs::remove(fs::path(tmp / "exported") / f);
  CHECK_THAT(error_of([&] { convert_hf_to_keel(kHf + "llama_tied", tmp / "exported", std::nullopt, true); }),
             Catch::Contains("--force replaces only an earlier keel checkpoint"));

  // A step_* folder among a run's checkpoints (a `latest` beside it) would pass for one of its
  // saves (rotation, resume): refused, either way and forced or not.
  fs::create_directories(tmp / "run/checkpoints");
  std::ofstream(tmp / "run/checkpoints/latest") << "step_00000004\n";
  const std::string named = tmp / "run/checkpoints/step_00000007";
  for (const bool force : {false, true}) {
    CHECK_THAT(error_of([&] { convert_hf_to_keel(kHf + "llama_tied", named, std::nullopt, force); }),
               Catch::Contains("the output " + named + " is named like a checkpoint (step_*) of the run"));
    over.force = force;
    CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "self_keel", named, over); }),
               Catch::Contains("give it a name that does not start with step_"));
  }
  CHECK_THAT(error_of([&] { convert_hf_to_keel(kHf + "llama_tied", named + "/", std::nullopt, false); }),
             Catch::Contains("of the run whose checkpoints are in " + tmp / "run/checkpoints:"));
  CHECK_FALSE(fs::exists(named));
}

// Seed 000: finetuning converted weights in bf16 must continue from the pretrained loss. The
// fixture model was trained to ~3.5 nats on fortunes (a random one sits at ln 512 = 6.2).
// Lose the pretrained weights in the fp32 masters (the bug: masters left at their init) and the
// loss jumps after the first update; keel builds the masters from the loaded weights.
TEST_CASE("hf: finetuning converted weights continues from the pretrained loss (seed 000)", "[hf][seed000]") {
  const Expected e = hf_expected("llama_trained");
  const double hf_loss = e.meta["train_loss"]["loss"].get<double>();
  const HfCheckpoint hf = HfCheckpoint::open(kHf + "llama_trained");
  json j = finetune_config_json(hf, "unused", ".");
  j["data"] = {{"train", kHf + "data/fortunes_sp.bin"}};
  j["train"] = {{"steps", 6}, {"global_batch", 8}, {"micro_batch", 4}, {"seq_len", 64}, {"seed", 3}};
  j["optimizer"]["lr"] = 3e-4;
  j["optimizer"]["min_lr"] = 3e-4;
  j["schedule"] = {{"warmup_steps", 0}, {"decay", "constant"}};

  auto run = [&](const std::string& precision, bool break_masters, std::vector<double>& losses) {
    j["precision"] = {{"mode", precision}};
    const RunConfig cfg = parse_config(j, "seed000.json");
    auto be = make_cpu_backend();
    Trainer tr(cfg, *be);
    const std::string note = init_weights_from_hf(kHf + "llama_trained", tr.table(), tr.state());
    CHECK_THAT(note, Catch::Contains("fp32 masters = their exact values"));
    if (break_masters) {  // what a trainer that forgets to build masters from the loaded weights does
      std::vector<float> init(static_cast<size_t>(tr.table().local_numel()));
      for (const ParamSpec& p : tr.table().params()) init_param(p, 1, init.data() + p.offset);
      Tensor master = tr.state().master;  // the first local_numel elements of the (padded) flat buffer
      master.ndim = 1;
      master.shape = {tr.table().local_numel(), 0, 0, 0};
      be->copy_from_host(master, init.data());
    }
    data::Sampler sampler(data::TokenDataset::open(cfg.data.train, 64, 512), cfg.train.seed, true);
    // The converted model's loss over every window of the shard, in this precision.
    std::vector<MicroBatch> all;
    for (int64_t w = 0; w + 4 <= sampler.num_windows(); w += 4) {
      MicroBatch mb;
      mb.inputs.resize(4 * 64);
      mb.targets.resize(4 * 64);
      for (int k = 0; k < 4; ++k) sampler.dataset().read_window(w + k, mb.inputs.data() + 64 * k, mb.targets.data() + 64 * k);
      all.push_back(std::move(mb));
    }
    const double start = break_masters ? 0.0 : tr.evaluate(all);
    for (int64_t it = 1; it <= cfg.train.steps; ++it) {
      std::vector<MicroBatch> batch(2);
      for (int m = 0; m < 2; ++m) {
        batch[m].inputs.resize(4 * 64);
        batch[m].targets.resize(4 * 64);
        sampler.fill((it - 1) * 8 + m * 4, 4, batch[m].inputs.data(), batch[m].targets.data());
      }
      losses.push_back(tr.step(batch, it).loss);
    }
    return start;
  };

  std::vector<double> fp32_losses;
  const double fp32_start = run("fp32", false, fp32_losses);
  INFO("HF fp32 loss on the shard " << std::to_string(hf_loss) << ", keel fp32 " << std::to_string(fp32_start));
  CHECK(std::abs(fp32_start - hf_loss) <= 1e-4 * hf_loss);  // the converted model is HF's model

  std::vector<double> bf16;
  const double bf16_start = run("bf16", false, bf16);
  INFO("bf16: loss over the shard " << std::to_string(bf16_start) << ", step losses " << bf16[0] << " " << bf16[1] << " " << bf16[2]
                                    << " " << bf16[3] << " " << bf16[4] << " " << bf16[5]);
  CHECK(std::abs(bf16_start - hf_loss) < 0.05);  // bf16 working weights: a little rounding
  for (double l : bf16) CHECK(l < bf16_start + 0.3);  // batches of 8 windows scatter by ~0.1-0.2; no jump

  // The control: with masters that lost the pretrained weights, the first update throws them away.
  std::vector<double> broken;
  run("bf16", true, broken);
  INFO("masters left at init: step losses " << broken[0] << " " << broken[1] << " " << broken[2]);
  CHECK(broken[0] < bf16_start + 0.3);  // step 1 still computes with the loaded working weights
  CHECK(broken[1] > bf16_start + 1.5);  // then the update writes the init masters back: the jump
}

TEST_CASE("hf: --init-from hf:DIR refuses a run config for another model, naming the field", "[hf]") {
  auto init_error = [](const std::string& name, const std::function<void(json&)>& edit) {
    const HfCheckpoint hf = HfCheckpoint::open(kHf + name);
    json j = finetune_config_json(hf, "unused", ".");
    j["data"] = {{"train", "unused.bin"}};
    j["train"]["seq_len"] = 16;
    edit(j["model"]);
    const RunConfig cfg = parse_config(j, "t.json");
    auto be = make_cpu_backend();
    Trainer tr(cfg, *be);
    return error_of([&] { init_weights_from_hf(kHf + name, tr.table(), tr.state()); });
  };
  CHECK_THAT(init_error("llama_tied", [](json& m) { m["rope_theta"] = 10000.0; }),
             Catch::Contains("model.rope_theta: the config has 10000") && Catch::Contains("500000"));
  // GPT-2's learned position table has n_positions rows: another max_seq_len is another model.
  CHECK_THAT(init_error("gpt2_tied", [](json& m) { m["max_seq_len"] = 128; }),
             Catch::Contains("model.max_seq_len: the config has 128") && Catch::Contains("has 64"));
  CHECK_THAT(init_error("gpt2_tied", [](json& m) { m["position_embedding"] = "alibi"; }),
             Catch::Contains("model.position_embedding: the config has alibi") &&
                 Catch::Contains("(GPT2LMHeadModel) has learned"));
  CHECK_THAT(init_error("bloom_bf16", [](json& m) { m.erase("embedding_norm"); }),
             Catch::Contains("model.embedding_norm: the config has false") && Catch::Contains("(BloomForCausalLM) has true"));
  // A longer context than BLOOM's training length is fine: ALiBi has no position table.
  CHECK(init_error("bloom_bf16", [](json& m) { m["max_seq_len"] = 4096; }) == "no error");
  // Another sliding window changes no tensor: it loads, with a note naming both, as from a keel checkpoint.
  const HfCheckpoint mistral = HfCheckpoint::open(kHf + "mistral_bf16");
  json j = finetune_config_json(mistral, "unused", ".");
  j["data"] = {{"train", "unused.bin"}};
  j["train"]["seq_len"] = 16;
  auto note = [&](const std::function<void(json&)>& edit) {
    json k = j;
    edit(k["model"]);
    const RunConfig cfg = parse_config(k, "t.json");
    auto be = make_cpu_backend();
    Trainer tr(cfg, *be);
    return init_weights_from_hf(kHf + "mistral_bf16", tr.table(), tr.state());
  };
  CHECK_THAT(note([](json& m) { m["sliding_window"] = 3; }),
             Catch::Contains("; NOTE: the HF model uses model.sliding_window 6, this run uses 3"));
  CHECK_THAT(note([](json& m) { m.erase("sliding_window"); }),
             Catch::Contains("; NOTE: the HF model uses model.sliding_window 6, this run uses none"));
  CHECK_THAT(note([](json&) {}), !Catch::Contains("sliding_window"));
}

TEST_CASE("hf: GPT-2 and BLOOM files without the transformer. prefix, and GPT-2's stored causal masks, load", "[hf]") {
  // The hub's original gpt2 and bloom files were written from the base model: wte.weight,
  // h.0.attn.c_attn.weight, ... Older GPT-2 files also carry each layer's attn.bias mask.
  test::TempDir tmp("hflegacy");
  for (const char* name : {"gpt2_tied", "bloom_bf16"}) {
    const std::string d = tmp / name;
    fs::copy(kHf + name, d, fs::copy_options::recursive);
    auto r = data::SafetensorsReader::open(d + "/model.safetensors");
    std::vector<data::SafetensorsTensorToWrite> ts;
    for (const auto& t : r.tensors())
      ts.push_back({t.name.substr(std::string("transformer.").size()), t.dtype, t.shape, r.bytes(t).data()});
    std::vector<float> mask(64 * 64, 1.0f), masked_bias(1, -1e4f);
    if (std::string(name) == "gpt2_tied")
      for (int i = 0; i < 2; ++i) {
        ts.push_back({"h." + std::to_string(i) + ".attn.bias", data::SafetensorsDtype::F32, {1, 1, 64, 64}, mask.data()});
        ts.push_back({"h." + std::to_string(i) + ".attn.masked_bias", data::SafetensorsDtype::F32, {}, masked_bias.data()});
      }
    data::write_safetensors(d + "/model.safetensors.new", ts, {{"format", "pt"}});
    fs::rename(d + "/model.safetensors.new", d + "/model.safetensors");

    const HfCheckpoint legacy = HfCheckpoint::open(d), saved = HfCheckpoint::open(kHf + name);
    CHECK(legacy.hf_name("layers.0.attn.wq").rfind("h.0.", 0) == 0);
    const ParamTable table(saved.model());
    CHECK(hf_weights(legacy, table) == hf_weights(saved, table));
    if (std::string(name) == "gpt2_tied") {
      REQUIRE(legacy.notes().size() == 1);
      CHECK_THAT(legacy.notes()[0], Catch::Contains("ignored 4 attn.bias / attn.masked_bias buffers"));
    }
    // Exported again, the names are save_pretrained's.
    test::TempDir out("hflegacy_out");
    convert_hf_to_keel(d, out / "keel", std::nullopt, false);
    ExportOptions opts;
    opts.dtype = saved.common_dtype();
    export_keel_to_hf(out / "keel", out / "hf", opts);
    const auto back = all_tensors(out / "hf"), orig = all_tensors(kHf + name);
    REQUIRE(back.size() == orig.size());
    for (const auto& [n, t] : orig) {
      INFO(n);
      REQUIRE(back.count(n));
      CHECK(back.at(n).bytes == t.bytes);
    }
  }
}

TEST_CASE("hf: GPT-2 and BLOOM features keel cannot represent are refused by name", "[hf]") {
  test::TempDir tmp("hferr2");
  auto edited = [&](const std::string& name, const std::string& to, const std::function<void(json&)>& f) {
    const std::string d = tmp / to;
    fs::copy(kHf + name, d, fs::copy_options::recursive);
    std::ifstream in(d + "/config.json");
    json c = json::parse(in);
    f(c);
    std::ofstream(d + "/config.json") << c.dump(2);
    return error_of([&] { HfCheckpoint::open(d); });
  };
  std::string msg = edited("gpt2_tied", "gelu", [](json& c) {
    c["activation_function"] = "gelu";
    c["scale_attn_by_inverse_layer_idx"] = true;
  });
  CHECK_THAT(msg, Catch::Contains("(GPT2LMHeadModel)") && Catch::Contains("activation_function \"gelu\" is not supported") &&
                      Catch::Contains("scale_attn_by_inverse_layer_idx"));
  msg = edited("bloom_bf16", "post_ln", [](json& c) { c["apply_residual_connection_post_layernorm"] = true; });
  CHECK_THAT(msg, Catch::Contains("(BloomForCausalLM)") && Catch::Contains("apply_residual_connection_post_layernorm"));
  msg = edited("gpt2_tied", "noheads", [](json& c) { c.erase("n_head"); });
  CHECK_THAT(msg, Catch::Contains("n_head or num_attention_heads is missing"));
  msg = edited("gpt2_tied", "inner", [](json& c) { c["n_inner"] = 100; });
  CHECK_THAT(msg, Catch::Contains("transformer.h.0.mlp.c_fc.weight (keel layers.0.mlp.w_fc) has shape [32, 128], the "
                                  "config implies [32, 100]"));

  // keel models with no HF architecture are refused at export, naming what is missing.
  auto arch_error = [](const std::function<void(ModelConfig&)>& f) {
    ModelConfig m = HfCheckpoint::open(kHf + "bloom_bf16").model();
    f(m);
    return error_of([&] { hf_arch_for(m, "checkpoint X"); });
  };
  CHECK(arch_error([](ModelConfig&) {}) == "no error");
  CHECK_THAT(arch_error([](ModelConfig& m) { m.embedding_norm = false; }),
             Catch::Contains("checkpoint X holds a gpt2 model with ALiBi but no embedding norm"));
  CHECK_THAT(arch_error([](ModelConfig& m) { m.alibi = false; }),
             Catch::Contains("an embedding norm but learned positions"));
  CHECK_THAT(arch_error([](ModelConfig& m) { m.ffn_hidden = 100; }),
             Catch::Contains("ffn_hidden 100") && Catch::Contains("4 x d_model = 192"));
  CHECK_THAT(arch_error([](ModelConfig& m) { m.family = Family::Llama; }),
             Catch::Contains("holds a Llama with ALiBi"));
}

namespace {
// A copy of an fp32 fixture with element 0 of one tensor set to `value`.
std::string with_value(const test::TempDir& tmp, const std::string& name, const std::string& to,
                       const std::string& tensor, float value) {
  const std::string d = tmp / to;
  fs::copy(kHf + name, d, fs::copy_options::recursive);
  std::vector<std::vector<char>> keep;
  {
    auto r = data::SafetensorsReader::open(d + "/model.safetensors");
    std::vector<data::SafetensorsTensorToWrite> ts;
    for (const auto& t : r.tensors()) {
      auto b = r.bytes(t);
      keep.emplace_back(reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(b.data()) + b.size());
      if (t.name == tensor) {
        REQUIRE(t.dtype == data::SafetensorsDtype::F32);
        std::memcpy(keep.back().data(), &value, sizeof value);
      }
      ts.push_back({t.name, t.dtype, t.shape, keep.back().data()});
    }
    data::write_safetensors(d + "/model.safetensors.new", ts, {{"format", "pt"}});
  }
  fs::rename(d + "/model.safetensors.new", d + "/model.safetensors");
  return d;
}
}  // namespace

TEST_CASE("hf: --dtype fp16 refuses values beyond its range, naming the tensor, and notes values lost to zero", "[hf]") {
  test::TempDir tmp("hffp16");
  const std::string up = "model.layers.0.mlp.up_proj.weight";
  const std::string big = with_value(tmp, "llama_trained", "big", up, 1e6f);
  auto refused = [&](const std::string& msg) {
    CHECK_THAT(msg, Catch::Contains("--dtype fp16: tensor " + up) && Catch::Contains("1 value(s) beyond fp16's range") &&
                        Catch::Contains("largest magnitude 1e+06"));
  };
  // Import: refused, nothing written; the HF dtype (fp32) still converts.
  refused(error_of([&] { convert_hf_to_keel(big, tmp / "big_fp16", DType::F16, false); }));
  CHECK_FALSE(fs::exists(tmp / "big_fp16"));
  convert_hf_to_keel(big, tmp / "big_keel", std::nullopt, false);
  // Export: the same.
  ExportOptions fp16;
  fp16.dtype = DType::F16;
  refused(error_of([&] { export_keel_to_hf(tmp / "big_keel", tmp / "big_hf", fp16); }));
  CHECK_FALSE(fs::exists(tmp / "big_hf"));
  // --dtype auto picks fp16 for a checkpoint from an fp16 model (one whose finetune grew a value
  // past fp16's range, say): refused too, saying where fp16 came from.
  test::edit_checkpoint_meta(tmp / "big_keel", [](json& meta) { meta["source"]["hf_dtype"] = "f16"; });
  CHECK_THAT(error_of([&] { export_keel_to_hf(tmp / "big_keel", tmp / "big_hf", ExportOptions{}); }),
             Catch::Contains("--dtype auto (fp16, the dtype of the HF model it came from): tensor " + up) &&
                 Catch::Contains("pass --dtype bf16 or fp32"));
  CHECK_FALSE(fs::exists(tmp / "big_hf"));

  // inf/NaN in the source: refused as broken weights, in any dtype, by the HF tensor's name;
  // --init-from hf: reads the same way (was: converted in the HF dtype, then every step's loss
  // nan and a non-finite save).
  const std::string nan = with_value(tmp, "llama_trained", "nan", up, std::nanf(""));
  for (const std::optional<DType> dtype : {std::optional<DType>(DType::F16), std::optional<DType>()}) {
    CHECK_THAT(error_of([&] { convert_hf_to_keel(nan, tmp / "nan_keel", dtype, false); }),
               Catch::Contains("hf:" + nan + ": tensor " + up + " holds 1 value that is nan or inf"));
    CHECK_FALSE(fs::exists(tmp / "nan_keel"));
  }

  // A value below fp16's smallest subnormal becomes 0: converted, with a note counting them.
  const std::string tiny = with_value(tmp, "llama_trained", "tiny", up, 1e-9f);
  const ConvertStats st = convert_hf_to_keel(tiny, tmp / "tiny_fp16", DType::F16, false);
  std::string notes;
  for (const auto& n : st.notes) notes += n + "\n";
  CHECK_THAT(notes, Catch::Contains("nonzero value(s) are below fp16's smallest") && Catch::Contains("became 0"));
  convert_hf_to_keel(tiny, tmp / "tiny_keel", std::nullopt, false);
  const ConvertStats ex = export_keel_to_hf(tmp / "tiny_keel", tmp / "tiny_hf", fp16);
  notes.clear();
  for (const auto& n : ex.notes) notes += n + "\n";
  CHECK_THAT(notes, Catch::Contains("became 0"));
}

TEST_CASE("hf: export without a source for the tokenizer and token ids says what it did not write", "[hf]") {
  test::TempDir tmp("hfnosource");
  convert_hf_to_keel(kHf + "llama_sharded", tmp / "keel", std::nullopt, false);  // fp16
  ExportOptions opts;
  auto notes_of = [](const ConvertStats& st) {
    std::string all;
    for (const auto& n : st.notes) all += n + "\n";
    return all;
  };
  const ConvertStats with_source = export_keel_to_hf(tmp / "keel", tmp / "hf", opts);
  CHECK_THAT(notes_of(with_source), !Catch::Contains("not written"));
  CHECK(with_source.dtype == DType::F16);  // --dtype auto: the HF model's dtype
  // As a from-scratch run's checkpoint: no HF config, tokenizer or recorded source.
  const fs::path k = fs::path(tmp / "keel");
  for (const char* f : {"hf_config.json", "tokenizer.json", "generation_config.json"}) fs::remove(k / f);
  test::edit_checkpoint_meta(k.string(), [](json& meta) { meta.erase("source"); });
  const ConvertStats st = export_keel_to_hf(tmp / "keel", tmp / "bare", opts);
  CHECK(st.dtype == DType::BF16);  // --dtype auto without an HF model to follow: bf16
  CHECK_FALSE(fs::exists(tmp / "bare/tokenizer.json"));
  CHECK_THAT(notes_of(st), Catch::Contains("not written: tokenizer.json, generation_config.json and bos/eos token ids") &&
                               Catch::Contains("pass --like DIR"));
  // With a tokenizer beside its training data (as prepare_data.py and keel tokenize leave it),
  // the export takes that one, as keel sample does, and says where it came from.
  const fs::path data = fs::path(tmp / "data");
  fs::create_directories(data);
  fs::copy_file(kHf + "llama_sharded/tokenizer.json", data / "tokenizer.json");
  test::edit_checkpoint_meta(k.string(), [&](json& meta) {
    meta["config"]["data"]["train"] = json::array({(data / "train_*.bin").string()});
  });
  const ConvertStats from_data = export_keel_to_hf(tmp / "keel", tmp / "from_data", opts);
  CHECK(test::read_file(tmp / "from_data/tokenizer.json") == test::read_file(kHf + "llama_sharded/tokenizer.json"));
  CHECK_THAT(notes_of(from_data), Catch::Contains("the tokenizer files come from " + data.string()) &&
                                      Catch::Contains("not written: generation_config.json and bos/eos token ids"));
}

TEST_CASE("hf: a folder with both model.safetensors and an index reads the single file, as transformers does", "[hf]") {
  test::TempDir tmp("hfboth");
  const std::string d = tmp / "both";
  fs::copy(kHf + "llama_sharded", d, fs::copy_options::recursive);
  // model.safetensors: the shards' tensors in one file, the embedding's first element changed,
  // so which file was read shows in the weights.
  const HfCheckpoint sharded = HfCheckpoint::open(kHf + "llama_sharded");
  {
    std::vector<std::unique_ptr<data::SafetensorsReader>> readers;
    std::vector<std::vector<char>> keep;
    std::vector<data::SafetensorsTensorToWrite> ts;
    for (const auto& f : fs::directory_iterator(kHf + "llama_sharded")) {
      if (f.path().extension() != ".safetensors") continue;
      readers.push_back(std::make_unique<data::SafetensorsReader>(data::SafetensorsReader::open(f.path().string())));
      for (const auto& t : readers.back()->tensors()) {
        auto b = readers.back()->bytes(t);
        keep.emplace_back(reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(b.data()) + b.size());
        if (t.name == "model.embed_tokens.weight") {
          REQUIRE(t.dtype == data::SafetensorsDtype::F16);
          const uint16_t h = f32_to_f16(7.0f);
          std::memcpy(keep.back().data(), &h, 2);
        }
        ts.push_back({t.name, t.dtype, t.shape, keep.back().data()});
      }
    }
    data::write_safetensors(d + "/model.safetensors", ts, {{"format", "pt"}});
  }
  const HfCheckpoint both = HfCheckpoint::open(d);
  CHECK(sharded.num_files() == 3);
  CHECK(both.num_files() == 1);
  std::string notes;
  for (const auto& n : both.notes()) notes += n + "\n";
  CHECK_THAT(notes, Catch::Contains("read model.safetensors and ignored model.safetensors.index.json"));
  const ParamTable table(both.model());
  const auto w = hf_weights(both, table), w_sharded = hf_weights(sharded, table);
  CHECK(w[table.at("tok_embed").offset] == 7.0f);
  CHECK(w_sharded[table.at("tok_embed").offset] != 7.0f);
}

TEST_CASE("hf: export writes keel's float fields as their decimals, and unknown configs say what is missing", "[hf]") {
  ModelConfig m = HfCheckpoint::open(kHf + "llama_tied").model();
  m.norm_eps = 1e-5f;
  m.init_std = 0.02f;
  m.rope_theta = 10000.0f;
  // No template: every float comes from keel's config.
  const json c = hf_config_json(m, HfArch::Llama, json(), DType::BF16);
  CHECK(c["rms_norm_eps"].dump() == "1e-05");
  CHECK(c["initializer_range"].dump() == "0.02");
  CHECK(c["rope_theta"].dump() == "10000.0");
  m.norm_eps = 1.17549435e-38f;  // one that needs all nine digits still reads back as itself
  CHECK(static_cast<float>(hf_config_json(m, HfArch::Llama, json(), DType::BF16)["rms_norm_eps"].get<double>()) ==
        m.norm_eps);

  CHECK_THAT(error_of([] { model_config_from_hf(json{{"vocab_size", 10}, {"hidden_size", 8}}, "x/config.json"); }),
             Catch::Contains("x/config.json has neither \"architectures\" nor \"model_type\""));
  const json run = finetune_config_json(HfCheckpoint::open(kHf + "llama_tied"), "ckpt/tied", ".");
  CHECK_THAT(run["description"].get<std::string>(),
             Catch::Contains("keel tokenize --jsonl FILE --tokenizer ckpt/tied --out data/finetune") &&
                 !Catch::Contains("prepare_data.py"));
  CHECK(run["data"]["train"] == "data/finetune/train_*.bin");  // where the description says to tokenize
}
