// keel train with choice_eval (multiple-choice accuracy during training) end to end: on the
// synthetic stream next = 3t + 1 (mod 64) the right ending is the stream's continuation, which
// the tiny model learns within 30 steps, so the accuracy climbs from near chance.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "common/process.h"
#include "common/workspace.h"

using namespace keel;
namespace fs = std::filesystem;
using json = nlohmann::json;


TEST_CASE("keel train with choice_eval and eval_at_start: the accuracy is logged, written and rises as the model learns",
          "[cli][e2e][choice_train]") {
  test::Workspace ws;
  test::write_stream_choice_items(ws.dir / "choices.jsonl", 40);
  const std::string out = ws.dir / "run";
  const test::ProcessResult r =
      test::run_keel("train --config " + ws.config + " --out " + out + " --set choice_eval.file=" +
                     (ws.dir / "choices.jsonl") + " --set train.eval_at_start=true --set choice_eval.write_scores=true");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("choice eval: 40 items from") && Catch::Contains("every 10 steps and at the end") &&
                           Catch::Contains("and before the first step"));
  CHECK_THAT(r.output, Catch::Contains(" choice eval at iteration 30 | acc "));
  std::map<int64_t, json> evals;
  std::vector<int64_t> val_steps;
  for (const json& rec : test::read_metrics(out + "/metrics.jsonl")) {
    if (rec.contains("choice_acc")) evals[rec["step"].get<int64_t>()] = rec;
    if (rec.contains("val_loss")) val_steps.push_back(rec["step"]);
  }
  CHECK(val_steps == std::vector<int64_t>{0, 10, 20, 30});  // train.eval_at_start validates before step 1 too
  CHECK_THAT(r.output, Catch::Contains(" validation at iteration 0 | lm loss:"));
  REQUIRE(evals.size() == 4);  // before step 1, at 10, 20 and 30
  for (int64_t step : {0, 10, 20, 30}) REQUIRE(evals.count(step));
  CHECK(evals[30]["choice_items"] == 40);
  CHECK_FALSE(evals[30].contains("choice_acc_per_byte"));  // token-id items have no bytes
  const double first = evals[0]["choice_acc"], last = evals[30]["choice_acc"];
  CHECK(first < 0.6);
  CHECK(last >= 0.9);
  WARN("choice accuracy " << first << " before training, " << last << " after 30 steps");

  // The scores file: one line per item, in file order, with the picks the accuracy counted.
  std::ifstream scores(evals[30]["choice_scores"].get<std::string>());
  std::string line;
  int n = 0, right = 0;
  while (std::getline(scores, line)) {
    const json s = json::parse(line);
    CHECK(s["logprob"].size() == 4);
    CHECK(s["line"] == n + 1);
    right += s["pick"] == s["label"];
    ++n;
  }
  CHECK(n == 40);
  CHECK(static_cast<double>(right) / n == last);

  // --eval-only: the numbers of the model the run would start from, printed as the run printed
  // them (same layout, same bits), and nothing written. The finished run is its step-30
  // checkpoint; a new run directory is the initialisation, which eval_at_start measured.
  auto line_of = [](const std::string& out, const std::string& start) {
    const size_t at = out.find(start);
    return at == std::string::npos ? std::string("(no line " + start + ")") : out.substr(at, out.find('\n', at) - at);
  };
  auto listing = [](const std::string& dir) {
    std::vector<std::string> files;
    for (const auto& e : fs::recursive_directory_iterator(dir))
      files.push_back(e.path().string() + " " + (e.is_regular_file() ? std::to_string(e.file_size()) : "dir") + " " +
                      std::to_string(e.last_write_time().time_since_epoch().count()));
    std::sort(files.begin(), files.end());
    return files;
  };
  const std::vector<std::string> before = listing(out);
  const std::string eval_only = "train --config " + ws.config + " --set choice_eval.file=" + (ws.dir / "choices.jsonl") +
                                " --set choice_eval.write_scores=true --eval-only --out ";
  const test::ProcessResult e = test::run_keel(eval_only + out);
  INFO(e.output);
  REQUIRE(e.code == 0);
  CHECK(line_of(e.output, " validation at iteration 30 |") == line_of(r.output, " validation at iteration 30 |"));
  // The choice line ends with the time it took.
  auto without_time = [](const std::string& l) { return l.substr(0, l.rfind(" items in ")); };
  CHECK(without_time(line_of(e.output, " choice eval at iteration 30 |")) ==
        without_time(line_of(r.output, " choice eval at iteration 30 |")));
  CHECK_THAT(e.output, Catch::Contains("--eval-only: evaluated " + out + "/checkpoints/step_00000030 at iteration 30 under "
                                       "tp=1 pp=1 dp=1; nothing was written"));
  CHECK(listing(out) == before);
  const test::ProcessResult fresh = test::run_keel(eval_only + (ws.dir / "fresh"));
  INFO(fresh.output);
  REQUIRE(fresh.code == 0);
  CHECK(line_of(fresh.output, " validation at iteration 0 |") == line_of(r.output, " validation at iteration 0 |"));
  CHECK(without_time(line_of(fresh.output, " choice eval at iteration 0 |")) ==
        without_time(line_of(r.output, " choice eval at iteration 0 |")));
  CHECK_THAT(fresh.output, Catch::Contains("evaluated the initialisation at iteration 0"));
  CHECK(!fs::exists(ws.dir / "fresh"));
  // --init-from the finished run's checkpoint: its weights (fp32 here: masters = weights), the
  // same numbers at iteration 0 of a new run.
  const test::ProcessResult init =
      test::run_keel(eval_only + (ws.dir / "init") + " --init-from " + out + "/checkpoints/step_00000030");
  INFO(init.output);
  REQUIRE(init.code == 0);
  const std::string v30 = line_of(r.output, " validation at iteration 30 |");
  CHECK(line_of(init.output, " validation at iteration 0 |").substr(29) == v30.substr(30));
  CHECK(!fs::exists(ws.dir / "init"));
  const test::ProcessResult nothing =
      test::run_keel("train --config " + ws.config + " --set data.val=null --eval-only --out " + out);
  CHECK(nothing.code == 2);
  CHECK_THAT(nothing.output, Catch::Contains("--eval-only: nothing to evaluate"));

  // Extending the finished run: eval_at_start measured the run's start, not each resume's (step
  // 30 was evaluated before its checkpoint was saved), so the evaluations go on at 40 only.
  const test::ProcessResult more =
      test::run_keel("train --config " + ws.config + " --out " + out + " --steps 40 --set choice_eval.file=" +
                     (ws.dir / "choices.jsonl") + " --set train.eval_at_start=true");
  INFO(more.output);
  REQUIRE(more.code == 0);
  std::vector<int64_t> val_after, choice_after;
  bool resumed = false;
  for (const json& rec : test::read_metrics(out + "/metrics.jsonl")) {
    resumed = resumed || rec.value("event", "") == "resume";
    if (resumed && rec.contains("val_loss")) val_after.push_back(rec["step"]);
    if (resumed && rec.contains("choice_acc")) choice_after.push_back(rec["step"]);
  }
  CHECK(resumed);
  CHECK(val_after == std::vector<int64_t>{40});
  CHECK(choice_after == std::vector<int64_t>{40});
  CHECK_THAT(more.output, !Catch::Contains("at iteration 30 |"));
}

TEST_CASE("keel train with choice_eval: bad items stop the run before anything is written", "[cli][errors][choice_train]") {
  test::Workspace ws;
  const std::string out = ws.dir / "never";
  auto run_with = [&](const std::string& items, const std::string& extra = "") {
    std::ofstream(ws.dir / "c.jsonl") << items;
    return test::run_keel("train --config " + ws.config + " --out " + out + " --set choice_eval.file=" +
                          (ws.dir / "c.jsonl") + " " + extra);
  };
  SECTION("text items without a tokenizer say how to give one") {
    const test::ProcessResult r = run_with(R"({"context": "a", "endings": [" b", " c"], "label": 0})");
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("c.jsonl:1") && Catch::Contains("choice_eval.tokenizer"));
  }
  SECTION("an ending longer than seq_len names the line") {
    const test::ProcessResult r = run_with(R"({"context_ids": [1], "ending_ids": [[2], [3, 4, 5, 6]], "label": 0})",
                                           "--set train.seq_len=3");
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("c.jsonl:1 ending 1 has 4 tokens, more than train.seq_len (3)"));
  }
  SECTION("ids beyond the vocabulary") {
    const test::ProcessResult r = run_with(R"({"context_ids": [1], "ending_ids": [[2], [64]], "label": 0})");
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("64 is not a token id of the model (0 .. 63)"));
  }
  SECTION("other choice_eval fields without a file") {
    const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + out +
                                                 " --set choice_eval.interval=5");
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("choice_eval.file: missing"));
  }
  CHECK_FALSE(fs::exists(out));
}
