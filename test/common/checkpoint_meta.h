// Editing a checkpoint's meta.json in tests, as another save (another device, build or layout)
// could have written it: the edit is applied and meta.json's own checksum recomputed, so that
// the checkpoint stays sound and only what the test means to change differs.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

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

}  // namespace keel::test
