// Run configs for tests, built from JSON exactly as `keel train` would build them.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "train/config.h"

namespace keel::test {

// A tiny Llama run on synthetic data; override fields with JSON merge-patch semantics.
inline nlohmann::json tiny_run_json(const std::string& family = "llama") {
  nlohmann::json j = {
      {"model",
       {{"family", family},
        {"vocab_size", 64},
        {"d_model", 32},
        {"n_layers", 2},
        {"n_heads", 4},
        {"n_kv_heads", family == "llama" ? 2 : 4},
        {"ffn_hidden", family == "llama" ? 64 : 128},
        {"max_seq_len", 32}}},
      {"precision", {{"mode", "fp32"}}},
      {"optimizer", {{"lr", 1e-2}, {"min_lr", 1e-3}, {"weight_decay", 0.1}, {"grad_clip", 1.0}}},
      {"schedule", {{"warmup_steps", 2}, {"decay", "cosine"}}},
      {"train", {{"steps", 30}, {"global_batch", 8}, {"micro_batch", 4}, {"seq_len", 32}, {"seed", 1}}},
      {"data", {{"train", "unused.bin"}}},
      {"device", "cpu"},  // the CPU reference, also on machines with a GPU (test/gpu covers CUDA)
  };
  return j;
}

inline RunConfig make_config(const nlohmann::json& base, const nlohmann::json& patch = nlohmann::json::object()) {
  nlohmann::json j = base;
  j.merge_patch(patch);
  return parse_config(j, "test.json");
}

}  // namespace keel::test
