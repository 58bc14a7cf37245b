// Device time per backend op, summed over a run, and its report: the op-level profile that
// KEEL_CUDA_PROFILE=1 prints when a CudaBackend is destroyed (kernels/cuda/cuda_backend.cu).
// Host-only (header-only: the CUDA library uses it), so the bookkeeping is tested on machines
// without a GPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace keel {

class OpTimeTable {
 public:
  // One call of `op` on tensors described by `shapes` took `ms` milliseconds of device time.
  void add(const std::string& op, const std::string& shapes, double ms);

  double total_ms() const { return total_ms_; }
  int64_t calls(const std::string& op) const;
  double ms(const std::string& op) const;

  // Two tables: every op by total time (calls, total ms, share of the total, mean us per call),
  // then the `top` heaviest (op, shapes) pairs, which tell which matmul shape dominates.
  std::string report(int top = 25) const;

 private:
  struct Row {
    int64_t calls = 0;
    double ms = 0;
  };
  std::map<std::string, Row> by_op_;
  std::map<std::pair<std::string, std::string>, Row> by_shape_;
  double total_ms_ = 0;
};

inline void OpTimeTable::add(const std::string& op, const std::string& shapes, double ms) {
  Row& r = by_op_[op];
  r.calls += 1;
  r.ms += ms;
  Row& s = by_shape_[{op, shapes}];
  s.calls += 1;
  s.ms += ms;
  total_ms_ += ms;
}

inline int64_t OpTimeTable::calls(const std::string& op) const {
  auto it = by_op_.find(op);
  return it == by_op_.end() ? 0 : it->second.calls;
}

inline double OpTimeTable::ms(const std::string& op) const {
  auto it = by_op_.find(op);
  return it == by_op_.end() ? 0.0 : it->second.ms;
}

namespace op_time_detail {

// Rows sorted by total time, heaviest first (ties by name, so the report is stable).
template <class Key, class Row>
std::vector<std::pair<Key, Row>> heaviest_first(const std::map<Key, Row>& rows) {
  std::vector<std::pair<Key, Row>> v(rows.begin(), rows.end());
  std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  return v;
}

}  // namespace op_time_detail

inline std::string OpTimeTable::report(int top) const {
  std::string out;
  char line[512];
  const double total = total_ms_ > 0 ? total_ms_ : 1.0;
  std::snprintf(line, sizeof line, "device time by op: %.3f ms in all\n%-40s %8s %12s %7s %12s\n", total_ms_, "op",
                "calls", "total ms", "share", "mean us");
  out += line;
  for (const auto& [op, r] : op_time_detail::heaviest_first(by_op_)) {
    std::snprintf(line, sizeof line, "%-40s %8lld %12.3f %6.1f%% %12.1f\n", op.c_str(), static_cast<long long>(r.calls),
                  r.ms, 100.0 * r.ms / total, 1000.0 * r.ms / static_cast<double>(r.calls));
    out += line;
  }
  std::snprintf(line, sizeof line, "heaviest %d (op, shapes):\n", top);
  out += line;
  int n = 0;
  for (const auto& [key, r] : op_time_detail::heaviest_first(by_shape_)) {
    if (n++ >= top) break;
    std::snprintf(line, sizeof line, "%6.1f%% %10.3f ms %6lld x  %s  %s\n", 100.0 * r.ms / total, r.ms,
                  static_cast<long long>(r.calls), key.first.c_str(), key.second.c_str());
    out += line;
  }
  return out;
}

}  // namespace keel
