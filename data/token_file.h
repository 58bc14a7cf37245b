// Read-only views of token files: llm.c shards and Megatron indexed datasets (.bin + .idx).
//
// A TokenFile memory-maps one token stream and hands out tokens by 64-bit index, so files
// over 2 GiB (and over 2^31 tokens) work; the page cache holds the data, never a copy of ours.
//
// Formats:
//   llm.c shard: 256 little-endian int32 header words ([0] magic, [1] version, [2] token count),
//     then the tokens. magic 20240520 / version 1: uint16 tokens (GPT-2);
//     magic 20240801 / version 7: uint32 tokens (Llama 3).
//   Megatron (MMIDIDX, megatron/core/datasets/indexed_dataset.py): prefix.bin holds the tokens of
//     every document back to back; prefix.idx holds
//       9 bytes "MMIDIDX\0\0", uint64 version (1), uint8 dtype code (4 = int32, 8 = uint16),
//       uint64 sequence count S, uint64 document-index count D (= documents + 1),
//       int32 sequence lengths[S], int64 sequence byte pointers[S],
//       int64 document indices[D] (sequence index where each document starts, then S),
//       and, for multimodal datasets only, int8 sequence modes[S].
//     keel reads the .bin as one flat token stream and keeps the document starts beside it.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/file_io.h"

namespace keel::data {

// Every problem with user data is one of these; the message is written for the person who
// has to fix the file (it names the file and what is wrong with it).
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class TokenFileFormat { llmc, megatron };

// Token storage of a Megatron .bin; the values are the dtype codes of the .idx header.
enum class MegatronDtype : uint8_t { int32 = 4, uint16 = 8 };

class TokenFile {
 public:
  // `path` is an llm.c shard, a Megatron `x.bin` / `x.idx` with its partner beside it, or a
  // Megatron prefix `x`. A .bin with an .idx beside it is Megatron; otherwise it must carry an
  // llm.c magic.
  static TokenFile open(const std::string& path);

  const std::string& path() const { return bin_.path(); }  // the file holding the tokens
  TokenFileFormat format() const { return format_; }
  int64_t num_tokens() const { return num_tokens_; }
  int token_bytes() const { return token_bytes_; }  // 2 or 4

  // Token i (0 <= i < num_tokens). Megatron int32 tokens come back as their bit pattern, so a
  // negative token shows up as a huge value and fails any vocab check.
  uint32_t token(int64_t i) const;

  // Copies tokens [start, start + count) into out; a range outside the file throws DataError.
  // Values are stored as int32 bit patterns (uint32 tokens >= 2^31 read back via uint32_t).
  void read(int64_t start, int64_t count, int32_t* out) const;

  // Position of the first token >= limit in [start, start + count), or -1: a linear scan at
  // memory speed, for the start-up check that the data fits the model's vocabulary.
  int64_t find_token_at_least(uint32_t limit, int64_t start, int64_t count) const;

  // Token offset where each document starts (Megatron; first is 0). Empty for llm.c shards,
  // which do not record document boundaries.
  const std::vector<int64_t>& doc_starts() const { return doc_starts_; }

 private:
  TokenFile() = default;
  static TokenFile open_llmc(const std::string& path);
  static TokenFile open_megatron(const std::string& prefix);
  void check_range(int64_t start, int64_t count) const;

  detail::MappedFile bin_;  // movable, not copyable: so is TokenFile
  TokenFileFormat format_ = TokenFileFormat::llmc;
  const unsigned char* tokens_ = nullptr;  // first token inside the mapping
  int64_t num_tokens_ = 0;
  int token_bytes_ = 2;
  std::vector<int64_t> doc_starts_;
};

// Expands glob patterns (glob(3)) into files: each pattern's matches sorted, patterns kept in
// the order given, duplicates dropped. `x.idx` is folded into `x.bin` so a glob over a folder of
// Megatron pairs names each dataset once; a Megatron prefix `x` (no file of that name) becomes
// `x.bin`. A pattern that matches nothing throws DataError naming `what` (e.g. "data.train").
// With `repeats`, it also lists each file that more than one entry matched (two globs, or one
// path given twice), with those entries in order: the caller can say that it is read once.
struct RepeatedMatch {
  std::string file;
  std::vector<std::string> entries;
};
std::vector<std::string> expand_paths(const std::vector<std::string>& patterns, const std::string& what,
                                      std::vector<RepeatedMatch>* repeats = nullptr);

// Writers for tests and tools. Throw DataError naming the path on any failure.
// llm.c shard: uint32 tokens (magic 20240801 / v7) when u32, else uint16 (20240520 / v1).
void write_llmc_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool u32);
// Megatron dataset prefix.bin + prefix.idx with one sequence per document.
void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& docs,
                            MegatronDtype dtype);

// The same, a document at a time: the tokens stream to prefix.bin, and close() writes
// prefix.idx (lengths, byte offsets, document indices) from what was added.
class MegatronDatasetWriter {
 public:
  MegatronDatasetWriter(const std::string& prefix, MegatronDtype dtype);
  ~MegatronDatasetWriter();
  void add_document(const uint32_t* tokens, size_t n);
  void close();
  const std::string& bin_path() const { return bin_path_; }
  const std::string& idx_path() const { return idx_path_; }

 private:
  std::string bin_path_, idx_path_;
  MegatronDtype dtype_;
  std::unique_ptr<detail::FileWriter> bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;
  int64_t offset_ = 0;
};

}  // namespace keel::data
