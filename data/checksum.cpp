#include "data/checksum.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "data/token_file.h"

namespace keel::data {

namespace {

// Reflected CRC-32C polynomial 0x1EDC6F41 -> 0x82F63B78 (bit-reversed).
constexpr uint32_t kPoly = 0x82f63b78u;

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  }
};

uint32_t crc32c_software(uint32_t crc, const unsigned char* p, size_t n) {
  static const Tables tables;
  const auto& t = tables.t;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;  // little-endian: the CRC mixes into the first four bytes
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^ t[4][(word >> 24) & 0xff] ^
          t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^ t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  crc = hw ? crc32c_sse42(crc, p, bytes) : crc32c_software(crc, p, bytes);
#else
  crc = crc32c_software(crc, p, bytes);
#endif
  return ~crc;
}

std::string crc32c_hex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

std::string content_fingerprint(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw DataError("cannot read '" + path + "' to fingerprint it: " + std::strerror(err));
  }
  const int64_t size = st.st_size;
  std::vector<unsigned char> block(static_cast<size_t>(kFingerprintBlock));
  uint32_t crc = crc32c(0, &size, sizeof size);
  for (const int64_t start : {int64_t{0}, std::max<int64_t>(0, size / 2 - kFingerprintBlock / 2),
                              std::max<int64_t>(0, size - kFingerprintBlock)}) {
    const int64_t want = std::min(kFingerprintBlock, size - start);
    int64_t got = 0;
    while (got < want) {
      const ssize_t n = ::pread(fd, block.data() + got, static_cast<size_t>(want - got), start + got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // shorter than fstat said (shrinking under us): what was read counts
      got += n;
    }
    crc = crc32c(crc, block.data(), static_cast<size_t>(got));
  }
  ::close(fd);
  return crc32c_hex(crc);
}

}  // namespace keel::data
