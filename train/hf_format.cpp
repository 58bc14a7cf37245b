#include "train/hf_format.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "data/checksum.h"
#include "data/file_io.h"
#include "data/token_file.h"
#include "train/model_loading.h"

namespace keel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::optional<DType> dtype_of(data::SafetensorsDtype t) {
  switch (t) {
    case data::SafetensorsDtype::F32: return DType::F32;
    case data::SafetensorsDtype::BF16: return DType::BF16;
    case data::SafetensorsDtype::F16: return DType::F16;
    default: return std::nullopt;
  }
}

data::SafetensorsDtype st_dtype(DType t) {
  switch (t) {
    case DType::BF16: return data::SafetensorsDtype::BF16;
    case DType::F16: return data::SafetensorsDtype::F16;
    default: return data::SafetensorsDtype::F32;
  }
}

std::string torch_dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: return "float32";
  }
}

float load_float(const char* p, DType t) {
  uint16_t h;
  float f;
  switch (t) {
    case DType::BF16: std::memcpy(&h, p, 2); return bf16_to_f32(h);
    case DType::F16: std::memcpy(&h, p, 2); return f16_to_f32(h);
    default: std::memcpy(&f, p, 4); return f;
  }
}

// n elements, a byte copy when the dtypes agree, else through fp32 rounding to nearest even.
void convert_elements(const char* src, DType s, char* dst, DType d, int64_t n) {
  if (s == d) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(s));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_float(src + i * dtype_size(s), s);
    char* o = dst + i * dtype_size(d);
    if (d == DType::BF16) {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(o, &h, 2);
    } else if (d == DType::F16) {
      const uint16_t h = f32_to_f16(v);
      std::memcpy(o, &h, 2);
    } else {
      std::memcpy(o, &v, 4);
    }
  }
}

// What --dtype fp16 could not hold, per tensor: values beyond its range (they would become
// inf), inf/NaN already in the source, and nonzero values too small for it (they become 0).
struct Fp16Range {
  int64_t overflow = 0, nonfinite = 0, underflow = 0;
  double largest = 0;  // the largest finite magnitude seen
};

// fp32 -> fp16 (round to nearest even), counting into r.
void to_f16_counting(const float* v, int64_t n, char* out, Fp16Range& r) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = f32_to_f16(v[i]);
    std::memcpy(out + 2 * i, &h, 2);
    if (!std::isfinite(v[i])) {
      ++r.nonfinite;
      continue;
    }
    r.largest = std::max(r.largest, std::fabs(static_cast<double>(v[i])));
    const float back = f16_to_f32(h);
    if (!std::isfinite(back)) ++r.overflow;
    else if (back == 0 && v[i] != 0) ++r.underflow;
  }
}

std::string fp16_underflow_note(int64_t n) {
  return "--dtype fp16: " + std::to_string(n) + " nonzero value(s) are below fp16's smallest (about 6e-8) and became 0";
}

// Refuses a tensor fp16 cannot hold, naming it; tiny values lost to zero only add to *underflow.
// `option`: how fp16 was asked for (--dtype fp16, or auto from the source's dtype).
void check_fp16_range(const Fp16Range& r, const std::string& tensor, const std::string& who, int64_t* underflow,
                      const std::string& option = "--dtype fp16") {
  char largest[32];
  std::snprintf(largest, sizeof largest, "%.6g", r.largest);
  if (r.nonfinite > 0)
    throw CheckpointError(who + ": tensor " + tensor + " holds " + std::to_string(r.nonfinite) +
                          " inf/NaN value(s) (largest finite magnitude " + largest +
                          "); the weights are broken, nothing was written");
  if (r.overflow > 0)
    throw CheckpointError(option + ": tensor " + tensor + " of " + who + " has " + std::to_string(r.overflow) +
                          " value(s) beyond fp16's range (largest magnitude " + largest +
                          ", fp16 holds up to 65504) that would become inf; pass --dtype bf16 or fp32. Nothing was "
                          "written");
  *underflow += r.underflow;
}

json read_json_file(const fs::path& p, const std::string& what) {
  std::ifstream in(p);
  if (!in) throw CheckpointError(what + " " + p.string() + " cannot be read");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw CheckpointError(what + " " + p.string() + " is not valid JSON: " + e.what());
  }
}

// A number field of an HF config, with a default when absent or null.
double num(const json& c, const char* key, double def) {
  return c.contains(key) && c[key].is_number() ? c[key].get<double>() : def;
}

void write_json_file(const fs::path& p, const json& j) {
  try {
    data::detail::write_text_file(p.string(), j.dump(2) + "\n");
  } catch (const data::DataError& e) {
    throw CheckpointError(e.what());
  }
}

}  // namespace

const std::vector<std::string>& hf_side_files() {
  static const std::vector<std::string> files = {"tokenizer.json",          "tokenizer_config.json",
                                                 "special_tokens_map.json", "tokenizer.model",
                                                 "generation_config.json",  "chat_template.jinja"};
  return files;
}

std::vector<std::string> copy_side_files(const fs::path& from, const fs::path& to) {
  std::vector<std::string> copied;
  for (const std::string& f : hf_side_files()) {
    if (!fs::exists(from / f)) continue;
    fs::copy_file(from / f, to / f, fs::copy_options::overwrite_existing);
    copied.push_back(f);
  }
  return copied;
}

std::optional<std::string> hf_path(const std::string& spec) {
  if (spec.rfind("hf:", 0) != 0) return std::nullopt;
  return spec.substr(3);
}

// ======================================================================================
// config.json
// ======================================================================================

std::string hf_arch_name(HfArch a) {
  switch (a) {
    case HfArch::GPT2: return "GPT2LMHeadModel";
    case HfArch::Bloom: return "BloomForCausalLM";
    case HfArch::Qwen2: return "Qwen2ForCausalLM";
    case HfArch::Qwen3: return "Qwen3ForCausalLM";
    case HfArch::Mistral: return "MistralForCausalLM";
    default: return "LlamaForCausalLM";
  }
}

namespace {
// Llama and its relatives that keel's llama family (with options) represents.
bool llama_like(HfArch a) {
  return a == HfArch::Llama || a == HfArch::Mistral || a == HfArch::Qwen2 || a == HfArch::Qwen3;
}
}  // namespace

HfArch hf_arch_for(const ModelConfig& m, const std::string& who) {
  if (m.is_llama()) {
    if (m.alibi || m.embedding_norm)
      throw CheckpointError(who + " holds a Llama with " +
                            (m.alibi ? "ALiBi (model.position_embedding \"alibi\")" : "an embedding norm") +
                            "; Hugging Face's Llama has neither, so it has no Hugging Face architecture");
    if (m.qkv_bias && m.qk_norm)
      throw CheckpointError(who + " holds a Llama with both q/k/v biases (Qwen2's) and q/k norms (Qwen3's); no "
                            "Hugging Face architecture has both");
    // Mistral is Llama with a sliding window; Qwen2 and Qwen3 have one as an option.
    return m.qkv_bias ? HfArch::Qwen2 : m.qk_norm ? HfArch::Qwen3 : m.sliding_window > 0 ? HfArch::Mistral : HfArch::Llama;
  }
  if (m.sliding_window > 0)
    throw CheckpointError(who + " holds a gpt2 model with a sliding window (model.sliding_window " +
                          std::to_string(m.sliding_window) + "); Hugging Face's GPT-2 and BLOOM have none");
  if (!m.alibi && !m.embedding_norm) return HfArch::GPT2;
  if (m.alibi && m.embedding_norm) {
    if (m.ffn_hidden != 4 * m.d_model)
      throw CheckpointError(who + " holds a BLOOM-style model with ffn_hidden " + std::to_string(m.ffn_hidden) +
                            "; Hugging Face's BLOOM fixes the MLP at 4 x d_model = " + std::to_string(4 * m.d_model));
    return HfArch::Bloom;
  }
  throw CheckpointError(who + " holds a gpt2 model with " +
                        (m.alibi ? std::string("ALiBi but no embedding norm") : std::string("an embedding norm but learned positions")) +
                        "; Hugging Face's GPT-2 has neither, its BLOOM has both");
}

namespace {

// The first integer among an HF config's spellings of a field (GPT-2 and BLOOM configs predate
// transformers' common names), or a problem naming them.
int64_t int_field(const json& c, std::initializer_list<const char*> keys, std::vector<std::string>& problems) {
  for (const char* k : keys)
    if (c.contains(k) && c[k].is_number_integer()) return c[k].get<int64_t>();
  std::string names;
  for (const char* k : keys) names += (names.empty() ? "" : " or ") + std::string(k);
  problems.push_back(names + " is missing");
  return 0;
}

void throw_problems(const std::vector<std::string>& problems, const std::string& what) {
  if (problems.empty()) return;
  std::string msg = what;
  for (const auto& p : problems) msg += "\n  " + p;
  throw CheckpointError(msg);
}

// model.sliding_window from an HF config. keel's window applies to every layer:
//   Mistral: sliding_window (null: none);
//   Qwen2 / Qwen3: sliding_window when use_sliding_window, in the layers that layer_types marks
//     "sliding_attention" (transformers 5 writes them), else in layers >= max_window_layers;
//   Llama: none (LlamaForCausalLM ignores a sliding_window field, so keel refuses one).
void read_sliding_window(const json& c, HfArch arch, ModelConfig& m, std::vector<std::string>& problems) {
  const bool has_window = c.contains("sliding_window") && !c["sliding_window"].is_null();
  if (arch == HfArch::Llama) {
    if (has_window)
      problems.push_back("sliding_window " + c["sliding_window"].dump() + " on a LlamaForCausalLM, which ignores it; "
                         "say MistralForCausalLM (or drop the field)");
    return;
  }
  const bool qwen = arch == HfArch::Qwen2 || arch == HfArch::Qwen3;
  const bool typed = qwen && c.contains("layer_types") && c["layer_types"].is_array();
  if (typed)
    for (const json& t : c["layer_types"])
      if (t != "sliding_attention" && t != "full_attention") {
        problems.push_back("layer_types holds " + t.dump() + " layers; keel knows \"full_attention\" and "
                           "\"sliding_attention\"");
        return;
      }
  if (!has_window || (qwen && !c.value("use_sliding_window", false))) return;
  if (!c["sliding_window"].is_number_integer() || c["sliding_window"].get<int64_t>() < 1 ||
      c["sliding_window"].get<int64_t>() > (1 << 30)) {
    problems.push_back("sliding_window " + c["sliding_window"].dump() + " is not a positive integer");
    return;
  }
  const int window = c["sliding_window"].get<int>();
  int sliding = m.n_layers, n_types = m.n_layers;  // layers with the window, of how many
  if (typed) {
    n_types = static_cast<int>(c["layer_types"].size());
    sliding = static_cast<int>(std::count(c["layer_types"].begin(), c["layer_types"].end(), "sliding_attention"));
  } else if (qwen) {
    const int64_t first = c.contains("max_window_layers") && c["max_window_layers"].is_number_integer()
                              ? c["max_window_layers"].get<int64_t>()
                              : 28;  // transformers' default
    sliding = static_cast<int>(std::clamp<int64_t>(m.n_layers - first, 0, m.n_layers));
  }
  if (sliding == 0) return;  // the window is in no layer
  if (sliding != n_types)
    problems.push_back("sliding_window attention in " + std::to_string(sliding) + " of " + std::to_string(n_types) +
                       " layers (layer_types / max_window_layers); keel's model.sliding_window applies to every "
                       "layer");
  else m.sliding_window = window;
}

// Llama, Mistral, Qwen2 and Qwen3: keel's llama family (Qwen2 adds biases to the q, k and v
// projections, Qwen3 RMSNorms of each q and k head; Mistral and both Qwens may have a sliding
// window).
ModelConfig llama_config_from_hf(const json& c, const std::string& where, HfArch arch) {
  std::vector<std::string> problems;
  ModelConfig m;
  m.family = Family::Llama;
  m.qkv_bias = arch == HfArch::Qwen2;
  m.qk_norm = arch == HfArch::Qwen3;
  m.vocab_size = int_field(c, {"vocab_size"}, problems);
  m.d_model = static_cast<int>(int_field(c, {"hidden_size"}, problems));
  m.n_layers = static_cast<int>(int_field(c, {"num_hidden_layers"}, problems));
  m.n_heads = static_cast<int>(int_field(c, {"num_attention_heads"}, problems));
  m.ffn_hidden = static_cast<int>(int_field(c, {"intermediate_size"}, problems));
  throw_problems(problems, where + " is not a usable Llama config:");
  m.n_kv_heads = c.contains("num_key_value_heads") && c["num_key_value_heads"].is_number_integer()
                     ? c["num_key_value_heads"].get<int>()
                     : m.n_heads;
  m.norm_eps = static_cast<float>(num(c, "rms_norm_eps", 1e-6));
  m.max_seq_len = static_cast<int>(num(c, "max_position_embeddings", 2048));
  m.tied_embeddings = c.value("tie_word_embeddings", false);

  // RoPE: transformers < 5 writes rope_theta (+ rope_scaling); 5.x writes rope_parameters.
  // Scaling: "default" (none) and Llama 3.1's "llama3"; any other is refused, never ignored.
  double theta = num(c, "rope_theta", 10000.0);
  auto read_scaling = [&](const json& r, const std::string& field) {
    const std::string rt = r.is_object() ? r.value("rope_type", r.value("type", std::string("?"))) : "?";
    if (rt == "default") return;
    if (rt != "llama3") {
      problems.push_back(field + " type \"" + rt + "\" (RoPE scaling) is not supported; keel supports \"default\" and "
                         "\"llama3\" (Llama 3.1 / 3.2)");
      return;
    }
    RopeScaling& s = m.rope_scaling;
    s.kind = RopeScaling::Kind::Llama3;
    for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (!r.contains(key) || !r[key].is_number()) problems.push_back(field + " (llama3) lacks the number \"" + key + "\"");
    s.factor = num(r, "factor", s.factor);
    s.low_freq_factor = num(r, "low_freq_factor", s.low_freq_factor);
    s.high_freq_factor = num(r, "high_freq_factor", s.high_freq_factor);
    s.original_max_position = static_cast<int64_t>(num(r, "original_max_position_embeddings",
                                                       static_cast<double>(s.original_max_position)));
  };
  // Both may be there (a transformers 4 config edited, or saved again by 5): transformers
  // applies a rope_scaling next to a "default" rope_parameters, so both are read, and two
  // scalings that differ are refused rather than one picked.
  const bool has_parameters = c.contains("rope_parameters") && c["rope_parameters"].is_object();
  if (has_parameters) {
    const json& rp = c["rope_parameters"];
    theta = num(rp, "rope_theta", theta);
    read_scaling(rp, "rope_parameters");
  }
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) {
    const RopeScaling from_parameters = m.rope_scaling;
    read_scaling(c["rope_scaling"], "rope_scaling");
    if (has_parameters && from_parameters.kind != RopeScaling::Kind::None && from_parameters != m.rope_scaling)
      problems.push_back("rope_parameters and rope_scaling give two different RoPE scalings (" +
                         c["rope_parameters"].dump() + " and " + c["rope_scaling"].dump() +
                         "): keep the one the model was trained with");
  }
  m.rope_theta = static_cast<float>(theta);

  if (c.value("attention_bias", false))
    problems.push_back("attention_bias = true (biases on q/k/v and o) is not supported (keel's qkv_bias is Qwen2's: "
                       "q/k/v only)");
  if (c.value("mlp_bias", false)) problems.push_back("mlp_bias = true is not supported");
  read_sliding_window(c, arch, m, problems);
  const std::string act = c.value("hidden_act", std::string("silu"));
  if (act != "silu") problems.push_back("hidden_act \"" + act + "\" is not supported (keel's SwiGLU uses silu)");
  // head_dim: Qwen3 and some Mistrals set it apart from hidden_size / num_attention_heads.
  if (c.contains("head_dim") && c["head_dim"].is_number_integer() && c["head_dim"].get<int>() > 0 && m.n_heads > 0 &&
      (m.d_model % m.n_heads != 0 || c["head_dim"].get<int>() != m.d_model / m.n_heads))
    m.explicit_head_dim = c["head_dim"].get<int>();
  if (m.n_kv_heads <= 0 || (m.n_heads > 0 && m.n_heads % m.n_kv_heads != 0))
    problems.push_back("num_key_value_heads " + std::to_string(m.n_kv_heads) + " does not divide num_attention_heads " +
                       std::to_string(m.n_heads));
  throw_problems(problems, where + " uses features keel cannot represent:");
  return m;
}

// GPT-2 and BLOOM: keel's gpt2 family (LayerNorm, tanh GELU, biases, tied head by default).
ModelConfig gpt2_config_from_hf(const json& c, const std::string& where, HfArch arch) {
  std::vector<std::string> problems;
  ModelConfig m;
  m.family = Family::GPT2;
  const bool bloom = arch == HfArch::Bloom;
  m.vocab_size = int_field(c, {"vocab_size"}, problems);
  m.d_model = static_cast<int>(bloom ? int_field(c, {"hidden_size", "n_embed"}, problems)
                                     : int_field(c, {"n_embd", "hidden_size"}, problems));
  m.n_layers = static_cast<int>(int_field(c, {"n_layer", "num_hidden_layers"}, problems));
  m.n_heads = static_cast<int>(int_field(c, {"n_head", "num_attention_heads"}, problems));
  if (!bloom) m.max_seq_len = static_cast<int>(int_field(c, {"n_positions", "max_position_embeddings"}, problems));
  throw_problems(problems, where + " is not a usable " + std::string(bloom ? "BLOOM" : "GPT-2") + " config:");
  m.n_kv_heads = m.n_heads;
  m.norm_eps = static_cast<float>(num(c, "layer_norm_epsilon", 1e-5));
  m.tied_embeddings = c.value("tie_word_embeddings", true);
  if (bloom) {
    // ALiBi has no position table, so no limit; seq_length (BLOOM's configs) or its 2048.
    m.max_seq_len = static_cast<int>(num(c, "seq_length", 2048));
    m.ffn_hidden = 4 * m.d_model;  // HF's BloomMLP
    m.alibi = true;
    m.embedding_norm = true;
    if (c.value("apply_residual_connection_post_layernorm", false))
      problems.push_back("apply_residual_connection_post_layernorm = true (the residual taken after the norm) is not "
                         "supported");
  } else {
    m.ffn_hidden = c.contains("n_inner") && c["n_inner"].is_number_integer() ? c["n_inner"].get<int>() : 4 * m.d_model;
    const std::string act = c.value("activation_function", std::string("gelu_new"));
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      problems.push_back("activation_function \"" + act + "\" is not supported (keel's GELU is the tanh approximation: "
                         "\"gelu_new\" or \"gelu_pytorch_tanh\")");
    if (!c.value("scale_attn_weights", true))
      problems.push_back("scale_attn_weights = false (scores not divided by sqrt(head_dim)) is not supported");
    if (c.value("scale_attn_by_inverse_layer_idx", false))
      problems.push_back("scale_attn_by_inverse_layer_idx = true is not supported");
    if (c.value("add_cross_attention", false)) problems.push_back("add_cross_attention = true is not supported");
  }
  if (c.contains("quantization_config")) problems.push_back("quantized checkpoints (quantization_config) are not supported");
  throw_problems(problems, where + " uses features keel cannot represent:");
  return m;
}

HfArch hf_arch_of_config(const json& c, const std::string& source) {
  const std::string arch = c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty()
                               ? c["architectures"][0].get<std::string>()
                               : "";
  const std::string type = c.value("model_type", "");
  if (arch.empty() && type.empty())
    throw CheckpointError(source + " has neither \"architectures\" nor \"model_type\", so the model is unknown; keel "
                          "converts LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                          "GPT2LMHeadModel and BloomForCausalLM (add \"architectures\": [\"LlamaForCausalLM\"] or the "
                          "right one)");
  auto is = [&](const char* a, const char* t) { return arch == a || (arch.empty() && type == t); };
  if (is("LlamaForCausalLM", "llama")) return HfArch::Llama;
  if (is("MistralForCausalLM", "mistral")) return HfArch::Mistral;
  if (is("Qwen2ForCausalLM", "qwen2")) return HfArch::Qwen2;
  if (is("Qwen3ForCausalLM", "qwen3")) return HfArch::Qwen3;
  if (is("GPT2LMHeadModel", "gpt2")) return HfArch::GPT2;
  if (is("BloomForCausalLM", "bloom")) return HfArch::Bloom;
  throw CheckpointError(source + ": architecture \"" + (arch.empty() ? "?" : arch) + "\" (model_type \"" + type +
                        "\") is not supported; keel converts LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                        "Qwen3ForCausalLM, GPT2LMHeadModel and BloomForCausalLM");
}

}  // namespace

ModelConfig model_config_from_hf(const json& c, const std::string& source) {
  const HfArch arch = hf_arch_of_config(c, source);
  const std::string where = source + " (" + hf_arch_name(arch) + ")";
  ModelConfig m = llama_like(arch) ? llama_config_from_hf(c, where, arch) : gpt2_config_from_hf(c, where, arch);
  m.pad_vocab_multiple = 1;
  m.init_std = static_cast<float>(num(c, "initializer_range", 0.02));
  std::vector<std::string> problems;
  if (m.n_heads <= 0 || (m.d_model % m.n_heads != 0 && m.explicit_head_dim == 0))
    problems.push_back("the hidden size " + std::to_string(m.d_model) + " is not a multiple of the head count " +
                       std::to_string(m.n_heads));
  throw_problems(problems, where + " uses features keel cannot represent:");
  return m;
}

std::vector<HfTensorSlice> hf_tensor_layout(const ModelConfig& m, const std::string& tensor_prefix) {
  const HfArch arch = hf_arch_for(m, "the model");
  const int64_t V = m.vocab_size, d = m.d_model, f = m.ffn_hidden, hd = m.head_dim();
  std::vector<HfTensorSlice> out;
  auto whole = [&](std::string keel, std::string hf, std::vector<int64_t> shape) {
    out.push_back({std::move(keel), std::move(hf), std::move(shape)});
  };
  if (llama_like(arch)) {
    const int64_t q = m.q_dim(), kv = m.kv_dim();
    whole("tok_embed", "model.embed_tokens.weight", {V, d});
    for (int i = 0; i < m.n_layers; ++i) {
      const std::string k = "layers." + std::to_string(i) + ".", h = "model.layers." + std::to_string(i) + ".";
      whole(k + "attn_norm.weight", h + "input_layernorm.weight", {d});
      whole(k + "attn.wq", h + "self_attn.q_proj.weight", {q, d});
      whole(k + "attn.wk", h + "self_attn.k_proj.weight", {kv, d});
      whole(k + "attn.wv", h + "self_attn.v_proj.weight", {kv, d});
      if (m.qkv_bias) {
        whole(k + "attn.bq", h + "self_attn.q_proj.bias", {q});
        whole(k + "attn.bk", h + "self_attn.k_proj.bias", {kv});
        whole(k + "attn.bv", h + "self_attn.v_proj.bias", {kv});
      }
      if (m.qk_norm) {
        whole(k + "attn.q_norm.weight", h + "self_attn.q_norm.weight", {hd});
        whole(k + "attn.k_norm.weight", h + "self_attn.k_norm.weight", {hd});
      }
      whole(k + "attn.wo", h + "self_attn.o_proj.weight", {d, q});
      whole(k + "mlp_norm.weight", h + "post_attention_layernorm.weight", {d});
      whole(k + "mlp.w_gate", h + "mlp.gate_proj.weight", {f, d});
      whole(k + "mlp.w_up", h + "mlp.up_proj.weight", {f, d});
      whole(k + "mlp.w_down", h + "mlp.down_proj.weight", {d, f});
    }
    whole("final_norm.weight", "model.norm.weight", {d});
  } else {
    const bool bloom = arch == HfArch::Bloom;
    const std::string& t = tensor_prefix;
    auto norm = [&](const std::string& k, const std::string& h) {
      whole(k + ".weight", h + ".weight", {d});
      whole(k + ".bias", h + ".bias", {d});
    };
    if (bloom) {
      whole("tok_embed", t + "word_embeddings.weight", {V, d});
      norm("embed_norm", t + "word_embeddings_layernorm");
    } else {
      whole("tok_embed", t + "wte.weight", {V, d});
      whole("pos_embed", t + "wpe.weight", {m.max_seq_len, d});
    }
    for (int i = 0; i < m.n_layers; ++i) {
      const std::string k = "layers." + std::to_string(i) + ".", h = t + "h." + std::to_string(i) + ".";
      const char* proj[3] = {"q", "k", "v"};
      if (bloom) {
        norm(k + "attn_norm", h + "input_layernorm");
        // query_key_value rows are [head][q|k|v][hd]: projection j of head n is at (3n + j) hd.
        for (int j = 0; j < 3; ++j)
          out.push_back({k + "attn.w" + proj[j], h + "self_attention.query_key_value.weight", {3 * d, d}, false,
                         j * hd, hd, 3 * hd});
        for (int j = 0; j < 3; ++j)
          out.push_back({k + "attn.b" + proj[j], h + "self_attention.query_key_value.bias", {3 * d}, false, j * hd, hd,
                         3 * hd});
        whole(k + "attn.wo", h + "self_attention.dense.weight", {d, d});
        whole(k + "attn.bo", h + "self_attention.dense.bias", {d});
        norm(k + "mlp_norm", h + "post_attention_layernorm");
        whole(k + "mlp.w_fc", h + "mlp.dense_h_to_4h.weight", {f, d});
        whole(k + "mlp.b_fc", h + "mlp.dense_h_to_4h.bias", {f});
        whole(k + "mlp.w_proj", h + "mlp.dense_4h_to_h.weight", {d, f});
        whole(k + "mlp.b_proj", h + "mlp.dense_4h_to_h.bias", {d});
      } else {
        norm(k + "attn_norm", h + "ln_1");
        // c_attn is [d, 3d] = [in, out], out = q | k | v: keel's wq is its first d columns, transposed.
        for (int j = 0; j < 3; ++j)
          out.push_back({k + "attn.w" + proj[j], h + "attn.c_attn.weight", {d, 3 * d}, true, j * d});
        for (int j = 0; j < 3; ++j)
          out.push_back({k + "attn.b" + proj[j], h + "attn.c_attn.bias", {3 * d}, false, j * d});
        out.push_back({k + "attn.wo", h + "attn.c_proj.weight", {d, d}, true});
        whole(k + "attn.bo", h + "attn.c_proj.bias", {d});
        norm(k + "mlp_norm", h + "ln_2");
        out.push_back({k + "mlp.w_fc", h + "mlp.c_fc.weight", {d, f}, true});
        whole(k + "mlp.b_fc", h + "mlp.c_fc.bias", {f});
        out.push_back({k + "mlp.w_proj", h + "mlp.c_proj.weight", {f, d}, true});
        whole(k + "mlp.b_proj", h + "mlp.c_proj.bias", {d});
      }
    }
    norm("final_norm", t + "ln_f");
  }
  if (!m.tied_embeddings) whole("lm_head", "lm_head.weight", {V, d});
  return out;
}

// ======================================================================================
// Reading an HF directory
// ======================================================================================

HfCheckpoint HfCheckpoint::open(const std::string& dir_in) {
  HfCheckpoint hf;
  hf.dir_ = hf_path(dir_in).value_or(dir_in);
  const fs::path dir(hf.dir_);
  const std::string who = "hf:" + hf.dir_;
  if (!fs::is_directory(dir)) throw CheckpointError(who + ": no such directory");
  if (!fs::exists(dir / "config.json")) throw CheckpointError(who + ": no config.json (not a Hugging Face model directory)");
  hf.config_ = read_json_file(dir / "config.json", "HF config");
  hf.model_ = model_config_from_hf(hf.config_, (dir / "config.json").string());
  hf.arch_ = hf_arch_of_config(hf.config_, (dir / "config.json").string());
  if (hf.arch_ == HfArch::Bloom)
    hf.notes_.push_back("BLOOM's ALiBi has no position limit: model.max_seq_len " + std::to_string(hf.model_.max_seq_len) +
                        (hf.config_.contains("seq_length") ? " (config.json's seq_length)" : " (BLOOM's training length)"));

  // The files: one model.safetensors, or the shards an index names.
  std::map<std::string, std::string> index;  // HF tensor -> file, from the index
  std::vector<std::string> file_names;
  // transformers' precedence: model.safetensors first, the index only without it.
  if (fs::exists(dir / "model.safetensors")) {
    file_names.push_back("model.safetensors");
    if (fs::exists(dir / "model.safetensors.index.json"))
      hf.notes_.push_back("read model.safetensors and ignored model.safetensors.index.json beside it, as transformers "
                          "does (remove one of them if the shards are the model you mean)");
  } else if (fs::exists(dir / "model.safetensors.index.json")) {
    const json idx = read_json_file(dir / "model.safetensors.index.json", "HF index");
    if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw CheckpointError(who + "/model.safetensors.index.json has no weight_map");
    std::set<std::string> seen;
    for (const auto& [t, f] : idx["weight_map"].items()) {
      index[t] = f.get<std::string>();
      if (seen.insert(f.get<std::string>()).second) file_names.push_back(f.get<std::string>());
    }
  } else {
    throw CheckpointError(who + ": no model.safetensors or model.safetensors.index.json" +
                          (fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json")
                               ? std::string(" (PyTorch .bin checkpoints are not read: save the model with "
                                             "save_pretrained(..., safe_serialization=True) first)")
                               : std::string()));
  }
  std::sort(file_names.begin(), file_names.end());

  std::map<std::string, std::pair<size_t, const data::SafetensorsTensorInfo*>> found;  // HF name -> where
  for (const std::string& f : file_names) {
    const fs::path p = dir / f;
    if (!fs::exists(p)) throw CheckpointError(who + ": shard " + f + " named by model.safetensors.index.json is missing");
    try {
      hf.files_.push_back(std::make_unique<data::SafetensorsReader>(data::SafetensorsReader::open(p.string())));
    } catch (const data::DataError& e) {
      throw CheckpointError(who + ": " + e.what());
    }
    const size_t fi = hf.files_.size() - 1;
    for (const auto& t : hf.files_[fi]->tensors()) {
      if (found.count(t.name))
        throw CheckpointError(who + ": tensor " + t.name + " is in two files (" + file_names[found[t.name].first] +
                              " and " + f + ")");
      found[t.name] = {fi, &t};
      hf.total_bytes_ += t.num_bytes();
    }
  }
  for (const auto& [t, f] : index)
    if (found.count(t) && file_names[found[t].first] != f)
      throw CheckpointError(who + ": the index puts " + t + " in " + f + " but it is in " + file_names[found[t].first]);

  // Every tensor the model needs, with the shape the config implies; nothing unexpected.
  // GPT-2 and BLOOM files from save_pretrained prefix "transformer."; the hub's originals do not.
  std::string prefix = "transformer.";
  if ((hf.arch_ == HfArch::GPT2 || hf.arch_ == HfArch::Bloom) && !found.count("transformer.wte.weight") &&
      !found.count("transformer.word_embeddings.weight") && (found.count("wte.weight") || found.count("word_embeddings.weight")))
    prefix = "";
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::set<DType> dtypes;
  for (const HfTensorSlice& sl : hf_tensor_layout(hf.model_, prefix)) {
    const std::string& hf_name = sl.hf;
    const bool first = used.insert(hf_name).second;  // fused tensors serve several keel tensors: check once
    auto it = found.find(hf_name);
    if (it == found.end()) {
      if (first)
        problems.push_back("tensor " + hf_name + " " + shape_text(sl.hf_shape) + " is missing" +
                           (index.count(hf_name) ? " (the index names " + index[hf_name] + ", which lacks it)" : ""));
      continue;
    }
    const auto* info = it->second.second;
    const auto dt = dtype_of(info->dtype);
    if (!dt) {
      if (first)
        problems.push_back("tensor " + hf_name + " has dtype " + std::string(data::safetensors_dtype_name(info->dtype)) +
                           " (keel reads BF16, F16 and F32)");
      continue;
    }
    if (info->shape != sl.hf_shape) {
      if (first)
        problems.push_back("tensor " + hf_name + " (keel " + sl.keel + ") has shape " + shape_text(info->shape) +
                           ", the config implies " + shape_text(sl.hf_shape));
      continue;
    }
    dtypes.insert(*dt);
    hf.tensors_[sl.keel] = {it->second.first, info, sl};
  }
  int mask_buffers = 0;
  for (const auto& [name, where] : found) {
    if (used.count(name)) continue;
    if (name.find("rotary_emb.inv_freq") != std::string::npos) {
      hf.notes_.push_back("ignored " + name + " (a RoPE buffer, recomputed)");
      continue;
    }
    if (hf.arch_ == HfArch::GPT2 && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"))) {
      ++mask_buffers;  // older GPT-2 files store each layer's causal mask
      continue;
    }
    if (name == "lm_head.weight" && hf.model_.tied_embeddings) {
      hf.notes_.push_back("ignored lm_head.weight: tie_word_embeddings is true, the head is the token embedding");
      continue;
    }
    problems.push_back("unexpected tensor " + name + " " + shape_text(where.second->shape) + " (not part of a " +
                       hf_arch_name(hf.arch_) + " with this config)");
  }
  if (mask_buffers > 0)
    hf.notes_.push_back("ignored " + std::to_string(mask_buffers) +
                        " attn.bias / attn.masked_bias buffers (GPT-2's stored causal masks)");
  if (!problems.empty()) {
    std::string msg = who + " does not match its config.json (" + std::to_string(problems.size()) + " problems):";
    for (size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
    if (problems.size() > 20) msg += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
    throw CheckpointError(msg);
  }
  hf.common_dtype_ = dtypes.size() == 1 ? *dtypes.begin() : DType::F32;
  return hf;
}

const HfCheckpoint::Source& HfCheckpoint::source(const std::string& keel_name) const {
  auto it = tensors_.find(keel_name);
  if (it == tensors_.end()) throw CheckpointError("hf:" + dir_ + " has no tensor for keel's " + keel_name);
  return it->second;
}

DType HfCheckpoint::stored_dtype(const std::string& keel_name) const { return *dtype_of(source(keel_name).info->dtype); }
const std::string& HfCheckpoint::hf_name(const std::string& keel_name) const { return source(keel_name).slice.hf; }

void HfCheckpoint::read(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const {
  read_values(keel_name, region, out_type, out);
  // A nan or inf in released weights (a damaged download, a diverged upload) would train to
  // nan and save a non-finite checkpoint: refused here, by the HF tensor's name.
  int64_t n = 1;
  for (int64_t d : region.shape) n *= d;
  int64_t nan = 0, inf = 0;
  count_nonfinite_stored(static_cast<const std::byte*>(out), n, out_type, nan, inf);
  if (const int64_t bad = nan + inf; bad > 0)
    throw CheckpointError("hf:" + dir_ + ": tensor " + source(keel_name).slice.hf + " holds " + std::to_string(bad) +
                          (bad == 1 ? " value that is" : " values that are") +
                          " nan or inf: a damaged file or a model that had diverged. Nothing was loaded from it");
}

void HfCheckpoint::read_values(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const {
  const Source& s = source(keel_name);
  const HfTensorSlice& sl = s.slice;
  const DType st = *dtype_of(s.info->dtype);
  const char* src = reinterpret_cast<const char*>(files_[s.file]->bytes(*s.info).data());
  char* dst = static_cast<char*>(out);
  const size_t in_size = dtype_size(st), out_size = dtype_size(out_type);
  const auto& shape = s.info->shape;
  // Rows of the HF tensor as keel sees it (its transpose for GPT-2's Conv1D weights).
  const int64_t hf_rows = sl.transposed ? shape[1] : shape[0];
  if (region.shape.size() == 1) {
    for (int64_t i = 0; i < region.shape[0]; ++i) {
      const int64_t row = sl.hf_row(region.offset[0] + i);
      if (row >= hf_rows) throw CheckpointError("hf:" + dir_ + ": element past the end of " + sl.hf);
      convert_elements(src + row * in_size, st, dst + i * out_size, out_type, 1);
    }
    return;
  }
  const int64_t cols = sl.transposed ? shape[0] : shape[1];
  if (region.offset[1] + region.shape[1] > cols)
    throw CheckpointError("hf:" + dir_ + ": region past the last column of " + sl.hf);
  const int64_t R = region.shape[0], W = region.shape[1], c0 = region.offset[1];
  if (!sl.transposed) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = sl.hf_row(region.offset[0] + r);
      char* d = dst + static_cast<size_t>(r * W) * out_size;
      if (row >= hf_rows) {  // keel's vocabulary padding: rows the HF model does not have
        std::memset(d, 0, static_cast<size_t>(W) * out_size);
        continue;
      }
      convert_elements(src + static_cast<size_t>(row * cols + c0) * in_size, st, d, out_type, W);
    }
    return;
  }
  // Transposed: keel (r, c) is stored at (c, hf_row(r)). Tiles of keel rows keep the reads of
  // one stored row (consecutive hf_row) together.
  constexpr int64_t kTile = 64;
  for (int64_t r0 = 0; r0 < R; r0 += kTile) {
    const int64_t r1 = std::min(R, r0 + kTile);
    for (int64_t c = 0; c < W; ++c)
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = sl.hf_row(region.offset[0] + r);
        if (row >= hf_rows) throw CheckpointError("hf:" + dir_ + ": region past the end of " + sl.hf);
        convert_elements(src + static_cast<size_t>((c0 + c) * shape[1] + row) * in_size, st,
                         dst + static_cast<size_t>(r * W + c) * out_size, out_type, 1);
      }
  }
}

void HfCheckpoint::read_full(const std::string& keel_name, const std::vector<int64_t>& keel_shape, DType out_type,
                             void* out) const {
  TensorRegion r;
  r.shape = keel_shape;
  r.offset.assign(keel_shape.size(), 0);
  read(keel_name, r, out_type, out);
}

void HfCheckpoint::release(const std::string& keel_name) const {
  const Source& s = source(keel_name);
  const auto bytes = files_[s.file]->bytes(*s.info);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  // Read-only file pages: dropping them costs nothing but a re-read should a neighbour need them.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

// ======================================================================================
// Finetuning config
// ======================================================================================

json finetune_config_json(const HfCheckpoint& hf, const std::string& out_dir, const std::string& init_from) {
  const ModelConfig& m = hf.model();
  const json& c = hf.config_json();
  json model = {{"family", family_name(m.family)},
                {"vocab_size", m.vocab_size},
                {"d_model", m.d_model},
                {"n_layers", m.n_layers},
                {"n_heads", m.n_heads},
                {"ffn_hidden", m.ffn_hidden},
                {"max_seq_len", m.max_seq_len},
                {"tied_embeddings", m.tied_embeddings},
                {"pad_vocab_to_multiple_of", 1}};
  // The HF value of eps as written (a double), not keel's float of it.
  if (m.is_llama()) {
    model["n_kv_heads"] = m.n_kv_heads;
    model["norm_eps"] = num(c, "rms_norm_eps", 1e-6);
    model["rope_theta"] = static_cast<double>(m.rope_theta);
    if (m.rope_scaling.kind != RopeScaling::Kind::None) model["rope_scaling"] = rope_scaling_json(m.rope_scaling);
  } else {
    model["norm_eps"] = num(c, "layer_norm_epsilon", 1e-5);
  }
  add_model_options(model, m);
  const std::string name = fs::path(out_dir).filename().string().empty() ? "model" : fs::path(out_dir).filename().string();
  const int64_t seq = std::min<int64_t>(m.max_seq_len, 2048);
  return {
      {"description", "Finetune " + name + " (converted from hf:" + hf.dir() +
                          "). data.train / data.val read data/finetune: keel tokenize --jsonl FILE --tokenizer " +
                          out_dir + " --out data/finetune (--loss-mask prompt for prompt/response pairs, --chat for "
                          "conversations), then: keel train --config " +
                          (fs::path(out_dir) / "config.json").string() + " (train.init_from names the weights)"},
      {"model", model},
      {"precision", {{"mode", "bf16"}}},
      {"optimizer",
       {{"lr", 2e-5}, {"min_lr", 2e-6}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.0},
        {"grad_clip", 1.0}}},
      {"schedule", {{"warmup_steps", 10}, {"decay", "cosine"}}},
      {"train",
       {{"steps", 1000}, {"global_batch", 32}, {"micro_batch", 1}, {"seq_len", seq}, {"seed", 1234},
        {"eval_interval", 100}, {"eval_batches", 8}, {"eval_at_start", true},  // the loaded model's loss first
        {"init_from", init_from}}},  // never a random init by a forgotten --init-from
      {"data", {{"train", "data/finetune/train_*.bin"}, {"val", "data/finetune/val_*.bin"}}},
      {"log", {{"interval", 1}}},
      {"checkpoint", {{"interval", 200}, {"keep_last", 2}}},
      {"parallel", {{"tp", 1}, {"pp", 1}, {"dp", 1}}},
      {"device", "auto"},
      {"out", "out/" + name + "-finetune"}};
}

// ======================================================================================
// HF -> keel
// ======================================================================================

ConvertStats convert_hf_to_keel(const std::string& hf_dir, const std::string& out_dir, std::optional<DType> dtype,
                                bool force) {
  const auto t0 = std::chrono::steady_clock::now();
  const HfCheckpoint hf = HfCheckpoint::open(hf_dir);
  const fs::path out(out_dir);
  check_new_output(out, force, {hf.dir()});
  const json run_json = finetune_config_json(hf, out_dir, ".");  // the weights beside it
  const RunConfig cfg = parse_config(run_json, (out / "config.json").string());
  const DType wdt = dtype.value_or(hf.common_dtype());

  const fs::path tmp = temp_dir_for(out);
  ConvertStats st;
  int64_t underflow = 0;
  try {
    const json source = hf_source_json(hf);
    std::vector<float> wide;  // --dtype fp16: one tensor in fp32, to count what fp16 cannot hold
    auto fill = [&](const ParamSpec& p, DType dt, void* dst) {
      if (dt == DType::F16) {
        wide.resize(static_cast<size_t>(p.logical_numel()));
        hf.read_full(p.name, p.shape, DType::F32, wide.data());
        Fp16Range r;
        to_f16_counting(wide.data(), p.logical_numel(), static_cast<char*>(dst), r);
        check_fp16_range(r, hf.hf_name(p.name), "hf:" + hf.dir(), &underflow);
      } else {
        hf.read_full(p.name, p.shape, dt, dst);
      }
      hf.release(p.name);
      st.parameters += p.logical_numel();
      ++st.tensors;
    };
    const SaveResult saved = write_weights_checkpoint(tmp.string(), cfg, wdt, fill, source);
    write_json_file(tmp / "config.json", run_json);
    write_json_file(tmp / "hf_config.json", hf.config_json());
    st.copied = copy_side_files(hf.dir(), tmp);
    st.bytes = saved.bytes;
    publish(tmp, out, force);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  st.out = out_dir;
  st.dtype = wdt;
  st.notes = hf.notes();
  if (underflow > 0) st.notes.push_back(fp16_underflow_note(underflow));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// ======================================================================================
// --init-from hf:DIR
// ======================================================================================

json hf_source_json(const HfCheckpoint& hf) {
  return {{"kind", "huggingface"}, {"path", fs::absolute(hf.dir()).string()},
          {"hf_dtype", std::string(dtype_name(hf.common_dtype()))}, {"hf_config", hf.config_json()}};
}

json source_with_init_from(json source, const std::string& path) {
  if (!source.is_object()) source = json::object();
  json chain = json::array({fs::absolute(path).lexically_normal().string()});
  if (source.contains("init_from") && source["init_from"].is_array())
    for (const json& p : source["init_from"]) chain.push_back(p);
  source["init_from"] = chain;
  return source;
}

std::vector<fs::path> source_dirs(const json& source) {
  std::vector<fs::path> dirs;
  if (!source.is_object()) return dirs;
  if (source.contains("init_from") && source["init_from"].is_array())
    for (const json& p : source["init_from"])
      if (p.is_string()) dirs.emplace_back(p.get<std::string>());
  if (source.contains("path") && source["path"].is_string()) dirs.emplace_back(source["path"].get<std::string>());
  return dirs;
}

std::string init_weights_from_hf(const std::string& hf_dir, const ParamTable& table, ParamState& state, json* source) {
  const HfCheckpoint hf = HfCheckpoint::open(hf_dir);
  if (source) *source = hf_source_json(hf);
  const ModelConfig& want = hf.model();
  const ModelConfig& have = table.config();
  std::vector<std::string> diffs;
  auto cmp = [&](const char* field, double a, double b) {
    if (a != b) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "model.%s: the config has %.9g, hf:%s has %.9g", field, a, hf.dir().c_str(), b);
      diffs.push_back(buf);
    }
  };
  auto cmp_text = [&](const char* field, const std::string& a, const std::string& b) {
    if (a != b) diffs.push_back(std::string("model.") + field + ": the config has " + a + ", hf:" + hf.dir() + " (" +
                                hf_arch_name(hf.arch()) + ") has " + b);
  };
  cmp_text("family", family_name(have.family), family_name(want.family));
  cmp_text("position_embedding", have.position_embedding(), want.position_embedding());
  cmp_text("embedding_norm", have.embedding_norm ? "true" : "false", want.embedding_norm ? "true" : "false");
  cmp("vocab_size", static_cast<double>(have.vocab_size), static_cast<double>(want.vocab_size));
  cmp("d_model", have.d_model, want.d_model);
  cmp("n_layers", have.n_layers, want.n_layers);
  cmp("n_heads", have.n_heads, want.n_heads);
  cmp("n_kv_heads", have.n_kv_heads, want.n_kv_heads);
  cmp("ffn_hidden", have.ffn_hidden, want.ffn_hidden);
  cmp("tied_embeddings", have.tied_embeddings, want.tied_embeddings);
  cmp("norm_eps", have.norm_eps, want.norm_eps);
  if (want.learned_positions()) cmp("max_seq_len", have.max_seq_len, want.max_seq_len);  // the pos_embed rows
  if (want.rope().rotates()) {
    cmp("rope_theta", have.rope_theta, want.rope_theta);
    if (have.rope_scaling != want.rope_scaling)
      diffs.push_back("model.rope_scaling: the config has " + have.rope().str() + ", hf:" + hf.dir() + " has " +
                      want.rope().str());
  }
  if (!diffs.empty()) {
    std::string msg = "--init-from hf:" + hf.dir() + ": the run's model is not the HF model:";
    for (const auto& d : diffs) msg += "\n  " + d;
    msg += "\n(keel convert --print-config hf:" + hf.dir() + " prints a config with the right model section)";
    throw ConfigError(msg);
  }
  // Masters exact, working rounded, moments zero, step 0: ParamState::load_fp32 owns that rule.
  const int64_t n = table.local_numel();
  std::vector<float> values(static_cast<size_t>(n));
  for (const ParamSpec& p : table.params()) {
    for (const TensorRegion& r : flat_range_regions(p, 0, n))
      hf.read(p.name, r, DType::F32, values.data() + r.flat_begin);
    hf.release(p.name);
  }
  state.load_fp32(values.data());
  std::string line = "initialised from hf:" + hf.dir() + ": " + std::to_string(table.params().size()) + " tensors, " +
                     std::string(dtype_name(hf.common_dtype())) + " weights (" + std::to_string(hf.num_files()) +
                     " safetensors file(s)); fp32 masters = their exact values, working weights rounded to " +
                     std::string(dtype_name(state.working.dtype)) +
                     "; Adam moments zero, Adam step 0, iteration 0, fresh LR and batch schedules";
  for (const std::string& n : hf.notes()) line += "; NOTE " + n;
  // The window changes no tensor: a deliberate change loads, as from a keel checkpoint, with a note.
  auto window = [](int64_t w) { return w > 0 ? std::to_string(w) : std::string("none"); };
  if (have.sliding_window != want.sliding_window)
    line += "; NOTE: the HF model uses model.sliding_window " + window(want.sliding_window) + ", this run uses " +
            window(have.sliding_window);
  if (want.rope().rotates() && have.max_seq_len > want.max_seq_len)
    line += "; NOTE model.max_seq_len " + std::to_string(have.max_seq_len) + " is beyond the HF model's " +
            std::to_string(want.max_seq_len) + " positions";
  return line;
}

// ======================================================================================
// keel -> HF
// ======================================================================================

namespace {

// A float as the shortest decimal that reads back as it (1e-05, not the double of the float,
// 9.999999747378752e-06), as a double for config.json.
double shortest_decimal(float value) {
  char buf[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(value));
    if (std::strtof(buf, nullptr) == value) break;
  }
  return std::strtod(buf, nullptr);
}

// The template's value of a float field when it rounds to keel's (so it is kept as written).
json same_or(const json& tmpl, const char* key, float value) {
  if (tmpl.contains(key) && tmpl[key].is_number() && static_cast<float>(tmpl[key].get<double>()) == value) return tmpl[key];
  return shortest_decimal(value);
}

}  // namespace

json hf_config_json(const ModelConfig& m, HfArch arch, const json& tmpl, DType dtype) {
  json c = json::object();
  if (tmpl.is_object()) {
    bool same = false;
    try {
      same = hf_arch_of_config(tmpl, "template") == arch;
    } catch (const CheckpointError&) {
    }
    if (same) c = tmpl;
    else
      for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"})
        if (tmpl.contains(k)) c[k] = tmpl[k];
  }
  c["architectures"] = {hf_arch_name(arch)};
  c["vocab_size"] = m.vocab_size;
  c["tie_word_embeddings"] = m.tied_embeddings;
  c["torch_dtype"] = torch_dtype_name(dtype);
  if (c.contains("dtype")) c["dtype"] = torch_dtype_name(dtype);
  if (!c.contains("initializer_range")) c["initializer_range"] = shortest_decimal(m.init_std);
  c["use_cache"] = true;
  if (llama_like(arch)) {
    c["model_type"] = arch == HfArch::Qwen2     ? "qwen2"
                      : arch == HfArch::Qwen3   ? "qwen3"
                      : arch == HfArch::Mistral ? "mistral"
                                                : "llama";
    c["hidden_size"] = m.d_model;
    c["intermediate_size"] = m.ffn_hidden;
    c["num_hidden_layers"] = m.n_layers;
    c["num_attention_heads"] = m.n_heads;
    c["num_key_value_heads"] = m.n_kv_heads;
    c["max_position_embeddings"] = m.max_seq_len;
    c["rms_norm_eps"] = same_or(tmpl, "rms_norm_eps", m.norm_eps);
    const double theta = same_or(tmpl, "rope_theta", m.rope_theta).get<double>();
    // transformers 5 writes rope_parameters (theta inside); earlier versions rope_theta + rope_scaling.
    const json scaling = rope_scaling_json(m.rope_scaling, "rope_type");
    if (c.contains("rope_parameters")) {
      c["rope_parameters"] = scaling.is_null() ? json{{"rope_type", "default"}} : scaling;
      c["rope_parameters"]["rope_theta"] = theta;
    } else {
      c["rope_theta"] = theta;
      c["rope_scaling"] = scaling;
    }
    c["hidden_act"] = "silu";
    if (arch == HfArch::Llama || arch == HfArch::Qwen3) c["attention_bias"] = false;  // Qwen2: fixed; Mistral: none
    if (arch == HfArch::Llama) c["mlp_bias"] = false;
    const json window = m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr);
    if (arch == HfArch::Mistral) c["sliding_window"] = window;
    if (arch == HfArch::Qwen2 || arch == HfArch::Qwen3) {
      // keel's window is in every layer: layer_types says so, and max_window_layers agrees
      c["use_sliding_window"] = m.sliding_window > 0;
      if (m.sliding_window > 0) {
        c["sliding_window"] = window;
        c["max_window_layers"] = 0;
      }
      if (c.contains("layer_types") || m.sliding_window > 0)
        c["layer_types"] = std::vector<std::string>(static_cast<size_t>(m.n_layers),
                                                    m.sliding_window > 0 ? "sliding_attention" : "full_attention");
    }
    if (c.contains("head_dim") || arch == HfArch::Qwen3 || m.explicit_head_dim > 0) c["head_dim"] = m.head_dim();
  } else if (arch == HfArch::GPT2) {
    for (const char* k : {"hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"}) c.erase(k);
    c["model_type"] = "gpt2";
    c["n_embd"] = m.d_model;
    c["n_layer"] = m.n_layers;
    c["n_head"] = m.n_heads;
    c["n_inner"] = m.ffn_hidden == 4 * m.d_model ? json(nullptr) : json(m.ffn_hidden);
    c["n_positions"] = m.max_seq_len;
    if (c.contains("n_ctx")) c["n_ctx"] = m.max_seq_len;
    c["layer_norm_epsilon"] = same_or(tmpl, "layer_norm_epsilon", m.norm_eps);
    const std::string act = c.value("activation_function", std::string());
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") c["activation_function"] = "gelu_new";
    c["scale_attn_weights"] = true;
    c["scale_attn_by_inverse_layer_idx"] = false;
    c["add_cross_attention"] = false;
  } else {
    for (const char* k : {"n_embed", "num_hidden_layers", "num_attention_heads"}) c.erase(k);
    c["model_type"] = "bloom";
    c["hidden_size"] = m.d_model;
    c["n_layer"] = m.n_layers;
    c["n_head"] = m.n_heads;
    c["seq_length"] = m.max_seq_len;
    c["layer_norm_epsilon"] = same_or(tmpl, "layer_norm_epsilon", m.norm_eps);
    c["apply_residual_connection_post_layernorm"] = false;
  }
  return c;
}

ConvertStats export_keel_to_hf(const std::string& ckpt_path, const std::string& out_dir, const ExportOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  const Checkpoint ck = open_undamaged(ckpt_path, "export");
  const RunConfig cfg = parse_config(ck.meta().at("config"), ck.path() + "/meta.json");
  const ModelConfig& m = cfg.model;
  HfArch arch = hf_arch_for(m, "checkpoint " + ck.path());
  const ParamTable table(m);
  // The best copy of the weights: fp32 masters when every tensor has them.
  bool have_master = true;
  for (const ParamSpec& p : table.params()) have_master &= ck.has("master", p.name);
  const std::string state = have_master ? "master" : "weight";
  check_tensors_match(ck, state, table);

  // Where config.json fields and tokenizer files come from.
  fs::path like;
  json tmpl;
  auto try_like = [&](const fs::path& d) {
    if (!tmpl.is_null()) return;
    for (const char* f : {"hf_config.json", "config.json"}) {
      if (!fs::exists(d / f)) continue;
      json j = read_json_file(d / f, "config");
      if (j.contains("model_type") || j.contains("architectures")) {  // an HF config, not a keel run config
        tmpl = j;
        like = d;
        return;
      }
    }
  };
  if (!opts.like.empty()) {
    const fs::path d = hf_path(opts.like).value_or(opts.like);
    try_like(d);
    if (tmpl.is_null()) throw CheckpointError("--like " + opts.like + ": no HF config.json or hf_config.json there");
  }
  try_like(ck.path());
  // Else the recorded source: its HF config, and the tokenizer files of the first of the
  // checkpoints and HF model it came from that still has any.
  const json source = ck.meta().value("source", json());
  if (tmpl.is_null() && source.is_object() && source.contains("hf_config")) {
    tmpl = source["hf_config"];
    for (const fs::path& d : source_dirs(source))
      for (const std::string& f : hf_side_files())
        if (like.empty() && fs::exists(d / f)) like = d;
  }
  // Else (a run from scratch) the tokenizer its training data was made with, beside the data,
  // where keel sample finds it too.
  bool like_is_data = false;
  if (like.empty() && !fs::exists(fs::path(ck.path()) / "tokenizer.json"))
    for (const fs::path& d : data_tokenizer_dirs(cfg))
      if (like.empty() && fs::exists(d / "tokenizer.json")) {
        like = d;
        like_is_data = true;
      }

  // --dtype auto: the HF model's own dtype (fp16 into bf16 would lose mantissa bits), else bf16.
  std::optional<DType> source_dtype;
  if (source.is_object() && source.contains("hf_dtype") && source["hf_dtype"].is_string())
    for (DType d : {DType::F32, DType::BF16, DType::F16})
      if (source["hf_dtype"].get<std::string>() == dtype_name(d)) source_dtype = d;
  const DType dtype = opts.dtype.value_or(source_dtype.value_or(DType::BF16));

  // A Mistral without a window (v0.2 on) is a Llama to keel; it goes back as the Mistral it was.
  if (arch == HfArch::Llama && tmpl.is_object() && tmpl.value("model_type", "") == "mistral") arch = HfArch::Mistral;
  const json c = hf_config_json(m, arch, tmpl, dtype);

  // The HF tensors, each with the keel slices that make it, in the layout's order; the shards:
  // a new file whenever the next tensor would push the current one past max_shard_bytes.
  struct HfOut {
    std::string name;
    std::vector<int64_t> shape;  // tok_embed / lm_head without keel's vocabulary padding
    std::vector<HfTensorSlice> slices;
  };
  std::vector<HfOut> tensors;
  std::map<std::string, size_t> tensor_index;
  for (HfTensorSlice& sl : hf_tensor_layout(m)) {
    auto [it, added] = tensor_index.emplace(sl.hf, tensors.size());
    if (added) tensors.push_back({sl.hf, sl.hf_shape, {}});
    tensors[it->second].slices.push_back(std::move(sl));
  }
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
    for (int64_t d : tensors[i].shape) bytes *= d;
    if (in_shard > 0 && in_shard + bytes > opts.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }

  const fs::path out(out_dir);
  check_new_output(out, opts.force, {ckpt_path, opts.like, like.string()}, OutputKind::HfModel);  // the inputs
  // The HF folder the checkpoint came from is an input too, though not named on the command
  // line: --force would otherwise replace the original model with this export.
  if (source.is_object()) {
    const std::string hf_source = source.value("path", "");
    if (would_replace(out, hf_source))
      throw ConfigError("the output " + out.string() + " would replace the Hugging Face model " + hf_source + " that " +
                        ck.path() + " comes from (meta.json source.path): pick another folder");
  }
  const fs::path tmp = temp_dir_for(out);
  ConvertStats st;
  int64_t underflow = 0;
  try {
    json weight_map = json::object();
    std::vector<char> staging, part, narrow;
    // fp16 is read as fp32 and narrowed here, counting what does not fit (check_fp16_range).
    const DType read_dtype = dtype == DType::F16 ? DType::F32 : dtype;
    const size_t es = dtype_size(read_dtype);
    for (size_t s = 0; s < shards.size(); ++s) {
      char fname[64];
      if (shards.size() == 1) std::snprintf(fname, sizeof fname, "model.safetensors");
      else std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      std::vector<data::SafetensorsWriter::Entry> entries;
      for (size_t i : shards[s]) {
        entries.push_back({tensors[i].name, st_dtype(dtype), tensors[i].shape});
        weight_map[tensors[i].name] = fname;
      }
      // transformers insists on format "pt" in the metadata
      data::SafetensorsWriter w((tmp / fname).string(), entries, {{"format", "pt"}});
      for (size_t i : shards[s]) {
        const HfOut& t = tensors[i];
        int64_t n = 1;
        for (int64_t d : t.shape) n *= d;
        staging.resize(static_cast<size_t>(n) * es);
        for (const HfTensorSlice& sl : t.slices) {
          const ParamSpec& p = table.at(sl.keel);
          TensorRegion r;
          r.shape = p.shape;
          r.offset.assign(r.shape.size(), 0);
          if (t.slices.size() == 1 && sl.one_to_one()) {  // straight into place (minus keel's vocab padding)
            r.shape[0] = t.shape[0];
            ck.read(state, sl.keel, r, read_dtype, staging.data());
          } else {  // a block of a fused tensor, or a transpose: scatter element by element
            part.resize(static_cast<size_t>(r.numel()) * es);
            ck.read(state, sl.keel, r, read_dtype, part.data());
            const int64_t rows = r.shape[0], cols = r.shape.size() > 1 ? r.shape[1] : 1;
            const int64_t hf_cols = t.shape.size() > 1 ? t.shape[1] : 1;
            for (int64_t row = 0; row < rows; ++row)
              for (int64_t col = 0; col < cols; ++col) {
                const int64_t at = sl.transposed ? col * hf_cols + sl.hf_row(row) : sl.hf_row(row) * hf_cols + col;
                std::memcpy(staging.data() + at * es, part.data() + (row * cols + col) * es, es);
              }
          }
          ck.release(state, sl.keel);
        }
        if (dtype == DType::F16) {
          narrow.resize(static_cast<size_t>(n) * 2);
          Fp16Range range;
          to_f16_counting(reinterpret_cast<const float*>(staging.data()), n, narrow.data(), range);
          check_fp16_range(range, t.name, "checkpoint " + ck.path(), &underflow,
                           opts.dtype ? "--dtype fp16" : "--dtype auto (fp16, the dtype of the HF model it came from)");
          w.write(narrow.data(), narrow.size());
        } else {
          w.write(staging.data(), staging.size());
        }
        st.parameters += n;
        ++st.tensors;
      }
      w.finish(/*sync=*/true);
      st.bytes += w.file_bytes();
    }
    if (shards.size() > 1)
      write_json_file(tmp / "model.safetensors.index.json",
                      {{"metadata", {{"total_size", total}, {"total_parameters", st.parameters}}}, {"weight_map", weight_map}});
    write_json_file(tmp / "config.json", c);
    if (!like.empty()) st.copied = copy_side_files(like, tmp);
    if (like_is_data)
      st.notes.push_back("the tokenizer files come from " + like.string() +
                         ", beside the run's training data (data.train): the checkpoint records no Hugging Face source");
    for (const std::string& f : hf_side_files())  // the checkpoint's own copies win
      if (fs::exists(fs::path(ck.path()) / f)) {
        fs::copy_file(fs::path(ck.path()) / f, tmp / f, fs::copy_options::overwrite_existing);
        if (std::find(st.copied.begin(), st.copied.end(), f) == st.copied.end()) st.copied.push_back(f);
      }
    // Without a source to take them from, transformers gets a model it cannot tokenize for or
    // stop: say what is missing and where it would come from.
    std::vector<std::string> missing;
    for (const char* f : {"tokenizer.json", "generation_config.json"})
      if (!fs::exists(tmp / f)) missing.push_back(f);
    if (!c.contains("eos_token_id")) missing.push_back("bos/eos token ids in config.json");
    const bool incomplete = !fs::exists(tmp / "tokenizer.json") || !c.contains("eos_token_id");
    if (incomplete) {  // a source without generation_config.json alone is common and harmless
      std::string what;
      for (size_t i = 0; i < missing.size(); ++i)
        what += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
      st.notes.push_back("not written: " + what + " (" +
                         (opts.like.empty() ? "the checkpoint records no Hugging Face source to take them from"
                                            : "--like " + opts.like + " has none") +
                         "); pass --like DIR, the HF model this was trained from or its keel convert output");
    }
    publish(tmp, out, opts.force);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  st.out = out_dir;
  st.dtype = dtype;
  if (underflow > 0) st.notes.push_back(fp16_underflow_note(underflow));
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace keel
