// Hugging Face Llama checkpoints in and out of keel: `keel convert hf:DIR OUT` (import),
// `keel convert CKPT hf:OUT` (export), `keel train --init-from hf:DIR`, `keel sample hf:DIR`.
//
// An HF checkpoint directory holds config.json (LlamaForCausalLM, or a Mistral-style config
// without sliding windows), model.safetensors or model-0000X-of-0000N.safetensors with
// model.safetensors.index.json (bf16, fp16 or fp32), and usually tokenizer.json.
//
// Tensor names (HF -> keel; Linear weights are [out, in] on both sides):
//   model.embed_tokens.weight                       tok_embed
//   model.layers.{i}.input_layernorm.weight         layers.{i}.attn_norm.weight
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.attn.{wq,wk,wv,wo}
//   model.layers.{i}.post_attention_layernorm.weight layers.{i}.mlp_norm.weight
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight layers.{i}.mlp.{w_gate,w_up,w_down}
//   model.norm.weight                               final_norm.weight
//   lm_head.weight                                  lm_head (absent when tie_word_embeddings)
// q_proj and k_proj are copied unpermuted: keel's RoPE pairs element i with i + head_dim/2 of
// each head (HF's rotate_half), the layout HF Llama checkpoints use (test_hf_convert.cpp checks
// converted models' logits and greedy tokens against transformers).
//
// Everything is streamed: the shards are memory-mapped and each tensor's pages are dropped from
// memory once it is written, so converting a 7B model needs a few hundred MB, not 13 GB.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/safetensors.h"
#include "model/model_config.h"
#include "model/param_table.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace keel {

// "hf:/models/x" -> "/models/x"; nullopt when spec does not start with "hf:".
std::optional<std::string> hf_path(const std::string& spec);

// The keel model an HF config.json describes. Throws CheckpointError naming the file and what
// keel cannot represent: another architecture, rope_scaling, attention/MLP biases, sliding
// windows, a head_dim other than hidden_size / num_attention_heads, an activation other than silu.
ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& source);

// keel name <-> HF name for every tensor of a Llama model (keel's table order).
std::vector<std::pair<std::string, std::string>> hf_tensor_names(const ModelConfig& m);

// An opened HF checkpoint directory: config parsed, every shard mapped, every tensor checked
// against the model the config describes (names, shapes, dtypes) before anything is read.
class HfCheckpoint {
 public:
  // `dir` with or without the "hf:" prefix. Throws CheckpointError listing every problem.
  static HfCheckpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config_json() const { return config_; }
  const ModelConfig& model() const { return model_; }
  // The dtype of the weights when all agree, else f32 (what a lossless copy needs).
  DType common_dtype() const { return common_dtype_; }
  DType stored_dtype(const std::string& keel_name) const;
  const std::string& hf_name(const std::string& keel_name) const;
  int64_t total_bytes() const { return total_bytes_; }
  size_t num_files() const { return files_.size(); }
  const std::vector<std::string>& notes() const { return notes_; }  // ignored extras, for the log

  // Reads a rectangle of keel tensor `keel_name` (full-tensor coordinates; rows past the HF
  // vocabulary, i.e. keel's vocab padding, read as zeros) converted to out_type: bit for bit
  // when out_type is the stored dtype, else round to nearest even.
  void read(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const;
  void read_full(const std::string& keel_name, const std::vector<int64_t>& keel_shape, DType out_type, void* out) const;
  // Done with a tensor: its pages leave this process's memory (they stay in the page cache).
  void release(const std::string& keel_name) const;

 private:
  struct Source {
    size_t file;
    const data::SafetensorsTensorInfo* info;
    std::string hf_name;
  };
  const Source& source(const std::string& keel_name) const;
  std::string dir_;
  nlohmann::json config_;
  ModelConfig model_;
  DType common_dtype_ = DType::F32;
  int64_t total_bytes_ = 0;
  std::vector<std::unique_ptr<data::SafetensorsReader>> files_;
  std::map<std::string, Source> tensors_;  // by keel name
  std::vector<std::string> notes_;
};

// The run config for finetuning an HF model (model section from its config.json, finetuning
// defaults elsewhere), as `keel convert` writes it to OUT/config.json and --print-config shows it.
nlohmann::json finetune_config_json(const HfCheckpoint& hf, const std::string& out_dir);

struct ConvertStats {
  std::string out;
  int64_t tensors = 0, parameters = 0, bytes = 0;
  DType dtype = DType::BF16;
  double seconds = 0;
  std::vector<std::string> copied;  // tokenizer and config files copied along
  std::vector<std::string> notes;   // what was ignored on the way (HfCheckpoint::notes)
};

// HF -> keel: a weights-only keel checkpoint in out_dir (meta.json + model-tp00-pp00.safetensors),
// plus config.json (finetune_config_json), hf_config.json (the HF config, for export), and the
// tokenizer files. Written to a temporary directory and renamed into place when complete;
// out_dir must not exist unless `force`. dtype: nullopt keeps the HF dtype (bit for bit).
ConvertStats convert_hf_to_keel(const std::string& hf_dir, const std::string& out_dir, std::optional<DType> dtype,
                                bool force);

struct ExportOptions {
  DType dtype = DType::BF16;
  int64_t max_shard_bytes = int64_t{5} << 30;  // more bytes than this: model-0000X-of-0000N + index
  // Where to take config.json fields (bos/eos ids, ...) and tokenizer files from: an HF dir or a
  // keel convert output. Empty: the checkpoint directory itself, then the checkpoint's recorded
  // source; without either, a config.json is made from the model alone.
  std::string like;
  bool force = false;
};

// keel -> HF: config.json and safetensors (sharded with model.safetensors.index.json when
// larger than max_shard_bytes) that transformers loads unchanged, plus the tokenizer files.
// Weights come from the fp32 masters when the checkpoint has them, else the stored weights.
ConvertStats export_keel_to_hf(const std::string& ckpt_path, const std::string& out_dir, const ExportOptions& opts);

// --init-from hf:DIR: fp32 masters from the HF weights (exact), working weights rounded to
// the working dtype, Adam moments zero, step 0 (ParamState::load_fp32). The run's model must be
// the HF model: a differing field is an error naming it and both values. Returns the log line.
std::string init_weights_from_hf(const std::string& hf_dir, const ParamTable& table, ParamState& state);

// Files copied along with a model: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// tokenizer.model, generation_config.json.
const std::vector<std::string>& hf_side_files();

}  // namespace keel
