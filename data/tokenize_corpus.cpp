#include "data/tokenize_corpus.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/checksum.h"
#include "data/file_io.h"
#include "data/loss_mask.h"
#include "data/python_random.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

namespace keel::data {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::quoted;

namespace {

// For "no documents found" in JSONL: the keys the first record has, and the option that reads
// such records (a chat file without --chat, pairs without --loss-mask prompt).
std::string first_record_hint(const TokenizeOptions& o) {
  if (o.jsonl.empty()) return {};
  std::ifstream in(o.jsonl.front());
  std::string line;
  while (std::getline(in, line) && line.find_first_not_of(" \t\r") == std::string::npos) {
  }
  const nlohmann::json rec = nlohmann::json::parse(line, nullptr, false);
  if (!rec.is_object()) return {};
  std::string keys;
  for (const auto& [k, v] : rec.items()) keys += (keys.empty() ? "" : ", ") + quoted(k);
  std::string hint = "; the first record of " + o.jsonl.front() + " has " + (keys.empty() ? "no keys" : keys);
  if (!o.chat && (rec.contains("messages") || rec.contains("conversations")))
    hint += ": conversations, which --chat renders with the model's chat template";
  else if (!o.prompt_loss_mask && !o.chat && rec.contains(o.prompt_key) && rec.contains(o.response_key))
    hint += ": prompt/response pairs, which --loss-mask prompt reads";
  return hint;
}


// Token files of an earlier run in `out` (both formats), replaced by a successful run.
bool is_token_output_name(const std::string& name) {
  static const std::regex re(R"((train|val)(_\d{3,})?\.(bin|idx|mask))");
  return std::regex_match(name, re);
}

int32_t end_of_text_id(const Tokenizer& tok, const std::string& requested, std::string& chosen) {
  if (!requested.empty()) {
    if (auto id = tok.token_to_id(requested)) return chosen = requested, *id;
    throw std::invalid_argument("--eot-token: the tokenizer has no token " + quoted(requested));
  }
  std::string names;
  for (const char* t : kEndOfTextTokens) {  // the first the tokenizer has
    if (auto id = tok.token_to_id(t)) return chosen = t, *id;
    names += (names.empty() ? "" : ", ") + std::string(t);
  }
  throw std::invalid_argument("the tokenizer has none of the end-of-text tokens " + names + ": pass --eot-token");
}

// Shards below this many tokens get a warning when a split has several: windows never cross a
// file, so each shard loses up to a window's worth of tokens.
constexpr int64_t kSmallShard = 65536;

// Masked outputs: prompt/response pairs, or conversations with the assistant mask.
bool masked(const TokenizeOptions& o) { return o.prompt_loss_mask || (o.chat && o.assistant_loss_mask); }
// Mask sidecars are written for masked outputs, and for packed ones (their padding is out of the loss).
bool writes_masks(const TokenizeOptions& o) { return masked(o) || o.pack > 0; }

PackOverflow pack_overflow_of(const TokenizeOptions& o) {
  if (o.pack_overflow) return *o.pack_overflow;
  return o.chat || o.prompt_loss_mask ? PackOverflow::drop : PackOverflow::split;
}

struct Encoded {
  std::vector<uint32_t> ids;  // document (prompt + response, or a conversation) and the end of text
  size_t prompt = 0;          // pairs: leading tokens out of the loss
  std::vector<uint8_t> mask;  // conversations: per token, 1 = in the loss
  int64_t unplaced_replies = 0, weight0_replies = 0;
  int32_t special_in_text = -1;  // a special token the document's text was encoded to (-1: none)
};

// Where conversations are read from: --messages-key, and by default also ShareGPT's field.
std::vector<std::string> messages_keys(const TokenizeOptions& o) {
  if (o.messages_key == "messages") return {"messages", "conversations"};
  return {o.messages_key};
}

// One split's token files in the staging folder: llm.c shards of at most shard_tokens (a
// document may straddle two), or one Megatron dataset, or packed shards of whole windows; and
// the loss-mask sidecars.
class SplitWriter {
 public:
  SplitWriter(const fs::path& dir, std::string prefix, const TokenizeOptions& o, bool u32, uint32_t eot, TokenizedSplit& out)
      : dir_(dir), prefix_(std::move(prefix)), o_(o), u32_(u32), eot_(eot), out_(out) {
    if (o.format == TokenOutputFormat::megatron)
      megatron_ = std::make_unique<MegatronDatasetWriter>((dir_ / prefix_).string(),
                                                          u32 ? MegatronDtype::int32 : MegatronDtype::uint16);
  }

  void add(const Encoded& e) {
    out_.unplaced_replies += e.unplaced_replies;
    out_.weight0_replies += e.weight0_replies;
    if (e.special_in_text >= 0) {
      ++out_.special_text_documents;
      if (out_.special_text_tokens.size() < 6) out_.special_text_tokens.insert(e.special_in_text);  // 5 shown, and "..."
    }
    if (o_.chat && o_.assistant_loss_mask) out_.without_replies += std::count(e.mask.begin(), e.mask.end(), uint8_t{1}) == 0;
    if (o_.chat && e.ids.size() > 1) out_.eot_inside_conversations += std::find(e.ids.begin(), e.ids.end() - 1, eot_) != e.ids.end() - 1;
    if (o_.pack > 0) return pack(e);
    ++out_.documents;
    out_.tokens += static_cast<int64_t>(e.ids.size());
    if (masked(o_)) {
      const std::vector<uint8_t> m = mask_of(e);
      mask_.insert(mask_.end(), m.begin(), m.end());
      out_.in_loss += std::count(m.begin(), m.end(), uint8_t{1});
    }
    if (megatron_) {
      megatron_->add_document(e.ids.data(), e.ids.size());
      return;
    }
    tokens_.insert(tokens_.end(), e.ids.begin(), e.ids.end());
    while (static_cast<int64_t>(tokens_.size()) >= o_.shard_tokens) flush(static_cast<size_t>(o_.shard_tokens));
  }

  void close() {
    if (megatron_) {
      megatron_->close();
      out_.files.push_back(prefix_ + ".bin");
      out_.files.push_back(prefix_ + ".idx");
      if (masked(o_)) write_loss_mask((dir_ / (prefix_ + ".mask")).string(), mask_);
      return;
    }
    if (o_.pack > 0) {
      pack_pool();
      if (windows_pending_ > 0) flush_windows();  // none when every document was dropped: no file
    } else if (!tokens_.empty() || out_.files.empty()) {
      flush(tokens_.size());
    }
    widen_names();
  }

 private:
  // Per token, 1 = in the loss as a target.
  std::vector<uint8_t> mask_of(const Encoded& e) const {
    if (o_.chat && o_.assistant_loss_mask) return e.mask;
    std::vector<uint8_t> m(e.ids.size(), 1);
    if (o_.prompt_loss_mask) std::fill_n(m.begin(), e.prompt, uint8_t{0});
    return m;
  }

  // ---- packing: documents gather in a pool of about one shard; the pool is packed into windows ----
  struct Piece {
    std::vector<uint32_t> ids;
    std::vector<uint8_t> mask;
  };

  int64_t window_tokens() const { return o_.pack; }
  int64_t windows_per_shard() const { return (o_.shard_tokens - 1) / o_.pack; }

  void pack(const Encoded& e) {
    const int64_t T = window_tokens(), n = static_cast<int64_t>(e.ids.size());
    std::vector<uint8_t> m = mask_of(e);
    if (n <= T) {
      ++out_.documents;
      add_piece({e.ids, std::move(m)});
      return;
    }
    ++out_.long_documents;
    out_.longest = std::max(out_.longest, n);
    const PackOverflow how = pack_overflow_of(o_);
    if (how == PackOverflow::drop) {
      out_.tokens_left_out += n;
      return;
    }
    ++out_.documents;
    // Pieces of T - 1 tokens and an end of text out of the loss (the document does not end
    // there, and document masking needs the boundary); the last piece keeps the real ending.
    int64_t at = 0;
    while (n - at > T) {
      Piece p{{e.ids.begin() + at, e.ids.begin() + at + T - 1}, {m.begin() + at, m.begin() + at + T - 1}};
      p.ids.push_back(eot_);
      p.mask.push_back(0);
      add_piece(std::move(p));
      at += T - 1;
      if (how == PackOverflow::truncate) {
        out_.tokens_left_out += n - at;
        return;
      }
      ++out_.pieces;
    }
    add_piece({{e.ids.begin() + at, e.ids.end()}, {m.begin() + at, m.end()}});
    ++out_.pieces;
  }

  void add_piece(Piece p) {
    pool_tokens_ += static_cast<int64_t>(p.ids.size());
    pool_.push_back(std::move(p));
    if (pool_tokens_ >= windows_per_shard() * window_tokens()) pack_pool();
  }

  void pack_pool() {
    if (pool_.empty()) return;
    std::vector<int64_t> lengths;
    for (const Piece& p : pool_) lengths.push_back(static_cast<int64_t>(p.ids.size()));
    std::vector<std::vector<size_t>> windows = best_fit_decreasing(lengths, window_tokens());
    // Best-fit decreasing opens windows longest document first; shuffle them, so that the
    // first windows (which validation reads) are not the longest documents.
    PythonRandom(o_.seed + static_cast<uint64_t>(pools_++)).shuffle(windows);
    for (const auto& w : windows) {
      const size_t start = tokens_.size();
      for (size_t i : w) {
        tokens_.insert(tokens_.end(), pool_[i].ids.begin(), pool_[i].ids.end());
        mask_.insert(mask_.end(), pool_[i].mask.begin(), pool_[i].mask.end());
      }
      const size_t used = tokens_.size() - start;
      tokens_.resize(start + static_cast<size_t>(window_tokens()), eot_);
      mask_.resize(tokens_.size(), 0);
      out_.pad_tokens += static_cast<int64_t>(tokens_.size() - start - used);
      mask_[start] = 0;  // the target of the previous window's last position, which is not its document
      ++out_.windows;
      if (++windows_pending_ == windows_per_shard()) flush_windows();
    }
    pool_.clear();
    pool_tokens_ = 0;
  }

  // A shard of the pending windows, plus one padding token: the last window's final target.
  void flush_windows() {
    tokens_.push_back(eot_);
    mask_.push_back(0);
    ++out_.pad_tokens;
    windows_pending_ = 0;
    flush(tokens_.size());
  }

  void flush(size_t n) {
    if (out_.files.size() == kMaxShards)
      throw std::invalid_argument("--shard-tokens " + std::to_string(o_.shard_tokens) + ": the " + prefix_ +
                                  " split needs more than " + std::to_string(kMaxShards) +
                                  " shards; give each more tokens (the default is 100000000)");
    char name[64];
    std::snprintf(name, sizeof name, "%s_%03zu.bin", prefix_.c_str(), out_.files.size());
    const std::string path = (dir_ / name).string();
    write_llmc_shard(path, std::vector<uint32_t>(tokens_.begin(), tokens_.begin() + static_cast<ptrdiff_t>(n)), u32_);
    tokens_.erase(tokens_.begin(), tokens_.begin() + static_cast<ptrdiff_t>(n));
    if (writes_masks(o_)) {
      const std::vector<uint8_t> m(mask_.begin(), mask_.begin() + static_cast<ptrdiff_t>(n));
      write_loss_mask(LossMask::sidecar_path(path), m);
      mask_.erase(mask_.begin(), mask_.begin() + static_cast<ptrdiff_t>(n));
      if (o_.pack > 0) out_.in_loss += std::count(m.begin(), m.end(), uint8_t{1});
    }
    if (o_.pack > 0) out_.tokens += static_cast<int64_t>(n);
    out_.files.push_back(name);
  }

  // Shards are named train_000, train_001, ... as prepare_data.py names them. Past 1000 they
  // are renamed to as many digits as the last one needs (train_0000 ... train_1234), as the
  // script does too, so that the names sort in the order of the data.
  void widen_names() {
    const size_t n = out_.files.size();
    if (n <= 1000) return;
    const int width = static_cast<int>(std::to_string(n - 1).size());
    for (size_t k = 0; k < n; ++k) {  // no new name is an old one: the old ones of that width have no leading 0
      char name[64];
      std::snprintf(name, sizeof name, "%s_%0*zu.bin", prefix_.c_str(), width, k);
      const fs::path from = dir_ / out_.files[k], to = dir_ / name;
      fs::rename(from, to);
      if (writes_masks(o_)) fs::rename(LossMask::sidecar_path(from.string()), LossMask::sidecar_path(to.string()));
      out_.files[k] = name;
    }
  }

  static constexpr size_t kMaxShards = 100'000;

  fs::path dir_;
  std::string prefix_;
  const TokenizeOptions& o_;
  bool u32_;
  uint32_t eot_;
  TokenizedSplit& out_;
  std::vector<uint32_t> tokens_;
  std::vector<uint8_t> mask_;
  std::unique_ptr<MegatronDatasetWriter> megatron_;
  std::vector<Piece> pool_;
  int64_t pool_tokens_ = 0, windows_pending_ = 0;
  int pools_ = 0;
};

// The folders that creating `out` made, outermost first; an error removes them again, each only
// if it is empty (after the staging folder inside went), so nothing but keel's own is touched.
struct CreatedFolders {
  std::vector<fs::path> made;
  bool keep = false;
  ~CreatedFolders() {
    std::error_code ec;
    if (!keep)
      for (auto it = made.rbegin(); it != made.rend(); ++it) fs::remove(*it, ec);
  }
};

// --out is a folder, or can become one: not a file, nor a path under one (exit 2, not the
// file system's "Not a directory" from deep inside).
void check_out_path(const std::string& out) {
  for (fs::path p(out); !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    if (fs::exists(st)) {
      if (!fs::is_directory(st))
        throw std::invalid_argument("--out " + quoted(out) + ": " +
                                    (p == fs::path(out) ? std::string("it") : quoted(p.string())) +
                                    " is a file, not a folder");
      return;
    }
    if (p == p.parent_path()) return;
  }
}

// The chat template files keel tokenize copies beside the data (from, name in the data folder):
// the template under the name a model folder gives it, and for a .jinja the tokenizer_config.json
// beside it (the special tokens it was rendered with).
std::vector<std::pair<fs::path, std::string>> chat_side_files(const std::optional<ChatTemplate>& chat) {
  std::vector<std::pair<fs::path, std::string>> files;
  if (!chat) return files;
  const fs::path origin = chat->origin();
  if (origin.extension() == ".json") {
    files.emplace_back(origin, "tokenizer_config.json");
  } else {
    files.emplace_back(origin, "chat_template.jinja");
    if (fs::exists(origin.parent_path() / "tokenizer_config.json"))
      files.emplace_back(origin.parent_path() / "tokenizer_config.json", "tokenizer_config.json");
  }
  return files;
}

bool same_file_contents(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  if (fs::file_size(a, ec) != fs::file_size(b, ec) || ec) return false;
  return detail::read_file(a.string(), "file") == detail::read_file(b.string(), "file");
}

// The meta.json in `dir`, parsed; null where there is none (a discarded value where it is not JSON).
json folder_meta(const fs::path& dir) {
  std::ifstream in(dir / "meta.json");
  return in ? json::parse(in, nullptr, false) : json();
}

// An earlier run's meta.json (keel tokenize's or prepare_data.py's).
bool is_token_data_meta(const json& meta) {
  return meta.is_object() && meta.contains("eot_id") && meta.contains("train_tokens");
}

// Besides the token files, a run replaces meta.json, tokenizer.json and the chat template files
// in `out`. Those must be an earlier run's: `out` may be a folder of the user's (a keel checkpoint,
// whose meta.json is the checkpoint; a Hugging Face model folder, whose tokenizer files are the
// model's), and nothing there may be lost. An earlier run always left its meta.json.
void check_out_replaces_only_token_data(const std::string& out_name, const fs::path& tokenizer,
                                        const std::optional<ChatTemplate>& chat) {
  const fs::path out(out_name);
  std::error_code ec;
  if (!fs::is_directory(out, ec)) return;
  const json meta = folder_meta(out);
  if (is_token_data_meta(meta)) return;
  const std::string refuse = " keel tokenize writes its own there, so it does not write into this folder; pick another --out";
  if (fs::exists(out / "meta.json", ec)) {
    const bool checkpoint = meta.is_object() && meta.value("format", json()) == "keel-checkpoint";
    throw std::invalid_argument("--out " + quoted(out_name) + " holds a meta.json that is not keel token data's (" +
                                (checkpoint ? std::string("it is a keel checkpoint") : std::string("from another program")) +
                                "):" + refuse);
  }
  std::vector<std::pair<fs::path, std::string>> files = chat_side_files(chat);
  files.emplace_back(tokenizer, "tokenizer.json");
  for (const auto& [from, name] : files)
    if (fs::exists(out / name, ec) && !same_file_contents(from, out / name))
      throw std::invalid_argument("--out " + quoted(out_name) + " holds a " + name + " other than " + quoted(from.string()) +
                                  " and no meta.json of an earlier keel tokenize run:" + refuse);
}

// The folder the outputs are written to before they replace the earlier ones; removed when the
// run ends either way (empty after a success, the partial outputs after an error).
struct StagingFolder {
  fs::path path;
  ~StagingFolder() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

// Staging folders are named by host and pid, so that one left by a killed run (kill -9 runs no
// destructor) can be told from one in use.
const std::string kStagingPrefix = ".keel-tokenize-";

// Removes the staging folders in `out` that runs on this host left behind when they were killed
// (their pid is gone), saying so: each would otherwise stay, as large as the outputs it was
// writing. Those of other hosts (and of keels that did not record the host) are only named in a
// note: on shared storage (NFS) their run may still be alive, and its pid means nothing here.
void remove_dead_staging_folders(const fs::path& out, const std::string& host,
                                 const std::function<void(const std::string&)>& log) {
  std::error_code ec;
  std::vector<std::string> elsewhere;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(kStagingPrefix) || !e.is_directory(ec)) continue;
    const std::string rest = name.substr(kStagingPrefix.size());  // <host>-<pid>, or <pid> (older keels)
    const size_t dash = rest.rfind('-');
    const std::string pid_text = dash == std::string::npos ? rest : rest.substr(dash + 1);
    if (pid_text.empty() || pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(pid_text));
    if (dash == std::string::npos || rest.substr(0, dash) != host) {
      elsewhere.push_back(name);
    } else if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) {  // EPERM: alive, someone else's
      std::error_code rm;
      fs::remove_all(e.path(), rm);
      log("keel tokenize: removed " + quoted(e.path().string()) + ", the staging folder of a run on this host (pid " +
          pid_text + ") that is gone" + (rm ? " (not all of it: " + rm.message() + ")" : ""));
    }
  }
  if (!elsewhere.empty()) {
    std::string names;
    for (const std::string& n : elsewhere) names += (names.empty() ? "" : ", ") + n;
    log("keel tokenize: note: " + quoted(out.string()) + " holds staging folders of keel tokenize runs on other hosts, or of older keels that did not record the host (" +
        names + "); left alone, as they may still be running. Remove those that are not (rm -r) to free the space");
  }
}

std::string crc_of_file(const fs::path& p) {
  const auto m = detail::MappedFile::open(p.string(), "written file");
  return crc32c_hex(crc32c(0, m.data(), static_cast<size_t>(m.size())));
}

void check_options(const TokenizeOptions& o) {
  if (o.jsonl.empty() == o.text.empty()) throw std::invalid_argument("give the corpus as --jsonl FILE... or --text FILE..., one of them");
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0))
    throw std::invalid_argument("--val-fraction: " + std::to_string(o.val_fraction) + " must be in [0, 1)");
  if (o.shard_tokens < 1) throw std::invalid_argument("--shard-tokens must be positive");
  if (o.shard_tokens >= (int64_t{1} << 31)) throw std::invalid_argument("--shard-tokens: llm.c shards hold fewer than 2^31 tokens");
  if (o.prompt_loss_mask && o.jsonl.empty())
    throw std::invalid_argument("--loss-mask prompt needs --jsonl (records with --prompt-key and --response-key)");
  if (o.chat && o.jsonl.empty()) throw std::invalid_argument("--chat needs --jsonl (records with a --messages-key list)");
  if (!o.chat && !o.chat_template.empty()) throw std::invalid_argument("--chat-template applies to --chat only");
  if (o.chat && o.prompt_loss_mask)
    throw std::invalid_argument("--loss-mask prompt is for prompt/response pairs; with --chat use assistant (the default) or none");
  if (o.chat && o.add_special_tokens)
    throw std::invalid_argument("--add-special-tokens does not apply to --chat: the chat template writes the special tokens "
                                "itself (transformers encodes its output without adding any), so a BOS would come twice");
  if (o.pack < 0 || o.pack == 1)
    throw std::invalid_argument("--pack: a window of " + std::to_string(o.pack) +
                                " tokens cannot hold a document and its end of text; give train.seq_len");
  if (o.pack > 0 && o.format == TokenOutputFormat::megatron)
    throw std::invalid_argument("--pack writes llm.c shards of whole windows; with --format megatron the reader (Megatron-LM) "
                                "builds its own samples from the documents, so the packing would not survive");
  if (o.pack > 0 && o.shard_tokens < o.pack + 1)
    throw std::invalid_argument("--shard-tokens " + std::to_string(o.shard_tokens) + " cannot hold one window of --pack " +
                                std::to_string(o.pack) + " tokens plus its final target (" + std::to_string(o.pack + 1) + ")");
  if (o.pack_overflow && o.pack == 0) throw std::invalid_argument("--pack-overflow applies to --pack only");
  if (o.out.empty()) throw std::invalid_argument("--out: the output folder is required");
  if (o.tokenizer.empty()) throw std::invalid_argument("--tokenizer: a tokenizer.json (or its folder) is required");
}

}  // namespace

TokenizeResult tokenize_corpus(const TokenizeOptions& o, const std::function<void(const std::string&)>& log) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto seconds_since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  auto say = [&](const char* fmt, auto... args) {  // a line of any length, whole
    std::string line(static_cast<size_t>(std::snprintf(nullptr, 0, fmt, args...)), '\0');
    std::snprintf(line.data(), line.size() + 1, fmt, args...);
    log(line);
  };
  check_options(o);
  check_out_path(o.out);
  const std::string host = detail::this_host();
  if (std::error_code ec; fs::is_directory(o.out, ec)) remove_dead_staging_folders(o.out, host, log);
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));

  // 1. The tokenizer and its end of text.
  const fs::path tok_path = fs::is_directory(o.tokenizer) ? fs::path(o.tokenizer) / "tokenizer.json" : fs::path(o.tokenizer);
  Tokenizer tok = Tokenizer::from_file(tok_path.string());
  // Not for conversations: the template writes its special tokens as text, which must stay
  // special; ChatTemplate keeps the messages' special-token text text instead.
  tok.set_split_special_tokens(o.split_special_tokens && !o.chat);
  TokenizeResult r;
  r.eot_id = end_of_text_id(tok, o.eot_token, r.eot_token);
  r.vocab_size = tok.vocab_size();
  r.u32 = r.vocab_size >= 65536;

  // Inputs must survive the replacement of earlier outputs.
  const fs::path out(o.out);
  for (const auto& files : {o.jsonl, o.text})
    for (const std::string& f : files) {
      std::error_code ec;
      if (fs::equivalent(fs::path(f).parent_path().empty() ? "." : fs::path(f).parent_path(), out, ec) &&
          (is_token_output_name(fs::path(f).filename().string()) || fs::path(f).filename() == "meta.json"))
        throw std::invalid_argument("input " + quoted(f) + " is in --out " + quoted(o.out) +
                                    " under a name keel tokenize replaces; move it or pick another --out");
    }

  // 2. Documents.
  // Conversations: the chat template, and a check that its special tokens are the tokenizer's
  // (a template of another model family would otherwise be encoded as plain text, in silence).
  std::optional<ChatTemplate> chat;
  if (o.chat) {
    chat = ChatTemplate::from_path(o.chat_template.empty() ? tok_path.parent_path().string() : o.chat_template,
                                   tok_path.parent_path().string());
    for (const char* name : {"bos_token", "eos_token"}) {
      const std::string t = chat->special_token(name);
      if (!t.empty() && !tok.token_to_id(t))
        throw DataError("the chat template's " + std::string(name) + " " + quoted(t) + " (" + chat->origin() +
                        ") is not a token of " + quoted(tok_path.string()) + ": template and tokenizer are from different models");
    }
    say("keel tokenize: chat template of %s", chat->origin().c_str());
  }
  check_out_replaces_only_token_data(o.out, tok_path, chat);

  const Corpus corpus = !o.text.empty()            ? Corpus::text(o.text, o.doc_split)
                        : o.chat             ? Corpus::jsonl_chat(o.jsonl, messages_keys(o), threads)
                        : o.prompt_loss_mask ? Corpus::jsonl_pairs(o.jsonl, o.prompt_key, o.response_key, threads)
                                             : Corpus::jsonl(o.jsonl, o.text_key, threads);
  if (corpus.size() == 0)
    throw DataError("no documents found" + (o.chat ? " (records need a list of messages in " + quoted(o.messages_key) +
                                                         (messages_keys(o).size() > 1 ? " or 'conversations'" : "") + ")"
                                            : o.prompt_loss_mask ? " (records need string fields " + quoted(o.prompt_key) +
                                                                    " and " + quoted(o.response_key) + ")"
                                                              : o.jsonl.empty() ? "" : " (records need a string field " + quoted(o.text_key) + ")") +
                    first_record_hint(o));
  r.characters = corpus.characters();
  say("keel tokenize: %zu documents (%lld characters) in %.2f s%s", corpus.size(), static_cast<long long>(r.characters),
      seconds_since(t0),
      corpus.skipped_records() ? (", " + std::to_string(corpus.skipped_records()) + " records skipped").c_str() : "");
  // Replacing invalid bytes is what the script does, but a corpus in another encoding (Latin-1,
  // cp1252) would then train on U+FFFD wherever it has an accent: say so, naming where.
  if (corpus.files_with_bad_utf8())
    log("keel tokenize: WARNING " + std::to_string(corpus.files_with_bad_utf8()) + " of " +
        std::to_string(o.text.empty() ? o.jsonl.size() : o.text.size()) +
        " input files are not valid UTF-8 (the first invalid byte is in " + corpus.first_bad_utf8() +
        "): each invalid byte became U+FFFD, as Python's errors=\"replace\" does. Was the corpus written in another "
        "encoding (Latin-1, cp1252)? Convert it first, e.g. iconv -f cp1252 -t utf-8");

  // 3. Shuffle by document and hold out the first val_fraction, as prepare_data.py does.
  std::vector<uint64_t> order(corpus.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  PythonRandom(o.seed).shuffle(order);
  size_t n_val = 0;
  if (o.val_fraction > 0) {
    if (corpus.size() < 2)
      throw DataError("only one document: nothing to hold out (try --doc-split paragraph or --val-fraction 0)");
    // Python's round(): half to even, which nearbyint gives in the default rounding mode.
    const auto wanted = static_cast<size_t>(std::nearbyint(static_cast<double>(corpus.size()) * o.val_fraction));
    n_val = std::min(corpus.size() - 1, std::max<size_t>(1, wanted));
  }

  // 4. Encode in parallel, write in order, into a staging folder inside `out`.
  CreatedFolders created;  // before the staging folder: destroyed after it
  std::error_code ec;
  for (fs::path p = out; !p.empty() && !fs::exists(p, ec); p = p.parent_path())
    created.made.insert(created.made.begin(), p);
  StagingFolder stage{out / (kStagingPrefix + host + "-" + std::to_string(::getpid()))};
  try {
    fs::create_directories(out);
    fs::remove_all(stage.path);
    fs::create_directory(stage.path);
  } catch (const fs::filesystem_error& e) {
    throw DataError("cannot write to --out " + quoted(o.out) + ": " + e.code().message());
  }
  const bool pairs = corpus.pairs();
  const std::vector<std::string> conversation_keys = messages_keys(o);
  auto encode_conversation = [&](uint64_t doc) {
    Encoded e;
    ChatTokens ct;
    try {
      const nlohmann::ordered_json record = nlohmann::ordered_json::parse(corpus.document(doc).text);
      nlohmann::ordered_json variables = nlohmann::ordered_json::object();
      if (record.contains("tools")) variables["tools"] = record["tools"];  // tool-calling data
      const nlohmann::ordered_json messages = chat_messages(*conversation_messages(record, conversation_keys));
      if (o.assistant_loss_mask) ct = chat->tokenize(tok, messages, variables, o.split_special_tokens);
      else ct = chat->encode(tok, messages, variables, o.split_special_tokens);  // one rendering, no mask
    } catch (const std::exception& err) {  // a template's raise_exception, or a template error
      throw DataError(corpus.where(doc) + ": " + err.what());
    }
    e.unplaced_replies = ct.unplaced_replies;
    e.weight0_replies = ct.weight0_replies;
    if (!o.split_special_tokens) e.special_in_text = ct.special_in_text;
    for (int32_t id : ct.ids) e.ids.push_back(static_cast<uint32_t>(id));
    e.mask = std::move(ct.reply);
    if (e.ids.empty() || e.ids.back() != static_cast<uint32_t>(r.eot_id)) {
      e.ids.push_back(static_cast<uint32_t>(r.eot_id));  // the document separator, out of the loss
      e.mask.push_back(0);
    }
    return e;
  };
  // A special token in a document's ids, beyond those the post-processor adds (BOS) and the
  // model's <unk>, came from its text: web text that mentions <|endoftext|>, say. Counted, and
  // said, since with data.document_masking an end of text there cuts the document in two.
  const std::vector<int32_t> added_ids = tok.encode("", o.add_special_tokens);
  // Looked up per token: a table made once, not the tokenizer's map (the model's <unk> left out).
  std::vector<char> counts_as_special(static_cast<size_t>(tok.vocab_size()), 0);
  for (int32_t id = 0; id < tok.vocab_size(); ++id) counts_as_special[static_cast<size_t>(id)] = tok.is_special(id) && id != tok.unk_id();
  const int64_t added_specials = std::count_if(added_ids.begin(), added_ids.end(), [&](int32_t id) { return tok.is_special(id); });
  auto special_from_text = [&](const std::vector<int32_t>& ids) {
    if (o.split_special_tokens) return -1;
    int64_t beyond = -added_specials;
    int32_t example = -1;
    for (int32_t id : ids)
      if (counts_as_special[static_cast<size_t>(id)]) {
        ++beyond;
        if (example < 0 || std::find(added_ids.begin(), added_ids.end(), example) != added_ids.end()) example = id;
      }
    return beyond > 0 ? example : -1;
  };
  auto encode = [&](uint64_t doc) {
    if (chat) return encode_conversation(doc);
    const Document d = corpus.document(doc);
    Encoded e;
    // A pair is the joined text's tokens, as one encode gives them (what the model will see
    // when prompted): the response encoded on its own would get a second "▁" from a
    // SentencePiece-style tokenizer. A token straddling the join is in the loss (encode_joined).
    std::vector<int32_t> ids;
    if (pairs) {
      Tokenizer::Joined j = tok.encode_joined(d.text, d.response, o.add_special_tokens);
      ids = std::move(j.ids);
      e.prompt = j.split;
    } else {
      ids = tok.encode(d.text, o.add_special_tokens);
    }
    e.special_in_text = special_from_text(ids);
    e.ids.reserve(ids.size() + 1);
    for (int32_t id : ids) e.ids.push_back(static_cast<uint32_t>(id));
    e.ids.push_back(static_cast<uint32_t>(r.eot_id));
    return e;
  };
  const auto t_encode = clock::now();
  auto last_report = t_encode;
  int64_t tokens_done = 0;
  for (int s = 0; s < 2; ++s) {
    const bool train = s == 0;
    const size_t begin = train ? n_val : 0, end = train ? order.size() : n_val;
    TokenizedSplit& split = train ? r.train : r.val;
    if (begin == end) continue;
    SplitWriter writer(stage.path, train ? "train" : "val", o, r.u32, static_cast<uint32_t>(r.eot_id), split);
    const size_t batch = 256 * static_cast<size_t>(threads);
    std::vector<Encoded> encoded;
    for (size_t b = begin; b < end; b += batch) {
      const size_t n = std::min(batch, end - b);
      encoded.assign(n, Encoded());
      std::vector<std::thread> pool;
      std::vector<std::exception_ptr> failed(static_cast<size_t>(threads));
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          try {
            for (size_t k = n * static_cast<size_t>(t) / threads; k < n * static_cast<size_t>(t + 1) / threads; ++k)
              encoded[k] = encode(order[b + k]);
          } catch (...) {
            failed[static_cast<size_t>(t)] = std::current_exception();
          }
        });
      for (auto& th : pool) th.join();
      for (auto& f : failed)
        if (f) std::rethrow_exception(f);
      for (const Encoded& e : encoded) {
        writer.add(e);
        tokens_done += static_cast<int64_t>(e.ids.size());
      }
      if (seconds_since(last_report) >= 10.0) {
        last_report = clock::now();
        say("keel tokenize: %s %zu / %zu documents, %lld tokens (%.2fM tokens/s)", train ? "train" : "val", b + n - begin,
            end - begin, static_cast<long long>(tokens_done), tokens_done / seconds_since(t_encode) / 1e6);
      }
    }
    writer.close();
    // Packing can drop every document of a split (all longer than a window). No training data
    // is an error; no validation data is what --val-fraction 0 gives, and the summary says why.
    if (o.pack > 0 && split.documents == 0 && train)
      throw DataError("all " + std::to_string(split.long_documents) +
                      " training documents are longer than a window of --pack " + std::to_string(o.pack) +
                      " tokens (the longest has " + std::to_string(split.longest) + ") and were dropped (--pack-overflow drop" +
                      (o.pack_overflow ? "" : ", the default for prompt/response pairs and conversations") +
                      "): nothing is left to train on. Pack into longer windows, or keep them with --pack-overflow "
                      "truncate or split");
  }
  const double encode_s = seconds_since(t_encode);

  // 5. Check what was written: every token file opens with its count, every mask matches it.
  json shards_meta = json::object();
  for (int s = 0; s < 2; ++s) {
    const TokenizedSplit& split = s == 0 ? r.train : r.val;
    json list = json::array();
    int64_t total = 0;
    for (const std::string& name : split.files) {
      if (name.ends_with(".idx")) continue;
      const fs::path p = stage.path / name;
      const TokenFile f = TokenFile::open(p.string());
      total += f.num_tokens();
      json e = {{"file", name}, {"tokens", f.num_tokens()}, {"crc32c", crc_of_file(p)}};
      if (o.format == TokenOutputFormat::megatron) {
        e["documents"] = static_cast<int64_t>(f.doc_starts().size());
        e["idx_crc32c"] = crc_of_file(stage.path / (name.substr(0, name.size() - 4) + ".idx"));
      }
      if (writes_masks(o)) {
        const auto m = LossMask::open_for(f);
        if (!m) throw DataError("internal error: no loss mask written for " + quoted(p.string()));
        e["mask"] = {{"file", fs::path(m->path()).filename().string()}, {"in_loss", m->count_in_loss()},
                     {"crc32c", crc_of_file(m->path())}};
      }
      list.push_back(std::move(e));
    }
    if (total != split.tokens)
      throw DataError("internal error: " + std::to_string(total) + " tokens written, " + std::to_string(split.tokens) + " encoded");
    shards_meta[s == 0 ? "train" : "val"] = std::move(list);
  }
  // A decode round trip of the first documents (responses of pairs), as the script warns.
  for (size_t k = n_val; !chat && k < std::min(order.size(), n_val + 50); ++k) {
    const Document d = corpus.document(order[k]);
    const std::string& text = pairs ? d.response : d.text;
    if (tok.decode(tok.encode(text, false)) != text) {
      say("WARNING: decode(encode(document)) differs from the document: %.60s", text.c_str());
      break;
    }
  }

  // 6. meta.json, the tokenizer and the chat template beside the data.
  // The template goes there as the tokenizer does, recorded relative to the folder, so that the
  // data keeps what it was rendered with wherever it moves: its file under the name a model
  // folder gives it, and for a .jinja the tokenizer_config.json beside it (the special tokens it
  // was rendered with). Where it came from: source.chat_template_origin.
  const std::vector<std::pair<fs::path, std::string>> chat_files = chat_side_files(chat);
  json meta = {
      {"format", o.format == TokenOutputFormat::llmc
                     ? "llm.c token shards: 256 x int32 header (magic, version, n_tokens), then tokens"
                     : "Megatron indexed dataset (MMIDIDX .bin + .idx), one sequence per document"},
      {"token_dtype", r.u32 ? (o.format == TokenOutputFormat::llmc ? "uint32" : "int32") : "uint16"},
      {"vocab_size", r.vocab_size},
      {"eot_id", r.eot_id},
      {"eot_placement", chat ? "after every conversation that does not end with it" : "after every document"},
      {"tokenizer", {{"kind", "file"}, {"source", fs::absolute(tok_path).string()}, {"path", "tokenizer.json"},
                     {"eot_token", r.eot_token}, {"vocab_size", r.vocab_size}, {"eot_id", r.eot_id},
                     {"describe", tok.describe()}}},
      {"source", !o.text.empty() ? json{{"kind", "text"}, {"files", o.text},
                                        {"doc_split", o.doc_split == DocSplit::file ? "file" : o.doc_split == DocSplit::paragraph ? "paragraph" : "line"}}
                 : chat ? json{{"kind", "jsonl conversations"}, {"files", o.jsonl}, {"messages_key", o.messages_key},
                               {"chat_template", chat_files.front().second},
                               {"chat_template_origin", fs::absolute(chat->origin()).string()}}
                 : o.prompt_loss_mask ? json{{"kind", "jsonl prompt/response pairs"}, {"files", o.jsonl},
                                             {"prompt_key", o.prompt_key}, {"response_key", o.response_key}}
                                      : json{{"kind", "jsonl"}, {"files", o.jsonl}, {"text_key", o.text_key}}},
      {"split", {{"seed", o.seed}, {"val_fraction", o.val_fraction}, {"unit", "document"}, {"shuffled", true}}},
      {"train", {{"documents", r.train.documents}, {"tokens", r.train.tokens}, {"files", shards_meta["train"]}}},
      {"val", {{"documents", r.val.documents}, {"tokens", r.val.tokens}, {"files", shards_meta["val"]}}},
      {"train_tokens", r.train.tokens},
      {"val_tokens", r.val.tokens},
      {"add_special_tokens", o.add_special_tokens},
      {"split_special_tokens", o.split_special_tokens},
      {"generated_by", "keel tokenize (" + std::to_string(threads) + " threads)"},
  };
  if (o.format == TokenOutputFormat::llmc) meta["shard_tokens"] = o.shard_tokens;
  if (o.pack > 0) {
    auto split_of = [](const TokenizedSplit& sp) {
      return json{{"windows", sp.windows}, {"documents", sp.documents}, {"pad_tokens", sp.pad_tokens},
                  {"long_documents", sp.long_documents}, {"longest", sp.longest}, {"pieces", sp.pieces},
                  {"tokens_left_out", sp.tokens_left_out}};
    };
    meta["pack"] = {{"seq_len", o.pack},
                    {"layout", "whole documents per window of seq_len tokens, then end-of-text padding out of the loss; "
                               "shards of whole windows plus one padding token; best-fit decreasing per pool of about "
                               "one shard, windows shuffled with the seed"},
                    {"overflow", std::string(pack_overflow_name(pack_overflow_of(o)))},
                    {"train", split_of(r.train)},
                    {"val", split_of(r.val)}};
  }
  // keel train refuses data.document_masking on such data (check_document_ends).
  if (chat)
    meta["eot_inside_conversations"] = {{"train", r.train.eot_inside_conversations},
                                        {"val", r.val.eot_inside_conversations}};
  if (corpus.skipped_records()) meta["source"]["jsonl_skipped"] = corpus.skipped_records();
  if (corpus.files_with_bad_utf8()) meta["source"]["files_with_bad_utf8"] = corpus.files_with_bad_utf8();
  std::string mask_kind = chat ? "assistant: the assistant replies, as the chat template renders them, are in the loss; "
                                 "everything else is out"
                               : "prompt: prompt tokens are out of the loss, response and end of text in";
  if (!masked(o) && o.pack > 0) mask_kind = "pack: every target is in the loss but the padding and each window's first token";
  meta["loss_mask"] = writes_masks(o) ? json{{"kind", mask_kind},
                                                {"format", "sidecar <token file>.mask: 256 x int32 header (magic 20240917, version 1, "
                                                           "n_tokens), then one uint8 per token (1 = in the loss as a target)"},
                                                {"train_in_loss", r.train.in_loss},
                                                {"val_in_loss", r.val.in_loss}}
                                         : json();
  detail::write_text_file((stage.path / "meta.json").string(), meta.dump(2) + "\n");
  // Copied through the checked writer: fs::copy_file's error on a full disk named no reason
  // keel could rely on ("Input/output error" on tmpfs) and ended with exit 1.
  const bool same_tokenizer = fs::exists(out / "tokenizer.json") && fs::equivalent(tok_path, out / "tokenizer.json");
  if (!same_tokenizer)
    detail::write_text_file((stage.path / "tokenizer.json").string(), detail::read_file(tok_path.string(), "tokenizer"));
  for (const auto& [from, name] : chat_files)
    if (!(fs::exists(out / name) && fs::equivalent(from, out / name)))
      detail::write_text_file((stage.path / name).string(), detail::read_file(from.string(), "chat template"));

  // 7. Replace the earlier outputs with the new ones.
  std::vector<fs::path> stale, staged;  // listed first: a folder is not changed while it is iterated
  for (const auto& entry : fs::directory_iterator(out))
    if (entry.is_regular_file() && is_token_output_name(entry.path().filename().string())) stale.push_back(entry.path());
  // The chat template files an earlier --chat run copied here and this run does not write: left,
  // a chat_template.jinja would be taken for this data's template (it comes first in a model
  // folder: keel tokenize --chat --tokenizer on this folder, keel convert's export, transformers).
  if (const json earlier = folder_meta(out);
      is_token_data_meta(earlier) && earlier.contains("source") && earlier["source"].is_object()) {
    const json t = earlier["source"].value("chat_template", json());
    std::vector<std::string> names;
    if (t == "chat_template.jinja") names = {"chat_template.jinja", "tokenizer_config.json"};
    if (t == "tokenizer_config.json") names = {"tokenizer_config.json"};
    for (const std::string& name : names)
      if (fs::is_regular_file(out / name) &&
          std::none_of(chat_files.begin(), chat_files.end(), [&](const auto& f) { return f.second == name; }))
        stale.push_back(out / name);
  }
  for (const auto& entry : fs::directory_iterator(stage.path)) staged.push_back(entry.path());
  created.keep = true;  // from here on `out` holds the run's results
  for (const fs::path& p : stale) fs::remove(p);
  for (const fs::path& p : staged) fs::rename(p, out / p.filename());
  detail::sync_directory(out.string());

  say("keel tokenize: encoded %lld tokens in %.2f s (%.2fM tokens/s, %d threads); vocab %lld (eot %s = %d), %s tokens",
      static_cast<long long>(r.train.tokens + r.val.tokens), encode_s, (r.train.tokens + r.val.tokens) / std::max(encode_s, 1e-9) / 1e6,
      threads, static_cast<long long>(r.vocab_size), r.eot_token.c_str(), r.eot_id, r.u32 ? "4-byte" : "2-byte");
  for (int s = 0; s < 2; ++s) {
    const TokenizedSplit& split = s == 0 ? r.train : r.val;
    // The first few names: a split of thousands of shards is one line, not a page.
    constexpr size_t kNamed = 4;
    std::string files;
    for (size_t f = 0; f < split.files.size() && f < kNamed; ++f) files += (f ? ", " : "") + split.files[f];
    if (split.files.size() > kNamed) files += ", ... and " + std::to_string(split.files.size() - kNamed) + " more";
    say("%s: %lld documents, %lld tokens%s  [%s]", s == 0 ? "train" : "val", static_cast<long long>(split.documents),
        static_cast<long long>(split.tokens),
        writes_masks(o) ? (", " + std::to_string(split.in_loss) + " in the loss").c_str() : "",
        files.empty() ? "-" : files.c_str());
    if (o.pack > 0 && split.windows > 0)
      say("  packed into %lld windows of %lld tokens: %.1f%% of the positions hold documents, %.1f%% padding",
          static_cast<long long>(split.windows), static_cast<long long>(o.pack),
          100.0 * static_cast<double>(split.tokens - split.pad_tokens) / static_cast<double>(split.tokens),
          100.0 * static_cast<double>(split.pad_tokens) / static_cast<double>(split.tokens));
    if (split.long_documents) {
      const PackOverflow how = pack_overflow_of(o);
      say("  NOTE %lld documents are longer than a window of %lld tokens (the longest has %lld): %s%s",
          static_cast<long long>(split.long_documents), static_cast<long long>(o.pack), static_cast<long long>(split.longest),
          how == PackOverflow::drop       ? ("dropped, " + std::to_string(split.tokens_left_out) + " tokens").c_str()
          : how == PackOverflow::truncate ? ("truncated, " + std::to_string(split.tokens_left_out) + " tokens left out").c_str()
                                          : ("split into " + std::to_string(split.pieces) + " pieces").c_str(),
          how == PackOverflow::split ? "" : " (--pack-overflow split keeps every token; a longer train.seq_len keeps them whole)");
    }
    if (o.pack > 0 && s == 1 && n_val > 0 && split.documents == 0)
      say("  NOTE no val file was written, as with --val-fraction 0: all %lld val documents were dropped",
          static_cast<long long>(split.long_documents));
    if (o.format == TokenOutputFormat::llmc && o.pack == 0 && split.files.size() > 1 && o.shard_tokens < kSmallShard)
      say("  WARNING %zu shards of at most --shard-tokens %lld tokens: keel train's windows (train.seq_len + 1 tokens) "
          "never cross a file, so each shard loses its last partial window, and a shard shorter than a window gives "
          "none. Shards of millions of tokens lose almost nothing (the default is 100000000)",
          split.files.size(), static_cast<long long>(o.shard_tokens));
    if (split.files.size() > 1000)
      say("  NOTE %zu shards: their names have %zu digits (%s ... %s), so that they sort in order", split.files.size(),
          std::to_string(split.files.size() - 1).size(), split.files.front().c_str(), split.files.back().c_str());
    if (split.special_text_documents) {
      std::string names;
      int shown = 0;
      for (int32_t id : split.special_text_tokens)
        if (shown++ < 5) names += (names.empty() ? "" : ", ") + tok.id_to_token(id);
      say("  NOTE %lld %s hold the text of a special token (%s%s), encoded as that token, as HF tokenizers "
          "does. With data.document_masking an end of text there cuts the %s in two. --split-special-tokens "
          "encodes such text as ordinary text (llm.c's encode_ordinary)%s",
          static_cast<long long>(split.special_text_documents), o.chat ? "conversations" : "documents", names.c_str(),
          split.special_text_tokens.size() > 5 ? ", ..." : "", o.chat ? "conversation" : "document",
          o.chat ? ", and the chat template's own special tokens stay special" : "");
    }
    if (split.eot_inside_conversations)
      say("  NOTE %lld of the conversations hold the end of text %s (id %d) before their end (the chat template "
          "writes it inside a conversation, e.g. after every turn): keel train refuses data.document_masking on this "
          "data, which would cut them at every one and train each turn without the ones before it",
          static_cast<long long>(split.eot_inside_conversations), r.eot_token.c_str(), r.eot_id);
    if (split.unplaced_replies)
      say("  NOTE %lld assistant replies are out of the loss: the chat template renders them differently once later "
          "messages follow (e.g. it drops their reasoning), so they could not be located",
          static_cast<long long>(split.unplaced_replies));
    if (split.weight0_replies)
      say("  %lld assistant replies have \"weight\": 0 and are out of the loss", static_cast<long long>(split.weight0_replies));
    if (split.without_replies)
      say("  NOTE %lld conversations have nothing in the loss (no assistant reply that could be located and has weight 1)",
          static_cast<long long>(split.without_replies));
  }
  say("wrote %s/ in %.2f s", o.out.c_str(), seconds_since(t0));
  return r;
}

}  // namespace keel::data
