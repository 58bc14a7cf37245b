#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace keel {

std::string format_step_line(const StepReport& r) {
  const StepStats& s = r.stats;
  char buf[640];
  std::snprintf(buf, sizeof buf,
                " iteration %8lld/%8lld | consumed samples: %12lld | consumed tokens: %14lld | "
                "elapsed time per iteration (ms): %.1f | learning rate: %.6E | global batch size: %5lld | "
                "lm loss: %.6E | loss scale: %.1f | grad norm: %.3f | num zeros: %lld | "
                "number of skipped iterations: %3lld | number of nan iterations: %3lld | "
                "tokens per second: %.0f | TFLOPs: %.2f |",
                static_cast<long long>(s.iteration), static_cast<long long>(r.total_steps),
                static_cast<long long>(r.consumed_samples), static_cast<long long>(r.consumed_tokens),
                r.ms_per_step, s.lr, static_cast<long long>(s.global_batch), s.loss, s.loss_scale, s.grad_norm,
                static_cast<long long>(s.num_zeros), static_cast<long long>(r.skipped_total),
                static_cast<long long>(r.nan_total), r.tokens_per_s, r.tflops);
  return buf;
}

// JSON has no inf/nan: write them as strings so the record stays parseable.
nlohmann::json json_number(double x) {
  if (std::isfinite(x)) return x;
  return std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf");
}

nlohmann::json step_record(const StepReport& r) {
  const StepStats& s = r.stats;
  return {{"step", s.iteration},
          {"loss", json_number(s.loss)},
          {"lr", s.lr},
          {"grad_norm", json_number(s.grad_norm)},
          {"loss_scale", s.loss_scale},
          {"global_batch", s.global_batch},
          {"consumed_samples", r.consumed_samples},
          {"consumed_tokens", r.consumed_tokens},
          {"loss_tokens", s.valid_tokens},  // targets that count in the loss (masks leave some out)
          {"num_zeros", s.num_zeros},
          {"skipped", s.skipped},
          {"skipped_total", r.skipped_total},
          {"nan_total", r.nan_total},
          {"ms_per_step", r.ms_per_step},
          {"tokens_per_s", r.tokens_per_s},
          {"tflops", r.tflops}};
}

MetricsWriter::MetricsWriter(const std::string& path, const std::string& tensorboard_dir) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("cannot open metrics file " + path + " for writing: " + std::strerror(errno));
  char last = '\n';
  const off_t size = ::lseek(fd_, 0, SEEK_END);
  partial_line_ = size > 0 && ::pread(fd_, &last, 1, size - 1) == 1 && last != '\n';
  if (!tensorboard_dir.empty()) tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir);
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (fd_ < 0) return;
  std::string line = partial_line_ ? "\n" : "";  // (not "literal" + string&&: GCC 12's -Wrestrict misfires)
  line += record.dump() + "\n";
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  size_t done = 0;
  int err = 0;
  while (done < line.size() && err == 0) {  // a short write is retried: the retry says why it stopped
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n > 0) done += static_cast<size_t>(n);
    else if (n == 0) err = EIO;
    else if (errno != EINTR) err = errno;
  }
  if (err == 0) {
    partial_line_ = false;
    if (dropped_streak_ > 0)
      std::printf("keel: %s is written again; %lld record(s) before this one were dropped\n", path_.c_str(),
                  static_cast<long long>(std::exchange(dropped_streak_, 0)));
  } else {
    const std::string why = std::strerror(err);
    if (before >= 0 && ::ftruncate(fd_, before) != 0) partial_line_ = true;  // the next record starts a new line
    ++dropped_;
    if (dropped_streak_++ == 0)
      std::printf("keel: WARNING cannot write %s: %s. Metrics records are dropped until it can be written again; "
                  "training goes on (a checkpoint save on a full disk fails on its own, keeping the earlier ones)\n",
                  path_.c_str(), why.c_str());
    std::fflush(stdout);
  }
  if (tensorboard_) {
    try {
      tensorboard_->write(record);
    } catch (const std::exception& e) {
      std::printf("keel: WARNING %s; no more TensorBoard events are written in this run\n", e.what());
      std::fflush(stdout);
      tensorboard_.reset();
    }
  }
}

}  // namespace keel
