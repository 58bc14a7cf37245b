// A checkpoint's vocab padding is kept as saved: loading it into a model padded otherwise (by
// model.pad_vocab_to_multiple_of x parallel.tp) is refused, and the refusal says that padding is
// the difference and what to do. (The padded rows' math: test/model/test_padded_vocab.cpp.)
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
