// Documents of a raw text corpus, read the way scripts/prepare_data.py reads them, so that
// keel tokenize and the script find the same documents (keel tokenize: data/tokenize_corpus.h).
//
//   JSON lines   one JSON object per line (\n, \r\n or \r end a line; blank lines are skipped);
//                a document is obj[text_key] when it is a string with more than whitespace.
//                Records whose field is missing or not a string are counted as skipped.
//   prompt/response pairs   JSON lines whose prompt and response are strings, the response
//                not blank (instruction data: the prompt leaves the loss).
//   conversations   JSON lines whose messages field is a list of {"role": ..., "content": ...}
//                objects, or ShareGPT's {"from": ..., "value": ...} (chat data, rendered by the
//                model's chat template: data/chat_template.h);
//                a record without the field is skipped, one whose field is not such a list is
//                an error naming the file and line.
//   plain text   one document per file, per paragraph (split at a newline, any whitespace,
//                a newline: Python's re.split(r"\n\s*\n")) or per line; \r\n becomes \n;
//                each piece loses its leading and trailing newlines and trailing whitespace
//                and is kept when something other than whitespace is left.
// Invalid UTF-8 becomes U+FFFD (Python's errors="replace"); "whitespace" is Python's
// str.isspace() (unicode::is_python_space).
//
// JSON lines stay in their memory-mapped files: the corpus keeps where each record is and
// parses it again when document(i) is asked for, so a corpus larger than memory works.
// Plain text files are read into memory.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/file_io.h"

namespace keel::data {

enum class DocSplit { file, paragraph, line };

struct Document {
  std::string text;      // the document, the prompt of a pair, or a conversation's whole JSON record
  std::string response;  // pairs only
};

class Corpus {
 public:
  // Throw DataError naming the file (and line) that cannot be read or is not JSON.
  // `threads` parse JSON lines in parallel (the result does not depend on it).
  static Corpus jsonl(const std::vector<std::string>& files, const std::string& text_key, int threads);
  static Corpus jsonl_pairs(const std::vector<std::string>& files, const std::string& prompt_key,
                            const std::string& response_key, int threads);
  // Conversations: the messages are in the first of `messages_keys` a record has.
  static Corpus jsonl_chat(const std::vector<std::string>& files, const std::vector<std::string>& messages_keys, int threads);
  static Corpus text(const std::vector<std::string>& files, DocSplit split);

  size_t size() const { return docs_.size(); }
  bool pairs() const { return mode_ == Mode::pairs; }
  bool conversations() const { return mode_ == Mode::chat; }
  // Document i, in the order of the files and of the records in them. Safe to call from
  // several threads at once.
  Document document(size_t i) const;
  // Where document i comes from, for messages: "file:line" (JSON lines) or "file" (text).
  std::string where(size_t i) const;

  // Code points of all documents (pairs: both parts; conversations: the messages' string contents).
  int64_t characters() const { return characters_; }
  int64_t skipped_records() const { return skipped_; }  // JSON records without the field(s)
  int64_t files_with_bad_utf8() const { return bad_utf8_files_; }
  // Where the first invalid UTF-8 is ("file:line", or "file" for text); empty when there is none.
  const std::string& first_bad_utf8() const { return first_bad_utf8_; }

 private:
  Corpus() = default;
  enum class Mode { text, pairs, chat };
  static Corpus read_jsonl(const std::vector<std::string>& files, const std::string& key1, const std::string& key2,
                           Mode mode, int threads, const std::vector<std::string>& messages_keys = {});

  struct Span {
    uint32_t source;  // index into files_ (JSON lines) or texts_ (plain text)
    uint64_t line;    // 1-based line of a JSON record (for messages)
    int64_t offset, size;
  };
  Mode mode_ = Mode::text;
  bool json_ = false;
  std::string key1_, key2_;  // text key, or prompt and response keys
  std::vector<detail::MappedFile> files_;
  std::vector<std::string> texts_, text_names_;
  std::vector<Span> docs_;
  int64_t characters_ = 0, skipped_ = 0, bad_utf8_files_ = 0;
  std::string first_bad_utf8_;
};

// Python's str.strip() / lstrip() / rstrip() of whitespace (unicode::is_python_space) on
// valid UTF-8.
std::string_view python_strip(std::string_view s);
std::string_view python_lstrip(std::string_view s);
std::string_view python_rstrip(std::string_view s);
// The pieces re.split(r"\n\s*\n", text) returns (Python's \s: is_python_space).
std::vector<std::string_view> split_paragraphs(std::string_view text);

}  // namespace keel::data
