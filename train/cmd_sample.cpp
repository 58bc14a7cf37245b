// `keel sample`: generate text from a keel checkpoint or an HF model directory, with a KV cache
// (model/generator.h), encoding and decoding with the model's tokenizer.json in C++.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>

#include "data/chat_template.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "model/generator.h"
#include "train/checkpoint.h"
#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/model_loading.h"
#include "train/run.h"

namespace keel {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct SampleArgs {
  InferenceModelArgs model;
  std::string prompt, prompt_ids;
  std::string chat, system, chat_template;  // --chat: a user message, rendered by the chat template
  int max_new_tokens = 64, top_k = 0;
  const CLI::Option* max_new_tokens_option = nullptr;  // given (count) or the default
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

// The model's chat template: --chat-template, else the first one found along the model's trail
// (lm.chat_templates: its own folders, the template its training data was rendered with, the
// checkpoints and HF model it came from), after the --tokenizer folder.
data::ChatTemplate find_chat_template(const LoadedModel& lm, const SampleArgs& a) {
  std::vector<fs::path> where;
  if (!a.model.tokenizer.empty())
    where.push_back(fs::is_directory(a.model.tokenizer) ? fs::path(a.model.tokenizer) : fs::path(a.model.tokenizer).parent_path());
  where.insert(where.end(), lm.chat_templates.begin(), lm.chat_templates.end());
  if (!a.chat_template.empty())  // its special tokens, when none are beside it: the tokenizer's, the model's
    return data::ChatTemplate::from_path(a.chat_template.starts_with("hf:") ? a.chat_template.substr(3) : a.chat_template,
                                         where.empty() ? std::string() : where.front().string());
  return first_chat_template(where, lm.source);
}

int cmd_sample(const SampleArgs& a) {
  const int prompts = !a.prompt.empty() + !a.prompt_ids.empty() + !a.chat.empty();
  if (prompts > 1) throw ConfigError("give one of --prompt, --prompt-ids and --chat");
  if (!a.system.empty() && a.chat.empty()) throw ConfigError("--system goes with --chat");
  InferenceModel im(a.model);
  const LoadedModel& lm = im.model;
  Backend* const be = im.backend.get();
  const ModelConfig& m = lm.table->config();

  std::optional<data::Tokenizer> tok = find_tokenizer(lm, a.model.tokenizer, /*required=*/a.prompt_ids.empty(),
                                                      "pass --tokenizer PATH (or --prompt-ids to give token ids)");

  std::vector<int32_t> prompt;
  std::optional<data::ChatTemplate> chat;
  if (!a.chat.empty()) {
    // As apply_chat_template(add_generation_prompt=True, tokenize=True): the template writes the
    // special tokens, so none are added.
    chat = find_chat_template(lm, a);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", a.chat}});
    prompt = tok->encode(chat->render(messages, true), false);
    std::fprintf(stderr, "keel: chat template of %s; the prompt is %zu tokens\n", chat->origin().c_str(), prompt.size());
  } else {
    prompt = !a.prompt_ids.empty() ? parse_ids(a.prompt_ids) : tok->encode(a.prompt, !a.no_special);
  }
  if (prompt.empty()) throw ConfigError("the prompt has no tokens");
  // Before anything is printed: the generator would stop at such an id with an internal error.
  if (!a.prompt_ids.empty())
    check_prompt_ids(prompt, m.vocab_size, "--prompt-ids", "");
  else
    check_prompt_ids(prompt, m.vocab_size, a.chat.empty() ? "--prompt" : "--chat",
                     ", from the tokenizer: is it the model's own? (--tokenizer)");

  // The default length, not asked for, fits what the model's positions leave after the prompt
  // (a model of 64 positions could not take a prompt and 64 more).
  const int64_t room = m.max_seq_len - static_cast<int64_t>(prompt.size());
  int max_new_tokens = a.max_new_tokens;
  if (a.max_new_tokens_option && a.max_new_tokens_option->count() == 0 && room > 0 && room < max_new_tokens) {
    max_new_tokens = static_cast<int>(room);
    std::fprintf(stderr, "keel: generating up to %d tokens, what the model's %lld positions leave after the %zu-token "
                 "prompt (-n to choose)\n", max_new_tokens, static_cast<long long>(m.max_seq_len), prompt.size());
  }
  GenerateOptions g;
  g.max_new_tokens = max_new_tokens;
  g.sampling = {a.temperature, a.top_p, a.top_k};
  g.seed = a.seed;
  if (tok && tok->vocab_size() < m.vocab_size) {
    g.choosable_ids = tok->vocab_size();
    std::fprintf(stderr, "keel: the model has %lld ids, the tokenizer %lld: ids from %lld on have no text and are not sampled\n",
                 static_cast<long long>(m.vocab_size), static_cast<long long>(tok->vocab_size()),
                 static_cast<long long>(tok->vocab_size()));
  }
  if (!a.ignore_eos) {
    // End of sequence: the HF config's eos_token_id (an id or a list), else well-known names.
    if (lm.hf_config.contains("eos_token_id")) {
      const json& e = lm.hf_config["eos_token_id"];
      if (e.is_number_integer()) g.stop_ids.push_back(e.get<int32_t>());
      if (e.is_array())
        for (const json& x : e) g.stop_ids.push_back(x.get<int32_t>());
    }
    if (g.stop_ids.empty() && tok) g.stop_ids = end_of_text_ids(*tok);
    // The end of a document in the run's training data, where its samples during training stop too.
    if (lm.eod_token >= 0 && std::find(g.stop_ids.begin(), g.stop_ids.end(), lm.eod_token) == g.stop_ids.end())
      g.stop_ids.push_back(static_cast<int32_t>(lm.eod_token));
    if (chat) {  // a reply ends at the template's eos_token or an end-of-turn token
      std::vector<std::string> names(std::begin(data::kEndOfTurnTokens), std::end(data::kEndOfTurnTokens));
      names.push_back(chat->special_token("eos_token"));
      for (const std::string& n : names)
        if (auto id = n.empty() ? std::nullopt : tok->token_to_id(n))
          if (std::find(g.stop_ids.begin(), g.stop_ids.end(), *id) == g.stop_ids.end()) g.stop_ids.push_back(*id);
    }
  }
  const int64_t max_len = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  if (max_len > m.max_seq_len)
    throw ConfigError("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new-tokens " +
                      std::to_string(max_new_tokens) + " exceed the model's " + std::to_string(m.max_seq_len) +
                      " positions" + (room > 0 ? ": at most -n " + std::to_string(room) + " after this prompt" : ""));
  Generator gen(*lm.table, *be, lm.weights, static_cast<int>(max_len), DType::F32);

  // Stream the continuation: decode prompt + new tokens and print what is new (decoding the
  // whole keeps SentencePiece spaces and multi-byte characters right).
  // A chat shows the reply only (the rendered prompt is the template's markup).
  const std::string prompt_text = tok && !chat ? tok->decode(prompt, true) : "";
  std::printf("%s", prompt_text.c_str());
  std::fflush(stdout);
  std::vector<int32_t> all = chat ? std::vector<int32_t>() : prompt;
  size_t printed = prompt_text.size();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> out;
  try {
    out = generate(gen, prompt, g, [&](int32_t id) {
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
  } catch (const NonFiniteLogits& e) {
    std::printf("\n");
    throw CheckpointError(non_finite_logits_message(e.what(), lm, a.model.dtype));
  }
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
  c->add_option("--chat", s.chat,
                "A user message, rendered with the model's chat template (apply_chat_template with "
                "add_generation_prompt); prints the assistant's reply");
  c->add_option("--system", s.system, "--chat: a system message before the user's");
  c->add_option("--chat-template", s.chat_template,
                "--chat: a .jinja file, tokenizer_config.json or model folder (default: the model's)");
  s.max_new_tokens_option =
      c->add_option("-n,--max-new-tokens", s.max_new_tokens,
                    "Tokens to generate (default 64, or what the model's positions leave after the prompt)")
          ->check(cli::integer<int>(1));
  c->add_option("-t,--temperature", s.temperature, "Sampling temperature; 0 = greedy (default 0.8)")
      ->check(cli::number(0, 100));
  c->add_option("--top-p", s.top_p,
                "Nucleus sampling: sample among the most likely tokens whose probabilities sum to P, at least one "
                "(default 0.95; 1 = off, 0 = the most likely token only)")
      ->check(cli::number(0, 1));
  c->add_option("--top-k", s.top_k, "Sample among the k most likely tokens (default 0 = off)")
      ->check(cli::integer<int>(0));
  c->add_option("--seed", s.seed, "Random seed for sampling (default 0)")->check(cli::integer<uint64_t>(0));
  c->add_flag("--no-special-tokens", s.no_special, "Encode the prompt without the tokenizer's special tokens (BOS)");
  c->add_flag("--ignore-eos", s.ignore_eos, "Do not stop at the end-of-sequence token");
  c->add_flag("--show-ids", s.show_ids, "Also print the prompt and generated token ids (always printed without a tokenizer)");
  c->footer(
      "Examples:\n"
      "  keel sample --checkpoint hf:/models/Llama-2-7b-hf --prompt \"The capital of France is\" -t 0 -n 16\n"
      "  keel sample --checkpoint out/ft/checkpoints --prompt \"Q: why is the sky blue?\\nA:\" --top-p 0.9 --seed 3\n"
      "  keel sample --checkpoint out/chat-ft/checkpoints --chat \"Name three primes.\" -t 0\n"
      "Generation uses a KV cache: the prompt in one forward, then one token per step.");
  return {c, [args] { return cmd_sample(*args); }};
}

}  // namespace keel
