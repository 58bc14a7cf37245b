// Token files: llm.c shards (both versions), Megatron .bin/.idx, >2 GiB files, path expansion
// and the error message for every kind of broken input.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/child.h"
#include "data/token_file.h"
#include "data_test_util.h"

using namespace keel::data;
using namespace keel::data::test;
using Catch::Contains;
using keel::test::ChildResult;
using keel::test::run_child;

namespace {

std::vector<int32_t> read_all(const TokenFile& f) {
  std::vector<int32_t> out(static_cast<size_t>(f.num_tokens()));
  f.read(0, f.num_tokens(), out.data());
  return out;
}

// An llm.c header by hand (not via write_llmc_shard), for the corrupt-file tests.
std::vector<unsigned char> llmc_header(int32_t magic, int32_t version, int32_t count) {
  std::vector<unsigned char> out;
  append_pod(out, magic);
  append_pod(out, version);
  append_pod(out, count);
  out.resize(1024, 0);
  return out;
}

// A sparse file: size bytes long, `head` at offset 0, costing almost no disk.
void make_sparse(const std::string& path, const std::vector<unsigned char>& head, int64_t size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()));
  REQUIRE(::ftruncate(fd, size) == 0);
  ::close(fd);
}

template <class T>
void pwrite_value(const std::string& path, int64_t offset, T value) {
  int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, &value, sizeof value, offset) == static_cast<ssize_t>(sizeof value));
  ::close(fd);
}

}  // namespace

TEST_CASE("llm.c uint16 shard (magic 20240520, version 1) round-trips", "[data][token_file]") {
  TempDir dir;
  std::vector<uint32_t> tokens;
  for (uint32_t k = 0; k < 1000; ++k) tokens.push_back((k * 7919u) % 65536u);
  tokens.push_back(65535);
  const std::string path = dir / "gpt2.bin";
  write_llmc_shard(path, tokens, /*u32=*/false);

  std::vector<unsigned char> raw = read_bytes(path);
  REQUIRE(raw.size() == 1024 + 2 * tokens.size());
  int32_t header[3];
  std::memcpy(header, raw.data(), sizeof header);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == static_cast<int32_t>(tokens.size()));

  TokenFile f = TokenFile::open(path);
  CHECK(f.path() == path);
  CHECK(f.format() == TokenFileFormat::llmc);
  CHECK(f.token_bytes() == 2);
  CHECK(f.num_tokens() == static_cast<int64_t>(tokens.size()));
  CHECK(f.doc_starts().empty());
  std::vector<int32_t> all = read_all(f);
  for (size_t k = 0; k < tokens.size(); ++k) {
    REQUIRE(f.token(static_cast<int64_t>(k)) == tokens[k]);
    REQUIRE(static_cast<uint32_t>(all[k]) == tokens[k]);
  }
  std::vector<int32_t> part(5);
  f.read(996, 5, part.data());
  CHECK(static_cast<uint32_t>(part[4]) == 65535u);
}

TEST_CASE("llm.c uint32 shard (magic 20240801, version 7) round-trips", "[data][token_file]") {
  TempDir dir;
  const std::vector<uint32_t> tokens{0, 1, 65536, 128255, 2147483647u, 4000000000u};
  const std::string path = dir / "llama3.bin";
  write_llmc_shard(path, tokens, /*u32=*/true);
  std::vector<unsigned char> raw = read_bytes(path);
  int32_t header[3];
  std::memcpy(header, raw.data(), sizeof header);
  CHECK(header[0] == 20240801);
  CHECK(header[1] == 7);
  CHECK(header[2] == 6);

  TokenFile f = TokenFile::open(path);
  CHECK(f.token_bytes() == 4);
  CHECK(f.num_tokens() == 6);
  std::vector<int32_t> all = read_all(f);
  for (size_t k = 0; k < tokens.size(); ++k) {
    CHECK(f.token(static_cast<int64_t>(k)) == tokens[k]);
    CHECK(static_cast<uint32_t>(all[k]) == tokens[k]);  // bit pattern survives int32 storage
  }
  // A moved-from file gives up its mapping; the moved-to one reads on.
  TokenFile moved = std::move(f);
  CHECK(moved.token(3) == 128255u);
}

TEST_CASE("Megatron dataset round-trips through prefix, .bin and .idx", "[data][token_file]") {
  TempDir dir;
  const std::vector<std::vector<uint32_t>> docs{{1, 2, 3}, {}, {4, 5}, {6}, {60000, 7, 8, 9}};
  const std::vector<int64_t> expected_starts{0, 3, 3, 5, 6};
  std::vector<uint32_t> flat;
  for (const auto& d : docs) flat.insert(flat.end(), d.begin(), d.end());

  for (MegatronDtype dtype : {MegatronDtype::uint16, MegatronDtype::int32}) {
    const int bytes = dtype == MegatronDtype::uint16 ? 2 : 4;
    const std::string prefix = dir / (bytes == 2 ? "m16" : "m32");
    write_megatron_dataset(prefix, docs, dtype);

    // The index layout, read back by hand from the MMIDIDX description.
    std::vector<unsigned char> idx = read_bytes(prefix + ".idx");
    const int64_t S = 5, D = 6;
    REQUIRE(idx.size() == static_cast<size_t>(34 + 4 * S + 8 * S + 8 * D));
    CHECK(std::memcmp(idx.data(), "MMIDIDX\0\0", 9) == 0);
    uint64_t u64;
    std::memcpy(&u64, idx.data() + 9, 8);
    CHECK(u64 == 1);
    CHECK(idx[17] == (bytes == 2 ? 8 : 4));
    std::memcpy(&u64, idx.data() + 18, 8);
    CHECK(u64 == 5);
    std::memcpy(&u64, idx.data() + 26, 8);
    CHECK(u64 == 6);  // documents + 1, as Megatron writes it
    int64_t last_pointer, last_doc_index;
    std::memcpy(&last_pointer, idx.data() + 34 + 4 * S + 8 * (S - 1), 8);
    std::memcpy(&last_doc_index, idx.data() + 34 + 12 * S + 8 * (D - 1), 8);
    CHECK(last_pointer == 6 * bytes);
    CHECK(last_doc_index == S);

    for (const std::string& name : {prefix, prefix + ".bin", prefix + ".idx"}) {
      TokenFile f = TokenFile::open(name);
      CHECK(f.format() == TokenFileFormat::megatron);
      CHECK(f.path() == prefix + ".bin");
      CHECK(f.token_bytes() == bytes);
      CHECK(f.num_tokens() == static_cast<int64_t>(flat.size()));
      CHECK(f.doc_starts() == expected_starts);
      std::vector<int32_t> all = read_all(f);
      for (size_t k = 0; k < flat.size(); ++k) CHECK(static_cast<uint32_t>(all[k]) == flat[k]);
    }
  }
}

TEST_CASE("reads are bounds-checked", "[data][token_file]") {
  TempDir dir;
  const std::string path = dir / "small.bin";
  write_llmc_shard(path, {1, 2, 3, 4}, false);
  TokenFile f = TokenFile::open(path);
  int32_t out[8];
  CHECK_THAT(data_error_of([&] { f.read(2, 3, out); }), Contains("small.bin") && Contains("[2, 5)"));
  CHECK_THAT(data_error_of([&] { f.read(-1, 1, out); }), Contains("outside"));
  CHECK_THAT(data_error_of([&] { f.token(4); }), Contains("4 tokens"));
  f.read(4, 0, out);  // an empty read at the end is fine
}

namespace {
// Stands for a SIGBUS handler installed before keel maps its files: Open MPI's MPI_Init installs a
// stack-trace handler, the sanitizers install theirs.
extern "C" void foreign_bus_handler(int, siginfo_t*, void*) {
  const char text[] = "foreign handler\n";
  (void)!::write(STDERR_FILENO, text, sizeof text - 1);
  _exit(9);
}

void install_foreign_bus_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = foreign_bus_handler;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  REQUIRE(sigaction(SIGBUS, &sa, nullptr) == 0);
}
}  // namespace

TEST_CASE("a token file truncated while it is mapped is named, with the data error's exit code", "[data][token_file][errors]") {
  // What a tool rewriting shards in place (open(path, "wb")) does to a running job: the mapping's
  // pages past the new end raise SIGBUS on the next read. A child process reads after the
  // truncation; it must exit 3 with a message naming the file, not die of "Bus error", also
  // where another SIGBUS handler was there first (every rank under mpirun).
  const bool other_handler = GENERATE(false, true);
  TempDir dir;
  const std::string path = dir / "shard.bin";
  write_llmc_shard(path, std::vector<uint32_t>(100000, 7), false);
  const ChildResult r = run_child([&] {
    if (other_handler) install_foreign_bus_handler();
    const TokenFile f = TokenFile::open(path);
    if (::truncate(path.c_str(), 2048) != 0) _exit(10);
    const uint32_t last = f.token(f.num_tokens() - 1);  // past the new end: SIGBUS
    _exit(last == 7 ? 11 : 12);                           // not reached
  });
  INFO("another handler first: " << other_handler << "\n" << r.stderr_text);
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.stderr_text, Contains("keel: data error: token file '" + path + "' is shorter than the 201024 bytes") &&
                                Contains("rewritten in place"));
  CHECK(r.stderr_text.find("foreign") == std::string::npos);
}

TEST_CASE("keel's SIGBUS handler hands the other handler every SIGBUS that is not a read of its files",
          "[data][token_file][errors]") {
  TempDir dir;
  const std::string path = dir / "shard.bin";
  write_llmc_shard(path, std::vector<uint32_t>(100000, 7), false);
  SECTION("a fault in a mapping keel did not make") {
    const ChildResult r = run_child([&] {
      install_foreign_bus_handler();
      const TokenFile f = TokenFile::open(path);  // keel's handler goes in front
      const int fd = ::open(path.c_str(), O_RDONLY);
      const void* other = ::mmap(nullptr, 201024, PROT_READ, MAP_SHARED, fd, 0);
      if (fd < 0 || other == MAP_FAILED || ::truncate(path.c_str(), 2048) != 0) _exit(10);
      const volatile unsigned char* bytes = static_cast<const unsigned char*>(other);
      _exit(bytes[201000] + 20);  // past the new end: SIGBUS, in no mapping of keel's
    });
    INFO(r.stderr_text);
    CHECK(r.exit_code == 9);
    CHECK(r.stderr_text == "foreign handler\n");
  }
  SECTION("a SIGBUS sent to the process") {
    const ChildResult r = run_child([&] {
      install_foreign_bus_handler();
      const TokenFile f = TokenFile::open(path);
      ::raise(SIGBUS);
      _exit(11);  // not reached
    });
    INFO(r.stderr_text);
    CHECK(r.exit_code == 9);
    CHECK(r.stderr_text == "foreign handler\n");
  }
}

// The SIGBUS handler's table of mappings had 4096 slots: the 4097th file of a data set was not
// named. The table now grows in chunks; the file mapped last of 5000 is named as the first is.
TEST_CASE("a token file truncated while mapped is named also when thousands of files are mapped", "[data][token_file][errors]") {
  TempDir dir;
  constexpr int kFiles = 5000;
  auto shard = [&](int k) {  // (built in steps: GCC 12 takes "s" + to_string(k) for an overlapping memcpy)
    std::string name = std::to_string(k);
    name.insert(0, 1, 's');
    return dir / (name + ".bin");
  };
  for (int k = 0; k < kFiles; ++k) write_llmc_shard(shard(k), {1, 2, 3, 4, 5, 6, 7, 8}, false);
  const std::string last = shard(kFiles - 1);
  const ChildResult r = run_child([&] {
    std::vector<TokenFile> files;
    for (int k = 0; k < kFiles; ++k) files.push_back(TokenFile::open(shard(k)));
    if (::truncate(last.c_str(), 0) != 0) _exit(10);
    const uint32_t t = files.back().token(7);  // the page is gone: SIGBUS
    _exit(t == 8 ? 11 : 12);                    // not reached
  });
  INFO(r.stderr_text);
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.stderr_text, Contains("keel: data error: token file '" + last + "' is shorter than the 1040 bytes"));
}

TEST_CASE("llm.c errors name the file and what is wrong", "[data][token_file][errors]") {
  TempDir dir;

  SECTION("missing file") {
    const std::string path = dir / "nope.bin";
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }), Contains(path) && Contains("does not exist"));
    const std::string prefix = dir / "nothing";
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(prefix) && Contains("does not exist") && Contains("Megatron prefix"));
  }
  SECTION("unreadable") {
    CHECK_THAT(data_error_of([&] { TokenFile::open(dir.str()); }), Contains(dir.str()) && Contains("directory"));
    if (geteuid() != 0) {  // root reads anything, so permissions cannot be tested as root
      const std::string path = dir / "secret.bin";
      write_llmc_shard(path, {1, 2}, false);
      ::chmod(path.c_str(), 0);
      CHECK_THAT(data_error_of([&] { TokenFile::open(path); }), Contains(path) && Contains("Permission denied"));
    }
  }
  SECTION("empty file") {
    const std::string path = dir / "empty.bin";
    write_bytes(path, {});
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }), Contains(path) && Contains("empty (0 bytes)"));
  }
  SECTION("bad magic says what it found and what it expected") {
    const std::string path = dir / "junk.bin";
    write_bytes(path, llmc_header(12345, 1, 0));
    std::string msg = data_error_of([&] { TokenFile::open(path); });
    CHECK_THAT(msg, Contains(path) && Contains("bad magic number 12345") && Contains("20240520") &&
                        Contains("20240801") && Contains("junk.idx"));
  }
  SECTION("a loss-mask sidecar given as a token file is named as one") {
    const std::string path = dir / "sft.mask";
    write_bytes(path, llmc_header(20240917, 1, 0));
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }),
               Contains(path) && Contains("loss-mask sidecar") && Contains("*.bin"));
  }
  SECTION("unsupported version") {
    const std::string path = dir / "v2.bin";
    write_bytes(path, llmc_header(20240520, 2, 0));
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }),
               Contains(path) && Contains("version 2") && Contains("version 1"));
    write_bytes(path, llmc_header(20240801, 1, 0));
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }), Contains("version 1") && Contains("version 7"));
  }
  SECTION("truncated: header says N tokens = X bytes but the file has Y") {
    const std::string path = dir / "cut.bin";
    write_llmc_shard(path, std::vector<uint32_t>(100, 5), false);
    std::filesystem::resize_file(path, 1024 + 150);
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }),
               Contains(path) && Contains("truncated") && Contains("100 tokens = 200 bytes") &&
                   Contains("file has 1174 bytes"));
    write_llmc_shard(path, std::vector<uint32_t>(100, 5), true);
    std::filesystem::resize_file(path, 1024 + 401);
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }),
               Contains("longer than its header says") && Contains("100 tokens = 400 bytes") &&
                   Contains("file has 1425 bytes"));
  }
  SECTION("shorter than the header") {
    const std::string path = dir / "stub.bin";
    std::vector<unsigned char> head = llmc_header(20240520, 1, 10);
    head.resize(100);
    write_bytes(path, head);
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }),
               Contains(path) && Contains("truncated") && Contains("1024-byte"));
  }
  SECTION("no tokens") {
    const std::string path = dir / "zero.bin";
    write_llmc_shard(path, {}, false);
    CHECK_THAT(data_error_of([&] { TokenFile::open(path); }), Contains(path) && Contains("no tokens"));
  }
  SECTION("writer refuses tokens that do not fit uint16") {
    const std::string path = dir / "wide.bin";
    CHECK_THAT(data_error_of([&] { write_llmc_shard(path, {1, 70000}, false); }),
               Contains(path) && Contains("70000"));
  }
}

TEST_CASE("Megatron errors name the file and what is wrong", "[data][token_file][errors]") {
  TempDir dir;
  const std::string prefix = dir / "ds";
  write_megatron_dataset(prefix, {{1, 2, 3}, {4, 5}}, MegatronDtype::uint16);
  const std::string idx = prefix + ".idx";
  const std::string bin = prefix + ".bin";

  SECTION("missing .bin") {
    std::filesystem::remove(bin);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }), Contains(bin) && Contains("does not exist"));
    CHECK_THAT(data_error_of([&] { TokenFile::open(idx); }), Contains(bin) && Contains("does not exist"));
  }
  SECTION("missing .idx: a .bin without llm.c magic is explained") {
    std::filesystem::remove(idx);
    CHECK_THAT(data_error_of([&] { TokenFile::open(bin); }),
               Contains(bin) && Contains("bad magic") && Contains(idx));
  }
  SECTION("idx/bin size mismatch") {
    std::vector<unsigned char> data = read_bytes(bin);
    data.push_back(0);
    data.push_back(0);
    write_bytes(bin, data);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(idx) && Contains(bin) && Contains("5 tokens = 10 bytes") && Contains("has 12 bytes"));
  }
  SECTION("empty .bin") {
    write_bytes(bin, {});
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }), Contains(bin) && Contains("empty"));
  }
  SECTION("bad index magic") {
    patch<char>(idx, 0, 'X');
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(idx) && Contains("bad magic \"XMIDIDX") && Contains("expected \"MMIDIDX"));
  }
  SECTION("unsupported index version") {
    patch<uint64_t>(idx, 9, 2);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }), Contains(idx) && Contains("version 2"));
  }
  SECTION("unsupported dtype") {
    patch<uint8_t>(idx, 17, 5);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(idx) && Contains("dtype code 5 (int64)"));
  }
  SECTION("truncated index") {
    std::filesystem::resize_file(idx, std::filesystem::file_size(idx) - 8);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(idx) && Contains("truncated") && Contains("2 sequences"));
    std::filesystem::resize_file(idx, 20);
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }), Contains(idx) && Contains("truncated"));
  }
  SECTION("sequence pointers that are not back to back") {
    patch<int64_t>(idx, 34 + 4 * 2 + 8, 8);  // second sequence claims to start at byte 8, not 6
    CHECK_THAT(data_error_of([&] { TokenFile::open(prefix); }),
               Contains(idx) && Contains("sequence 1 starts at byte 8, expected 6"));
  }
}

TEST_CASE("a token file over 2 GiB is read with 64-bit offsets", "[data][token_file][large]") {
  TempDir dir;
  SECTION("llm.c uint16 shard") {
    const int64_t count = (int64_t{1} << 30) + 4096;  // 2^31 + 8192 bytes of tokens
    const int64_t size = 1024 + 2 * count;
    const std::string path = dir / "huge.bin";
    make_sparse(path, llmc_header(20240520, 1, static_cast<int32_t>(count)), size);
    pwrite_value<uint16_t>(path, 1024 + 2 * (count - 1), 4242);
    pwrite_value<uint16_t>(path, 1024 + 2 * (count - 2), 77);
    pwrite_value<uint16_t>(path, 1024 + 2 * (int64_t{1} << 30), 31337);  // byte offset > 2^31

    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK(st.st_size > (int64_t{1} << 31));
    CHECK(st.st_blocks * 512 < (int64_t{1} << 20));  // sparse: the test costs no disk

    TokenFile f = TokenFile::open(path);
    CHECK(f.num_tokens() == count);
    CHECK(f.token(count - 1) == 4242u);
    CHECK(f.token(int64_t{1} << 30) == 31337u);
    int32_t tail[3];
    f.read(count - 3, 3, tail);
    CHECK(tail[0] == 0);
    CHECK(tail[1] == 77);
    CHECK(tail[2] == 4242);
  }
  SECTION("Megatron int32 dataset with an index written by hand") {
    const int64_t count = (int64_t{1} << 29) + 16;  // 2^31 + 64 bytes of int32 tokens
    const std::string prefix = dir / "huge_m";
    // Two documents: one of 16 tokens, then the rest; the second pointer is a plain int64.
    const char magic[] = "MMIDIDX\0\0";
    std::vector<unsigned char> idx(magic, magic + 9);
    append_pod<uint64_t>(idx, 1);
    append_pod<uint8_t>(idx, 4);
    append_pod<uint64_t>(idx, 2);
    append_pod<uint64_t>(idx, 3);
    append_pod<int32_t>(idx, 16);
    append_pod<int32_t>(idx, static_cast<int32_t>(count - 16));
    append_pod<int64_t>(idx, 0);
    append_pod<int64_t>(idx, 64);
    for (int64_t d : {0, 1, 2}) append_pod<int64_t>(idx, d);
    write_bytes(prefix + ".idx", idx);
    make_sparse(prefix + ".bin", {}, 4 * count);
    pwrite_value<int32_t>(prefix + ".bin", 4 * (count - 1), 128000);

    TokenFile f = TokenFile::open(prefix);
    CHECK(f.num_tokens() == count);
    CHECK(f.doc_starts() == std::vector<int64_t>{0, 16});
    int32_t last;
    f.read(count - 1, 1, &last);
    CHECK(last == 128000);
  }
}

TEST_CASE("expand_paths globs, sorts, de-duplicates and folds Megatron pairs", "[data][token_file]") {
  TempDir dir;
  for (const char* name : {"c.bin", "a.bin", "b.bin"}) write_llmc_shard(dir / name, {1, 2, 3}, false);
  write_megatron_dataset(dir / "m", {{1, 2}}, MegatronDtype::uint16);

  std::vector<std::string> got = expand_paths({dir / "*.bin", dir / "a.bin"}, "data.train");
  CHECK(got == std::vector<std::string>{dir / "a.bin", dir / "b.bin", dir / "c.bin", dir / "m.bin"});

  got = expand_paths({dir / "c.bin", dir / "*"}, "data.train");  // pattern order kept, m.idx folded
  CHECK(got == std::vector<std::string>{dir / "c.bin", dir / "a.bin", dir / "b.bin", dir / "m.bin"});

  got = expand_paths({dir / "m"}, "data.val");  // a Megatron prefix
  CHECK(got == std::vector<std::string>{dir / "m.bin"});

  const std::string missing = dir / "shard_*.bin";
  CHECK_THAT(data_error_of([&] { expand_paths({dir / "a.bin", missing}, "data.train"); }),
             Contains("data.train") && Contains(missing) && Contains("matches no file"));
}

TEST_CASE("expand_paths names each file that more than one entry matched, with those entries", "[data][token_file]") {
  TempDir dir;
  for (const char* name : {"a.bin", "b.bin"}) write_llmc_shard(dir / name, {1, 2, 3}, false);
  write_megatron_dataset(dir / "m", {{1, 2}}, MegatronDtype::uint16);
  std::vector<RepeatedMatch> repeats;
  // A glob and a path inside it, and one path listed twice.
  const std::vector<std::string> got =
      expand_paths({dir / "*.bin", dir / "a.bin", dir / "m.bin", dir / "m.bin"}, "data.train", &repeats);
  CHECK(got == std::vector<std::string>{dir / "a.bin", dir / "b.bin", dir / "m.bin"});
  REQUIRE(repeats.size() == 2);
  CHECK(repeats[0].file == dir / "a.bin");
  CHECK(repeats[0].entries == std::vector<std::string>{dir / "*.bin", dir / "a.bin"});
  CHECK(repeats[1].file == dir / "m.bin");
  CHECK(repeats[1].entries == std::vector<std::string>{dir / "*.bin", dir / "m.bin", dir / "m.bin"});
  // One glob matching a Megatron pair's .bin and .idx is one dataset matched once, not a repeat.
  repeats.clear();
  expand_paths({dir / "m.*", dir / "a.bin"}, "data.train", &repeats);
  CHECK(repeats.empty());
}
