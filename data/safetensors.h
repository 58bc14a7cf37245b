// safetensors files (github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
// "__metadata__": {str: str}}, then the byte buffer the offsets point into (relative to its
// start). Tensors are row-major, little-endian, packed back to back with no gaps.
//
// The reader memory-maps the file and checks the whole header before handing out any bytes,
// so a corrupt or hostile file gives a DataError naming it, never a read out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/file_io.h"
#include "data/token_file.h"  // DataError

namespace keel::data {

enum class SafetensorsDtype { BOOL, U8, I8, F8_E4M3, F8_E5M2, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64 };

std::string_view safetensors_dtype_name(SafetensorsDtype dtype);  // "BF16"
size_t safetensors_dtype_size(SafetensorsDtype dtype);             // bytes per element
std::optional<SafetensorsDtype> parse_safetensors_dtype(std::string_view name);

struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;  // [] is a scalar
  int64_t begin = 0;           // byte span [begin, end) within the data buffer
  int64_t end = 0;

  int64_t num_elements() const;
  int64_t num_bytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  // In buffer order (by begin offset).
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  const SafetensorsTensorInfo* find(std::string_view name) const;  // nullptr when absent
  const SafetensorsTensorInfo& tensor(std::string_view name) const;  // throws DataError when absent

  // The tensor's bytes inside the mapping (valid while the reader lives). Their address is
  // only as aligned as the writer made it; copy (memcpy) rather than cast when unsure.
  std::span<const std::byte> bytes(const SafetensorsTensorInfo& info) const;
  std::span<const std::byte> bytes(std::string_view name) const { return bytes(tensor(name)); }
  // The whole file as it was when opened (header included). The mapping holds the file's data,
  // so it stays readable after the file is renamed or removed (a running job's rotation).
  std::span<const std::byte> file_bytes() const {
    return {reinterpret_cast<const std::byte*>(file_.data()), static_cast<size_t>(file_.size())};
  }

 private:
  detail::MappedFile file_;
  const std::byte* buffer_ = nullptr;  // start of the data buffer
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsTensorToWrite {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  const void* data;  // num_elements * dtype size bytes, row-major
};

// Streams a safetensors file tensor by tensor: the header (every name, dtype and shape) first,
// then each tensor's bytes in the order given, so no tensor needs to be in memory with the
// others (checkpoints of large models are written from a small staging buffer). Tracks the
// CRC-32C of each tensor's bytes and of the whole file. Errors throw DataError naming the path.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    SafetensorsDtype dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::string& path, std::vector<Entry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes to the tensor being written; a call may span several tensors.
  void write(const void* data, size_t bytes);
  // All bytes written: optionally fsync, then close. Throws if tensors are incomplete.
  void finish(bool sync);

  const std::string& path() const { return path_; }
  const std::vector<Entry>& entries() const { return entries_; }
  uint32_t tensor_crc(size_t index) const { return tensor_crc_.at(index); }
  uint32_t file_crc() const { return file_crc_; }
  int64_t file_bytes() const;

 private:
  std::string path_;
  std::vector<Entry> entries_;
  std::vector<int64_t> sizes_;
  std::vector<uint32_t> tensor_crc_;
  size_t current_ = 0;       // tensor being written
  int64_t current_done_ = 0;  // its bytes written so far
  uint32_t file_crc_ = 0;
  struct Impl;
  Impl* impl_;
};

// Writes the tensors back to back in the order given, the header padded with spaces to a
// multiple of 8 bytes so the data buffer starts at an 8-aligned file offset. Throws
// DataError naming the path on bad input (duplicate or reserved names, negative dims) and on
// any I/O error (EACCES, ENOSPC, ...). Durability (fsync, rename) is the caller's business.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace keel::data
