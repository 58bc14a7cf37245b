// safetensors: round trip of every dtype and metadata, a file written by the Python package,
// every kind of corruption, and writer I/O errors.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "data/file_io.h"
#include "data/safetensors.h"
#include "data_test_util.h"

using namespace keel::data;
using namespace keel::data::test;
using Catch::Contains;

namespace {

const std::vector<SafetensorsDtype> kAllDtypes{
    SafetensorsDtype::BOOL, SafetensorsDtype::U8,  SafetensorsDtype::I8,  SafetensorsDtype::F8_E4M3,
    SafetensorsDtype::F8_E5M2, SafetensorsDtype::U16, SafetensorsDtype::I16, SafetensorsDtype::F16,
    SafetensorsDtype::BF16, SafetensorsDtype::U32, SafetensorsDtype::I32, SafetensorsDtype::F32,
    SafetensorsDtype::U64, SafetensorsDtype::I64, SafetensorsDtype::F64};

// A file with the given header text (unpadded) and a zeroed data buffer.
void write_raw_safetensors(const std::string& path, const std::string& header, size_t buffer_bytes) {
  std::vector<unsigned char> bytes;
  append_pod<uint64_t>(bytes, header.size());
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + buffer_bytes, 0);
  write_bytes(path, bytes);
}

template <class T>
T value_at(const SafetensorsReader& r, const std::string& name, size_t k) {
  std::span<const std::byte> b = r.bytes(name);
  REQUIRE((k + 1) * sizeof(T) <= b.size());
  T v;
  std::memcpy(&v, b.data() + k * sizeof(T), sizeof(T));
  return v;
}

}  // namespace

TEST_CASE("safetensors dtype names and sizes", "[data][safetensors]") {
  for (SafetensorsDtype d : kAllDtypes) CHECK(parse_safetensors_dtype(safetensors_dtype_name(d)) == d);
  CHECK(safetensors_dtype_size(SafetensorsDtype::BF16) == 2);
  CHECK(safetensors_dtype_size(SafetensorsDtype::F64) == 8);
  CHECK(safetensors_dtype_name(SafetensorsDtype::F8_E4M3) == "F8_E4M3");
  CHECK_FALSE(parse_safetensors_dtype("F128").has_value());
}

TEST_CASE("safetensors round trip: every dtype, scalars, empty tensors, metadata", "[data][safetensors]") {
  TempDir dir;
  const std::string path = dir / "all.safetensors";
  std::vector<std::vector<unsigned char>> payloads;
  std::vector<SafetensorsTensorToWrite> tensors;
  for (size_t k = 0; k < kAllDtypes.size(); ++k) {
    const std::vector<int64_t> shape{2, 3};
    std::vector<unsigned char> data(6 * safetensors_dtype_size(kAllDtypes[k]));
    for (size_t b = 0; b < data.size(); ++b) data[b] = static_cast<unsigned char>(k * 31 + b * 7 + 1);
    payloads.push_back(std::move(data));
    tensors.push_back({"layers." + std::to_string(k) + "." + std::string(safetensors_dtype_name(kAllDtypes[k])),
                       kAllDtypes[k], shape, payloads.back().data()});
  }
  const float scalar = 2.5f;
  tensors.push_back({"scalar", SafetensorsDtype::F32, {}, &scalar});
  tensors.push_back({"empty", SafetensorsDtype::BF16, {0, 4}, nullptr});
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"step", "1200"}, {"note", "ünïcode \"quoted\""}};
  write_safetensors(path, tensors, metadata);

  // Header padded with spaces to 8 bytes, so the buffer starts 8-aligned.
  std::vector<unsigned char> raw = read_bytes(path);
  uint64_t header_len;
  std::memcpy(&header_len, raw.data(), 8);
  CHECK(header_len % 8 == 0);
  CHECK(raw[8] == '{');

  SafetensorsReader r = SafetensorsReader::open(path);
  CHECK(r.path() == path);
  CHECK(r.metadata() == metadata);
  REQUIRE(r.tensors().size() == tensors.size());
  for (size_t k = 0; k < kAllDtypes.size(); ++k) {
    const SafetensorsTensorInfo& info = r.tensor(tensors[k].name);
    CHECK(info.dtype == kAllDtypes[k]);
    CHECK(info.shape == std::vector<int64_t>{2, 3});
    CHECK(info.num_elements() == 6);
    std::span<const std::byte> b = r.bytes(info);
    REQUIRE(b.size() == payloads[k].size());
    CHECK(std::memcmp(b.data(), payloads[k].data(), b.size()) == 0);
  }
  CHECK(r.tensor("scalar").shape.empty());
  CHECK(r.tensor("scalar").num_elements() == 1);
  CHECK(value_at<float>(r, "scalar", 0) == 2.5f);
  CHECK(r.tensor("empty").num_bytes() == 0);
  CHECK(r.tensor("empty").shape == std::vector<int64_t>{0, 4});
  // Listed in buffer order, which is the order written.
  for (size_t k = 0; k + 1 < r.tensors().size(); ++k) CHECK(r.tensors()[k].end <= r.tensors()[k + 1].begin);
  CHECK(r.find("absent") == nullptr);
  CHECK_THAT(data_error_of([&] { r.tensor("absent"); }), Contains(path) && Contains("no tensor 'absent'"));
}

TEST_CASE("a file written by Python's safetensors package reads back exactly", "[data][safetensors]") {
  // Made by scripts/gen_safetensors_fixture.py (torch + safetensors.torch.save_file).
  SafetensorsReader r = SafetensorsReader::open(KEEL_FIXTURE_DIR "/safetensors_py.safetensors");
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.metadata().at("source") == "keel fixture");
  CHECK(r.tensors().size() == 9);

  CHECK(r.tensor("f32").dtype == SafetensorsDtype::F32);
  CHECK(r.tensor("f32").shape == std::vector<int64_t>{2, 3});
  const float f32[] = {1.5f, -2.0f, 3.25f, 0.0f, -0.5f, 1024.0f};
  for (size_t k = 0; k < 6; ++k) CHECK(value_at<float>(r, "f32", k) == f32[k]);

  CHECK(r.tensor("bf16").dtype == SafetensorsDtype::BF16);
  const uint16_t bf16[] = {0x3f80, 0xc000, 0x3f00, 0x4040};  // 1, -2, 0.5, 3
  for (size_t k = 0; k < 4; ++k) CHECK(value_at<uint16_t>(r, "bf16", k) == bf16[k]);

  CHECK(r.tensor("f16").dtype == SafetensorsDtype::F16);
  const uint16_t f16[] = {0x3c00, 0xc000, 0x7bff};  // 1, -2, 65504
  for (size_t k = 0; k < 3; ++k) CHECK(value_at<uint16_t>(r, "f16", k) == f16[k]);

  CHECK(r.tensor("f64").dtype == SafetensorsDtype::F64);
  CHECK(value_at<double>(r, "f64", 0) == 3.141592653589793);
  CHECK(value_at<double>(r, "f64", 1) == -1e300);

  CHECK(r.tensor("i32").dtype == SafetensorsDtype::I32);
  CHECK(value_at<int32_t>(r, "i32", 0) == -1);
  CHECK(value_at<int32_t>(r, "i32", 1) == 2147483647);
  CHECK(value_at<int32_t>(r, "i32", 2) == 0);

  CHECK(r.tensor("i64").dtype == SafetensorsDtype::I64);
  CHECK(r.tensor("i64").shape == std::vector<int64_t>{2, 1});
  CHECK(value_at<int64_t>(r, "i64", 0) == -5);
  CHECK(value_at<int64_t>(r, "i64", 1) == (int64_t{1} << 40));

  CHECK(r.tensor("u16").dtype == SafetensorsDtype::U16);
  CHECK(value_at<uint16_t>(r, "u16", 1) == 65535);
  CHECK(value_at<uint16_t>(r, "u16", 2) == 1234);

  CHECK(r.tensor("scalar").shape.empty());
  CHECK(value_at<float>(r, "scalar", 0) == 7.0f);
  CHECK(r.tensor("empty").shape == std::vector<int64_t>{0, 3});
  CHECK(r.tensor("empty").num_bytes() == 0);
}

TEST_CASE("corrupt safetensors files are rejected with the file and the problem", "[data][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  auto error = [&] { return data_error_of([&] { SafetensorsReader::open(path); }); };

  SECTION("empty and too short") {
    write_bytes(path, {});
    CHECK_THAT(error(), Contains(path) && Contains("empty"));
    write_bytes(path, {1, 2, 3});
    CHECK_THAT(error(), Contains(path) && Contains("8-byte header length"));
  }
  SECTION("header length beyond the file size") {
    const float v[2] = {1, 2};
    write_safetensors(path, {{"w", SafetensorsDtype::F32, {2}, v}});
    const uint64_t size = std::filesystem::file_size(path);
    patch<uint64_t>(path, 0, size);
    CHECK_THAT(error(), Contains(path) && Contains("header length " + std::to_string(size)) &&
                            Contains("runs past the end of the file"));
    patch<uint64_t>(path, 0, ~uint64_t{0});
    CHECK_THAT(error(), Contains("runs past the end"));
  }
  SECTION("bad JSON") {
    write_raw_safetensors(path, R"({"w": {"dtype": "F32", )", 0);
    CHECK_THAT(error(), Contains(path) && Contains("not valid JSON"));
    write_raw_safetensors(path, "[1, 2]", 0);
    CHECK_THAT(error(), Contains("not an object"));
  }
  SECTION("unknown dtype") {
    write_raw_safetensors(path, R"({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})", 16);
    CHECK_THAT(error(), Contains(path) && Contains("tensor 'w'") && Contains("unknown dtype 'F128'"));
  }
  SECTION("shape * dtype size != byte span") {
    write_raw_safetensors(path, R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8);
    CHECK_THAT(error(), Contains(path) && Contains("tensor 'w'") && Contains("shape [3] of F32 needs 12 bytes") &&
                            Contains("span 8"));
  }
  SECTION("offsets out of range") {
    write_raw_safetensors(path, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12);
    CHECK_THAT(error(), Contains(path) && Contains("tensor 'w'") && Contains("[0, 16]") && Contains("out of range") &&
                            Contains("12 bytes"));
    write_raw_safetensors(path, R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 12);
    CHECK_THAT(error(), Contains("end before they begin"));
    write_raw_safetensors(path, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 0);
    CHECK_THAT(error(), Contains("bad data_offsets"));
  }
  SECTION("overlapping tensors") {
    write_raw_safetensors(path,
                          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          12);
    CHECK_THAT(error(), Contains(path) && Contains("'a' [0, 8]") && Contains("'b' [4, 12]") && Contains("overlap"));
  }
  SECTION("a gap between tensors") {
    write_raw_safetensors(path,
                          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                          20);
    CHECK_THAT(error(), Contains(path) && Contains("bytes [8, 12)") && Contains("belong to no tensor"));
  }
  SECTION("offsets not covering the buffer") {
    write_raw_safetensors(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 12);
    CHECK_THAT(error(), Contains(path) && Contains("cover 8 bytes") && Contains("has 12 bytes"));
  }
  SECTION("duplicate tensor name") {
    write_raw_safetensors(path,
                          R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                              "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                          8);
    CHECK_THAT(error(), Contains(path) && Contains("'a' twice"));
  }
  SECTION("malformed entries and metadata") {
    write_raw_safetensors(path, R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})", 0);
    CHECK_THAT(error(), Contains("tensor 'a'") && Contains("bad shape"));
    write_raw_safetensors(path, R"({"a": {"dtype": "F32", "data_offsets": [0, 0]}})", 0);
    CHECK_THAT(error(), Contains("tensor 'a'") && Contains("\"shape\""));
    write_raw_safetensors(path, R"({"__metadata__": {"step": 12}})", 0);
    CHECK_THAT(error(), Contains("__metadata__") && Contains("'step'"));
  }
}

// keel convert's config.json and the run's config.json go through this: an ofstream checked
// before its destructor flushes reported success for a small file on a full disk.
TEST_CASE("write_text_file reports a full disk naming the path", "[data][io]") {
  CHECK_THAT(data_error_of([] { keel::data::detail::write_text_file("/dev/full", "{\"a\": 1}\n"); }),
             Contains("cannot write '/dev/full'") && Contains(std::strerror(ENOSPC)));
}

TEST_CASE("safetensors writer reports bad input and I/O errors naming the path", "[data][safetensors][errors]") {
  TempDir dir;
  const float v[4] = {1, 2, 3, 4};

  SECTION("no space left on the device") {
    // /dev/full accepts the open and fails every write with ENOSPC.
    CHECK_THAT(data_error_of([&] { write_safetensors("/dev/full", {{"w", SafetensorsDtype::F32, {4}, v}}); }),
               Contains("/dev/full") && Contains(std::strerror(ENOSPC)));
  }
  SECTION("cannot create the file") {
    if (geteuid() != 0) {
      ::chmod(dir.str().c_str(), 0500);
      const std::string path = dir / "denied.safetensors";
      CHECK_THAT(data_error_of([&] { write_safetensors(path, {{"w", SafetensorsDtype::F32, {4}, v}}); }),
                 Contains(path) && Contains(std::strerror(EACCES)));
    }
    // Root ignores permissions; a missing directory fails for everyone.
    const std::string path = dir / "no_such_dir/x.safetensors";
    CHECK_THAT(data_error_of([&] { write_safetensors(path, {{"w", SafetensorsDtype::F32, {4}, v}}); }),
               Contains(path) && Contains(std::strerror(ENOENT)));
  }
  SECTION("bad input") {
    const std::string path = dir / "x.safetensors";
    CHECK_THAT(data_error_of([&] {
                 write_safetensors(path, {{"w", SafetensorsDtype::F32, {2}, v}, {"w", SafetensorsDtype::F32, {2}, v}});
               }),
               Contains(path) && Contains("'w' appears twice"));
    CHECK_THAT(data_error_of([&] { write_safetensors(path, {{"__metadata__", SafetensorsDtype::F32, {1}, v}}); }),
               Contains("reserved"));
    CHECK_THAT(data_error_of([&] { write_safetensors(path, {{"w", SafetensorsDtype::F32, {-2}, v}}); }),
               Contains("negative"));
  }
}
