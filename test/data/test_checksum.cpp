#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <filesystem>
#include <random>
#include <vector>

#include "data/checksum.h"
#include "data/safetensors.h"

using namespace keel::data;

TEST_CASE("crc32c: standard check value, incremental, hardware and software paths agree", "[checksum]") {
  const char* check = "123456789";
  CHECK(crc32c(0, check, 9) == 0xe3069283u);  // the CRC-32C catalogue's check value
  CHECK(crc32c_hex(0xe3069283u) == "e3069283");
  CHECK(crc32c(crc32c(0, check, 4), check + 4, 5) == 0xe3069283u);
  // Lengths around the 8-byte word size, split at every point.
  std::mt19937 rng(1);
  std::vector<unsigned char> buf(1000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const uint32_t whole = crc32c(0, buf.data(), buf.size());
  for (size_t cut = 0; cut <= 17; ++cut)
    CHECK(crc32c(crc32c(0, buf.data(), cut), buf.data() + cut, buf.size() - cut) == whole);
  // A flipped bit changes it.
  buf[500] ^= 1;
  CHECK(crc32c(0, buf.data(), buf.size()) != whole);
}

// The fingerprint reads blocks at the start, middle and end of a file, and its size: a change
// in any of them shows, one between the blocks does not (the price of reading 192 KiB of a
// shard of any size), and the same bytes give the same fingerprint.
TEST_CASE("content_fingerprint: the size and blocks at the start, middle and end", "[checksum][fingerprint]") {
  const std::string path = (std::filesystem::temp_directory_path() / ("keel-fingerprint-" + std::to_string(::getpid()))).string();
  const int64_t size = 1 << 20;
  std::vector<unsigned char> bytes(static_cast<size_t>(size));
  std::mt19937 rng(2);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  auto print_of = [&](const std::vector<unsigned char>& content) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(content.data()), static_cast<std::streamsize>(content.size()));
    return content_fingerprint(path);
  };
  const std::string base = print_of(bytes);
  CHECK(base.size() == 8);
  CHECK(print_of(bytes) == base);
  for (const int64_t at : {int64_t{0}, kFingerprintBlock - 1, size / 2, size / 2 - kFingerprintBlock / 2, size - 1}) {
    std::vector<unsigned char> changed = bytes;
    changed[static_cast<size_t>(at)] ^= 1;
    INFO("byte " << at);
    CHECK(print_of(changed) != base);
  }
  std::vector<unsigned char> between = bytes;
  between[static_cast<size_t>(size / 4)] ^= 1;  // in no block
  CHECK(print_of(between) == base);
  std::vector<unsigned char> longer = bytes;
  longer.push_back(0);
  CHECK(print_of(longer) != base);
  // A file smaller than a block: its blocks overlap, every byte counts.
  const std::vector<unsigned char> small(bytes.begin(), bytes.begin() + 100);
  std::vector<unsigned char> small_changed = small;
  small_changed[50] ^= 1;
  CHECK(print_of(small) != print_of(small_changed));
  std::filesystem::remove(path);
  CHECK_THROWS_WITH(content_fingerprint(path), Catch::Contains(path) && Catch::Contains("No such file"));
}

TEST_CASE("streaming safetensors writer: tensors written piecewise, CRCs per tensor and per file", "[safetensors]") {
  auto path = (std::filesystem::temp_directory_path() / "keel-stream-writer.safetensors").string();
  std::vector<float> a(100), b(7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  {
    SafetensorsWriter w(path, {{"a", SafetensorsDtype::F32, {10, 10}}, {"empty", SafetensorsDtype::F32, {0}},
                               {"b", SafetensorsDtype::F32, {7}}},
                        {{"note", "x"}});
    w.write(a.data(), 40 * sizeof(float));  // a, in two pieces; the second runs into b
    std::vector<float> rest(a.begin() + 40, a.end());
    rest.insert(rest.end(), b.begin(), b.begin() + 3);
    w.write(rest.data(), rest.size() * sizeof(float));
    w.write(b.data() + 3, 4 * sizeof(float));
    w.finish(true);
    CHECK(w.tensor_crc(0) == crc32c(0, a.data(), a.size() * sizeof(float)));
    CHECK(w.tensor_crc(2) == crc32c(0, b.data(), b.size() * sizeof(float)));
    CHECK(w.file_bytes() == static_cast<int64_t>(std::filesystem::file_size(path)));
  }
  auto r = SafetensorsReader::open(path);
  CHECK(std::memcmp(r.bytes("a").data(), a.data(), a.size() * 4) == 0);
  CHECK(std::memcmp(r.bytes("b").data(), b.data(), b.size() * 4) == 0);
  CHECK(r.metadata().at("note") == "x");
  SafetensorsWriter incomplete(path, {{"a", SafetensorsDtype::F32, {2}}});
  CHECK_THROWS_WITH(incomplete.finish(false), Catch::Contains("'a' is incomplete"));
  std::filesystem::remove(path);
}
