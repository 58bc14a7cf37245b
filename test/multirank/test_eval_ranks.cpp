// keel eval under mpirun: data-parallel scoring. Every rank loads the whole model and scores its
// share of the items; the lead's report and scores file must be the single process's, byte for
// byte (each item's log-likelihoods are computed alone, whichever rank computes them, and travel
// as their bits), on both paths: the KV cache and --rows packing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "common/process.h"
#include "common/temp_dir.h"
#include "common/workspace.h"

using namespace keel;

// keel train --eval-only under mpirun: a model too large for one device is evaluated under a
// model-parallel layout. A single-process checkpoint, evaluated under tp=2 pp=2 and pp=2 dp=2,
// gives the single process's validation loss and choice log-likelihoods within fp32 summation
// order (1e-5 relative, the bound of the layout tests' first forward), and writes nothing.
TEST_CASE("keel train --eval-only evaluates a checkpoint under TP, PP and DP like one process", "[eval][mpi]") {
  test::Workspace ws;
  test::write_stream_choice_items(ws.dir / "choices.jsonl", 21);
  const std::string out = ws.dir / "run";
  const std::string args = "train --config " + ws.config + " --out " + out + " --steps 10 --set choice_eval.file=" +
                           (ws.dir / "choices.jsonl") + " --set choice_eval.write_scores=true";
  const test::ProcessResult one = test::run_keel(args);
  INFO(one.output);
  REQUIRE(one.code == 0);
  double val = 0;
  for (const nlohmann::json& rec : test::read_metrics(out + "/metrics.jsonl"))
    if (rec.contains("val_loss") && rec["step"] == 10) val = rec["val_loss"];
  REQUIRE(val > 0);
  const size_t acc_at = one.output.find(" choice eval at iteration 10 | acc ");
  REQUIRE(acc_at != std::string::npos);
  const std::string acc_line = one.output.substr(acc_at, one.output.find(" | chance", acc_at) - acc_at);  // acc, acc_per_token
  const std::string metrics = test::read_file(out + "/metrics.jsonl");
  const std::string scores = test::read_file(out + "/choice_scores/step_10.jsonl");
  REQUIRE(!scores.empty());
  for (const std::string layout : {"--set parallel.tp=2 --set parallel.pp=2", "--set parallel.pp=2 --set parallel.dp=2"}) {
    INFO(layout);
    const test::ProcessResult many = test::run_keel_mpi(4, args + " --eval-only " + layout);
    INFO(many.output);
    REQUIRE(many.code == 0);
    const size_t at = many.output.find(" validation at iteration 10 | lm loss: ");
    REQUIRE(at != std::string::npos);
    const double got = std::stod(many.output.substr(at + 39, 12));
    CHECK(std::abs(got - val) <= 1e-5 * val);
    CHECK_THAT(many.output, Catch::Contains(acc_line) && Catch::Contains("nothing was written"));
    CHECK(test::read_file(out + "/metrics.jsonl") == metrics);
    CHECK(test::read_file(out + "/choice_scores/step_10.jsonl") == scores);  // write_scores is not acted on
  }
}

TEST_CASE("keel eval under mpirun splits the items over the ranks and reports the single process's scores",
          "[eval][mpi]") {
  test::TempDir tmp("eval-ranks");
  const std::string hf = std::string(KEEL_FIXTURE_DIR) + "/hf/";
  const std::string base = "eval --checkpoint hf:" + hf + "llama_trained --choices " + hf + "choices/fortunes.jsonl";
  for (const std::string rows : {"", " --rows 3"}) {
    INFO("path:" << (rows.empty() ? " KV cache" : rows));
    const test::ProcessResult one = test::run_keel(base + rows + " --scores " + tmp / "one.jsonl");
    INFO(one.output);
    REQUIRE(one.code == 0);
    // 3 ranks for 24 items: 8 each; 5 ranks: 5, 5, 5, 5, 4.
    for (int np : {3, 5}) {
      const std::string file = tmp / ("np" + std::to_string(np) + ".jsonl");
      const test::ProcessResult many = test::run_keel_mpi(np, base + rows + " --scores " + file);
      INFO(many.output);
      REQUIRE(many.code == 0);
      CHECK_THAT(many.output, Catch::Contains("scored 24 items in") &&
                                  Catch::Contains(" on " + std::to_string(np) + " ranks"));
      // The accuracy lines, printed once, by the lead. mpirun forwards a rank's stdout and
      // stderr through separate pipes, so stderr's "keel: scored ..." line can land among them:
      // the report is the stdout lines only.
      auto report = [](const std::string& out) {
        const size_t at = out.find("keel eval ");
        std::string lines, block = out.substr(at, out.find("chance", at) - at);
        for (size_t pos = 0; pos < block.size();) {
          const size_t end = std::min(block.find('\n', pos), block.size());
          if (block.compare(pos, 5, "keel:") != 0) lines += block.substr(pos, end - pos) + "\n";
          pos = end + 1;
        }
        return lines;
      };
      CHECK(report(many.output) == report(one.output));
      CHECK(many.output.find("keel eval ") == many.output.rfind("keel eval "));
      const std::string scores = test::read_file(file);
      CHECK(!scores.empty());
      CHECK(scores == test::read_file(tmp / "one.jsonl"));
    }
  }
}
