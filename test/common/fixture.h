// Oracle fixtures made by scripts/make_fixtures.py (PyTorch + HF transformers, float64):
// test/fixtures/<name>.json (model shape, batch, AdamW settings) and <name>.safetensors
// (param.*, grad.*, final.*, tokens, targets, logits, loss, step_losses, step_grad_norms).
#pragma once

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "data/safetensors.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"
#include "model/param_table.h"

namespace keel::test {

// The fixture folder: the source tree's, unless KEEL_FIXTURE_DIR names another (test binaries
// built on one machine and run from another checkout, as scripts/gpu_session.sh does).
inline std::string fixture_dir() {
  const char* env = std::getenv("KEEL_FIXTURE_DIR");
  return env && *env ? env : KEEL_FIXTURE_DIR;
}

// test/fixtures/hf/ (scripts/make_hf_fixtures.py): tiny HF model directories, and under
// expected/ what HF computed for them in float64.
inline std::string hf_fixture_dir() { return fixture_dir() + "/hf/"; }

struct HfExpected {
  nlohmann::json meta;        // expected/<name>.json
  std::vector<float> logits;  // expected/<name>.safetensors "logits" (none for the choices_* files)
};

inline HfExpected hf_expected(const std::string& name) {
  HfExpected e;
  const std::string base = hf_fixture_dir() + "expected/" + name;
  std::ifstream in(base + ".json");
  e.meta = nlohmann::json::parse(in);
  if (std::ifstream(base + ".safetensors")) {
    auto st = data::SafetensorsReader::open(base + ".safetensors");
    auto bytes = st.bytes("logits");
    e.logits.resize(bytes.size() / 4);
    std::memcpy(e.logits.data(), bytes.data(), bytes.size());
  }
  return e;
}

struct Fixture {
  nlohmann::json meta;
  ModelConfig model;
  int B = 0, T = 0;
  data::SafetensorsReader st;

  explicit Fixture(const std::string& name)
      : st(data::SafetensorsReader::open(fixture_dir() + "/" + name + ".safetensors")) {
    std::ifstream in(fixture_dir() + "/" + name + ".json");
    meta = nlohmann::json::parse(in);
    const auto& m = meta["model"];
    model.family = m["family"] == "gpt2" ? Family::GPT2 : Family::Llama;
    model.vocab_size = m["vocab_size"];
    model.d_model = m["d_model"];
    model.n_layers = m["n_layers"];
    model.n_heads = m["n_heads"];
    model.n_kv_heads = m["n_kv_heads"];
    model.ffn_hidden = m["ffn_hidden"];
    model.norm_eps = m["norm_eps"];
    model.rope_theta = m["rope_theta"];
    model.max_seq_len = m["max_seq_len"];
    model.tied_embeddings = m["tied_embeddings"];
    model.alibi = m.value("position_embedding", "") == "alibi";
    model.embedding_norm = m.value("embedding_norm", false);
    model.qkv_bias = m.value("qkv_bias", false);
    model.qk_norm = m.value("qk_norm", false);
    model.explicit_head_dim = m.value("head_dim", 0);
    model.sliding_window = m.value("sliding_window", 0);
    B = meta["batch"]["B"];
    T = meta["batch"]["T"];
  }

  template <class T>
  std::vector<T> read(const std::string& name) const {
    auto bytes = st.bytes(name);
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }

  // A per-parameter fixture family ("param", "grad", "final") laid out as the table's flat buffer.
  std::vector<float> flat(const ParamTable& table, const std::string& prefix) const {
    std::vector<float> out(static_cast<size_t>(table.local_numel()));
    for (const ParamSpec& p : table.params()) {
      const auto& info = st.tensor(prefix + "." + p.name);
      if (info.shape != p.shape)
        throw std::runtime_error("fixture tensor " + prefix + "." + p.name + " has another shape than keel's");
      auto v = read<float>(prefix + "." + p.name);
      std::memcpy(out.data() + p.offset, v.data(), v.size() * sizeof(float));
    }
    return out;
  }

  // inputs = tokens[:, :T]; targets as stored (with the ignored -1 entries).
  std::vector<int32_t> inputs() const {
    auto tok = read<int32_t>("tokens");
    std::vector<int32_t> in;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) in.push_back(tok[static_cast<size_t>(b * (T + 1) + t)]);
    return in;
  }
  std::vector<int32_t> targets() const { return read<int32_t>("targets"); }
};

// Flat fp32 weights and their bf16 rounding, viewed in the storage a model runs with.
struct Weights {
  std::vector<float> w32;
  std::vector<uint16_t> w16;
  explicit Weights(std::vector<float> fp32) : w32(std::move(fp32)) {
    for (float x : w32) w16.push_back(f32_to_bf16(x));
  }
  Tensor view(DType act) {
    const int64_t n = static_cast<int64_t>(w32.size());
    return act == DType::F32 ? Tensor(w32.data(), DType::F32, {n}) : Tensor(w16.data(), DType::BF16, {n});
  }
};

// ||a - b|| / ||b|| over a range, in double (||a - b|| when b is all zero).
inline double rel_error(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Every parameter gradient against the oracle's: within 1e-5 relative, except gradients that
// are mathematically zero (GPT-2's key bias: softmax ignores a per-key constant), where keel
// must give only fp32 cancellation noise, far below the other gradients. Returns the worst
// relative error and its tensor, for the log.
inline std::pair<double, std::string> check_gradients(const Fixture& fx, const ParamTable& table,
                                                      const std::vector<float>& grads, const std::string& label) {
  std::vector<float> ref_grads = fx.flat(table, "grad");
  const std::vector<float> all_zero(ref_grads.size(), 0.0f);
  const double total = rel_error(ref_grads.data(), all_zero.data(), ref_grads.size());
  std::pair<double, std::string> worst{0.0, ""};
  for (const ParamSpec& p : table.params()) {
    const float* g = grads.data() + p.offset;
    const float* ref = ref_grads.data() + p.offset;
    const size_t n = static_cast<size_t>(p.numel);
    if (rel_error(ref, all_zero.data(), n) < 1e-12 * total) {
      const double noise = rel_error(g, all_zero.data(), n);
      INFO(label << " gradient of " << p.name << " should vanish; norm " << noise << " vs total " << total);
      CHECK(noise <= 1e-6 * total);
      continue;
    }
    const double err = rel_error(g, ref, n);
    INFO(label << " gradient of " << p.name << " relative error " << err);
    CHECK(err <= 1e-5);
    if (err > worst.first) worst = {err, p.name};
  }
  return worst;
}

}  // namespace keel::test
