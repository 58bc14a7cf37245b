// An HF model's weights as fp32, laid out by a keel parameter table (one flat host buffer).
#pragma once

#include <vector>

#include "model/param_table.h"
#include "train/hf_format.h"

namespace keel::test {

inline std::vector<float> hf_weights(const HfCheckpoint& hf, const ParamTable& table) {
  std::vector<float> w(static_cast<size_t>(table.local_numel()));
  for (const ParamSpec& p : table.params()) hf.read_full(p.name, p.shape, DType::F32, w.data() + p.offset);
  return w;
}

}  // namespace keel::test
