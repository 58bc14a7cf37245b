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
#include "common/hf_weights.h"
#include "common/run_config.h"
#include "common/temp_dir.h"
#include "train/choice_eval.h"
#include "train/config.h"
#include "train/hf_format.h"
#include "train/trainer.h"

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
      std::vector<float> w = test::hf_weights(hf, table);
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
  CHECK_THAT(error_for(R"({"context": "a", "endings": [" c", " d"]})"),
             Catch::Contains("c.jsonl:1: \"label\" (the index of the right ending) is missing"));
  // Present but not an integer: said so, not "missing".
  CHECK_THAT(error_for(R"({"context": "a", "endings": [" c", " d"], "label": "0"})"),
             Catch::Contains("c.jsonl:1: \"label\" must be an integer, the index of the right ending (0 for the first); "
                             "got \"0\"") &&
                 !Catch::Contains("missing"));
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

TEST_CASE("keel eval: an ending's tokens are those of context + ending encoded as one text", "[eval]") {
  test::TempDir tmp("choices");
  auto items_of = [&](const data::Tokenizer& tok, const json& item) {
    const std::string path = tmp / "c.jsonl";
    std::ofstream(path) << item.dump() << "\n";
    return read_choice_items(path, &tok, tok.vocab_size());
  };
  auto tokens = [](const data::Tokenizer& tok, const std::vector<int32_t>& ids) {
    std::vector<std::string> t;
    for (int32_t id : ids) t.push_back(tok.id_to_token(id));
    return t;
  };
  auto joined = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };

  SECTION("SentencePiece-style tokenizer: no second \"▁\" before the ending") {
    // Llama 2's Prepend("▁") normalizer marks the start of every text it encodes, so " 4" on its
    // own is "▁" "▁" "4": scoring that would score a text with two spaces.
    const data::Tokenizer tok = data::Tokenizer::from_file(kHf + "llama_trained/tokenizer.json");
    const std::string context = "Q: 2+2?\nA:";
    const auto items = items_of(tok, {{"context", context}, {"endings", {" 4", " 5"}}, {"label", 0}});
    REQUIRE(items.size() == 1);
    CHECK(items[0].context == tok.encode(context, true));
    CHECK(tokens(tok, items[0].endings[0]) == std::vector<std::string>{"▁", "4"});
    CHECK(tokens(tok, tok.encode(" 4", false)) == std::vector<std::string>{"▁", "▁", "4"});
    for (size_t e = 0; e < 2; ++e)
      CHECK(joined(items[0].context, items[0].endings[e]) == tok.encode(context + (e ? " 5" : " 4"), true));
    CHECK(items[0].ending_bytes == std::vector<int64_t>{2, 2});
  }

  SECTION("a token straddling the join: the context stops before it, and it counts as every ending's") {
    const data::Tokenizer tok = data::Tokenizer::from_file(test::fixture_dir() + "/tokenizers/gpt2.json");
    const auto items = items_of(tok, {{"context", "Q: the"}, {"endings", {"re is", " is"}}, {"label", 0}});
    REQUIRE(items.size() == 1);
    CHECK(tokens(tok, items[0].context) == std::vector<std::string>{"Q", ":"});
    CHECK(tokens(tok, items[0].endings[0]) == std::vector<std::string>{"Ġthere", "Ġis"});
    CHECK(tokens(tok, items[0].endings[1]) == std::vector<std::string>{"Ġthe", "Ġis"});
    CHECK(joined(items[0].context, items[0].endings[0]) == tok.encode("Q: there is", true));
    CHECK(joined(items[0].context, items[0].endings[1]) == tok.encode("Q: the is", true));
    CHECK(items[0].ending_bytes == std::vector<int64_t>{5, 3});  // the endings' own text
    // A context whose only token merges into an ending leaves nothing for the ending to follow.
    CHECK_THAT(error_of([&] { items_of(tok, {{"context", " the"}, {"endings", {"re", " x"}}, {"label", 0}}); }),
               Catch::Contains("c.jsonl:1: the context's first token merges with the start of an ending"));
  }
}

// ---- In-training scoring: the endings as rows of micro-batches through Trainer's forward ----

namespace {

// A single-process fp32 Trainer holding the HF fixture's weights, micro_batch rows of seq_len.
struct HfTrainer {
  HfCheckpoint hf;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Trainer> tr;
  // pack: the model takes document positions (as with choice_eval set), so several endings
  // share a row; else one ending per row.
  HfTrainer(const std::string& model, int64_t micro_batch, int64_t seq_len, bool pack = false)
      : hf(HfCheckpoint::open(kHf + model)) {
    RunConfig cfg = test::make_config(test::tiny_run_json());
    cfg.model = hf.model();
    if (pack) cfg.choice_eval.file = "items.jsonl";
    cfg.train.micro_batch = micro_batch;
    cfg.train.global_batch = micro_batch;
    cfg.train.seq_len = seq_len;
    tr = std::make_unique<Trainer>(cfg, *be);
    tr->state().load_fp32(test::hf_weights(hf, tr->table()).data());
  }
};

}  // namespace

TEST_CASE("in-training choice scoring (endings packed in micro-batch rows) gives HF's log-likelihoods",
          "[eval][choice_train]") {
  // Same fixtures and tolerance as keel eval's test above. One ending per row, and packed (each
  // ending its own document of the row); micro_batch 3, so endings of one item straddle
  // micro-batches and the last micro-batch has padding rows.
  for (const std::string model : {"llama_trained", "gpt2_tied"})
  for (const bool pack : {false, true}) {
    SECTION(model + (pack ? " packed" : " one per row")) {
      const json e = test::hf_expected("choices_" + model).meta;
      const data::Tokenizer tok = data::Tokenizer::from_file(kHf + model + "/tokenizer.json");
      const auto items = read_choice_items(kHf + e["file"].get<std::string>(), &tok,
                                           HfCheckpoint::open(kHf + model).model().vocab_size);
      int64_t longest = 0;
      for (const ChoiceItem& it : items)
        for (const auto& end : it.endings)
          longest = std::max<int64_t>(longest, static_cast<int64_t>(it.context.size() + end.size()) - 1);
      const std::vector<ChoicePlace> places = place_choices(items, longest, pack);
      const int64_t rows = places.back().row + 1;
      if (pack) CHECK(rows < static_cast<int64_t>(places.size()));  // some rows hold two endings
      else CHECK(rows == static_cast<int64_t>(places.size()));
      HfTrainer t(model, 3, longest, pack);  // every ending fits without cutting the context
      CHECK(t.tr->model().document_masking() == pack);
      REQUIRE(choice_contexts_cut(items, longest) == 0);
      REQUIRE(choice_contexts_cut(items, longest - 1) > 0);
      const std::vector<ChoiceScore> scores = score_choices(*t.tr, items);
      REQUIRE(scores.size() == items.size());
      double worst = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        const json& x = e["items"][i];
        INFO(model << " item " << i);
        REQUIRE(scores[i].logprob.size() == x["logprob"].size());
        for (size_t k = 0; k < scores[i].logprob.size(); ++k) {
          const double d = std::abs(scores[i].logprob[k] - x["logprob"][k].get<double>());
          worst = std::max(worst, d);
          CHECK(d <= 1e-4);
        }
        CHECK(scores[i].pick == x["pick"].get<int>());
        CHECK(scores[i].pick_per_token == x["pick_per_token"].get<int>());
        CHECK(scores[i].pick_per_byte == x.value("pick_per_byte", -1));
      }
      WARN(model << (pack ? " (in training, packed)" : " (in training)")
                 << ": worst log-likelihood difference from HF float64 " << worst);
    }
  }
}

TEST_CASE("in-training choice sequences: layout, contexts cut from the front, endings too long", "[eval][choice_train]") {
  ChoiceItem item;
  item.context = {5, 6, 7, 8};
  item.endings = {{10, 11}, {20, 21, 22}};
  item.line = 7;
  std::vector<int32_t> in(8, 99), tg(8, 99);
  // Everything fits: inputs ctx ++ ending minus its last token, targets only the ending's tokens.
  CHECK(choice_sequence(item, 1, 8) == 6);
  CHECK(choice_sequence(item, 1, 8, in.data(), tg.data()) == 6);
  CHECK(in == std::vector<int32_t>{5, 6, 7, 8, 20, 21, 99, 99});  // only its 6 entries written
  CHECK(tg == std::vector<int32_t>{-1, -1, -1, 20, 21, 22, 99, 99});
  // seq_len 4: ending 1 keeps the last 2 context tokens, ending 0 the last 3.
  CHECK(choice_sequence(item, 1, 4, in.data(), tg.data()) == 4);
  CHECK(std::vector<int32_t>(in.begin(), in.begin() + 4) == std::vector<int32_t>{7, 8, 20, 21});
  CHECK(std::vector<int32_t>(tg.begin(), tg.begin() + 4) == std::vector<int32_t>{-1, 20, 21, 22});
  CHECK(choice_sequence(item, 0, 4, in.data(), tg.data()) == 4);
  CHECK(std::vector<int32_t>(in.begin(), in.begin() + 4) == std::vector<int32_t>{6, 7, 8, 10});
  CHECK(std::vector<int32_t>(tg.begin(), tg.begin() + 4) == std::vector<int32_t>{-1, -1, 10, 11});
  // Packing in order, as many as fit (lengths 5 and 6, twice); never reordered to fill a gap.
  const std::vector<ChoiceItem> two = {item, item};
  auto rows_offsets = [](const std::vector<ChoicePlace>& places) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const ChoicePlace& p : places) out.emplace_back(p.row, p.offset);
    return out;
  };
  using RO = std::vector<std::pair<int64_t, int64_t>>;
  CHECK(rows_offsets(place_choices(two, 12, true)) == RO{{0, 0}, {0, 5}, {1, 0}, {1, 5}});
  CHECK(rows_offsets(place_choices(two, 4, true)) == RO{{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  CHECK(rows_offsets(place_choices(two, 11, true)) == RO{{0, 0}, {0, 5}, {1, 0}, {1, 5}});
  CHECK(rows_offsets(place_choices(two, 10, true)) == RO{{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  CHECK(rows_offsets(place_choices(two, 12, false)) == RO{{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  CHECK(choice_contexts_cut({item}, 6) == 0);  // 4 + 3 tokens: 6 inputs
  CHECK(choice_contexts_cut({item}, 5) == 1);
  CHECK(error_of([&] { check_choices_fit({item}, 3, "c.jsonl"); }) == "no error");
  CHECK_THAT(error_of([&] { check_choices_fit({item}, 2, "c.jsonl"); }),
             Catch::Contains("c.jsonl:7 ending 1 has 3 tokens, more than train.seq_len (2)"));
}

TEST_CASE("in-training choice scoring with cut contexts equals scoring the cut items whole", "[eval][choice_train]") {
  // seq_len 10 cuts most fortunes' contexts; each ending must score as if its item's context
  // were only the tokens its sequence keeps (the Generator, with no cut, is the reference).
  // Packed: short sequences share rows.
  const std::string model = "llama_trained";
  const data::Tokenizer tok = data::Tokenizer::from_file(kHf + model + "/tokenizer.json");
  const int64_t T = 10;
  HfTrainer t(model, 4, T, /*pack=*/true);
  auto items = read_choice_items(kHf + "choices/fortunes.jsonl", &tok, t.hf.model().vocab_size);
  items.resize(6);
  for (ChoiceItem& it : items)  // endings within seq_len
    for (auto& end : it.endings) end.resize(std::min<size_t>(end.size(), 6));
  REQUIRE(choice_contexts_cut(items, T) == 6);
  const std::vector<ChoiceScore> scores = score_choices(*t.tr, items);
  const ParamTable& table = t.tr->table();
  std::vector<float> w(static_cast<size_t>(table.local_numel()));
  t.tr->state().working_to_host(w.data());
  Generator gen(table, *t.be, Tensor(w.data(), DType::F32, {table.local_numel()}), static_cast<int>(T));
  double worst = 0;
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t e = 0; e < items[i].endings.size(); ++e) {
      ChoiceItem cut = items[i];
      const size_t keep = std::min(cut.context.size(), static_cast<size_t>(T) + 1 - cut.endings[e].size());
      cut.context.erase(cut.context.begin(), cut.context.end() - static_cast<std::ptrdiff_t>(keep));
      cut.endings = {items[i].endings[e], items[i].endings[e]};
      const double ref = score_choice(gen, cut).logprob[0];
      INFO("item " << i << " ending " << e << ": " << scores[i].logprob[e] << " vs " << ref);
      worst = std::max(worst, std::abs(scores[i].logprob[e] - ref));
      CHECK(std::abs(scores[i].logprob[e] - ref) <= 1e-4);
    }
  WARN("cut contexts: worst difference from the Generator " << worst);
}
