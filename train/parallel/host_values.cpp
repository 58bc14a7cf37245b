#include "train/parallel/host_values.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace keel::parallel {

namespace {

// A temporary F32 or I32 tensor on the backend, released on scope exit.
struct Staging {
  Backend& be;
  Tensor t;
  Staging(Backend& b, DType dt, int64_t n) : be(b), t(b.allocate(static_cast<size_t>(n) * 4), dt, {n}, b.device()) {}
  ~Staging() { be.release(t.data); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
};

}  // namespace

std::vector<double> sum_over_ranks(Comm& c, Backend& be, const std::vector<double>& x) {
  if (c.size() == 1 || x.empty()) return x;
  std::vector<float> parts(2 * x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    parts[2 * i] = static_cast<float>(x[i]);
    parts[2 * i + 1] = static_cast<float>(x[i] - static_cast<float>(x[i]));
  }
  Staging s(be, DType::F32, static_cast<int64_t>(parts.size()));
  be.copy_from_host(s.t, parts.data());
  c.all_reduce(s.t);
  be.copy_to_host(parts.data(), s.t);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<double>(parts[2 * i]) + parts[2 * i + 1];
  return out;
}

std::vector<float> max_over_ranks(Comm& c, Backend& be, const std::vector<float>& x) {
  if (c.size() == 1 || x.empty()) return x;
  // [values with NaN as -inf, then 1 where the value was NaN]: max keeps the flag whatever the
  // max does with NaN operands.
  const size_t n = x.size();
  std::vector<float> buf(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const bool nan = std::isnan(x[i]);
    buf[i] = nan ? -std::numeric_limits<float>::infinity() : x[i];
    buf[n + i] = nan ? 1.0f : 0.0f;
  }
  Staging s(be, DType::F32, static_cast<int64_t>(buf.size()));
  be.copy_from_host(s.t, buf.data());
  c.all_reduce(s.t, ReduceOp::Max);
  be.copy_to_host(buf.data(), s.t);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = buf[n + i] > 0 ? std::numeric_limits<float>::quiet_NaN() : buf[i];
  return out;
}

std::vector<std::string> gather_text(Comm& c, Backend& be, const std::string& mine) {
  if (c.size() == 1) return {mine};
  constexpr int64_t kBytes = 1024;
  std::vector<char> buf(kBytes, 0);
  std::memcpy(buf.data(), mine.data(), std::min<size_t>(mine.size(), kBytes - 1));
  Staging in(be, DType::I32, kBytes / 4), out(be, DType::I32, kBytes / 4 * c.size());
  be.copy_from_host(in.t, buf.data());
  c.all_gather(out.t, in.t);
  std::vector<char> all(static_cast<size_t>(kBytes * c.size()));
  be.copy_to_host(all.data(), out.t);
  std::vector<std::string> texts;
  for (int r = 0; r < c.size(); ++r) texts.emplace_back(all.data() + r * kBytes);
  return texts;
}

}  // namespace keel::parallel
