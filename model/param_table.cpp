#include "model/param_table.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <stdexcept>

namespace keel {

std::string family_name(Family f) { return f == Family::GPT2 ? "gpt2" : "llama"; }

std::string option_names(const ModelConfig& m) {
  std::string s;
  if (m.alibi) s += ", ALiBi";
  if (m.embedding_norm) s += ", embedding norm";
  if (m.is_llama() && m.qkv_bias) s += ", q/k/v biases";
  if (m.qk_norm) s += ", q/k norms";
  if (m.explicit_head_dim > 0) s += ", head_dim " + std::to_string(m.explicit_head_dim);
  if (m.sliding_window > 0) s += ", sliding window " + std::to_string(m.sliding_window);
  return s;
}

double flops_per_token(const ModelConfig& m, int64_t seq) {
  const double d = m.d_model, q = m.q_dim(), kv = m.kv_dim(), F = m.ffn_hidden;
  const double mlp = m.is_llama() ? 3 * d * F : 2 * d * F;
  const double per_layer = d * (q + 2 * kv) + q * d + mlp;
  const double matmul_params = m.n_layers * per_layer + static_cast<double>(m.embed_rows()) * d;
  return 6 * matmul_params + 12.0 * m.n_layers * static_cast<double>(m.attended_keys(seq)) * q;
}

std::string role_name(Role r) {
  switch (r) {
    case Role::Matrix: return "matrix";
    case Role::Embedding: return "embedding";
    case Role::Norm: return "norm";
    case Role::Bias: return "bias";
  }
  return "?";
}

std::string split_name(TpSplit s) {
  switch (s) {
    case TpSplit::None: return "replicated";
    case TpSplit::Rows: return "rows";
    case TpSplit::Cols: return "cols";
  }
  return "?";
}

bool embedding_tensor(const ParamSpec& p) {
  return p.layer < 0 && !p.tied_copy &&
         (p.name == "tok_embed" || p.name == "pos_embed" || p.name.starts_with("embed_norm."));
}

Tensor param_view(const Tensor& flat, const ParamSpec& p) {
  Tensor t = flat;
  t.data = static_cast<char*>(flat.data) + p.offset * dtype_size(flat.dtype);
  t.ndim = static_cast<int>(p.local_shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = p.local_shape[i];
  return t;
}

int64_t ParamSpec::logical_numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

ParamTable::ParamTable(const ModelConfig& cfg, const ModelShard& shard) : ParamTable(cfg, std::vector<ModelShard>{shard}) {}

ParamTable::ParamTable(const ModelConfig& cfg, const std::vector<ModelShard>& chunks) : cfg_(cfg) {
  if (chunks.empty()) throw std::invalid_argument("ParamTable: no model chunk given");
  shard_ = chunks.front();
  for (ModelShard c : chunks) {
    if (c.end_layer < 0) c.end_layer = cfg.n_layers;
    if (c.tp_rank != shard_.tp_rank || c.tp_size != shard_.tp_size)
      throw std::invalid_argument("ParamTable: the model chunks of one rank must have the same TP rank and size");
    chunks_.push_back(c);
    shard_.has_embedding = shard_.has_embedding || c.has_embedding;
    shard_.has_head = shard_.has_head || c.has_head;
  }
  shard_.end_layer = chunks_.back().end_layer;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    add_chunk(chunks_[c]);
    chunk_of_.resize(params_.size(), static_cast<int>(c));
  }
}

ParamTable ParamTable::chunk(int c) const {
  ParamTable t;
  t.cfg_ = cfg_;
  t.shard_ = chunks_.at(static_cast<size_t>(c));
  t.chunks_ = {t.shard_};
  for (size_t i = 0; i < params_.size(); ++i) {
    if (chunk_of_[i] != c) continue;
    t.index_[params_[i].name] = t.params_.size();
    t.params_.push_back(params_[i]);
    t.chunk_of_.push_back(0);
  }
  t.local_numel_ = local_numel_;
  return t;
}

void ParamTable::add_chunk(const ModelShard& shard) {
  const ModelConfig& cfg = cfg_;
  const bool gpt2 = cfg.is_gpt2();
  const int64_t d = cfg.d_model, V = cfg.embed_rows(), F = cfg.ffn_hidden;
  const int64_t q = cfg.q_dim(), kv = cfg.kv_dim();
  const float std = cfg.init_std;
  // GPT-2's scaled init: projections that write into the residual stream get std / sqrt(2 L),
  // so the stream's variance does not grow with depth.
  const float resid_std = std / std::sqrt(2.0f * static_cast<float>(cfg.n_layers));

  // The padding rows of a padded vocabulary (see ParamSpec::padded_from).
  auto mark_padding = [&] {
    if (V > cfg.vocab_size) params_.back().padded_from = cfg.vocab_size;
  };
  if (shard.has_embedding) {
    add("tok_embed", {V, d}, Role::Embedding, TpSplit::Rows, -1, std);
    mark_padding();
    if (cfg.learned_positions()) add("pos_embed", {cfg.max_seq_len, d}, Role::Embedding, TpSplit::None, -1, std);
    if (cfg.embedding_norm) {
      add("embed_norm.weight", {d}, Role::Norm, TpSplit::None, -1, 0, 1.0f);
      if (gpt2) add("embed_norm.bias", {d}, Role::Bias, TpSplit::None, -1, 0);
    }
  }
  for (int i = shard.first_layer; i < shard.end_layer; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    add(p + "attn_norm.weight", {d}, Role::Norm, TpSplit::None, i, 0, 1.0f);
    if (gpt2) add(p + "attn_norm.bias", {d}, Role::Bias, TpSplit::None, i, 0);
    add(p + "attn.wq", {q, d}, Role::Matrix, TpSplit::Rows, i, std);
    add(p + "attn.wk", {kv, d}, Role::Matrix, TpSplit::Rows, i, std);
    add(p + "attn.wv", {kv, d}, Role::Matrix, TpSplit::Rows, i, std);
    if (cfg.has_qkv_bias()) {
      add(p + "attn.bq", {q}, Role::Bias, TpSplit::Rows, i, 0);
      add(p + "attn.bk", {kv}, Role::Bias, TpSplit::Rows, i, 0);
      add(p + "attn.bv", {kv}, Role::Bias, TpSplit::Rows, i, 0);
    }
    if (cfg.qk_norm) {  // shared by all heads, so every TP rank holds them whole
      add(p + "attn.q_norm.weight", {cfg.head_dim()}, Role::Norm, TpSplit::None, i, 0, 1.0f);
      add(p + "attn.k_norm.weight", {cfg.head_dim()}, Role::Norm, TpSplit::None, i, 0, 1.0f);
    }
    add(p + "attn.wo", {d, q}, Role::Matrix, TpSplit::Cols, i, resid_std);
    if (gpt2) add(p + "attn.bo", {d}, Role::Bias, TpSplit::None, i, 0);
    add(p + "mlp_norm.weight", {d}, Role::Norm, TpSplit::None, i, 0, 1.0f);
    if (gpt2) {
      add(p + "mlp_norm.bias", {d}, Role::Bias, TpSplit::None, i, 0);
      add(p + "mlp.w_fc", {F, d}, Role::Matrix, TpSplit::Rows, i, std);
      add(p + "mlp.b_fc", {F}, Role::Bias, TpSplit::Rows, i, 0);
      add(p + "mlp.w_proj", {d, F}, Role::Matrix, TpSplit::Cols, i, resid_std);
      add(p + "mlp.b_proj", {d}, Role::Bias, TpSplit::None, i, 0);
    } else {
      add(p + "mlp.w_gate", {F, d}, Role::Matrix, TpSplit::Rows, i, std);
      add(p + "mlp.w_up", {F, d}, Role::Matrix, TpSplit::Rows, i, std);
      add(p + "mlp.w_down", {d, F}, Role::Matrix, TpSplit::Cols, i, resid_std);
    }
  }
  if (shard.has_head) {
    add("final_norm.weight", {d}, Role::Norm, TpSplit::None, -1, 0, 1.0f);
    if (gpt2) add("final_norm.bias", {d}, Role::Bias, TpSplit::None, -1, 0);
    // A tied head reads tok_embed; on a stage without the embedding it would hold a tied copy
    // (pipeline parallelism). Untied heads have their own matrix.
    if (!cfg.tied_embeddings) {
      add("lm_head", {V, d}, Role::Matrix, TpSplit::Rows, -1, std);
      mark_padding();
    } else if (!shard.has_embedding) {
      add("tok_embed", {V, d}, Role::Embedding, TpSplit::Rows, -1, std);
      params_.back().tied_copy = true;
      mark_padding();
    }
  }
}

ModelShard pipeline_stage(const ModelConfig& cfg, int pp, int stage, const PipelineSplit& split) {
  ModelShard s;
  const int L = cfg.n_layers;
  s.has_embedding = stage == 0;
  s.has_head = stage == pp - 1;
  if (!split.layers.empty()) {
    if (split.layers.size() != static_cast<size_t>(pp))
      throw std::invalid_argument("the pipeline split lists the layers of " + std::to_string(split.layers.size()) +
                                  " stages, not " + std::to_string(pp));
    int total = 0;
    for (int n : split.layers) {
      if (n < 0) throw std::invalid_argument("the pipeline split gives a stage " + std::to_string(n) + " layers");
      total += n;
    }
    if (total != L)
      throw std::invalid_argument("the pipeline split's " + std::to_string(total) +
                                  " layers are not the model's " + std::to_string(L));
    s.first_layer = 0;
    for (int k = 0; k < stage; ++k) s.first_layer += split.layers[static_cast<size_t>(k)];
    s.end_layer = s.first_layer + split.layers[static_cast<size_t>(stage)];
  } else if (!split.embedding_slots) {
    const int base = L / pp, extra = L % pp;
    s.first_layer = stage * base + std::min(stage, extra);
    s.end_layer = s.first_layer + base + (stage < extra ? 1 : 0);
  } else {
    // Units 0 (embedding), 1..L (layers), L+1 (head); stage s holds units [u_s, u_{s+1}).
    const int units = L + 2;
    auto boundary = [&](int k) { return static_cast<int>((static_cast<int64_t>(k) * units) / pp); };
    const int u0 = boundary(stage), u1 = boundary(stage + 1);
    s.first_layer = std::max(u0, 1) - 1;
    s.end_layer = std::min(u1, L + 1) - 1;
    if (s.end_layer < s.first_layer) s.end_layer = s.first_layer;
  }
  if (s.end_layer == s.first_layer && !s.has_embedding && !s.has_head)
    throw std::invalid_argument("pipeline stage " + std::to_string(stage) + " of " + std::to_string(pp) +
                                " would hold no layer (" + std::to_string(L) + " layers" +
                                (!split.layers.empty()       ? " as parallel.pipeline_layers cuts them"
                                 : split.embedding_slots ? " + embedding and head slots"
                                                             : "") +
                                ")");
  return s;
}

std::vector<ModelShard> pipeline_chunks(const ModelConfig& cfg, int pp, int chunks, int stage,
                                        const PipelineSplit& split) {
  std::vector<ModelShard> out;
  for (int c = 0; c < chunks; ++c) {
    try {
      out.push_back(pipeline_stage(cfg, pp * chunks, c * pp + stage, split));
    } catch (const std::invalid_argument& e) {
      if (chunks == 1) throw;
      throw std::invalid_argument(std::string(e.what()) + ": with parallel.virtual_stages " + std::to_string(chunks) +
                                  " the " + std::to_string(cfg.n_layers) + " layers are cut into pp * virtual_stages = " +
                                  std::to_string(pp * chunks) + " virtual stages");
    }
  }
  return out;
}

std::vector<int> pipeline_layer_counts(const ModelConfig& cfg, int stages, const PipelineSplit& split) {
  std::vector<int> out;
  for (int s = 0; s < stages; ++s) {
    const ModelShard sh = pipeline_stage(cfg, stages, s, split);
    out.push_back(sh.end_layer - sh.first_layer);
  }
  return out;
}

std::vector<int> balanced_pipeline_layers(const std::vector<double>& fixed_s, double layer_s, int n_layers,
                                          const std::vector<int>& max_layers, int chunks) {
  const size_t n = fixed_s.size();
  if (n == 0 || chunks < 1 || (!max_layers.empty() && max_layers.size() != n)) return {};
  auto room = [&](size_t s, int layers) { return max_layers.empty() || layers <= max_layers[s]; };
  auto model_end = [&](size_t s, int c) { return (s == 0 && c == 0) || (s + 1 == n && c + 1 == chunks); };
  std::vector<int> layers(n, 0);
  int left = n_layers;
  for (size_t s = 0; s < n; ++s) {
    for (int c = 0; c < chunks; ++c) layers[s] += model_end(s, c) ? 0 : 1;
    left -= layers[s];
    if (!room(s, layers[s])) return {};
  }
  if (left < 0) return {};
  for (; left > 0; --left) {
    std::optional<size_t> best;
    for (size_t s = n; s-- > 0;)
      if (room(s, layers[s] + 1) &&
          (!best || fixed_s[s] + layers[s] * layer_s < fixed_s[*best] + layers[*best] * layer_s))
        best = s;
    if (!best) return {};
    ++layers[*best];
  }
  if (chunks == 1) return layers;
  std::vector<int> stages(n * static_cast<size_t>(chunks), 0);
  for (size_t s = 0; s < n; ++s) {
    auto at = [&](int c) -> int& { return stages[static_cast<size_t>(c) * n + s]; };
    int rest = layers[s];
    for (int c = 0; c < chunks; ++c)
      if (!model_end(s, c)) at(c) = 1, --rest;
    for (; rest > 0; --rest) {
      int fewest = chunks - 1;
      for (int c = chunks - 1; c-- > 0;)
        if (at(c) < at(fewest)) fewest = c;
      ++at(fewest);
    }
  }
  return stages;
}

void ParamTable::add(std::string name, std::vector<int64_t> shape, Role role, TpSplit split, int layer,
                     float init_std, float init_value) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.role = role;
  p.split = split;
  p.layer = layer;
  p.decay = role_decays(role);
  p.init_std = init_std;
  p.init_value = init_value;
  p.local_shape = p.shape;
  if (split != TpSplit::None && shard_.tp_size > 1) {
    const size_t dim = split == TpSplit::Rows ? 0 : 1;
    if (p.shape[dim] % shard_.tp_size != 0)
      throw std::invalid_argument("parameter " + p.name + ": dimension " + std::to_string(dim) + " (" +
                                  std::to_string(p.shape[dim]) + ") is not divisible by tp=" +
                                  std::to_string(shard_.tp_size));
    p.local_shape[dim] = p.shape[dim] / shard_.tp_size;
    p.shard_begin = p.local_shape[dim] * shard_.tp_rank;
  }
  p.numel = 1;
  for (int64_t s : p.local_shape) p.numel *= s;
  p.offset = local_numel_;
  local_numel_ += p.numel;
  index_[p.name] = params_.size();
  params_.push_back(std::move(p));
}

const ParamSpec& ParamTable::at(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw std::out_of_range("no parameter named '" + name + "' in this model");
  return params_[it->second];
}

int64_t ParamTable::logical_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.logical_numel();
  return n;
}

namespace {

// splitmix64: a bijective 64-bit mixer; good enough statistically for weight init and cheap.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t hash_name(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Uniform in (0, 1), never exactly 0 (log below).
inline double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

}  // namespace

uint64_t param_key(const ParamSpec& p, uint64_t seed) { return mix64(seed ^ mix64(hash_name(p.name))); }

void init_param(const ParamSpec& p, uint64_t seed, float* out) {
  if (p.init_std <= 0) {
    for (int64_t i = 0; i < p.numel; ++i) out[i] = p.init_value;
    return;
  }
  const uint64_t key = param_key(p, seed);
  const int64_t local_rows = p.local_shape.size() == 2 ? p.local_shape[0] : 1;
  const int64_t local_cols = p.local_shape.back();
  const int64_t full_cols = p.shape.back();
  // Every element is a function of its logical position alone, so the threads (a 1B model has
  // 1.2G elements: half a minute on one core) cannot change a bit.
  const int64_t n = local_rows * local_cols;
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / local_cols, c = i % local_cols;
    // Position of this element in the logical tensor (what makes init layout-independent).
    int64_t lr = r, lc = c;
    if (p.split == TpSplit::Rows) (p.shape.size() == 2 ? lr : lc) += p.shard_begin;
    if (p.split == TpSplit::Cols) lc += p.shard_begin;
    if (p.padded_from > 0 && lr >= p.padded_from) {  // a padding row: zero (as an HF import pads)
      out[i] = 0.0f;
      continue;
    }
    const uint64_t idx = static_cast<uint64_t>(lr * full_cols + lc);
    // Box-Muller on two counter-derived uniforms.
    const double u1 = uniform01(mix64(key + 2 * idx));
    const double u2 = uniform01(mix64(key + 2 * idx + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    out[i] = static_cast<float>(z * p.init_std);
  }
}

}  // namespace keel
