// Hugging Face checkpoints in and out of keel: `keel convert hf:DIR OUT` (import),
// `keel convert CKPT hf:OUT` (export), `keel train --init-from hf:DIR`, `keel sample hf:DIR`.
//
// An HF checkpoint directory holds config.json, model.safetensors or
// model-0000X-of-0000N.safetensors with model.safetensors.index.json (bf16, fp16 or fp32), and
// usually tokenizer.json. These architectures map onto keel's model:
//   LlamaForCausalLM                                 -> family llama
//   MistralForCausalLM                               -> llama, with sliding_window when it has one
//   Qwen2ForCausalLM (Qwen2, Qwen2.5)                -> llama with qkv_bias
//   Qwen3ForCausalLM (dense Qwen3)                   -> llama with qk_norm, head_dim
//   (the Qwens' sliding windows when every layer has one: use_sliding_window and layer_types)
//   GPT2LMHeadModel                                  -> family gpt2
//   BloomForCausalLM                                 -> gpt2 with position_embedding "alibi", embedding_norm
// A keel llama exports as Qwen2 with qkv_bias, Qwen3 with qk_norm, else Mistral with a sliding
// window, else Llama.
//
// Tensor names (HF -> keel; keel's Linear weights are [out, in]):
//   Llama  model.embed_tokens.weight                  tok_embed
//          model.layers.{i}.input_layernorm.weight    layers.{i}.attn_norm.weight
//          model.layers.{i}.self_attn.{q,k,v,o}_proj  layers.{i}.attn.{wq,wk,wv,wo}
//          model.layers.{i}.self_attn.{q,k,v}_proj.bias  layers.{i}.attn.{bq,bk,bv} (Qwen2)
//          model.layers.{i}.self_attn.{q,k}_norm        layers.{i}.attn.{q,k}_norm.weight (Qwen3)
//          model.layers.{i}.post_attention_layernorm  layers.{i}.mlp_norm.weight
//          model.layers.{i}.mlp.{gate,up,down}_proj   layers.{i}.mlp.{w_gate,w_up,w_down}
//          model.norm.weight                          final_norm.weight
//   GPT-2  (transformer.)wte / wpe                    tok_embed / pos_embed
//          h.{i}.ln_1 / ln_2, ln_f                    attn_norm / mlp_norm, final_norm (.weight, .bias)
//          h.{i}.attn.c_attn [d, 3d] + bias [3d]      wq | wk | wv column blocks, transposed; bq | bk | bv
//          h.{i}.attn.c_proj, mlp.c_fc, mlp.c_proj    wo, w_fc, w_proj transposed (Conv1D stores [in, out])
//   BLOOM  (transformer.)word_embeddings(_layernorm)  tok_embed, embed_norm
//          h.{i}.input_layernorm / post_attention_layernorm, ln_f   attn_norm / mlp_norm, final_norm
//          h.{i}.self_attention.query_key_value [3d, d] rows per head h: [q_h; k_h; v_h] -> wq, wk, wv
//          h.{i}.self_attention.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h         wo, w_fc, w_proj
//   lm_head.weight -> lm_head when the head is untied.
// "transformer." is what save_pretrained writes; the hub's original GPT-2 and BLOOM files omit
// it, and both spellings are read. q_proj and k_proj are copied unpermuted: keel's RoPE pairs
// element i with i + head_dim/2 of each head (HF's rotate_half), the layout HF Llama checkpoints
// use (test_hf_convert.cpp checks converted models' logits and greedy tokens against transformers).
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

enum class HfArch { Llama, Mistral, Qwen2, Qwen3, GPT2, Bloom };
// "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel",
// "BloomForCausalLM"
std::string hf_arch_name(HfArch a);
// The HF architecture a keel model exports as. Throws CheckpointError naming what has no HF
// counterpart (ALiBi on a Llama, an embedding norm with learned positions, BLOOM's MLP width, a
// sliding window on GPT-2).
HfArch hf_arch_for(const ModelConfig& m, const std::string& who);

// The keel model an HF config.json describes. Throws CheckpointError naming the file and what
// keel cannot represent: another architecture, rope_scaling, attention/MLP biases on a Llama,
// sliding windows in only some layers, another activation,
// GPT-2's per-layer attention scaling, BLOOM's post-layernorm residual.
ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& source);

// config.json of an exported model: the template's fields (token ids, dropout, ...) when it
// describes the same architecture, else only its token ids, with every model field keel knows
// written over them (the inverse of model_config_from_hf). Alias spellings (n_embed, hidden_size
// on GPT-2, ...) are dropped so they cannot override the fields written.
nlohmann::json hf_config_json(const ModelConfig& m, HfArch arch, const nlohmann::json& tmpl, DType dtype);

// Where one keel tensor lives in an HF checkpoint. Keel row r (element r of a 1-D tensor) is
// row hf_row(r) of the HF tensor, or of its transpose when `transposed` (GPT-2's Conv1D weights
// are stored [in, out]). hf_row(r) = offset + (r / block) * stride + r % block: a fused
// tensor's column block (GPT-2's c_attn), or every head's slice of BLOOM's per-head [q; k; v].
struct HfTensorSlice {
  std::string keel, hf;
  std::vector<int64_t> hf_shape;  // the whole HF tensor as stored
  bool transposed = false;
  int64_t offset = 0, block = 0, stride = 0;  // block 0: rows one to one from offset
  int64_t hf_row(int64_t r) const { return block == 0 ? offset + r : offset + (r / block) * stride + r % block; }
  bool one_to_one() const { return !transposed && block == 0 && offset == 0; }  // keel row r is HF row r
};

// Every keel tensor of the model with its place in the HF files (the slices of a fused HF tensor
// are listed together). tensor_prefix: "transformer." (what save_pretrained writes) or "" (the
// hub's original GPT-2 / BLOOM files); Llama's is always "model.".
std::vector<HfTensorSlice> hf_tensor_layout(const ModelConfig& m, const std::string& tensor_prefix = "transformer.");

// An opened HF checkpoint directory: config parsed, every shard mapped, every tensor checked
// against the model the config describes (names, shapes, dtypes) before anything is read.
class HfCheckpoint {
 public:
  // `dir` with or without the "hf:" prefix. Throws CheckpointError listing every problem.
  static HfCheckpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config_json() const { return config_; }
  const ModelConfig& model() const { return model_; }
  HfArch arch() const { return arch_; }
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
  // A nan or inf among the values read is an error naming the HF tensor (CheckpointError).
  void read(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const;
  void read_full(const std::string& keel_name, const std::vector<int64_t>& keel_shape, DType out_type, void* out) const;
  // Done with a tensor: its pages leave this process's memory (they stay in the page cache).
  void release(const std::string& keel_name) const;

 private:
  struct Source {
    size_t file;
    const data::SafetensorsTensorInfo* info;
    HfTensorSlice slice;
  };
  const Source& source(const std::string& keel_name) const;
  void read_values(const std::string& keel_name, const TensorRegion& region, DType out_type, void* out) const;
  std::string dir_;
  nlohmann::json config_;
  ModelConfig model_;
  HfArch arch_ = HfArch::Llama;
  DType common_dtype_ = DType::F32;
  int64_t total_bytes_ = 0;
  std::vector<std::unique_ptr<data::SafetensorsReader>> files_;
  std::map<std::string, Source> tensors_;  // by keel name
  std::vector<std::string> notes_;
};

// The run config for finetuning an HF model (model section from its config.json, finetuning
// defaults elsewhere), as `keel convert` writes it to OUT/config.json and --print-config shows it.
// train.init_from is `init_from`: "." beside the converted weights (read from the config's folder,
// so the pair can move together), hf:DIR for --print-config.
nlohmann::json finetune_config_json(const HfCheckpoint& hf, const std::string& out_dir, const std::string& init_from);

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
  // nullopt (--dtype auto): the dtype of the HF model the checkpoint came from (meta.json
  // source.hf_dtype), so that HF -> keel -> HF is lossless; bf16 for a checkpoint without one.
  std::optional<DType> dtype;
  int64_t max_shard_bytes = int64_t{5} << 30;  // more bytes than this: model-0000X-of-0000N + index
  // Where to take config.json fields (bos/eos ids, ...) and tokenizer files from: an HF dir or a
  // keel convert output. Empty: the checkpoint directory itself, then the checkpoint's recorded
  // source (its HF config; the files of the first of source_dirs that has any); without either,
  // a config.json is made from the model alone.
  std::string like;
  bool force = false;
};

// keel -> HF: config.json and safetensors (sharded with model.safetensors.index.json when
// larger than max_shard_bytes) that transformers loads unchanged, plus the tokenizer files.
// Weights come from the fp32 masters when the checkpoint has them, else the stored weights.
ConvertStats export_keel_to_hf(const std::string& ckpt_path, const std::string& out_dir, const ExportOptions& opts);

// --init-from hf:DIR: fp32 masters from the HF weights (exact), working weights rounded to
// the working dtype, Adam moments zero, step 0 (ParamState::load_fp32). The run's model must be
// the HF model: a differing field is an error naming it and both values. Returns the log line;
// `source` (when given) gets the record of the HF model a checkpoint's meta.json keeps.
std::string init_weights_from_hf(const std::string& hf_dir, const ParamTable& table, ParamState& state,
                                 nlohmann::json* source = nullptr);

// meta.json's "source" for weights from an HF model: its path, dtype and config.json (export
// and sample read them to find the config fields and tokenizer files).
nlohmann::json hf_source_json(const HfCheckpoint& hf);

// `source` (a checkpoint's meta.json "source", possibly null) with the keel checkpoint at `path`
// added in front of its "init_from" list: what keel train --init-from CKPT records, so that
// sample and export find the tokenizer, chat template and HF files in a converted checkpoint
// even once the HF model it came from has moved. Earlier entries (a finetune of a finetune) stay.
nlohmann::json source_with_init_from(nlohmann::json source, const std::string& path);

// The folders a checkpoint's meta.json "source" points to, best first: the checkpoints it was
// initialised from (newest first), then the HF model. They may no longer exist.
std::vector<std::filesystem::path> source_dirs(const nlohmann::json& source);

// Files copied along with a model: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// tokenizer.model, generation_config.json, chat_template.jinja (the chat template, when it is
// not inside tokenizer_config.json).
const std::vector<std::string>& hf_side_files();
// Copies those of them that `from` has into `to` (replacing); returns their names.
std::vector<std::string> copy_side_files(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace keel
