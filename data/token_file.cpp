#include "data/token_file.h"

#include <glob.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <unordered_map>

#include "data/loss_mask.h"

namespace keel::data {

// The formats are little-endian and we read them in place.
static_assert(std::endian::native == std::endian::little, "keel::data assumes a little-endian host");

using detail::quoted;

namespace {

constexpr int32_t kLlmcMagicU16 = 20240520;  // GPT-2 shards, version 1
constexpr int32_t kLlmcMagicU32 = 20240801;  // Llama 3 shards, version 7
constexpr int32_t kLlmcVersionU16 = 1;
constexpr int32_t kLlmcVersionU32 = 7;
constexpr int64_t kLlmcHeaderWords = 256;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderWords * 4;

constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kIdxHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, S, D

// The .idx arrays start at byte 34, so their elements are not aligned: load through memcpy.
template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool ends_with(const std::string& s, const char* suffix) {
  size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Shows bytes of an unknown header readably: printable ASCII as is, the rest as \xNN.
std::string escape_bytes(const unsigned char* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\') {
      out += static_cast<char>(p[i]);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", p[i]);
      out += buf;
    }
  }
  return out;
}

const char* numpy_name_of_code(uint8_t code) {
  switch (code) {
    case 1: return "uint8";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 6: return "float64";
    case 7: return "float32";
    case 8: return "uint16";
    default: return "unknown";
  }
}

}  // namespace

TokenFile TokenFile::open(const std::string& path) {
  if (ends_with(path, ".idx")) return open_megatron(path.substr(0, path.size() - 4));
  if (ends_with(path, ".bin")) {
    std::string prefix = path.substr(0, path.size() - 4);
    if (detail::file_exists(prefix + ".idx")) return open_megatron(prefix);
    return open_llmc(path);
  }
  if (!detail::file_exists(path)) {
    if (detail::file_exists(path + ".bin") || detail::file_exists(path + ".idx")) return open_megatron(path);
    throw DataError("token file " + quoted(path) + " does not exist (nor is it a Megatron prefix with " +
                    quoted(path + ".bin") + " and " + quoted(path + ".idx") + ")");
  }
  return open_llmc(path);
}

TokenFile TokenFile::open_llmc(const std::string& path) {
  TokenFile tf;
  tf.bin_ = detail::MappedFile::open(path, "token file");
  tf.format_ = TokenFileFormat::llmc;
  const unsigned char* bytes = tf.bin_.data();
  const int64_t size = tf.bin_.size();

  const std::string megatron_hint =
      ends_with(path, ".bin") ? " (a Megatron .bin needs its index " + quoted(path.substr(0, path.size() - 4) + ".idx") +
                                    " beside it)"
                              : "";
  if (size < 4) {
    throw DataError(quoted(path) + " is not an llm.c token shard: only " + std::to_string(size) +
                    " bytes, too short for the 4-byte magic number" + megatron_hint);
  }
  const int32_t magic = load<int32_t>(bytes);
  if (magic == LossMask::kMagic)  // a data.train pattern such as "dir/*" also matched the sidecars
    throw DataError(quoted(path) + " is a loss-mask sidecar (magic " + std::to_string(magic) +
                    "), not a token file: it is read beside its token file, so leave it out of the data patterns "
                    "(e.g. \"dir/*.bin\" rather than \"dir/*\")");
  if (magic != kLlmcMagicU16 && magic != kLlmcMagicU32) {
    throw DataError(quoted(path) + " is not an llm.c token shard: bad magic number " + std::to_string(magic) +
                    " (bytes \"" + escape_bytes(bytes, 4) + "\"), expected " + std::to_string(kLlmcMagicU16) + " (uint16 tokens) or " +
                    std::to_string(kLlmcMagicU32) + " (uint32 tokens)" + megatron_hint);
  }
  if (size < kLlmcHeaderBytes) {
    throw DataError(quoted(path) + " is truncated: " + std::to_string(size) + " bytes, shorter than the " +
                    std::to_string(kLlmcHeaderBytes) + "-byte llm.c header");
  }
  const int32_t version = load<int32_t>(bytes + 4);
  const int32_t expected_version = magic == kLlmcMagicU16 ? kLlmcVersionU16 : kLlmcVersionU32;
  if (version != expected_version) {
    throw DataError(quoted(path) + ": unsupported llm.c shard version " + std::to_string(version) + " for magic " +
                    std::to_string(magic) + " (keel reads version " + std::to_string(expected_version) + ")");
  }
  tf.token_bytes_ = magic == kLlmcMagicU16 ? 2 : 4;
  // llm.c writes the count as int32 (< 2^31); reading it unsigned costs nothing and never
  // turns a large count negative.
  const int64_t count = load<uint32_t>(bytes + 8);
  if (count == 0) throw DataError(quoted(path) + " holds no tokens (its header says 0 tokens)");
  const int64_t token_bytes = count * tf.token_bytes_;
  const int64_t expected_size = kLlmcHeaderBytes + token_bytes;
  if (size != expected_size) {
    std::string what = size < expected_size ? " is truncated" : " is longer than its header says";
    throw DataError(quoted(path) + what + ": header says " + std::to_string(count) + " tokens = " +
                    std::to_string(token_bytes) + " bytes (+ " + std::to_string(kLlmcHeaderBytes) +
                    "-byte header = " + std::to_string(expected_size) + " bytes), but the file has " +
                    std::to_string(size) + " bytes");
  }
  tf.num_tokens_ = count;
  tf.tokens_ = bytes + kLlmcHeaderBytes;
  return tf;
}

TokenFile TokenFile::open_megatron(const std::string& prefix) {
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  if (!detail::file_exists(idx_path)) {
    throw DataError("Megatron dataset " + quoted(prefix) + ": index " + quoted(idx_path) + " does not exist");
  }
  if (!detail::file_exists(bin_path)) {
    throw DataError("Megatron dataset " + quoted(prefix) + ": data file " + quoted(bin_path) +
                    " does not exist (its index " + quoted(idx_path) + " does)");
  }
  detail::MappedFile idx = detail::MappedFile::open(idx_path, "Megatron index");
  const unsigned char* ib = idx.data();
  const int64_t idx_size = idx.size();

  if (idx_size < 9 || std::memcmp(ib, kIdxMagic, 9) != 0) {
    throw DataError(quoted(idx_path) + " is not a Megatron MMIDIDX index: bad magic \"" +
                    escape_bytes(ib, static_cast<size_t>(std::min<int64_t>(idx_size, 9))) +
                    "\", expected \"MMIDIDX\\x00\\x00\"");
  }
  if (idx_size < kIdxHeaderBytes) {
    throw DataError(quoted(idx_path) + " is truncated: " + std::to_string(idx_size) + " bytes, shorter than the " +
                    std::to_string(kIdxHeaderBytes) + "-byte MMIDIDX header");
  }
  const uint64_t version = load<uint64_t>(ib + 9);
  if (version != 1) {
    throw DataError(quoted(idx_path) + ": unsupported MMIDIDX version " + std::to_string(version) +
                    " (keel reads version 1)");
  }
  const uint8_t code = ib[17];
  int token_bytes = 0;
  if (code == static_cast<uint8_t>(MegatronDtype::uint16)) token_bytes = 2;
  if (code == static_cast<uint8_t>(MegatronDtype::int32)) token_bytes = 4;
  if (token_bytes == 0) {
    throw DataError(quoted(idx_path) + ": unsupported token dtype code " + std::to_string(code) + " (" +
                    numpy_name_of_code(code) + "); keel reads uint16 (code 8) and int32 (code 4)");
  }
  const uint64_t seq_count = load<uint64_t>(ib + 18);
  const uint64_t doc_index_count = load<uint64_t>(ib + 26);
  // Bound the counts before multiplying so a garbage header cannot overflow the size check.
  const uint64_t max_count = static_cast<uint64_t>(idx_size);
  const std::string counts = std::to_string(seq_count) + " sequences and " + std::to_string(doc_index_count) +
                             " document indices";
  if (seq_count > max_count || doc_index_count > max_count) {
    throw DataError(quoted(idx_path) + " is truncated or corrupt: header says " + counts + ", but the file has only " +
                    std::to_string(idx_size) + " bytes");
  }
  const int64_t S = static_cast<int64_t>(seq_count);
  const int64_t D = static_cast<int64_t>(doc_index_count);
  const int64_t lengths_at = kIdxHeaderBytes;
  const int64_t pointers_at = lengths_at + 4 * S;
  const int64_t doc_indices_at = pointers_at + 8 * S;
  const int64_t expected_size = doc_indices_at + 8 * D;
  // Multimodal datasets append one int8 mode per sequence; the token layout is the same.
  if (idx_size != expected_size && idx_size != expected_size + S) {
    throw DataError(quoted(idx_path) + (idx_size < expected_size ? " is truncated" : " has trailing bytes") +
                    ": header says " + counts + " = " + std::to_string(expected_size) + " bytes, but the file has " +
                    std::to_string(idx_size) + " bytes");
  }
  if (D < 1 || load<int64_t>(ib + doc_indices_at) != 0 || load<int64_t>(ib + doc_indices_at + 8 * (D - 1)) != S) {
    throw DataError(quoted(idx_path) + " is corrupt: document indices must run from 0 to the sequence count " +
                    std::to_string(S));
  }

  // One pass over the sequences: the pointers must be the running byte offset (documents back
  // to back), which is what lets us read the .bin as one flat stream.
  int64_t offset_bytes = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int32_t length = load<int32_t>(ib + lengths_at + 4 * s);
    const int64_t pointer = load<int64_t>(ib + pointers_at + 8 * s);
    if (length < 0) {
      throw DataError(quoted(idx_path) + " is corrupt: sequence " + std::to_string(s) + " has negative length " +
                      std::to_string(length));
    }
    if (pointer != offset_bytes) {
      throw DataError(quoted(idx_path) + ": sequence " + std::to_string(s) + " starts at byte " +
                      std::to_string(pointer) + ", expected " + std::to_string(offset_bytes) +
                      " (keel reads datasets whose sequences are stored back to back)");
    }
    offset_bytes += static_cast<int64_t>(length) * token_bytes;
  }

  TokenFile tf;
  tf.bin_ = detail::MappedFile::open(bin_path, "Megatron data file");
  tf.format_ = TokenFileFormat::megatron;
  tf.token_bytes_ = token_bytes;
  if (tf.bin_.size() != offset_bytes) {
    throw DataError("Megatron index and data disagree: " + quoted(idx_path) + " describes " +
                    std::to_string(offset_bytes / token_bytes) + " tokens = " + std::to_string(offset_bytes) +
                    " bytes of " + numpy_name_of_code(code) + ", but " + quoted(bin_path) + " has " +
                    std::to_string(tf.bin_.size()) + " bytes");
  }
  tf.num_tokens_ = offset_bytes / token_bytes;
  tf.tokens_ = tf.bin_.data();

  tf.doc_starts_.reserve(static_cast<size_t>(D - 1));
  int64_t previous = 0;
  for (int64_t d = 0; d + 1 < D; ++d) {
    const int64_t first_seq = load<int64_t>(ib + doc_indices_at + 8 * d);
    if (first_seq < previous || first_seq > S) {
      throw DataError(quoted(idx_path) + " is corrupt: document " + std::to_string(d) + " starts at sequence " +
                      std::to_string(first_seq) + ", outside [" + std::to_string(previous) + ", " +
                      std::to_string(S) + "]");
    }
    previous = first_seq;
    const int64_t start_byte = first_seq < S ? load<int64_t>(ib + pointers_at + 8 * first_seq) : offset_bytes;
    tf.doc_starts_.push_back(start_byte / token_bytes);
  }
  return tf;
}

void TokenFile::check_range(int64_t start, int64_t count) const {
  if (start < 0 || count < 0 || start > num_tokens_ - count) {
    throw DataError(quoted(path()) + ": token range [" + std::to_string(start) + ", " +
                    std::to_string(start + count) + ") is outside the file's " + std::to_string(num_tokens_) +
                    " tokens");
  }
}

uint32_t TokenFile::token(int64_t i) const {
  check_range(i, 1);
  if (token_bytes_ == 2) return load<uint16_t>(tokens_ + 2 * i);
  return load<uint32_t>(tokens_ + 4 * i);
}

void TokenFile::read(int64_t start, int64_t count, int32_t* out) const {
  check_range(start, count);
  if (token_bytes_ == 4) {
    std::memcpy(out, tokens_ + 4 * start, static_cast<size_t>(count) * 4);
    return;
  }
  // Token data starts at byte 0 or 1024 of a page-aligned mapping, so uint16 access is aligned.
  const uint16_t* src = reinterpret_cast<const uint16_t*>(tokens_) + start;
  for (int64_t k = 0; k < count; ++k) out[k] = src[k];
}

int64_t TokenFile::find_token_at_least(uint32_t limit, int64_t start, int64_t count) const {
  check_range(start, count);
  auto scan = [&](auto* src) -> int64_t {
    for (int64_t k = 0; k < count; ++k)
      if (static_cast<uint32_t>(src[k]) >= limit) return start + k;
    return -1;
  };
  if (token_bytes_ == 2) return scan(reinterpret_cast<const uint16_t*>(tokens_) + start);
  // uint32 tokens sit at 4-byte aligned offsets (header 1024 bytes or a page-aligned .bin)
  return scan(reinterpret_cast<const uint32_t*>(tokens_) + start);
}

std::vector<std::string> expand_paths(const std::vector<std::string>& patterns, const std::string& what,
                                      std::vector<RepeatedMatch>* repeats) {
  std::vector<std::string> out;
  std::unordered_map<std::string, size_t> seen;    // file -> its place in out
  std::vector<std::vector<size_t>> matched_by;     // per file of out: the entries that matched it
  for (size_t entry = 0; entry < patterns.size(); ++entry) {
    const std::string& pattern = patterns[entry];
    glob_t g{};
    const int rc = glob(pattern.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0) {
      for (size_t k = 0; k < g.gl_pathc; ++k) matches.emplace_back(g.gl_pathv[k]);
    }
    globfree(&g);
    if (rc == GLOB_NOMATCH) {
      if (detail::file_exists(pattern + ".bin") && detail::file_exists(pattern + ".idx")) {
        matches.push_back(pattern + ".bin");  // a Megatron prefix
      } else {
        throw DataError(what + ": pattern " + quoted(pattern) + " matches no file");
      }
    } else if (rc != 0) {
      throw DataError(what + ": cannot expand pattern " + quoted(pattern) +
                      (rc == GLOB_NOSPACE ? ": out of memory" : ": read error"));
    }
    // glob sorts with strcoll (locale-dependent); sort bytewise so every machine agrees.
    std::sort(matches.begin(), matches.end());
    for (std::string& m : matches) {
      if (ends_with(m, ".idx")) {
        std::string bin = m.substr(0, m.size() - 4) + ".bin";
        if (detail::file_exists(bin)) m = bin;
      }
      const auto [at, fresh] = seen.try_emplace(m, out.size());
      if (fresh) out.push_back(m), matched_by.emplace_back();
      // x.bin and x.idx of one glob are one dataset, matched once by that entry.
      if (std::vector<size_t>& by = matched_by[at->second]; by.empty() || by.back() != entry) by.push_back(entry);
    }
  }
  if (repeats)
    for (size_t f = 0; f < out.size(); ++f)
      if (matched_by[f].size() > 1) {
        RepeatedMatch r{out[f], {}};
        for (size_t e : matched_by[f]) r.entries.push_back(patterns[e]);
        repeats->push_back(std::move(r));
      }
  return out;
}

void write_llmc_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool u32) {
  if (tokens.size() >= (size_t{1} << 31)) {
    throw DataError("cannot write " + quoted(path) + ": llm.c shards hold fewer than 2^31 tokens");
  }
  std::array<int32_t, kLlmcHeaderWords> header{};
  header[0] = u32 ? kLlmcMagicU32 : kLlmcMagicU16;
  header[1] = u32 ? kLlmcVersionU32 : kLlmcVersionU16;
  header[2] = static_cast<int32_t>(tokens.size());
  detail::FileWriter out(path);
  out.write(header.data(), sizeof header);
  if (u32) {
    out.write(tokens.data(), tokens.size() * 4);
  } else {
    std::vector<uint16_t> narrow(tokens.size());
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (tokens[k] > 0xffff) {
        throw DataError("cannot write " + quoted(path) + ": token " + std::to_string(tokens[k]) + " at position " +
                        std::to_string(k) + " does not fit a uint16 shard");
      }
      narrow[k] = static_cast<uint16_t>(tokens[k]);
    }
    out.write(narrow.data(), narrow.size() * 2);
  }
  out.close();
}

MegatronDatasetWriter::MegatronDatasetWriter(const std::string& prefix, MegatronDtype dtype)
    : bin_path_(prefix + ".bin"), idx_path_(prefix + ".idx"), dtype_(dtype),
      bin_(std::make_unique<detail::FileWriter>(bin_path_)) {}

MegatronDatasetWriter::~MegatronDatasetWriter() = default;

void MegatronDatasetWriter::add_document(const uint32_t* tokens, size_t n) {
  const int token_bytes = dtype_ == MegatronDtype::uint16 ? 2 : 4;
  const uint32_t max_token = dtype_ == MegatronDtype::uint16 ? 0xffffu : 0x7fffffffu;
  const size_t d = lengths_.size();
  if (n > 0x7fffffffu) throw DataError("cannot write " + quoted(bin_path_) + ": document too long");
  for (size_t k = 0; k < n; ++k) {
    if (tokens[k] > max_token) {
      throw DataError("cannot write " + quoted(bin_path_) + ": token " + std::to_string(tokens[k]) + " in document " +
                      std::to_string(d) + " does not fit " + numpy_name_of_code(static_cast<uint8_t>(dtype_)));
    }
  }
  if (token_bytes == 4) {
    bin_->write(tokens, n * 4);
  } else {
    std::vector<uint16_t> narrow(tokens, tokens + n);
    bin_->write(narrow.data(), narrow.size() * 2);
  }
  lengths_.push_back(static_cast<int32_t>(n));
  pointers_.push_back(offset_);
  offset_ += static_cast<int64_t>(n) * token_bytes;
}

void MegatronDatasetWriter::close() {
  bin_->close();
  std::vector<int64_t> doc_indices(lengths_.size() + 1);  // one sequence per document
  for (size_t k = 0; k < doc_indices.size(); ++k) doc_indices[k] = static_cast<int64_t>(k);
  detail::FileWriter idx(idx_path_);
  const uint64_t version = 1;
  const uint8_t code = static_cast<uint8_t>(dtype_);
  const uint64_t seq_count = lengths_.size();
  const uint64_t doc_index_count = doc_indices.size();  // documents + 1, as Megatron writes it
  idx.write(kIdxMagic, sizeof kIdxMagic);
  idx.write(&version, 8);
  idx.write(&code, 1);
  idx.write(&seq_count, 8);
  idx.write(&doc_index_count, 8);
  idx.write(lengths_.data(), lengths_.size() * 4);
  idx.write(pointers_.data(), pointers_.size() * 8);
  idx.write(doc_indices.data(), doc_indices.size() * 8);
  idx.close();
}

void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& docs,
                            MegatronDtype dtype) {
  MegatronDatasetWriter w(prefix, dtype);
  for (const auto& doc : docs) w.add_document(doc.data(), doc.size());
  w.close();
}

}  // namespace keel::data
