// keel tokenize: a raw corpus (JSON lines or plain text) to token files keel trains on, with a
// tokenizer.json, in C++ and in parallel. It is scripts/prepare_data.py with an existing
// tokenizer, without Python: the same documents (data/corpus.h), the same seeded shuffle and
// train/val split (data/python_random.h), the same tokens and the same llm.c shards and loss-mask
// sidecars, byte for byte (test/data/test_tokenize_corpus.cpp checks the script's outputs).
// It does not train tokenizers or write multiple-choice items; the script does.
//
// Outputs in `out`:
//   llmc format:     train_000.bin, train_001.bin, ... (at most shard_tokens each), val_000.bin;
//                    past 1000 shards, as many digits as the last needs (train_0000.bin ...)
//                    (uint16 tokens when every id fits, else uint32: data/token_file.h)
//   megatron format: train.bin + train.idx, val.bin + val.idx (one sequence per document)
//   with the prompt loss mask: a sidecar per token file (train_000.mask, train.mask: data/loss_mask.h)
//   meta.json (vocab size, eot_id, counts, checksums, the source), tokenizer.json (a copy)
//   with chat: the chat template (chat_template.jinja and the tokenizer_config.json beside it, or
//   tokenizer_config.json alone), recorded in meta.json source.chat_template relative to `out`
// Every document is followed by the end-of-text token. With the prompt loss mask the document
// is the tokens of prompt + response encoded as one text, then the end of text, and only the
// response's tokens (from a token straddling the join on: Tokenizer::encode_joined) and the end
// of text count in the loss.
// Conversations (chat) are rendered by the model's chat template (data/chat_template.h) and
// encoded as transformers' apply_chat_template(tokenize=True) encodes them (no special tokens
// added: the template writes them); the end of text follows unless the rendering already ends
// with it. With the assistant loss mask only the assistant's replies count in the loss.
//
// With pack = T (llmc only), documents are packed whole into windows of T tokens, the
// train.seq_len that reads them (data/packing.h): each window holds whole documents and then
// padding (end-of-text tokens out of the loss); a shard holds whole windows plus one padding
// token, the last window's final target. Every token file then gets a mask sidecar: padding and
// the first token of each window (the previous window's last target) are out of the loss.
// Documents longer than a window are handled by pack_overflow. meta.json records the packing,
// and keel train refuses the data under another train.seq_len. When every training document is
// longer than a window and dropped, the run fails; when every validation document is, no val
// file is written (as with val_fraction 0) and the summary says so.
//
// Nothing in `out` changes until everything is written and checked: the files are written to a
// staging folder inside it, then token files of an earlier run (train_NNN / val_NNN .bin and
// .mask, train / val .bin, .idx and .mask) are removed and the new ones moved in. An error
// leaves `out` as it was, and removes it again when the run created it. The staging folder is
// .keel-tokenize-<host>-<pid>; a run first removes those of this host whose process is gone (a
// killed run's), and names those of other hosts in a note without touching them.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "data/corpus.h"
#include "data/packing.h"

namespace keel::data {

enum class TokenOutputFormat { llmc, megatron };

struct TokenizeOptions {
  std::vector<std::string> jsonl, text;  // exactly one of them
  std::string text_key = "text";
  DocSplit doc_split = DocSplit::file;  // plain text only
  bool prompt_loss_mask = false;        // JSON lines of prompt/response pairs
  std::string prompt_key = "prompt", response_key = "response";
  bool chat = false;                    // JSON lines of conversations, in messages_key
  std::string messages_key = "messages";  // the default also reads ShareGPT's "conversations"
  std::string chat_template;            // a .jinja, tokenizer_config.json or model folder; empty: the tokenizer's folder
  bool assistant_loss_mask = true;      // chat: only the assistant's replies in the loss
  std::string tokenizer;                // tokenizer.json, or a folder that holds one
  std::string eot_token;                // empty: <|endoftext|>, else the first of </s>, <|end_of_text|>, <|eot_id|>
  bool add_special_tokens = false;      // encode each document (prompt) with the post-processor (BOS)
  bool split_special_tokens = false;    // a special token's text in a document (in messages) is encoded as text
  uint64_t seed = 1337;                 // document shuffle, as random.Random(seed).shuffle
  double val_fraction = 0.05;           // documents held out, in [0, 1)
  int64_t shard_tokens = 100'000'000;   // llmc: tokens per shard
  TokenOutputFormat format = TokenOutputFormat::llmc;
  int64_t pack = 0;                     // > 0: whole documents in windows of this many tokens (llmc only)
  std::optional<PackOverflow> pack_overflow;  // unset: split plain documents, drop pairs and conversations
  int threads = 0;                      // 0: every core
  std::string out;
};

struct TokenizedSplit {
  int64_t documents = 0, tokens = 0, in_loss = 0;  // in_loss: targets the mask keeps (masked runs)
  int64_t unplaced_replies = 0;                    // chat: assistant replies the mask could not locate
  int64_t without_replies = 0;                     // chat: conversations with nothing in the loss
  int64_t weight0_replies = 0;                     // chat: assistant replies left out by "weight": 0
  // Documents whose text (conversations whose messages) holds a special token's text, encoded as
  // that token (without --split-special-tokens), and such tokens (one per document; up to 6
  // kinds, 5 of them shown).
  int64_t special_text_documents = 0;
  std::set<int32_t> special_text_tokens;
  // Chat: conversations holding the end-of-text token before their end (Llama 2's and Zephyr's
  // templates write </s> after every turn), which data.document_masking would cut at each.
  int64_t eot_inside_conversations = 0;
  // Packing: windows written, padding tokens among `tokens`, documents longer than a window (the
  // longest of them, in tokens with its end of text), the pieces that split made of them, and
  // the tokens that drop and truncate left out. `documents` counts what was written.
  int64_t windows = 0, pad_tokens = 0, long_documents = 0, longest = 0, pieces = 0, tokens_left_out = 0;
  std::vector<std::string> files;                  // token files, names inside `out`
};

struct TokenizeResult {
  TokenizedSplit train, val;
  int64_t vocab_size = 0, characters = 0;
  int32_t eot_id = -1;
  std::string eot_token;
  bool u32 = false;  // 4-byte tokens
};

// Throws std::invalid_argument for bad options (naming the option and what is allowed; keel
// tokenize turns it into a ConfigError, exit 2) and DataError for unreadable inputs or
// unwritable outputs (exit 3). `log` gets the progress and summary lines.
TokenizeResult tokenize_corpus(const TokenizeOptions& o, const std::function<void(const std::string&)>& log);

}  // namespace keel::data
