// Editing a checkpoint's meta.json in tests, as another save (another device, build or layout)
// could have written it: the edit is applied and meta.json's own checksum recomputed, so that
// the checkpoint stays sound and only what the test means to change differs.
#pragma once

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/checksum.h"
#include "data/safetensors.h"
#include "kernels/dtype.h"
#include "train/checkpoint.h"

namespace keel::test {

// Writes `meta` to the meta.json at meta_path with its own checksum (meta_crc32c) recomputed.
inline void write_checkpoint_meta(const std::string& meta_path, nlohmann::json meta) {
  meta["meta_crc32c"] = meta_checksum(meta);
  std::ofstream(meta_path) << meta.dump(2);
}

// Applies `edit` to the meta.json of the checkpoint directory, keeping it sound.
template <class Edit>
void edit_checkpoint_meta(const std::string& checkpoint_dir, Edit&& edit) {
  const std::string path = checkpoint_dir + "/meta.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(path));
  edit(meta);
  write_checkpoint_meta(path, meta);
}

// Where an entry's bytes lie in a safetensors file: {offset, size} (the data buffer is the
// file's tail).
inline std::pair<int64_t, int64_t> entry_span_in_file(const std::string& file, const std::string& entry) {
  const auto r = data::SafetensorsReader::open(file);
  int64_t buffer = 0;
  for (const auto& t : r.tensors()) buffer = std::max(buffer, t.end);
  const auto& info = r.tensor(entry);
  return {static_cast<int64_t>(std::filesystem::file_size(file)) - buffer + info.begin, info.num_bytes()};
}

// Sets element `index` of `entry` ("adam_v/layers.0.attn.wq") in the checkpoint's file to
// `value` (in the entry's dtype) and updates the file's and the tensor's checksums in meta.json:
// a checkpoint that was saved holding that value, not one damaged afterwards.
inline void set_saved_value(const std::string& checkpoint_dir, const std::string& file_name, const std::string& entry,
                            int64_t index, float value) {
  const std::string file = checkpoint_dir + "/" + file_name;
  const auto [offset, size] = entry_span_in_file(file, entry);
  const bool wide = data::SafetensorsReader::open(file).tensor(entry).dtype == data::SafetensorsDtype::F32;
  char bytes[4];
  if (wide) {
    std::memcpy(bytes, &value, 4);
  } else {  // the checkpoints' 16-bit weights are bf16
    const uint16_t h = f32_to_bf16(value);
    std::memcpy(bytes, &h, 2);
  }
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset + index * (wide ? 4 : 2));
    f.write(bytes, wide ? 4 : 2);
  }
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  edit_checkpoint_meta(checkpoint_dir, [&](nlohmann::json& m) {
    nlohmann::json& info = m["files"][file_name];
    info["tensors"][entry] = data::crc32c_hex(data::crc32c(0, all.data() + offset, static_cast<size_t>(size)));
    info["crc32c"] = data::crc32c_hex(data::crc32c(0, all.data(), all.size()));
  });
}

}  // namespace keel::test
