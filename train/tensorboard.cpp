#include "train/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>

#include "data/checksum.h"
#include "data/file_io.h"

namespace keel {
namespace {

// ---- protobuf wire format: varints, fixed-width little-endian, length-delimited ----
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_key(std::string& out, int field, int wire_type) { put_varint(out, (uint64_t(field) << 3) | wire_type); }

void put_fixed(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
}

void put_double(std::string& out, int field, double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  put_key(out, field, 1);
  put_fixed(out, bits, 8);
}

void put_float(std::string& out, int field, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  put_key(out, field, 5);
  put_fixed(out, bits, 4);
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// The Event fields every event has: wall_time, and step unless 0 (proto3 leaves defaults out).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);
  if (step != 0) {
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

uint32_t masked_crc(const std::string& bytes) {
  const uint32_t crc = data::crc32c(0, bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

// ---- metrics records to scalars ----
bool scalar_value(const nlohmann::json& v, float& out) {
  if (v.is_number()) {
    out = static_cast<float>(v.get<double>());
    return true;
  }
  if (!v.is_string()) return false;
  const std::string& s = v.get_ref<const std::string&>();
  if (s == "nan") out = std::numeric_limits<float>::quiet_NaN();
  else if (s == "inf") out = std::numeric_limits<float>::infinity();
  else if (s == "-inf") out = -std::numeric_limits<float>::infinity();
  else return false;
  return true;
}

void flatten(const std::string& tag, const nlohmann::json& v, TensorBoardScalars& out) {
  float x;
  if (scalar_value(v, x)) {
    out.emplace_back(tag, x);
  } else if (v.is_object()) {
    for (const auto& [key, item] : v.items()) flatten(tag + "/" + key, item, out);
  } else if (v.is_array()) {
    const size_t width = std::to_string(v.empty() ? 0 : v.size() - 1).size();
    for (size_t i = 0; i < v.size(); ++i) {
      if (!scalar_value(v[i], x)) continue;  // arrays of objects (stragglers) are not plotted
      std::string index = std::to_string(i);
      out.emplace_back(tag + "/" + std::string(width - index.size(), '0') + index, x);
    }
  }
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string tensorboard_record(const std::string& event) {
  std::string length;
  put_fixed(length, event.size(), 8);
  std::string r = length;
  put_fixed(r, masked_crc(length), 4);
  r += event;
  put_fixed(r, masked_crc(event), 4);
  return r;
}

std::string tensorboard_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string tensorboard_scalars_event(double wall_time, int64_t step, const TensorBoardScalars& values) {
  std::string summary;
  for (const auto& [tag, x] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, x);
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string tensorboard_start_event(double wall_time, int64_t step) {
  std::string log;
  put_key(log, 1, 0);
  put_varint(log, 1);  // SessionLog.START
  std::string e = event_head(wall_time, step);
  put_bytes(e, 7, log);
  return e;
}

TensorBoardScalars tensorboard_scalars(const nlohmann::json& record) {
  TensorBoardScalars out;
  if (!record.is_object()) return out;
  std::string kind = "train", strip;
  if (record.contains("event") && record["event"].is_string()) {
    kind = record["event"].get<std::string>();
  } else if (record.contains("val_loss") || record.contains("val_losses")) {
    kind = "val", strip = "val_";
  } else if (record.contains("choice_acc")) {
    kind = "choice_eval", strip = "choice_";
  }
  for (const auto& [key, value] : record.items()) {
    if (key == "step" || key == "event") continue;
    const bool prefixed = !strip.empty() && key.compare(0, strip.size(), strip) == 0;
    flatten(kind + "/" + (prefixed ? key.substr(strip.size()) : key), value, out);
  }
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error("cannot create the TensorBoard directory " + dir + ": " + ec.message());
  const std::string host = data::detail::this_host();
  const double t = now_seconds();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(t)) + "." +
                                         host + "." + std::to_string(getpid())))
              .string();
  errno = 0;
  out_.open(path_, std::ios::binary | std::ios::app);
  // The stream keeps no reason; the open(2) under it left one in errno, as with the directory.
  if (!out_)
    throw std::runtime_error("cannot open the TensorBoard event file " + path_ + " for writing: " +
                             (errno ? std::strerror(errno) : "reason unknown"));
  append(tensorboard_version_event(t));
}

void TensorBoardWriter::write(const nlohmann::json& record) {
  const int64_t step = record.contains("step") && record["step"].is_number_integer() ? record["step"].get<int64_t>() : 0;
  const std::string event = record.value("event", std::string());
  if (event == "resume") append(tensorboard_start_event(now_seconds(), step + 1));
  if (event == "start") append(tensorboard_start_event(now_seconds(), 0));  // a new run: every earlier point goes
  if (event == "rewind" && record.contains("to")) append(tensorboard_start_event(now_seconds(), record["to"].get<int64_t>() + 1));
  const TensorBoardScalars values = tensorboard_scalars(record);
  if (!values.empty()) append(tensorboard_scalars_event(now_seconds(), step, values));
}

void TensorBoardWriter::append(const std::string& event) {
  errno = 0;
  out_ << tensorboard_record(event);
  out_.flush();
  if (!out_)
    throw std::runtime_error("writing " + path_ + " failed: " + (errno ? std::strerror(errno) : "reason unknown (disk full?)"));
}

}  // namespace keel
