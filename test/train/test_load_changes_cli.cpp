// What a load says about the changes between the checkpoint and this run: each changed setting
// by name, the next step's learning rate when it moves, and a refusal that names vocab padding
// as the difference (model.pad_vocab_to_multiple_of x parallel.tp; the padded rows' math is
// test/model/test_padded_vocab.cpp).
#include <catch2/catch.hpp>

#include <filesystem>

#include "common/process.h"
#include "common/workspace.h"

using namespace keel;
namespace fs = std::filesystem;

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

TEST_CASE("a resume names training files that changed under the same data.train", "[ckpt][cli][resume][data]") {
  // data.train is a glob; a shard added to the folder (or one rewritten with another length)
  // changes the windows, and with them the sampler's order, while the config stays the same.
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 6}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  fs::create_directories(ws.dir / "shards");
  data::write_llmc_shard(ws.dir / "shards/a.bin", test::synthetic_tokens(5000, 1), false);
  data::write_llmc_shard(ws.dir / "shards/b.bin", test::synthetic_tokens(5000, 2), false);
  const std::string out = ws.dir / "run";
  const std::string set = " --set 'data.train=[\"" + (ws.dir / "shards") + "/*.bin\"]'";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + set + " -q --stop-at 2").code == 4);
  const test::ProcessResult same = test::run_keel("train --config " + ws.config + " --out " + out + set + " --stop-at 3");
  INFO(same.output);
  CHECK(same.code == 4);
  CHECK(same.output.find("training data changed") == std::string::npos);

  data::write_llmc_shard(ws.dir / "shards/c.bin", test::synthetic_tokens(3000, 3), false);
  data::write_llmc_shard(ws.dir / "shards/b.bin", test::synthetic_tokens(4000, 2), false);
  const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + out + set + " --stop-at 4");
  INFO(r.output);
  CHECK(r.code == 4);
  const std::string shards = fs::absolute(ws.dir / "shards").lexically_normal().string();
  CHECK_THAT(r.output, Catch::Contains("WARNING the training data changed since the checkpoint, under the same data.train:\n"
                                       "    " + shards + "/b.bin had 5000 tokens, now 4000\n"
                                       "    " + shards + "/c.bin is new (3000 tokens)\n") &&
                           Catch::Contains("from sample 24 on, this run reads another order"));
}
