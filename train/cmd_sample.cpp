// `keel sample`: generate text from a keel checkpoint or an HF model directory, with a KV cache
// (model/generator.h), encoding and decoding with the model's tokenizer.json in C++.
#include <chrono>
#include <cstdio>
#include <sstream>

#include "data/tokenizer.h"
#include "model/generator.h"
#include "train/commands.h"
#include "train/model_loading.h"
#include "train/run.h"

namespace keel {

using json = nlohmann::json;

namespace {

struct SampleArgs {
  InferenceModelArgs model;
  std::string prompt, prompt_ids;
  int max_new_tokens = 64, top_k = 0;
  float temperature = 0.8f, top_p = 0.95f;
  uint64_t seed = 0;
  bool no_special = false, ignore_eos = false, show_ids = false;
};


std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoi(item, &used));
      if (item.find_first_not_of(" \t", used) != std::string::npos) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw ConfigError("--prompt-ids: \"" + item + "\" is not a token id (expected e.g. 1,415,2936)");
    }
  }
  return ids;
}

std::string show_ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

int cmd_sample(const SampleArgs& a) {
  if (!a.prompt.empty() && !a.prompt_ids.empty()) throw ConfigError("give --prompt or --prompt-ids, not both");
  InferenceModel im(a.model);
  const LoadedModel& lm = im.model;
  Backend* const be = im.backend.get();
  const ModelConfig& m = lm.table->config();

  std::optional<data::Tokenizer> tok = find_tokenizer(lm, a.model.tokenizer, /*required=*/a.prompt_ids.empty(),
                                                      "pass --tokenizer PATH (or --prompt-ids to give token ids)");

  std::vector<int32_t> prompt = !a.prompt_ids.empty() ? parse_ids(a.prompt_ids) : tok->encode(a.prompt, !a.no_special);
  if (prompt.empty()) throw ConfigError("the prompt has no tokens");

  GenerateOptions g;
  g.max_new_tokens = a.max_new_tokens;
  g.sampling = {a.temperature, a.top_p, a.top_k};
  g.seed = a.seed;
  if (!a.ignore_eos) {
    // End of sequence: the HF config's eos_token_id (an id or a list), else well-known names.
    if (lm.hf_config.contains("eos_token_id")) {
      const json& e = lm.hf_config["eos_token_id"];
      if (e.is_number_integer()) g.stop_ids.push_back(e.get<int32_t>());
      if (e.is_array())
        for (const json& x : e) g.stop_ids.push_back(x.get<int32_t>());
    }
    if (g.stop_ids.empty() && tok) g.stop_ids = end_of_text_ids(*tok);
  }
  const int64_t max_len = static_cast<int64_t>(prompt.size()) + a.max_new_tokens;
  if (max_len > m.max_seq_len)
    throw ConfigError("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new-tokens " +
                      std::to_string(a.max_new_tokens) + " exceed the model's " + std::to_string(m.max_seq_len) +
                      " positions");
  Generator gen(*lm.table, *be, lm.weights, static_cast<int>(max_len), DType::F32);

  // Stream the continuation: decode prompt + new tokens and print what is new (decoding the
  // whole keeps SentencePiece spaces and multi-byte characters right).
  const std::string prompt_text = tok ? tok->decode(prompt, true) : "";
  std::printf("%s", prompt_text.c_str());
  std::fflush(stdout);
  std::vector<int32_t> all = prompt;
  size_t printed = prompt_text.size();
  const auto t0 = std::chrono::steady_clock::now();
  auto out = generate(gen, prompt, g, [&](int32_t id) {
    all.push_back(id);
    if (!tok) return;
    const std::string text = tok->decode(all, true);
    const bool partial = text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
    if (!partial && text.size() > printed) {
      std::printf("%s", text.substr(printed).c_str());
      std::fflush(stdout);
      printed = text.size();
    }
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tok) {
    const std::string text = tok->decode(all, true);
    if (text.size() > printed) std::printf("%s", text.substr(printed).c_str());
  }
  std::printf("\n");
  if (a.show_ids || !tok) {  // without a tokenizer the ids are the only output
    std::printf("prompt ids: %s\n", show_ids(prompt).c_str());
    std::printf("generated ids: %s\n", show_ids(out).c_str());
  }
  std::fflush(stdout);
  const bool stopped = !out.empty() && std::find(g.stop_ids.begin(), g.stop_ids.end(), out.back()) != g.stop_ids.end();
  std::fprintf(stderr, "keel: %zu new tokens in %.2f s (%.1f tokens/s)%s\n", out.size(), secs,
               secs > 0 ? out.size() / secs : 0.0, stopped ? ", stopped at end of sequence" : "");
  return kExitOk;
}

}  // namespace

Command add_sample_command(CLI::App& app) {
  auto args = std::make_shared<SampleArgs>();
  SampleArgs& s = *args;
  CLI::App* c = app.add_subcommand("sample", "Generate text from a checkpoint or a Hugging Face model");
  add_inference_model_options(c, s.model,
                              "tokenizer.json (or its directory); default: the checkpoint's, its HF source's, or its "
                              "training data's",
                              "Weights in memory: fp32 (default, matches HF fp32 logits), bf16, fp16");
  c->add_option("-p,--prompt", s.prompt, "Prompt text (encoded with the model's tokenizer, special tokens added)");
  c->add_option("--prompt-ids", s.prompt_ids, "Prompt as comma-separated token ids instead of text");
  c->add_option("-n,--max-new-tokens", s.max_new_tokens, "Tokens to generate (default 64)")->check(CLI::PositiveNumber);
  c->add_option("-t,--temperature", s.temperature, "Sampling temperature; 0 = greedy (default 0.8)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--top-p", s.top_p, "Nucleus sampling mass (default 0.95; 1 = off)")->check(CLI::Range(0.0, 1.0));
  c->add_option("--top-k", s.top_k, "Sample among the k most likely tokens (default 0 = off)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--seed", s.seed, "Random seed for sampling (default 0)");
  c->add_flag("--no-special-tokens", s.no_special, "Encode the prompt without the tokenizer's special tokens (BOS)");
  c->add_flag("--ignore-eos", s.ignore_eos, "Do not stop at the end-of-sequence token");
  c->add_flag("--show-ids", s.show_ids, "Also print the prompt and generated token ids (always printed without a tokenizer)");
  c->footer(
      "Examples:\n"
      "  keel sample --checkpoint hf:/models/Llama-2-7b-hf --prompt \"The capital of France is\" -t 0 -n 16\n"
      "  keel sample --checkpoint out/ft/checkpoints --prompt \"Q: why is the sky blue?\\nA:\" --top-p 0.9 --seed 3\n"
      "Generation uses a KV cache: the prompt in one forward, then one token per step.");
  return {c, [args] { return cmd_sample(*args); }};
}

}  // namespace keel
