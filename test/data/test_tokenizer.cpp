// keel's C++ tokenizer against the HF `tokenizers` library: the fixtures of
// scripts/make_tokenizer_fixtures.py hold eight tokenizer.json files (GPT-2 / Llama 3 /
// RoBERTa-style byte-level BPE, Llama 2-style SentencePiece BPE with byte fallback, its
// Metaspace variant, and three that exercise the remaining components) and the ids and texts
// HF produced for ~280 strings (multilingual text, emoji, digits, whitespace runs, code,
// special tokens inside text). Encode and decode must agree exactly.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/regex.h"
#include "data/tokenizer.h"
#include "data/unicode.h"
#include "data/token_file.h"

using namespace keel::data;

namespace {

const std::string kDir = std::string(KEEL_FIXTURE_DIR) + "/tokenizers/";

const nlohmann::json& cases() {
  static const nlohmann::json j = [] {
    std::ifstream in(kDir + "cases.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::string show(const std::vector<int32_t>& ids) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? ", " : "") << ids[i];
  return s.str() + "]";
}

void check_tokenizer(const std::string& name) {
  const auto& c = cases()["tokenizers"][name];
  const auto& strings = cases()["strings"];
  Tokenizer tok = Tokenizer::from_file(kDir + c["file"].get<std::string>());
  CHECK(tok.vocab_size() == c["vocab_size"].get<int64_t>());
  int encode_failures = 0, decode_failures = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const std::string s = strings[i].get<std::string>();
    const auto want = c["encode"][i].get<std::vector<int32_t>>();
    const auto got = tok.encode(s, false);
    if (got != want && ++encode_failures <= 5) {
      INFO(name << " string #" << i << " " << nlohmann::json(s).dump() << "\n  HF:   " << show(want) << "\n  keel: " << show(got));
      CHECK(got == want);
    }
    const std::string want_text = c["decode"][i].get<std::string>();
    const std::string text = tok.decode(want, false);
    if (text != want_text && ++decode_failures <= 5) {
      INFO(name << " decode of string #" << i << " ids " << show(want));
      CHECK(nlohmann::json(text).dump() == nlohmann::json(want_text).dump());
    }
  }
  CHECK(encode_failures == 0);
  CHECK(decode_failures == 0);

  for (size_t i = 0; i < c["encode_special"].size(); ++i) {
    const std::string s = strings[i].get<std::string>();
    const auto want = c["encode_special"][i].get<std::vector<int32_t>>();
    INFO(name << " with special tokens, string #" << i << " " << nlohmann::json(s).dump());
    CHECK(show(tok.encode(s, true)) == show(want));
    CHECK(nlohmann::json(tok.decode(want, true)).dump() == nlohmann::json(c["decode_skip"][i].get<std::string>()).dump());
  }
  for (size_t i = 0; i < c["random_ids"].size(); ++i) {
    const auto ids = c["random_ids"][i].get<std::vector<int32_t>>();
    INFO(name << " decode of random ids " << show(ids));
    CHECK(nlohmann::json(tok.decode(ids, false)).dump() ==
          nlohmann::json(c["random_decode"][i].get<std::string>()).dump());
  }
}

}  // namespace

TEST_CASE("tokenizer: GPT-2 style byte-level BPE matches HF tokenizers", "[tokenizer]") { check_tokenizer("gpt2"); }
TEST_CASE("tokenizer: Llama 3 style byte-level BPE (Split regex, ignore_merges) matches HF", "[tokenizer]") {
  check_tokenizer("llama3");
}
TEST_CASE("tokenizer: byte-level BPE with add_prefix_space and RobertaProcessing matches HF", "[tokenizer]") {
  check_tokenizer("roberta");
}
TEST_CASE("tokenizer: Llama 2 style SentencePiece BPE with byte fallback matches HF", "[tokenizer]") {
  check_tokenizer("llama2");
}
TEST_CASE("tokenizer: Metaspace pre-tokenizer and decoder match HF", "[tokenizer]") { check_tokenizer("metaspace"); }
TEST_CASE("tokenizer: every Split behaviour, Digits, Strip and regex Replace match HF", "[tokenizer]") {
  check_tokenizer("splits");
}
TEST_CASE("tokenizer: <unk> without byte fallback, Metaspace with split, Whitespace, no decoder match HF",
          "[tokenizer]") {
  check_tokenizer("metaspace_unk");
  check_tokenizer("whitespace");
}

TEST_CASE("tokenizer: unsupported components and bad input give errors that name them", "[tokenizer]") {
  std::ifstream in(kDir + "gpt2.json");
  nlohmann::json doc = nlohmann::json::parse(in);
  auto error_of = [](const nlohmann::json& d) {
    try {
      Tokenizer::from_json(d.dump(), "my/tokenizer.json");
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json d = doc;
  d["normalizer"] = {{"type", "NFKC"}};
  CHECK_THAT(error_of(d), Catch::Contains("my/tokenizer.json") && Catch::Contains("normalizer \"NFKC\""));
  d = doc;
  d["model"]["type"] = "Unigram";
  CHECK_THAT(error_of(d), Catch::Contains("model type \"Unigram\""));
  d = doc;
  d["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(?<=a)b"}}}, {"behavior", "Isolated"}, {"invert", false}};
  CHECK_THAT(error_of(d), Catch::Contains("lookbehind"));
  d = doc;
  d["model"]["merges"].push_back(nlohmann::json::array({"zzzq", "xxq"}));
  CHECK_THAT(error_of(d), Catch::Contains("zzzq xxq") && Catch::Contains("not in the vocabulary"));
  CHECK_THROWS_AS(Tokenizer::from_file("/nonexistent/tokenizer.json"), DataError);

  Tokenizer tok = Tokenizer::from_json(doc.dump());
  CHECK_THROWS_WITH(tok.encode("bad \xff utf8"), Catch::Contains("not valid UTF-8") && Catch::Contains("byte 4"));
}

TEST_CASE("regex: Oniguruma semantics of the pre-tokenizer patterns", "[tokenizer]") {
  auto split = [](const char* pattern, const std::u32string& text) {
    Regex re(pattern);
    std::vector<std::u32string> out;
    for (auto [b, e] : re.find_all(text)) out.push_back(text.substr(b, e - b));
    return out;
  };
  // \s+(?!\S) leaves the last space of a run for the next word.
  CHECK(split(R"( ?\p{L}+|\s+(?!\S)|\s+)", U"a   b") == std::vector<std::u32string>{U"a", U"  ", U" b"});
  // case-insensitive contractions, {1,3} digit groups, lazy and possessive quantifiers
  CHECK(split(R"((?i:'s|'ll)|\p{N}{1,3})", U"IT'S 12345 WE'LL") == std::vector<std::u32string>{U"'S", U"123", U"45", U"'LL"});
  CHECK(split(R"(a+?)", U"aaa") == std::vector<std::u32string>{U"a", U"a", U"a"});
  CHECK(split(R"(a++a|b)", U"aaab") == std::vector<std::u32string>{U"b"});
  CHECK(split(R"([^\s\p{L}]+)", U"héllo, wörld!!") == std::vector<std::u32string>{U",", U"!!"});
  CHECK_THROWS_AS(Regex("(?<name>x)"), std::invalid_argument);
  CHECK_THROWS_AS(Regex("\\bword"), std::invalid_argument);
  CHECK_THROWS_AS(Regex("(unclosed"), std::invalid_argument);
}

TEST_CASE("unicode: categories and white space", "[tokenizer]") {
  using namespace keel::data::unicode;
  CHECK(category(U'a') == Category::Ll);
  CHECK(category(U'Ж') == Category::Lu);
  CHECK(category(U'中') == Category::Lo);
  CHECK(category(U'٣') == Category::Nd);
  CHECK(category(U'Ⅻ') == Category::Nl);
  CHECK(category(U'½') == Category::No);
  CHECK(category(0x301) == Category::Mn);
  CHECK(category(0x1F600) == Category::So);
  CHECK(category(0x10FFFF) == Category::Cn);
  CHECK(is_white_space(0xA0));
  CHECK(is_white_space(0x3000));
  CHECK_FALSE(is_white_space(0x200B));
  CHECK_FALSE(is_white_space(0x1C));
}
