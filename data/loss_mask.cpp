#include "data/loss_mask.h"

#include <array>
#include <cstring>

#include "data/token_file.h"

namespace keel::data {

namespace {
constexpr int64_t kHeaderWords = 256;
constexpr int64_t kHeaderBytes = kHeaderWords * 4;
}  // namespace

std::string LossMask::sidecar_path(const std::string& token_path) {
  const std::string bin = ".bin";
  if (token_path.size() > bin.size() && token_path.compare(token_path.size() - bin.size(), bin.size(), bin) == 0)
    return token_path.substr(0, token_path.size() - bin.size()) + ".mask";
  return token_path + ".mask";
}

std::optional<LossMask> LossMask::open_for(const TokenFile& tokens) {
  const std::string path = sidecar_path(tokens.path());
  if (!detail::file_exists(path)) return std::nullopt;
  LossMask m;
  m.file_ = detail::MappedFile::open(path, "loss mask");
  const int64_t size = m.file_.size();
  const std::string who = "loss mask '" + path + "' (sidecar of token file '" + tokens.path() + "')";
  if (size < kHeaderBytes) throw DataError(who + " is truncated: " + std::to_string(size) + " bytes, shorter than its 1024-byte header");
  int32_t header[3];
  std::memcpy(header, m.file_.data(), sizeof header);
  if (header[0] != kMagic)
    throw DataError(who + " has bad magic " + std::to_string(header[0]) + " (expected " + std::to_string(kMagic) + ")");
  if (header[1] != kVersion)
    throw DataError(who + " has version " + std::to_string(header[1]) + " (keel reads version " + std::to_string(kVersion) + ")");
  const int64_t count = static_cast<uint32_t>(header[2]);
  const int64_t body = size - kHeaderBytes;
  if (body < count)
    throw DataError(who + " is truncated: its header says " + std::to_string(count) + " tokens, but it holds " +
                    std::to_string(body) + " mask bytes; rewrite it with keel tokenize or scripts/prepare_data.py");
  if (body > count)
    throw DataError(who + " has " + std::to_string(body - count) + " bytes after the " + std::to_string(count) +
                    " mask bytes its header counts; rewrite it with keel tokenize or scripts/prepare_data.py");
  if (count != tokens.num_tokens())
    throw DataError(who + " does not match its token file: the mask covers " + std::to_string(count) +
                    " tokens, the token file holds " + std::to_string(tokens.num_tokens()) +
                    "; rewrite both with keel tokenize or scripts/prepare_data.py");
  m.mask_ = m.file_.data() + kHeaderBytes;
  m.size_ = count;
  // One byte per token, 0 or 1; counted here once, since the start-up summary needs the count.
  for (int64_t i = 0; i < count; ++i) {
    const unsigned char b = m.mask_[i];
    if (b > 1)
      throw DataError(who + ": byte " + std::to_string(b) + " at token " + std::to_string(i) + " (file offset " +
                      std::to_string(kHeaderBytes + i) + ") is neither 0 (out of the loss) nor 1 (in the loss)");
    m.in_loss_ += b;
  }
  return m;
}

int64_t LossMask::count_in_loss() const { return in_loss_; }

int64_t mask_targets_after_eod(const int32_t* inputs, int32_t* targets, int64_t n, int32_t eod) {
  int64_t masked = 0;
  for (int64_t i = 0; i < n; ++i)
    if (inputs[i] == eod) {
      targets[i] = -1;
      ++masked;
    }
  return masked;
}

void write_loss_mask(const std::string& path, const std::vector<uint8_t>& mask) {
  if (mask.size() >= (size_t{1} << 31)) throw DataError("cannot write loss mask '" + path + "': more than 2^31 tokens");
  std::array<int32_t, kHeaderWords> header{};
  header[0] = LossMask::kMagic;
  header[1] = LossMask::kVersion;
  header[2] = static_cast<int32_t>(mask.size());
  detail::FileWriter out(path);
  out.write(header.data(), sizeof header);
  out.write(mask.data(), mask.size());
  out.close();
}

}  // namespace keel::data
