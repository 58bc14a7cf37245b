#include "train/training_sample.h"

#include <cstdio>

#include "model/generator.h"
#include "train/model_loading.h"

namespace keel {

TrainingSampler::TrainingSampler(const RunConfig& cfg) : cfg_(cfg.sample) {
  if (!on()) return;
  tokenizer_path_ = locate_tokenizer(data_tokenizer_dirs(cfg), cfg_.tokenizer);
  if (tokenizer_path_.empty())
    throw ConfigError("sample.interval: samples are text and need a tokenizer: set sample.tokenizer, or keep "
                      "tokenizer.json beside the data.train files");
  tokenizer_ = data::Tokenizer::from_file(tokenizer_path_);
  // A sample ends at an end-of-text token: the data's, else a well-known one of the tokenizer.
  if (cfg.data.eod_token >= 0) stop_ids_.push_back(static_cast<int32_t>(cfg.data.eod_token));
  for (int32_t id : end_of_text_ids(*tokenizer_)) stop_ids_.push_back(id);
  prompt_ = tokenizer_->encode(cfg_.prompt, /*add_special_tokens=*/true);
  if (prompt_.empty()) {  // no prompt and no BOS: start after an end of text, as llm.c does
    if (stop_ids_.empty())
      throw ConfigError("sample.prompt: empty, and the tokenizer " + tokenizer_path_ +
                        " has no BOS or end-of-text token to start from; give a prompt");
    prompt_ = {stop_ids_.front()};
  }
  check_prompt_ids(prompt_, cfg.model.vocab_size, "sample.prompt",
                   ": " + tokenizer_path_ + " is not this model's tokenizer");
  if (static_cast<int64_t>(prompt_.size()) + cfg_.tokens > cfg.model.max_seq_len)
    throw ConfigError("sample.tokens: the prompt's " + std::to_string(prompt_.size()) + " tokens and " +
                      std::to_string(cfg_.tokens) + " new ones exceed model.max_seq_len (" +
                      std::to_string(cfg.model.max_seq_len) + ")");
}

std::string TrainingSampler::describe() const {
  char b[160];
  std::snprintf(b, sizeof b, "%lld tokens every %lld steps and at the end, temperature %g, top_p %g%s",
                static_cast<long long>(cfg_.tokens), static_cast<long long>(cfg_.interval), cfg_.temperature,
                cfg_.top_p, cfg_.top_k > 0 ? (", top_k " + std::to_string(cfg_.top_k)).c_str() : "");
  return "sample: " + std::to_string(prompt_.size()) + "-token prompt, " + b + ", tokenizer " + tokenizer_path_;
}

std::string TrainingSampler::sample(const ParamTable& table, Backend& backend, const Tensor& weights) const {
  GenerateOptions g;
  g.max_new_tokens = static_cast<int>(cfg_.tokens);
  g.sampling = {static_cast<float>(cfg_.temperature), static_cast<float>(cfg_.top_p), static_cast<int>(cfg_.top_k)};
  g.seed = static_cast<uint64_t>(cfg_.seed);
  g.stop_ids = stop_ids_;
  g.choosable_ids = tokenizer_->vocab_size();
  Generator gen(table, backend, weights, static_cast<int>(prompt_.size() + cfg_.tokens), DType::F32);
  std::vector<int32_t> all = prompt_;
  for (int32_t id : generate(gen, prompt_, g)) all.push_back(id);
  return tokenizer_->decode(all, /*skip_special_tokens=*/true);
}

}  // namespace keel
