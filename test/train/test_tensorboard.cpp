// TensorBoard event files (train/tensorboard.h): the encoder byte for byte against a file the
// tensorboard package wrote (scripts/make_tensorboard_fixture.py), the mapping of metrics records
// to tags, and a real run's events read back and compared with its metrics.jsonl.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <ctime>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>

#include "common/process.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "data/checksum.h"
#include "train/tensorboard.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {

// A reader for what keel writes: each record's CRCs are checked, then the Event fields keel
// uses are decoded (wall_time, step, file_version, summary values, session_log status).
struct ReadEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
  int session_status = 0;
};

struct Cursor {
  const std::string& s;
  size_t at;
  size_t end;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      REQUIRE(at < end);
      const uint8_t b = static_cast<uint8_t>(s[at++]);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  uint64_t fixed(int bytes) {
    REQUIRE(at + bytes <= end);
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(static_cast<uint8_t>(s[at + i])) << (8 * i);
    at += bytes;
    return v;
  }
  Cursor sub() {  // a length-delimited field's contents
    const uint64_t n = varint();
    REQUIRE(at + n <= end);
    Cursor c{s, at, at + n};
    at += n;
    return c;
  }
};

uint32_t masked(const std::string& s, size_t at, size_t n) {
  const uint32_t crc = data::crc32c(0, s.data() + at, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::vector<ReadEvent> read_events(const std::string& bytes) {
  std::vector<ReadEvent> out;
  size_t at = 0;
  while (at < bytes.size()) {
    Cursor head{bytes, at, bytes.size()};
    const uint64_t n = head.fixed(8);
    REQUIRE(head.fixed(4) == masked(bytes, at, 8));
    const size_t body = head.at;
    REQUIRE(body + n + 4 <= bytes.size());
    Cursor tail{bytes, body + n, bytes.size()};
    REQUIRE(tail.fixed(4) == masked(bytes, body, n));
    ReadEvent e;
    Cursor c{bytes, body, body + n};
    while (c.at < c.end) {
      const uint64_t key = c.varint();
      const int field = static_cast<int>(key >> 3);
      if (field == 1) {
        const uint64_t bits = c.fixed(8);
        std::memcpy(&e.wall_time, &bits, 8);
      } else if (field == 2) {
        e.step = static_cast<int64_t>(c.varint());
      } else if (field == 3) {
        Cursor v = c.sub();
        e.file_version = bytes.substr(v.at, v.end - v.at);
      } else if (field == 5) {
        Cursor summary = c.sub();
        while (summary.at < summary.end) {
          REQUIRE(summary.varint() == ((1 << 3) | 2));
          Cursor value = summary.sub();
          REQUIRE(value.varint() == ((1 << 3) | 2));
          Cursor tag = value.sub();
          REQUIRE(value.varint() == ((2 << 3) | 5));
          const uint32_t bits = static_cast<uint32_t>(value.fixed(4));
          float x;
          std::memcpy(&x, &bits, 4);
          e.values.emplace_back(bytes.substr(tag.at, tag.end - tag.at), x);
        }
      } else if (field == 7) {
        Cursor log = c.sub();
        REQUIRE(log.varint() == ((1 << 3) | 0));
        e.session_status = static_cast<int>(log.varint());
      } else {
        FAIL("unexpected Event field " << field);
      }
    }
    out.push_back(e);
    at = body + n + 4;
  }
  return out;
}

float value_of(const TensorBoardScalars& values, const std::string& tag) {
  for (const auto& [t, x] : values)
    if (t == tag) return x;
  FAIL("no scalar " << tag);
  return 0;
}

// The names the writer may give its event file in `dir` over the next minute (the name holds
// the time in seconds, the host and the process).
std::vector<fs::path> event_file_names(const fs::path& dir) {
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  std::vector<fs::path> names;
  const auto now = static_cast<int64_t>(std::time(nullptr));
  for (int64_t t = now - 1; t < now + 60; ++t)
    names.push_back(dir / ("events.out.tfevents." + std::to_string(t) + "." + host + "." + std::to_string(getpid())));
  return names;
}

}  // namespace

TEST_CASE("TensorBoard events are encoded byte for byte as the tensorboard package writes them", "[tensorboard]") {
  // The same events as scripts/make_tensorboard_fixture.py, in the same order.
  const float inf = std::numeric_limits<float>::infinity();
  std::string mine;
  mine += tensorboard_record(tensorboard_version_event(1700000000.25));
  mine += tensorboard_record(tensorboard_scalars_event(
      1700000001.5, 1, {{"train/loss", 7.65625f}, {"train/lr", 3e-4f}, {"train/zero", 0.0f}, {"train/negative", -2.5f}}));
  mine += tensorboard_record(tensorboard_scalars_event(1700000002.0, 0, {{"val/loss", 7.5f}}));
  mine += tensorboard_record(tensorboard_scalars_event(1700000003.125, (int64_t(1) << 40) + 5,
                                                       {{"train/nan", std::numeric_limits<float>::quiet_NaN()},
                                                        {"train/inf", inf},
                                                        {"train/-inf", -inf},
                                                        {"layer/" + std::string(200, 'x'), 1.0f},
                                                        {"train/\xce\xb5", 1e-30f}}));
  mine += tensorboard_record(tensorboard_start_event(1700000100.0, 600));
  mine += tensorboard_record(tensorboard_scalars_event(1700000101.0, 601, {{"train/loss", 4.25f}}));

  const std::string theirs = test::read_file(std::string(KEEL_FIXTURE_DIR) + "/tensorboard_events.bin");
  REQUIRE(theirs.size() == 596);
  CHECK(mine.size() == theirs.size());
  CHECK(mine == theirs);

  // And the reader used below decodes them.
  const std::vector<ReadEvent> ev = read_events(theirs);
  REQUIRE(ev.size() == 6);
  CHECK(ev[0].file_version == "brain.Event:2");
  CHECK(ev[0].wall_time == 1700000000.25);
  CHECK(ev[3].step == (int64_t(1) << 40) + 5);
  CHECK(std::isnan(ev[3].values[0].second));
  CHECK(ev[4].step == 600);
  CHECK(ev[4].session_status == 1);
}

TEST_CASE("metrics records become TensorBoard scalars under their kind's tags", "[tensorboard]") {
  using nlohmann::json;
  // A step record: every number under train/, per-layer maxima by zero-padded layer index.
  json step = {{"step", 12}, {"loss", 4.5}, {"grad_norm", "nan"}, {"skipped", false}, {"lr", 1e-3},
               {"act_max", std::vector<double>(11, 2.0)}, {"spike", "loss z-score 7.1"}};
  step["act_max"][10] = 3.0;
  const TensorBoardScalars s = tensorboard_scalars(step);
  CHECK(value_of(s, "train/loss") == 4.5f);
  CHECK(std::isnan(value_of(s, "train/grad_norm")));
  CHECK(value_of(s, "train/act_max/00") == 2.0f);
  CHECK(value_of(s, "train/act_max/10") == 3.0f);
  CHECK(s.size() == 2 + 1 + 11);  // no step, no boolean, no text

  const TensorBoardScalars v = tensorboard_scalars({{"step", 10}, {"val_loss", 3.25}, {"consumed_tokens", 640}});
  CHECK(v == TensorBoardScalars{{"val/consumed_tokens", 640.0f}, {"val/loss", 3.25f}});
  // data.val_sets alone (no data.val): still a validation record.
  CHECK(tensorboard_scalars({{"step", 10}, {"val_losses", {{"web", 2.0}, {"code", 1.5}}}}) ==
        TensorBoardScalars{{"val/losses/code", 1.5f}, {"val/losses/web", 2.0f}});

  const TensorBoardScalars c = tensorboard_scalars(
      {{"step", 10}, {"choice_acc", 0.5}, {"choice_acc_per_token", 0.25}, {"choice_items", 8}, {"choice_scores", "f"}});
  CHECK(c == TensorBoardScalars{{"choice_eval/acc", 0.5f}, {"choice_eval/acc_per_token", 0.25f}, {"choice_eval/items", 8.0f}});

  // Events: nested objects extend the tag; arrays of objects (the stragglers) are left out.
  const TensorBoardScalars t = tensorboard_scalars(
      {{"event", "timers"}, {"step", 2}, {"ranks", 4},
       {"ms", {{"step", {{"min", 10.5}, {"max", 12.0}, {"max_rank", 3}}}}},
       {"stragglers", json::array({{{"rank", 2}, {"host", "n7"}}})}});
  CHECK(t == TensorBoardScalars{{"timers/ms/step/max", 12.0f}, {"timers/ms/step/max_rank", 3.0f},
                                {"timers/ms/step/min", 10.5f}, {"timers/ranks", 4.0f}});
  CHECK(tensorboard_scalars({{"event", "resume"}, {"step", 4}, {"checkpoint", "x"}}).empty());
}

TEST_CASE("TensorBoardWriter: a version event, one event per record, a session start at a resume", "[tensorboard]") {
  test::TempDir dir("tb");
  std::string path;
  {
    TensorBoardWriter w(dir / "tb");
    path = w.path();
    CHECK(fs::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
    w.write({{"step", 1}, {"loss", 5.0}});
    w.write({{"event", "resume"}, {"step", 4}, {"checkpoint", "ck"}});
    w.write({{"event", "rewind"}, {"step", 9}, {"to", 6}});
  }
  const std::vector<ReadEvent> ev = read_events(test::read_file(path));
  REQUIRE(ev.size() == 5);
  CHECK(ev[0].file_version == "brain.Event:2");
  CHECK(ev[0].wall_time > 1.7e9);
  CHECK((ev[1].step == 1 && ev[1].values == TensorBoardScalars{{"train/loss", 5.0f}}));
  CHECK((ev[2].step == 5 && ev[2].session_status == 1));  // the resumed run trains step 5 next
  CHECK((ev[3].step == 7 && ev[3].session_status == 1));  // rewound to 6: step 7 is trained again
  CHECK((ev[4].step == 9 && ev[4].values == TensorBoardScalars{{"rewind/to", 6.0f}}));
}

TEST_CASE("TensorBoardWriter: a new run's start event drops every earlier point of the directory", "[tensorboard]") {
  test::TempDir dir("tb-start");
  std::string path;
  {
    TensorBoardWriter w(dir / "tb");
    path = w.path();
    w.write({{"event", "start"}, {"step", 0}});
  }
  const std::vector<ReadEvent> ev = read_events(test::read_file(path));
  REQUIRE(ev.size() == 2);
  CHECK((ev[1].step == 0 && ev[1].session_status == 1 && ev[1].values.empty()));
}

TEST_CASE("TensorBoardWriter: an event file that cannot be opened or written is named with the OS's reason",
          "[tensorboard][errors]") {
  test::TempDir dir("tb-errors");
  // A folder where the file would go: open(2) says "Is a directory".
  for (const fs::path& p : event_file_names(dir.path / "taken")) fs::create_directories(p);
  CHECK_THROWS_WITH(TensorBoardWriter(dir / "taken"),
                    Catch::Contains("cannot open the TensorBoard event file " + dir / "taken/events.out.tfevents.") &&
                        Catch::EndsWith(": " + std::string(std::strerror(EISDIR))));
  // A full disk, as /dev/full is: the first event's write says "No space left on device".
  if (fs::exists("/dev/full")) {
    fs::create_directories(dir.path / "full");
    for (const fs::path& p : event_file_names(dir.path / "full")) fs::create_symlink("/dev/full", p);
    CHECK_THROWS_WITH(TensorBoardWriter(dir / "full"), Catch::Contains("writing " + dir / "full/events.out.tfevents.") &&
                                                          Catch::EndsWith(": " + std::string(std::strerror(ENOSPC))));
  }
}

TEST_CASE("keel train with log.tensorboard: the events hold metrics.jsonl's numbers, a resume adds a file",
          "[tensorboard][cli][e2e]") {
  test::Workspace ws(nlohmann::json{{"log", {{"tensorboard", true}}}});
  const std::string out = ws.dir / "run";
  test::ProcessResult first = test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 20");
  INFO(first.output);
  REQUIRE(first.code == 4);  // --stop-at: saved and stopped
  CHECK_THAT(first.output, Catch::Contains("keel: TensorBoard events: " + out + "/tensorboard/events.out.tfevents."));
  test::ProcessResult second = test::run_keel("train --config " + ws.config + " --out " + out + " -q");
  INFO(second.output);
  REQUIRE(second.code == 0);

  std::vector<fs::path> files;
  for (const auto& f : fs::directory_iterator(out + "/tensorboard")) files.push_back(f.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() == 2);  // one per process start (the pid tells them apart)

  // Every step's loss and learning rate, and every validation loss, as metrics.jsonl has them.
  std::map<int64_t, float> loss, lr, val;
  int starts = 0;
  for (const fs::path& f : files)
    for (const ReadEvent& e : read_events(test::read_file(f))) {
      for (const auto& [tag, x] : e.values) {
        if (tag == "train/loss") loss[e.step] = x;
        if (tag == "train/lr") lr[e.step] = x;
        if (tag == "val/loss") val[e.step] = x;
      }
      if (e.session_status == 1) {
        ++starts;
        CHECK(e.step == 21);
      }
    }
  CHECK(starts == 1);
  std::map<int64_t, float> want_loss, want_lr, want_val;
  for (const nlohmann::json& r : test::read_metrics(out + "/metrics.jsonl")) {
    const int64_t step = r["step"].get<int64_t>();
    if (r.contains("loss")) want_loss[step] = static_cast<float>(r["loss"].get<double>());
    if (r.contains("lr")) want_lr[step] = static_cast<float>(r["lr"].get<double>());
    if (r.contains("val_loss")) want_val[step] = static_cast<float>(r["val_loss"].get<double>());
  }
  CHECK(loss.size() == 30);
  CHECK(loss == want_loss);
  CHECK(lr == want_lr);
  CHECK(val.size() == 3);  // steps 10, 20, 30
  CHECK(val == want_val);
}
