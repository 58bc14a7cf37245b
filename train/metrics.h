// What a run reports: one human line per step (Megatron's layout) and one JSON object per
// step in OUT/metrics.jsonl for machines (scripts/plot_metrics.py).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "train/tensorboard.h"
#include "train/trainer.h"

namespace keel {

struct StepReport {
  StepStats stats;
  int64_t total_steps = 0;
  int64_t consumed_samples = 0;  // after this step
  int64_t consumed_tokens = 0;
  double ms_per_step = 0;
  double tokens_per_s = 0;
  double tflops = 0;             // model TFLOP/s achieved per rank
  int64_t skipped_total = 0;     // skipped iterations so far (overflow / non-finite)
  int64_t nan_total = 0;         // iterations whose loss or gradient was non-finite
};

std::string format_step_line(const StepReport& r);
// x as a JSON value: a number, or "nan", "inf", "-inf" (JSON has none of them).
nlohmann::json json_number(double x);
nlohmann::json step_record(const StepReport& r);

// Appends JSON lines, each written whole with one write(2), so a crash loses nothing already
// reported. With a TensorBoard directory (log.tensorboard), every record also goes there as scalars.
// A record that cannot be written (a full disk, a file-size limit) is dropped whole (the file is
// cut back to its last complete line) with a warning naming the file and the reason, and the run
// goes on: its checkpoints, not its log, are what must not be lost. A file that ends in a partial
// line (a kill mid-write by an older keel) gets a newline before the first new record.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  explicit MetricsWriter(const std::string& path, const std::string& tensorboard_dir = "");
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }
  const TensorBoardWriter* tensorboard() const { return tensorboard_.get(); }
  int64_t dropped() const { return dropped_; }  // records that could not be written

 private:
  std::string path_;
  int fd_ = -1;
  bool partial_line_ = false;  // the file ends without a newline
  int64_t dropped_ = 0, dropped_streak_ = 0;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace keel
