// keel's C++ tokenizer against the HF `tokenizers` library: the fixtures of
// scripts/make_tokenizer_fixtures.py hold ten tokenizer.json files (GPT-2 / Llama 3 / Qwen2 /
// RoBERTa-style byte-level BPE, Llama 2-style SentencePiece BPE with byte fallback, its
// Metaspace variant, and four that exercise the remaining components, NFD and NFKC among them)
// and the ids and texts HF produced for ~300 strings (multilingual text, emoji, digits,
// whitespace runs, code, special tokens inside text, text that normalization changes). Encode
// and decode must agree exactly.
// Unicode normalization (NFC, NFD, NFKC, NFKD) against Python's unicodedata: the fixture of
// scripts/make_unicode_tables.py holds a CRC-32 of every code point normalized alone and a few
// hundred combining sequences with their four forms.
#include <catch2/catch.hpp>

#include <array>
#include <cstdio>
#include <fstream>
#include <map>
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

TEST_CASE("tokenizer: Qwen2 style byte-level BPE (NFC, Qwen2 regex, ChatML tokens) matches HF", "[tokenizer][unicode]") {
  check_tokenizer("qwen2");
}
TEST_CASE("tokenizer: NFD, Replace and NFKC normalizers and normalized added tokens match HF", "[tokenizer][unicode]") {
  check_tokenizer("nfkc");
}

// Documents that mention special tokens ("Use <|endoftext|> to end a document."), encoded as HF
// tokenizers does by default (the token) and with encode_special_tokens (ordinary text), every
// fixture tokenizer (scripts/make_split_special_fixture.py). Ids must be equal, exactly.
TEST_CASE("tokenizer: special-token text in documents matches HF with and without encode_special_tokens",
          "[tokenizer][split_special]") {
  std::ifstream in(kDir + "split_special.json");
  const nlohmann::json fixture = nlohmann::json::parse(in);
  REQUIRE(fixture["tokenizers"].size() == 10);
  for (const auto& [name, c] : fixture["tokenizers"].items()) {
    Tokenizer tok = Tokenizer::from_file(kDir + name + ".json");
    CHECK_FALSE(tok.split_special_tokens());
    const auto& strings = c["strings"];
    REQUIRE(strings.size() > 10);
    int differ = 0;
    for (const std::string key : {"special", "split", "split_bos"}) {
      tok.set_split_special_tokens(key != "special");
      for (size_t i = 0; i < strings.size(); ++i) {
        const std::string s = strings[i].get<std::string>();
        const auto want = c[key][i].get<std::vector<int32_t>>();
        const auto got = tok.encode(s, key == "split_bos");
        INFO(name << " " << key << " string #" << i << " " << nlohmann::json(s).dump() << "\n  HF:   " << show(want)
                  << "\n  keel: " << show(got));
        CHECK(got == want);
        if (key == "split") differ += want != c["special"][i].get<std::vector<int32_t>>();
      }
    }
    CHECK(differ > 0);  // the option changed something for every tokenizer (each has special tokens)
  }
}

// The same strings, with the special tokens kept text by place (encode_with_text_spans, what
// keel tokenize --chat --split-special-tokens uses): the places special_token_spans finds give
// encode_special_tokens' ids, no places the default's; ranges that cover only some of them keep
// only those text, the others are still matched.
TEST_CASE("tokenizer: special tokens kept text by place match HF's encode_special_tokens", "[tokenizer][split_special]") {
  std::ifstream in(kDir + "split_special.json");
  const nlohmann::json fixture = nlohmann::json::parse(in);
  int partial = 0;
  for (const auto& [name, c] : fixture["tokenizers"].items()) {
    const Tokenizer tok = Tokenizer::from_file(kDir + name + ".json");
    const auto& strings = c["strings"];
    for (size_t i = 0; i < strings.size(); ++i) {
      const std::string s = strings[i].get<std::string>();
      INFO(name << " string #" << i << " " << nlohmann::json(s).dump());
      const Tokenizer::Spans spans = tok.special_token_spans(s);
      for (auto [b, e] : spans) CHECK(tok.is_special(*tok.token_to_id(s.substr(b, e - b))));
      CHECK(tok.encode_with_text_spans(s, spans) == c["split"][i].get<std::vector<int32_t>>());
      CHECK(tok.encode_with_text_spans(s, spans, true) == c["split_bos"][i].get<std::vector<int32_t>>());
      CHECK(tok.encode_with_text_spans(s, {}) == c["special"][i].get<std::vector<int32_t>>());
      // The default's ids hold the token of each place.
      const auto special = c["special"][i].get<std::vector<int32_t>>();
      for (auto [b, e] : spans) CHECK(std::count(special.begin(), special.end(), *tok.token_to_id(s.substr(b, e - b))) > 0);
      // (Text kept from the model's <unk> may encode as <unk> again: not counted below.)
      auto is_unk = [&](std::pair<size_t, size_t> sp) { return *tok.token_to_id(s.substr(sp.first, sp.second - sp.first)) == tok.unk_id(); };
      if (spans.size() >= 2 && std::none_of(spans.begin(), spans.end(), is_unk)) {
        // The first place kept text, every other place still its token.
        ++partial;
        const std::vector<int32_t> got = tok.encode_with_text_spans(s, {spans[0]});
        std::map<int32_t, long> want_count;
        for (size_t k = 1; k < spans.size(); ++k) ++want_count[*tok.token_to_id(s.substr(spans[k].first, spans[k].second - spans[k].first))];
        want_count.try_emplace(*tok.token_to_id(s.substr(spans[0].first, spans[0].second - spans[0].first)), 0);
        for (const auto& [id, n] : want_count) CHECK(std::count(got.begin(), got.end(), id) == n);
      }
    }
  }
  CHECK(partial >= 10);
  // Ranges out of order or past the text are a caller's bug, refused.
  const Tokenizer tok = Tokenizer::from_file(kDir + "gpt2.json");
  CHECK_THROWS_AS(tok.encode_with_text_spans("abc", {{2, 3}, {0, 1}}), std::invalid_argument);
  CHECK_THROWS_AS(tok.encode_with_text_spans("abc", {{2, 4}}), std::invalid_argument);
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
  d["normalizer"] = {{"type", "BertNormalizer"}};
  CHECK_THAT(error_of(d), Catch::Contains("my/tokenizer.json") && Catch::Contains("normalizer \"BertNormalizer\"") &&
                              Catch::Contains("NFC, NFD, NFKC, NFKD"));
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

namespace {

using keel::data::unicode::NormalForm;

const nlohmann::json& normalization_fixture() {
  static const nlohmann::json j = [] {
    std::ifstream in(std::string(KEEL_FIXTURE_DIR) + "/unicode/normalization.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

constexpr std::array<std::pair<const char*, NormalForm>, 4> kForms{
    {{"NFC", NormalForm::NFC}, {"NFD", NormalForm::NFD}, {"NFKC", NormalForm::NFKC}, {"NFKD", NormalForm::NFKD}}};

// zlib's CRC-32 (reflected polynomial 0xEDB88320), which the generator takes from Python's zlib.
class Crc32 {
 public:
  void update(std::string_view bytes) {
    static const std::array<uint32_t, 256> table = [] {
      std::array<uint32_t, 256> t{};
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[i] = c;
      }
      return t;
    }();
    for (unsigned char b : bytes) state_ = table[(state_ ^ b) & 0xFFu] ^ (state_ >> 8);
  }
  uint32_t value() const { return ~state_; }

 private:
  uint32_t state_ = 0xFFFFFFFFu;
};

std::string hex_code_points(std::string_view utf8) {
  std::string out;
  for (char32_t c : keel::data::unicode::decode_utf8(utf8)) {
    char buf[12];
    std::snprintf(buf, sizeof buf, "%s%04X", out.empty() ? "" : " ", static_cast<unsigned>(c));
    out += buf;
  }
  return out;
}

// "0065 0301" -> UTF-8
std::string from_hex_code_points(const std::string& hex) {
  std::string out;
  std::istringstream in(hex);
  std::string word;
  while (in >> word) keel::data::unicode::append_utf8(out, static_cast<char32_t>(std::stoul(word, nullptr, 16)));
  return out;
}

}  // namespace

TEST_CASE("unicode: every code point normalized alone matches Python's unicodedata under NFC, NFD, NFKC and NFKD",
          "[tokenizer][unicode]") {
  using namespace keel::data::unicode;
  const auto& fx = normalization_fixture();
  REQUIRE(fx["unicode_version"].get<std::string>() == unicode_version());
  Crc32 check;
  check.update("123456789");
  REQUIRE(check.value() == 0xCBF43926u);  // the CRC-32 check value: the digest is zlib's

  // Per form, per block of code points: the CRC-32 of each code point's normal form followed by
  // 0xFF (never in UTF-8), as scripts/make_unicode_tables.py computes it with unicodedata.
  const auto block = fx["digest_block"].get<uint32_t>();
  for (const auto& [name, form] : kForms) {
    const auto want = fx["digests"][name].get<std::vector<uint32_t>>();
    REQUIRE(want.size() * block == 0x110000);
    std::string bad;
    for (uint32_t b = 0; b < want.size(); ++b) {
      Crc32 crc;
      for (uint32_t c = b * block; c < (b + 1) * block; ++c) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;  // surrogates are not text
        std::string in;
        append_utf8(in, c);
        crc.update(normalize(in, form));
        crc.update("\xFF");
      }
      if (crc.value() != want[b]) {
        char range[40];
        std::snprintf(range, sizeof range, " U+%04X..U+%04X", b * block, (b + 1) * block - 1);
        bad += range;
      }
    }
    INFO(name << " differs from unicodedata in the blocks" << bad);
    CHECK(bad.empty());
  }
}

TEST_CASE("unicode: combining sequences, Hangul jamo, exclusions and compatibility characters match unicodedata",
          "[tokenizer][unicode]") {
  using namespace keel::data::unicode;
  const auto& cases = normalization_fixture()["cases"];
  REQUIRE(cases.size() >= 300);
  // Each case is "source;NFC;NFD;NFKC;NFKD" (c1..c5). Besides the forms of the source, the
  // invariants of Unicode's NormalizationTest.txt: c2 = NFC(c1..c3), c4 = NFC(c4, c5),
  // c3 = NFD(c1..c3), c5 = NFD(c4, c5), c4 = NFKC(c1..c5), c5 = NFKD(c1..c5).
  struct Invariant {
    NormalForm form;
    const char* name;
    size_t want;
    std::vector<size_t> from;  // columns, 0-based
  };
  const std::vector<Invariant> invariants{
      {NormalForm::NFC, "NFC", 1, {0, 1, 2}},
      {NormalForm::NFC, "NFC", 3, {3, 4}},
      {NormalForm::NFD, "NFD", 2, {0, 1, 2}},
      {NormalForm::NFD, "NFD", 4, {3, 4}},
      {NormalForm::NFKC, "NFKC", 3, {0, 1, 2, 3, 4}},
      {NormalForm::NFKD, "NFKD", 4, {0, 1, 2, 3, 4}},
  };
  int failures = 0;
  for (const auto& item : cases) {
    std::array<std::string, 5> c;
    std::istringstream fields(item.get<std::string>());
    for (std::string& x : c) {
      std::string hex;
      std::getline(fields, hex, ';');
      x = from_hex_code_points(hex);
    }
    for (const Invariant& inv : invariants) {
      for (size_t from : inv.from) {
        const std::string got = normalize(c[from], inv.form);
        if (got != c[inv.want] && ++failures <= 10) {
          INFO(inv.name << " of c" << from + 1 << " [" << hex_code_points(c[from]) << "]: want c" << inv.want + 1 << " ["
                        << hex_code_points(c[inv.want]) << "], got [" << hex_code_points(got) << "]");
          CHECK(got == c[inv.want]);
        }
      }
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("unicode: combining classes, the ASCII fast path and invalid UTF-8", "[tokenizer][unicode]") {
  using namespace keel::data::unicode;
  // Every code point's class, one byte each, against the CRC-32 unicodedata.combining gives.
  Crc32 crc;
  for (char32_t c = 0; c <= 0x10FFFF; ++c) crc.update(std::string(1, static_cast<char>(combining_class(c))));
  CHECK(crc.value() == normalization_fixture()["combining_class_crc"].get<uint32_t>());
  CHECK(combining_class(U'a') == 0);
  CHECK(combining_class(0x301) == 230);  // acute above
  CHECK(combining_class(0x316) == 220);  // grave below
  CHECK(combining_class(0x1D16E) == 216);
  CHECK(combining_class(0x10FFFF) == 0);
  const std::string ascii = "plain ASCII text\n\t~";
  for (const auto& [name, form] : kForms) CHECK(normalize(ascii, form) == ascii);
  CHECK(normalize("", NormalForm::NFKC).empty());
  CHECK_THROWS_WITH(normalize("ok \xC3", NormalForm::NFC),
                    Catch::Contains("not valid UTF-8") && Catch::Contains("byte 3"));
}

// encode_joined: a prompt and its response (or a context and an ending) as the tokens of the
// joined text, and where the second part's tokens begin.
TEST_CASE("tokenizer: encode_joined gives the joined text's tokens, a straddling token counted as the second part's",
          "[tokenizer][tokenize]") {
  auto tokens = [](const Tokenizer& tok, const std::vector<int32_t>& ids, size_t from) {
    std::vector<std::string> t;
    for (size_t i = from; i < ids.size(); ++i) t.push_back(tok.id_to_token(ids[i]));
    return t;
  };
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"Q: 2+2?\nA:", " 4"}, {"Translate: bonjour\nEnglish:", " hello"}, {"User: hi", " there, how are you?"}};

  SECTION("SentencePiece-style: no second \"▁\" at the join (Prepend normalizer, Metaspace pre-tokenizer)") {
    for (const std::string name : {"llama2", "metaspace"}) {
      INFO(name);
      const Tokenizer tok = Tokenizer::from_file(kDir + name + ".json");
      const Tokenizer::Joined j = tok.encode_joined("Q: 2+2?\nA:", " 4", true);
      CHECK(j.ids == tok.encode("Q: 2+2?\nA: 4", true));
      CHECK(j.split == tok.encode("Q: 2+2?\nA:", true).size());
      CHECK(tokens(tok, j.ids, j.split) == std::vector<std::string>{"▁", "4"});
      // A response without its space: "4" joins ":" as one text would have it, no "▁" at all.
      const Tokenizer::Joined k = tok.encode_joined("A:", "4", true);
      CHECK(tokens(tok, k.ids, k.split) == std::vector<std::string>{"4"});
      CHECK(tokens(tok, tok.encode("4", false), 0) == std::vector<std::string>{"▁", "4"});  // what it got before
    }
    // Llama 2's Prepend normalizer marks the start of every text it encodes: " 4" alone gets
    // two "▁", the defect encode_joined avoids.
    const Tokenizer llama2 = Tokenizer::from_file(kDir + "llama2.json");
    CHECK(tokens(llama2, llama2.encode(" 4", false), 0) == std::vector<std::string>{"▁", "▁", "4"});
  }

  SECTION("byte-level BPE: a join at a word boundary gives the two parts' own tokens, as before") {
    for (const std::string name : {"gpt2", "llama3", "qwen2"}) {
      const Tokenizer tok = Tokenizer::from_file(kDir + name + ".json");
      for (const auto& [first, second] : pairs) {
        INFO(name << ": " << nlohmann::json(first + second).dump());
        const Tokenizer::Joined j = tok.encode_joined(first, second, true);
        std::vector<int32_t> parts = tok.encode(first, true);
        const std::vector<int32_t> rest = tok.encode(second, false);
        CHECK(j.split == parts.size());
        parts.insert(parts.end(), rest.begin(), rest.end());
        CHECK(show(j.ids) == show(parts));
      }
    }
  }

  SECTION("a token that straddles the join counts as the second part's") {
    // "Q: the" + "re is": the joined text has "there", which begins in the prompt.
    for (const auto& [name, there] : std::vector<std::pair<std::string, std::string>>{
             {"llama2", "▁there"}, {"metaspace", "▁there"}, {"gpt2", "Ġthere"}, {"llama3", "Ġthere"}}) {
      INFO(name);
      const Tokenizer tok = Tokenizer::from_file(kDir + name + ".json");
      const Tokenizer::Joined j = tok.encode_joined("Q: the", "re is", true);
      const std::vector<int32_t> alone = tok.encode("Q: the", true);
      CHECK(j.ids == tok.encode("Q: there is", true));
      CHECK(j.split == alone.size() - 1);  // the prompt's last token, "the", is not in the joined text
      REQUIRE(j.split < j.ids.size());
      CHECK(tok.id_to_token(j.ids[j.split]) == there);
      CHECK(tok.id_to_token(j.ids[j.split - 1]) == ":");
    }
  }

  SECTION("every tokenizer, over the fixture strings: the joined encoding, split after the longest shared prefix") {
    const auto& strings = cases()["strings"];
    for (const auto& [name, c] : cases()["tokenizers"].items()) {
      const Tokenizer tok = Tokenizer::from_file(kDir + c["file"].get<std::string>());
      for (size_t i = 0; i + 1 < strings.size(); i += 7) {
        const std::string a = strings[i], b = strings[i + 1];
        INFO(name << " strings #" << i << " and #" << i + 1);
        const Tokenizer::Joined j = tok.encode_joined(a, b, true);
        const std::vector<int32_t> alone = tok.encode(a, true);
        CHECK(j.ids == tok.encode(a + b, true));
        REQUIRE(j.split <= std::min(alone.size(), j.ids.size()));
        CHECK(std::equal(alone.begin(), alone.begin() + static_cast<std::ptrdiff_t>(j.split), j.ids.begin()));
        if (j.split < alone.size() && j.split < j.ids.size()) CHECK(alone[j.split] != j.ids[j.split]);
      }
    }
  }
}
