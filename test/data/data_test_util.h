// Helpers for the data tests: a scratch directory that cleans up after itself, raw file
// edits for building corrupt inputs, and catching a DataError's message.
#pragma once

#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/token_file.h"

namespace keel::data::test {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("keel_test_data_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Overwrites bytes at `offset` with the object representation of `value`.
template <class T>
void patch(const std::string& path, int64_t offset, T value) {
  std::vector<unsigned char> bytes = read_bytes(path);
  REQUIRE(offset + static_cast<int64_t>(sizeof(T)) <= static_cast<int64_t>(bytes.size()));
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
  write_bytes(path, bytes);
}

template <class T>
void append_pod(std::vector<unsigned char>& out, T value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// The message of the DataError `f` throws; fails the test when it throws none.
template <class F>
std::string data_error_of(F&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  FAIL("expected a keel::data::DataError");
  return {};
}

}  // namespace keel::data::test
