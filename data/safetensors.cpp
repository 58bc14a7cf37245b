#include "data/safetensors.h"

#include "data/checksum.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

namespace keel::data {

namespace {

struct DtypeEntry {
  SafetensorsDtype dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DtypeEntry, 15> kDtypes{{
    {SafetensorsDtype::BOOL, "BOOL", 1},       {SafetensorsDtype::U8, "U8", 1},
    {SafetensorsDtype::I8, "I8", 1},           {SafetensorsDtype::F8_E4M3, "F8_E4M3", 1},
    {SafetensorsDtype::F8_E5M2, "F8_E5M2", 1}, {SafetensorsDtype::U16, "U16", 2},
    {SafetensorsDtype::I16, "I16", 2},         {SafetensorsDtype::F16, "F16", 2},
    {SafetensorsDtype::BF16, "BF16", 2},       {SafetensorsDtype::U32, "U32", 4},
    {SafetensorsDtype::I32, "I32", 4},         {SafetensorsDtype::F32, "F32", 4},
    {SafetensorsDtype::U64, "U64", 8},         {SafetensorsDtype::I64, "I64", 8},
    {SafetensorsDtype::F64, "F64", 8},
}};

const DtypeEntry& entry_of(SafetensorsDtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  throw DataError("unknown safetensors dtype enum value " + std::to_string(static_cast<int>(dtype)));
}

// The reference implementation refuses headers above 100 MB, so no valid file has one; the
// limit keeps a corrupt length from making us parse gigabytes of tensor data as JSON.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Offsets and element counts stay below 2^62, so sums and products of two of them fit int64.
constexpr uint64_t kMaxExtent = uint64_t{1} << 62;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t k = 0; k < shape.size(); ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + "]";
}

std::string span_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// Product of the dims, or -1 when it would pass kMaxExtent.
int64_t checked_elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d == 0) return 0;
    if (n > kMaxExtent / static_cast<uint64_t>(d)) return -1;
    n *= static_cast<uint64_t>(d);
  }
  return static_cast<int64_t>(n);
}

}  // namespace

std::string_view safetensors_dtype_name(SafetensorsDtype dtype) { return entry_of(dtype).name; }
size_t safetensors_dtype_size(SafetensorsDtype dtype) { return entry_of(dtype).size; }

std::optional<SafetensorsDtype> parse_safetensors_dtype(std::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

int64_t SafetensorsTensorInfo::num_elements() const { return checked_elements(shape); }

// ---- reader ------------------------------------------------------------------------------

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  r.file_ = detail::MappedFile::open(path, "safetensors file");
  const std::string who = "safetensors file '" + path + "'";
  const int64_t file_size = r.file_.size();
  if (file_size < 8) {
    throw DataError(who + " is truncated: " + std::to_string(file_size) +
                    " bytes, too short for the 8-byte header length");
  }
  uint64_t header_len;
  std::memcpy(&header_len, r.file_.data(), 8);
  const uint64_t room = static_cast<uint64_t>(file_size) - 8;
  if (header_len > room) {
    throw DataError(who + ": header length " + std::to_string(header_len) + " runs past the end of the file (" +
                    std::to_string(file_size) + " bytes, so at most " + std::to_string(room) +
                    " bytes of header); the file is truncated or not safetensors");
  }
  if (header_len > kMaxHeaderBytes) {
    throw DataError(who + ": header length " + std::to_string(header_len) + " is over the 100 MB limit");
  }

  // Parse, noting the first key repeated within one object: the format forbids duplicates and
  // a plain parse would silently keep the last one.
  const char* header_text = reinterpret_cast<const char*>(r.file_.data() + 8);
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate_key;
  auto on_event = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys_per_object.emplace_back();
    if (event == Event::object_end && !keys_per_object.empty()) keys_per_object.pop_back();
    if (event == Event::key && !keys_per_object.empty() && parsed.is_string() &&
        !keys_per_object.back().insert(parsed.get<std::string>()).second && duplicate_key.empty()) {
      duplicate_key = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text, header_text + header_len, on_event);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(who + ": header is not valid JSON: " + e.what());
  }
  if (!duplicate_key.empty()) throw DataError(who + ": header names '" + duplicate_key + "' twice");
  if (!header.is_object()) throw DataError(who + ": header is JSON but not an object");

  const int64_t buffer_size = file_size - 8 - static_cast<int64_t>(header_len);
  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw DataError(who + ": __metadata__ is not an object of strings");
      for (auto& [key, text] : value.items()) {
        if (!text.is_string()) throw DataError(who + ": __metadata__ entry '" + key + "' is not a string");
        r.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    const std::string tensor_who = who + ": tensor '" + name + "'";
    if (!value.is_object()) throw DataError(tensor_who + " is not described by an object");
    auto dtype_it = value.find("dtype");
    auto shape_it = value.find("shape");
    auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string()) throw DataError(tensor_who + " has no string \"dtype\"");
    if (shape_it == value.end() || !shape_it->is_array()) throw DataError(tensor_who + " has no array \"shape\"");
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      throw DataError(tensor_who + " has no two-element \"data_offsets\"");
    }
    SafetensorsTensorInfo info;
    info.name = name;
    const std::string dtype_name = dtype_it->get<std::string>();
    std::optional<SafetensorsDtype> dtype = parse_safetensors_dtype(dtype_name);
    if (!dtype) throw DataError(tensor_who + " has unknown dtype '" + dtype_name + "'");
    info.dtype = *dtype;
    for (const nlohmann::json& d : *shape_it) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxExtent) {
        throw DataError(tensor_who + " has a bad shape " + shape_it->dump() + " (dims must be integers >= 0)");
      }
      info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    for (int k = 0; k < 2; ++k) {
      const nlohmann::json& o = (*offsets_it)[k];
      if (!o.is_number_unsigned() || o.get<uint64_t>() > kMaxExtent) {
        throw DataError(tensor_who + " has bad data_offsets " + offsets_it->dump() + " (must be integers >= 0)");
      }
    }
    info.begin = static_cast<int64_t>((*offsets_it)[0].get<uint64_t>());
    info.end = static_cast<int64_t>((*offsets_it)[1].get<uint64_t>());
    if (info.end < info.begin) {
      throw DataError(tensor_who + ": data_offsets " + span_text(info.begin, info.end) + " end before they begin");
    }
    if (info.end > buffer_size) {
      throw DataError(tensor_who + ": data_offsets " + span_text(info.begin, info.end) +
                      " are out of range: the data buffer after the header has " + std::to_string(buffer_size) +
                      " bytes");
    }
    const int64_t elements = checked_elements(info.shape);
    const int64_t dsize = static_cast<int64_t>(safetensors_dtype_size(info.dtype));
    if (elements < 0 || elements * dsize != info.num_bytes()) {
      throw DataError(tensor_who + ": shape " + shape_text(info.shape) + " of " + dtype_name + " needs " +
                      (elements < 0 ? std::string("more than 2^62") : std::to_string(elements * dsize)) +
                      " bytes, but data_offsets " + span_text(info.begin, info.end) + " span " +
                      std::to_string(info.num_bytes()));
    }
    r.tensors_.push_back(std::move(info));
  }

  // The tensors must tile the buffer exactly: no overlap (which would alias two tensors), no
  // gap and nothing left over (either means the file is not what its header says).
  std::sort(r.tensors_.begin(), r.tensors_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t covered = 0;
  const SafetensorsTensorInfo* previous = nullptr;
  for (const SafetensorsTensorInfo& t : r.tensors_) {
    if (t.begin < covered) {
      throw DataError(who + ": tensors '" + previous->name + "' " + span_text(previous->begin, previous->end) +
                      " and '" + t.name + "' " + span_text(t.begin, t.end) + " overlap");
    }
    if (t.begin > covered) {
      throw DataError(who + ": bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                      ") of the data buffer belong to no tensor (data_offsets leave a gap before '" + t.name + "')");
    }
    covered = t.end;
    previous = &t;
  }
  if (covered != buffer_size) {
    throw DataError(who + ": the tensors cover " + std::to_string(covered) + " bytes but the data buffer after the " +
                    "header has " + std::to_string(buffer_size) + " bytes (the data_offsets do not cover the buffer)");
  }
  for (size_t k = 0; k < r.tensors_.size(); ++k) r.index_.emplace(r.tensors_[k].name, k);
  r.buffer_ = reinterpret_cast<const std::byte*>(r.file_.data() + 8 + header_len);
  return r;
}

const SafetensorsTensorInfo* SafetensorsReader::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensorInfo& SafetensorsReader::tensor(std::string_view name) const {
  const SafetensorsTensorInfo* info = find(name);
  if (info == nullptr) {
    throw DataError("safetensors file '" + path() + "' has no tensor '" + std::string(name) + "'");
  }
  return *info;
}

std::span<const std::byte> SafetensorsReader::bytes(const SafetensorsTensorInfo& info) const {
  return {buffer_ + info.begin, static_cast<size_t>(info.num_bytes())};
}

// ---- writer ------------------------------------------------------------------------------

struct SafetensorsWriter::Impl {
  detail::FileWriter out;
  explicit Impl(const std::string& path) : out(path) {}
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<Entry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), entries_(std::move(entries)), impl_(nullptr) {
  const std::string who = "cannot write safetensors file '" + path + "'";
  // ordered_json keeps __metadata__ first and the tensors in buffer order, which is what a
  // person reading the header expects.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string_view> names;
  int64_t offset = 0;
  for (const Entry& t : entries_) {
    if (t.name == "__metadata__") throw DataError(who + ": '__metadata__' is reserved, not a tensor name");
    if (!names.insert(t.name).second) throw DataError(who + ": tensor name '" + t.name + "' appears twice");
    for (int64_t d : t.shape) {
      if (d < 0) throw DataError(who + ": tensor '" + t.name + "' has negative dim in shape " + shape_text(t.shape));
    }
    const int64_t elements = checked_elements(t.shape);
    if (elements < 0) throw DataError(who + ": tensor '" + t.name + "' is too large");
    const int64_t bytes = elements * static_cast<int64_t>(safetensors_dtype_size(t.dtype));
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(safetensors_dtype_name(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + bytes};
    header[t.name] = std::move(entry);
    sizes_.push_back(bytes);
    offset += bytes;
  }
  tensor_crc_.assign(entries_.size(), 0);
  std::string text = header.dump();
  // Spaces are valid trailing JSON; padding to 8 puts the data buffer at an 8-aligned offset.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  impl_ = new Impl(path);
  impl_->out.write(&header_len, 8);
  impl_->out.write(text.data(), text.size());
  file_crc_ = crc32c(crc32c(0, &header_len, 8), text.data(), text.size());
  while (current_ < sizes_.size() && sizes_[current_] == 0) ++current_;
}

SafetensorsWriter::~SafetensorsWriter() { delete impl_; }

void SafetensorsWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    if (current_ >= sizes_.size())
      throw DataError("cannot write safetensors file '" + path_ + "': more bytes than its tensors hold");
    const size_t n = std::min<size_t>(bytes, static_cast<size_t>(sizes_[current_] - current_done_));
    impl_->out.write(p, n);
    tensor_crc_[current_] = crc32c(tensor_crc_[current_], p, n);
    file_crc_ = crc32c(file_crc_, p, n);
    p += n;
    bytes -= n;
    current_done_ += static_cast<int64_t>(n);
    if (current_done_ == sizes_[current_]) {
      current_done_ = 0;
      do ++current_;
      while (current_ < sizes_.size() && sizes_[current_] == 0);
    }
  }
}

void SafetensorsWriter::finish(bool sync) {
  if (current_ < sizes_.size())
    throw DataError("cannot finish safetensors file '" + path_ + "': tensor '" + entries_[current_].name +
                    "' is incomplete");
  if (sync) impl_->out.sync();
  impl_->out.close();
}

int64_t SafetensorsWriter::file_bytes() const { return impl_->out.bytes_written(); }

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& t : tensors) entries.push_back({t.name, t.dtype, t.shape});
  SafetensorsWriter w(path, std::move(entries), metadata);
  for (const auto& t : tensors) {
    const int64_t elements = checked_elements(t.shape);
    const size_t bytes = static_cast<size_t>(elements) * safetensors_dtype_size(t.dtype);
    if (bytes > 0 && t.data == nullptr)
      throw DataError("cannot write safetensors file '" + path + "': tensor '" + t.name + "' has no data");
    if (bytes > 0) w.write(t.data, bytes);
  }
  w.finish(false);
}

}  // namespace keel::data
