#include "train/checkpoint.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "data/checksum.h"
#include "data/file_io.h"
#include "train/hf_format.h"
#include "train/schedule.h"

namespace keel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "keel-checkpoint";
const std::vector<std::string> kOptimStates = {"master", "adam_m", "adam_v"};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The stored tensor is the model's, padded otherwise.
bool padded_otherwise(const ParamSpec& p, const std::vector<int64_t>& stored, const ModelConfig& m) {
  return vocab_padding_only(p.name, p.shape, stored, m.vocab_size);
}

std::string vocab_rows_hint(const ParamSpec& p, const std::vector<int64_t>& stored, const ModelConfig& m) {
  if (!padded_otherwise(p, stored, m)) return "";
  return " (model.vocab_size " + std::to_string(m.vocab_size) + ", padded to " + std::to_string(stored[0]) +
         " rows in the checkpoint and to " + std::to_string(p.shape[0]) +
         " here by model.pad_vocab_to_multiple_of x parallel.tp)";
}

// A stored tensor whose shape is not the model's, as --init-from, a resume and verify say it.
std::string shape_mismatch(const ParamSpec& p, const std::vector<int64_t>& stored, const ModelConfig& m) {
  return "tensor " + p.name + ": checkpoint has shape " + shape_str(stored) + ", the model expects " +
         shape_str(p.shape) + vocab_rows_hint(p, stored, m);
}

data::SafetensorsDtype to_st(DType t) {
  switch (t) {
    case DType::F32: return data::SafetensorsDtype::F32;
    case DType::BF16: return data::SafetensorsDtype::BF16;
    case DType::F16: return data::SafetensorsDtype::F16;
    case DType::I32: return data::SafetensorsDtype::I32;
  }
  return data::SafetensorsDtype::F32;
}

std::optional<DType> from_st(data::SafetensorsDtype t) {
  switch (t) {
    case data::SafetensorsDtype::F32: return DType::F32;
    case data::SafetensorsDtype::BF16: return DType::BF16;
    case data::SafetensorsDtype::F16: return DType::F16;
    default: return std::nullopt;
  }
}

float load_float(const void* p, DType t) {
  switch (t) {
    case DType::BF16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    default: { float f; std::memcpy(&f, p, 4); return f; }
  }
}

void store_float(void* p, DType t, float v) {
  switch (t) {
    case DType::BF16: { uint16_t h = f32_to_bf16(v); std::memcpy(p, &h, 2); return; }
    case DType::F16: { uint16_t h = f32_to_f16(v); std::memcpy(p, &h, 2); return; }
    default: std::memcpy(p, &v, 4);
  }
}

// n elements from src (dtype s) to dst (dtype d): a byte copy when the dtypes agree, else
// through fp32 with round-to-nearest-even.
void convert_elements(const void* src, DType s, void* dst, DType d, int64_t n) {
  if (s == d) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(s));
    return;
  }
  const auto* in = static_cast<const char*>(src);
  auto* out = static_cast<char*>(dst);
  for (int64_t i = 0; i < n; ++i) store_float(out + i * dtype_size(d), d, load_float(in + i * dtype_size(s), s));
}

// Fault injection for the crash-safety tests: KEEL_CRASH_DURING_SAVE=<phase> ends the process
// the way kill -9 would (no cleanup, no flush) when a save reaches that phase.
void maybe_crash(const char* phase) {
  static const char* want = std::getenv("KEEL_CRASH_DURING_SAVE");
  if (want && std::strcmp(want, phase) == 0) _exit(137);
}

// Fault injection for the rewind test: KEEL_FAULT_DAMAGE_SAVE=<name> (step_00000040) flips a
// byte in the middle of that save's first tensor file once it is published, as disk damage would.
void maybe_damage(const fs::path& checkpoint) {
  static const char* want = std::getenv("KEEL_FAULT_DAMAGE_SAVE");
  if (!want || checkpoint.filename() != want) return;
  const fs::path file = checkpoint / "model-tp00-pp00.safetensors";
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto middle = static_cast<std::streamoff>(fs::file_size(file) / 2);
  char c = 0;
  f.seekg(middle);
  f.get(c);
  f.seekp(middle);
  f.put(static_cast<char>(c ^ 0x10));
}

void write_text_file_synced(const std::string& path, const std::string& text) {
  data::detail::FileWriter w(path);
  w.write(text.data(), text.size());
  w.sync();
  w.close();
}

json progress_json(const TrainProgress& p) {
  return {{"iteration", p.iteration},
          {"consumed_samples", p.consumed_samples},
          {"consumed_tokens", p.consumed_tokens},
          {"skipped_total", p.skipped_total},
          {"nan_total", p.nan_total}};
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

bool is_complete_checkpoint(const fs::path& p) { return fs::is_directory(p) && fs::exists(p / "meta.json"); }

// What is wrong with a complete checkpoint's files at a glance, without reading them: a meta.json
// that does not parse, a file it lists that is missing or of another size (a truncated copy, a
// full disk). Empty when nothing is; the checksums are for the load (and keel ckpt verify).
std::string files_damage(const fs::path& p) {
  std::ifstream in(p / "meta.json");
  const json m = json::parse(in, nullptr, false);
  if (!m.is_object() || !m.contains("files") || !m["files"].is_object()) return "its meta.json does not parse";
  for (const auto& [name, info] : m["files"].items()) {
    std::error_code ec;
    const auto size = fs::file_size(p / name, ec);
    if (ec) return name + " is missing";
    if (info.is_object() && info.contains("bytes") && info["bytes"].is_number_integer() &&
        static_cast<int64_t>(size) != info["bytes"].get<int64_t>())
      return name + " has " + std::to_string(size) + " bytes, not the " + std::to_string(info["bytes"].get<int64_t>()) +
             " saved";
  }
  return {};
}

int64_t step_of(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return -1;
  try {
    return std::stoll(name.substr(5));
  } catch (...) {
    return -1;
  }
}

const char* json_kind(const json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

// meta.json's fields are what a resume continues from; each one a later step reads is checked
// here for its type (and its range, where a wrong value would train on silently), so that a
// damaged or hand-edited meta.json is named with its field instead of failing deep inside.
void validate_meta(const json& m, const std::string& meta_path) {
  auto bad = [&](const std::string& field, const std::string& what) {
    throw CheckpointError(meta_path + ": field " + field + ": " + what);
  };
  auto need = [&](const json& obj, const std::string& prefix, const char* key, bool required) -> const json* {
    if (!obj.contains(key)) {
      if (required) bad(prefix + key, "missing");
      return nullptr;
    }
    return &obj[key];
  };
  auto object = [&](const json& obj, const std::string& prefix, const char* key, bool required) -> const json* {
    const json* v = need(obj, prefix, key, required);
    if (v && !v->is_object()) bad(prefix + key, std::string("expected an object, got ") + json_kind(*v));
    return v;
  };
  auto integer = [&](const json& obj, const std::string& prefix, const char* key, bool required,
                     bool may_be_negative = false) -> int64_t {
    const json* v = need(obj, prefix, key, required);
    if (!v) return 0;
    if (!v->is_number_integer())
      bad(prefix + key, std::string("expected an integer, got ") + json_kind(*v) + " " + v->dump());
    const int64_t x = v->get<int64_t>();
    if (x < 0 && !may_be_negative) bad(prefix + key, "is " + std::to_string(x) + ", which is negative");
    return x;
  };
  auto number = [&](const json& obj, const std::string& prefix, const char* key) {
    const json* v = need(obj, prefix, key, true);
    if (!v->is_number()) bad(prefix + key, std::string("expected a number, got ") + json_kind(*v) + " " + v->dump());
  };
  auto string = [&](const json& obj, const std::string& prefix, const char* key, bool required) {
    const json* v = need(obj, prefix, key, required);
    if (v && !v->is_string()) bad(prefix + key, std::string("expected a string, got ") + json_kind(*v));
  };

  const json& progress = *object(m, "", "progress", true);
  const int64_t iteration = integer(progress, "progress.", "iteration", true);
  const int64_t samples = integer(progress, "progress.", "consumed_samples", true);
  const int64_t tokens = integer(progress, "progress.", "consumed_tokens", true);
  // The data position against the progress. Global batch and seq_len may change on resume and
  // a rewind skips samples, so the exact count follows from no schedule; but every iteration
  // reads at least one sample of at least one token, and the data section repeats the count.
  if (samples < iteration)
    bad("progress.consumed_samples", "is " + std::to_string(samples) + ", fewer than progress.iteration " +
                                         std::to_string(iteration) + " (every iteration consumes at least one sample)");
  if (tokens < samples)
    bad("progress.consumed_tokens", "is " + std::to_string(tokens) + ", fewer than progress.consumed_samples " +
                                        std::to_string(samples) + " (every sample has at least one token)");
  if (const json* d = object(m, "", "data", false); d && d->contains("consumed_samples")) {
    const int64_t data_samples = integer(*d, "data.", "consumed_samples", true);
    if (data_samples != samples)
      bad("data.consumed_samples", "is " + std::to_string(data_samples) + ", progress.consumed_samples " +
                                       std::to_string(samples) + " (both record the data position and must agree)");
  }
  // The blend's history (data/sampler.h: BlendSchedule): segments from sample 0 on, forward,
  // none after the data position, one positive finite weight per source in each.
  if (const json* d = object(m, "", "data", false); d && d->contains("blend")) {
    const json& b = (*d)["blend"];
    if (!b.is_array() || b.empty())
      bad("data.blend", std::string("expected a non-empty array of segments, got ") + json_kind(b));
    int64_t previous = -1;
    size_t sources = 0;
    for (size_t s = 0; s < b.size(); ++s) {
      const std::string at = "data.blend[" + std::to_string(s) + "]";
      if (!b[s].is_object()) bad(at, std::string("expected an object, got ") + json_kind(b[s]));
      const int64_t from = integer(b[s], at + ".", "from_sample", true);
      if (s == 0 && from != 0) bad(at + ".from_sample", "is " + std::to_string(from) + ": the first segment starts at 0");
      if (s > 0 && from <= previous)
        bad(at + ".from_sample", "is " + std::to_string(from) + ", not after the previous segment's " +
                                     std::to_string(previous));
      if (from > samples)
        bad(at + ".from_sample", "is " + std::to_string(from) + ", after progress.consumed_samples " +
                                     std::to_string(samples));
      previous = from;
      const json* w = need(b[s], at + ".", "weights", true);
      if (!w->is_array() || w->size() < 2 ||
          !std::all_of(w->begin(), w->end(), [](const json& x) {
            return x.is_number() && std::isfinite(x.get<double>()) && x.get<double>() > 0;
          }))
        bad(at + ".weights", "expected two or more positive numbers, got " + w->dump());
      if (s > 0 && w->size() != sources)
        bad(at + ".weights", "has " + std::to_string(w->size()) + " weights, the first segment " + std::to_string(sources));
      sources = w->size();
    }
  }
  integer(progress, "progress.", "skipped_total", false);
  integer(progress, "progress.", "nan_total", false);
  const int64_t adam_step = integer(m, "", "adam_step", false);
  if (adam_step > iteration)
    bad("adam_step", "is " + std::to_string(adam_step) + ", more than progress.iteration " +
                         std::to_string(iteration) + " (Adam steps once per iteration at most)");
  if (const json* ls = object(m, "", "loss_scaler", true)) {
    number(*ls, "loss_scaler.", "scale");
    integer(*ls, "loss_scaler.", "growth_tracker", true);
    // Earlier keels counted it below 0 after repeated overflows (-1 in the save at an exhausted
    // fp16 scale): any value below 0 means what 0 does, and those checkpoints must still load.
    integer(*ls, "loss_scaler.", "hysteresis_tracker", true, true);
  }
  object(m, "", "config", true);
  if (const json* t = object(m, "", "topology", false)) {
    for (const char* k : {"tp", "pp", "dp"}) integer(*t, "topology.", k, false);
    if (const json* l = need(*t, "topology.", "pipeline_layers", false);
        l && !(l->is_array() && std::all_of(l->begin(), l->end(), [](const json& e) { return e.is_number_integer(); })))
      bad("topology.pipeline_layers", "expected layer counts (integers), got " + l->dump());
  }
  string(m, "", "precision", false);
  string(m, "", "weight_dtype", false);
  if (const json* st = need(m, "", "states", false)) {
    if (!st->is_array()) bad("states", std::string("expected an array, got ") + json_kind(*st));
    for (const json& e : *st)
      if (!e.is_string()) bad("states", std::string("expected names (strings), found ") + json_kind(e));
  }
  object(m, "", "health", false);
  for (const auto& [name, info] : m["files"].items()) {
    const std::string prefix = "files." + name;
    if (!info.is_object()) bad(prefix, std::string("expected an object, got ") + json_kind(info));
    integer(info, prefix + ".", "bytes", true);
    string(info, prefix + ".", "crc32c", true);
    if (const json* t = object(info, prefix + ".", "tensors", false))
      for (const auto& [tensor, crc] : t->items())
        if (!crc.is_string()) bad(prefix + ".tensors." + tensor, std::string("expected a string, got ") + json_kind(crc));
  }
}

// The CRC-32C (hex) of a whole file, header included.
std::string file_crc32c(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crc = data::crc32c(crc, buf.data(), static_cast<size_t>(in.gcount()));
  }
  return data::crc32c_hex(crc);
}

// Drops a mapped file range's pages from this process's memory (they stay in the page cache).
// Read-only file pages: dropping them only costs a re-read should a neighbour need them.
void drop_pages(std::span<const std::byte> bytes) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

// Counts the NaN and inf among n stored floats whose bits are U (fp32, or bf16 and fp16, by
// `exponent`, their exponent mask): the exponent all ones, with a mantissa (NaN) or without (inf).
// On the bits, as verify() scans every value of a checkpoint.
template <class U>
void count_nonfinite(const std::byte* p, int64_t n, U exponent, int64_t& nan, int64_t& inf) {
  const U mantissa = static_cast<U>((exponent & -exponent) - 1);  // the bits below the exponent's lowest
  for (int64_t i = 0; i < n; ++i) {
    U u;
    std::memcpy(&u, p + i * static_cast<int64_t>(sizeof(U)), sizeof(U));
    if ((u & exponent) == exponent) ++((u & mantissa) ? nan : inf);
  }
}

}  // namespace

void count_nonfinite_stored(const std::byte* p, int64_t n, DType dt, int64_t& nan, int64_t& inf) {
  if (dt == DType::F32) count_nonfinite<uint32_t>(p, n, 0x7f800000u, nan, inf);
  else count_nonfinite<uint16_t>(p, n, dt == DType::BF16 ? 0x7f80 : 0x7c00, nan, inf);
}

std::string saved_layout_text(const json& meta) {
  const json topo = meta.value("topology", json::object());
  const int pp = topo.value("pp", 1);
  std::string t = "tp=" + std::to_string(topo.value("tp", 1)) + " pp=" + std::to_string(pp) +
                  " dp=" + std::to_string(topo.value("dp", 1));
  if (pp > 1 && topo.contains("pipeline_layers")) t += ", layers per stage " + topo["pipeline_layers"].dump();
  return t;
}

std::string meta_checksum(const json& meta) {
  json rest = meta;
  rest.erase("meta_crc32c");
  const std::string text = rest.dump();  // canonical: keys sorted, no spaces
  return data::crc32c_hex(data::crc32c(0, text.data(), text.size()));
}

int64_t TensorRegion::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<TensorRegion> flat_range_regions(const ParamSpec& p, int64_t begin, int64_t end) {
  std::vector<TensorRegion> out;
  const int64_t a = std::max(begin, p.offset) - p.offset;
  const int64_t b = std::min(end, p.offset + p.numel) - p.offset;
  if (a >= b) return out;
  // Local shard coordinates -> full tensor coordinates.
  auto full_offset = [&](int64_t row, int64_t col) -> std::vector<int64_t> {
    if (p.local_shape.size() == 1) return {col + (p.split == TpSplit::Rows ? p.shard_begin : 0)};
    return {row + (p.split == TpSplit::Rows ? p.shard_begin : 0), col + (p.split == TpSplit::Cols ? p.shard_begin : 0)};
  };
  if (p.local_shape.size() == 1) {
    out.push_back({full_offset(0, a), {b - a}, p.offset + a});
    return out;
  }
  const int64_t C = p.local_shape[1];
  int64_t ra = a / C, ca = a % C;
  const int64_t rb = b / C, cb = b % C;
  if (ra == rb) {  // inside one row
    out.push_back({full_offset(ra, ca), {1, cb - ca}, p.offset + a});
    return out;
  }
  if (ca > 0) {
    out.push_back({full_offset(ra, ca), {1, C - ca}, p.offset + a});
    ++ra;
  }
  if (ra < rb) out.push_back({full_offset(ra, 0), {rb - ra, C}, p.offset + ra * C});
  if (cb > 0) out.push_back({full_offset(rb, 0), {1, cb}, p.offset + rb * C});
  return out;
}

// ======================================================================================
// Reading
// ======================================================================================

namespace {

// Where a checkpoint stands in its directory's order of saves: meta.json's save_seq, a counter
// the coordinator raises with every publication (clock-free, so ranks and nodes whose clocks
// disagree still agree on it); then, for checkpoints saved before that field existed (seq -1,
// so before every numbered save), meta.json's saved_at_ns or else its modification time
// (written once, at publication); the step number breaks the remaining ties.
struct SavedCheckpoint {
  int64_t seq = -1, saved_ns = 0, step = 0;
  std::string name;
  auto key() const { return std::tie(seq, saved_ns, step); }
};

SavedCheckpoint saved_checkpoint(const fs::path& ckpt) {
  SavedCheckpoint c;
  c.name = ckpt.filename().string();
  c.step = step_of(c.name);
  const fs::path meta = ckpt / "meta.json";
  try {
    std::ifstream in(meta);
    const json m = json::parse(in);
    if (m.contains("save_seq") && m["save_seq"].is_number_integer()) c.seq = m["save_seq"].get<int64_t>();
    if (m.contains("saved_at_ns") && m["saved_at_ns"].is_number_integer()) {
      c.saved_ns = m["saved_at_ns"].get<int64_t>();
      return c;
    }
  } catch (const std::exception&) {
    // unreadable: its file time still orders it
  }
  struct stat st {};
  if (::stat(meta.c_str(), &st) == 0) c.saved_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  return c;
}

// The complete step_* checkpoints of a directory in the order they were saved, oldest first.
std::vector<SavedCheckpoint> saved_checkpoints(const fs::path& dir) {
  std::vector<SavedCheckpoint> found;
  for (const auto& e : fs::directory_iterator(dir))
    if (step_of(e.path().filename().string()) >= 0 && is_complete_checkpoint(e.path()))
      found.push_back(saved_checkpoint(e.path()));
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.key() < b.key(); });
  return found;
}

// The save_seq the next publication in `dir` takes: one past every numbered save there.
int64_t next_save_seq(const fs::path& dir) {
  int64_t next = 0;
  if (fs::is_directory(dir))
    for (const SavedCheckpoint& c : saved_checkpoints(dir)) next = std::max(next, c.seq + 1);
  return next;
}

// The checkpoint's meta.json, if it parses and matches its own checksum (meta_crc32c; one saved
// before that field existed only has to parse).
std::optional<json> sound_meta(const fs::path& ckpt) {
  std::ifstream in(ckpt / "meta.json");
  json m = json::parse(in, nullptr, false);
  if (!m.is_object()) return std::nullopt;
  if (m.contains("meta_crc32c") &&
      !(m["meta_crc32c"].is_string() && m["meta_crc32c"].get<std::string>() == meta_checksum(m)))
    return std::nullopt;
  return m;
}

// The checkpoint.dir a checkpoint was saved into, from its resolved config (<out>/checkpoints
// by default); empty if it does not say.
std::string saved_into(const json& meta) {
  const json cfg = meta.value("config", json::object());
  if (!cfg.is_object()) return {};
  const json ck = cfg.value("checkpoint", json::object());
  if (ck.is_object() && ck.contains("dir") && ck["dir"].is_string() && !ck["dir"].get<std::string>().empty())
    return ck["dir"].get<std::string>();
  if (cfg.contains("out") && cfg["out"].is_string()) return (fs::path(cfg["out"].get<std::string>()) / "checkpoints").string();
  return {};
}

// Their names alone, oldest save first.
std::vector<std::string> complete_checkpoints(const fs::path& dir) {
  std::vector<std::string> out;
  for (auto& c : saved_checkpoints(dir)) out.push_back(std::move(c.name));
  return out;
}

// The complete checkpoints of `dir` but `except`, oldest save first, as " step_A step_B (damaged: ...)":
// each marked with what is wrong with its files at a glance. *suggest: the newest unmarked one
// (empty if none), the one to continue from.
std::string listed_checkpoints(const fs::path& dir, const std::string& except, std::string* suggest) {
  std::string out;
  suggest->clear();
  for (const auto& c : complete_checkpoints(dir)) {
    if (c == except) continue;
    const std::string damage = files_damage(dir / c);
    out += " " + c + (damage.empty() ? "" : " (damaged: " + damage + ")");
    if (damage.empty()) *suggest = c;
  }
  return out;
}

// A complete checkpoint `name` moved aside as .old-<name>-<pid> by a save of the same step that
// was killed before it renamed its own copy into place (finish_save); empty if none.
fs::path moved_aside(const fs::path& dir, const std::string& name) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string(), prefix = ".old-" + name + "-";
    if (f.rfind(prefix, 0) == 0 && f.size() > prefix.size() &&
        f.find_first_not_of("0123456789", prefix.size()) == std::string::npos && is_complete_checkpoint(e.path()))
      return e.path();
  }
  return {};
}

// The abandoned-after-<S>-<time> folder holding checkpoint `name`: set aside there by a start-up
// (CheckpointManager::set_aside) killed before it pointed `latest` at S, the one it resumed
// from; empty if none.
fs::path set_aside_into(const fs::path& dir, const std::string& name) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("abandoned-after-", 0) == 0 && is_complete_checkpoint(e.path() / name))
      return e.path();
  return {};
}

// A pointer's content as it can be printed: quoted, control and non-ASCII bytes as \xNN, cut short.
std::string printable(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < 100; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out + (s.size() > 100 ? "...\"" : "\"");
}

}  // namespace

namespace {
// `latest` names `named`. A save publishes by renaming its directory into place, then pointing
// `latest` at it: a kill between the two leaves one complete checkpoint numbered after the one
// `latest` names (save_seq), and nothing else can (a rewind sets the later ones aside, and
// rotation never removes the newest). That one is the run's last save: resumed from, said so.
// Only metas that match their own checksum are trusted with that order: a damaged meta.json
// ranks its checkpoint before every numbered save (or anywhere, if its save_seq is what changed),
// and the named one is then loaded, to be refused by name, not passed over for an older one.
// A checkpoint copied in from another run may be numbered after it too (that run saved more
// often): the interrupted save is of a later step, and was saved into this directory or into the
// one the named checkpoint was (a run directory moved since).
fs::path newer_than_pointer(const fs::path& dir, const std::string& named, std::string* note) {
  const std::vector<SavedCheckpoint> saved = saved_checkpoints(dir);
  const auto it = std::find_if(saved.begin(), saved.end(), [&](const auto& c) { return c.name == named; });
  const std::optional<json> named_meta = sound_meta(dir / named);
  if (it == saved.end() || !named_meta) return dir / named;
  std::vector<const SavedCheckpoint*> newer;
  for (const SavedCheckpoint& c : saved) {
    if (c.seq < 0 || c.seq <= it->seq) continue;
    const std::optional<json> meta = sound_meta(dir / c.name);
    if (!meta || c.step <= it->step) continue;  // damaged, or of an earlier step: not what an interrupted save leaves
    std::error_code ec;
    const std::string into = saved_into(*meta);
    if (fs::equivalent(into, dir, ec) || into == saved_into(*named_meta)) newer.push_back(&c);
  }
  if (newer.size() != 1) return dir / named;  // none, or not what an interrupted save leaves
  if (note)
    *note = (dir / "latest").string() + " names " + named + ", but " + newer[0]->name +
            " was saved after it and is complete: its save was interrupted between publishing it and updating " +
            "latest. Continuing from " + newer[0]->name;
  return dir / newer[0]->name;
}
}  // namespace

std::optional<std::string> Checkpoint::find_latest(const std::string& checkpoints_dir, std::string* note) {
  const fs::path dir(checkpoints_dir);
  if (!fs::is_directory(dir)) return std::nullopt;
  const fs::path pointer = dir / "latest";
  std::error_code ec;
  if (fs::exists(fs::symlink_status(pointer, ec))) {
    // The pointer is what the last save published. If it cannot be followed, the newest step_*
    // is no safe stand-in (after a rewind it belongs to the abandoned run): ask the user.
    std::string name, why;
    std::ifstream in(pointer);
    if (fs::is_directory(pointer) || !in) {
      why = "cannot be read";
    } else {
      std::getline(in, name);
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
      if (name.empty())
        why = "is empty";
      else if (step_of(name) < 0 || name.find('/') != std::string::npos)
        why = "names " + printable(name) + ", which is not a step_* checkpoint in " + dir.string() +
              " (keel only follows a pointer to one beside it: the file holds its name, e.g. step_00000004)";
      else if (const fs::path aside = fs::exists(dir / name) ? fs::path() : moved_aside(dir, name); !aside.empty())
        throw CheckpointError(pointer.string() + " names " + name + ", which is at " + aside.string() +
                              ": a save of the same step moved it aside and was killed before it put its own copy "
                              "in place.\nTo resume from it, rename it back: mv " + aside.string() + " " +
                              (dir / name).string() + "\nNothing was changed.");
      else if (const fs::path folder = fs::exists(dir / name) ? fs::path() : set_aside_into(dir, name); !folder.empty()) {
        // The folder's name gives the checkpoint that run resumed from: abandoned-after-step_N-<time>.
        const std::string rest = folder.filename().string().substr(std::string("abandoned-after-").size());
        const std::string resumed = rest.substr(0, rest.find('-'));
        const bool there = step_of(resumed) >= 0 && is_complete_checkpoint(dir / resumed);
        throw CheckpointError(
            pointer.string() + " names " + name + ", which was set aside into " + folder.string() +
            " with the rest of an abandoned run: a run that resumed from " + (there ? resumed : "an earlier step") +
            " was killed before it pointed latest at it.\n" +
            (there ? "To continue that run: --resume " + (dir / resumed).string() + ". " : "") +
            "To go back to the abandoned run instead, move the checkpoints in " + folder.string() + " back into " +
            dir.string() + ". Nothing was changed.");
      } else if (!fs::exists(dir / name))
        why = "names " + printable(name) + ", which does not exist";
      else if (!is_complete_checkpoint(dir / name))
        why = "names " + printable(name) + ", which is not a complete checkpoint (no meta.json)";
      else
        return newer_than_pointer(dir, name, note).string();
    }
    const std::vector<std::string> complete = complete_checkpoints(dir);
    std::string msg = (pointer.string() + " " + why) +
                      ": keel does not guess which checkpoint to resume from (the highest step may belong to an "
                      "abandoned run).";
    if (complete.empty()) {
      msg += "\nThere is no complete checkpoint in " + dir.string() + "; to start afresh, remove " + pointer.string() +
             ".";
    } else {
      std::string suggest;
      msg += "\nComplete checkpoints in " + dir.string() + ", oldest save first:" + listed_checkpoints(dir, "", &suggest);
      msg += suggest.empty() ? "\nEvery one of them is damaged; to start afresh, remove " + pointer.string() +
                                   " (and the damaged checkpoints). Nothing was changed."
                             : "\nPass the one to continue from with --resume " + (dir / suggest).string() +
                                   " (or another of them), or repair " + pointer.string() + ". Nothing was changed.";
    }
    throw CheckpointError(msg);
  }
  // No pointer at all (removed by hand, or copied without it): the newest complete step
  // directory whose files are all there at their saved sizes; damaged newer ones are named.
  const std::vector<std::string> complete = complete_checkpoints(dir);
  if (complete.empty()) return std::nullopt;
  std::string skipped;
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    const std::string damage = files_damage(dir / *it);
    if (!damage.empty()) {
      skipped += (skipped.empty() ? "" : "; ") + *it + " (" + damage + ")";
      continue;
    }
    if (note)
      *note = "no `latest` pointer in " + dir.string() + ": continuing from the newest complete checkpoint there, " + *it +
              (skipped.empty() ? "" : ", past the damaged newer " + skipped);
    return (dir / *it).string();
  }
  return (dir / complete.back()).string();  // every one damaged: the load names what is wrong
}

std::string other_checkpoints_hint(const std::string& checkpoints_dir, const std::string& except,
                                   const std::string& flag) {
  std::string suggest;
  const std::string listed = fs::is_directory(checkpoints_dir) ? listed_checkpoints(checkpoints_dir, except, &suggest) : "";
  if (listed.empty()) return "\nThere is no other checkpoint in " + checkpoints_dir + ". Nothing was changed.";
  std::string msg = "\nThe other checkpoints in " + checkpoints_dir + ", oldest save first:" + listed + ".";
  return msg + (suggest.empty() ? " Every one of them is damaged. Nothing was changed."
                                : " Nothing was changed; to continue from the newest intact one: " + flag + " " +
                                      (fs::path(checkpoints_dir) / suggest).string());
}

namespace {
// A run directory (keel train's --out): its checkpoints are in checkpoint.dir, which its
// config.json records (by default <out>/checkpoints). Empty when `path` is no run directory.
std::string run_checkpoint_dir(const fs::path& path) {
  std::ifstream in(path / "config.json");
  if (!in) return "";
  if (fs::is_directory(path / "checkpoints")) return (path / "checkpoints").string();
  const nlohmann::json cfg = nlohmann::json::parse(in, nullptr, false);
  if (cfg.is_object() && cfg.contains("checkpoint") && cfg["checkpoint"].is_object() &&
      cfg["checkpoint"].contains("dir") && cfg["checkpoint"]["dir"].is_string())
    return cfg["checkpoint"]["dir"].get<std::string>();
  return "";
}

// The step_* directory `path_in` names: itself, or the checkpoint a pointer to one (a
// checkpoints or run directory, a `latest` file) leads to.
std::string checkpoint_named_by(const std::string& path_in) {
  std::string path = path_in;
  if (!fs::exists(path)) {
    // A checkpoint that a running job's rotation is removing has been renamed .old-NAME-PID first.
    std::string removing;
    const fs::path p(path), parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    std::error_code ec;
    for (fs::directory_iterator it(parent, ec), stop; !ec && it != stop; it.increment(ec))
      if (it->path().filename().string().starts_with(".old-" + p.filename().string() + "-"))
        removing = it->path().filename().string();
    throw CheckpointError("no checkpoint at " + path + ": no such file or directory" +
                          (removing.empty() ? ""
                                            : " (it is being removed, as " + removing +
                                                  ": the checkpoint rotation of the run saving there, "
                                                  "checkpoint.keep_last, removes its older checkpoints; give " +
                                                  parent.string() + " to load the newest)"));
  }
  // The pointer file itself (--resume run/checkpoints/latest): follow it.
  if (fs::is_regular_file(path) && fs::path(path).filename() == "latest") {
    const std::string dir = fs::path(path).parent_path().string();
    auto latest = Checkpoint::find_latest(dir.empty() ? "." : dir);
    if (!latest) throw CheckpointError("no checkpoint at " + path + ": nothing to follow it to");
    path = *latest;
  }
  if (!fs::exists(fs::path(path) / "meta.json")) {
    if (fs::exists(fs::path(path) / "latest") || !fs::exists(fs::path(path) / "model-tp00-pp00.safetensors")) {
      auto latest = Checkpoint::find_latest(path);
      const std::string run_dir = latest ? "" : run_checkpoint_dir(path);
      if (!run_dir.empty()) latest = Checkpoint::find_latest(run_dir);  // a run directory: its latest checkpoint
      if (!latest)
        throw CheckpointError("no checkpoint at " + path +
                              ": not a checkpoint (no meta.json) and no complete step_* checkpoint inside" +
                              (run_dir.empty() ? "" : " nor in its run's checkpoint.dir " + run_dir));
      path = *latest;
    } else if (fs::path(path).filename().string().rfind(".tmp-", 0) == 0) {
      throw CheckpointError(path + " is not a complete checkpoint (no meta.json): a save that was interrupted "
                                   "before it was published");
    } else {
      // keel writes meta.json before it renames a save into place: a published one without it
      // lost it afterwards.
      throw CheckpointError(path + " is not a complete checkpoint: its meta.json is missing (deleted, or lost to disk "
                                   "damage or an incomplete copy; a save writes it before publishing). Without it "
                                   "nothing in the checkpoint can be checked: resume from another one (--resume PATH)");
    }
  }
  return path;
}
}  // namespace

Checkpoint Checkpoint::open(const std::string& path_in) {
  // A pointer names the newest save of a run that may still be training (keel sample or eval
  // on a live run, --init-from its checkpoints). Its rotation can remove that save between
  // the pointer's reading and the opening of the files (they stay readable once opened: they
  // are mapped): the pointer then names the save that replaced it, so it is followed again.
  const bool pointer = !fs::exists(fs::path(path_in) / "meta.json");
  for (int attempt = 1;; ++attempt) {
    std::string path;  // the checkpoint the pointer named, once followed
    try {
      path = checkpoint_named_by(path_in);
      return open_directory(path);
    } catch (const CheckpointError& e) {
      // Named and there, yet unusable: damage, no race. Else a pointer is followed again (a
      // refusal that was no race comes back the same).
      if (!path.empty() && fs::exists(fs::path(path) / "meta.json")) throw;
      if (pointer && attempt < 5) continue;
      if (pointer || path.empty()) throw;
      throw CheckpointError(std::string(e.what()) + " (" + path +
                            " was removed while keel opened it: the checkpoint rotation of a run saving there, "
                            "checkpoint.keep_last, removes its older checkpoints; give " +
                            fs::path(path).parent_path().string() + " to load the newest)");
    }
  }
}

Checkpoint Checkpoint::open_directory(const std::string& path) {
  Checkpoint ck;
  ck.path_ = path;
  const std::string meta_path = (fs::path(path) / "meta.json").string();
  {
    std::ifstream in(meta_path);
    if (!in) throw CheckpointError("cannot read " + meta_path);
    try {
      ck.meta_ = json::parse(in);
    } catch (const json::exception& e) {
      throw CheckpointError(meta_path + " is corrupt (not valid JSON): " + e.what());
    }
  }
  if (ck.meta_.value("format", std::string()) != kFormat)
    throw CheckpointError(meta_path + " is not a keel checkpoint (format is not \"" + std::string(kFormat) + "\")");
  const int version = ck.meta_.value("format_version", 0);
  if (version < 1 || version > kCheckpointFormatVersion)
    throw CheckpointError(meta_path + ": format version " + std::to_string(version) +
                          " is not supported by this keel (it reads versions 1.." +
                          std::to_string(kCheckpointFormatVersion) + ")");
  if (!ck.meta_.contains("files") || !ck.meta_["files"].is_object() || ck.meta_["files"].empty())
    throw CheckpointError(meta_path + " lists no tensor files");
  // meta.json's own checksum (absent in checkpoints saved before it existed: they still load).
  if (ck.meta_.contains("meta_crc32c")) {
    const json& stored = ck.meta_["meta_crc32c"];
    const std::string got = meta_checksum(ck.meta_);
    if (!stored.is_string() || stored.get<std::string>() != got)
      throw CheckpointError(meta_path + " is damaged or was edited after the save: its content has checksum " + got +
                            ", its field meta_crc32c says " + stored.dump() +
                            ". It holds the iteration, the data position and every file's checksum, so the checkpoint "
                            "cannot be trusted; resume from another one (--resume PATH)");
  }
  validate_meta(ck.meta_, meta_path);

  for (const auto& [name, info] : ck.meta_["files"].items()) {
    const std::string file = (fs::path(path) / name).string();
    std::error_code size_ec;  // a file removed meanwhile is missing, not a filesystem_error
    const auto size = fs::file_size(file, size_ec);
    if (size_ec && !fs::exists(file))
      throw CheckpointError("checkpoint " + path + " is incomplete: file " + name + " is missing");
    if (size_ec) throw CheckpointError("checkpoint file " + file + " cannot be read: " + size_ec.message());
    const auto expected = info.value("bytes", int64_t{-1});
    const auto actual = static_cast<int64_t>(size);
    if (expected != actual)
      throw CheckpointError("checkpoint file " + file + " has " + std::to_string(actual) + " bytes, meta.json says " +
                            std::to_string(expected) + (actual < expected ? " (truncated)" : ""));
    // A header that does not hold together is most likely damage: the file's checksum says
    // so (and is checked only then, as verify() reads every byte anyway).
    const std::string want = info.value("crc32c", std::string());
    auto bad_header = [&](const std::string& what) {
      const std::string got = file_crc32c(file);
      if (got != want)
        return CheckpointError("checkpoint file " + file + " is damaged: its checksum is " + got + ", meta.json says " +
                               want + " (reading its header: " + what + ")");
      return CheckpointError("checkpoint file " + file + ": " + what);
    };
    std::shared_ptr<data::SafetensorsReader> reader;
    try {
      reader = std::make_shared<data::SafetensorsReader>(data::SafetensorsReader::open(file));
    } catch (const data::DataError& e) {
      throw bad_header(std::string("not a readable safetensors file: ") + e.what());
    }
    json chunks;
    try {
      chunks = json::parse(reader->metadata().at("keel")).at("chunks");
    } catch (const std::exception&) {
      throw bad_header("no keel chunk table in its safetensors metadata");
    }
    const size_t fi = ck.files_.size();
    ck.file_names_.push_back(name);
    ck.files_.push_back(reader);
    for (const auto& [entry, c] : chunks.items()) {
      const data::SafetensorsTensorInfo* t = reader->find(entry);
      if (!t) throw bad_header("the chunk table names '" + entry + "', which is not in the file");
      try {
        Chunk ch{fi, t, c.at("shape").get<std::vector<int64_t>>(), c.at("offset").get<std::vector<int64_t>>()};
        ck.chunks_[c.at("state").get<std::string>() + "/" + c.at("tensor").get<std::string>()].push_back(std::move(ch));
      } catch (const json::exception& e) {
        throw bad_header("the chunk table's entry '" + entry + "' is malformed: " + e.what());
      }
    }
  }
  return ck;
}

TrainProgress Checkpoint::progress() const {
  const json& p = meta_.at("progress");
  return {p.at("iteration"), p.at("consumed_samples"), p.at("consumed_tokens"), p.value("skipped_total", int64_t{0}),
          p.value("nan_total", int64_t{0})};
}

std::vector<std::string> Checkpoint::states() const {
  std::set<std::string> s;
  for (const auto& [key, _] : chunks_) s.insert(key.substr(0, key.find('/')));
  return {s.begin(), s.end()};
}

bool Checkpoint::has(const std::string& state, const std::string& tensor) const {
  return chunks_.count(state + "/" + tensor) != 0;
}

std::map<std::string, std::vector<int64_t>> Checkpoint::tensors(const std::string& state) const {
  std::map<std::string, std::vector<int64_t>> out;
  const std::string prefix = state + "/";
  for (const auto& [key, chunks] : chunks_)
    if (key.rfind(prefix, 0) == 0) out[key.substr(prefix.size())] = chunks.front().full_shape;
  return out;
}

DType Checkpoint::stored_dtype(const std::string& state, const std::string& tensor) const {
  auto it = chunks_.find(state + "/" + tensor);
  if (it == chunks_.end()) throw CheckpointError("checkpoint " + path_ + " has no " + state + " for tensor " + tensor);
  auto d = from_st(it->second.front().info->dtype);
  if (!d) throw CheckpointError("checkpoint " + path_ + ": " + state + " of " + tensor + " has an unsupported dtype");
  return *d;
}

bool vocab_padding_only(const std::string& name, const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                        int64_t vocab_size) {
  return (name == "tok_embed" || name == "lm_head") && a.size() == 2 && b.size() == 2 && a[1] == b[1] &&
         a[0] >= vocab_size && b[0] >= vocab_size && vocab_size > 0;
}

const std::vector<int64_t>& Checkpoint::shape(const std::string& state, const std::string& tensor) const {
  auto it = chunks_.find(state + "/" + tensor);
  if (it == chunks_.end()) throw CheckpointError("checkpoint " + path_ + " has no " + state + " for tensor " + tensor);
  return it->second.front().full_shape;
}

void Checkpoint::read(const std::string& state, const std::string& tensor, const TensorRegion& region, DType out_type,
                      void* out) const {
  auto it = chunks_.find(state + "/" + tensor);
  if (it == chunks_.end()) throw CheckpointError("checkpoint " + path_ + " has no " + state + " for tensor " + tensor);
  const size_t dims = region.shape.size();
  int64_t covered = 0;
  for (const Chunk& c : it->second) {
    if (c.offset.size() != dims || c.info->shape.size() != dims)
      throw CheckpointError("checkpoint " + path_ + ": " + state + " of " + tensor + " is stored with " +
                            std::to_string(c.info->shape.size()) + " dimensions, the model expects " +
                            std::to_string(dims));
    std::vector<int64_t> lo(dims), hi(dims);
    bool empty = false;
    for (size_t d = 0; d < dims; ++d) {
      lo[d] = std::max(region.offset[d], c.offset[d]);
      hi[d] = std::min(region.offset[d] + region.shape[d], c.offset[d] + c.info->shape[d]);
      empty |= lo[d] >= hi[d];
    }
    if (empty) continue;
    const DType src_type = *from_st(c.info->dtype);
    const auto bytes = files_[c.file]->bytes(*c.info);
    const char* src = reinterpret_cast<const char*>(bytes.data());
    char* dst = static_cast<char*>(out);
    // Copy row segments of the intersection (a 1-D tensor is a single row).
    const int64_t src_cols = dims == 2 ? c.info->shape[1] : c.info->shape[0];
    const int64_t dst_cols = dims == 2 ? region.shape[1] : region.shape[0];
    const int64_t row_lo = dims == 2 ? lo[0] : 0, row_hi = dims == 2 ? hi[0] : 1;
    const int64_t col_lo = lo[dims - 1], col_hi = hi[dims - 1];
    for (int64_t r = row_lo; r < row_hi; ++r) {
      const int64_t s_index = (dims == 2 ? (r - c.offset[0]) * src_cols : 0) + (col_lo - c.offset[dims - 1]);
      const int64_t d_index = (dims == 2 ? (r - region.offset[0]) * dst_cols : 0) + (col_lo - region.offset[dims - 1]);
      convert_elements(src + s_index * dtype_size(src_type), src_type, dst + d_index * dtype_size(out_type), out_type,
                       col_hi - col_lo);
    }
    int64_t n = 1;
    for (size_t d = 0; d < dims; ++d) n *= hi[d] - lo[d];
    covered += n;
  }
  // Chunks of one tensor never overlap, so covering exactly numel elements means covering all.
  if (covered != region.numel())
    throw CheckpointError("checkpoint " + path_ + ": " + state + " of tensor " + tensor + " covers " +
                          std::to_string(covered) + " of the " + std::to_string(region.numel()) +
                          " elements needed (region at " + shape_str(region.offset) + " of shape " +
                          shape_str(region.shape) + ")");
}

std::vector<float> Checkpoint::read_full(const std::string& state, const std::string& tensor) const {
  auto it = chunks_.find(state + "/" + tensor);
  if (it == chunks_.end()) throw CheckpointError("checkpoint " + path_ + " has no " + state + " for tensor " + tensor);
  TensorRegion r;
  r.shape = it->second.front().full_shape;
  r.offset.assign(r.shape.size(), 0);
  std::vector<float> out(static_cast<size_t>(r.numel()));
  read(state, tensor, r, DType::F32, out.data());
  return out;
}

std::string CheckpointProblems::refusal(const std::string& what, const std::string& path) const {
  std::string msg = damage.empty() ? "refusing to " + what + " checkpoint " + path + ", which holds non-finite values:"
                                   : "refusing to " + what + " a damaged checkpoint " + path + ":";
  for (const auto& p : damage) msg += "\n  " + p;
  for (const auto& p : nonfinite) msg += "\n  " + p;
  return msg;
}

CheckpointProblems Checkpoint::verify() const {
  CheckpointProblems problems;
  std::vector<std::string>& damage = problems.damage;
  // inf and NaN per "state/tensor", over all its chunks, for the tensors whose bytes are intact.
  std::map<std::string, std::array<int64_t, 3>> nonfinite;  // nan, inf, values
  for (size_t f = 0; f < files_.size(); ++f) {
    const std::string& name = file_names_[f];
    const std::string file = (fs::path(path_) / name).string();
    const json& info = meta_["files"][name];
    const data::SafetensorsReader& r = *files_[f];
    const json& crcs = info.value("tensors", json::object());
    for (const auto& t : r.tensors()) {
      auto b = r.bytes(t);
      const std::string got = data::crc32c_hex(data::crc32c(0, b.data(), b.size()));
      if (!crcs.contains(t.name)) {
        damage.push_back(file + ": tensor " + t.name + " has no checksum in meta.json");
      } else if (crcs[t.name].get<std::string>() != got) {
        damage.push_back(file + ": tensor " + t.name + " is corrupt (checksum " + got + ", meta.json says " +
                         crcs[t.name].get<std::string>() + ")");
      } else if (const auto dt = from_st(t.dtype)) {
        auto& [nan, inf, values] = nonfinite[t.name.substr(0, t.name.find('#'))];
        count_nonfinite_stored(b.data(), t.num_elements(), *dt, nan, inf);
        values += t.num_elements();
      }
    }
    // The whole file, header included (a damaged header that still parses is caught here).
    // From the mapping open() made, not by path: a running job's rotation may rename or remove
    // the checkpoint while it is verified, and the mapping still holds the files as opened.
    const auto whole = r.file_bytes();
    const std::string got = data::crc32c_hex(data::crc32c(0, whole.data(), whole.size()));
    if (got != info.value("crc32c", std::string()))
      damage.push_back(file + ": file checksum " + got + " does not match meta.json (" +
                       info.value("crc32c", std::string()) + ")");
    drop_pages(whole);  // a checkpoint larger than memory is verified file by file
  }
  for (const auto& [tensor, count] : nonfinite) {
    const auto [nan, inf, values] = count;
    if (nan + inf == 0) continue;
    problems.nonfinite.push_back(tensor + " holds " + std::to_string(nan) + " NaN and " + std::to_string(inf) +
                                 " inf among its " + std::to_string(values) + " values");
  }
  if (!problems.nonfinite.empty())
    problems.nonfinite.push_back(
        "(these files match their checksums: the values were saved so, by a run whose state had gone non-finite or "
        "a fault before the save, not damaged on disk; a model or run from them computes NaN. Use an earlier "
        "checkpoint)");
  // Completeness: every tensor of the saved model, every state the checkpoint claims, fully
  // covered. A shape other than the model's is said once per tensor (a meta.json whose model was
  // edited), not once per state.
  try {
    RunConfig cfg = parse_config(meta_.at("config"), path_ + "/meta.json");
    ParamTable full(cfg.model);
    std::set<std::string> reshaped;
    for (const std::string& state : meta_.value("states", std::vector<std::string>{})) {
      for (const ParamSpec& p : full.params()) {
        if (!has(state, p.name)) {
          damage.push_back("checkpoint " + path_ + ": " + state + " of tensor " + p.name + " is missing");
          continue;
        }
        const std::vector<Chunk>& chunks = chunks_.at(state + "/" + p.name);
        if (chunks.front().full_shape != p.shape) {
          if (reshaped.insert(p.name).second)
            damage.push_back("checkpoint " + path_ + " does not match the model in its meta.json: " +
                             shape_mismatch(p, chunks.front().full_shape, cfg.model));
          continue;
        }
        int64_t covered = 0;
        for (const Chunk& c : chunks) covered += c.info->num_elements();
        if (covered != p.logical_numel())
          damage.push_back("checkpoint " + path_ + ": " + state + " of tensor " + p.name + " holds " +
                           std::to_string(covered) + " of its " + std::to_string(p.logical_numel()) + " elements");
      }
    }
  } catch (const std::exception& e) {
    damage.push_back("checkpoint " + path_ + ": cannot check completeness: " + e.what());
  }
  return problems;
}

void check_tensors_match(const Checkpoint& ck, const std::string& state, const ParamTable& table, bool repadding) {
  ParamTable full(table.config());
  auto stored = ck.tensors(state);
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const ParamSpec& p : full.params()) {
    expected.insert(p.name);
    auto it = stored.find(p.name);
    if (it == stored.end())
      problems.push_back("tensor " + p.name + " " + shape_str(p.shape) + " is missing from the checkpoint");
    else if (it->second != p.shape && !(repadding && padded_otherwise(p, it->second, table.config())))
      problems.push_back(shape_mismatch(p, it->second, table.config()));
  }
  for (const auto& [name, shape] : stored)
    if (!expected.count(name)) problems.push_back("tensor " + name + " " + shape_str(shape) + " is not part of this model");
  if (!problems.empty()) {
    std::string msg = "checkpoint " + ck.path() + " (" + state + ") does not match the model:";
    for (size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
    if (problems.size() > 20) msg += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
    // The settings behind the shapes: the model fields the checkpoint's config and this one differ in.
    RunConfig now;
    now.model = table.config();
    std::string fields;
    for (const FieldChange& c : field_changes(ck.meta().value("config", json::object()).value("model", json::object()),
                                              to_json(now)["model"], "model"))
      if (c.field != "model.init_std" && c.field != "model.pad_vocab_to_multiple_of")
        fields += (fields.empty() ? "" : ", ") + c.field + " " + c.a + " in the checkpoint, " + c.b + " here";
    if (!fields.empty()) msg += "\n  (the model settings that differ: " + fields + ")";
    throw CheckpointError(msg);
  }
}

// ======================================================================================
// Writing
// ======================================================================================

namespace {

struct FilePlan {
  std::string name;
  std::vector<data::SafetensorsWriter::Entry> entries;
  struct Source {
    Tensor view;             // the chunk's elements in a rank buffer (working / master / m / v)
    std::unique_ptr<char[]> host;  // or their copy in host memory (view.bytes()), for a background save
  };
  std::vector<Source> sources;
  json chunks = json::object();
};

void add_chunks(FilePlan& plan, const std::string& state, const ParamTable& table, const ParamState& ps,
                const ParamSpec& p, const Tensor& buffer, int64_t begin, int64_t end) {
  // A tensor replicated over TP ranks (norms, GPT-2's output biases) is saved once, by TP
  // rank 0; the last stage's tied copy of tok_embed not at all (the first stage saves it).
  if (!table.is_primary(p)) return;
  const auto regions = flat_range_regions(p, begin, end);
  for (size_t k = 0; k < regions.size(); ++k) {
    const TensorRegion& r = regions[k];
    std::string entry = state + "/" + p.name;
    if (regions.size() > 1 || r.numel() != p.logical_numel()) entry += "#" + std::to_string(r.flat_begin);
    plan.entries.push_back({entry, to_st(buffer.dtype), r.shape});
    plan.sources.push_back({ps.flat_view(buffer, r.flat_begin, r.numel()), {}});
    plan.chunks[entry] = {{"tensor", p.name}, {"state", state}, {"shape", p.shape}, {"offset", r.offset}};
  }
}

// The files this rank writes: the working weights of its TP x PP shard (DP rank 0 only) and the
// optimizer state it owns.
std::vector<FilePlan> plan_files(const ParamTable& table, const ParamState& state, const RankPlace& place,
                                 bool separate_master) {
  char tp_pp[32], dp[16];
  std::snprintf(tp_pp, sizeof tp_pp, "tp%02d-pp%02d", place.tp_rank, place.pp_rank);
  std::snprintf(dp, sizeof dp, "dp%02d", place.dp_rank);
  const int64_t n = table.local_numel();
  const int64_t ob = state.optim_begin(), oe = std::min(state.optim_end(), n);
  std::vector<FilePlan> plans;
  if (place.writes_weights) {
    FilePlan model;
    model.name = std::string("model-") + tp_pp + ".safetensors";
    for (const ParamSpec& p : table.params()) add_chunks(model, "weight", table, state, p, state.working, 0, n);
    plans.push_back(std::move(model));
  }
  FilePlan optim;
  optim.name = std::string("optim-") + tp_pp + "-" + dp + ".safetensors";
  for (const ParamSpec& p : table.params()) {
    if (separate_master) add_chunks(optim, "master", table, state, p, state.master, ob, oe);
    add_chunks(optim, "adam_m", table, state, p, state.m, ob, oe);
    add_chunks(optim, "adam_v", table, state, p, state.v, ob, oe);
  }
  plans.push_back(std::move(optim));
  // A file with nothing in it is not written (e.g. a TP rank > 0 whose shard holds only replicas).
  std::erase_if(plans, [](const FilePlan& p) { return p.entries.empty(); });
  return plans;
}

// Writes one planned file; returns its manifest. Sources copied to host memory are written
// from there (and freed), the others staged through host memory one chunk at a time.
json write_file(const fs::path& dir, FilePlan& plan, Backend* be) {
  json meta = {{"format", kFormat}, {"format_version", kCheckpointFormatVersion}, {"chunks", plan.chunks}};
  data::SafetensorsWriter w((dir / plan.name).string(), plan.entries, {{"keel", meta.dump()}});
  std::vector<char> staging;
  for (auto& s : plan.sources) {
    if (be == nullptr) {
      w.write(s.host.get(), s.view.bytes());
      s.host.reset();
      continue;
    }
    staging.resize(s.view.bytes());
    be->copy_to_host(staging.data(), s.view);
    w.write(staging.data(), staging.size());
  }
  w.finish(/*sync=*/true);
  json tensors = json::object();
  for (size_t i = 0; i < plan.entries.size(); ++i) tensors[plan.entries[i].name] = data::crc32c_hex(w.tensor_crc(i));
  return {{"bytes", w.file_bytes()}, {"crc32c", data::crc32c_hex(w.file_crc())}, {"tensors", tensors}};
}

// Phase 2 of a save for one rank: its files, then a manifest of their checksums. `be` null:
// every source is already in host memory (a background save, which must not touch the device).
int64_t write_rank_part(const fs::path& tmp, std::vector<FilePlan>& plans, Backend* be, int world_rank) {
  json manifest = json::object();
  int64_t bytes = 0;
  for (FilePlan& plan : plans) {
    manifest[plan.name] = write_file(tmp, plan, be);
    bytes += manifest[plan.name]["bytes"].get<int64_t>();
  }
  maybe_crash("files");
  write_text_file_synced((tmp / ("manifest-rank" + std::to_string(world_rank) + ".json")).string(), manifest.dump());
  return bytes;
}

}  // namespace

// A save between its start and its publication: the meta.json it will get (taken at the start,
// since training moves on) and, for a background save, the thread writing this rank's files.
struct CheckpointManager::PendingSave {
  std::string name;
  fs::path tmp, final_path;
  bool coordinator = false;
  json meta;
  std::chrono::steady_clock::time_point start;
  double held_seconds = 0;  // training waited this long in begin_save (directory, host copy)
  std::thread writer;
  std::atomic<bool> written{false};
  std::string error;  // this rank's write failure (read after `written` or join)
  int64_t bytes = 0;
  double write_seconds = 0;  // this rank's files, from the start
  bool background = false;
};

CheckpointManager::CheckpointManager(std::string checkpoints_dir, CheckpointConfig cfg)
    : dir_(std::move(checkpoints_dir)), cfg_(cfg) {}

// A save still unpublished when the manager goes away (the run failed) stays a .tmp- directory,
// removed by the next run's clean_incomplete; only its writer must end first.
CheckpointManager::~CheckpointManager() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

std::string CheckpointManager::step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

SaveResult CheckpointManager::save(const RunConfig& cfg, const ParamTable& table, ParamState& state, Backend& backend,
                                   const TrainProgress& progress, const LossScaler& scaler, const RankPlace& place,
                                   const AgreeFn& agree, const nlohmann::json& health) {
  begin_save(cfg, table, state, backend, progress, scaler, place, agree, health, /*background=*/false);
  return finish_save(agree);
}

bool CheckpointManager::writing() const { return pending_ && !pending_->written.load(std::memory_order_acquire); }

void CheckpointManager::begin_save(const RunConfig& cfg, const ParamTable& table, ParamState& state,
                                   Backend& backend, const TrainProgress& progress, const LossScaler& scaler,
                                   const RankPlace& place, const AgreeFn& agree, const nlohmann::json& health,
                                   bool background) {
  if (pending_) throw std::logic_error("CheckpointManager::begin_save: the previous save is not finished");
  auto p = std::make_unique<PendingSave>();
  p->start = std::chrono::steady_clock::now();
  p->name = step_name(progress.iteration);
  p->tmp = fs::path(dir_) / (".tmp-" + p->name);
  p->final_path = fs::path(dir_) / p->name;
  p->coordinator = place.world_rank == 0;
  p->background = background;
  std::string error;
  auto guarded = [&](auto&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };

  // Phase 1: the coordinator makes the temporary directory.
  if (p->coordinator) guarded([&] {
      fs::create_directories(dir_);
      fs::remove_all(p->tmp);
      fs::create_directory(p->tmp);
    });
  if (!agree(error.empty())) fail_save(*p, error.empty() ? "another rank could not start the save" : error);

  // What meta.json will say: everything but the files, as of now.
  const bool separate_master = state.has_master() && !state.master_is_working();
  std::vector<std::string> states = {"weight", "adam_m", "adam_v"};
  if (separate_master) states.insert(states.begin() + 1, "master");
  p->meta = {
      {"format", kFormat},
      {"format_version", kCheckpointFormatVersion},
      {"keel_version", "0.1"},
      {"progress", progress_json(progress)},
      {"adam_step", state.adam_step},
      {"loss_scaler",
       {{"scale", scaler.scale_value()},
        {"growth_tracker", scaler.growth_tracker()},
        {"hysteresis_tracker", scaler.hysteresis_tracker()}}},
      // The sampler is a pure function of (seed, consumed samples): this is the data position.
      {"data", {{"consumed_samples", progress.consumed_samples}, {"seed", cfg.train.seed}, {"train", cfg.data.train}}},
      {"topology",
       {{"tp", cfg.parallel.tp},
        {"pp", cfg.parallel.pp},
        {"dp", cfg.parallel.dp},
        {"pipeline_layers",
         pipeline_layer_counts(cfg.model, static_cast<int>(cfg.parallel.pp * cfg.parallel.virtual_stages),
                               cfg.parallel.pipeline_split())}}},
      {"precision", precision_name(cfg.precision.mode)},
      {"weight_dtype", std::string(dtype_name(state.working.dtype))},
      {"states", states},
      {"master_is_weight", state.master_is_working()},
      {"config", to_json(cfg)}};
  // What a restart must reproduce: the probe batch's loss and per-tensor norms.
  if (!health.is_null()) p->meta["health"] = health;
  if (!source_.is_null()) p->meta["source"] = source_;
  if (!data_files_.is_null()) p->meta["data"]["files"] = data_files_;
  if (!blend_history_.is_null()) p->meta["data"]["blend"] = blend_history_;

  // Phase 2: every rank writes its files and a manifest of their checksums; in the background
  // from a host copy of the state taken now, or here, streaming from the device.
  std::vector<FilePlan> plans = plan_files(table, state, place, separate_master);
  if (!background) {
    guarded([&] { p->bytes = write_rank_part(p->tmp, plans, &backend, place.world_rank); });
    p->error = error;
    p->written = true;
    pending_ = std::move(p);
    return;
  }
  guarded([&] {
    for (FilePlan& plan : plans)
      for (auto& s : plan.sources) {
        s.host.reset(new char[s.view.bytes()]);  // not zero-filled: the copy fills it
        backend.copy_to_host(s.host.get(), s.view);
      }
  });
  if (!error.empty()) {  // out of host memory for the copy: the save fails at its finish, on every rank
    p->error = error;
    p->written = true;
  } else {
    PendingSave* ps = p.get();
    ps->writer = std::thread([ps, plans = std::move(plans), rank = place.world_rank]() mutable {
      try {
        ps->bytes = write_rank_part(ps->tmp, plans, nullptr, rank);
      } catch (const std::exception& e) {
        ps->error = e.what();
      }
      ps->write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - ps->start).count();
      ps->written.store(true, std::memory_order_release);
    });
  }
  p->held_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - p->start).count();
  pending_ = std::move(p);
}

SaveResult CheckpointManager::finish_save(const AgreeFn& agree) {
  if (!pending_) throw std::logic_error("CheckpointManager::finish_save: no save in progress");
  std::unique_ptr<PendingSave> p = std::move(pending_);
  const auto finish_start = std::chrono::steady_clock::now();
  if (p->writer.joinable()) p->writer.join();
  if (!agree(p->error.empty())) fail_save(*p, p->error.empty() ? "another rank could not write its part" : p->error);

  // Phase 3: the coordinator merges the manifests into meta.json (the file that makes a save
  // complete), renames the directory into place and points `latest` at it.
  std::string error;
  int64_t total_bytes = 0;  // every rank's files, from the manifests
  bool in_place = false, pointed_to = false;  // renamed to step_*; named by `latest`
  fs::path old;  // an earlier save of the same step, moved aside until `latest` names the new one
  if (p->coordinator) try {
      const fs::path dir(dir_);
      json files = json::object();
      for (const auto& e : fs::directory_iterator(p->tmp)) {
        const std::string fname = e.path().filename().string();
        if (fname.rfind("manifest-rank", 0) != 0) continue;
        std::ifstream in(e.path());
        const json part = json::parse(in);
        for (const auto& [k, v] : part.items()) files[k] = v;
        fs::remove(e.path());
      }
      json meta = std::move(p->meta);
      meta["saved_at"] = utc_now();
      // keep_last ranks saves by save_seq, not by step: after a rewind the new run's saves are the
      // recent ones. (saved_at_ns is what keel ranked them by before save_seq, and still writes.)
      meta["save_seq"] = next_seq_ = std::max(next_seq_, next_save_seq(dir));
      ++next_seq_;
      meta["saved_at_ns"] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
      meta["files"] = files;
      // How long the save took (the slowest rank's files, as every rank has agreed they are
      // written; a background save: this rank's writer): a resumed run's --time-limit keeps room
      // for one before it has timed a save of its own.
      meta["save_seconds"] = p->background ? p->write_seconds
                                           : std::chrono::duration<double>(std::chrono::steady_clock::now() - p->start).count();
      for (const auto& [_, info] : files.items()) total_bytes += info.at("bytes").get<int64_t>();
      meta["meta_crc32c"] = meta_checksum(meta);
      maybe_crash("meta");
      write_text_file_synced((p->tmp / "meta.json").string(), meta.dump(2));
      data::detail::sync_directory(p->tmp.string());

      // An existing save of the same step (from a replayed stretch of training) is moved
      // aside first and removed once `latest` names the new one: until then it is what a
      // failure puts back.
      if (fs::exists(p->final_path)) {
        old = dir / (".old-" + p->name + "-" + std::to_string(::getpid()));
        fs::rename(p->final_path, old);
      }
      maybe_crash("rename");
      fs::rename(p->tmp, p->final_path);
      in_place = true;
      data::detail::sync_directory(dir.string());
      maybe_crash("latest");
      write_text_file_synced((dir / ".latest.tmp").string(), p->name + "\n");
      fs::rename(dir / ".latest.tmp", dir / "latest");
      pointed_to = true;
      ++published_;
      data::detail::sync_directory(dir.string());
      if (!old.empty()) fs::remove_all(old);
      rotate();
      maybe_damage(p->final_path);
    } catch (const std::exception& e) {
      error = e.what();
      // In place but not named by `latest` (a full disk at the pointer): undone, so that the
      // directory holds what the error says, the previous checkpoints and nothing of this one.
      std::error_code ec;
      if (in_place && !pointed_to) {
        fs::rename(p->final_path, p->tmp, ec);
        fs::remove(fs::path(dir_) / ".latest.tmp", ec);
      }
      // The save it replaced back under its name (`latest` may name it).
      if (!pointed_to && !old.empty() && !fs::exists(p->final_path, ec)) fs::rename(old, p->final_path, ec);
    }
  if (!agree(error.empty())) fail_save(*p, error.empty() ? "the coordinating rank could not publish it" : error);

  SaveResult r;
  r.path = p->final_path.string();
  r.bytes = p->coordinator ? total_bytes : p->bytes;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - p->start).count();
  r.background = p->background;
  r.write_seconds = p->background ? p->write_seconds : r.seconds;
  // Training also waits for this half: the writer (when it is behind) and the publication.
  r.held_seconds = p->background
                       ? p->held_seconds +
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - finish_start).count()
                       : r.seconds;
  return r;
}

void CheckpointManager::fail_save(const PendingSave& p, const std::string& why) {
  std::error_code ec;
  if (p.coordinator) fs::remove_all(p.tmp, ec);
  bool earlier = false;
  try {
    earlier = fs::is_directory(dir_) && !complete_checkpoints(dir_).empty();
  } catch (const std::exception&) {
    // an unreadable directory: say nothing about what it holds
  }
  // A folder emptied, removed or replaced while the run went on lost saves this run made.
  const std::string before = earlier ? "; the previous checkpoints are untouched"
                             : published_ > 0
                                 ? "; " + dir_ + " holds no complete checkpoint now, though this run saved " +
                                       std::to_string(published_) + " into it (removed, or the folder replaced, since)"
                                 : "; no checkpoint had been saved before it";
  throw CheckpointError("saving checkpoint " + p.name + " in " + dir_ + " failed: " + why + before);
}

std::vector<std::string> CheckpointManager::set_resumed_from(int64_t step, const std::string& resumed) {
  resumed_step_ = step;
  const fs::path from = fs::absolute(resumed).lexically_normal();
  std::error_code ec;
  const bool here = fs::equivalent(from.parent_path(), dir_, ec) && step_of(from.filename().string()) >= 0;
  resumed_seq_ = -1;
  if (here) {
    const int64_t seq = saved_checkpoint(from).seq;
    resumed_seq_ = seq >= 0 ? seq : std::numeric_limits<int64_t>::max();
  }
  // Every save already there came before this run; this run's take save_seq >= run_start_seq_
  // even after set_aside has moved the highest-numbered ones away.
  next_seq_ = run_start_seq_ = next_save_seq(dir_);
  std::vector<std::string> out;
  if (!fs::is_directory(dir_)) return out;
  for (const SavedCheckpoint& c : saved_checkpoints(dir_))
    if (abandoned(c.seq, c.step)) out.push_back(c.name);
  return out;
}

std::string CheckpointManager::set_aside(const std::vector<std::string>& names, const std::string& resumed_path) {
  const fs::path dir(dir_);
  char when[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", std::gmtime(&t));
  fs::path folder = dir / ("abandoned-after-" + step_name(resumed_step_) + "-" + when);
  if (fs::exists(folder)) folder += "-" + std::to_string(::getpid());
  std::vector<std::string> moved;
  try {
    fs::create_directory(folder);
    for (const std::string& name : names) {
      fs::rename(dir / name, folder / name);
      moved.push_back(name);
    }
    const fs::path resumed = fs::absolute(resumed_path).lexically_normal();
    std::error_code ec;
    if (fs::equivalent(resumed.parent_path(), dir, ec) && step_of(resumed.filename().string()) >= 0) {
      write_text_file_synced((dir / ".latest.tmp").string(), resumed.filename().string() + "\n");
      fs::rename(dir / ".latest.tmp", dir / "latest");
    }
    data::detail::sync_directory(dir.string());
  } catch (const std::exception& e) {
    std::error_code ec;
    for (const std::string& name : moved) fs::rename(folder / name, dir / name, ec);
    fs::remove(folder, ec);  // only if empty: nothing of the user's goes
    throw CheckpointError("could not move the abandoned checkpoints into " + folder.string() + ": " + e.what());
  }
  return folder.string();
}

bool CheckpointManager::abandoned(int64_t seq, int64_t step) const {
  return resumed_step_ >= 0 && seq < run_start_seq_ && (resumed_seq_ < 0 || step > resumed_step_ || seq > resumed_seq_);
}

void CheckpointManager::rotate() {
  const fs::path dir(dir_);
  // The current trajectory in save order: the checkpoints up to the one this run resumed from,
  // then this run's saves. A rewind's abandoned run (higher steps saved before this run) is
  // left out and never removed: keel cannot know whether the user still wants it (set_resumed_from).
  std::vector<std::string> saves;
  for (SavedCheckpoint& c : saved_checkpoints(dir))
    if (!abandoned(c.seq, c.step)) saves.push_back(std::move(c.name));
  std::string latest;
  std::ifstream in(dir / "latest");
  std::getline(in, latest);
  for (size_t i = 0; i < saves.size(); ++i) {
    const bool recent = i + static_cast<size_t>(cfg_.keep_last) >= saves.size();
    const bool milestone = cfg_.keep_every > 0 && step_of(saves[i]) % cfg_.keep_every == 0;
    if (recent || milestone || saves[i] == latest) continue;
    // Renamed out of the step_* names first: a kill during the removal then leaves a .old-
    // directory that the next run's clean_incomplete removes, not a step_* missing some files.
    const fs::path doomed = dir / (".old-" + saves[i] + "-" + std::to_string(::getpid()));
    std::error_code ec;
    fs::rename(dir / saves[i], doomed, ec);
    if (ec) continue;
    maybe_crash("prune");
    fs::remove_all(doomed, ec);
  }
}

std::vector<std::string> CheckpointManager::clean_incomplete() {
  const fs::path dir(dir_);
  std::vector<std::string> removed;
  if (!fs::is_directory(dir)) return removed;
  std::string latest;
  std::ifstream in(dir / "latest");
  std::getline(in, latest);
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".old-", 0) == 0 || name == ".latest.tmp") {
      // Kept: the checkpoint `latest` names, moved aside by an interrupted save of its step
      // (find_latest says to rename it back). Rotation's leftovers are never the one `latest` names.
      if (!latest.empty() && !fs::exists(dir / latest) && e.path() == moved_aside(dir, latest)) continue;
      std::error_code ec;
      fs::remove_all(e.path(), ec);
      removed.push_back(name);
    }
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

// ======================================================================================
// Restoring
// ======================================================================================

namespace {

// Reads (state, tensor) over the flat range [begin, end) into a rank buffer.
void read_into(const Checkpoint& ck, const std::string& state, const ParamSpec& p, const ParamTable& table,
               const ParamState& ps, const Tensor& buffer, int64_t begin, int64_t end, Backend& be) {
  std::vector<char> staging;
  for (const TensorRegion& r : flat_range_regions(p, begin, end)) {
    staging.resize(static_cast<size_t>(r.numel()) * dtype_size(buffer.dtype));
    read_param(ck, state, p, table.config().vocab_size, r, buffer.dtype, staging.data());
    be.copy_from_host(ps.flat_view(buffer, r.flat_begin, r.numel()), staging.data());
  }
}

}  // namespace

void read_param(const Checkpoint& ck, const std::string& state, const ParamSpec& p, int64_t vocab_size,
                const TensorRegion& region, DType out_type, void* out) {
  const std::vector<int64_t>& stored = ck.shape(state, p.name);
  if (stored == p.shape || region.shape.size() != 2) {
    ck.read(state, p.name, region, out_type, out);
    return;
  }
  // Rows [r0, r0 + R) of a vocabulary tensor padded otherwise (check_tensors_match allowed it):
  // those below vocab_size from the checkpoint, the rest zero. The region's rows are whole
  // stretches of its columns, one after another in `out`.
  const int64_t r0 = region.offset[0], R = region.shape[0], W = region.shape[1];
  const int64_t real = std::clamp(vocab_size - r0, int64_t{0}, R);
  if (real > 0) {
    TensorRegion part = region;
    part.shape[0] = real;
    ck.read(state, p.name, part, out_type, out);
  }
  std::memset(static_cast<char*>(out) + static_cast<size_t>(real * W) * dtype_size(out_type), 0,
              static_cast<size_t>((R - real) * W) * dtype_size(out_type));
}

std::vector<float> read_padding_rows(const Checkpoint& ck, const std::string& state, const std::string& tensor,
                                     int64_t vocab_size) {
  const std::vector<int64_t>& s = ck.shape(state, tensor);
  if (s.size() != 2 || s[0] <= vocab_size) return {};
  TensorRegion pad;
  pad.offset = {vocab_size, 0};
  pad.shape = {s[0] - vocab_size, s[1]};
  std::vector<float> values(static_cast<size_t>(pad.numel()));
  ck.read(state, tensor, pad, DType::F32, values.data());
  return values;
}

std::map<std::string, DroppedPadding> repadded_tensors(const Checkpoint& ck, const ParamTable& table) {
  std::map<std::string, DroppedPadding> out;
  const int64_t vocab = table.config().vocab_size;
  const ParamTable full(table.config());  // every rank says the same of every tensor, held or not
  const std::optional<std::string> masters = master_source(ck, full);
  for (const ParamSpec& p : full.params()) {
    if (!ck.has("weight", p.name)) continue;
    const std::vector<int64_t>& stored = ck.shape("weight", p.name);
    if (stored == p.shape || !padded_otherwise(p, stored, table.config())) continue;
    DroppedPadding& d = out[p.name];
    d.rows_saved = stored[0];
    d.rows_now = p.shape[0];
    auto sumsq = [&](const std::string& state) {
      double s = 0;
      for (float v : read_padding_rows(ck, state, p.name, vocab)) s += static_cast<double>(v) * v;
      return s;
    };
    d.weight_sumsq = sumsq("weight");
    if (masters) d.master_sumsq = sumsq(*masters);
  }
  return out;
}

std::optional<std::string> master_source(const Checkpoint& ck, const ParamTable& table) {
  auto covers = [&](const std::string& state) {
    for (const ParamSpec& p : table.params())
      if (!ck.has(state, p.name)) return false;
    return true;
  };
  if (covers("master")) return "master";
  bool f32_weights = covers("weight");
  for (const ParamSpec& p : table.params())
    if (f32_weights && ck.stored_dtype("weight", p.name) != DType::F32) f32_weights = false;
  if (f32_weights) return "weight";
  return std::nullopt;
}

std::vector<std::string> model_differences(const json& a, const json& b, const std::string& a_name,
                                           const std::string& b_name) {
  std::vector<std::string> diffs;  // fields written only when set may be missing on either side ("-")
  for (const FieldChange& c : field_changes(a, b, "model"))
    diffs.push_back(c.field + ": " + a_name + " " + c.a + ", " + b_name + " " + c.b);
  return diffs;
}

Checkpoint open_undamaged(const std::string& path, const std::string& what) {
  Checkpoint ck = Checkpoint::open(path);
  if (const CheckpointProblems problems = ck.verify(); !problems.empty())
    throw CheckpointError(problems.refusal(what, ck.path()));
  return ck;
}

TrainProgress restore_for_resume(const Checkpoint& ck, const RunConfig& cfg, const ParamTable& table,
                                 ParamState& state, Backend& backend, LossScaler& scaler, const RankPlace& place,
                                 std::vector<std::string>* warnings) {
  // The model must be the same network.
  const json saved = ck.meta().at("config");
  const json now = to_json(cfg);
  // Another vocabulary padding is the same network (the padding rows are no token's); the
  // tensors are re-padded below, and the change is listed with the other settings.
  // model.init_std only draws a fresh run's weights. model.max_seq_len is no tensor's shape under
  // RoPE or ALiBi (a longer context, as Megatron's context extension continues a run); GPT-2's
  // learned positions are, and check_tensors_match refuses those by their shapes.
  std::vector<std::string> diffs = model_differences(saved["model"], now["model"], "checkpoint", "config");
  std::vector<std::string> harmless;
  std::erase_if(diffs, [&](const std::string& d) {
    if (d.starts_with("model.init_std:") || d.starts_with("model.max_seq_len:")) harmless.push_back(d);
    return d.starts_with("model.pad_vocab_to_multiple_of:") || d.starts_with("model.init_std:") ||
           d.starts_with("model.max_seq_len:");
  });
  if (warnings)
    for (const std::string& d : harmless)
      warnings->push_back(d + (d.starts_with("model.init_std:")
                                   ? " (it only draws a fresh run's weights: no change to a resumed one)"
                                   : " (no tensor's shape here: the same weights continue, over positions the "
                                     "checkpoint may never have trained)"));
  if (!diffs.empty()) {
    std::string msg = "checkpoint " + ck.path() + " was saved for another model, it cannot be resumed with this config:";
    for (const auto& d : diffs) msg += "\n  " + d;
    throw CheckpointError(msg);
  }
  check_tensors_match(ck, "weight", table, /*repadding=*/true);

  // Optimizer state: all of it, for every tensor, or the resume is refused.
  const bool needs_master = state.has_master() && !state.master_is_working();
  std::vector<std::string> missing;
  for (const ParamSpec& p : table.params())
    for (const char* s : {"adam_m", "adam_v"})
      if (!ck.has(s, p.name)) missing.push_back(std::string(s) + " of " + p.name);
  const auto master_from = master_source(ck, table);
  if ((needs_master || cfg.precision.mode == PrecisionMode::FP32) && !master_from)
    missing.push_back("fp32 master weights (no \"master\" state and the weights are not fp32)");
  if (!missing.empty()) {
    std::string msg = "checkpoint " + ck.path() + " cannot be resumed: its optimizer state is missing or partial (" +
                      std::to_string(missing.size()) + " pieces missing, e.g. " + missing.front() + ").";
    msg += "\nA resume needs the fp32 master weights and both Adam moments of every tensor. To start a new run from"
           "\nthis checkpoint's weights (fresh optimizer, step 0), use --init-from " + ck.path();
    throw CheckpointError(msg);
  }

  const int64_t n = table.local_numel();
  const int64_t ob = state.optim_begin(), oe = std::min(state.optim_end(), n);
  for (const ParamSpec& p : table.params()) {
    if (!state.m.empty()) {  // (a state for evaluation only has no moments)
      read_into(ck, "adam_m", p, table, state, state.m, ob, oe, backend);
      read_into(ck, "adam_v", p, table, state, state.v, ob, oe, backend);
    }
    if (needs_master) read_into(ck, *master_from, p, table, state, state.master, ob, oe, backend);
    // Working weights: the stored ones when their dtype matches (bit-exact), else the masters'.
    const std::string wsrc =
        ck.stored_dtype("weight", p.name) == state.working.dtype || !master_from ? "weight" : *master_from;
    read_into(ck, wsrc, p, table, state, state.working, 0, n, backend);
  }
  state.adam_step = ck.adam_step();
  const json& ls = ck.meta().at("loss_scaler");
  if (scaler.enabled()) {
    if (ck.precision() == "fp16")
      scaler.restore(ls.at("scale"), ls.at("growth_tracker"), ls.at("hysteresis_tracker"));
    else if (warnings)
      warnings->push_back("the checkpoint was not saved in fp16: the loss scaler starts fresh");
  }

  if (warnings) {
    if (ck.precision() != precision_name(cfg.precision.mode))
      warnings->push_back("precision changes from " + ck.precision() + " to " + precision_name(cfg.precision.mode) +
                          ": the run continues from the same fp32 state but will not be bit-identical");
    // Each changed setting by name (a whole section's JSON hides the one change in it).
    std::vector<std::string> changed;
    std::string order_fields;  // the settings the sample order is a function of
    for (const char* section : {"optimizer", "schedule", "train", "data", "parallel"})
      if (saved.contains(section))
        for (const FieldChange& c : field_changes(saved[section], now[section], section)) {
          // New weights for the same number of sources: the run's own note on the blend says
          // what they do (each source continues where it left off, or the blend restarts).
          if (c.field.starts_with("data.train_weights.") && saved[section].contains("train_weights") &&
              saved[section]["train_weights"].size() == now[section].value("train_weights", json::array()).size())
            continue;
          changed.push_back(c.field + ": " + c.a + " -> " + c.b);
          if (c.field == "train.seed" || c.field == "train.seq_len" || c.field == "data.shuffle")
            order_fields += (order_fields.empty() ? "" : ", ") + c.field;
        }
    for (const FieldChange& c : field_changes(saved["model"], now["model"], "model"))
      if (c.field == "model.pad_vocab_to_multiple_of") changed.push_back(c.field + ": " + c.a + " -> " + c.b);
    if (!changed.empty()) {
      std::string text = "settings changed since the checkpoint:";
      for (const std::string& c : changed) text += "\n    " + c;
      if (!order_fields.empty())
        text += "\n  With another " + order_fields + " the samples come in another order (other windows) from sample " +
                std::to_string(ck.progress().consumed_samples) +
                " on: some of the current epoch may repeat or be skipped";
      // An evaluation reads eval_batches micro-batches' windows: another micro_batch (to fit
      // another GPU's memory, say) evaluates other windows, and the validation curve steps.
      const auto windows = [](const json& t) {
        return t.value("eval_batches", int64_t{0}) * t.value("micro_batch", int64_t{0});
      };
      const bool validates = cfg.train.eval_batches > 0 && (!cfg.data.val.empty() || !cfg.data.val_sets.empty());
      if (validates && saved.contains("train") && windows(saved["train"]) != windows(now["train"]))
        text += "\n  Validation now reads the first " + std::to_string(windows(now["train"])) +
                " windows of each set (train.eval_batches x train.micro_batch), not " +
                std::to_string(windows(saved["train"])) +
                ": validation losses before and after this resume are not comparable (a set of fewer windows is read "
                "whole either way)";
      warnings->push_back(text);
    }
    // The schedule follows train.steps (the decay window) and the schedule section: say what the
    // next step's learning rate becomes, which the changes above only imply.
    const int64_t next = ck.progress().iteration + 1;
    try {
      const RunConfig was = parse_config(saved, ck.path() + "/meta.json");
      const double lr_was = learning_rate(was, next), lr_now = learning_rate(cfg, next);
      if (lr_was != lr_now) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "the learning rate of step %lld changes from %.6g (the checkpoint's settings) to %.6g",
                      static_cast<long long>(next), lr_was, lr_now);
        warnings->push_back(buf);
      }
    } catch (const std::exception&) {
      // A config of an older keel that this one no longer parses: the changes above say enough.
    }
  }
  return ck.progress();
}

namespace {
// Llama weights trained with RoPE load into an ALiBi model and back, and weights load with
// another sliding window or none (the same tensors; a change of embedding_norm, or gpt2's
// position table, is a tensor mismatch), but they meet another network: say so (restart
// verification then compares the weights, not the probe loss: model_function_changes).
std::string attention_change_note(const Checkpoint& ck, const ModelConfig& now) {
  const json saved = ck.meta().value("config", json::object()).value("model", json::object());
  std::string note;
  const std::string before = saved.value("position_embedding", now.is_gpt2() ? "learned" : "rope");
  if (before != now.position_embedding())
    note += "; NOTE: the checkpoint was trained with model.position_embedding \"" + before + "\", this run uses \"" +
            now.position_embedding() + "\"";
  auto window = [](int64_t w) { return w > 0 ? std::to_string(w) : std::string("none"); };
  const int64_t saved_window = saved.value("sliding_window", int64_t{0});
  if (saved_window != now.sliding_window)
    note += "; NOTE: the checkpoint was trained with model.sliding_window " + window(saved_window) +
            ", this run uses " + window(now.sliding_window);
  return note;
}

// A config value as JSON text ("-": not set), a float field as the shortest decimal that reads
// back as the float (1e-05, not the double of the float, 9.999999747378752e-06; as
// keel convert's export writes them).
std::string model_value_text(const std::string& dumped) {
  if (dumped == "-") return dumped;
  const json v = json::parse(dumped, nullptr, false);
  if (!v.is_number_float()) return dumped;
  char buf[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v.get<double>());
    if (std::strtof(buf, nullptr) == static_cast<float>(v.get<double>())) break;
  }
  return json(std::strtod(buf, nullptr)).dump();
}

// The model fields of init_weights_from's warnings (model_function_changes), each with both
// values and what to do if it is a slip: a --set or an edited config there finetunes a model other
// than the checkpoint's without a word otherwise. Not a refusal: a new rope_theta can be a
// deliberate context extension. Attention's changes have their NOTE (attention_change_note).
std::vector<std::string> model_change_warnings(const std::vector<FieldChange>& changes) {
  std::vector<std::string> warnings;
  for (const FieldChange& c : changes) {
    if (c.field == "model.position_embedding" || c.field == "model.sliding_window") continue;
    const std::string a = model_value_text(c.a), b = model_value_text(c.b);
    const bool rope = c.field == "model.rope_theta" || c.field.starts_with("model.rope_scaling");
    const std::string top = c.field.substr(0, c.field.find('.', 6));  // model.rope_scaling of its sub-fields
    warnings.push_back("WARNING " + c.field + ": the checkpoint was trained with " + (a == "-" ? "none" : a) +
                       ", this run uses " + (b == "-" ? "none" : b) +
                       ". The tensors keep their shapes, so the weights load, but this run computes another function "
                       "of them than the one they were trained as: unless that is meant" +
                       (rope ? " (a context extension)" : "") + ", " +
                       (a == "-" ? "leave " + top + " out" : "--set " + c.field + "=" + a) +
                       " as the checkpoint has it");
  }
  return warnings;
}
}  // namespace

std::vector<FieldChange> model_function_changes(const Checkpoint& ck, const ModelConfig& now) {
  const json saved = ck.meta().value("config", json::object()).value("model", json::object());
  RunConfig cfg;  // the run's model as a checkpoint records it (to_json), to compare field by field
  cfg.model = now;
  std::vector<FieldChange> out;
  for (FieldChange& c : field_changes(saved, to_json(cfg)["model"], "model")) {
    // Not the function: the vocabulary's padding (no token's rows; the load re-pads), init_std
    // (a fresh initialisation's, which the load replaces), max_seq_len (a limit; a shape where
    // positions are learned, refused by the tensor check), RoPE's settings without RoPE.
    if (c.field == "model.pad_vocab_to_multiple_of" || c.field == "model.init_std" || c.field == "model.max_seq_len")
      continue;
    if ((c.field == "model.rope_theta" || c.field.starts_with("model.rope_scaling")) && !now.rope().rotates()) continue;
    out.push_back(std::move(c));
  }
  return out;
}

std::string init_weights_from(const Checkpoint& ck, const ParamTable& table, ParamState& state, Backend& backend,
                              const RankPlace& place, std::vector<std::string>* warnings) {
  auto from = master_source(ck, table);
  const std::string source = from ? *from : "weight";
  check_tensors_match(ck, source, table, /*repadding=*/true);
  const int64_t n = table.local_numel();
  std::vector<float> values(static_cast<size_t>(n));
  for (const ParamSpec& p : table.params())
    for (const TensorRegion& r : flat_range_regions(p, 0, n))
      read_param(ck, source, p, table.config().vocab_size, r, DType::F32, values.data() + r.flat_begin);
  state.load_fp32(values.data());  // masters exact, working = rounding, moments 0, Adam step 0
  // Test hook for the restart verification: KEEL_FAULT_MASTERS_FROM_INIT=1 reproduces the
  // seed-000 bug (fp32 masters left at a fresh random init under the loaded weights).
  if (std::getenv("KEEL_FAULT_MASTERS_FROM_INIT") && state.has_master() && !state.master_is_working()) {
    std::vector<float> init(static_cast<size_t>(n));
    for (const ParamSpec& p : table.params()) init_param(p, 12345, init.data() + p.offset);
    const int64_t ob = state.optim_begin(), oe = std::min(state.optim_end(), n);
    if (oe > ob) backend.copy_from_host(state.flat_view(state.master, ob, oe - ob), init.data() + ob);
  }
  std::string dtype = std::string(dtype_name(ck.stored_dtype(source, table.params().front().name)));
  std::string what = source == "master" ? "the fp32 master weights" : dtype + " weights";
  std::string note = attention_change_note(ck, table.config());
  const int64_t saved_len = ck.meta().value("config", json::object()).value("model", json::object()).value("max_seq_len", int64_t{0});
  if (saved_len > 0 && saved_len != table.config().max_seq_len)  // a limit, not the function
    note += "; NOTE: the checkpoint was trained with model.max_seq_len " + std::to_string(saved_len) +
            ", this run allows " + std::to_string(table.config().max_seq_len);
  if (warnings)
    for (std::string& w : model_change_warnings(model_function_changes(ck, table.config())))
      warnings->push_back(std::move(w));
  return "initialised from " + ck.path() + ": " + std::to_string(table.params().size()) + " tensors, " + what +
         "; fp32 masters = their exact values, working weights rounded to " +
         std::string(dtype_name(state.working.dtype)) +
         "; Adam moments zero, Adam step 0, iteration 0, fresh LR and batch schedules; the checkpoint's optimizer "
         "state (if any) is not used" + note;
}

// ======================================================================================
// Weights-only checkpoints from another source (keel convert hf:DIR OUT)
// ======================================================================================

void Checkpoint::release(const std::string& state, const std::string& tensor) const {
  auto it = chunks_.find(state + "/" + tensor);
  if (it == chunks_.end()) return;
  for (const Chunk& c : it->second) drop_pages(files_[c.file]->bytes(*c.info));
}

SaveResult write_weights_checkpoint(const std::string& dir, const RunConfig& cfg, DType dtype, const TensorFill& fill,
                                    const json& source) {
  const auto t0 = std::chrono::steady_clock::now();
  const ParamTable table(cfg.model);  // the whole model, one rank
  const std::string file = "model-tp00-pp00.safetensors";
  const fs::path path = fs::path(dir) / file;
  try {
    std::vector<data::SafetensorsWriter::Entry> entries;
    json chunks = json::object();
    for (const ParamSpec& p : table.params()) {
      const std::string entry = "weight/" + p.name;
      entries.push_back({entry, to_st(dtype), p.shape});
      chunks[entry] = {{"tensor", p.name}, {"state", "weight"}, {"shape", p.shape},
                       {"offset", std::vector<int64_t>(p.shape.size(), 0)}};
    }
    const json file_meta = {{"format", kFormat}, {"format_version", kCheckpointFormatVersion}, {"chunks", chunks}};
    data::SafetensorsWriter w(path.string(), entries, {{"keel", file_meta.dump()}});
    std::vector<char> staging;
    for (const ParamSpec& p : table.params()) {
      staging.resize(static_cast<size_t>(p.logical_numel()) * dtype_size(dtype));
      fill(p, dtype, staging.data());
      w.write(staging.data(), staging.size());
    }
    w.finish(/*sync=*/true);
    json tensors = json::object();
    for (size_t i = 0; i < entries.size(); ++i) tensors[entries[i].name] = data::crc32c_hex(w.tensor_crc(i));
    const json files = {{file, {{"bytes", w.file_bytes()}, {"crc32c", data::crc32c_hex(w.file_crc())}, {"tensors", tensors}}}};
    json meta = {
        {"format", kFormat},
        {"format_version", kCheckpointFormatVersion},
        {"keel_version", "0.1"},
        {"saved_at", utc_now()},
        {"progress", progress_json(TrainProgress{})},
        {"adam_step", 0},
        {"loss_scaler", {{"scale", 1.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 0}}},
        {"data", {{"consumed_samples", 0}, {"seed", cfg.train.seed}, {"train", cfg.data.train}}},
        {"topology", {{"tp", 1}, {"pp", 1}, {"dp", 1}}},
        {"precision", precision_name(cfg.precision.mode)},
        {"weight_dtype", std::string(dtype_name(dtype))},
        {"states", {"weight"}},
        {"master_is_weight", false},
        {"weights_only", true},
        {"source", source},
        {"config", to_json(cfg)},
        {"files", files}};
    meta["meta_crc32c"] = meta_checksum(meta);
    write_text_file_synced((fs::path(dir) / "meta.json").string(), meta.dump(2));
    data::detail::sync_directory(dir);
    SaveResult r;
    r.path = dir;
    r.bytes = w.file_bytes();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError("writing weights-only checkpoint " + dir + " failed: " + e.what());
  }
}

bool would_replace(const fs::path& out, const std::string& in) {
  if (in.empty()) return false;
  std::error_code ec;
  const fs::path rel = fs::relative(fs::weakly_canonical(in, ec), fs::weakly_canonical(out, ec), ec);
  return !ec && !rel.empty() && *rel.begin() != "..";
}

bool is_keel_checkpoint(const fs::path& dir) {
  try {
    std::ifstream in(dir / "meta.json");
    return json::parse(in).value("format", std::string()) == kFormat;
  } catch (const std::exception&) {
    return false;  // no meta.json, or not a keel one
  }
}

namespace {

// "a/, b, c and 4 more": the first six of `names`, sorted.
std::string listed_names(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  std::string text;
  for (size_t i = 0; i < names.size() && i < 6; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > 6) text += " and " + std::to_string(names.size() - 6) + " more";
  return text;
}

// Would an output of this kind write a file of this name? (What --force may remove with it.)
bool written_by_keel(const std::string& name, OutputKind kind) {
  const auto& side = hf_side_files();
  if (name == "config.json" || std::find(side.begin(), side.end(), name) != side.end()) return true;
  const bool safetensors = name.ends_with(".safetensors");
  if (kind == OutputKind::HfModel)  // model.safetensors, or shards model-00001-of-00002.safetensors and their index
    return name == "model.safetensors.index.json" || (safetensors && name.starts_with("model"));
  return name == "meta.json" || name == "hf_config.json" ||
         (safetensors && (name.starts_with("model-") || name.starts_with("optim-")));
}

// What in the existing folder `out` an output of this kind would not have written: "README.md,
// eval/", the user's, kept from --force.
std::string not_written_by_keel(const fs::path& out, OutputKind kind) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out))
    if (e.is_directory() || !written_by_keel(e.path().filename().string(), kind))
      names.push_back(e.path().filename().string() + (e.is_directory() ? "/" : ""));
  return listed_names(std::move(names));
}

// Is the existing `out` an earlier output of this kind, which --force may replace? An empty
// folder holds nothing to lose either; one with anything else in it (a downloaded model's
// README.md, the user's notes) is not an output of keel's.
bool replaceable_output(const fs::path& out, OutputKind kind) {
  if (!fs::is_directory(out)) return false;
  if (fs::is_empty(out)) return true;
  if (!not_written_by_keel(out, kind).empty()) return false;
  if (kind == OutputKind::HfModel) {
    if (!fs::is_regular_file(out / "config.json")) return false;
    for (const auto& e : fs::directory_iterator(out))
      if (e.path().extension() == ".safetensors") return true;
    return false;
  }
  return is_keel_checkpoint(out);
}

// What is at `p`, for a refusal: "a file", or "a folder holding a/, b, c and 4 more".
std::string describe_contents(const fs::path& p) {
  if (!fs::is_directory(p)) return "a file";
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(p))
    names.push_back(e.path().filename().string() + (e.is_directory() ? "/" : ""));
  return "a folder holding " + listed_names(std::move(names));
}

// The checkpoints directory of a run that `out` would sit in under a checkpoint's name (a
// step_* beside a `latest` pointer or another complete step_*), if any: the run would take it
// for one of its own saves.
std::optional<fs::path> runs_checkpoints_dir_of(const fs::path& out) {
  fs::path p = fs::absolute(out).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "step_5/"
  if (step_of(p.filename().string()) < 0) return std::nullopt;
  const fs::path dir = p.parent_path();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  if (fs::exists(fs::symlink_status(dir / "latest", ec)) || !complete_checkpoints(dir).empty()) return dir;
  return std::nullopt;
}

}  // namespace

void check_new_output(const fs::path& out, bool force, const std::vector<std::string>& inputs, OutputKind kind) {
  for (const std::string& in : inputs) {
    if (would_replace(out, in))
      throw ConfigError("the output " + out.string() + " would replace the input " + in + ": pick another folder");
    // Inside an input, the output goes when the input is replaced or rotated away.
    if (!in.empty() && would_replace(in, out.string()))
      throw ConfigError("the output " + out.string() + " is inside the input " + in +
                        " (removing or replacing that input, as checkpoint rotation does, would delete it): pick a "
                        "folder outside it");
  }
  if (const auto dir = runs_checkpoints_dir_of(out))
    throw ConfigError("the output " + out.string() + " is named like a checkpoint (step_*) of the run whose "
                      "checkpoints are in " + dir->string() +
                      ": that run would take it for one of its own saves, so checkpoint.keep_last could delete it "
                      "and a resume without `latest` could continue from it. Nothing was written; write it outside " +
                      dir->string() + ", or give it a name that does not start with step_");
  if (!fs::exists(out)) return;
  if (!force) throw ConfigError(out.string() + " already exists (pass --force to replace it)");  // an argument: exit 2
  if (!replaceable_output(out, kind)) {
    const std::string others = fs::is_directory(out) ? not_written_by_keel(out, kind) : "";
    throw ConfigError("the output " + out.string() + " exists and is " + describe_contents(out) +
                      ": --force replaces only an earlier " +
                      (kind == OutputKind::HfModel ? "Hugging Face model folder (config.json and *.safetensors)"
                                                   : "keel checkpoint (a folder with a keel meta.json)") +
                      (others.empty() ? "" : ", holding nothing keel does not write there (not " + others + ")") +
                      ". Nothing was changed; pick another folder, or remove this one yourself if it is to go");
  }
}

fs::path temp_dir_for(const fs::path& out) {
  fs::path tmp = out;
  tmp += ".tmp-keel-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  return tmp;
}

void publish(const fs::path& tmp, const fs::path& out, bool force) {
  if (!fs::exists(out)) {
    fs::rename(tmp, out);
    return;
  }
  if (!force) throw CheckpointError(out.string() + " appeared while it was written (pass --force to replace it)");
  // Moved aside, not removed, until the new one is in place: a kill between the two renames
  // leaves both folders, never neither.
  fs::path old = out;
  old += ".old-keel-" + std::to_string(::getpid());
  fs::remove_all(old);
  fs::rename(out, old);
  fs::rename(tmp, out);
  fs::remove_all(old);
}

}  // namespace keel
