#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

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

namespace {
// JSON has no inf/nan: write them as strings so the record stays parseable.
nlohmann::json number(double x) {
  if (std::isfinite(x)) return x;
  return std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf");
}
}  // namespace

nlohmann::json step_record(const StepReport& r) {
  const StepStats& s = r.stats;
  return {{"step", s.iteration},
          {"loss", number(s.loss)},
          {"lr", s.lr},
          {"grad_norm", number(s.grad_norm)},
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

MetricsWriter::MetricsWriter(const std::string& path, const std::string& tensorboard_dir)
    : path_(path), out_(path, std::ios::app) {
  if (!out_) throw std::runtime_error("cannot open metrics file " + path + " for writing: " + std::strerror(errno));
  if (!tensorboard_dir.empty()) tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!out_.is_open()) return;
  out_ << record.dump() << '\n';
  out_.flush();
  if (!out_) throw std::runtime_error("writing " + path_ + " failed (disk full?)");
  if (tensorboard_) tensorboard_->write(record);
}

}  // namespace keel
