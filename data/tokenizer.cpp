#include "data/tokenizer.h"

#include <algorithm>
#include <queue>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "data/regex.h"
#include "data/token_file.h"  // DataError
#include "data/unicode.h"

namespace keel::data {

namespace {

using json = nlohmann::json;
namespace uc = unicode;

// GPT-2's pre-tokenization pattern (what ByteLevel's use_regex splits with).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  size_t pos = 0;
  while (pos < s.size()) {
    const int32_t c = uc::next_utf8(s, pos);
    out += c < 0 ? char32_t{0xFFFD} : static_cast<char32_t>(c);
  }
  return out;
}

// Byte offset of each code point of s (plus s.size() at the end).
std::vector<size_t> char_offsets(std::string_view s) {
  std::vector<size_t> off;
  size_t pos = 0;
  while (pos < s.size()) {
    off.push_back(pos);
    uc::next_utf8(s, pos);
  }
  off.push_back(s.size());
  return off;
}

// UTF-8 with each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy,
// which HF's ByteLevel decoder uses).
std::string utf8_lossy(std::string_view s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    size_t pos = i;
    if (uc::next_utf8(s, pos) >= 0) {
      out.append(s.substr(i, pos - i));
      i = pos;
      continue;
    }
    // Skip the longest prefix that could still have begun a valid sequence (at least 1 byte).
    const auto b0 = static_cast<unsigned char>(s[i]);
    int need = (b0 & 0xE0) == 0xC0 && b0 >= 0xC2 ? 1 : (b0 & 0xF0) == 0xE0 ? 2 : (b0 & 0xF8) == 0xF0 && b0 <= 0xF4 ? 3 : 0;
    size_t j = i + 1;
    for (int k = 0; k < need && j < s.size(); ++k, ++j) {
      const auto b = static_cast<unsigned char>(s[j]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (k == 0) {
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
      }
      if (b < lo || b > hi) break;
    }
    out += "\xEF\xBF\xBD";
    i = j;
  }
  return out;
}

bool is_valid_utf8(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size())
    if (uc::next_utf8(s, pos) < 0) return false;
  return true;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t at = s.find(from, pos);
    if (at == std::string::npos) break;
    out.append(s, pos, at - pos);
    out += to;
    pos = at + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// GPT-2's reversible byte <-> printable character map: bytes that are printable (other than
// space) stand for themselves, the rest map to U+0100 onwards in byte order.
struct ByteMap {
  char32_t to_char[256];
  std::unordered_map<char32_t, uint8_t> to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      to_byte[to_char[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// A pattern of Split / Replace: a literal string or a regex.
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  // Match ranges in byte offsets of s.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    if (regex) {
      const std::u32string u = to_u32(s);
      const auto off = char_offsets(s);
      for (auto [b, e] : regex->find_all(u)) out.emplace_back(off[b], off[e]);
    } else if (!literal.empty()) {
      size_t pos = 0;
      while ((pos = s.find(literal, pos)) != std::string::npos) {
        out.emplace_back(pos, pos + literal.size());
        pos += literal.size();
      }
    }
    return out;
  }
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Splits s by the ranges (the delimiters, or with invert the content) the way HF's
// SplitDelimiterBehavior does; empty pieces are dropped.
std::vector<std::pair<size_t, size_t>> split_ranges(size_t n, const std::vector<std::pair<size_t, size_t>>& matches,
                                                    SplitBehavior behavior, bool invert) {
  // (begin, end, is_match) covering [0, n)
  struct Span {
    size_t b, e;
    bool delim;
  };
  std::vector<Span> spans;
  size_t pos = 0;
  for (auto [b, e] : matches) {
    if (b > pos) spans.push_back({pos, b, invert});
    spans.push_back({b, e, !invert});
    pos = e;
  }
  if (pos < n) spans.push_back({pos, n, invert});

  std::vector<std::pair<size_t, size_t>> out;
  switch (behavior) {
    case SplitBehavior::Removed:
      for (const Span& s : spans)
        if (!s.delim) out.emplace_back(s.b, s.e);
      break;
    case SplitBehavior::Isolated:
      for (const Span& s : spans) out.emplace_back(s.b, s.e);
      break;
    case SplitBehavior::Contiguous: {
      bool prev_delim = false;
      for (const Span& s : spans) {
        if (s.delim && prev_delim && !out.empty() && out.back().second == s.b) out.back().second = s.e;
        else out.emplace_back(s.b, s.e);
        prev_delim = s.delim;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      size_t start = 0;
      bool open = false;
      for (const Span& s : spans) {
        if (!open) start = s.b, open = true;
        if (s.delim) {
          out.emplace_back(start, s.e);
          open = false;
        }
      }
      if (open) out.emplace_back(start, n);
      break;
    }
    case SplitBehavior::MergedWithNext: {
      size_t start = 0;
      bool open = false;
      for (const Span& s : spans) {
        if (s.delim && open) {
          out.emplace_back(start, s.b);
          open = false;
        }
        if (!open) start = s.b, open = true;
      }
      if (open) out.emplace_back(start, n);
      break;
    }
  }
  std::vector<std::pair<size_t, size_t>> nonempty;
  for (auto r : out)
    if (r.second > r.first) nonempty.push_back(r);
  return nonempty;
}

// A piece of the input on its way through the pipeline.
struct Piece {
  std::string text;
  int32_t added_id = -1;  // >= 0: an added token, final
  bool at_start = false;  // begins at offset 0 of the original input (Metaspace "first")
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
  // What is looked for in the text: content, or for a normalized token content normalized,
  // since it is matched after the normalizer.
  std::string match;
};

struct NormalizerStep {
  enum Kind { Prepend, Replace, Strip, Unicode } kind;
  std::string text;     // Prepend: what; Replace: content
  Pattern pattern;      // Replace
  bool left = false, right = false;  // Strip
  uc::NormalForm form = uc::NormalForm::NFC;  // Unicode (NFC, NFD, NFKC, NFKD)
};

struct PreTokenizerStep {
  enum Kind { ByteLevel, Split, Metaspace, Digits, WhitespaceSplit } kind;
  bool add_prefix_space = false, use_regex = true;  // ByteLevel
  Pattern pattern;                                  // Split
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  std::string replacement;                          // Metaspace
  std::string prepend_scheme = "always";
  bool split = true;
  bool individual_digits = false;                   // Digits
};

struct DecoderStep {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind;
  Pattern pattern;
  std::string content;                              // Replace content; Strip char; Metaspace replacement
  int start = 0, stop = 0;                          // Strip
  std::string prepend_scheme = "always";            // Metaspace
};

bool is_byte_token(const std::string& t, uint8_t& byte) {
  // "<0xAB>"
  if (t.size() != 6 || t[0] != '<' || t[1] != '0' || t[2] != 'x' || t[5] != '>') return false;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return false;
  byte = static_cast<uint8_t>(hi * 16 + lo);
  return true;
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  // model (BPE)
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // model vocab and added tokens
  struct Merge {
    int32_t rank, new_id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left << 32 | right) -> rank, merged id
  int32_t unk_id = -1;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  bool byte_level = false;  // a ByteLevel pre-tokenizer maps bytes to characters
  // pipeline
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  bool has_decoder = false;
  // post-processor (single sequence): ids before and after the text
  std::vector<int32_t> prefix_ids, suffix_ids;
  std::string post_processor_problem;  // non-empty: add_special_tokens=true is refused
  std::vector<std::string> component_names;
  bool split_special = false;  // special added tokens' text is encoded as text (set_split_special_tokens)

  [[noreturn]] void fail(const std::string& what) const { throw DataError("tokenizer " + source + ": " + what); }

  // ------------------------------------------------------------------ loading
  Pattern parse_pattern(const json& p, const std::string& where) {
    Pattern out;
    if (p.contains("String")) {
      out.literal = p["String"].get<std::string>();
    } else if (p.contains("Regex")) {
      try {
        out.regex = std::make_shared<Regex>(p["Regex"].get<std::string>());
      } catch (const std::invalid_argument& e) {
        fail(where + ": " + e.what());
      }
    } else {
      fail(where + ": pattern is neither {\"String\": ...} nor {\"Regex\": ...}: " + p.dump());
    }
    return out;
  }

  void load_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = n.value("type", "");
    if (type == "Sequence") {
      for (const json& s : n.at("normalizers")) load_normalizer(s);
      return;
    }
    NormalizerStep step{};
    if (type == "Prepend") {
      step.kind = NormalizerStep::Prepend;
      step.text = n.at("prepend").get<std::string>();
    } else if (type == "Replace") {
      step.kind = NormalizerStep::Replace;
      step.pattern = parse_pattern(n.at("pattern"), "normalizer Replace");
      step.text = n.at("content").get<std::string>();
    } else if (type == "Strip") {
      step.kind = NormalizerStep::Strip;
      step.left = n.value("strip_left", false);
      step.right = n.value("strip_right", false);
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      step.kind = NormalizerStep::Unicode;
      step.form = type == "NFC" ? uc::NormalForm::NFC : type == "NFD" ? uc::NormalForm::NFD
                : type == "NFKC" ? uc::NormalForm::NFKC : uc::NormalForm::NFKD;
    } else {
      fail("normalizer \"" + type +
           "\" is not supported (keel supports NFC, NFD, NFKC, NFKD, Prepend, Replace, Strip and Sequence)");
    }
    component_names.push_back("normalizer " + type);
    normalizer.push_back(std::move(step));
  }

  static SplitBehavior parse_behavior(const std::string& b, Impl& self) {
    if (b == "Removed") return SplitBehavior::Removed;
    if (b == "Isolated") return SplitBehavior::Isolated;
    if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
    if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
    if (b == "Contiguous") return SplitBehavior::Contiguous;
    self.fail("split behavior \"" + b + "\" is unknown");
  }

  void load_pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      for (const json& s : p.at("pretokenizers")) load_pre_tokenizer(s);
      return;
    }
    PreTokenizerStep step{};
    if (type == "ByteLevel") {
      step.kind = PreTokenizerStep::ByteLevel;
      step.add_prefix_space = p.value("add_prefix_space", false);
      step.use_regex = p.value("use_regex", true);
      if (step.use_regex) step.pattern.regex = std::make_shared<Regex>(kGpt2Pattern);
      byte_level = true;
    } else if (type == "Split") {
      step.kind = PreTokenizerStep::Split;
      step.pattern = parse_pattern(p.at("pattern"), "pre-tokenizer Split");
      step.behavior = parse_behavior(p.value("behavior", "Isolated"), *this);
      step.invert = p.value("invert", false);
    } else if (type == "Metaspace") {
      step.kind = PreTokenizerStep::Metaspace;
      step.replacement = p.value("replacement", "\xE2\x96\x81");
      if (p.contains("prepend_scheme")) step.prepend_scheme = p["prepend_scheme"].get<std::string>();
      else step.prepend_scheme = p.value("add_prefix_space", true) ? "always" : "never";
      step.split = p.value("split", true);
      if (step.prepend_scheme != "always" && step.prepend_scheme != "first" && step.prepend_scheme != "never")
        fail("Metaspace prepend_scheme \"" + step.prepend_scheme + "\" is unknown");
    } else if (type == "Digits") {
      step.kind = PreTokenizerStep::Digits;
      step.individual_digits = p.value("individual_digits", false);
    } else if (type == "WhitespaceSplit") {
      step.kind = PreTokenizerStep::WhitespaceSplit;
    } else if (type == "Whitespace") {
      // HF's Whitespace is the split \w+|[^\w\s]+ keeping the matches.
      step.kind = PreTokenizerStep::Split;
      step.pattern.regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)");
      step.behavior = SplitBehavior::Removed;
      step.invert = true;
    } else {
      fail("pre-tokenizer \"" + type +
           "\" is not supported (keel supports ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit and "
           "Sequence)");
    }
    component_names.push_back("pre-tokenizer " + type);
    pre_tokenizer.push_back(std::move(step));
  }

  void load_decoder(const json& d) {
    if (d.is_null()) return;
    has_decoder = true;
    const std::string type = d.value("type", "");
    if (type == "Sequence") {
      for (const json& s : d.at("decoders")) load_decoder(s);
      return;
    }
    DecoderStep step{};
    if (type == "ByteLevel") {
      step.kind = DecoderStep::ByteLevel;
    } else if (type == "Replace") {
      step.kind = DecoderStep::Replace;
      step.pattern = parse_pattern(d.at("pattern"), "decoder Replace");
      step.content = d.at("content").get<std::string>();
    } else if (type == "ByteFallback") {
      step.kind = DecoderStep::ByteFallback;
    } else if (type == "Fuse") {
      step.kind = DecoderStep::Fuse;
    } else if (type == "Strip") {
      step.kind = DecoderStep::Strip;
      step.content = d.at("content").get<std::string>();
      step.start = d.value("start", 0);
      step.stop = d.value("stop", 0);
    } else if (type == "Metaspace") {
      step.kind = DecoderStep::Metaspace;
      step.content = d.value("replacement", "\xE2\x96\x81");
      if (d.contains("prepend_scheme")) step.prepend_scheme = d["prepend_scheme"].get<std::string>();
      else step.prepend_scheme = d.value("add_prefix_space", true) ? "always" : "never";
    } else {
      fail("decoder \"" + type +
           "\" is not supported (keel supports ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequence)");
    }
    decoder.push_back(std::move(step));
  }

  int32_t special_id(const std::string& token, const std::string& where) {
    auto it = vocab.find(token);
    if (it == vocab.end()) fail(where + " names token \"" + token + "\", which is not in the vocabulary");
    return it->second;
  }

  void load_post_processor(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      for (const json& s : p.at("processors")) load_post_processor(s);
      return;
    }
    if (type == "ByteLevel") return;  // only adjusts offsets
    if (type == "TemplateProcessing") {
      const json& single = p.at("single");
      bool seen_sequence = false;
      for (const json& item : single) {
        if (item.contains("Sequence")) {
          seen_sequence = true;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        const json& st = p.at("special_tokens").at(name);
        for (const json& id : st.at("ids")) (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int32_t>());
      }
      return;
    }
    if (type == "BertProcessing" || type == "RobertaProcessing") {
      prefix_ids.push_back(p.at("cls").at(1).get<int32_t>());
      suffix_ids.push_back(p.at("sep").at(1).get<int32_t>());
      return;
    }
    post_processor_problem = "post-processor \"" + type + "\" is not supported";
  }

  void load(const json& doc) {
    const json& model = doc.at("model");
    const std::string type = model.value("type", "BPE");
    if (type != "BPE")
      fail("model type \"" + type + "\" is not supported (keel supports BPE: GPT-2, Llama 2 and Llama 3 style)");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      fail("BPE dropout is not supported");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && !model[key].get<std::string>().empty())
        fail(std::string("BPE ") + key + " is not supported");
    byte_fallback = model.value("byte_fallback", false);
    fuse_unk = model.value("fuse_unk", false);
    ignore_merges = model.value("ignore_merges", false);

    int32_t max_id = -1;
    for (const auto& [token, id] : model.at("vocab").items()) {
      vocab[token] = id.get<int32_t>();
      max_id = std::max(max_id, id.get<int32_t>());
    }
    if (doc.contains("added_tokens")) {
      for (const json& a : doc["added_tokens"]) {
        AddedToken t;
        t.id = a.at("id").get<int32_t>();
        t.content = a.at("content").get<std::string>();
        t.single_word = a.value("single_word", false);
        t.lstrip = a.value("lstrip", false);
        t.rstrip = a.value("rstrip", false);
        t.normalized = a.value("normalized", false);
        t.special = a.value("special", false);
        max_id = std::max(max_id, t.id);
        added_by_id[t.id] = added.size();
        added.push_back(std::move(t));
      }
    }
    id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& [token, id] : vocab) id_to_token[static_cast<size_t>(id)] = token;
    for (const AddedToken& t : added) {
      id_to_token[static_cast<size_t>(t.id)] = t.content;
      vocab.emplace(t.content, t.id);
    }
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      const std::string unk = model["unk_token"].get<std::string>();
      auto it = vocab.find(unk);
      if (it == vocab.end()) fail("unk_token \"" + unk + "\" is not in the vocabulary");
      unk_id = it->second;
    }

    // Merges: "a b" strings (older files) or ["a", "b"] pairs (tokenizers >= 0.20).
    int32_t rank = 0;
    for (const json& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) fail("merge \"" + s + "\" has no space between its two tokens");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
      if (ia == vocab.end() || ib == vocab.end() || im == vocab.end())
        fail("merge \"" + a + " " + b + "\" (rank " + std::to_string(rank) + ") names a token not in the vocabulary");
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) |
                           static_cast<uint32_t>(ib->second);
      merges.emplace(key, Merge{rank, im->second});
      ++rank;
    }

    load_normalizer(doc.value("normalizer", json()));
    // A normalized added token is looked for in normalized text, so as its normalized content;
    // HF also decodes it (and names it) so: "ﬁx" under NFKC is "fix" both ways.
    for (AddedToken& t : added) {
      t.match = t.normalized ? normalize(t.content) : t.content;
      id_to_token[static_cast<size_t>(t.id)] = t.match;
    }
    load_pre_tokenizer(doc.value("pre_tokenizer", json()));
    load_post_processor(doc.value("post_processor", json()));
    load_decoder(doc.value("decoder", json()));
  }

  // ------------------------------------------------------------------ encoding
  std::string normalize(std::string s) const {
    for (const NormalizerStep& n : normalizer) {
      switch (n.kind) {
        case NormalizerStep::Prepend:
          if (!s.empty()) s = n.text + s;
          break;
        case NormalizerStep::Replace:
          if (!n.pattern.regex) {
            replace_all(s, n.pattern.literal, n.text);
          } else {
            std::string out;
            size_t pos = 0;
            for (auto [b, e] : n.pattern.find_all(s)) {
              out.append(s, pos, b - pos);
              out += n.text;
              pos = e;
            }
            out.append(s, pos, std::string::npos);
            s = std::move(out);
          }
          break;
        case NormalizerStep::Strip: {
          const std::u32string u = to_u32(s);
          size_t b = 0, e = u.size();
          if (n.left)
            while (b < e && uc::is_white_space(u[b])) ++b;
          if (n.right)
            while (e > b && uc::is_white_space(u[e - 1])) --e;
          std::string out;
          for (size_t k = b; k < e; ++k) uc::append_utf8(out, u[k]);
          s = std::move(out);
          break;
        }
        case NormalizerStep::Unicode:
          s = uc::normalize(s, n.form);
          break;
      }
    }
    return s;
  }

  static bool is_word_char(char32_t c) {
    return c == '_' || uc::in_mask(uc::category_mask("L") | uc::category_mask("N"), c);
  }

  // The leftmost match in s at or after `from` among `tokens`, the longest at that position,
  // single_word requiring no word character next to it (nullptr: none).
  static const AddedToken* find_added(const std::string& s, size_t from, const std::vector<const AddedToken*>& tokens,
                                      size_t& best_at) {
    best_at = std::string::npos;
    size_t best_len = 0;
    const AddedToken* best = nullptr;
    for (const AddedToken* t : tokens) {
      size_t at = s.find(t->match, from);
      while (at != std::string::npos && t->single_word) {
        // single_word: no word character directly before or after
        const std::u32string before = to_u32(s.substr(0, at)), after = to_u32(s.substr(at + t->match.size()));
        const bool ok = (before.empty() || !is_word_char(before.back())) && (after.empty() || !is_word_char(after.front()));
        if (ok) break;
        at = s.find(t->match, at + 1);
      }
      if (at == std::string::npos) continue;
      if (at < best_at || (at == best_at && t->match.size() > best_len)) {
        best_at = at;
        best_len = t->match.size();
        best = t;
      }
    }
    return best;
  }

  std::vector<const AddedToken*> added_with(bool normalized_tokens) const {
    std::vector<const AddedToken*> tokens;
    for (const AddedToken& t : added)
      if (t.normalized == normalized_tokens && !t.match.empty()) tokens.push_back(&t);
    return tokens;
  }

  // Whether [b, e) overlaps one of `spans` (in order, not overlapping).
  static bool overlaps(const Tokenizer::Spans& spans, size_t b, size_t e) {
    auto it = std::lower_bound(spans.begin(), spans.end(), b, [](const auto& sp, size_t x) { return sp.second <= x; });
    return it != spans.end() && it->first < e;
  }

  // Splits pieces on the added tokens with the given `normalized` flag: the leftmost match, the
  // longest at that position, with lstrip/rstrip swallowing whitespace around it and
  // single_word requiring no word character next to it. `text_spans` (byte ranges of the input,
  // for the first pass, which sees the input as one piece): special tokens overlapping them stay text.
  void split_added(std::vector<Piece>& pieces, bool normalized_tokens, const Tokenizer::Spans* text_spans = nullptr) const {
    const std::vector<const AddedToken*> tokens = added_with(normalized_tokens);
    if (tokens.empty()) return;
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      if (p.added_id >= 0) {
        out.push_back(std::move(p));
        continue;
      }
      const std::string& s = p.text;
      size_t pos = 0;   // start of the text not yet split off
      size_t from = 0;  // where the next match may start: past a special token left as text
      bool first = true;
      while (from <= s.size()) {
        size_t best_at = 0;
        const AddedToken* best = find_added(s, from, tokens, best_at);
        if (!best) break;
        const size_t best_len = best->match.size();
        // split_special: the match stays text, as in HF tokenizers' encode_special_tokens (which
        // skips it after matching among every added token, so no shorter token inside it matches).
        if (best->special && (split_special || (text_spans && overlaps(*text_spans, best_at, best_at + best_len)))) {
          from = best_at + best_len;
          continue;
        }
        size_t b = best_at, e = best_at + best_len;
        if (best->lstrip)
          while (b > pos && (s[b - 1] == ' ' || s[b - 1] == '\t' || s[b - 1] == '\n' || s[b - 1] == '\r')) --b;
        if (best->rstrip)
          while (e < s.size() && (s[e] == ' ' || s[e] == '\t' || s[e] == '\n' || s[e] == '\r')) ++e;
        if (b > pos) out.push_back({s.substr(pos, b - pos), -1, first && p.at_start});
        out.push_back({s.substr(b, e - b), best->id, false});
        first = false;
        pos = from = e;
      }
      if (pos < s.size()) out.push_back({s.substr(pos), -1, first && p.at_start});
    }
    pieces = std::move(out);
  }

  // Tokenizer::special_token_spans: the matches encode_special_tokens would leave as text.
  Tokenizer::Spans special_token_spans(std::string_view text) const {
    Tokenizer::Spans spans;
    const std::string s(text);
    const std::vector<const AddedToken*> tokens = added_with(false);
    size_t at = 0;
    for (size_t from = 0; const AddedToken* t = find_added(s, from, tokens, at); from = at + t->match.size())
      if (t->special) spans.emplace_back(at, at + t->match.size());
    return spans;
  }

  int32_t normalized_special_in(std::string_view text) const {
    std::string n;
    for (const AddedToken* t : added_with(true)) {
      if (!t->special) continue;
      if (n.empty()) n = normalize(std::string(text));
      if (n.find(t->match) != std::string::npos) return t->id;
    }
    return -1;
  }

  std::vector<Piece> pre_tokenize(std::vector<Piece> pieces) const {
    for (const PreTokenizerStep& st : pre_tokenizer) {
      std::vector<Piece> out;
      for (Piece& p : pieces) {
        if (p.added_id >= 0) {
          out.push_back(std::move(p));
          continue;
        }
        std::string s = std::move(p.text);
        std::vector<std::pair<size_t, size_t>> ranges;
        switch (st.kind) {
          case PreTokenizerStep::ByteLevel: {
            if (st.add_prefix_space && (s.empty() || s[0] != ' ')) s = " " + s;
            ranges = st.use_regex ? split_ranges(s.size(), st.pattern.find_all(s), SplitBehavior::Isolated, false)
                                  : std::vector<std::pair<size_t, size_t>>{{0, s.size()}};
            const ByteMap& bm = byte_map();
            bool first = true;
            for (auto [b, e] : ranges) {
              if (e == b) continue;
              std::string mapped;
              for (size_t k = b; k < e; ++k) uc::append_utf8(mapped, bm.to_char[static_cast<uint8_t>(s[k])]);
              out.push_back({std::move(mapped), -1, first && p.at_start});
              first = false;
            }
            continue;
          }
          case PreTokenizerStep::Split:
            ranges = split_ranges(s.size(), st.pattern.find_all(s), st.behavior, st.invert);
            break;
          case PreTokenizerStep::Metaspace: {
            replace_all(s, " ", st.replacement);
            const bool prepend = st.prepend_scheme == "always" || (st.prepend_scheme == "first" && p.at_start);
            if (prepend && s.compare(0, st.replacement.size(), st.replacement) != 0) s = st.replacement + s;
            if (st.split) {
              Pattern rep;
              rep.literal = st.replacement;
              ranges = split_ranges(s.size(), rep.find_all(s), SplitBehavior::MergedWithNext, false);
            } else {
              ranges = {{0, s.size()}};
            }
            break;
          }
          case PreTokenizerStep::Digits:
          case PreTokenizerStep::WhitespaceSplit: {
            const auto off = char_offsets(s);
            const std::u32string u = to_u32(s);
            std::vector<std::pair<size_t, size_t>> matches;
            const uint32_t numeric = uc::category_mask("N");
            for (size_t k = 0; k < u.size(); ++k) {
              const bool hit = st.kind == PreTokenizerStep::Digits ? uc::in_mask(numeric, u[k]) : uc::is_white_space(u[k]);
              if (hit) matches.emplace_back(off[k], off[k + 1]);
            }
            const SplitBehavior bh = st.kind == PreTokenizerStep::WhitespaceSplit ? SplitBehavior::Removed
                                     : st.individual_digits                       ? SplitBehavior::Isolated
                                                                                  : SplitBehavior::Contiguous;
            ranges = split_ranges(s.size(), matches, bh, false);
            break;
          }
        }
        bool first = true;
        for (auto [b, e] : ranges) {
          out.push_back({s.substr(b, e - b), -1, first && p.at_start && b == 0});
          first = false;
        }
      }
      pieces = std::move(out);
    }
    return pieces;
  }

  // BPE of one pre-token.
  void bpe(const std::string& word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges) {
      auto it = vocab.find(word);
      if (it != vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int prev, next;
      size_t len;  // bytes of the word it covers (0: merged away)
    };
    std::vector<Symbol> sym;
    int32_t last_unk = -1;  // index of the previous symbol when it is an unk (fuse_unk)
    size_t pos = 0;
    while (pos < word.size()) {
      const size_t start = pos;
      uc::next_utf8(word, pos);
      const std::string ch = word.substr(start, pos - start);
      auto it = vocab.find(ch);
      if (it != vocab.end()) {
        sym.push_back({it->second, 0, 0, ch.size()});
        last_unk = -1;
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : ch) {
          char name[8];
          std::snprintf(name, sizeof name, "<0x%02X>", b);
          auto bt = vocab.find(name);
          if (bt == vocab.end()) break;
          bytes.push_back(bt->second);
        }
        if (bytes.size() == ch.size()) {
          for (int32_t b : bytes) sym.push_back({b, 0, 0, 1});
          last_unk = -1;
          continue;
        }
      }
      if (unk_id >= 0) {
        if (fuse_unk && last_unk >= 0) {
          sym[static_cast<size_t>(last_unk)].len += ch.size();
        } else {
          sym.push_back({unk_id, 0, 0, ch.size()});
          last_unk = static_cast<int32_t>(sym.size()) - 1;
        }
      }
      // without an unk token the character is dropped, as HF does
    }
    const int n = static_cast<int>(sym.size());
    for (int k = 0; k < n; ++k) {
      sym[static_cast<size_t>(k)].prev = k - 1;
      sym[static_cast<size_t>(k)].next = k + 1 < n ? k + 1 : -1;
    }
    auto find_merge = [&](int32_t a, int32_t b) -> const Merge* {
      auto it = merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
      return it == merges.end() ? nullptr : &it->second;
    };
    // Lowest rank first; among equal ranks the leftmost.
    struct Cand {
      int32_t rank;
      int pos;
      int32_t new_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue;
    for (int k = 0; k + 1 < n; ++k)
      if (const Merge* m = find_merge(sym[static_cast<size_t>(k)].id, sym[static_cast<size_t>(k + 1)].id))
        queue.push({m->rank, k, m->new_id});
    while (!queue.empty()) {
      const Cand c = queue.top();
      queue.pop();
      Symbol& left = sym[static_cast<size_t>(c.pos)];
      if (left.len == 0 || left.next < 0) continue;
      Symbol& right = sym[static_cast<size_t>(left.next)];
      const Merge* m = find_merge(left.id, right.id);
      if (!m || m->rank != c.rank || m->new_id != c.new_id) continue;  // stale entry
      left.id = c.new_id;
      left.len += right.len;
      right.len = 0;
      left.next = right.next;
      if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = c.pos;
      if (left.prev >= 0)
        if (const Merge* pm = find_merge(sym[static_cast<size_t>(left.prev)].id, left.id))
          queue.push({pm->rank, left.prev, pm->new_id});
      if (left.next >= 0)
        if (const Merge* nm = find_merge(left.id, sym[static_cast<size_t>(left.next)].id))
          queue.push({nm->rank, c.pos, nm->new_id});
    }
    for (int k = n > 0 ? 0 : -1; k >= 0; k = sym[static_cast<size_t>(k)].next) ids.push_back(sym[static_cast<size_t>(k)].id);
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens, const Tokenizer::Spans* text_spans = nullptr) const {
    if (!is_valid_utf8(text)) {
      size_t pos = 0;
      while (pos < text.size()) {
        const size_t at = pos;
        if (uc::next_utf8(text, pos) < 0)
          throw DataError("cannot tokenize: the text is not valid UTF-8 (bad byte sequence at byte " + std::to_string(at) + ")");
      }
    }
    if (add_special_tokens && !post_processor_problem.empty())
      fail(post_processor_problem + ", so special tokens cannot be added (encode without them)");
    std::vector<Piece> pieces{{std::string(text), -1, true}};
    split_added(pieces, false, text_spans);  // one piece: its bytes are the input's, as text_spans counts them
    for (Piece& p : pieces)
      if (p.added_id < 0) p.text = normalize(std::move(p.text));
    split_added(pieces, true);
    pieces = pre_tokenize(std::move(pieces));
    std::vector<int32_t> ids;
    if (add_special_tokens) ids = prefix_ids;
    for (const Piece& p : pieces) {
      if (p.added_id >= 0) ids.push_back(p.added_id);
      else bpe(p.text, ids);
    }
    if (add_special_tokens) ids.insert(ids.end(), suffix_ids.begin(), suffix_ids.end());
    return ids;
  }

  // ------------------------------------------------------------------ decoding
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    std::vector<std::string> tokens;
    for (int32_t id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= id_to_token.size()) continue;
      auto a = added_by_id.find(id);
      if (a != added_by_id.end() && skip_special && added[a->second].special) continue;
      const std::string& t = id_to_token[static_cast<size_t>(id)];
      if (t.empty() && a == added_by_id.end() && !vocab.count(t)) continue;
      tokens.push_back(t);
    }
    if (!has_decoder) {
      std::string out;
      for (size_t k = 0; k < tokens.size(); ++k) out += (k ? " " : "") + tokens[k];
      return out;
    }
    for (const DecoderStep& d : decoder) {
      switch (d.kind) {
        case DecoderStep::ByteLevel: {
          const ByteMap& bm = byte_map();
          std::string bytes;
          for (const std::string& t : tokens) {
            size_t pos = 0;
            while (pos < t.size()) {
              const size_t start = pos;
              const int32_t c = uc::next_utf8(t, pos);
              auto it = c < 0 ? bm.to_byte.end() : bm.to_byte.find(static_cast<char32_t>(c));
              if (it != bm.to_byte.end()) bytes += static_cast<char>(it->second);
              else bytes.append(t, start, pos - start);  // not a byte character: kept as it is
            }
          }
          tokens = {utf8_lossy(bytes)};
          break;
        }
        case DecoderStep::Replace:
          for (std::string& t : tokens) {
            if (!d.pattern.regex) {
              replace_all(t, d.pattern.literal, d.content);
            } else {
              std::string out;
              size_t pos = 0;
              for (auto [b, e] : d.pattern.find_all(t)) {
                out.append(t, pos, b - pos);
                out += d.content;
                pos = e;
              }
              out.append(t, pos, std::string::npos);
              t = std::move(out);
            }
          }
          break;
        case DecoderStep::ByteFallback: {
          // Runs of <0xXX> tokens become the text their bytes spell, or one U+FFFD per byte
          // when the bytes are not valid UTF-8.
          std::vector<std::string> out;
          std::string pending;
          size_t pending_n = 0;
          auto flush = [&]() {
            if (pending_n == 0) return;
            if (is_valid_utf8(pending)) {
              out.push_back(pending);
            } else {
              for (size_t k = 0; k < pending_n; ++k) out.push_back("\xEF\xBF\xBD");
            }
            pending.clear();
            pending_n = 0;
          };
          for (std::string& t : tokens) {
            uint8_t b;
            if (is_byte_token(t, b)) {
              pending += static_cast<char>(b);
              ++pending_n;
            } else {
              flush();
              out.push_back(std::move(t));
            }
          }
          flush();
          tokens = std::move(out);
          break;
        }
        case DecoderStep::Fuse: {
          std::string all;
          for (const std::string& t : tokens) all += t;
          tokens = {all};
          break;
        }
        case DecoderStep::Strip:
          for (std::string& t : tokens) {
            std::u32string u = to_u32(t);
            const char32_t c = to_u32(d.content).empty() ? U' ' : to_u32(d.content)[0];
            size_t b = 0, e = u.size();
            for (int k = 0; k < d.start && b < e && u[b] == c; ++k) ++b;
            for (int k = 0; k < d.stop && e > b && u[e - 1] == c; ++k) --e;
            std::string out;
            for (size_t k = b; k < e; ++k) uc::append_utf8(out, u[k]);
            t = std::move(out);
          }
          break;
        case DecoderStep::Metaspace:
          for (size_t k = 0; k < tokens.size(); ++k) {
            replace_all(tokens[k], d.content, " ");
            if (k == 0 && d.prepend_scheme != "never" && !tokens[k].empty() && tokens[k][0] == ' ')
              tokens[k].erase(0, 1);
          }
          break;
      }
    }
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  Tokenizer t;
  t.impl_->source = source;
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    throw DataError("tokenizer " + source + " is not valid JSON: " + e.what());
  }
  try {
    t.impl_->load(doc);
  } catch (const json::exception& e) {
    throw DataError("tokenizer " + source + " is malformed: " + e.what());
  } catch (const std::invalid_argument& e) {
    throw DataError("tokenizer " + source + ": " + e.what());
  }
  return t;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json(detail::read_file(path, "tokenizer"), path);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

Tokenizer::Spans Tokenizer::special_token_spans(std::string_view text) const { return impl_->special_token_spans(text); }
int32_t Tokenizer::normalized_special_in(std::string_view text) const { return impl_->normalized_special_in(text); }

std::vector<int32_t> Tokenizer::encode_with_text_spans(std::string_view text, const Spans& text_spans,
                                                       bool add_special_tokens) const {
  for (size_t k = 0; k < text_spans.size(); ++k)
    if (text_spans[k].first > text_spans[k].second || text_spans[k].second > text.size() ||
        (k > 0 && text_spans[k].first < text_spans[k - 1].second))
      throw std::invalid_argument("encode_with_text_spans: the spans must be in order, not overlapping, inside the text");
  return impl_->encode(text, add_special_tokens, &text_spans);
}

Tokenizer::Joined Tokenizer::encode_joined(std::string_view first, std::string_view second,
                                           bool add_special_tokens) const {
  std::string text;
  text.reserve(first.size() + second.size());
  text.append(first).append(second);
  Joined j;
  j.ids = encode(text, add_special_tokens);
  const std::vector<int32_t> alone = encode(first, add_special_tokens);
  const size_t n = std::min(alone.size(), j.ids.size());
  while (j.split < n && alone[j.split] == j.ids[j.split]) ++j.split;
  return j;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) return "";
  return impl_->id_to_token[static_cast<size_t>(id)];
}

void Tokenizer::set_split_special_tokens(bool on) { impl_->split_special = on; }
int32_t Tokenizer::unk_id() const { return impl_->unk_id; }
bool Tokenizer::split_special_tokens() const { return impl_->split_special; }

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

std::string Tokenizer::describe() const {
  std::string kind = impl_->byte_level ? "byte-level BPE" : impl_->byte_fallback ? "BPE with byte fallback" : "BPE";
  std::string s = kind + ", " + std::to_string(vocab_size()) + " ids (" + std::to_string(impl_->added.size()) +
                  " added tokens)";
  for (const auto& c : impl_->component_names) s += ", " + c;
  return s;
}

}  // namespace keel::data
