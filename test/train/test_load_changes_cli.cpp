// What a load says about the changes between the checkpoint and this run: each changed setting
// by name, the next step's learning rate when it moves, and a refusal that names vocab padding
// as the difference (model.pad_vocab_to_multiple_of x parallel.tp; the padded rows' math is
// test/model/test_padded_vocab.cpp).
#include <catch2/catch.hpp>

#include "common/process.h"
#include "common/workspace.h"

using namespace keel;

TEST_CASE("a checkpoint padded otherwise than the model is refused, naming the padding", "[ckpt][cli][vocab]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 2}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q").code == 0);
  const test::ProcessResult r =
      test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "padded") + " --init-from " + out +
                     "/checkpoints --set model.pad_vocab_to_multiple_of=48");
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("tensor tok_embed: checkpoint has shape [64, 32], the model expects [96, 32] "
                                       "(model.vocab_size 64, padded to 64 rows in the checkpoint and to 96 here") &&
                           Catch::Contains("--init-from hf:DIR, which pads"));
}

TEST_CASE("a resume names each changed setting and the next step's new learning rate", "[ckpt][cli][resume]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 6}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 4").code == 4);
  const test::ProcessResult same = test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 5");
  INFO(same.output);
  CHECK(same.code == 4);
  CHECK(same.output.find("settings changed") == std::string::npos);
  CHECK(same.output.find("learning rate of step") == std::string::npos);
  // A longer run with a lower peak: cosine decay over more steps, from another lr.
  const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + out +
                                               " --stop-at 6 --steps 8 --set optimizer.lr=5e-3");
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("settings changed since the checkpoint:\n    optimizer.lr: 0.01 -> 0.005\n"
                                       "    train.steps: 6 -> 8") &&
                           Catch::Contains("the learning rate of step 6 changes from "));
}
