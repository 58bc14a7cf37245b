// Loss-mask sidecars: which tokens of a token file count in the loss (instruction data, where
// the prompt is context and only the response is learned).
//
// The sidecar of token file `x.bin` is `x.mask` (of any other name `x`: `x.mask`), written by
// scripts/prepare_data.py --loss-mask prompt. Not `x.mask.bin`: a glob like train_*.bin would
// then pick the masks up as token files. Format, in the style of the llm.c shard header:
//   256 little-endian int32 header words: [0] magic 20240917, [1] version 1, [2] token count
//   (the token file's), [3..255] zero; then one uint8 per token: 1 = token i, as a target (the
//   prediction of token i from the tokens before it), counts in the loss; 0 = it does not. Any
//   other byte is an error.
// A window whose target k is token start+1+k of the file gets target -1 (ignored by the
// loss) where mask[start+1+k] == 0. No sidecar: every token counts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/file_io.h"

namespace keel::data {

class TokenFile;

class LossMask {
 public:
  static constexpr int32_t kMagic = 20240917;
  static constexpr int32_t kVersion = 1;

  // The sidecar path for a token file path.
  static std::string sidecar_path(const std::string& token_path);
  // Opens the sidecar of `tokens` when one exists; checks its header, that it has exactly one
  // byte per token and that every byte is 0 or 1 (else DataError naming both files).
  static std::optional<LossMask> open_for(const TokenFile& tokens);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return size_; }
  bool in_loss(int64_t i) const { return mask_[i] != 0; }
  int64_t count_in_loss() const;

 private:
  detail::MappedFile file_;
  const unsigned char* mask_ = nullptr;
  int64_t size_ = 0;
  int64_t in_loss_ = 0;  // bytes that are 1
};

// Megatron's --eod-mask-loss: target -1 wherever the input is the end-of-document token `eod`,
// so the prediction of the next document's first token from the end of the previous one does
// not count in the loss. Returns how many targets it masked (already -1 ones included).
int64_t mask_targets_after_eod(const int32_t* inputs, int32_t* targets, int64_t n, int32_t eod);

// Writes a sidecar (for tests and tools); throws DataError naming the path.
void write_loss_mask(const std::string& path, const std::vector<uint8_t>& mask);

}  // namespace keel::data
