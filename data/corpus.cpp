#include "data/corpus.h"

#include <algorithm>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/token_file.h"
#include "data/unicode.h"

namespace keel::data {

namespace uc = unicode;
namespace fs = std::filesystem;
using detail::quoted;

namespace {

// The code point that ends at s[end - 1] and where it starts (s is valid UTF-8).
char32_t last_code_point(std::string_view s, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  size_t pos = start;
  return static_cast<char32_t>(uc::next_utf8(s, pos));
}

int64_t count_code_points(std::string_view s) {
  int64_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// prepare_data.py's add_doc: strip("\n"), then rstrip(); kept when strip() leaves something.
std::string_view trim_document(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  s = python_rstrip(s);
  return python_strip(s).empty() ? std::string_view() : s;
}

// One line of a JSON-lines file as Python reads it: invalid UTF-8 replaced (into `storage`),
// whitespace stripped. The result points into `raw` or `storage`.
std::string_view clean_line(std::string_view raw, std::string& storage) {
  if (uc::is_valid_utf8(raw)) return python_strip(raw);
  storage = uc::replace_invalid_utf8(raw);
  return python_strip(storage);
}

const nlohmann::json* string_field(const nlohmann::json& obj, const std::string& key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? &*it : nullptr;
}

// Why `messages` is not a conversation ("" when it is one); counts its content's code points.
std::string conversation_problem(const nlohmann::json& messages, int64_t& chars) {
  if (!messages.is_array()) return std::string("must be a list of messages, not ") + messages.type_name();
  if (messages.empty()) return "is an empty list";
  for (size_t m = 0; m < messages.size(); ++m) {
    const nlohmann::json& msg = messages[m];
    const bool sharegpt = msg.is_object() && !msg.contains("role") && msg.contains("from");
    const char* role = sharegpt ? "from" : "role";
    const char* content = sharegpt ? "value" : "content";
    if (!msg.is_object() || !msg.contains(role) || !msg[role].is_string())
      return "item " + std::to_string(m) + " is not a message: expected an object with a string \"role\" (or ShareGPT's \"from\")";
    if (msg.contains(content) && msg[content].is_string()) chars += count_code_points(msg[content].get_ref<const std::string&>());
  }
  return "";
}

}  // namespace

std::string_view python_strip(std::string_view s) { return python_rstrip(python_lstrip(s)); }

std::string_view python_lstrip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    size_t pos = b;
    if (!uc::is_python_space(static_cast<char32_t>(uc::next_utf8(s, pos)))) break;
    b = pos;
  }
  return s.substr(b);
}

std::string_view python_rstrip(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    size_t start = 0;
    if (!uc::is_python_space(last_code_point(s, e, start))) break;
    e = start;
  }
  return s.substr(0, e);
}

std::vector<std::string_view> split_paragraphs(std::string_view text) {
  // At each "\n", the separator runs to the last "\n" of the whitespace that follows it (the
  // greedy \s* backing off to a "\n"); with no "\n" in that run there is no separator here.
  std::vector<std::string_view> out;
  size_t piece = 0, i = 0;
  while (i < text.size()) {
    if (text[i] != '\n') {
      ++i;
      continue;
    }
    size_t j = i + 1, last_newline = std::string_view::npos;
    while (j < text.size()) {
      size_t pos = j;
      const int32_t c = uc::next_utf8(text, pos);
      if (c < 0 || !uc::is_python_space(static_cast<char32_t>(c))) break;
      if (c == '\n') last_newline = j;
      j = pos;
    }
    if (last_newline == std::string_view::npos) {
      ++i;
      continue;
    }
    out.push_back(text.substr(piece, i - piece));
    piece = i = last_newline + 1;
  }
  out.push_back(text.substr(piece));
  return out;
}

Corpus Corpus::jsonl(const std::vector<std::string>& files, const std::string& text_key, int threads) {
  return read_jsonl(files, text_key, "", Mode::text, threads);
}

Corpus Corpus::jsonl_pairs(const std::vector<std::string>& files, const std::string& prompt_key,
                           const std::string& response_key, int threads) {
  return read_jsonl(files, prompt_key, response_key, Mode::pairs, threads);
}

Corpus Corpus::jsonl_chat(const std::vector<std::string>& files, const std::vector<std::string>& messages_keys, int threads) {
  return read_jsonl(files, "", "", Mode::chat, threads, messages_keys);
}

Corpus Corpus::read_jsonl(const std::vector<std::string>& files, const std::string& key1, const std::string& key2,
                          Mode mode, int threads, const std::vector<std::string>& messages_keys) {
  Corpus c;
  c.json_ = true;
  c.mode_ = mode;
  const bool pairs = mode == Mode::pairs;
  c.key1_ = key1;
  c.key2_ = key2;
  // Every non-blank line, in order. A line ends at \n, \r\n or \r (Python's universal newlines).
  std::vector<Span> lines;
  for (size_t f = 0; f < files.size(); ++f) {
    std::error_code ec;
    const auto bytes = fs::file_size(files[f], ec);
    if (!ec && bytes == 0 && fs::is_regular_file(files[f])) {
      c.files_.emplace_back();  // an empty file holds no records
      continue;
    }
    c.files_.push_back(detail::MappedFile::open(files[f], "JSON-lines file"));
    const std::string_view all(reinterpret_cast<const char*>(c.files_.back().data()),
                               static_cast<size_t>(c.files_.back().size()));
    uint64_t line = 0;
    for (size_t pos = 0; pos < all.size();) {
      size_t end = all.find_first_of("\r\n", pos);
      if (end == std::string_view::npos) end = all.size();
      ++line;
      if (end > pos) lines.push_back({static_cast<uint32_t>(f), line, static_cast<int64_t>(pos), static_cast<int64_t>(end - pos)});
      pos = end + 1;
      if (end + 1 < all.size() && all[end] == '\r' && all[end + 1] == '\n') ++pos;
    }
  }

  // Parse in parallel: each thread a contiguous range of lines; the results are merged in order.
  enum : uint8_t { kBlank, kSkipped, kDocument };
  std::vector<uint8_t> kind(lines.size(), kBlank);
  std::vector<int64_t> chars(lines.size(), 0);
  std::vector<uint8_t> bad_utf8(lines.size(), 0);
  const size_t nthreads = std::clamp<size_t>(threads > 0 ? static_cast<size_t>(threads) : 1, 1,
                                             std::max<size_t>(1, lines.size() / 1024));
  std::vector<std::string> errors(nthreads);
  auto parse_range = [&](size_t t) {
    const size_t begin = lines.size() * t / nthreads, end = lines.size() * (t + 1) / nthreads;
    for (size_t k = begin; k < end; ++k) {
      const Span& s = lines[k];
      const auto* data = reinterpret_cast<const char*>(c.files_[s.source].data()) + s.offset;
      std::string storage;
      const std::string_view line = clean_line(std::string_view(data, static_cast<size_t>(s.size)), storage);
      bad_utf8[k] = !storage.empty();  // storage holds the repaired line only when there was something to repair
      if (line.empty()) continue;
      nlohmann::json obj;
      try {
        obj = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        errors[t] = files[s.source] + ":" + std::to_string(s.line) + ": invalid JSON (" + e.what() + ")";
        return;
      }
      if (mode == Mode::chat) {
        auto it = obj.end();
        std::string key;
        for (const std::string& name : messages_keys)
          if (it == obj.end() && obj.is_object() && (it = obj.find(name)) != obj.end()) key = name;
        if (it == obj.end()) {
          kind[k] = kSkipped;
          continue;
        }
        int64_t n = 0;
        if (const std::string problem = conversation_problem(*it, n); !problem.empty()) {
          errors[t] = files[s.source] + ":" + std::to_string(s.line) + ": " + detail::quoted(key) + " " + problem;
          return;
        }
        kind[k] = kDocument;
        chars[k] = n;
        continue;
      }
      const nlohmann::json* a = string_field(obj, key1);
      const nlohmann::json* b = pairs ? string_field(obj, key2) : nullptr;
      if (!a || (pairs && (!b || python_strip(b->get_ref<const std::string&>()).empty()))) {
        kind[k] = kSkipped;
        continue;
      }
      const std::string& text = a->get_ref<const std::string&>();
      if (!pairs && python_strip(text).empty()) continue;  // a blank document: dropped, not counted
      kind[k] = kDocument;
      chars[k] = count_code_points(text) + (pairs ? count_code_points(b->get_ref<const std::string&>()) : 0);
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < nthreads; ++t) pool.emplace_back(parse_range, t);
  parse_range(0);
  for (auto& th : pool) th.join();
  for (const std::string& e : errors)
    if (!e.empty()) throw DataError(e);  // the first bad line in file order

  for (size_t k = 0; k < lines.size(); ++k) {
    c.skipped_ += kind[k] == kSkipped;
    if (kind[k] != kDocument) continue;
    c.docs_.push_back(lines[k]);
    c.characters_ += chars[k];
  }
  // Line ends are ASCII, so every invalid byte sits in some line: a file is bad if a line is.
  std::vector<uint8_t> file_bad(c.files_.size(), 0);
  for (size_t k = 0; k < lines.size(); ++k) {
    file_bad[lines[k].source] |= bad_utf8[k];
    if (bad_utf8[k] && c.first_bad_utf8_.empty())
      c.first_bad_utf8_ = files[lines[k].source] + ":" + std::to_string(lines[k].line);
  }
  for (uint8_t b : file_bad) c.bad_utf8_files_ += b;
  return c;
}

Corpus Corpus::text(const std::vector<std::string>& files, DocSplit split) {
  Corpus c;
  for (const std::string& path : files) {
    std::string text = detail::read_file(path, "text file");
    if (!uc::is_valid_utf8(text)) {
      text = uc::replace_invalid_utf8(text);
      ++c.bad_utf8_files_;
      if (c.first_bad_utf8_.empty()) c.first_bad_utf8_ = path;
    }
    std::string unix_text;  // \r\n -> \n
    unix_text.reserve(text.size());
    for (size_t k = 0; k < text.size(); ++k)
      if (!(text[k] == '\r' && k + 1 < text.size() && text[k + 1] == '\n')) unix_text += text[k];
    c.texts_.push_back(std::move(unix_text));
    c.text_names_.push_back(path);
    const std::string_view all = c.texts_.back();
    const auto source = static_cast<uint32_t>(c.texts_.size() - 1);

    auto add = [&](std::string_view piece) {
      const std::string_view doc = trim_document(piece);
      if (doc.empty()) return;
      c.docs_.push_back({source, 0, static_cast<int64_t>(doc.data() - all.data()), static_cast<int64_t>(doc.size())});
      c.characters_ += count_code_points(doc);
    };
    if (split == DocSplit::file) {
      add(all);
    } else if (split == DocSplit::paragraph) {
      for (std::string_view p : split_paragraphs(all)) add(p);
    } else {
      for (size_t pos = 0;;) {
        const size_t end = all.find('\n', pos);
        add(all.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos));
        if (end == std::string_view::npos) break;
        pos = end + 1;
      }
    }
  }
  return c;
}

std::string Corpus::where(size_t i) const {
  const Span& s = docs_.at(i);
  if (!json_) return text_names_.at(s.source);
  return files_.at(s.source).path() + ":" + std::to_string(s.line);
}

Document Corpus::document(size_t i) const {
  const Span& s = docs_.at(i);
  if (!json_) return {texts_[s.source].substr(static_cast<size_t>(s.offset), static_cast<size_t>(s.size)), {}};
  const auto* data = reinterpret_cast<const char*>(files_[s.source].data()) + s.offset;
  std::string storage;
  const std::string_view line = clean_line(std::string_view(data, static_cast<size_t>(s.size)), storage);
  Document d;
  if (mode_ == Mode::chat) {  // the whole record: the chat template may use more than the messages (tools)
    d.text = std::string(line);
    return d;
  }
  const nlohmann::json obj = nlohmann::json::parse(line);  // parsed once already when the corpus was read: cannot fail
  d.text = obj.at(key1_).get<std::string>();
  if (mode_ == Mode::pairs) d.response = obj.at(key2_).get<std::string>();
  return d;
}

}  // namespace keel::data
