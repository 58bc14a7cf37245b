// What a load says about the changes between the checkpoint and this run: each changed setting
// by name, the next step's learning rate when it moves, and another vocabulary padding
// (model.pad_vocab_to_multiple_of x parallel.tp), which a load re-pads (the padded rows' math is
// test/model/test_padded_vocab.cpp; under other TP degrees, test/multirank/test_layouts.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>

#include "common/checkpoint_meta.h"
#include "common/process.h"
#include "common/workspace.h"

using namespace keel;
namespace fs = std::filesystem;

// Vocabulary padding (model.vocab_size rounded up by model.pad_vocab_to_multiple_of x
// parallel.tp) changes with the layout; a load under another one takes the real rows and zeroes
// the padding. The padded rows are no token's (their logits get -inf), so the padded model
// computes the unpadded one's losses and real gradients bit for bit (test_padded_vocab.cpp) and
// its padding rows, zero, never move: the runs below train the same losses to the bit.
TEST_CASE("finetuning (--init-from) from a checkpoint padded otherwise loads the real rows, zeroes the padding, and trains the same losses",
          "[ckpt][cli][vocab]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 3}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --steps 2").code == 0);
  auto finetune = [&](const std::string& name, const std::string& from, const std::string& extra) {
    const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / name) +
                                                 " --init-from " + from + " " + extra);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("restart verification passed"));
    return std::make_pair(r.output, test::losses_by_step(test::read_metrics(ws.dir / (name + "/metrics.jsonl"))));
  };
  const auto plain = finetune("plain", out + "/checkpoints", "");
  CHECK(plain.first.find("pads the vocabulary") == std::string::npos);
  REQUIRE(plain.second.size() == 3);
  // 64 rows -> 96 (a multiple of 48): rows 64..95 added, zero.
  const auto padded = finetune("padded", out + "/checkpoints", "--set model.pad_vocab_to_multiple_of=48");
  CHECK_THAT(padded.first, Catch::Contains("the checkpoint pads the vocabulary to 64 rows, this run to 96 "
                                           "(model.vocab_size 64, model.pad_vocab_to_multiple_of 48 x parallel.tp 1): "
                                           "lm_head and tok_embed loaded with their 64 real rows in every state, the "
                                           "padding rows zero"));
  CHECK(padded.second == plain.second);
  // And back: 96 rows -> 64 (the padding rows dropped; keel's init and the load left them zero).
  const auto back = finetune("back", ws.dir / "padded/checkpoints", "");
  CHECK_THAT(back.first, Catch::Contains("pads the vocabulary to 96 rows, this run to 64"));
  CHECK(back.first.find("were not zero") == std::string::npos);
  const auto cont = finetune("cont", ws.dir / "padded/checkpoints", "--set model.pad_vocab_to_multiple_of=48");
  CHECK(back.second == cont.second);
}

TEST_CASE("a resume under another model.pad_vocab_to_multiple_of continues bit for bit, naming the change",
          "[ckpt][cli][vocab][resume]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 4}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "straight") + " -q").code == 0);
  const auto straight = test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl"));
  REQUIRE(straight.size() == 4);
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 2").code == 4);
  const test::ProcessResult r =
      test::run_keel("train --config " + ws.config + " --out " + out + " --set model.pad_vocab_to_multiple_of=40");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("model.pad_vocab_to_multiple_of: 1 -> 40") &&
                           Catch::Contains("pads the vocabulary to 64 rows, this run to 80") &&
                           Catch::Contains("restart verification passed"));
  CHECK(test::losses_by_step(test::read_metrics(out + "/metrics.jsonl")) == straight);
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
                           Catch::Contains("the learning rate of step 6 changes from ") &&
                           !Catch::Contains("another order"));
  // Another seed: the order of the samples changes from the resumed one on, and that is said.
  const test::ProcessResult seed = test::run_keel("train --config " + ws.config + " --out " + out +
                                                  " --stop-at 7 --steps 8 --set optimizer.lr=5e-3 --seed 99");
  INFO(seed.output);
  CHECK(seed.code == 4);
  CHECK_THAT(seed.output, Catch::Contains("train.seed: 1 -> 99") &&
                              Catch::Contains("With another train.seed the samples come in another order (other "
                                              "windows) from sample 48 on") &&
                              !Catch::Contains("Validation now reads"));
  // Another micro_batch (for another GPU's memory): the same training, but an evaluation reads
  // eval_batches (2) of the new micro-batches, other windows than before.
  const test::ProcessResult mbs = test::run_keel("train --config " + ws.config + " --out " + out +
                                                 " --stop-at 8 --steps 8 --set optimizer.lr=5e-3 --seed 99" +
                                                 " --set train.micro_batch=2");
  INFO(mbs.output);
  CHECK(mbs.code == 0);
  CHECK_THAT(mbs.output, Catch::Contains("train.micro_batch: 4 -> 2") &&
                             Catch::Contains("Validation now reads the first 4 windows of each set (train.eval_batches "
                                             "x train.micro_batch), not 8: validation losses before and after this "
                                             "resume are not comparable") &&
                             Catch::Contains("validation: 124 windows, 4 of them per evaluation (train.eval_batches 2 "
                                             "x train.micro_batch 2)"));
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

// A shard rewritten with the same length (re-tokenized, reshuffled) keeps its token count, so
// only its content fingerprint (data/checksum.h: blocks at the start, middle and end) shows it.
// A checkpoint from before fingerprints has none to compare: such a resume stays quiet.
TEST_CASE("a resume names a training file rewritten with the same length and stays quiet for a checkpoint without fingerprints",
          "[ckpt][cli][resume][data]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 6}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  fs::create_directories(ws.dir / "shards");
  const std::vector<uint32_t> a = test::synthetic_tokens(5000, 1), b = test::synthetic_tokens(200000, 2);
  data::write_llmc_shard(ws.dir / "shards/a.bin", a, false);
  data::write_llmc_shard(ws.dir / "shards/b.bin", b, false);
  const std::string out = ws.dir / "run";
  const std::string set = " --set 'data.train=[\"" + (ws.dir / "shards") + "/*.bin\"]'";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + set + " -q --stop-at 2").code == 4);
  const nlohmann::json meta = nlohmann::json::parse(test::read_file(out + "/checkpoints/step_00000002/meta.json"));
  const nlohmann::json& files = meta["data"]["files"][0];
  REQUIRE(files.size() == 2);
  for (const auto& f : files) CHECK(f["fingerprint"].get<std::string>().size() == 8);

  // One token in the middle of b (the 1024-byte header, then 2 bytes a token) changes.
  std::vector<uint32_t> b2 = b;
  const size_t middle = (1024 + 2 * b.size()) / 2;
  b2[(middle - 1024) / 2] = (b2[(middle - 1024) / 2] + 1) % 64;
  data::write_llmc_shard(ws.dir / "shards/b.bin", b2, false);
  const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + out + set + " --stop-at 3");
  INFO(r.output);
  CHECK(r.code == 4);
  const std::string shards = fs::absolute(ws.dir / "shards").lexically_normal().string();
  CHECK_THAT(r.output, Catch::Contains("WARNING the training data changed since the checkpoint, under the same data.train:\n"
                                       "    " + shards + "/b.bin was rewritten: the same 200000 tokens, other content "
                                       "(fingerprint " + files[1]["fingerprint"].get<std::string>() + ", now ") &&
                           !Catch::Contains("a.bin"));

  // The step-3 checkpoint as an older keel saved it: no fingerprints. a.bin rewritten in place.
  test::edit_checkpoint_meta(out + "/checkpoints/step_00000003", [](nlohmann::json& m) {
    for (auto& f : m["data"]["files"][0]) f.erase("fingerprint");
  });
  std::vector<uint32_t> a2 = a;
  std::reverse(a2.begin(), a2.end());
  data::write_llmc_shard(ws.dir / "shards/a.bin", a2, false);
  const test::ProcessResult old = test::run_keel("train --config " + ws.config + " --out " + out + set + " --stop-at 4");
  INFO(old.output);
  CHECK(old.code == 4);
  CHECK(old.output.find("training data changed") == std::string::npos);
}

// --init-from checks the tensors' shapes; the model fields that change no shape (rope_theta,
// norm_eps, n_heads at the same widths) make the same weights compute another function. Each is
// named with both values (a warning: a new rope_theta can be a deliberate context extension);
// max_seq_len, a limit and no part of the function, gets a note. --eval-only loads the same way.
TEST_CASE("an --init-from warns of each model field that changes the function but not the shapes", "[ckpt][cli][finetune]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 2}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q").code == 0);
  auto finetune = [&](const std::string& name, const std::string& extra) {
    const test::ProcessResult r = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / name) +
                                                 " -q --init-from " + out + "/checkpoints " + extra);
    INFO(r.output);
    CHECK(r.code == 0);
    return r.output;
  };
  const std::string same = finetune("same", "");
  CHECK_THAT(same, Catch::Contains("initialised from ") && !Catch::Contains("WARNING model.") &&
                       !Catch::Contains("NOTE: the checkpoint was trained with") &&
                       Catch::Contains("probe loss and per-tensor norms as saved"));
  CHECK_THAT(finetune("theta", "--set model.rope_theta=500000"),
             Catch::Contains("WARNING model.rope_theta: the checkpoint was trained with 10000.0, this run uses "
                             "500000.0. The tensors keep their shapes, so the weights load, but this run computes "
                             "another function of them than the one they were trained as: unless that is meant (a "
                             "context extension), --set model.rope_theta=10000.0 as the checkpoint has it"));
  CHECK_THAT(finetune("eps", "--set model.norm_eps=1e-6"),
             Catch::Contains("WARNING model.norm_eps: the checkpoint was trained with 1e-05, this run uses 1e-06.") &&
                 Catch::Contains("unless that is meant, --set model.norm_eps=1e-05 as the checkpoint has it"));
  // 8 heads of 4 instead of 4 of 8, 4 kv heads of 4 instead of 2 of 8: every matrix keeps its shape.
  const std::string heads = finetune("heads", "--set model.n_heads=8 --set model.n_kv_heads=4");
  CHECK_THAT(heads, Catch::Contains("WARNING model.n_heads: the checkpoint was trained with 4, this run uses 8.") &&
                        Catch::Contains("WARNING model.n_kv_heads: the checkpoint was trained with 2, this run uses 4.") &&
                        // Another function: the probe loss is another (restart verification checks the weights only).
                        Catch::Contains("computes another function of the weights than the checkpoint's (model.n_heads, "
                                        "model.n_kv_heads): the probe batch's loss is not compared") &&
                        Catch::Contains("restart verification passed: masters consistent with the weights, per-tensor "
                                        "norms as saved"));
  const std::string longer = finetune("longer", "--set model.max_seq_len=64");
  CHECK_THAT(longer, Catch::Contains("; NOTE: the checkpoint was trained with model.max_seq_len 32, this run allows 64") &&
                         !Catch::Contains("WARNING model.") && Catch::Contains("probe loss and per-tensor norms as saved"));
  // --eval-only from the same weights says the same (and writes nothing).
  const test::ProcessResult eval = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "eval") +
                                                  " --eval-only --init-from " + out + "/checkpoints --set model.rope_theta=500000");
  INFO(eval.output);
  CHECK(eval.code == 0);
  CHECK_THAT(eval.output, Catch::Contains("WARNING model.rope_theta: the checkpoint was trained with 10000.0"));
  // A shape that changes is still refused, naming the tensor.
  const test::ProcessResult wider = test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "wider") +
                                                   " -q --init-from " + out + "/checkpoints --set model.ffn_hidden=96");
  CHECK(wider.code == 5);
}

// A resume under another data.train lists the change with the other settings; the files it
// resolves to differ then of course, and the warning about them must not claim the same data.train.
TEST_CASE("a resume under another data.train says so in the training-data warning", "[ckpt][cli][resume][data]") {
  test::Workspace ws(nlohmann::json{{"train", {{"steps", 6}, {"eval_interval", 0}}}, {"schedule", {{"warmup_steps", 1}}}});
  data::write_llmc_shard(ws.dir / "other.bin", test::synthetic_tokens(6000, 5), false);
  const std::string out = ws.dir / "run";
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + out + " -q --stop-at 2").code == 4);
  const std::string a = fs::absolute(ws.dir / "train.bin").lexically_normal().string();
  const std::string b = fs::absolute(ws.dir / "other.bin").lexically_normal().string();
  const test::ProcessResult r =
      test::run_keel("train --config " + ws.config + " --out " + out + " --stop-at 3 --set data.train=" + b);
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("data.train.0: \"" + a + "\" -> \"" + b + "\"") &&
                           Catch::Contains("WARNING the training data changed since the checkpoint: data.train is not "
                                           "the checkpoint's (above), and the files it resolves to differ:\n") &&
                           Catch::Contains(b + " is new (6000 tokens)") && !Catch::Contains("under the same data.train"));

  // The same file copied elsewhere (data staged to another filesystem): a note that the order
  // continues, no warning, and the steps are those of the run that did not move it.
  fs::create_directories(ws.dir / "staged");
  fs::copy_file(ws.dir / "train.bin", ws.dir / "staged/train.bin");
  const std::string staged = fs::absolute(ws.dir / "staged/train.bin").lexically_normal().string();
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "straight") + " -q").code == 0);
  REQUIRE(test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "moved") + " -q --stop-at 2").code == 4);
  const test::ProcessResult m =
      test::run_keel("train --config " + ws.config + " --out " + (ws.dir / "moved") + " --set data.train=" + staged);
  INFO(m.output);
  CHECK(m.code == 0);
  CHECK_THAT(m.output, Catch::Contains("data.train's files moved since the checkpoint: the same 1 file(s) at other paths") &&
                           !Catch::Contains("WARNING the training data changed"));
  CHECK(test::losses_by_step(test::read_metrics(ws.dir / "moved/metrics.jsonl")) ==
        test::losses_by_step(test::read_metrics(ws.dir / "straight/metrics.jsonl")));
}
