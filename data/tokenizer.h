// Hugging Face tokenizer.json, encode and decode, in C++ (keel sample's prompts, tools).
//
// Covers the BPE tokenizers of the Llama family, GPT-2 and Qwen2:
//   byte-level BPE (GPT-2, Llama 3, Qwen2/2.5/3): ByteLevel pre-tokenizer (GPT-2 regex or a
//     Split regex before it), merges by rank, ignore_merges, added/special tokens, an NFC
//     normalizer;
//   SentencePiece-style BPE (Llama 2, Mistral): "▁" for spaces via Prepend/Replace normalizers
//     or a Metaspace pre-tokenizer, byte fallback to <0xXX> tokens, unk fusing.
// Components: normalizers NFC, NFD, NFKC, NFKD (Unicode normalization, data/unicode.h),
// Prepend, Replace, Strip, Sequence; pre-tokenizers ByteLevel, Split, Metaspace, Digits,
// Whitespace, WhitespaceSplit, Sequence; post-processors TemplateProcessing, ByteLevel,
// BertProcessing/RobertaProcessing (single sequence), Sequence; decoders ByteLevel, Replace,
// ByteFallback, Fuse, Strip, Metaspace, Sequence. Anything else is refused when the
// file is loaded, with an error naming the component, so keel never tokenizes differently from
// the library in silence. The behaviour is checked id for id against the HF `tokenizers`
// library on a multilingual corpus (test/data/test_tokenizer.cpp). One known difference: the
// normalizers follow Unicode 14.0 (Python's unicodedata), while HF's tables are older and
// leave alone the 73 code points whose decompositions are newer (U+32FF, U+A7F2..U+A7F4,
// U+10781.., U+11938, ...).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::data {

// The well-known end-of-text tokens, in prepare_data.py's order of preference: GPT-2 and Qwen's,
// Llama 2 and Mistral's, Llama 3's two.
inline constexpr const char* kEndOfTextTokens[] = {"<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>"};
// The tokens that end a chat turn in the common chat templates: Llama 3 (and its tool-call
// turn), ChatML (Qwen), Gemma, Phi-3.
inline constexpr const char* kEndOfTurnTokens[] = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>"};

class Tokenizer {
 public:
  // Throws DataError naming the file and the unsupported or malformed part.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(std::string_view json_text, const std::string& source = "tokenizer.json");
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Text (UTF-8; invalid UTF-8 throws DataError) to token ids, as HF's
  // tokenizer.encode(text, add_special_tokens=...).ids. add_special_tokens applies the
  // post-processor (e.g. Llama's BOS).
  // Keeps no state between calls: one Tokenizer may encode from many threads at once
  // (keel tokenize does).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // With `on`, the text of an added token marked special (a document that mentions
  // "<|endoftext|>") is encoded as ordinary text, not as that token: HF tokenizers'
  // encode_special_tokens = True (transformers' split_special_tokens), llm.c's encode_ordinary.
  // Non-special added tokens still match, and the post-processor's BOS/EOS stay special.
  void set_split_special_tokens(bool on);
  bool split_special_tokens() const;
  // Byte ranges [begin, end), in order, of the special tokens that encode(text) matches on the
  // text as given: the added tokens marked special and "normalized": false (as transformers adds
  // special tokens), found as encode_special_tokens finds them to leave them text.
  using Spans = std::vector<std::pair<size_t, size_t>>;
  Spans special_token_spans(std::string_view text) const;
  // The id of a special token marked "normalized": true whose content the normalized text holds
  // (-1: none). Such a token is matched after the normalizer, in text whose bytes are not the
  // input's, so no byte range of the input names it.
  int32_t normalized_special_in(std::string_view text) const;
  // encode, except that a special token whose match overlaps one of `text_spans` (byte ranges in
  // order, not overlapping) stays ordinary text, as with set_split_special_tokens there; special
  // tokens elsewhere are matched as usual. What a chat template's rendering becomes when the
  // special-token text of the messages is text (keel tokenize --chat --split-special-tokens):
  // the template's own special tokens stay special.
  std::vector<int32_t> encode_with_text_spans(std::string_view text, const Spans& text_spans,
                                              bool add_special_tokens = false) const;
  // first + second encoded as one text, and where second's tokens begin in it: what a prompt
  // and its response (keel tokenize --loss-mask prompt) or a context and an ending (keel eval)
  // become. Encoding second on its own would not give the same tokens: a SentencePiece-style
  // tokenizer (Prepend or Metaspace "▁") marks the start of every text it encodes, so " 4" would
  // get a second "▁", and BPE may merge across the join. The rule at the join: second's tokens
  // start after the longest prefix that ids shares with encode(first, add_special_tokens), so a
  // token that straddles the join (or one of first's tokens that the join re-tokenizes) counts
  // as second's. Where first's tokens are a prefix of the whole, as usual, split is their count
  // (as in lm-evaluation-harness, TRL and axolotl).
  struct Joined {
    std::vector<int32_t> ids;  // encode(first + second, add_special_tokens)
    size_t split = 0;          // second's tokens are ids[split:]
  };
  Joined encode_joined(std::string_view first, std::string_view second, bool add_special_tokens = false) const;
  // Ids to text, as HF's tokenizer.decode(ids, skip_special_tokens=...). Ids outside the
  // vocabulary are skipped.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // Number of ids (model vocabulary plus added tokens): every id is below it.
  int64_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // "" for unknown ids
  bool is_special(int32_t id) const;          // an added token marked special
  int32_t unk_id() const;                     // the model's unknown-text id (-1: none)
  // One line for logs: "byte-level BPE, 50257 ids (1 added), pre-tokenizer ByteLevel".
  std::string describe() const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::data
