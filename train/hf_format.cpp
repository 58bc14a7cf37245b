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
  std::ofstream out(p);
  out << j.dump(2) << '\n';
  if (!out) throw CheckpointError("cannot write " + p.string());
}

// Moves the finished temporary directory into place (replacing `out` when forced).
void publish(const fs::path& tmp, const fs::path& out, bool force) {
  if (fs::exists(out)) {
    if (!force) throw CheckpointError(out.string() + " already exists (pass --force to replace it)");
    fs::remove_all(out);
  }
  fs::rename(tmp, out);
}

fs::path temp_dir_for(const fs::path& out) {
  fs::path tmp = out;
  tmp += ".tmp-keel-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  return tmp;
}

void check_new_output(const fs::path& out, bool force) {
  if (fs::exists(out) && !force)
    throw CheckpointError(out.string() + " already exists (pass --force to replace it)");
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

}  // namespace

const std::vector<std::string>& hf_side_files() {
  static const std::vector<std::string> files = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                                 "tokenizer.model", "generation_config.json"};
  return files;
}

std::optional<std::string> hf_path(const std::string& spec) {
  if (spec.rfind("hf:", 0) != 0) return std::nullopt;
  return spec.substr(3);
}

// ======================================================================================
// config.json
// ======================================================================================

ModelConfig model_config_from_hf(const json& c, const std::string& source) {
  std::vector<std::string> problems;
  const std::string arch = c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty()
                               ? c["architectures"][0].get<std::string>()
                               : "";
  const std::string type = c.value("model_type", "");
  const bool llama = arch == "LlamaForCausalLM" || (arch.empty() && type == "llama");
  const bool mistral = arch == "MistralForCausalLM" || (arch.empty() && type == "mistral");
  if (!llama && !mistral)
    throw CheckpointError(source + ": architecture \"" + (arch.empty() ? "?" : arch) + "\" (model_type \"" + type +
                          "\") is not supported; keel converts LlamaForCausalLM (model_type \"llama\") and "
                          "Mistral-style configs without sliding windows");
  for (const char* key : {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"})
    if (!c.contains(key) || !c[key].is_number_integer()) problems.push_back(std::string(key) + " is missing");
  if (!problems.empty()) {
    std::string msg = source + " is not a usable Llama config:";
    for (const auto& p : problems) msg += "\n  " + p;
    throw CheckpointError(msg);
  }

  ModelConfig m;
  m.family = Family::Llama;
  m.vocab_size = c["vocab_size"].get<int64_t>();
  m.pad_vocab_multiple = 1;
  m.d_model = c["hidden_size"].get<int>();
  m.n_layers = c["num_hidden_layers"].get<int>();
  m.n_heads = c["num_attention_heads"].get<int>();
  m.n_kv_heads = c.contains("num_key_value_heads") && c["num_key_value_heads"].is_number_integer()
                     ? c["num_key_value_heads"].get<int>()
                     : m.n_heads;
  m.ffn_hidden = c["intermediate_size"].get<int>();
  m.norm_eps = static_cast<float>(num(c, "rms_norm_eps", 1e-6));
  m.max_seq_len = static_cast<int>(num(c, "max_position_embeddings", 2048));
  m.tied_embeddings = c.value("tie_word_embeddings", false);
  m.init_std = static_cast<float>(num(c, "initializer_range", 0.02));

  // RoPE: transformers < 5 writes rope_theta (+ rope_scaling); 5.x writes rope_parameters.
  // Scaling: "default" (none) and Llama 3.1's "llama3"; any other is refused, never ignored.
  double theta = num(c, "rope_theta", 10000.0);
  auto read_scaling = [&](const json& r, const std::string& where) {
    const std::string rt = r.is_object() ? r.value("rope_type", r.value("type", std::string("?"))) : "?";
    if (rt == "default") return;
    if (rt != "llama3") {
      problems.push_back(where + " type \"" + rt + "\" (RoPE scaling) is not supported; keel supports \"default\" and "
                         "\"llama3\" (Llama 3.1 / 3.2)");
      return;
    }
    RopeScaling& s = m.rope_scaling;
    s.kind = RopeScaling::Kind::Llama3;
    for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (!r.contains(key) || !r[key].is_number()) problems.push_back(where + " (llama3) lacks the number \"" + key + "\"");
    s.factor = num(r, "factor", s.factor);
    s.low_freq_factor = num(r, "low_freq_factor", s.low_freq_factor);
    s.high_freq_factor = num(r, "high_freq_factor", s.high_freq_factor);
    s.original_max_position = static_cast<int64_t>(num(r, "original_max_position_embeddings",
                                                       static_cast<double>(s.original_max_position)));
  };
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const json& rp = c["rope_parameters"];
    theta = num(rp, "rope_theta", theta);
    read_scaling(rp, "rope_parameters");
  } else if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) {
    read_scaling(c["rope_scaling"], "rope_scaling");
  }
  m.rope_theta = static_cast<float>(theta);

  if (c.value("attention_bias", false)) problems.push_back("attention_bias = true (biases on q/k/v/o) is not supported");
  if (c.value("mlp_bias", false)) problems.push_back("mlp_bias = true is not supported");
  if (c.contains("sliding_window") && !c["sliding_window"].is_null() && c.value("use_sliding_window", true))
    problems.push_back("sliding_window attention (" + c["sliding_window"].dump() + ") is not supported");
  const std::string act = c.value("hidden_act", std::string("silu"));
  if (act != "silu") problems.push_back("hidden_act \"" + act + "\" is not supported (keel's SwiGLU uses silu)");
  if (c.contains("quantization_config")) problems.push_back("quantized checkpoints (quantization_config) are not supported");
  if (m.n_heads <= 0 || m.d_model % m.n_heads != 0) {
    problems.push_back("hidden_size " + std::to_string(m.d_model) + " is not a multiple of num_attention_heads " +
                       std::to_string(m.n_heads));
  } else if (c.contains("head_dim") && c["head_dim"].is_number_integer() &&
             c["head_dim"].get<int>() != m.d_model / m.n_heads) {
    problems.push_back("head_dim " + c["head_dim"].dump() + " differs from hidden_size / num_attention_heads = " +
                       std::to_string(m.d_model / m.n_heads) + " (keel derives the head size)");
  }
  if (m.n_kv_heads <= 0 || m.n_heads % m.n_kv_heads != 0)
    problems.push_back("num_key_value_heads " + std::to_string(m.n_kv_heads) + " does not divide num_attention_heads " +
                       std::to_string(m.n_heads));
  if (!problems.empty()) {
    std::string msg = source + " (" + (arch.empty() ? type : arch) + ") uses features keel cannot represent:";
    for (const auto& p : problems) msg += "\n  " + p;
    throw CheckpointError(msg);
  }
  return m;
}

std::vector<std::pair<std::string, std::string>> hf_tensor_names(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::string>> out = {{"tok_embed", "model.embed_tokens.weight"}};
  for (int i = 0; i < m.n_layers; ++i) {
    const std::string k = "layers." + std::to_string(i) + ".", h = "model.layers." + std::to_string(i) + ".";
    out.insert(out.end(), {{k + "attn_norm.weight", h + "input_layernorm.weight"},
                           {k + "attn.wq", h + "self_attn.q_proj.weight"},
                           {k + "attn.wk", h + "self_attn.k_proj.weight"},
                           {k + "attn.wv", h + "self_attn.v_proj.weight"},
                           {k + "attn.wo", h + "self_attn.o_proj.weight"},
                           {k + "mlp_norm.weight", h + "post_attention_layernorm.weight"},
                           {k + "mlp.w_gate", h + "mlp.gate_proj.weight"},
                           {k + "mlp.w_up", h + "mlp.up_proj.weight"},
                           {k + "mlp.w_down", h + "mlp.down_proj.weight"}});
  }
  out.emplace_back("final_norm.weight", "model.norm.weight");
  if (!m.tied_embeddings) out.emplace_back("lm_head", "lm_head.weight");
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

  // The files: one model.safetensors, or the shards an index names.
  std::map<std::string, std::string> index;  // HF tensor -> file, from the index
  std::vector<std::string> file_names;
  if (fs::exists(dir / "model.safetensors.index.json")) {
    const json idx = read_json_file(dir / "model.safetensors.index.json", "HF index");
    if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw CheckpointError(who + "/model.safetensors.index.json has no weight_map");
    std::set<std::string> seen;
    for (const auto& [t, f] : idx["weight_map"].items()) {
      index[t] = f.get<std::string>();
      if (seen.insert(f.get<std::string>()).second) file_names.push_back(f.get<std::string>());
    }
  } else if (fs::exists(dir / "model.safetensors")) {
    file_names.push_back("model.safetensors");
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
  const ParamTable table(hf.model_);
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::set<DType> dtypes;
  for (const auto& [keel_name, hf_name] : hf_tensor_names(hf.model_)) {
    auto it = found.find(hf_name);
    const ParamSpec& p = table.at(keel_name);
    if (it == found.end()) {
      problems.push_back("tensor " + hf_name + " " + shape_text(p.shape) + " is missing" +
                         (index.count(hf_name) ? " (the index names " + index[hf_name] + ", which lacks it)" : ""));
      continue;
    }
    used.insert(hf_name);
    const auto* info = it->second.second;
    const auto dt = dtype_of(info->dtype);
    if (!dt) {
      problems.push_back("tensor " + hf_name + " has dtype " + std::string(data::safetensors_dtype_name(info->dtype)) +
                         " (keel reads BF16, F16 and F32)");
      continue;
    }
    if (info->shape != p.shape) {
      problems.push_back("tensor " + hf_name + " (keel " + keel_name + ") has shape " + shape_text(info->shape) +
                         ", the config implies " + shape_text(p.shape));
      continue;
    }
    dtypes.insert(*dt);
    hf.tensors_[keel_name] = {it->second.first, info, hf_name};
  }
  for (const auto& [name, where] : found) {
    if (used.count(name)) continue;
    if (name.find("rotary_emb.inv_freq") != std::string::npos) {
      hf.notes_.push_back("ignored " + name + " (a RoPE buffer, recomputed)");
      continue;
    }
    if (name == "lm_head.weight" && hf.model_.tied_embeddings) {
      hf.notes_.push_back("ignored lm_head.weight: tie_word_embeddings is true, the head is model.embed_tokens.weight");
      continue;
    }
    problems.push_back("unexpected tensor " + name + " " + shape_text(where.second->shape) +
                       " (not part of a Llama model with this config)");
  }
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
const std::string& HfCheckpoint::hf_name(const std::string& keel_name) const { return source(keel_name).hf_name; }

void HfCheckpoint::read(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const {
  const Source& s = source(keel_name);
  const DType st = *dtype_of(s.info->dtype);
  const char* src = reinterpret_cast<const char*>(files_[s.file]->bytes(*s.info).data());
  const auto& shape = s.info->shape;
  char* dst = static_cast<char*>(out);
  const size_t in_size = dtype_size(st), out_size = dtype_size(out_type);
  if (region.shape.size() == 1) {
    if (region.offset[0] + region.shape[0] > shape[0])
      throw CheckpointError("hf:" + dir_ + ": region past the end of " + s.hf_name);
    convert_elements(src + region.offset[0] * in_size, st, dst, out_type, region.shape[0]);
    return;
  }
  const int64_t R = shape[0], C = shape[1];
  if (region.offset[1] + region.shape[1] > C)
    throw CheckpointError("hf:" + dir_ + ": region past the last column of " + s.hf_name);
  for (int64_t r = 0; r < region.shape[0]; ++r) {
    const int64_t row = region.offset[0] + r;
    char* d = dst + static_cast<size_t>(r * region.shape[1]) * out_size;
    if (row >= R) {  // keel's vocabulary padding: rows the HF model does not have
      std::memset(d, 0, static_cast<size_t>(region.shape[1]) * out_size);
      continue;
    }
    convert_elements(src + static_cast<size_t>(row * C + region.offset[1]) * in_size, st, d, out_type, region.shape[1]);
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

json finetune_config_json(const HfCheckpoint& hf, const std::string& out_dir) {
  const ModelConfig& m = hf.model();
  const json& c = hf.config_json();
  json model = {{"family", "llama"},
                {"vocab_size", m.vocab_size},
                {"d_model", m.d_model},
                {"n_layers", m.n_layers},
                {"n_heads", m.n_heads},
                {"n_kv_heads", m.n_kv_heads},
                {"ffn_hidden", m.ffn_hidden},
                {"norm_eps", num(c, "rms_norm_eps", 1e-6)},
                {"rope_theta", static_cast<double>(m.rope_theta)},
                {"max_seq_len", m.max_seq_len},
                {"tied_embeddings", m.tied_embeddings},
                {"pad_vocab_to_multiple_of", 1}};
  if (m.rope_scaling.kind != RopeScaling::Kind::None) model["rope_scaling"] = rope_scaling_json(m.rope_scaling);
  const std::string name = fs::path(out_dir).filename().string().empty() ? "model" : fs::path(out_dir).filename().string();
  const int64_t seq = std::min<int64_t>(m.max_seq_len, 2048);
  return {
      {"description", "Finetune " + name + " (converted from hf:" + hf.dir() +
                          "). Point data.train / data.val at shards made with scripts/prepare_data.py --tokenizer " +
                          (fs::path(out_dir) / "tokenizer.json").string() + ", then: keel train --config " +
                          (fs::path(out_dir) / "config.json").string() + " --init-from " + out_dir},
      {"model", model},
      {"precision", {{"mode", "bf16"}}},
      {"optimizer",
       {{"lr", 2e-5}, {"min_lr", 2e-6}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.0},
        {"grad_clip", 1.0}}},
      {"schedule", {{"warmup_steps", 10}, {"decay", "cosine"}}},
      {"train",
       {{"steps", 1000}, {"global_batch", 32}, {"micro_batch", 1}, {"seq_len", seq}, {"seed", 1234},
        {"eval_interval", 100}, {"eval_batches", 8}}},
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
  check_new_output(out, force);
  const json run_json = finetune_config_json(hf, out_dir);
  const RunConfig cfg = parse_config(run_json, (out / "config.json").string());
  const DType wdt = dtype.value_or(hf.common_dtype());

  const fs::path tmp = temp_dir_for(out);
  ConvertStats st;
  try {
    const json source = {{"kind", "huggingface"}, {"path", fs::absolute(hf.dir()).string()},
                         {"hf_dtype", std::string(dtype_name(hf.common_dtype()))}, {"hf_config", hf.config_json()}};
    auto fill = [&](const ParamSpec& p, DType dt, void* dst) {
      hf.read_full(p.name, p.shape, dt, dst);
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
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// ======================================================================================
// --init-from hf:DIR
// ======================================================================================

std::string init_weights_from_hf(const std::string& hf_dir, const ParamTable& table, ParamState& state) {
  const HfCheckpoint hf = HfCheckpoint::open(hf_dir);
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
  if (!have.is_llama()) diffs.push_back("model.family: the config has gpt2, an HF Llama needs llama");
  if (have.alibi) diffs.push_back("model.position_embedding: the config has alibi, an HF Llama uses rope");
  if (have.embedding_norm) diffs.push_back("model.embedding_norm: the config has true, an HF Llama has no embedding norm");
  cmp("vocab_size", static_cast<double>(have.vocab_size), static_cast<double>(want.vocab_size));
  cmp("d_model", have.d_model, want.d_model);
  cmp("n_layers", have.n_layers, want.n_layers);
  cmp("n_heads", have.n_heads, want.n_heads);
  cmp("n_kv_heads", have.n_kv_heads, want.n_kv_heads);
  cmp("ffn_hidden", have.ffn_hidden, want.ffn_hidden);
  cmp("tied_embeddings", have.tied_embeddings, want.tied_embeddings);
  cmp("norm_eps", have.norm_eps, want.norm_eps);
  cmp("rope_theta", have.rope_theta, want.rope_theta);
  if (have.rope_scaling != want.rope_scaling)
    diffs.push_back("model.rope_scaling: the config has " + have.rope().str() + ", hf:" + hf.dir() + " has " +
                    want.rope().str());
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
  if (have.max_seq_len > want.max_seq_len)
    line += "; NOTE model.max_seq_len " + std::to_string(have.max_seq_len) + " is beyond the HF model's " +
            std::to_string(want.max_seq_len) + " positions";
  return line;
}

// ======================================================================================
// keel -> HF
// ======================================================================================

ConvertStats export_keel_to_hf(const std::string& ckpt_path, const std::string& out_dir, const ExportOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    // Checksums first, with a reader of its own: verifying touches every page, and dropping
    // this reader afterwards lets them go before the export streams the tensors.
    const Checkpoint check = Checkpoint::open(ckpt_path);
    if (auto problems = check.verify(); !problems.empty()) {
      std::string msg = "refusing to export a damaged checkpoint " + check.path() + ":";
      for (const auto& p : problems) msg += "\n  " + p;
      throw CheckpointError(msg);
    }
  }
  const Checkpoint ck = Checkpoint::open(ckpt_path);
  const RunConfig cfg = parse_config(ck.meta().at("config"), ck.path() + "/meta.json");
  const ModelConfig& m = cfg.model;
  if (!m.is_llama())
    throw CheckpointError("checkpoint " + ck.path() + " holds a gpt2 model; export to Hugging Face supports Llama models");
  if (m.alibi || m.embedding_norm)
    throw CheckpointError("checkpoint " + ck.path() + " holds a Llama with " +
                          (m.alibi ? "ALiBi (model.position_embedding \"alibi\")" : "an embedding norm") +
                          "; Hugging Face's Llama has neither, so it cannot be exported as one");
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
  if (tmpl.is_null() && ck.meta().contains("source") && ck.meta()["source"].contains("hf_config")) {
    tmpl = ck.meta()["source"]["hf_config"];
    const std::string src = ck.meta()["source"].value("path", "");
    if (!src.empty() && fs::is_directory(src)) like = src;
  }

  json c = tmpl.is_object() ? tmpl : json::object();
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["hidden_size"] = m.d_model;
  c["intermediate_size"] = m.ffn_hidden;
  c["num_hidden_layers"] = m.n_layers;
  c["num_attention_heads"] = m.n_heads;
  c["num_key_value_heads"] = m.n_kv_heads;
  c["vocab_size"] = m.vocab_size;
  c["max_position_embeddings"] = m.max_seq_len;
  c["rms_norm_eps"] = tmpl.contains("rms_norm_eps") && static_cast<float>(tmpl["rms_norm_eps"].get<double>()) == m.norm_eps
                          ? tmpl["rms_norm_eps"]
                          : json(static_cast<double>(m.norm_eps));
  const double theta = tmpl.contains("rope_theta") && static_cast<float>(tmpl["rope_theta"].get<double>()) == m.rope_theta
                           ? tmpl["rope_theta"].get<double>()
                           : static_cast<double>(m.rope_theta);
  c["rope_theta"] = theta;
  const json scaling = rope_scaling_json(m.rope_scaling, "rope_type");
  if (c.contains("rope_parameters")) {
    c["rope_parameters"] = scaling.is_null() ? json{{"rope_type", "default"}} : scaling;
    c["rope_parameters"]["rope_theta"] = theta;
  } else {
    c["rope_scaling"] = scaling;
  }
  c["tie_word_embeddings"] = m.tied_embeddings;
  c["hidden_act"] = "silu";
  c["attention_bias"] = false;
  c["mlp_bias"] = false;
  if (c.contains("head_dim")) c["head_dim"] = m.head_dim();
  c["torch_dtype"] = torch_dtype_name(opts.dtype);
  if (c.contains("dtype")) c["dtype"] = torch_dtype_name(opts.dtype);
  if (!c.contains("initializer_range")) c["initializer_range"] = m.init_std;
  c["use_cache"] = true;

  // Plan the shards: tensors in keel's table order, a new file whenever the next tensor would
  // push the current one past max_shard_bytes.
  const auto names = hf_tensor_names(m);
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0, total = 0;
  std::vector<std::vector<int64_t>> hf_shapes;
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int64_t> shape = table.at(names[i].first).shape;
    if (names[i].first == "tok_embed" || names[i].first == "lm_head") shape[0] = m.vocab_size;  // drop vocab padding
    int64_t bytes = static_cast<int64_t>(dtype_size(opts.dtype));
    for (int64_t d : shape) bytes *= d;
    hf_shapes.push_back(shape);
    if (in_shard > 0 && in_shard + bytes > opts.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }

  const fs::path out(out_dir);
  check_new_output(out, opts.force);
  const fs::path tmp = temp_dir_for(out);
  ConvertStats st;
  try {
    json weight_map = json::object();
    std::vector<char> staging;
    for (size_t s = 0; s < shards.size(); ++s) {
      char fname[64];
      if (shards.size() == 1) std::snprintf(fname, sizeof fname, "model.safetensors");
      else std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      std::vector<data::SafetensorsWriter::Entry> entries;
      for (size_t i : shards[s]) {
        entries.push_back({names[i].second, st_dtype(opts.dtype), hf_shapes[i]});
        weight_map[names[i].second] = fname;
      }
      // transformers insists on format "pt" in the metadata
      data::SafetensorsWriter w((tmp / fname).string(), entries, {{"format", "pt"}});
      for (size_t i : shards[s]) {
        TensorRegion r;
        r.shape = hf_shapes[i];
        r.offset.assign(r.shape.size(), 0);
        staging.resize(static_cast<size_t>(r.numel()) * dtype_size(opts.dtype));
        ck.read(state, names[i].first, r, opts.dtype, staging.data());
        ck.release(state, names[i].first);
        w.write(staging.data(), staging.size());
        st.parameters += r.numel();
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
    for (const std::string& f : hf_side_files())  // the checkpoint's own copies win
      if (fs::exists(fs::path(ck.path()) / f)) {
        fs::copy_file(fs::path(ck.path()) / f, tmp / f, fs::copy_options::overwrite_existing);
        if (std::find(st.copied.begin(), st.copied.end(), f) == st.copied.end()) st.copied.push_back(f);
      }
    publish(tmp, out, opts.force);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  st.out = out_dir;
  st.dtype = opts.dtype;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace keel
