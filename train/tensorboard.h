// TensorBoard event files (log.tensorboard): the numbers of metrics.jsonl as TensorBoard
// scalars, like Megatron's --tensorboard-dir, without TensorFlow or protobuf.
//
// The format (facts from TensorFlow's event.proto and record writer):
//   file   = record*, each record = u64 length | u32 masked_crc(length bytes) | data |
//            u32 masked_crc(data), little-endian; masked_crc(x) = rotr15(crc32c(x)) + 0xa282ead8
//   Event  = wall_time (1, double) | step (2, int64; omitted when 0) | file_version (3, string)
//            | summary (5, Summary) | session_log (7, SessionLog)
//   Summary = repeated value (1, {tag (1, string) | simple_value (2, float)})
//   SessionLog = status (1, enum; START = 1)
// test/train/test_tensorboard.cpp checks the bytes against a file written by the tensorboard
// package itself (scripts/make_tensorboard_fixture.py).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace keel {

using TensorBoardScalars = std::vector<std::pair<std::string, float>>;

// Encoders, exposed for the byte-for-byte test.
std::string tensorboard_record(const std::string& event);  // framing with the masked CRCs
std::string tensorboard_version_event(double wall_time);   // "brain.Event:2", opens every file
std::string tensorboard_scalars_event(double wall_time, int64_t step, const TensorBoardScalars& values);
std::string tensorboard_start_event(double wall_time, int64_t step);  // SessionLog START

// The scalars of one metrics.jsonl record. Tags are "<kind>/<key>":
//   step records        "train/loss", "train/lr", "train/grad_norm", ... ("train/act_max/07": layer 7)
//   validation          "val/loss", "val/losses/<set>"   (the record's "val_" prefix dropped)
//   choice_eval         "choice_eval/acc", ...    (its "choice_" prefix dropped)
//   events              "<event>/..." ("timers/ms/step/max": nested objects extend the tag)
// "step" is the event's step, not a scalar. Array indices are zero-padded so TensorBoard sorts
// them in order. "nan", "inf" and "-inf" (how metrics.jsonl writes them) become those floats;
// other strings, booleans and arrays of objects are left out.
TensorBoardScalars tensorboard_scalars(const nlohmann::json& record);

// One event file in `dir` (created), named events.out.tfevents.<unix time>.<host>.<pid>: a
// resumed run adds a file beside the earlier ones, and TensorBoard reads them as one run.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);
  // One event per record, flushed, so a crash loses nothing already reported. A "resume" or
  // "rewind" record writes SessionLog START at the first step to be trained again: TensorBoard's
  // event loader then drops the earlier files' points from that step on, which the crashed or
  // rewound run had logged and this one logs again.
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

}  // namespace keel
