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

}  // namespace keel::data
