// Text generated during training (the `sample` config section), as llm.c prints samples while
// it trains: every sample.interval steps the lead rank continues sample.prompt with a KV-cache
// Generator (model/generator.h) over its working weights. Needs the whole model on the rank
// (tp = pp = 1; config.cpp refuses other layouts).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "kernels/backend.h"
#include "model/param_table.h"
#include "train/config.h"

namespace keel {

class TrainingSampler {
 public:
  // Reads the tokenizer (sample.tokenizer, else tokenizer.json beside data.train) and encodes
  // the prompt; throws ConfigError naming the field when either is unusable. Off (interval 0):
  // does nothing.
  explicit TrainingSampler(const RunConfig& cfg);
  bool on() const { return cfg_.interval > 0; }
  bool due(int64_t step, int64_t last_step) const {
    return on() && due_every(step, cfg_.interval, last_step);
  }
  std::string describe() const;  // the start-up line

  // The prompt and its continuation as text. The same seed every time: two samples differ only
  // by the weights.
  std::string sample(const ParamTable& table, Backend& backend, const Tensor& weights) const;

 private:
  SampleConfig cfg_;
  std::string tokenizer_path_;
  std::optional<data::Tokenizer> tokenizer_;
  std::vector<int32_t> prompt_, stop_ids_;
};

}  // namespace keel
