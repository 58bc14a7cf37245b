// A whole model loaded for inference (keel sample, keel eval): from a keel checkpoint (its fp32
// masters when saved, else its weights) or an HF directory, on the CPU or a GPU, with the
// tokenizer that belongs to it.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "kernels/backend.h"
#include "model/param_table.h"

namespace keel {

struct LoadedModel {
  std::unique_ptr<ParamTable> table;
  Tensor weights;  // flat, laid out by table, on the backend
  std::string description;
  std::string source;  // the spec it was loaded from
  nlohmann::json hf_config;  // the HF config.json, when known (eos ids)
  std::vector<std::filesystem::path> tokenizer_dirs;  // where to look for tokenizer.json, best first
  // "hf:/m (bf16): llama model, 1100048384 parameters"
  std::string summary() const;
};

// spec: a keel checkpoint (step_* or a checkpoints directory) or hf:DIR. Weights in `dtype`.
LoadedModel load_model(const std::string& spec, DType dtype, Backend& be);

// --dtype fp32|bf16|fp16 for the weights in memory; anything else is a ConfigError.
DType parse_inference_dtype(const std::string& name);

// --device cpu|cuda, checked: a CUDA request without a CUDA build or a visible GPU is a
// ConfigError saying which.
std::unique_ptr<Backend> inference_backend(const std::string& device);

// `explicit_path` (a tokenizer.json or its directory) when given, else the first tokenizer.json
// in `dirs`; empty when there is none.
std::string locate_tokenizer(const std::vector<std::filesystem::path>& dirs, const std::string& explicit_path);

// `explicit_path` (a tokenizer.json or its directory) when given, else the first tokenizer.json
// among the model's tokenizer_dirs; logs which. None found: nullopt, or when `required` a
// ConfigError listing where it looked, followed by `hint`.
std::optional<data::Tokenizer> find_tokenizer(const LoadedModel& lm, const std::string& explicit_path, bool required,
                                              const std::string& hint);

}  // namespace keel
