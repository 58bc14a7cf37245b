// Checkpoint format and restore logic, driven as a library: chunk geometry, exact round trips,
// saves split over several (simulated) ranks and read back under other layouts, and the
// seed-000 finetuning scenario (weights-only loads).
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "common/batches.h"
#include "common/process.h"
#include "common/run_config.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

using namespace keel;
namespace fs = std::filesystem;

using test::batches_from;

namespace {

// Raw bytes of a flat buffer (CPU backend: host memory).
std::vector<char> bytes_of(const Tensor& t) {
  std::vector<char> out(t.bytes());
  std::memcpy(out.data(), t.data, out.size());
  return out;
}

void require_same_state(ParamState& a, ParamState& b) {
  REQUIRE(bytes_of(a.working) == bytes_of(b.working));
  REQUIRE(bytes_of(a.m) == bytes_of(b.m));
  REQUIRE(bytes_of(a.v) == bytes_of(b.v));
  if (a.has_master()) REQUIRE(bytes_of(a.master) == bytes_of(b.master));
  REQUIRE(a.adam_step == b.adam_step);
}

}  // namespace

TEST_CASE("flat ranges map to rectangles of the logical tensor that cover exactly the range", "[ckpt][format]") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    ParamSpec p;
    p.name = "t";
    const bool two_d = trial % 4 != 0;
    const int64_t R = 1 + rng() % 7, C = 1 + rng() % 9, tp = 1 + rng() % 3, rank = rng() % tp;
    p.split = static_cast<TpSplit>(rng() % 3);
    if (!two_d && p.split == TpSplit::Cols) p.split = TpSplit::Rows;
    p.shape = two_d ? std::vector<int64_t>{R * (p.split == TpSplit::Rows ? tp : 1), C * (p.split == TpSplit::Cols ? tp : 1)}
                    : std::vector<int64_t>{C * (p.split == TpSplit::Rows ? tp : 1)};
    p.local_shape = two_d ? std::vector<int64_t>{R, C} : std::vector<int64_t>{C};
    p.shard_begin = p.split == TpSplit::None ? 0 : (p.split == TpSplit::Rows ? (two_d ? R : C) : C) * rank;
    p.numel = two_d ? R * C : C;
    p.offset = rng() % 50;
    const int64_t a = p.offset - 3 + static_cast<int64_t>(rng() % (p.numel + 6));
    const int64_t b = a + static_cast<int64_t>(rng() % (p.numel + 4));
    // Expected: every flat index in [a, b) ∩ the tensor, mapped to full coordinates directly.
    std::set<std::pair<int64_t, int64_t>> expected, got;
    for (int64_t f = std::max(a, p.offset); f < std::min(b, p.offset + p.numel); ++f) {
      const int64_t i = f - p.offset;
      int64_t r = two_d ? i / C : 0, c = two_d ? i % C : i;
      if (p.split == TpSplit::Rows) (two_d ? r : c) += p.shard_begin;
      if (p.split == TpSplit::Cols) c += p.shard_begin;
      expected.insert({r, c});
    }
    for (const TensorRegion& reg : flat_range_regions(p, a, b)) {
      int64_t flat = reg.flat_begin;
      const int64_t rows = two_d ? reg.shape[0] : 1, cols = reg.shape.back();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c, ++flat) {
          REQUIRE(flat >= std::max(a, p.offset));
          REQUIRE(flat < std::min(b, p.offset + p.numel));
          got.insert({two_d ? reg.offset[0] + r : 0, reg.offset.back() + c});
        }
    }
    INFO("trial " << trial);
    REQUIRE(got == expected);
  }
}

TEST_CASE("save then resume restores every buffer, the Adam step and the loss scaler bit for bit", "[ckpt]") {
  for (const char* mode : {"bf16", "fp32", "fp16", "bf16-unsafe-no-master"}) {
    INFO(mode);
    test::TempDir dir("ckpt-roundtrip");
    RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", mode}}}});
    auto be = make_cpu_backend();
    auto tokens = test::synthetic_tokens(4000, 1);
    Trainer a(cfg, *be);
    a.init_weights();
    for (int s = 1; s <= 3; ++s) a.step(batches_from(tokens, 100 * s, 2, 4, 32), s);
    CheckpointManager mgr(dir / "ck", cfg.checkpoint);
    TrainProgress prog{3, 24, 768, 0, 0};
    auto saved = mgr.save(cfg, a.table(), a.state(), *be, prog, a.scaler(), {});
    CHECK(fs::exists(saved.path + "/meta.json"));

    Trainer b(cfg, *be);
    b.init_weights();
    Checkpoint ck = Checkpoint::open(dir / "ck");  // via `latest`
    CHECK(ck.verify().empty());
    TrainProgress got = restore_for_resume(ck, cfg, b.table(), b.state(), *be, b.scaler(), {});
    CHECK(got.iteration == 3);
    CHECK(got.consumed_samples == 24);
    require_same_state(a.state(), b.state());
    CHECK(b.scaler().scale() == a.scaler().scale());
    // And the next step is identical.
    auto next = batches_from(tokens, 2000, 2, 4, 32);
    CHECK(a.step(next, 4).loss == b.step(next, 4).loss);
    require_same_state(a.state(), b.state());
  }
}

TEST_CASE("a background save holds the state as it was when it began, byte for byte a synchronous save",
          "[ckpt][async]") {
  test::TempDir dir("ckpt-async");
  RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}}});
  auto be = make_cpu_backend();
  auto tokens = test::synthetic_tokens(4000, 4);
  Trainer a(cfg, *be);
  a.init_weights();
  for (int s = 1; s <= 3; ++s) a.step(batches_from(tokens, 100 * s, 2, 4, 32), s);
  const TrainProgress prog{3, 24, 768, 0, 0};
  CheckpointManager sync_mgr(dir / "sync", cfg.checkpoint);
  const SaveResult direct = sync_mgr.save(cfg, a.table(), a.state(), *be, prog, a.scaler(), {});
  CHECK_FALSE(direct.background);

  CheckpointManager mgr(dir / "async", cfg.checkpoint);
  mgr.begin_save(cfg, a.table(), a.state(), *be, prog, a.scaler(), {}, [](bool ok) { return ok; }, nullptr, true);
  CHECK(mgr.save_pending());
  CHECK_THROWS_AS(mgr.begin_save(cfg, a.table(), a.state(), *be, prog, a.scaler(), {}, [](bool ok) { return ok; },
                                 nullptr, true),
                  std::logic_error);  // one save at a time: the caller finishes the first
  // Training moves on while the files are written: every buffer changes.
  for (int s = 4; s <= 5; ++s) a.step(batches_from(tokens, 100 * s, 2, 4, 32), s);
  CHECK_FALSE(fs::exists(dir / "async/step_00000003"));  // not published before finish_save
  const SaveResult later = mgr.finish_save([](bool ok) { return ok; });
  CHECK_FALSE(mgr.save_pending());
  CHECK_FALSE(mgr.writing());
  CHECK(later.background);
  CHECK(later.held_seconds <= later.seconds);
  CHECK(later.path == dir / "async/step_00000003");

  // The same files, byte for byte; meta.json differs only in its save time.
  int files = 0;
  for (const auto& e : fs::directory_iterator(direct.path)) {
    const std::string name = e.path().filename().string();
    if (name == "meta.json") continue;
    INFO(name);
    CHECK(test::read_file(e.path()) == test::read_file(later.path + "/" + name));
    ++files;
  }
  CHECK(files == 2);
  Checkpoint x = Checkpoint::open(direct.path), y = Checkpoint::open(later.path);
  nlohmann::json mx = x.meta(), my = y.meta();
  for (auto* m : {&mx, &my}) {
    m->erase("saved_at");
    m->erase("saved_at_ns");
    m->erase("save_seconds");
    m->erase("meta_crc32c");
    (*m)["config"]["checkpoint"].erase("dir");
  }
  CHECK(mx == my);
  CHECK(y.verify().empty());
  CHECK(Checkpoint::find_latest(dir / "async") == later.path);
}

// (A write error inside the background writer: test_checkpoint_cli's file-size-limit case.)
namespace {

// Starts a background save of iteration `it`, lets its files be written, then removes them:
// the error its publication raises (empty if it published).
std::string failed_publication(CheckpointManager& mgr, const RunConfig& cfg, Trainer& a, Backend& be,
                               const std::string& dir, int64_t it) {
  const auto ok = [](bool v) { return v; };
  mgr.begin_save(cfg, a.table(), a.state(), be, {it, 8 * it, 256 * it, 0, 0}, a.scaler(), {}, ok, nullptr, true);
  for (int i = 0; i < 2000 && mgr.writing(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE_FALSE(mgr.writing());
  CHECK(mgr.save_pending());
  char name[32];
  std::snprintf(name, sizeof name, "/.tmp-step_%08lld", static_cast<long long>(it));
  fs::remove_all(dir + name);
  try {
    mgr.finish_save(ok);
  } catch (const CheckpointError& e) {
    CHECK_FALSE(mgr.save_pending());
    return e.what();
  }
  return "";
}

// What a call throws as CheckpointError ("" if nothing).
std::string checkpoint_error(const std::function<void()>& call) {
  try {
    call();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

// A tiny fp32 run saving into dir/ck: save(s) saves step s (8 samples of 32 tokens a step).
struct SavingRun {
  RunConfig cfg;
  std::unique_ptr<Backend> be;
  Trainer trainer;
  CheckpointManager mgr;
  explicit SavingRun(const test::TempDir& dir, int64_t keep_last = 3)
      : cfg(with_keep_last(test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "fp32"}}}}), keep_last)),
        be(make_cpu_backend()),
        trainer(cfg, *be),
        mgr(dir / "ck", cfg.checkpoint) {
    trainer.init_weights();
  }
  void save(int64_t step) {
    mgr.save(cfg, trainer.table(), trainer.state(), *be, {step, 8 * step, 256 * step, 0, 0}, trainer.scaler(), {});
  }
  static RunConfig with_keep_last(RunConfig c, int64_t keep_last) {
    c.checkpoint.keep_last = keep_last;
    return c;
  }
};

}  // namespace

TEST_CASE("a background save that cannot be published fails at its finish and leaves the previous save as latest",
          "[ckpt][async]") {
  test::TempDir dir("ckpt-async-fail");
  SavingRun run(dir);
  auto& [cfg, be, a, mgr] = run;
  // The first save fails: there were no earlier checkpoints to call untouched.
  const std::string first = failed_publication(mgr, cfg, a, *be, dir / "ck", 1);
  CHECK_THAT(first, Catch::Contains("saving checkpoint step_00000001") &&
                        Catch::Contains("no checkpoint had been saved before it") && !Catch::Contains("untouched"));
  run.save(1);
  // Once the files are written, the temporary directory vanishes: there is nothing to publish.
  const std::string second = failed_publication(mgr, cfg, a, *be, dir / "ck", 2);
  CHECK_THAT(second, Catch::Contains("saving checkpoint step_00000002") &&
                         Catch::Contains("the previous checkpoints are untouched"));
  CHECK_FALSE(fs::exists(dir / "ck/step_00000002"));
  CHECK_FALSE(fs::exists(dir / "ck/.tmp-step_00000002"));
  CHECK(Checkpoint::find_latest(dir / "ck") == dir / "ck/step_00000001");
  CHECK(Checkpoint::open(dir / "ck").verify().empty());
  // The folder replaced by a file while the run went on: its saves are gone, not "never made".
  fs::remove_all(dir / "ck");
  std::ofstream(dir / "ck") << "not a folder\n";
  const std::string gone =
      checkpoint_error([&] { run.save(3); });
  CHECK_THAT(gone, Catch::Contains("saving checkpoint step_00000003") &&
                       Catch::Contains(dir / "ck" + " holds no complete checkpoint now, though this run saved 1 into it") &&
                       !Catch::Contains("no checkpoint had been saved before it"));
}

// A full disk can leave room for the files and meta.json but not for the new `latest`: the save
// was in place under its step_* name, unnamed by `latest`, while the error said it failed.
TEST_CASE("a save whose latest pointer cannot be written is undone, leaving the previous one as latest",
          "[ckpt][io]") {
  test::TempDir dir("ckpt-latest-fail");
  SavingRun run(dir);
  run.save(1);
  fs::create_directories(dir / "ck/.latest.tmp");  // the pointer's temporary file cannot be created
  const std::string error =
      checkpoint_error([&] { run.save(2); });
  CHECK_THAT(error, Catch::Contains("saving checkpoint step_00000002") && Catch::Contains(".latest.tmp") &&
                        Catch::Contains("the previous checkpoints are untouched"));
  CHECK_FALSE(fs::exists(dir / "ck/step_00000002"));
  CHECK_FALSE(fs::exists(dir / "ck/.tmp-step_00000002"));
  CHECK(test::read_file(dir / "ck/latest") == "step_00000001\n");
  CHECK(Checkpoint::open(dir / "ck").verify().empty());
}

// A save of a step already saved (a replayed stretch) moves the earlier copy aside: it was
// removed before `latest` was written, so a failure there left neither copy.
TEST_CASE("a save replacing one of the same step that fails at its latest pointer keeps the earlier copy",
          "[ckpt][io]") {
  test::TempDir dir("ckpt-replace-fail");
  SavingRun run(dir);
  auto& [cfg, be, a, mgr] = run;
  run.save(1);
  const std::string saved_meta = test::read_file(dir / "ck/step_00000001/meta.json");
  fs::create_directories(dir / "ck/.latest.tmp");  // the pointer's temporary file cannot be created
  const std::string error =
      checkpoint_error([&] { run.save(1); });
  CHECK_THAT(error, Catch::Contains("saving checkpoint step_00000001") && Catch::Contains(".latest.tmp"));
  CHECK(test::read_file(dir / "ck/latest") == "step_00000001\n");
  CHECK(test::read_file(dir / "ck/step_00000001/meta.json") == saved_meta);  // the earlier save, not the failed one
  CHECK(Checkpoint::open(dir / "ck").verify().empty());
  for (const auto& e : fs::directory_iterator(dir / "ck")) CHECK(e.path().filename().string().rfind(".old-", 0) != 0);
  // Killed between its two renames, a replacement leaves the earlier copy aside, named by
  // `latest`: a resume says where it is, and the start-up clean-up of leftovers keeps it.
  const fs::path aside = dir / "ck/.old-step_00000001-4242";
  fs::rename(dir / "ck/step_00000001", aside);
  const std::string refusal = checkpoint_error([&] { Checkpoint::find_latest(dir / "ck"); });
  CHECK_THAT(refusal, Catch::Contains("names step_00000001, which is at " + aside.string()) &&
                          Catch::Contains("mv " + aside.string() + " " + (dir / "ck/step_00000001")));
  CheckpointManager(dir / "ck", cfg.checkpoint).clean_incomplete();
  CHECK(fs::exists(aside / "meta.json"));
  fs::rename(aside, dir / "ck/step_00000001");
  CHECK(Checkpoint::find_latest(dir / "ck") == dir / "ck/step_00000001");
  // With the pointer writable again, the replacement goes through and leaves no copy aside.
  fs::remove(dir / "ck/.latest.tmp");
  run.save(1);
  CHECK(test::read_file(dir / "ck/step_00000001/meta.json") != saved_meta);
  CHECK(Checkpoint::open(dir / "ck").verify().empty());
  for (const auto& e : fs::directory_iterator(dir / "ck")) CHECK(e.path().filename().string().rfind(".old-", 0) != 0);
}

// A start-up that resumes from an earlier step moves the later checkpoints into
// abandoned-after-<step>-<time>/ and then points latest at the one it resumed from: killed in
// between, latest names a checkpoint that is in that folder. The refusal says where, and how to
// continue either run.
TEST_CASE("latest naming a checkpoint set aside with an abandoned run says where it is and what to resume",
          "[ckpt][latest]") {
  test::TempDir dir("ckpt-set-aside-kill");
  SavingRun run(dir);
  run.save(4);
  run.save(8);
  const std::string folder = dir / "ck/abandoned-after-step_00000004-20261207T120000Z";
  fs::create_directory(folder);
  fs::rename(dir / "ck/step_00000008", folder + "/step_00000008");  // moved; latest not yet rewritten
  const std::string refusal = checkpoint_error([&] { Checkpoint::find_latest(dir / "ck"); });
  CHECK_THAT(refusal, Catch::Contains("names step_00000008, which was set aside into " + folder) &&
                          Catch::Contains("a run that resumed from step_00000004 was killed before it pointed latest") &&
                          Catch::Contains("To continue that run: --resume " + (dir / "ck/step_00000004")) &&
                          Catch::Contains("Nothing was changed"));
  CHECK(test::read_file(dir / "ck/latest") == "step_00000008\n");
}

// keel sample, keel eval or --init-from on the checkpoints of a run that is still training: its
// rotation (checkpoint.keep_last) removes the save a reader opened, or the one `latest` named
// when the reader read it. verify() re-read each file by its path, so a checkpoint removed
// while it was verified was reported damaged (a file checksum of nothing).
TEST_CASE("a checkpoint that a live run's rotation removes after it was opened still verifies and reads",
          "[ckpt][live]") {
  test::TempDir dir("ckpt-live-rotation");
  SavingRun run(dir, /*keep_last=*/1);
  auto& [cfg, be, a, mgr] = run;
  run.save(1);
  const std::string tensor = a.table().params().front().name;
  const Checkpoint opened = Checkpoint::open(dir / "ck");
  REQUIRE(opened.path() == dir / "ck/step_00000001");
  const std::vector<float> saved = opened.read_full("weight", tensor);
  a.step(batches_from(test::synthetic_tokens(4000, 1), 0, 2, 4, 32), 1);
  run.save(2);
  REQUIRE_FALSE(fs::exists(dir / "ck/step_00000001"));  // rotated away while open
  CHECK(opened.verify().empty());
  CHECK(opened.read_full("weight", tensor) == saved);
  CHECK(Checkpoint::open(dir / "ck").read_full("weight", tensor) != saved);

  // Named by its own path while the rotation removes it (renamed .old-NAME-PID first).
  fs::rename(dir / "ck/step_00000002", dir / "ck/.old-step_00000002-4242");
  const std::string gone = checkpoint_error([&] { Checkpoint::open(dir / "ck/step_00000002"); });
  CHECK_THAT(gone, Catch::Contains("no checkpoint at " + (dir / "ck/step_00000002") + ": no such file or directory") &&
                       Catch::Contains("being removed, as .old-step_00000002-4242") &&
                       Catch::Contains("checkpoint.keep_last") &&
                       Catch::Contains("give " + (dir / "ck") + " to load the newest"));
}

// The race itself: a reader loads the live run's newest checkpoint through its directory (as
// keel sample --checkpoint out/checkpoints does) while the run saves and rotates with
// keep_last 1. Each load must verify and read one whole checkpoint, whichever it ends on.
TEST_CASE("loads of a live run's newest checkpoint succeed while the run saves and rotates", "[ckpt][live]") {
  test::TempDir dir("ckpt-live-race");
  SavingRun run(dir, /*keep_last=*/1);
  auto& [cfg, be, a, mgr] = run;
  run.save(1);
  const std::string tensor = a.table().params().front().name;
  std::atomic<bool> saving{true};
  std::thread saver([&] {
    for (int64_t s = 2; s <= 80; ++s) run.save(s);
    saving = false;
  });
  int loads = 0;
  std::vector<std::string> failures;
  while (saving) {
    try {
      // Verified (keel sample, eval) every other load; opened alone, the race is in open().
      const Checkpoint ck = loads % 2 ? Checkpoint::open(dir / "ck") : open_undamaged(dir / "ck", "load");
      CHECK(ck.read_full("weight", tensor).size() == static_cast<size_t>(a.table().params().front().logical_numel()));
      ++loads;
    } catch (const CheckpointError& e) {
      failures.push_back(e.what());
    }
  }
  saver.join();
  INFO(loads << " loads; the first failure: " << (failures.empty() ? "none" : failures.front()));
  CHECK(failures.empty());
  CHECK(loads > 0);
}

// The window between reading `latest` and opening the files is microseconds wide, so the race
// above rarely falls in it. Here `latest` is a FIFO that names step_00000001 at its first
// reading (removed meanwhile, as a rotation would) and step_00000002 at every later one: a run
// that saved and rotated between two readings.
TEST_CASE("a pointer whose checkpoint is removed before its files are open is followed again", "[ckpt][live]") {
  test::TempDir dir("ckpt-live-pointer");
  SavingRun run(dir);
  run.save(1);
  run.save(2);
  fs::remove_all(dir / "ck/step_00000001");
  const std::string pointer = dir / "ck/latest";
  fs::remove(pointer);
  REQUIRE(::mkfifo(pointer.c_str(), 0600) == 0);
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::thread pointer_writer([&] {
    sigset_t pipe_signal;  // a reader that closed before a write: EPIPE, not the signal
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    while (!stop) {
      const int fd = ::open(pointer.c_str(), O_WRONLY | O_NONBLOCK);  // fails until a reader opens it
      if (fd < 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      const std::string text = served++ == 0 ? "step_00000001\n" : "step_00000002\n";
      [[maybe_unused]] const ssize_t n = ::write(fd, text.data(), text.size());
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::optional<Checkpoint> ck;
  std::string error;
  try {
    ck = Checkpoint::open(dir / "ck");
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  stop = true;
  pointer_writer.join();
  INFO(error);
  REQUIRE(ck);
  CHECK(ck->path() == dir / "ck/step_00000002");
  CHECK(served >= 2);
}

// The error named the tensor file whatever failed ("writing ... model-tp00-pp00.safetensors
// failed: cannot write .../meta.json"); it names the checkpoint and, through the cause, the file.
TEST_CASE("a weights-only checkpoint that cannot be written names the folder and the file that failed", "[ckpt][io]") {
  test::TempDir dir("ckpt-weights-fail");
  const RunConfig cfg = test::make_config(test::tiny_run_json(), nlohmann::json::object());
  fs::create_directories(dir / "out/meta.json");  // meta.json cannot be created
  std::string error;
  try {
    write_weights_checkpoint(dir / "out", cfg, DType::F32,
                             [](const ParamSpec& p, DType, void* out) {
                               std::memset(out, 0, static_cast<size_t>(p.logical_numel()) * sizeof(float));
                             });
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::StartsWith("writing weights-only checkpoint " + (dir / "out") + " failed: ") &&
                        Catch::Contains("cannot create '" + (dir / "out/meta.json") + "': Is a directory"));
}

// Checkpoints saved before meta.json recorded saved_at_ns are ranked by meta.json's file time.
TEST_CASE("rotation ranks checkpoints by when they were saved, by file time for ones without a save time",
          "[ckpt][rotate]") {
  test::TempDir dir("ckpt-rotate-order");
  CheckpointConfig cfg;
  cfg.keep_last = 2;
  cfg.keep_every = 0;
  const auto now = fs::file_time_type::clock::now();
  // Steps 3 and 4 were saved first (an abandoned run), then 1 and 2 (after a rewind).
  const std::map<std::string, int> minutes_ago = {{"step_00000003", 40}, {"step_00000004", 30},
                                                  {"step_00000001", 20}, {"step_00000002", 10}};
  for (const auto& [name, ago] : minutes_ago) {
    fs::create_directories(dir / name);
    std::ofstream(fs::path(dir / name) / "meta.json") << "{}";
    fs::last_write_time(fs::path(dir / name) / "meta.json", now - std::chrono::minutes(ago));
  }
  std::ofstream(dir / "latest") << "step_00000002\n";
  CheckpointManager(dir.path.string(), cfg).rotate();
  CHECK(fs::exists(dir / "step_00000001"));
  CHECK(fs::exists(dir / "step_00000002"));
  CHECK_FALSE(fs::exists(dir / "step_00000003"));
  CHECK_FALSE(fs::exists(dir / "step_00000004"));
}

// A job resumed on other nodes: the clock that stamps the new saves runs an hour behind the one
// that stamped the old ones. By the clock, the rewind's abandoned steps 3 and 4 would look like
// this run's (and be rotated) and this run's saves like the oldest (and be removed first).
TEST_CASE("the order of saves and a rewind's abandoned steps follow save_seq, not clocks that disagree",
          "[ckpt][rotate]") {
  test::TempDir dir("ckpt-rotate-seq");
  CheckpointConfig cfg;
  cfg.keep_last = 2;
  cfg.keep_every = 0;
  const int64_t now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const int64_t hour_ns = int64_t{3600} * 1000000000;
  const auto fake_save = [&](int step, int64_t seq, int64_t saved_ns) {
    const fs::path ck = fs::path(dir.path) / CheckpointManager::step_name(step);
    fs::create_directories(ck);
    std::ofstream(ck / "meta.json") << nlohmann::json{{"save_seq", seq}, {"saved_at_ns", saved_ns}}.dump();
  };
  for (int s = 1; s <= 4; ++s) fake_save(s, s - 1, now_ns + hour_ns + s);  // the first run, fast clock
  std::ofstream(dir / "latest") << "step_00000004\n";

  CheckpointManager mgr(dir.path.string(), cfg);
  CHECK(mgr.set_resumed_from(2, dir / "step_00000002") ==
        std::vector<std::string>{"step_00000003", "step_00000004"});
  // This run's saves (numbered after every save there; stamped by the slow clock) at steps 5, 6.
  fake_save(5, 4, now_ns + 5);
  fake_save(6, 5, now_ns + 6);
  std::ofstream(dir / "latest") << "step_00000006\n";
  mgr.rotate();
  // The trajectory in save order is 1, 2, 5, 6: keep_last keeps 5 and 6; 3 and 4 stay untouched.
  CHECK_FALSE(fs::exists(dir / "step_00000001"));
  CHECK_FALSE(fs::exists(dir / "step_00000002"));
  for (const char* kept : {"step_00000003", "step_00000004", "step_00000005", "step_00000006"}) {
    INFO(kept);
    CHECK(fs::exists(dir / kept));
  }
  // With no `latest`, the newest save is the one of the highest save_seq, not the latest clock.
  fs::remove(dir / "latest");
  CHECK(Checkpoint::find_latest(dir.path.string()) == (fs::path(dir.path) / "step_00000006").string());
  // A save of a lower step made after the one resumed (save_seq) is not its past either; one
  // resumed from outside the directory has no known past here at all.
  fake_save(1, 6, now_ns + 7);
  CheckpointManager later(dir.path.string(), cfg);
  CHECK(later.set_resumed_from(5, dir / "step_00000005") ==
        std::vector<std::string>{"step_00000006", "step_00000001"});
  CheckpointManager elsewhere(dir.path.string(), cfg);
  CHECK(elsewhere.set_resumed_from(5, "/another/run/checkpoints/step_00000005").size() == 5);  // 1, 3 to 6
}


TEST_CASE("a save split over DP ranks (ZeRO shards) and TP ranks is read back under any layout", "[ckpt][reshard]") {
  test::TempDir dir("ckpt-reshard");
  RunConfig cfg = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}}});
  auto be = make_cpu_backend();
  Trainer full(cfg, *be);
  full.init_weights();
  auto tokens = test::synthetic_tokens(4000, 2);
  for (int s = 1; s <= 2; ++s) full.step(batches_from(tokens, 300 * s, 2, 4, 32), s);
  const int64_t n = full.table().local_numel();

  SECTION("three DP ranks each write their third of the optimizer state; one rank or two read it back") {
    CheckpointManager mgr1(dir / "dp1", cfg.checkpoint);
    mgr1.save(cfg, full.table(), full.state(), *be, {2, 16, 512, 0, 0}, full.scaler(), {});
    Checkpoint ck1 = Checkpoint::open(dir / "dp1");
    // Three ZeRO shards (their cut points run through tensors: chunks are partial rows).
    std::vector<std::unique_ptr<ParamState>> shards;
    for (int r = 0; r < 3; ++r) {
      shards.push_back(std::make_unique<ParamState>(full.table(), *be, cfg.precision.mode, 3, r));
      LossScaler sc(cfg.precision.loss_scale, false);
      restore_for_resume(ck1, cfg, full.table(), *shards.back(), *be, sc, {});
      CHECK(shards.back()->optim_end() - shards.back()->optim_begin() == (n + 2) / 3);
    }
    // Each rank has its own manager, as in a run; these ranks save in the background.
    std::barrier sync(3);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.emplace_back([&, r] {
        RankPlace place;
        place.world_rank = r;
        place.dp_rank = r;
        place.writes_weights = r == 0;
        const AgreeFn agree = [&](bool ok) {
          sync.arrive_and_wait();
          return ok;
        };
        CheckpointManager mgr(dir / "dp3", cfg.checkpoint);
        mgr.begin_save(cfg, full.table(), *shards[r], *be, {2, 16, 512, 0, 0}, full.scaler(), place, agree, nullptr,
                       /*background=*/true);
        mgr.finish_save(agree);
      });
    }
    for (auto& t : ranks) t.join();
    Checkpoint ck = Checkpoint::open(dir / "dp3");
    CHECK(ck.meta()["files"].size() == 4);  // one model file + three optimizer shards
    CHECK(ck.verify().empty());
    Trainer one(cfg, *be);
    restore_for_resume(ck, cfg, one.table(), one.state(), *be, one.scaler(), {});
    require_same_state(full.state(), one.state());
    // ...and as two DP ranks with other cut points.
    for (int r = 0; r < 2; ++r) {
      ParamState half(full.table(), *be, cfg.precision.mode, 2, r);
      LossScaler sc(cfg.precision.loss_scale, false);
      restore_for_resume(ck, cfg, full.table(), half, *be, sc, {});
      const int64_t b0 = half.optim_begin(), len = std::min(half.optim_end(), n) - b0;
      for (const Tensor* t : {&half.m, &half.v, &half.master}) {
        const Tensor& whole = t == &half.m ? full.state().m : t == &half.v ? full.state().v : full.state().master;
        REQUIRE(std::memcmp(half.flat_view(*t, b0, len).data, full.state().flat_view(whole, b0, len).data,
                            static_cast<size_t>(len) * 4) == 0);
      }
      REQUIRE(std::memcmp(half.working.data, full.state().working.data,
                          static_cast<size_t>(n) * dtype_size(half.working.dtype)) == 0);
    }
  }

  SECTION("tp=1 -> two TP shards -> saved by two TP ranks -> read back as tp=1") {
    CheckpointManager mgr1(dir / "tp1", cfg.checkpoint);
    mgr1.save(cfg, full.table(), full.state(), *be, {2, 16, 512, 0, 0}, full.scaler(), {});
    Checkpoint ck1 = Checkpoint::open(dir / "tp1");
    std::vector<std::unique_ptr<ParamTable>> tables;
    std::vector<std::unique_ptr<ParamState>> states;
    for (int r = 0; r < 2; ++r) {
      ModelShard sh;
      sh.tp_rank = r;
      sh.tp_size = 2;
      tables.push_back(std::make_unique<ParamTable>(cfg.model, sh));
      states.push_back(std::make_unique<ParamState>(*tables.back(), *be, cfg.precision.mode));
      LossScaler sc(cfg.precision.loss_scale, false);
      restore_for_resume(ck1, cfg, *tables.back(), *states.back(), *be, sc, {});
      // Spot-check a column-split and a row-split tensor against the full one.
      for (const char* name : {"layers.1.attn.wo", "layers.0.attn.wk", "layers.0.mlp.w_gate"}) {
        const ParamSpec& ps = tables.back()->at(name);
        const ParamSpec& pf = full.table().at(name);
        const auto* shard = static_cast<const float*>(states.back()->master.data) + ps.offset;
        const auto* whole = static_cast<const float*>(full.state().master.data) + pf.offset;
        for (int64_t i = 0; i < ps.local_shape[0]; ++i)
          for (int64_t j = 0; j < ps.local_shape[1]; ++j) {
            const int64_t fi = ps.split == TpSplit::Rows ? ps.shard_begin + i : i;
            const int64_t fj = ps.split == TpSplit::Cols ? ps.shard_begin + j : j;
            REQUIRE(shard[i * ps.local_shape[1] + j] == whole[fi * pf.shape[1] + fj]);
          }
      }
    }
    std::barrier sync(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.emplace_back([&, r] {
        RankPlace place;
        place.world_rank = r;
        place.tp_rank = r;
        LossScaler sc(cfg.precision.loss_scale, false);
        CheckpointManager mgr2(dir / "tp2", cfg.checkpoint);
        mgr2.save(cfg, *tables[r], *states[r], *be, {2, 16, 512, 0, 0}, sc, place, [&](bool ok) {
          sync.arrive_and_wait();
          return ok;
        });
      });
    for (auto& t : ranks) t.join();
    Checkpoint ck2 = Checkpoint::open(dir / "tp2");
    CHECK(ck2.verify().empty());
    Trainer back(cfg, *be);
    restore_for_resume(ck2, cfg, back.table(), back.state(), *be, back.scaler(), {});
    require_same_state(full.state(), back.state());
  }
}

TEST_CASE("seed 000 in miniature: --init-from continues the pretrained loss, masters left random jump",
          "[ckpt][finetune]") {
  // Pretrain a tiny model in bf16 until its loss is far below the random-init loss.
  test::TempDir dir("ckpt-finetune");
  auto be = make_cpu_backend();
  auto tokens = test::synthetic_tokens(60000, 4);
  RunConfig pre = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}},
                                                             {"train", {{"steps", 150}}}});
  Trainer p(pre, *be);
  p.init_weights();
  for (int s = 1; s <= 150; ++s) p.step(batches_from(tokens, static_cast<size_t>(s % 100) * 264, 2, 4, 32), s);
  CheckpointManager mgr(dir / "pre", pre.checkpoint);
  mgr.save(pre, p.table(), p.state(), *be, {150, 1200, 38400, 0, 0}, p.scaler(), {});
  Checkpoint ck = Checkpoint::open(dir / "pre");

  // The finetuning run: a fresh schedule with a small constant LR.
  RunConfig ft = test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}},
                                                            {"optimizer", {{"lr", 1e-3}, {"min_lr", 1e-3}}},
                                                            {"schedule", {{"warmup_steps", 0}, {"decay", "constant"}}}});
  auto held_out = batches_from(tokens, 50000, 2, 4, 32);
  auto train_batch = batches_from(tokens, 40000, 2, 4, 32);

  Trainer good(ft, *be);
  std::string log = init_weights_from(ck, good.table(), good.state(), *be, {});
  CHECK_THAT(log, Catch::Contains("Adam moments zero") && Catch::Contains("fp32 master weights"));
  CHECK(good.state().adam_step == 0);

  // The seed's bug: working weights loaded, fp32 masters left at a random init.
  Trainer broken(ft, *be);
  broken.init_weights();
  {
    std::vector<float> w(static_cast<size_t>(broken.table().local_numel()));
    good.state().working_to_host(w.data());  // the same pretrained bf16 values...
    Tensor host(w.data(), DType::F32, {broken.table().local_numel()});
    be->convert(broken.state().working, host);  // ...into the working copy only
  }

  const double good_before = good.evaluate(held_out);
  good.step(train_batch, 1);
  const double good_after = good.evaluate(held_out);
  const double broken_before = broken.evaluate(held_out);
  broken.step(train_batch, 1);
  const double broken_after = broken.evaluate(held_out);

  Trainer fresh(ft, *be);
  fresh.init_weights();
  const double random_init = fresh.evaluate(held_out);

  INFO("pretrained " << good_before << " -> after one finetuning step " << good_after << "; broken path "
                     << broken_before << " -> " << broken_after << "; random init " << random_init);
  REQUIRE(good_before < random_init - 1.5);      // the pretraining took hold
  CHECK(broken_before == good_before);           // both start from the same weights
  const double margin = 0.05;                    // what "no jump" means here
  CHECK(std::abs(good_after - good_before) < margin);
  CHECK(broken_after - broken_before > 20 * margin);  // the test can tell the two apart
  CHECK(std::abs(broken_after - random_init) < 0.5);  // it jumps back to the random-init loss
}

// Vocabulary padding: keel's init zeroes the padding rows, and a load under another padding
// keeps the real rows and zeroes the padding in every state. A checkpoint whose padding rows
// hold values (saved by an older keel, whose init drew them at random) loads the same way, and
// repadded_tensors gives the squared sums dropped, which the restart verification discounts.
TEST_CASE("a load under another vocabulary padding keeps the real rows and zeroes the padding in every state",
          "[ckpt][vocab]") {
  test::TempDir dir("ckpt-repad");
  auto be = make_cpu_backend();
  auto config = [](int pad) {
    return test::make_config(test::tiny_run_json(),
                             {{"precision", {{"mode", "bf16"}}}, {"model", {{"pad_vocab_to_multiple_of", pad}}}});
  };
  const RunConfig cfg96 = config(48);  // 64 tokens -> 96 rows
  Trainer a(cfg96, *be);
  a.init_weights();
  const ParamSpec& emb = a.table().at("tok_embed");
  REQUIRE(emb.shape == std::vector<int64_t>{96, 32});
  REQUIRE(emb.padded_from == 64);
  auto row_values = [](const Tensor& buffer, const ParamSpec& p, int64_t row0, int64_t row1) {
    std::vector<float> out;
    const int64_t cols = p.shape[1];
    for (int64_t i = row0 * cols; i < row1 * cols; ++i) {
      const char* e = static_cast<const char*>(buffer.data) + (p.offset + i) * dtype_size(buffer.dtype);
      uint16_t h;
      std::memcpy(&h, e, 2);
      out.push_back(buffer.dtype == DType::BF16 ? bf16_to_f32(h) : *reinterpret_cast<const float*>(e));
    }
    return out;
  };
  for (const char* name : {"tok_embed", "lm_head"}) {
    const std::vector<float> pad = row_values(a.state().working, a.table().at(name), 64, 96);
    CHECK(std::all_of(pad.begin(), pad.end(), [](float x) { return x == 0.0f; }));
  }
  auto tokens = test::synthetic_tokens(4000, 1);
  for (int s = 1; s <= 2; ++s) a.step(batches_from(tokens, 100 * s, 2, 4, 32), s);
  // Two steps on: still zero (no gradient, and decay of zero is zero). Then as an older keel
  // left them: values in the padding rows of the weights and masters.
  double weight_sumsq = 0, master_sumsq = 0;
  for (const char* name : {"tok_embed", "lm_head"}) {
    const ParamSpec& p = a.table().at(name);
    for (float x : row_values(a.state().working, p, 64, 96)) REQUIRE(x == 0.0f);
    for (int64_t i = 64 * 32; i < 96 * 32; ++i) {
      const float v = 0.01f * static_cast<float>(i % 7 + 1);
      static_cast<float*>(a.state().master.data)[p.offset + i] = v;
      static_cast<uint16_t*>(a.state().working.data)[p.offset + i] = f32_to_bf16(v);
      weight_sumsq += static_cast<double>(bf16_to_f32(f32_to_bf16(v))) * bf16_to_f32(f32_to_bf16(v));
      master_sumsq += static_cast<double>(v) * v;
    }
  }
  CheckpointManager(dir / "ck", cfg96.checkpoint).save(cfg96, a.table(), a.state(), *be, {2, 16, 512, 0, 0}, a.scaler(), {});
  Checkpoint ck = Checkpoint::open(dir / "ck");

  for (const int pad : {1, 128}) {  // 64 rows (padding dropped), 128 rows (more padding)
    INFO("pad_vocab_to_multiple_of " << pad);
    const RunConfig cfg = config(pad);
    Trainer b(cfg, *be);
    b.init_weights();
    LossScaler sc(cfg.precision.loss_scale, false);
    restore_for_resume(ck, cfg, b.table(), b.state(), *be, sc, {});
    for (const char* name : {"tok_embed", "lm_head"}) {
      INFO(name);
      const ParamSpec& pa = a.table().at(name);
      const ParamSpec& pb = b.table().at(name);
      for (auto member : {&ParamState::working, &ParamState::master, &ParamState::m, &ParamState::v}) {
        CHECK(row_values(b.state().*member, pb, 0, 64) == row_values(a.state().*member, pa, 0, 64));
        const std::vector<float> pad_rows = row_values(b.state().*member, pb, 64, pb.shape[0]);
        CHECK(std::all_of(pad_rows.begin(), pad_rows.end(), [](float x) { return x == 0.0f; }));
      }
    }
    const auto dropped = repadded_tensors(ck, b.table());
    REQUIRE(dropped.size() == 2);
    double w = 0, m = 0;
    for (const auto& [name, d] : dropped) {
      CHECK(d.rows_saved == 96);
      CHECK(d.rows_now == (pad == 1 ? 64 : 128));
      w += d.weight_sumsq;
      m += d.master_sumsq;
    }
    CHECK(w == Approx(weight_sumsq).epsilon(1e-12));
    CHECK(m == Approx(master_sumsq).epsilon(1e-12));
    // keel ckpt diff of the two: the real rows equal, the old padding rows named (not zero).
    const std::string saved = dir / ("pad" + std::to_string(pad));
    CheckpointManager(saved, cfg.checkpoint).save(cfg, b.table(), b.state(), *be, {2, 16, 512, 0, 0}, b.scaler(), {});
    const test::ProcessResult d = test::run_keel("ckpt diff " + (dir / "ck") + " " + saved);
    INFO(d.output);
    CHECK(d.code == 1);
    for (const char* state : {"weight", "master"})
      for (const char* name : {"tok_embed", "lm_head"})
        CHECK_THAT(d.output, Catch::Contains(std::string(state) + "   " + name) &&
                                 Catch::Contains("padding rows (past model.vocab_size 64) hold values other than zero"));
    CHECK_THAT(d.output, Catch::Contains("4 of 84 tensors compared differ"));
  }
  // The same padding: nothing re-padded, the stored padding rows restored as they are.
  CHECK(repadded_tensors(ck, a.table()).empty());
}

TEST_CASE("weights-only loads name the tensor and both shapes on a mismatch", "[ckpt][finetune]") {
  test::TempDir dir("ckpt-mismatch");
  auto be = make_cpu_backend();
  RunConfig cfg = test::make_config(test::tiny_run_json());
  Trainer a(cfg, *be);
  a.init_weights();
  CheckpointManager(dir / "ck", cfg.checkpoint).save(cfg, a.table(), a.state(), *be, {1, 8, 256, 0, 0}, a.scaler(), {});
  Checkpoint ck = Checkpoint::open(dir / "ck");
  RunConfig wider = test::make_config(test::tiny_run_json(), {{"model", {{"ffn_hidden", 96}}}});
  Trainer b(wider, *be);
  CHECK_THROWS_WITH(init_weights_from(ck, b.table(), b.state(), *be, {}),
                    Catch::Contains("layers.0.mlp.w_gate: checkpoint has shape [64, 32], the model expects [96, 32]") &&
                        Catch::Contains("(the model settings that differ: model.ffn_hidden 64 in the checkpoint, 96 here)"));
  LossScaler sc(wider.precision.loss_scale, false);
  CHECK_THROWS_WITH(restore_for_resume(ck, wider, b.table(), b.state(), *be, sc, {}),
                    Catch::Contains("model.ffn_hidden: checkpoint 64, config 96"));
}
