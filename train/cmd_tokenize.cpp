// `keel tokenize`: a JSON-lines or plain-text corpus to the token files keel trains on, with the
// model's tokenizer.json, in parallel and without Python (data/tokenize_corpus.h).
#include <cstdio>
#include <filesystem>

#include "data/tokenize_corpus.h"
#include "train/checkpoint.h"
#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/model_loading.h"
#include "train/run.h"

namespace keel {

namespace {

struct TokenizeArgs {
  data::TokenizeOptions o;
  std::string doc_split = "file", loss_mask, format = "llmc";  // loss_mask "": none, or assistant with --chat
  std::string pack_overflow;                                  // "": the default of data/tokenize_corpus.h
  bool eot_given = false;                                     // --eot-token on the command line
};

// --tokenizer a keel checkpoint (a finetune's, tokenizing for its next stage), which holds no
// tokenizer.json of its own: the tokenizer, and for --chat the template, that keel sample would
// use for it (checkpoint_assets: its run, the checkpoints and HF model it came from, its data).
void use_checkpoint_assets(data::TokenizeOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir(o.tokenizer);
  if (!fs::is_directory(dir) || fs::exists(dir / "tokenizer.json") ||
      !(fs::exists(dir / "meta.json") || fs::exists(dir / "latest") || fs::exists(dir / "checkpoints")))
    return;
  const Checkpoint ck = Checkpoint::open(fs::exists(dir / "checkpoints") ? (dir / "checkpoints").string() : o.tokenizer);
  const AssetTrail trail = checkpoint_assets(ck);
  const std::string found = locate_tokenizer(trail.tokenizer_dirs, "");
  if (found.empty())
    throw ConfigError("--tokenizer " + o.tokenizer + ": the keel checkpoint " + ck.path() +
                      " has no tokenizer.json along its trail; " + tokenizer_places(trail.tokenizer_dirs) +
                      "\npass the tokenizer.json it was trained with");
  std::printf("keel: --tokenizer %s is a keel checkpoint: its tokenizer is %s\n", o.tokenizer.c_str(), found.c_str());
  o.tokenizer = found;
  if (o.chat && o.chat_template.empty()) {
    o.chat_template = first_chat_template(trail.chat_templates, ck.path()).origin();
    std::printf("keel: its chat template: %s\n", o.chat_template.c_str());
  }
}

int cmd_tokenize(TokenizeArgs a) {
  data::TokenizeOptions& o = a.o;
  // An empty TokenizeOptions::eot_token means "the default"; an empty --eot-token is a mistake.
  if (a.eot_given && o.eot_token.empty())
    throw ConfigError("--eot-token: an empty token name; leave the option out for the default (<|endoftext|>, else "
                      "</s>, <|end_of_text|>, <|eot_id|>)");
  o.doc_split = a.doc_split == "paragraph" ? data::DocSplit::paragraph
                : a.doc_split == "line"    ? data::DocSplit::line
                                           : data::DocSplit::file;
  o.prompt_loss_mask = a.loss_mask == "prompt";
  if (a.loss_mask == "assistant" && !o.chat) throw ConfigError("--loss-mask assistant is for conversations: add --chat");
  o.assistant_loss_mask = a.loss_mask.empty() || a.loss_mask == "assistant";
  if (o.chat_template.starts_with("hf:")) o.chat_template = o.chat_template.substr(3);
  o.format = a.format == "megatron" ? data::TokenOutputFormat::megatron : data::TokenOutputFormat::llmc;
  if (!a.pack_overflow.empty())
    o.pack_overflow = a.pack_overflow == "drop"       ? data::PackOverflow::drop
                      : a.pack_overflow == "truncate" ? data::PackOverflow::truncate
                                                      : data::PackOverflow::split;
  if (o.tokenizer.starts_with("hf:")) o.tokenizer = o.tokenizer.substr(3);
  use_checkpoint_assets(o);
  if (!o.jsonl.empty() && a.doc_split != "file") throw ConfigError("--doc-split applies to --text only");
  try {
    data::tokenize_corpus(o, [](const std::string& line) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    });
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  return kExitOk;
}

}  // namespace

Command add_tokenize_command(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  TokenizeArgs& a = *args;
  data::TokenizeOptions& o = a.o;
  CLI::App* c = app.add_subcommand(
      "tokenize", "Tokenize a JSON-lines or text corpus into token files for keel train (prepare_data.py in C++)");
  auto* jsonl = c->add_option("--jsonl", o.jsonl, "JSON-lines files: one object per line, the document in --text-key");
  c->add_option("--text", o.text, "Plain text files (one document per file, paragraph or line: --doc-split)")
      ->excludes(jsonl);
  c->add_option("--tokenizer", o.tokenizer, "tokenizer.json, or a folder holding one (a converted checkpoint, hf:DIR), or a keel checkpoint or run directory (its tokenizer, as keel sample finds it)")
      ->required();
  c->add_option("-o,--out", o.out, "Output folder (token files, meta.json, tokenizer.json)")->required();
  c->add_option("--text-key", o.text_key, "JSON field holding the document (default: text)");
  c->add_option("--doc-split", a.doc_split, "--text: file, paragraph (blank-line separated) or line (default: file)")
      ->check(CLI::IsMember({"file", "paragraph", "line"}));
  c->add_option("--loss-mask", a.loss_mask,
                "prompt: records are prompt/response pairs and only the response and end of text count in the loss; "
                "assistant (the default with --chat): only the assistant's replies count; none (the default otherwise). "
                "Masks are .mask sidecars beside the token files")
      ->check(CLI::IsMember({"none", "prompt", "assistant"}));
  c->add_flag("--chat", o.chat,
              "Records are conversations ({\"messages\": [{\"role\", \"content\"}, ...], optional \"tools\"}), "
              "rendered with the model's chat template as transformers' apply_chat_template does");
  c->add_option("--messages-key", o.messages_key, "--chat: JSON field holding the messages (default: messages, else ShareGPT's conversations)");
  c->add_option("--chat-template", o.chat_template,
                "--chat: a .jinja file, a tokenizer_config.json or a model folder (default: the tokenizer's folder)");
  c->add_option("--prompt-key", o.prompt_key, "JSON prompt field for --loss-mask prompt (default: prompt)");
  c->add_option("--response-key", o.response_key, "JSON response field for --loss-mask prompt (default: response)");
  c->add_option("--eot-token", o.eot_token,
                "End-of-text token after every document (default <|endoftext|>, else </s>, <|end_of_text|>, <|eot_id|>)")
      ->each([&a](const std::string&) { a.eot_given = true; });
  c->add_flag("--add-special-tokens", o.add_special_tokens,
              "Encode each document (prompt) with the tokenizer's post-processor, e.g. Llama's BOS in front");
  c->add_flag("--split-special-tokens", o.split_special_tokens,
              "Encode the text of special tokens in documents (\"<|endoftext|>\" in a web page) as ordinary text, "
              "as transformers' split_special_tokens and llm.c's encode_ordinary do, instead of as the token: with "
              "data.document_masking a false end of text would cut the document in two. With --chat: such text in the "
              "messages (and tools); the special tokens the chat template writes stay special");
  c->add_option("--seed", o.seed, "Document shuffle seed (default 1337; the same split as prepare_data.py)")
      ->check(cli::integer<uint64_t>(0));
  c->add_option("--val-fraction", o.val_fraction, "Fraction of documents held out for validation (default 0.05)")
      ->check(cli::number(0, 1, /*lo_open=*/false, /*hi_open=*/true));
  c->add_option("--shard-tokens", o.shard_tokens,
                "llmc: tokens per shard (default 100000000); past 1000 shards the names get more digits "
                "(train_0000.bin ...), so that they sort in order")
      ->check(cli::integer<int64_t>(1));
  c->add_option("--format", a.format, "llmc (llm.c shards, default) or megatron (.bin + .idx per split)")
      ->check(CLI::IsMember({"llmc", "megatron"}));
  c->add_option("--pack", o.pack,
                "Pack whole documents into windows of this many tokens, the train.seq_len that will read them, with "
                "padding out of the loss: no document is cut by a window boundary (instruction data); llmc only. "
                "0 (the default): no packing")
      ->check(cli::integer<int64_t>(0));
  c->add_option("--pack-overflow", a.pack_overflow,
                "--pack: documents longer than a window are dropped, truncated, or split into window-sized pieces "
                "(default: split plain documents, drop prompt/response pairs and conversations)")
      ->check(CLI::IsMember({"drop", "truncate", "split"}));
  c->add_option("-j,--threads", o.threads, "Encoding threads (default: every core)")->check(cli::integer<int>(0));
  c->footer(
      "Examples:\n"
      "  keel tokenize --jsonl web.jsonl --tokenizer ckpt/llama2-7b --out data/web\n"
      "  keel tokenize --jsonl sft.jsonl --loss-mask prompt --add-special-tokens --tokenizer hf:/models/Llama-3.2-1B --out data/sft\n"
      "  keel tokenize --text book.txt --doc-split paragraph --tokenizer data/fortunes/tokenizer.json --out data/book\n"
      "  keel tokenize --jsonl chats.jsonl --chat --tokenizer hf:/models/Llama-3.2-1B-Instruct --out data/chats --pack 2048\n"
      "Documents are shuffled with --seed and --val-fraction of them held out, as scripts/prepare_data.py does:\n"
      "with the same inputs and tokenizer both write the same token files byte for byte. The output folder\n"
      "changes only once everything is written and checked.");
  return {c, [args] { return cmd_tokenize(*args); }};
}

}  // namespace keel
