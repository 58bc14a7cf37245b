// A temporary run setup for end-to-end tests: synthetic token shards and a tiny run config.
#pragma once

#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/run_config.h"
#include "common/temp_dir.h"
#include "data/token_file.h"

namespace keel::test {

// A learnable token stream: next = 3 * token + 1 (mod 64), with 1 in 8 tokens random.
inline std::vector<uint32_t> synthetic_tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> out;
  uint32_t tok = 0;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(tok);
    tok = rng() % 8 == 0 ? rng() % 64 : (3 * tok + 1) % 64;
  }
  return out;
}

struct Workspace {
  TempDir dir{"run"};
  std::string config;
  nlohmann::json json;
  explicit Workspace(const nlohmann::json& patch = nlohmann::json::object()) {
    data::write_llmc_shard(dir / "train.bin", synthetic_tokens(20000, 1), false);
    data::write_llmc_shard(dir / "val.bin", synthetic_tokens(4000, 2), false);
    json = tiny_run_json();
    json["data"] = {{"train", dir / "train.bin"}, {"val", dir / "val.bin"}};
    json["train"]["eval_interval"] = 10;
    json["train"]["eval_batches"] = 2;
    json.merge_patch(patch);
    config = dir / "run.json";
    std::ofstream(config) << json.dump(2);
  }
};

// n multiple-choice token-id items (keel eval's JSONL) on the synthetic stream: a 3-token context
// of it, its true 2-token continuation and the continuations of three other starts (none equal to
// the true one), the true one at a random place. A model that learned the stream picks it.
inline void write_stream_choice_items(const std::string& path, int n) {
  std::mt19937 rng(7);
  auto chain = [](uint32_t t, int len) {
    std::vector<uint32_t> out;
    for (int i = 0; i < len; ++i) out.push_back(t = (3 * t + 1) % 64);
    return out;
  };
  std::ofstream out(path);
  for (int i = 0; i < n; ++i) {
    const uint32_t start = rng() % 64;
    std::vector<uint32_t> context = {start};
    for (uint32_t t : chain(start, 2)) context.push_back(t);
    const std::vector<uint32_t> right = chain(context.back(), 2);
    std::vector<std::vector<uint32_t>> endings;
    while (endings.size() < 3) {
      const std::vector<uint32_t> wrong = chain(rng() % 64, 2);
      if (wrong != right) endings.push_back(wrong);
    }
    const int label = static_cast<int>(rng() % 4);
    endings.insert(endings.begin() + label, right);
    out << nlohmann::json{{"context_ids", context}, {"ending_ids", endings}, {"label", label}}.dump() << '\n';
  }
}

// A whole file's bytes (empty when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Training loss per step; a step recorded twice (replayed after a crash) keeps its last value.
inline std::map<int64_t, double> losses_by_step(const std::vector<nlohmann::json>& records) {
  std::map<int64_t, double> out;
  for (const auto& r : records)
    if (r.contains("loss")) out[r["step"].get<int64_t>()] = r["loss"].get<double>();
  return out;
}

}  // namespace keel::test
