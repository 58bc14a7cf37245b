#include "train/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <sstream>

#include "data/sampler.h"

namespace keel {

using json = nlohmann::json;

std::string precision_name(PrecisionMode m) {
  switch (m) {
    case PrecisionMode::FP32: return "fp32";
    case PrecisionMode::BF16: return "bf16";
    case PrecisionMode::FP16: return "fp16";
    case PrecisionMode::BF16UnsafeNoMaster: return "bf16-unsafe-no-master";
  }
  return "?";
}

std::optional<PrecisionMode> precision_from_name(const std::string& name) {
  for (PrecisionMode m : {PrecisionMode::FP32, PrecisionMode::BF16, PrecisionMode::FP16, PrecisionMode::BF16UnsafeNoMaster})
    if (precision_name(m) == name) return m;
  return std::nullopt;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {

std::string show(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Every problem found in a config, and the fields that had one. A field that failed stands in
// with a default the user never gave, so the checks across fields skip it (ok()): they would
// quote that stand-in ("n_kv_heads: 2 does not divide n_heads (1)") or divide by it.
struct Problems {
  std::vector<std::string> errors;
  std::set<std::string> failed;
  void add(const std::string& field, const std::string& msg) {
    errors.push_back(field + ": " + msg);
    failed.insert(field);
  }
  bool ok(std::initializer_list<std::string> fields) const {
    return std::none_of(fields.begin(), fields.end(), [&](const std::string& f) { return failed.count(f) > 0; });
  }
};

// Reads the fields of one JSON object, recording every problem with its full path; finish()
// reports fields nobody asked for.
class Fields {
 public:
  Fields(const json* obj, std::string path, Problems& problems)
      : obj_(obj), path_(std::move(path)), problems_(problems) {
    if (obj_ && !obj_->is_object()) {
      error(path_, "expected an object {...}, got " + show(*obj_));
      obj_ = nullptr;
    }
  }

  std::string path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  void error(const std::string& where, const std::string& msg) { problems_.add(where, msg); }
  bool has(const std::string& key) {
    known_.insert(key);
    return obj_ && obj_->contains(key) && !(*obj_)[key].is_null();
  }
  const json* raw(const std::string& key) {
    known_.insert(key);
    return obj_ && obj_->contains(key) ? &(*obj_)[key] : nullptr;
  }

  // Integer in [lo, hi]; `required` fields have no default.
  int64_t integer(const std::string& key, std::optional<int64_t> def, int64_t lo,
                  int64_t hi = std::numeric_limits<int64_t>::max()) {
    if (!has(key)) {
      if (!def) error(path(key), "missing (required: an integer >= " + std::to_string(lo) + ")");
      return def.value_or(lo);
    }
    const json& v = (*obj_)[key];
    int64_t x = 0;
    std::string range = hi == std::numeric_limits<int64_t>::max()
                            ? ">= " + std::to_string(lo)
                            : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      // Read as int64 it would wrap to a negative value, which the message would then quote.
      error(path(key), std::to_string(v.get<uint64_t>()) + " is out of range (allowed: " + range + ")");
      return def.value_or(lo);
    }
    if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
               std::fabs(v.get<double>()) < 9e18) {
      x = static_cast<int64_t>(v.get<double>());  // 1e6 written as a float is still an integer
    } else {
      error(path(key), "expected an integer, got " + show(v));
      return def.value_or(lo);
    }
    if (x < lo || x > hi) {
      error(path(key), std::to_string(x) + " is out of range (allowed: " + range + ")");
      return def.value_or(lo);  // a value in range, so that no later check divides by it
    }
    return x;
  }

  // Number in [lo, hi] (lo excluded when lo_open).
  // A number in [lo, hi], with either end open ("(0, 1)") as lo_open / hi_open say.
  double number(const std::string& key, std::optional<double> def, double lo, double hi, bool lo_open = false,
                bool hi_open = false) {
    if (!has(key)) {
      if (!def) error(path(key), "missing (required: a number)");
      return def.value_or(lo);
    }
    const json& v = (*obj_)[key];
    if (!v.is_number()) {
      error(path(key), "expected a number, got " + show(v));
      return def.value_or(lo);
    }
    double x = v.get<double>();
    if (!std::isfinite(x) || (lo_open ? x <= lo : x < lo) || (hi_open ? x >= hi : x > hi)) {
      std::ostringstream r;
      r << (lo_open ? "(" : "[") << lo << ", " << hi << (hi_open ? ")" : "]");
      error(path(key), show(v) + " is out of range (allowed: " + r.str() + ")");
    }
    return x;
  }

  bool boolean(const std::string& key, bool def) {
    if (!has(key)) return def;
    const json& v = (*obj_)[key];
    if (!v.is_boolean()) {
      error(path(key), "expected true or false, got " + show(v));
      return def;
    }
    return v.get<bool>();
  }

  std::string string(const std::string& key, const std::string& def) {
    if (!has(key)) return def;
    const json& v = (*obj_)[key];
    if (!v.is_string()) {
      error(path(key), "expected a string, got " + show(v));
      return def;
    }
    return v.get<std::string>();
  }

  std::string choice(const std::string& key, std::optional<std::string> def, const std::vector<std::string>& allowed) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    if (!has(key)) {
      if (!def) error(path(key), "missing (required: one of " + list + ")");
      return def.value_or(allowed.front());
    }
    const json& v = (*obj_)[key];
    if (!v.is_string() || std::find(allowed.begin(), allowed.end(), v.get<std::string>()) == allowed.end()) {
      error(path(key), show(v) + " is not allowed (allowed: " + list + ")");
      return def.value_or(allowed.front());
    }
    return v.get<std::string>();
  }

  // `key` left out takes a default computed from other fields (ffn_hidden from d_model). When one
  // of them failed, that default came from a stand-in, so `key` counts as failed too (with no
  // error of its own): the checks across fields skip it rather than quote a value nobody gave.
  void derives(const std::string& key, std::initializer_list<std::string> from) {
    if (!has(key) && !problems_.ok(from)) problems_.failed.insert(path(key));
  }

  // A string or a list of strings.
  std::vector<std::string> strings(const std::string& key) {
    std::vector<std::string> out;
    if (!has(key)) return out;
    const json& v = (*obj_)[key];
    // "" names no files, like choice_eval.file's: --set data.val= turns validation off
    if (v.is_string()) return v.get<std::string>().empty() ? out : std::vector<std::string>{v.get<std::string>()};
    if (v.is_array() && std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); })) {
      for (const auto& e : v) out.push_back(e.get<std::string>());
      return out;
    }
    error(path(key), "expected a path or a list of paths, got " + show(v));
    return out;
  }

  void finish() {
    if (!obj_) return;
    for (const auto& [key, value] : obj_->items()) {
      if (known_.count(key)) continue;
      std::string best;
      size_t best_d = 3;  // only suggest close names
      for (const auto& k : known_) {
        size_t dd = edit_distance(key, k);
        if (dd < best_d) best_d = dd, best = k;
      }
      std::string known;
      for (const auto& k : known_) known += (known.empty() ? "" : ", ") + k;
      error(path(key), "unknown field" + (best.empty() ? "" : " (did you mean '" + best + "'?)") +
                           "; known fields here: " + known);
    }
  }

 private:
  const json* obj_;
  std::string path_;
  Problems& problems_;
  std::set<std::string> known_;
};

// JSON text with comments, refusing a key given twice in one object: nlohmann keeps the last
// without a word, so "lr": 3e-3 and a later "lr": 1e-3 would silently become 1e-3.
// `what` names the text in messages (the config file, or a --set).
// `root`: the path of the text's top level ("sample" for --set sample={...}).
json parse_json_once_per_key(const std::string& text, const std::string& what, const std::string& root = "") {
  struct Frame {
    std::string path;  // "optimizer", "data.val_sets"; "" for the top level
    bool object = false;
    std::string key;  // the key being read in an object
    std::set<std::string> keys;
  };
  std::vector<Frame> frames;
  std::vector<std::string> twice;
  const auto callback = [&](int, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      std::string path = root;
      if (!frames.empty()) {
        const Frame& up = frames.back();
        path = up.object ? (up.path.empty() ? up.key : up.path + "." + up.key) : up.path + "[]";
      }
      frames.push_back({path, event == E::object_start, "", {}});
    } else if (event == E::key) {
      Frame& f = frames.back();
      f.key = parsed.get<std::string>();
      if (!f.keys.insert(f.key).second) twice.push_back(f.path.empty() ? f.key : f.path + "." + f.key);
    } else if (event == E::object_end || event == E::array_end) {
      frames.pop_back();
    }
    return true;
  };
  json doc = json::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  if (!twice.empty()) {
    std::string list;
    for (const std::string& k : twice) list += (list.empty() ? "" : ", ") + k;
    throw ConfigError(what + ": " + list + (twice.size() > 1 ? " are" : " is") +
                      " given twice in the same object; JSON keeps only the last, so one is a mistake: remove it");
  }
  return doc;
}

const json* child(const json& doc, const char* key) {
  return doc.is_object() && doc.contains(key) && !doc[key].is_null() ? &doc[key] : nullptr;
}

}  // namespace

RunConfig parse_config(const json& doc, const std::string& source) {
  Problems problems;
  std::vector<std::string>& errors = problems.errors;  // checks across fields add here
  auto ok = [&](std::initializer_list<std::string> fields) { return problems.ok(fields); };
  RunConfig c;
  c.source = source;
  c.name = std::filesystem::path(source).stem().string();
  Fields top(&doc, "", problems);

  // ---- model ----
  {
    top.raw("model");
    Fields f(child(doc, "model"), "model", problems);
    if (!child(doc, "model")) errors.push_back("model: missing (required: the network's shape)");
    ModelConfig& m = c.model;
    m.family = f.choice("family", std::nullopt, {"gpt2", "llama"}) == "gpt2" ? Family::GPT2 : Family::Llama;
    // With no valid family, the rules of the one standing in (gpt2) are not the user's.
    const bool family_ok = ok({"model.family"});
    const bool gpt2 = family_ok && m.is_gpt2(), llama = family_ok && m.is_llama();
    m.vocab_size = f.integer("vocab_size", std::nullopt, 1, 1ll << 31);
    m.pad_vocab_multiple = f.integer("pad_vocab_to_multiple_of", 1, 1, 1 << 20);
    m.d_model = static_cast<int>(f.integer("d_model", std::nullopt, 1, 1 << 20));
    m.n_layers = static_cast<int>(f.integer("n_layers", std::nullopt, 1, 10000));
    m.n_heads = static_cast<int>(f.integer("n_heads", std::nullopt, 1, 1 << 16));
    m.n_kv_heads = static_cast<int>(f.integer("n_kv_heads", m.n_heads, 1, 1 << 16));
    f.derives("n_kv_heads", {"model.n_heads"});
    // Defaults: GPT-2 uses 4d; Llama uses 2/3 of 4d rounded up to a multiple of 256.
    int64_t ffn_default = m.is_gpt2() ? 4ll * m.d_model : ((8ll * m.d_model / 3 + 255) / 256) * 256;
    m.ffn_hidden = static_cast<int>(f.integer("ffn_hidden", ffn_default, 1, 1 << 24));
    f.derives("ffn_hidden", {"model.d_model", "model.family"});
    m.norm_eps = static_cast<float>(f.number("norm_eps", 1e-5, 0, 1, true));
    m.rope_theta = static_cast<float>(f.number("rope_theta", 10000.0, 0, 1e12, true));
    m.max_seq_len = static_cast<int>(f.integer("max_seq_len", std::nullopt, 1, 1 << 22));
    m.tied_embeddings = f.boolean("tied_embeddings", m.is_gpt2());
    const std::string positions =
        f.choice("position_embedding", m.is_gpt2() ? "learned" : "rope", {"learned", "rope", "alibi"});
    m.alibi = positions == "alibi";
    if (gpt2 && positions == "rope")
      errors.push_back("model.position_embedding: gpt2 takes \"learned\" or \"alibi\", got \"rope\" (RoPE is "
                       "llama's)");
    if (llama && positions == "learned")
      errors.push_back("model.position_embedding: llama takes \"rope\" or \"alibi\", got \"learned\" (a "
                       "position table is gpt2's)");
    m.embedding_norm = f.boolean("embedding_norm", false);
    // The option is llama's; gpt2 always has the biases (has_qkv_bias()), so may only say so.
    const bool qkv_bias = f.boolean("qkv_bias", m.is_gpt2());
    if (gpt2 && !qkv_bias)
      errors.push_back("model.qkv_bias: gpt2 always has q/k/v biases (must be true, or leave the field out)");
    m.qkv_bias = m.is_llama() && qkv_bias;
    m.qk_norm = f.boolean("qk_norm", false);
    if (gpt2 && m.qk_norm) errors.push_back("model.qk_norm: true is a llama option (Qwen3's RMSNorms of q and k)");
    if (f.has("head_dim")) m.explicit_head_dim = static_cast<int>(f.integer("head_dim", 0, 1, 1 << 16));
    // The derived size written out is no option: keep one spelling, so checkpoints compare equal.
    if (m.n_heads > 0 && m.d_model % m.n_heads == 0 && m.explicit_head_dim == m.d_model / m.n_heads)
      m.explicit_head_dim = 0;
    if (gpt2 && m.explicit_head_dim > 0)
      errors.push_back("model.head_dim: gpt2's heads are d_model / n_heads wide (head_dim is a llama option)");
    if (f.has("sliding_window")) m.sliding_window = static_cast<int>(f.integer("sliding_window", 0, 1, 1 << 30));
    m.init_std = static_cast<float>(f.number("init_std", 0.02, 0, 10, true));
    if (const json* rs_doc = f.raw("rope_scaling"); rs_doc && !rs_doc->is_null()) {
      // Llama 3.1's frequency scaling (kernels/rope_frequencies.h), as in HF's rope_scaling.
      Fields rs(rs_doc, "model.rope_scaling", problems);
      RopeScaling& r = m.rope_scaling;
      const std::string type = rs.choice("type", "llama3", {"none", "llama3"});
      r.kind = type == "llama3" ? RopeScaling::Kind::Llama3 : RopeScaling::Kind::None;
      r.factor = rs.number("factor", r.factor, 0, 1e6, true);
      r.low_freq_factor = rs.number("low_freq_factor", r.low_freq_factor, 0, 1e6, true);
      r.high_freq_factor = rs.number("high_freq_factor", r.high_freq_factor, 0, 1e6, true);
      r.original_max_position = rs.integer("original_max_position_embeddings", r.original_max_position, 1, 1 << 30);
      rs.finish();
      if (r.kind == RopeScaling::Kind::Llama3 && r.high_freq_factor <= r.low_freq_factor &&
          ok({"model.rope_scaling.high_freq_factor", "model.rope_scaling.low_freq_factor"}))
        errors.push_back("model.rope_scaling.high_freq_factor: " + show(r.high_freq_factor) +
                         " must exceed low_freq_factor (" + show(r.low_freq_factor) + ")");
      if (r.kind != RopeScaling::Kind::None && gpt2)
        errors.push_back("model.rope_scaling: gpt2 has learned positions, no RoPE to scale (remove the field)");
      else if (r.kind != RopeScaling::Kind::None && m.alibi)
        errors.push_back("model.rope_scaling: position_embedding \"alibi\" has no RoPE to scale (remove the field)");
    }
    f.finish();
    const bool shape_ok = ok({"model.d_model", "model.n_heads", "model.head_dim"});
    if (shape_ok && m.d_model > 0 && m.n_heads > 0 && m.d_model % m.n_heads != 0 && m.explicit_head_dim == 0)
      errors.push_back("model.n_heads: " + std::to_string(m.n_heads) + " does not divide model.d_model (" +
                       std::to_string(m.d_model) + "); set model.head_dim for heads of another size");
    if (ok({"model.n_heads", "model.n_kv_heads"}) && m.n_kv_heads > 0 && m.n_heads % m.n_kv_heads != 0)
      errors.push_back("model.n_kv_heads: " + std::to_string(m.n_kv_heads) + " does not divide model.n_heads (" +
                       std::to_string(m.n_heads) + ")");
    if (gpt2 && ok({"model.n_heads", "model.n_kv_heads"}) && m.n_kv_heads != m.n_heads)
      errors.push_back("model.n_kv_heads: gpt2 has no grouped-query attention (must equal n_heads = " +
                       std::to_string(m.n_heads) + ")");
    if (gpt2 && !m.tied_embeddings)
      errors.push_back("model.tied_embeddings: gpt2 ties its head to the token embedding (must be true)");
    // RoPE rotates column pairs; ALiBi and learned positions take any head_dim
    if (shape_ok && m.rope().rotates() && m.n_heads > 0 && (m.d_model % m.n_heads == 0 || m.explicit_head_dim > 0) &&
        m.head_dim() % 2 != 0)
      errors.push_back(std::string(m.explicit_head_dim > 0 ? "model.head_dim" : "model.d_model / model.n_heads") +
                       ": RoPE needs an even head dimension, got " + std::to_string(m.head_dim()));
  }

  // ---- precision ----
  {
    top.raw("precision");
    Fields f(child(doc, "precision"), "precision", problems);
    std::string mode = f.choice("mode", "bf16", {"bf16", "fp32", "fp16", "bf16-unsafe-no-master"});
    c.precision.mode = precision_from_name(mode).value_or(PrecisionMode::BF16);  // choice() named any other
    c.precision.stochastic_rounding = f.boolean("stochastic_rounding", false);
    if (c.precision.stochastic_rounding && c.precision.mode != PrecisionMode::BF16 && ok({"precision.mode"}))
      errors.push_back("precision.stochastic_rounding: true needs precision.mode \"bf16\" (fp32 masters written to a "
                       "bf16 working copy), got mode \"" + mode + "\"");
    f.raw("loss_scale");
    const json* ls_doc = child(doc, "precision") ? child(*child(doc, "precision"), "loss_scale") : nullptr;
    Fields ls(ls_doc, "precision.loss_scale", problems);
    LossScaleConfig& s = c.precision.loss_scale;
    s.initial = ls.number("initial", s.initial, 0, 1e38, true);
    s.growth_interval = ls.integer("growth_interval", s.growth_interval, 1);
    s.hysteresis = ls.integer("hysteresis", s.hysteresis, 1);
    s.min = ls.number("min", s.min, 0, 1e38, true);
    s.growth_factor = ls.number("growth_factor", s.growth_factor, 1, 1e6, true);
    s.backoff_factor = ls.number("backoff_factor", s.backoff_factor, 0, 1, true, true);
    ls.finish();
    f.finish();
    if (s.min > s.initial && ok({"precision.loss_scale.min", "precision.loss_scale.initial"}))
      errors.push_back("precision.loss_scale.min: " + show(s.min) + " is above the initial scale " + show(s.initial));
  }

  // ---- optimizer ----
  {
    top.raw("optimizer");
    Fields f(child(doc, "optimizer"), "optimizer", problems);
    OptimizerConfig& o = c.optimizer;
    f.choice("type", "adamw", {"adamw"});
    o.lr = f.number("lr", o.lr, 0, 10, true);
    o.min_lr = f.number("min_lr", o.lr / 10, 0, 10);
    f.derives("min_lr", {"optimizer.lr"});
    o.beta1 = f.number("beta1", o.beta1, 0, 1, false, true);
    o.beta2 = f.number("beta2", o.beta2, 0, 1, false, true);
    o.eps = f.number("eps", o.eps, 0, 1, true);
    o.weight_decay = f.number("weight_decay", o.weight_decay, 0, 10);
    o.grad_clip = f.number("grad_clip", o.grad_clip, 0, 1e12);
    f.finish();
    if (o.min_lr > o.lr && ok({"optimizer.lr", "optimizer.min_lr"}))
      errors.push_back("optimizer.min_lr: " + show(o.min_lr) + " is above optimizer.lr (" + show(o.lr) + ")");
  }

  // ---- train ----
  {
    top.raw("train");
    Fields f(child(doc, "train"), "train", problems);
    if (!child(doc, "train")) errors.push_back("train: missing (required: steps, global_batch, micro_batch, seq_len)");
    TrainConfig& t = c.train;
    t.steps = f.integer("steps", std::nullopt, 1);
    t.global_batch = f.integer("global_batch", std::nullopt, 1);
    t.micro_batch = f.integer("micro_batch", std::nullopt, 1);
    t.seq_len = f.integer("seq_len", c.model.max_seq_len, 1);
    f.derives("seq_len", {"model.max_seq_len"});
    t.seed = static_cast<uint64_t>(f.integer("seed", 1234, 0));
    t.eval_interval = f.integer("eval_interval", 0, 0);
    t.eval_batches = f.integer("eval_batches", 8, 0);
    t.eval_at_start = f.boolean("eval_at_start", false);
    t.init_from = f.string("init_from", "");
    t.recompute = f.choice("recompute", "none", {"none", "selective", "full"});
    t.recompute_layers = f.integer("recompute_layers", 0, 0, 1 << 20);
    t.logits_chunk_rows = f.integer("logits_chunk_rows", 0, 0);
    f.finish();
    if (t.recompute_layers > 0 && t.recompute != "full" && ok({"train.recompute"}))
      errors.push_back("train.recompute_layers: " + std::to_string(t.recompute_layers) +
                       " needs train.recompute \"full\" (it is \"" + t.recompute + "\")");
    if (ok({"model.max_seq_len", "train.seq_len"}) && c.model.max_seq_len > 0 && t.seq_len > c.model.max_seq_len)
      errors.push_back("train.seq_len: " + std::to_string(t.seq_len) + " exceeds model.max_seq_len (" +
                       std::to_string(c.model.max_seq_len) + ")");
  }

  // ---- parallel ----
  {
    top.raw("parallel");
    const size_t errors_before = errors.size();
    Fields f(child(doc, "parallel"), "parallel", problems);
    ParallelConfig& p = c.parallel;
    p.tp = f.integer("tp", 1, 1, 1 << 16);
    p.pp = f.integer("pp", 1, 1, 1 << 16);
    p.dp = f.integer("dp", 1, 1, 1 << 20);
    p.embedding_slot = f.boolean("embedding_slot", false);
    p.sequence_parallel = f.boolean("sequence_parallel", false);
    p.virtual_stages = f.integer("virtual_stages", 1, 1, 1 << 10);
    p.overlap_grad_reduce = f.boolean("overlap_grad_reduce", false);
    p.grad_bucket_size = f.integer("grad_bucket_size", 0, 0, int64_t{1} << 40);
    p.overlap_param_gather = f.boolean("overlap_param_gather", false);
    const json* split = f.raw("pipeline_layers");
    if (split && !split->is_null()) {
      const bool counts = split->is_array() && std::all_of(split->begin(), split->end(), [](const json& e) {
        return e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() <= (1 << 20);
      });
      if (!counts)
        f.error("parallel.pipeline_layers", "expected a list of layer counts >= 0, one per pipeline stage, got " + show(*split));
      else
        for (const json& e : *split) p.pipeline_layers.push_back(e.get<int>());
    }
    f.finish();
    // The layout's checks against the model and batch quote these fields: only when they are valid.
    const bool layout_valid = errors.size() == errors_before;
    const ModelConfig& m = c.model;
    auto divides = [&](int64_t by, int64_t what, const std::string& by_name, const std::string& what_name) {
      if (by > 0 && what > 0 && what % by != 0 && ok({what_name}))
        errors.push_back(by_name + ": " + std::to_string(by) + " does not divide " + what_name + " (" +
                         std::to_string(what) + ")");
    };
    if (layout_valid) {
      divides(p.tp, m.n_heads, "parallel.tp", "model.n_heads");
      divides(p.tp, m.n_kv_heads, "parallel.tp", "model.n_kv_heads");
      // Embedding rows: vocab padded up to a multiple of pad_vocab_to_multiple_of * tp (Megatron's
      // make-vocab-size-divisible-by); the padding rows are never a target.
      if (m.pad_vocab_multiple > 1) {
        const int64_t unit = m.pad_vocab_multiple * p.tp;
        c.model.padded_vocab_size = (m.vocab_size + unit - 1) / unit * unit;
      } else if (m.vocab_size % p.tp != 0 && ok({"model.vocab_size", "model.pad_vocab_to_multiple_of"})) {
        errors.push_back("parallel.tp: " + std::to_string(p.tp) + " does not divide model.vocab_size (" +
                         std::to_string(m.vocab_size) + "); set model.pad_vocab_to_multiple_of (e.g. 128) to pad it");
      }
      divides(p.tp, m.ffn_hidden, "parallel.tp", "model.ffn_hidden");
      const bool layers_ok = ok({"model.n_layers"});
      if (!p.pipeline_layers.empty()) {
        // An explicit split replaces the checks of the even one below.
        const int64_t stages = p.pp * p.virtual_stages;
        int64_t total = 0;
        for (int n : p.pipeline_layers) total += n;
        std::string zeros;
        for (size_t k = 1; k + 1 < p.pipeline_layers.size(); ++k)
          if (p.pipeline_layers[k] == 0) zeros += (zeros.empty() ? "" : ", ") + std::to_string(k);
        if (p.embedding_slot)
          errors.push_back("parallel.pipeline_layers: set, and so is parallel.embedding_slot; both choose the split "
                           "(keep one: pipeline_layers gives every stage's layers itself)");
        else if (static_cast<int64_t>(p.pipeline_layers.size()) != stages)
          errors.push_back("parallel.pipeline_layers: " + std::to_string(p.pipeline_layers.size()) +
                           (p.pipeline_layers.size() == 1 ? " layer count" : " layer counts") + " for " +
                           std::to_string(stages) + " pipeline stages (parallel.pp" +
                           (p.virtual_stages > 1 ? " * parallel.virtual_stages" : "") +
                           "; one count per stage, in model order)");
        else if (layers_ok && total != m.n_layers)
          errors.push_back("parallel.pipeline_layers: the counts add up to " + std::to_string(total) +
                           " layers, but model.n_layers is " + std::to_string(m.n_layers));
        else if (!zeros.empty())
          errors.push_back("parallel.pipeline_layers: " + std::string(p.virtual_stages > 1 ? "virtual " : "") +
                           (zeros.find(',') == std::string::npos ? "stage " : "stages ") + zeros +
                           " would hold no layer (only the first stage, which holds the embedding, and the last, "
                           "which holds the head, may hold none)");
      } else if (layers_ok && p.pp > m.n_layers + (p.embedding_slot ? 2 : 0))
        errors.push_back("parallel.pp: " + std::to_string(p.pp) + " stages for " + std::to_string(m.n_layers) +
                         " layers" + (p.embedding_slot ? " + embedding and head slots" : "") +
                         " (each stage needs at least one)");
      if (p.virtual_stages > 1 && p.pp == 1)
        errors.push_back("parallel.virtual_stages: " + std::to_string(p.virtual_stages) +
                         " model chunks per rank interleave a pipeline; with parallel.pp = 1 there is none (set it to 1)");
      else if (p.virtual_stages > 1 && layers_ok && p.pipeline_layers.empty() &&
               p.pp * p.virtual_stages > m.n_layers + (p.embedding_slot ? 2 : 0))
        errors.push_back("parallel.virtual_stages: pp * virtual_stages = " + std::to_string(p.pp * p.virtual_stages) +
                         " virtual stages for " + std::to_string(m.n_layers) + " layers" +
                         (p.embedding_slot ? " + embedding and head slots" : "") + " (each needs at least one)");
      const TrainConfig& t = c.train;
      const bool batch_ok = ok({"train.global_batch", "train.micro_batch"});
      if (p.sequence_parallel && p.tp > 1 && ok({"train.micro_batch", "train.seq_len", "model.max_seq_len"}) &&
          (t.micro_batch * t.seq_len) % p.tp != 0)
        errors.push_back("parallel.sequence_parallel: the " + std::to_string(t.micro_batch * t.seq_len) +
                         " token rows of a micro-batch (train.micro_batch * train.seq_len) do not divide over tp=" +
                         std::to_string(p.tp));
      if (batch_ok && t.global_batch % (t.micro_batch * p.dp) != 0)
        errors.push_back("train.global_batch: " + std::to_string(t.global_batch) +
                         " is not a multiple of train.micro_batch * parallel.dp (" + std::to_string(t.micro_batch) +
                         " * " + std::to_string(p.dp) + ")");
    }
  }

  // ---- schedule ----
  {
    top.raw("schedule");
    Fields f(child(doc, "schedule"), "schedule", problems);
    ScheduleConfig& s = c.schedule;
    s.warmup_steps = f.integer("warmup_steps", 0, 0);
    std::string decay = f.choice("decay", "cosine", {"cosine", "linear", "constant", "wsd"});
    s.decay = decay == "cosine"   ? DecayStyle::Cosine
              : decay == "linear" ? DecayStyle::Linear
              : decay == "wsd"    ? DecayStyle::WSD
                                  : DecayStyle::Constant;
    s.decay_steps = f.integer("decay_steps", 0, 0);
    const bool wsd_fields = f.has("wsd_decay_steps") || f.has("wsd_decay_style");
    s.wsd_decay_steps = f.integer("wsd_decay_steps", 0, 0);
    const std::string shape = f.choice("wsd_decay_style", "linear", {"linear", "cosine", "1-sqrt"});
    s.wsd_decay_style = shape == "linear"   ? CooldownShape::Linear
                        : shape == "cosine" ? CooldownShape::Cosine
                                            : CooldownShape::OneMinusSqrt;
    if (wsd_fields && s.decay != DecayStyle::WSD)
      errors.push_back("schedule.wsd_decay_steps / wsd_decay_style: need schedule.decay \"wsd\" (it is \"" + decay +
                       "\")");
    if (s.decay == DecayStyle::WSD && s.decay_steps > 0 && s.wsd_decay_steps > s.decay_steps &&
        ok({"schedule.decay_steps", "schedule.wsd_decay_steps"}))
      errors.push_back("schedule.wsd_decay_steps: " + std::to_string(s.wsd_decay_steps) +
                       " exceeds schedule.decay_steps (" + std::to_string(s.decay_steps) + ")");
    if (const json* r = f.raw("rampup_batch_size"); r && !r->is_null()) {
      // [start, increment, samples], as Megatron's --rampup-batch-size
      if (!r->is_array() || r->size() != 3 ||
          !std::all_of(r->begin(), r->end(), [](const json& e) { return e.is_number_integer() && e.get<int64_t>() > 0; })) {
        errors.push_back("schedule.rampup_batch_size: " + show(*r) +
                         " is not allowed (allowed: null or [start, increment, samples], positive integers)");
      } else {
        RampupConfig rc{(*r)[0].get<int64_t>(), (*r)[1].get<int64_t>(), (*r)[2].get<int64_t>()};
        const int64_t unit = c.train.micro_batch * c.parallel.dp;
        const bool batch_ok = ok({"train.global_batch", "train.micro_batch", "parallel.dp"});
        if (batch_ok && rc.start >= c.train.global_batch)
          errors.push_back("schedule.rampup_batch_size: start " + std::to_string(rc.start) +
                           " must be below train.global_batch (" + std::to_string(c.train.global_batch) + ")");
        else if (batch_ok && (c.train.global_batch - rc.start) % rc.increment != 0)
          errors.push_back("schedule.rampup_batch_size: train.global_batch - start (" +
                           std::to_string(c.train.global_batch - rc.start) + ") is not a multiple of the increment " +
                           std::to_string(rc.increment));
        if (batch_ok && (rc.start % unit != 0 || rc.increment % unit != 0))
          errors.push_back("schedule.rampup_batch_size: start (" + std::to_string(rc.start) + ") and increment (" +
                           std::to_string(rc.increment) + ") must be multiples of micro_batch * dp (" +
                           std::to_string(unit) + ")");
        s.rampup = rc;
      }
    }
    f.finish();
    // A warmup longer than the run is allowed (a short trial of a long run's config): keel train
    // says where the run ends in it.
  }

  // ---- data ----
  {
    top.raw("data");
    Fields f(child(doc, "data"), "data", problems);
    c.data.train = f.strings("train");
    if (const json* w = f.raw("train_weights"); w && !w->is_null()) {
      const bool numbers = w->is_array() && std::all_of(w->begin(), w->end(), [](const json& e) { return e.is_number(); });
      if (!numbers) {
        errors.push_back("data.train_weights: expected a list of numbers, one per data.train entry, got " + w->dump());
      } else {
        for (const json& e : *w) c.data.train_weights.push_back(e.get<double>());
        if (c.data.train_weights.size() != c.data.train.size())
          errors.push_back("data.train_weights: " + std::to_string(c.data.train_weights.size()) + " weights for " +
                           std::to_string(c.data.train.size()) + " data.train entries (one weight per entry)");
        double total = 0;
        for (double x : c.data.train_weights) total += std::isfinite(x) && x > 0 ? x : 0;
        for (size_t k = 0; k < c.data.train_weights.size(); ++k) {
          const double x = c.data.train_weights[k];
          if (!std::isfinite(x) || x <= 0)
            errors.push_back("data.train_weights[" + std::to_string(k) + "]: " + w->at(k).dump() +
                             " is out of range (allowed: > 0)");
          else if (x / total * data::Blend::kPeriod < 1) {
            char share[32];  // %g: a share of 1e-07 is not "0.000000"
            std::snprintf(share, sizeof share, "%.3g", x / total);
            errors.push_back("data.train_weights[" + std::to_string(k) + "]: " + w->at(k).dump() + " is " + share +
                             " of the total, below the smallest share a blend gives (1/" +
                             std::to_string(data::Blend::kPeriod) + ")");
          }
        }
      }
    }
    c.data.val = f.strings("val");
    if (const json* sets = f.raw("val_sets"); sets && !sets->is_null()) {
      Fields set(sets, "data.val_sets", problems);  // an object of name: path or [paths]
      if (sets->is_object())
        for (const auto& [name, paths] : sets->items()) {
          const bool good_name = !name.empty() && std::all_of(name.begin(), name.end(), [](char ch) {
            return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.';
          });
          if (!good_name)
            set.error(set.path(name), "the name is not allowed (allowed: letters, digits, '_', '-' and '.'; it "
                                      "names the set in the log line, metrics.jsonl and TensorBoard)");
          std::vector<std::string> files = set.strings(name);
          if (files.empty() && (paths.is_string() || paths.is_array()))
            set.error(set.path(name), "no files (expected a path or a list of paths)");
          c.data.val_sets.emplace_back(name, std::move(files));
        }
    }
    c.data.shuffle = f.boolean("shuffle", true);
    c.data.document_masking = f.boolean("document_masking", false);
    c.data.eod_mask_loss = f.boolean("eod_mask_loss", false);
    const int64_t last_id = ok({"model.vocab_size"}) ? c.model.vocab_size - 1 : std::numeric_limits<int64_t>::max();
    c.data.eod_token = f.integer("eod_token", -1, -1, last_id);
    f.finish();
    if (c.data.train.empty()) errors.push_back("data.train: missing (required: token files or glob patterns)");
  }

  {
    top.raw("sample");
    Fields f(child(doc, "sample"), "sample", problems);
    SampleConfig& g = c.sample;
    g.interval = f.integer("interval", 0, 0);
    g.prompt = f.string("prompt", "");
    const int64_t most_tokens = ok({"model.max_seq_len"}) ? std::max<int64_t>(c.model.max_seq_len - 1, 1)
                                                          : std::numeric_limits<int64_t>::max();
    g.tokens = f.integer("tokens", g.tokens, 1, most_tokens);
    g.temperature = f.number("temperature", g.temperature, 0, 100);
    g.top_p = f.number("top_p", g.top_p, 0, 1, /*lo_open=*/true);
    g.top_k = f.integer("top_k", g.top_k, 0);
    g.seed = f.integer("seed", g.seed, 0);
    g.tokenizer = f.string("tokenizer", "");
    f.finish();
    if (g.interval > 0 && (c.parallel.tp > 1 || c.parallel.pp > 1))
      errors.push_back("sample.interval: generating during training needs the whole model on each rank "
                       "(parallel.tp = 1 and parallel.pp = 1; here tp = " + std::to_string(c.parallel.tp) +
                       ", pp = " + std::to_string(c.parallel.pp) +
                       "). Sample a checkpoint with keel sample instead, or set sample.interval to 0");
  }
  {
    top.raw("choice_eval");
    Fields f(child(doc, "choice_eval"), "choice_eval", problems);
    ChoiceEvalConfig& e = c.choice_eval;
    e.file = f.string("file", "");
    e.interval = f.integer("interval", 0, 0);
    e.items = f.integer("items", 0, 0);
    e.tokenizer = f.string("tokenizer", "");
    e.write_scores = f.boolean("write_scores", false);
    f.finish();
    // An empty file turns it off (--set choice_eval.file= on a config that has one); other
    // fields with no file named are a mistake.
    const json* section = child(doc, "choice_eval");
    if (section && section->is_object() && !section->empty() && !section->contains("file"))
      errors.push_back("choice_eval.file: missing (the JSONL items to score; the other choice_eval fields need it)");
  }

  // ---- log, checkpoint ----
  {
    top.raw("log");
    Fields f(child(doc, "log"), "log", problems);
    c.log.interval = f.integer("interval", 1, 1);
    c.log.timers = f.boolean("timers", c.log.timers);
    c.log.timers_interval_s = f.number("timers_interval_s", c.log.timers_interval_s, 0, 1e9);
    c.log.tensorboard = f.boolean("tensorboard", c.log.tensorboard);
    f.finish();
  }
  {
    top.raw("checkpoint");
    Fields f(child(doc, "checkpoint"), "checkpoint", problems);
    c.checkpoint.interval = f.integer("interval", 0, 0);
    c.checkpoint.keep_last = f.integer("keep_last", 3, 1);
    c.checkpoint.keep_every = f.integer("keep_every", 0, 0);
    c.checkpoint.save_at_end = f.boolean("save_at_end", true);
    c.checkpoint.async = f.boolean("async", false);
    c.checkpoint.dir = f.string("dir", "");
    f.finish();
  }

  {
    top.raw("health");
    Fields f(child(doc, "health"), "health", problems);
    HealthConfig& h = c.health;
    h.replica_check_interval = f.integer("replica_check_interval", h.replica_check_interval, 0);
    h.param_group_audit = f.choice("param_group_audit", h.param_group_audit, {"error", "warn"});
    h.host_memory_check = f.choice("host_memory_check", h.host_memory_check, {"error", "warn"});
    h.frozen_check_interval = f.integer("frozen_check_interval", h.frozen_check_interval, 0);
    h.frozen_window = f.integer("frozen_window", h.frozen_window, 1);
    h.frozen_fraction = f.number("frozen_fraction", h.frozen_fraction, 0, 1, true);
    h.stats_interval = f.integer("stats_interval", h.stats_interval, 0);
    h.localize_nonfinite = f.boolean("localize_nonfinite", h.localize_nonfinite);
    h.spike_zscore = f.number("spike_zscore", h.spike_zscore, 0, 1e6, true);
    h.spike_warmup = f.integer("spike_warmup", h.spike_warmup, 1);
    h.spike_min_jump = f.number("spike_min_jump", h.spike_min_jump, 0, 1e6);
    h.spike_norm_ratio = f.number("spike_norm_ratio", h.spike_norm_ratio, 1, 1e6);
    h.spike_action = f.choice("spike_action", h.spike_action, {"warn", "skip", "rewind"});
    h.verify_restart = f.boolean("verify_restart", h.verify_restart);
    h.straggler_ratio = f.number("straggler_ratio", h.straggler_ratio, 0, 1e6);
    if (h.straggler_ratio > 0 && h.straggler_ratio <= 1)
      errors.push_back("health.straggler_ratio: " + nlohmann::json(h.straggler_ratio).dump() +
                       " would call typical ranks slow (allowed: 0 to turn the check off, or a ratio above 1 such as 1.25)");
    f.finish();
  }

  c.device = top.choice("device", "auto", {"auto", "cpu", "cuda"});
  c.out = top.string("out", "out/" + c.name);
  if (c.out.empty())
    top.error("out", "an empty path is not allowed (--out or \"out\" names the run directory; leave it out for out/" +
                         c.name + ")");
  if (c.checkpoint.dir.empty()) c.checkpoint.dir = (std::filesystem::path(c.out) / "checkpoints").string();
  c.description = top.string("description", "");
  top.finish();

  if (!errors.empty()) {
    std::string msg = "invalid config " + source + ":";
    for (const auto& e : errors) msg += "\n  " + e;
    throw ConfigError(msg);
  }
  return c;
}

void apply_override(json& doc, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError("--set " + assignment + ": expected key.path=value, e.g. --set optimizer.lr=3e-4");
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  json value;
  try {
    value = parse_json_once_per_key(text, "--set " + assignment, key);
  } catch (const json::exception& e) {
    // A list or object that is not JSON ([/a.bin]: unquoted strings) would become a string, and
    // then a glob pattern: say what is wrong with it instead.
    const size_t first = text.find_first_not_of(" \t");
    if (first != std::string::npos && (text[first] == '[' || text[first] == '{'))
      throw ConfigError("--set " + assignment + ": the value starts like a JSON list or object but is not valid JSON (" +
                        e.what() + "). Strings need double quotes, inside a list (--set '" + key +
                        "=[\"a.bin\", \"b.bin\"]') and for a string that starts with [ or { (--set '" + key +
                        "=\"[INST] ...\"')");
    value = text;  // bare strings: --set precision.mode=fp32
  }
  json* node = &doc;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) throw ConfigError("--set " + assignment + ": empty name in '" + key + "'");
    if (!node->is_object()) {
      if (!node->is_null()) throw ConfigError("--set " + assignment + ": '" + key.substr(0, start ? start - 1 : 0) + "' is not an object");
      *node = json::object();
    }
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return;
    }
    node = &(*node)[part];
    start = dot + 1;
  }
}

std::vector<int> RunConfig::step_micro_batch_counts(int64_t micro_batch, int64_t dp) const {
  const int64_t unit = micro_batch * dp;
  std::vector<int> counts = {static_cast<int>(train.global_batch / unit)};
  if (const auto& r = schedule.rampup; r && r->increment > 0)
    for (int64_t b = r->start; b < train.global_batch; b += r->increment)
      if (b / unit > 0) counts.push_back(static_cast<int>(b / unit));
  return counts;
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) {
    throw ConfigError("cannot read config file " + path + ": " +
                      (std::filesystem::exists(path) ? "permission denied or not a file" : "no such file"));
  }
  json doc;
  try {
    doc = parse_json_once_per_key(std::string(std::istreambuf_iterator<char>(in), {}), "config file " + path);
  } catch (const json::parse_error& e) {
    throw ConfigError("config file " + path + " is not valid JSON: " + e.what());
  }
  // train.init_from names the weights the file was written for (keel convert puts "." beside
  // them): read from the file's folder, so it holds wherever the folder moves. --set values, like
  // every other path, stay relative to the current directory (resolve_paths).
  if (doc.is_object() && doc.contains("train") && doc["train"].is_object() && doc["train"].contains("init_from") &&
      doc["train"]["init_from"].is_string()) {
    std::string& v = doc["train"]["init_from"].get_ref<std::string&>();
    const bool hf = v.rfind("hf:", 0) == 0;
    const std::filesystem::path p = hf ? v.substr(3) : v;
    if (!p.empty() && p.is_relative()) {
      std::filesystem::path abs = (std::filesystem::absolute(path).parent_path() / p).lexically_normal();
      if (abs.filename().empty()) abs = abs.parent_path();  // "." -> the folder, without a trailing '/'
      v = (hf ? "hf:" : "") + abs.string();
    }
  }
  for (const auto& o : overrides) apply_override(doc, o);
  return parse_config(doc, path);
}

json rope_scaling_json(const RopeScaling& s, const char* type_key) {
  if (s.kind == RopeScaling::Kind::None) return nullptr;
  return {{type_key, "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_position}};
}

void add_model_options(json& model, const ModelConfig& m) {
  if (m.alibi) model["position_embedding"] = m.position_embedding();
  if (m.embedding_norm) model["embedding_norm"] = true;
  if (m.qkv_bias) model["qkv_bias"] = true;
  if (m.qk_norm) model["qk_norm"] = true;
  if (m.explicit_head_dim > 0) model["head_dim"] = m.explicit_head_dim;
  if (m.sliding_window > 0) model["sliding_window"] = m.sliding_window;
}

std::vector<FieldChange> field_changes(const json& a, const json& b, const std::string& prefix) {
  const json fa = a.flatten(), fb = b.flatten();  // keys as JSON pointers: "/optimizer/lr"
  std::set<std::string> keys;
  for (const auto& item : fa.items()) keys.insert(item.key());
  for (const auto& item : fb.items()) keys.insert(item.key());
  auto shown = [](const json& j, const std::string& k) { return j.contains(k) ? j[k].dump() : std::string("-"); };
  std::vector<FieldChange> out;
  for (std::string k : keys) {
    FieldChange c{"", shown(fa, k), shown(fb, k)};
    if (c.a == c.b) continue;
    std::replace(k.begin(), k.end(), '/', '.');
    c.field = prefix.empty() ? k.substr(1) : prefix + k;
    out.push_back(std::move(c));
  }
  return out;
}

void resolve_paths(RunConfig& c) {
  auto resolve = [](std::string& path) {
    if (!path.empty()) path = std::filesystem::absolute(path).lexically_normal().string();
  };
  for (std::string* p : {&c.out, &c.checkpoint.dir, &c.sample.tokenizer, &c.choice_eval.file, &c.choice_eval.tokenizer})
    resolve(*p);
  if (c.train.init_from.rfind("hf:", 0) == 0) {
    std::string dir = c.train.init_from.substr(3);
    resolve(dir);
    c.train.init_from = "hf:" + dir;
  } else {
    resolve(c.train.init_from);
  }
  for (std::string& p : c.data.train) resolve(p);
  for (std::string& p : c.data.val) resolve(p);
  for (auto& [name, files] : c.data.val_sets)
    for (std::string& p : files) resolve(p);
}

json to_json(const RunConfig& c) {
  const ModelConfig& m = c.model;
  json j;
  j["model"] = {{"family", family_name(m.family)},
                {"vocab_size", m.vocab_size},
                {"pad_vocab_to_multiple_of", m.pad_vocab_multiple},
                {"d_model", m.d_model},
                {"n_layers", m.n_layers},
                {"n_heads", m.n_heads},
                {"n_kv_heads", m.n_kv_heads},
                {"ffn_hidden", m.ffn_hidden},
                {"norm_eps", m.norm_eps},
                {"rope_theta", m.rope_theta},
                {"max_seq_len", m.max_seq_len},
                {"tied_embeddings", m.tied_embeddings},
                {"init_std", m.init_std}};
  if (m.rope_scaling.kind != RopeScaling::Kind::None) j["model"]["rope_scaling"] = rope_scaling_json(m.rope_scaling);
  add_model_options(j["model"], m);
  const LossScaleConfig& s = c.precision.loss_scale;
  j["precision"] = {{"mode", precision_name(c.precision.mode)},
                    {"stochastic_rounding", c.precision.stochastic_rounding},
                    {"loss_scale",
                     {{"initial", s.initial},
                      {"growth_interval", s.growth_interval},
                      {"hysteresis", s.hysteresis},
                      {"min", s.min},
                      {"growth_factor", s.growth_factor},
                      {"backoff_factor", s.backoff_factor}}}};
  const OptimizerConfig& o = c.optimizer;
  j["optimizer"] = {{"type", "adamw"},      {"lr", o.lr},   {"min_lr", o.min_lr},
                    {"beta1", o.beta1},     {"beta2", o.beta2}, {"eps", o.eps},
                    {"weight_decay", o.weight_decay}, {"grad_clip", o.grad_clip}};
  const char* decay = c.schedule.decay == DecayStyle::Cosine   ? "cosine"
                      : c.schedule.decay == DecayStyle::Linear ? "linear"
                      : c.schedule.decay == DecayStyle::WSD    ? "wsd"
                                                               : "constant";
  j["schedule"] = {{"warmup_steps", c.schedule.warmup_steps},
                   {"decay", decay},
                   {"decay_steps", c.schedule.decay_steps},
                   {"rampup_batch_size", c.schedule.rampup
                                             ? json::array({c.schedule.rampup->start, c.schedule.rampup->increment,
                                                            c.schedule.rampup->samples})
                                             : json(nullptr)}};
  if (c.schedule.decay == DecayStyle::WSD) {
    j["schedule"]["wsd_decay_steps"] = c.schedule.wsd_decay_steps;
    j["schedule"]["wsd_decay_style"] = c.schedule.wsd_decay_style == CooldownShape::Linear   ? "linear"
                                       : c.schedule.wsd_decay_style == CooldownShape::Cosine ? "cosine"
                                                                                             : "1-sqrt";
  }
  const TrainConfig& t = c.train;
  j["train"] = {{"steps", t.steps},
                {"global_batch", t.global_batch},
                {"micro_batch", t.micro_batch},
                {"seq_len", t.seq_len},
                {"seed", t.seed},
                {"eval_interval", t.eval_interval},
                {"eval_batches", t.eval_batches},
                {"eval_at_start", t.eval_at_start},
                {"recompute", t.recompute},
                {"recompute_layers", t.recompute_layers},
                {"logits_chunk_rows", t.logits_chunk_rows}};
  if (!t.init_from.empty()) j["train"]["init_from"] = t.init_from;  // only when set: older configs compare equal
  j["data"] = {{"train", c.data.train}, {"val", c.data.val}, {"shuffle", c.data.shuffle}};
  for (const auto& [name, files] : c.data.val_sets) j["data"]["val_sets"][name] = files;
  if (!c.data.train_weights.empty()) j["data"]["train_weights"] = c.data.train_weights;
  if (c.data.document_masking) j["data"]["document_masking"] = true;
  if (c.data.eod_mask_loss) j["data"]["eod_mask_loss"] = true;
  if (c.data.eod_token >= 0) j["data"]["eod_token"] = c.data.eod_token;
  if (!c.choice_eval.file.empty()) {
    const ChoiceEvalConfig& e = c.choice_eval;
    j["choice_eval"] = {{"file", e.file},         {"interval", e.interval},   {"items", e.items},
                        {"tokenizer", e.tokenizer}, {"write_scores", e.write_scores}};
  }
  if (c.sample.interval > 0) {
    const SampleConfig& g = c.sample;
    j["sample"] = {{"interval", g.interval}, {"prompt", g.prompt}, {"tokens", g.tokens},
                   {"temperature", g.temperature}, {"top_p", g.top_p}, {"top_k", g.top_k},
                   {"seed", g.seed}, {"tokenizer", g.tokenizer}};
  }
  j["log"] = {{"interval", c.log.interval},
              {"timers", c.log.timers},
              {"timers_interval_s", c.log.timers_interval_s},
              {"tensorboard", c.log.tensorboard}};
  j["checkpoint"] = {{"interval", c.checkpoint.interval},
                     {"keep_last", c.checkpoint.keep_last},
                     {"keep_every", c.checkpoint.keep_every},
                     {"save_at_end", c.checkpoint.save_at_end},
                     {"async", c.checkpoint.async}};
  // The default, <out>/checkpoints, follows `out` and is left out: a printed or saved config run
  // again with another --out must not save into (resume from, prune) the first run's checkpoints.
  if (c.checkpoint.dir != (std::filesystem::path(c.out) / "checkpoints").string())
    j["checkpoint"]["dir"] = c.checkpoint.dir;
  j["parallel"] = {{"tp", c.parallel.tp},
                   {"pp", c.parallel.pp},
                   {"dp", c.parallel.dp},
                   {"embedding_slot", c.parallel.embedding_slot},
                   {"pipeline_layers", c.parallel.pipeline_layers},
                   {"sequence_parallel", c.parallel.sequence_parallel},
                   {"virtual_stages", c.parallel.virtual_stages},
                   {"overlap_grad_reduce", c.parallel.overlap_grad_reduce},
                   {"grad_bucket_size", c.parallel.grad_bucket_size},
                   {"overlap_param_gather", c.parallel.overlap_param_gather}};
  const HealthConfig& h = c.health;
  j["health"] = {{"replica_check_interval", h.replica_check_interval},
                 {"param_group_audit", h.param_group_audit},
                 {"host_memory_check", h.host_memory_check},
                 {"frozen_check_interval", h.frozen_check_interval},
                 {"frozen_window", h.frozen_window},
                 {"frozen_fraction", h.frozen_fraction},
                 {"stats_interval", h.stats_interval},
                 {"localize_nonfinite", h.localize_nonfinite},
                 {"spike_zscore", h.spike_zscore},
                 {"spike_warmup", h.spike_warmup},
                 {"spike_min_jump", h.spike_min_jump},
                 {"spike_norm_ratio", h.spike_norm_ratio},
                 {"spike_action", h.spike_action},
                 {"verify_restart", h.verify_restart},
                 {"straggler_ratio", h.straggler_ratio}};
  j["device"] = c.device;
  j["out"] = c.out;
  if (!c.description.empty()) j["description"] = c.description;
  return j;
}

}  // namespace keel
