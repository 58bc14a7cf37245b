// The most memory a rank's backend has held, against keel plan's figure for its pipeline stage,
// as the run goes on. After the run's first step rank 0 reports its peak, and again whenever it
// has grown by 5% and more than the libraries' own allocations could explain (64 MiB on a GPU,
// for cuBLASLt's workspace and tables; 1 MiB on the CPU): validation, samples, choice scoring and
// saves run after the first step, and anything the plan does not count shows up there. A peak
// more than 5% + 64 MiB over the plan is a warning, once, on every rank it happens on: the plan
// chose the layout and the activation policy, and a run that needs more than it said would fail
// on a longer sequence or a fuller GPU.
#pragma once

#include <cstdint>

namespace keel {

class MemoryWatch {
 public:
  struct News {
    bool report = false;  // a peak to report: the first, or one grown since the last report
    bool first = false;   // the first report of the run
    bool warn = false;    // over the plan by more than its margin, for the first time
    double previous_bytes = 0;  // the last report's peak (when not the first)
    int64_t previous_step = 0;
  };
  explicit MemoryWatch(bool gpu) : growth_slack_bytes_((gpu ? 64.0 : 1.0) * (1 << 20)) {}

  // The backend's peak after step `step`, and the plan's figure for this rank's stage.
  News observe(double peak_bytes, double planned_bytes, int64_t step) {
    News n;
    if (peak_bytes <= 0 || planned_bytes <= 0) return n;  // a backend or a layout nothing counts for
    if (reported_bytes_ > 0 && peak_bytes <= 1.05 * reported_bytes_ + growth_slack_bytes_) return n;
    n.report = true;
    n.first = reported_bytes_ == 0;
    n.previous_bytes = reported_bytes_;
    n.previous_step = reported_step_;
    n.warn = !warned_ && peak_bytes > 1.05 * planned_bytes + 64.0 * (1 << 20);
    warned_ = warned_ || n.warn;
    reported_bytes_ = peak_bytes;
    reported_step_ = step;
    return n;
  }

 private:
  double growth_slack_bytes_;
  double reported_bytes_ = 0;
  int64_t reported_step_ = 0;
  bool warned_ = false;
};

}  // namespace keel
