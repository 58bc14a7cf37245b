// AdamWParams::decay_runs, checked once for every backend.
#include <string>

#include "kernels/backend.h"

namespace keel {

std::vector<AdamWDecayRun> adamw_decay_runs(const char* backend, const AdamWParams& p, int64_t n) {
  if (p.decay_runs.empty()) return {{n, p.weight_decay}};
  int64_t begin = 0;
  for (size_t r = 0; r < p.decay_runs.size(); ++r) {
    const int64_t end = p.decay_runs[r].end;
    const bool last = r + 1 == p.decay_runs.size();
    if (end <= begin || end > n || (last && end != n))
      fail_op(backend, "adamw",
              "decay_runs[" + std::to_string(r) + "].end is " + std::to_string(end) + ": each end must exceed the one before (" +
                  std::to_string(begin) + ") and the last must be the element count (" + std::to_string(n) + ")",
              {});
    begin = end;
  }
  return {p.decay_runs.begin(), p.decay_runs.end()};
}

}  // namespace keel
