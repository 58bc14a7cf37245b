// A small backtracking regex engine for tokenizer pre-tokenization patterns (the "Split"
// regexes of HF tokenizer.json files: GPT-2, Llama 3, Qwen, ...). Semantics follow
// Oniguruma, the engine HF tokenizers uses: Perl-style ordered alternation, greedy / lazy /
// possessive quantifiers with backtracking, Unicode classes.
//
// Supported: literals and escapes (\n \r \t \f \v \e \xHH \x{H..} \uHHHH, escaped punctuation),
// . (not \n), [...] and [^...] with ranges, \s \S \d \D \w \W \p{..} \P{..} (general categories
// and their one-letter groups), groups (...) (?:...) (?i:...) (?-i:...) (?i) (?>...), lookahead
// (?=...) (?!...), quantifiers * + ? {m} {m,} {m,n} with lazy (?) and possessive (+) forms,
// anchors ^ $ \A \z \Z. Anything else (lookbehind, backreferences, \b, POSIX classes) is
// rejected with an error naming it, never silently mis-matched.
//
// Matching works on code points; the patterns keel meets match every character class they use
// in one step, so repeats of a single character class run without recursion.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::data {

class Regex {
 public:
  // Throws std::invalid_argument naming the pattern and the unsupported or malformed part.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The leftmost match starting at or after `from`: [begin, end) in code points; false if none.
  // Empty matches are skipped (a tokenizer split never produces an empty piece).
  bool search(const std::u32string& text, size_t from, size_t& begin, size_t& end) const;
  // Every non-overlapping non-empty match, left to right.
  std::vector<std::pair<size_t, size_t>> find_all(const std::u32string& text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::data
