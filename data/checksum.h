// CRC-32C (Castagnoli), the checksum of keel's checkpoint files and tensors: detects flipped
// bytes and truncation; hardware-accelerated (SSE4.2 crc32 instruction) where available, so
// checking a checkpoint runs at memory speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace keel::data {

// Extends `crc` (start from 0) over `bytes` bytes; crc32c(crc32c(0, a), b) == crc32c(0, a+b).
uint32_t crc32c(uint32_t crc, const void* data, size_t bytes);

// "1a2b3c4d": how checksums appear in meta.json.
std::string crc32c_hex(uint32_t crc);

// A cheap fingerprint of a file's content, for noticing a file rewritten with the same length
// (re-tokenized, reshuffled): the CRC-32C, as crc32c_hex, of its size and of three blocks of
// kFingerprintBlock bytes at its start, middle and end (overlapping in a small file). It reads
// at most 3 x 64 KiB whatever the size, three reads of a TB-scale shard. Throws DataError naming
// the path when the file cannot be read.
constexpr int64_t kFingerprintBlock = 64 << 10;
std::string content_fingerprint(const std::string& path);

}  // namespace keel::data
