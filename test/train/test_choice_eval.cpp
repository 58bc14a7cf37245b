// keel eval's multiple-choice scoring (train/choice_eval.h) against HF in float64
// (scripts/make_hf_fixtures.py): text items through keel's tokenizer for the fortunes-trained
// tiny Llama, token-id items (endings of 1 to 6 tokens) for the tiny GPT-2.
//
// Tolerance: each ending's log-likelihood within 1e-4 absolute of HF's float64 value. keel's fp32
// logits are within ~1e-6 relative of HF's (test_hf_convert); a log-likelihood sums up to ~30
// log-softmax terms of magnitude up to ~10, so a few 1e-5 is the fp32 floor. The picks must be
// HF's exactly (the fixture's smallest gap between the top two endings is > 1e-3).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "common/error_of.h"
#include "common/fixture.h"
#include "common/temp_dir.h"
#include "train/choice_eval.h"
#include "train/config.h"
#include "train/hf_format.h"

using namespace keel;
namespace fs = std::filesystem;
using json = nlohmann::json;
using test::error_of;

namespace {

const std::string kHf = test::hf_fixture_dir();

}  // namespace

TEST_CASE("keel eval scores multiple-choice endings as HF does (text and token-id items)", "[eval]") {
  for (const std::string model : {"llama_trained", "gpt2_tied"}) {
    SECTION(model) {
      const json e = test::hf_expected("choices_" + model).meta;
      const HfCheckpoint hf = HfCheckpoint::open(kHf + model);
      const ParamTable table(hf.model());
      std::vector<float> w(static_cast<size_t>(table.local_numel()));
      for (const ParamSpec& p : table.params()) hf.read_full(p.name, p.shape, DType::F32, w.data() + p.offset);
      auto be = make_cpu_backend();
      Generator gen(table, *be, Tensor(w.data(), DType::F32, {table.local_numel()}), hf.model().max_seq_len);
      const data::Tokenizer tok = data::Tokenizer::from_file(kHf + model + "/tokenizer.json");

      const auto items = read_choice_items(kHf + e["file"].get<std::string>(), &tok, hf.model().vocab_size);
      REQUIRE(items.size() == e["items"].size());
      ChoiceTotals totals;
      double worst = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        const json& x = e["items"][i];
        INFO(model << " item " << i);
        CHECK(items[i].context == x["context_ids"].get<std::vector<int32_t>>());
        CHECK(items[i].endings == x["ending_ids"].get<std::vector<std::vector<int32_t>>>());
        const ChoiceScore s = score_choice(gen, items[i]);
        REQUIRE(s.logprob.size() == x["logprob"].size());
        for (size_t k = 0; k < s.logprob.size(); ++k) {
          const double d = std::abs(s.logprob[k] - x["logprob"][k].get<double>());
          worst = std::max(worst, d);
          CHECK(d <= 1e-4);
        }
        CHECK(s.pick == x["pick"].get<int>());
        CHECK(s.pick_per_token == x["pick_per_token"].get<int>());
        CHECK(s.pick_per_byte == x.value("pick_per_byte", -1));
        totals.add(items[i], s);
      }
      WARN(model << ": worst log-likelihood difference from HF float64 " << worst);
      CHECK(static_cast<double>(totals.correct) / totals.items == e["acc"].get<double>());
      CHECK(totals.chance == Approx(items.size() * 0.25));
    }
  }
}

TEST_CASE("keel eval: a bad choice file names the file, the line and the field", "[eval]") {
  test::TempDir tmp("choices");
  const data::Tokenizer tok = data::Tokenizer::from_file(kHf + "gpt2_tied/tokenizer.json");
  auto error_for = [&](const std::string& lines) {
    const std::string path = tmp / "c.jsonl";
    std::ofstream(path) << lines;
    return error_of([&] { read_choice_items(path, &tok, 300); });
  };
  const std::string ok = R"({"context": "a b", "endings": [" c", " d"], "label": 1})";
  CHECK(error_for(ok + "\n\n" + ok + "\n") == "no error");
  CHECK_THAT(error_for(ok + "\n" + R"({"context": "a", "endings": [" c", " d"], "label": 2})"),
             Catch::Contains("c.jsonl:2: label 2 is not an ending index (0 .. 1)"));
  CHECK_THAT(error_for(R"({"context": "a", "endings": [" c"], "label": 0})"),
             Catch::Contains("c.jsonl:1: 1 ending(s); an item needs at least 2"));
  CHECK_THAT(error_for(R"({"context": "a", "endings": [" c", " d"]})"), Catch::Contains("c.jsonl:1: \"label\""));
  CHECK_THAT(error_for(R"({"prompt": "a"})"), Catch::Contains("needs \"context\" (a string) and \"endings\""));
  CHECK_THAT(error_for(R"({"context_ids": [1, 300], "ending_ids": [[2], [3]], "label": 0})"),
             Catch::Contains("c.jsonl:1 context_ids: 300 is not a token id of the model (0 .. 299)"));
  CHECK_THAT(error_for(R"({"context_ids": [1], "ending_ids": [[2], []], "label": 0})"),
             Catch::Contains("ending 1 has no tokens"));
  CHECK_THAT(error_for("not json"), Catch::Contains("c.jsonl:1 is not a JSON object"));
  CHECK_THAT(error_for("\n"), Catch::Contains("holds no items"));
  CHECK_THAT(error_of([&] { read_choice_items(tmp / "missing.jsonl", &tok, 300); }), Catch::Contains("cannot be read"));
  std::ofstream(tmp / "t.jsonl") << ok;
  CHECK_THAT(error_of([&] { read_choice_items(tmp / "t.jsonl", nullptr, 300); }), Catch::Contains("needs the model's tokenizer"));
}
