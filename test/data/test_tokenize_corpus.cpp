// keel tokenize (data/tokenize_corpus.h) against scripts/prepare_data.py: the fixtures in
// test/fixtures/tokenize are the script's token files for small corpora with every awkward
// input we know of (scripts/make_tokenize_fixtures.py), and keel must write them byte for byte.
// Also the Python behaviour it rests on: random.Random's shuffle, UTF-8 replacement,
// str.isspace and re.split of paragraphs.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/corpus.h"
#include "data/loss_mask.h"
#include "data/python_random.h"
#include "data/token_file.h"
#include "data/tokenize_corpus.h"
#include "data/tokenizer.h"
#include "data/unicode.h"
#include "data_test_util.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::read_bytes;
using test::TempDir;

const std::string kDir = std::string(KEEL_FIXTURE_DIR) + "/tokenize/";
const std::string kTokenizers = std::string(KEEL_FIXTURE_DIR) + "/tokenizers/";

json load(const std::string& name) {
  std::ifstream in(kDir + name);
  REQUIRE(in);
  return json::parse(in);
}

std::vector<unsigned char> unhex(const std::string& h) {
  std::vector<unsigned char> out;
  for (size_t k = 0; k + 1 < h.size(); k += 2) out.push_back(static_cast<unsigned char>(std::stoi(h.substr(k, 2), nullptr, 16)));
  return out;
}

// prepare_data.py's arguments (as cases.json lists them) as TokenizeOptions.
TokenizeOptions options_of(const json& args, const std::string& out, int threads) {
  TokenizeOptions o;
  o.out = out;
  o.threads = threads;
  std::vector<std::string>* list = nullptr;
  for (size_t k = 0; k < args.size(); ++k) {
    const std::string a = args[k];
    auto next = [&] { return args.at(++k).get<std::string>(); };
    if (a == "--jsonl") list = &o.jsonl;
    else if (a == "--text") list = &o.text;
    else if (a.rfind("--", 0) != 0 && list) list->push_back(kDir + a);
    else {
      list = nullptr;
      if (a == "--tokenizer") o.tokenizer = kTokenizers + next();
      else if (a == "--shard-tokens") o.shard_tokens = std::stoll(next());
      else if (a == "--seed") o.seed = std::stoull(next());
      else if (a == "--val-fraction") o.val_fraction = std::stod(next());
      else if (a == "--add-special-tokens") o.add_special_tokens = true;
      else if (a == "--loss-mask") o.prompt_loss_mask = next() == "prompt";
      else if (a == "--doc-split") {
        const std::string s = next();
        o.doc_split = s == "paragraph" ? DocSplit::paragraph : s == "line" ? DocSplit::line : DocSplit::file;
      } else FAIL("unknown argument in cases.json: " << a);
    }
  }
  return o;
}

void quiet(const std::string&) {}

std::vector<std::string> token_outputs(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".bin") || n.ends_with(".idx") || n.ends_with(".mask")) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("PythonRandom draws what random.Random(seed) draws", "[tokenize]") {
  const json cases = load("python.json");
  for (const json& c : cases.at("random")) {
    const uint64_t seed = c["seed"];
    INFO("seed " << seed);
    PythonRandom r(seed);
    for (size_t k = 0; k < c["getrandbits"].size(); ++k)
      CHECK(r.getrandbits(c["getrandbits_k"][k].get<int>()) == std::stoull(c["getrandbits"][k].get<std::string>()));
    std::vector<int> small(10);
    for (int k = 0; k < 10; ++k) small[k] = k;
    PythonRandom(seed).shuffle(small);
    CHECK(small == c["shuffle10"].get<std::vector<int>>());
    std::vector<uint64_t> large(100000);
    for (size_t k = 0; k < large.size(); ++k) large[k] = k;
    PythonRandom(seed).shuffle(large);
    CHECK(std::vector<uint64_t>(large.begin(), large.begin() + 20) == c["shuffle100000_head"].get<std::vector<uint64_t>>());
    unsigned __int128 weighted = 0;
    for (size_t k = 0; k < large.size(); ++k) weighted += static_cast<unsigned __int128>(k) * large[k];
    CHECK(static_cast<uint64_t>(weighted % ((uint64_t{1} << 61) - 1)) == c["shuffle100000_weighted"].get<uint64_t>());
  }
}

TEST_CASE("Invalid UTF-8 is replaced as Python's errors=\"replace\" replaces it", "[tokenize]") {
  const json cases = load("python.json");
  for (const json& c : cases.at("utf8_replace")) {
    const auto raw = unhex(c["bytes"]);
    const std::string bytes(raw.begin(), raw.end());
    INFO("bytes " << c["bytes"].get<std::string>());
    CHECK(unicode::replace_invalid_utf8(bytes) == c["text"].get<std::string>());
    CHECK(unicode::is_valid_utf8(bytes) == (bytes == c["text"].get<std::string>()));
  }
}

TEST_CASE("is_python_space is str.isspace() over every code point", "[tokenize]") {
  const auto spaces = load("python.json")["isspace"].get<std::vector<uint32_t>>();
  size_t next = 0, mismatches = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    const bool python = next < spaces.size() && spaces[next] == c;
    next += python;
    mismatches += unicode::is_python_space(c) != python;
  }
  CHECK(next == spaces.size());
  CHECK(mismatches == 0);
}

// Python's re.split(r"\n\s*\n", text) on the fixture's texts
TEST_CASE("split_paragraphs splits where Python's re.split on newline, whitespace, newline does", "[tokenize]") {
  const json cases = load("python.json");
  for (const json& c : cases.at("paragraphs")) {
    const std::string text = c["text"];
    INFO(text);
    std::vector<std::string> pieces;
    for (std::string_view p : split_paragraphs(text)) pieces.emplace_back(p);
    CHECK(pieces == c["pieces"].get<std::vector<std::string>>());
  }
}

TEST_CASE("keel tokenize writes prepare_data.py's token files byte for byte", "[tokenize]") {
  const json cases = load("cases.json");
  for (const auto& [name, c] : cases.items()) {
    for (int threads : {1, 3}) {
      INFO(name << ", " << threads << " threads");
      TempDir dir;
      const TokenizeOptions o = options_of(c["args"], dir / "out", threads);
      const TokenizeResult r = tokenize_corpus(o, quiet);
      CHECK(r.eot_id == c["eot_id"].get<int>());
      CHECK(r.vocab_size == c["vocab_size"].get<int64_t>());
      CHECK(r.train.documents == c["train"]["documents"].get<int64_t>());
      CHECK(r.train.tokens == c["train"]["tokens"].get<int64_t>());
      CHECK(r.val.documents == c["val"]["documents"].get<int64_t>());
      CHECK(r.val.tokens == c["val"]["tokens"].get<int64_t>());
      if (o.prompt_loss_mask) {
        CHECK(r.train.in_loss == c["train"]["in_loss"].get<int64_t>());
        CHECK(r.val.in_loss == c["val"]["in_loss"].get<int64_t>());
      }
      const auto expected = c["files"].get<std::vector<std::string>>();
      REQUIRE(token_outputs(dir / "out") == expected);
      for (const std::string& f : expected) {
        INFO(f);
        CHECK(read_bytes(dir / ("out/" + f)) == read_bytes(kDir + name + "/" + f));
      }
      // meta.json names the end of text (keel train's document masking reads it) and the
      // tokenizer comes along.
      std::ifstream in(dir / "out/meta.json");
      CHECK(json::parse(in)["eot_id"] == c["eot_id"]);
      CHECK(fs::exists(dir / "out/tokenizer.json"));
      for (const auto& e : fs::directory_iterator(dir / "out"))  // no staging folder left behind
        CHECK_FALSE(e.path().filename().string().starts_with(".keel-tokenize-"));
    }
  }
}

TEST_CASE("keel tokenize --format megatron: the same token stream with document boundaries", "[tokenize]") {
  const json c = load("cases.json")["pairs_llama2"];
  TempDir dir;
  TokenizeOptions o = options_of(c["args"], dir / "out", 2);
  o.format = TokenOutputFormat::megatron;
  const TokenizeResult r = tokenize_corpus(o, quiet);
  CHECK(token_outputs(dir / "out") ==
        std::vector<std::string>{"train.bin", "train.idx", "train.mask", "val.bin", "val.idx", "val.mask"});
  for (const std::string split : {"train", "val"}) {
    INFO(split);
    const TokenFile f = TokenFile::open(dir / ("out/" + split + ".bin"));
    const auto mask = LossMask::open_for(f);
    REQUIRE(mask);
    // The llm.c shards of prepare_data.py, concatenated, are the same tokens and mask bytes.
    std::vector<uint32_t> shard_tokens;
    std::vector<bool> shard_mask;
    for (const std::string& name : c["files"].get<std::vector<std::string>>()) {
      if (!name.starts_with(split + "_") || !name.ends_with(".bin")) continue;
      const TokenFile s = TokenFile::open(kDir + "pairs_llama2/" + name);
      const auto m = LossMask::open_for(s);
      for (int64_t i = 0; i < s.num_tokens(); ++i) shard_tokens.push_back(s.token(i)), shard_mask.push_back(m->in_loss(i));
    }
    REQUIRE(f.num_tokens() == static_cast<int64_t>(shard_tokens.size()));
    size_t token_diffs = 0, mask_diffs = 0, eot_ends = 0;
    for (int64_t i = 0; i < f.num_tokens(); ++i) {
      token_diffs += f.token(i) != shard_tokens[static_cast<size_t>(i)];
      mask_diffs += mask->in_loss(i) != shard_mask[static_cast<size_t>(i)];
    }
    CHECK(token_diffs == 0);
    CHECK(mask_diffs == 0);
    // One sequence per document, each ending with the end of text.
    const auto& starts = f.doc_starts();
    const TokenizedSplit& s = split == "train" ? r.train : r.val;
    CHECK(static_cast<int64_t>(starts.size()) == s.documents);
    for (size_t d = 0; d < starts.size(); ++d) {
      const int64_t end = d + 1 < starts.size() ? starts[d + 1] : f.num_tokens();
      eot_ends += f.token(end - 1) == static_cast<uint32_t>(r.eot_id);
    }
    CHECK(eot_ends == starts.size());
  }
}

TEST_CASE("keel tokenize changes nothing in --out until it succeeds", "[tokenize]") {
  TempDir dir;
  const std::string out = dir / "out";
  fs::create_directories(out);
  const std::vector<unsigned char> old_shard{1, 2, 3}, notes{'h', 'i'};
  test::write_bytes(out + "/train_000.bin", old_shard);
  test::write_bytes(out + "/train_007.bin", old_shard);
  test::write_bytes(out + "/val.idx", old_shard);
  test::write_bytes(out + "/notes.txt", notes);
  const json c = load("cases.json")["jsonl_gpt2"];
  auto unchanged = [&] {
    CHECK(token_outputs(out) == std::vector<std::string>{"train_000.bin", "train_007.bin", "val.idx"});
    CHECK(read_bytes(out + "/train_000.bin") == old_shard);
    std::vector<std::string> hidden;
    for (const auto& e : fs::directory_iterator(out))
      if (e.path().filename().string().starts_with(".")) hidden.push_back(e.path().filename().string());
    CHECK(hidden.empty());  // no staging folder left behind
  };

  SECTION("an unknown end-of-text token") {
    TokenizeOptions o = options_of(c["args"], out, 2);
    o.eot_token = "<nope>";
    CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--eot-token") && Catch::Contains("<nope>"));
    unchanged();
  }
  SECTION("a line that is not JSON names the file and the line") {
    std::ofstream(dir / "bad.jsonl") << "{\"text\": \"fine\"}\n\n{\"text\": \"also fine\"}\n{\"text\": broken}\n";
    TokenizeOptions o = options_of(c["args"], out, 2);
    o.jsonl = {dir / "bad.jsonl"};
    const std::string msg = test::data_error_of([&] { tokenize_corpus(o, quiet); });
    CHECK_THAT(msg, Catch::Contains(dir / "bad.jsonl:4: invalid JSON"));
    unchanged();
  }
  SECTION("no documents") {
    std::ofstream(dir / "empty.jsonl") << "{\"txt\": \"wrong field\"}\n";
    TokenizeOptions o = options_of(c["args"], out, 2);
    o.jsonl = {dir / "empty.jsonl"};
    CHECK_THAT(test::data_error_of([&] { tokenize_corpus(o, quiet); }),
               Catch::Contains("no documents found") && Catch::Contains("'text'") &&
                   Catch::Contains("the first record of " + (dir / "empty.jsonl") + " has 'txt'"));
    unchanged();
    // Conversations or pairs read without their option: the option is named.
    std::ofstream(dir / "chats.jsonl") << R"({"messages": [{"role": "user", "content": "hi"}]})" << "\n";
    std::ofstream(dir / "pairs.jsonl") << R"({"prompt": "Q: 1+1?", "response": " 2"})" << "\n";
    for (const auto& [file, option] : {std::pair{"chats.jsonl", "--chat"}, std::pair{"pairs.jsonl", "--loss-mask prompt"}}) {
      o.jsonl = {dir / file};
      CHECK_THAT(test::data_error_of([&] { tokenize_corpus(o, quiet); }),
                 Catch::Contains("no documents found") && Catch::Contains(std::string("which ") + option));
    }
    unchanged();
  }
  SECTION("an input that the run would replace") {
    std::ofstream(out + "/train_000.jsonl") << "{\"text\": \"x\"}\n";
    fs::copy_file(kDir + "corpus.jsonl", out + "/val_001.mask");
    TokenizeOptions o = options_of(c["args"], out, 2);
    o.jsonl = {out + "/val_001.mask"};
    CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("val_001.mask") && Catch::Contains("move it"));
    fs::remove(out + "/val_001.mask");
    unchanged();
  }
  SECTION("a file that cannot be written (a file-size limit, as a full disk) is named with the reason") {
    // 8 KiB: the token files (under 2 KiB each) and meta.json fit, the 15 KiB tokenizer.json not.
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    rlimit small = saved;
    small.rlim_cur = 8192;
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    const std::string msg = test::data_error_of([&] { tokenize_corpus(options_of(c["args"], out, 2), quiet); });
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    CHECK_THAT(msg, Catch::Contains("tokenizer.json': ") && Catch::Contains(std::strerror(EFBIG)));
    unchanged();
  }
  SECTION("success replaces the earlier token files and keeps everything else") {
    tokenize_corpus(options_of(c["args"], out, 2), quiet);
    CHECK(token_outputs(out) == c["files"].get<std::vector<std::string>>());
    CHECK(read_bytes(out + "/notes.txt") == notes);
  }
}

// A kill -9 runs no destructor, so a killed run's staging folder stays; the next run on the same
// host removes it, and leaves those of live runs and of other hosts (NFS) alone.
TEST_CASE("keel tokenize removes the staging folders of killed runs on its own host only", "[tokenize]") {
  TempDir dir;
  const std::string out = dir / "out";
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  const pid_t dead = ::fork();  // a pid whose process is surely gone: a child that exited and was reaped
  if (dead == 0) ::_exit(0);
  REQUIRE(dead > 0);
  REQUIRE(::waitpid(dead, nullptr, 0) == dead);
  const std::string killed = ".keel-tokenize-" + std::string(host) + "-" + std::to_string(dead);
  const std::string alive = ".keel-tokenize-" + std::string(host) + "-" + std::to_string(::getppid());
  const std::string other = ".keel-tokenize-node-b.cluster-" + std::to_string(dead);
  for (const std::string& name : {killed, alive, other}) {
    fs::create_directories(out + "/" + name);
    test::write_bytes(out + "/" + name + "/train_000.bin", {1, 2, 3});
  }
  std::vector<std::string> lines;
  tokenize_corpus(options_of(load("cases.json")["jsonl_gpt2"]["args"], out, 2),
                  [&](const std::string& line) { lines.push_back(line); });
  CHECK_FALSE(fs::exists(out + "/" + killed));
  CHECK(read_bytes(out + "/" + alive + "/train_000.bin") == std::vector<unsigned char>{1, 2, 3});
  CHECK(read_bytes(out + "/" + other + "/train_000.bin") == std::vector<unsigned char>{1, 2, 3});
  CHECK(fs::exists(out + "/train_000.bin"));
  std::string log;
  for (const std::string& l : lines) log += l + "\n";
  INFO(log);
  CHECK_THAT(log, Catch::Contains("removed '" + out + "/" + killed + "'") && Catch::Contains("pid " + std::to_string(dead)));
  CHECK_THAT(log, Catch::Contains("note:") && Catch::Contains(other) && Catch::Contains("other hosts"));
  CHECK_THAT(log, !Catch::Contains(alive));
}

TEST_CASE("keel tokenize: past 1000 shards the names get more digits and still sort in order", "[tokenize]") {
  // The fixture case with masks, in shards of 5 tokens instead of 300: 1372 train shards.
  const json c = load("cases.json")["pairs_llama2"];
  TempDir dir;
  TokenizeOptions o = options_of(c["args"], dir / "out", 2);
  o.shard_tokens = 5;
  std::vector<std::string> log;
  const TokenizeResult r = tokenize_corpus(o, [&](const std::string& l) { log.push_back(l); });
  const int64_t train_tokens = c["train"]["tokens"];
  REQUIRE(r.train.files.size() == static_cast<size_t>((train_tokens + 4) / 5));
  CHECK(r.train.files.front() == "train_0000.bin");
  CHECK(r.train.files.back() == "train_1371.bin");
  CHECK(std::is_sorted(r.train.files.begin(), r.train.files.end()));  // the order of the data is the order of the names
  CHECK(r.val.files.front() == "val_000.bin");  // fewer than 1000: prepare_data.py's names
  // The same tokens and mask bytes as the script's shards of 300, in the names' order.
  std::vector<unsigned char> tokens, mask, want_tokens, want_mask;
  auto body = [](const std::vector<unsigned char>& b) { return std::vector<unsigned char>(b.begin() + 1024, b.end()); };
  for (const std::string& f : r.train.files) {
    const auto t = body(read_bytes(dir / ("out/" + f))), m = body(read_bytes(dir / ("out/" + LossMask::sidecar_path(f))));
    tokens.insert(tokens.end(), t.begin(), t.end());
    mask.insert(mask.end(), m.begin(), m.end());
  }
  for (const std::string& f : c["files"].get<std::vector<std::string>>()) {
    if (!f.starts_with("train_")) continue;
    const auto b = body(read_bytes(kDir + "pairs_llama2/" + f));
    std::vector<unsigned char>& want = f.ends_with(".bin") ? want_tokens : want_mask;
    want.insert(want.end(), b.begin(), b.end());
  }
  CHECK(tokens == want_tokens);
  CHECK(mask == want_mask);
  std::ifstream in(dir / "out/meta.json");
  const json meta = json::parse(in);
  CHECK(meta["train"]["files"].back()["file"] == "train_1371.bin");
  CHECK(meta["train"]["files"].back()["mask"]["file"] == "train_1371.mask");
  auto said = [&](const std::string& what) {
    return std::any_of(log.begin(), log.end(), [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  CHECK(said("1372 shards: their names have 4 digits (train_0000.bin ... train_1371.bin)"));
  // The summary names the first shards and counts the rest, on a line that ends whole.
  CHECK(said(" in the loss  [train_0000.bin, train_0001.bin, train_0002.bin, train_0003.bin, ... and 1368 more]"));
  CHECK(said("WARNING 1372 shards of at most --shard-tokens 5 tokens"));
  // A second run over the first replaces every one of them.
  o.shard_tokens = 300;
  tokenize_corpus(o, quiet);
  CHECK(token_outputs(dir / "out") == c["files"].get<std::vector<std::string>>());
}

// The log's lines were cut at 512 bytes: a deep --out lost the end of "wrote ...".
TEST_CASE("keel tokenize: a long line of the log is printed whole", "[tokenize]") {
  TempDir dir;
  std::string deep = dir / "out";
  while (deep.size() < 700) deep += "/a-rather-long-folder-name";
  std::vector<std::string> log;
  tokenize_corpus(options_of(load("cases.json")["jsonl_gpt2"]["args"], deep, 1),
                  [&](const std::string& l) { log.push_back(l); });
  CHECK(std::any_of(log.begin(), log.end(), [&](const std::string& l) { return l.starts_with("wrote " + deep + "/ in "); }));
}

TEST_CASE("keel tokenize: --out must be a folder, and a folder the run made goes again on an error", "[tokenize]") {
  TempDir dir;
  const json c = load("cases.json")["jsonl_gpt2"];
  std::ofstream(dir / "afile") << "x";
  for (const std::string& out : {dir / "afile", dir / "afile/sub/out"}) {
    INFO(out);
    TokenizeOptions o = options_of(c["args"], out, 1);
    try {
      tokenize_corpus(o, quiet);
      FAIL("no error");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains("--out '" + out + "'") && Catch::Contains("is a file, not a folder"));
    }
  }
  CHECK(read_bytes(dir / "afile") == std::vector<unsigned char>{'x'});
  // An error leaves no folder behind (test_packing.cpp has one that comes after the folders were made).
  std::ofstream(dir / "bad.jsonl") << "{\"text\": \"fine\"}\n{\"text\": broken}\n";
  TokenizeOptions o = options_of(c["args"], dir / "new/deeper/out", 1);
  o.jsonl = {dir / "bad.jsonl"};
  CHECK_THAT(test::data_error_of([&] { tokenize_corpus(o, quiet); }), Catch::Contains("invalid JSON"));
  CHECK(!fs::exists(dir / "new"));
}

// Besides token files, a run writes meta.json, tokenizer.json and the chat template files: in a
// folder no keel tokenize run wrote (a keel checkpoint, a Hugging Face model folder) those are the
// user's, and the run refuses rather than replace them.
TEST_CASE("keel tokenize: an --out of other files (a checkpoint, a model folder) is refused, not overwritten", "[tokenize]") {
  TempDir dir;
  const json c = load("cases.json")["jsonl_gpt2"];
  const std::string out = dir / "ckpt";
  fs::create_directories(out);
  const std::string checkpoint_meta = "{\"format\": \"keel-checkpoint\", \"iteration\": 3}\n";
  std::ofstream(out + "/meta.json") << checkpoint_meta;
  TokenizeOptions o = options_of(c["args"], out, 1);
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--out '" + out + "' holds a meta.json") &&
                                                   Catch::Contains("keel checkpoint") && Catch::Contains("another --out"));
  CHECK(test::read_bytes(out + "/meta.json") == std::vector<unsigned char>(checkpoint_meta.begin(), checkpoint_meta.end()));
  CHECK(token_outputs(out).empty());

  // A model folder with another tokenizer.json: kept; with the same one (--tokenizer hf:DIR), written.
  const std::string model = dir / "model";
  fs::create_directories(model);
  fs::copy_file(kTokenizers + "llama3.json", model + "/tokenizer.json");
  o = options_of(c["args"], model, 1);
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("holds a tokenizer.json other than"));
  CHECK(test::read_bytes(model + "/tokenizer.json") == test::read_bytes(kTokenizers + "llama3.json"));
  o.tokenizer = model;
  tokenize_corpus(o, quiet);
  CHECK(!token_outputs(model).empty());
  // An earlier run's folder is replaced as before, with another tokenizer too.
  o = options_of(c["args"], model, 1);
  tokenize_corpus(o, quiet);
  CHECK(test::read_bytes(model + "/tokenizer.json") == test::read_bytes(o.tokenizer));
}

// A --chat run copies its template beside the data; a later run into the same folder that writes
// another (or none) removes it, or a chat_template.jinja of the earlier model would be taken for
// this data's template (it comes before tokenizer_config.json in a model folder).
TEST_CASE("keel tokenize: an earlier run's chat template files do not outlive it", "[tokenize][chat]") {
  TempDir dir;
  const json c = load("cases.json")["jsonl_gpt2"];
  const std::string out = dir / "out";
  TokenizeOptions o = options_of(c["args"], out, 1);
  tokenize_corpus(o, quiet);
  // As an earlier --chat run with a .jinja template left them.
  json meta = json::parse(std::ifstream(out + "/meta.json"));
  meta["source"]["chat_template"] = "chat_template.jinja";
  std::ofstream(out + "/meta.json") << meta.dump(2);
  std::ofstream(out + "/chat_template.jinja") << "{{ messages }}";
  std::ofstream(out + "/tokenizer_config.json") << "{}";
  std::ofstream(out + "/notes.txt") << "mine";
  tokenize_corpus(o, quiet);
  CHECK(!fs::exists(out + "/chat_template.jinja"));
  CHECK(!fs::exists(out + "/tokenizer_config.json"));
  CHECK(fs::exists(out + "/notes.txt"));
  CHECK(json::parse(std::ifstream(out + "/meta.json"))["source"].value("chat_template", json()).is_null());
}

TEST_CASE("Options are checked by name", "[tokenize]") {
  TempDir dir;
  const json c = load("cases.json")["jsonl_gpt2"];
  TokenizeOptions o = options_of(c["args"], dir / "out", 1);
  o.val_fraction = 1.0;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--val-fraction") && Catch::Contains("[0, 1)"));
  o = options_of(c["args"], dir / "out", 1);
  o.text = {kDir + "corpus.txt"};
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--jsonl") && Catch::Contains("--text"));
  o = options_of(c["args"], dir / "out", 1);
  o.shard_tokens = 0;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--shard-tokens"));
  CHECK(!fs::exists(dir / "out"));
}

TEST_CASE("Corpus counts records, characters and files with invalid UTF-8 as the script does", "[tokenize]") {
  const json cases = load("cases.json");
  // corpus.jsonl has one line of invalid UTF-8 (the script does not count JSON-lines files, so
  // this count is keel's own); corpus.txt is invalid UTF-8 and the script counts it.
  const Corpus docs = Corpus::jsonl({kDir + "corpus.jsonl"}, "text", 3);
  CHECK(docs.skipped_records() == cases["jsonl_gpt2"]["skipped"].get<int64_t>());
  CHECK(docs.files_with_bad_utf8() == 1);
  CHECK(static_cast<int64_t>(docs.size()) ==
        cases["jsonl_gpt2"]["train"]["documents"].get<int64_t>() + cases["jsonl_gpt2"]["val"]["documents"].get<int64_t>());
  TempDir dir;
  std::ofstream(dir / "clean.jsonl") << "{\"text\": \"caf\u00e9 \\u00e9\"}\n";
  const Corpus clean = Corpus::jsonl({dir / "clean.jsonl"}, "text", 1);
  CHECK(clean.files_with_bad_utf8() == 0);
  CHECK(clean.characters() == 6);  // "café é"
  const Corpus text = Corpus::text({kDir + "corpus.txt", kDir + "corpus.txt"}, DocSplit::paragraph);
  CHECK(text.files_with_bad_utf8() == cases["text_llama3"]["bad_utf8_files"].get<int64_t>());
}

TEST_CASE("keel tokenize warns about input that is not UTF-8, naming where", "[tokenize]") {
  // A cp1252 corpus: every accent is one invalid byte, which becomes U+FFFD as the script has it.
  // That must not pass in silence: the log names the file and line of the first one.
  TempDir dir;
  std::ofstream(dir / "clean.jsonl") << "{\"text\": \"plain ascii\"}\n{\"text\": \"more ascii\"}\n";
  std::ofstream(dir / "cp1252.jsonl") << "{\"text\": \"fine\"}\n{\"text\": \"caf\xe9 au lait\"}\n";
  std::ofstream(dir / "cp1252.txt") << "na\xefve\n\nsecond paragraph\n";
  TokenizeOptions o;
  o.tokenizer = kTokenizers + "gpt2.json";
  o.threads = 1;
  std::vector<std::string> log;
  auto collect = [&](const std::string& line) { log.push_back(line); };
  auto warnings = [&] {
    std::vector<std::string> w;
    for (const std::string& line : log)
      if (line.find("not valid UTF-8") != std::string::npos) w.push_back(line);
    return w;
  };

  o.jsonl = {dir / "clean.jsonl", dir / "cp1252.jsonl"};
  o.out = dir / "jsonl";
  tokenize_corpus(o, collect);
  REQUIRE(warnings().size() == 1);
  CHECK_THAT(warnings()[0], Catch::Contains("WARNING 1 of 2 input files") &&
                                Catch::Contains(dir / "cp1252.jsonl:2") && Catch::Contains("U+FFFD"));

  log.clear();
  o.jsonl.clear();
  o.text = {dir / "cp1252.txt"};
  o.doc_split = DocSplit::paragraph;
  o.out = dir / "text";
  tokenize_corpus(o, collect);
  REQUIRE(warnings().size() == 1);
  CHECK_THAT(warnings()[0], Catch::Contains("WARNING 1 of 1 input files") && Catch::Contains(dir / "cp1252.txt"));

  log.clear();
  o.text = {};
  o.jsonl = {dir / "clean.jsonl"};
  o.out = dir / "clean";
  tokenize_corpus(o, collect);
  CHECK(warnings().empty());
}

TEST_CASE("keel tokenize --loss-mask prompt: a pair is its joined text's tokens, the response's in the loss",
          "[tokenize]") {
  // Dogfooding found the response encoded on its own: Llama 2's tokenizer then gave
  // "Q: 2+2?\nA:" + " 4" the tokens ... "A" ":" "▁" "▁" "4" (decoding to two spaces), and a
  // finetuned model learned to emit the extra "▁". The pair must be what encoding the whole text
  // gives, with the prompt's tokens out of the loss. A token straddling the join ("the" + "re"
  // as "there") is in the loss; so is the response's part of it.
  struct Pair {
    std::string prompt, response;
    std::vector<std::string> in_loss;  // the response's tokens, without the end of text
  };
  for (const auto& [name, pairs] : std::vector<std::pair<std::string, std::vector<Pair>>>{
           {"llama2", {{"Q: 2+2?\nA:", " 4", {"▁", "4"}},
                       {"Q: the", "re is", {"▁there", "▁is"}},
                       {"A: ", "4", {"4"}}}},
           {"gpt2", {{"Q: 2+2?\nA:", " 4", {"Ġ", "4"}},
                     {"Q: the", "re is", {"Ġthere", "Ġis"}},
                     {"A: ", "4", {"4"}}}}}) {
    INFO(name);
    TempDir dir;
    {
      std::ofstream f(dir / "pairs.jsonl");
      for (const Pair& p : pairs) f << json{{"prompt", p.prompt}, {"response", p.response}}.dump() << "\n";
    }
    TokenizeOptions o;
    o.jsonl = {dir / "pairs.jsonl"};
    o.prompt_loss_mask = true;
    o.add_special_tokens = true;
    o.tokenizer = kTokenizers + name + ".json";
    o.val_fraction = 0;
    o.threads = 2;
    o.out = dir / "out";
    const TokenizeResult r = tokenize_corpus(o, quiet);
    const Tokenizer tok = Tokenizer::from_file(o.tokenizer);
    const TokenFile f = TokenFile::open(dir / "out/train_000.bin");
    const auto mask = LossMask::open_for(f);
    REQUIRE(mask);
    // The documents (shuffled), each ending with the end of text, and their masks.
    std::vector<std::pair<std::vector<int32_t>, std::vector<bool>>> docs(1);
    for (int64_t i = 0; i < f.num_tokens(); ++i) {
      docs.back().first.push_back(static_cast<int32_t>(f.token(i)));
      docs.back().second.push_back(mask->in_loss(i));
      if (f.token(i) == static_cast<uint32_t>(r.eot_id) && i + 1 < f.num_tokens()) docs.emplace_back();
    }
    REQUIRE(docs.size() == pairs.size());
    for (const Pair& p : pairs) {
      INFO(json(p.prompt).dump() << " + " << json(p.response).dump());
      std::vector<int32_t> want = tok.encode(p.prompt + p.response, true);
      want.push_back(r.eot_id);
      const auto doc = std::find_if(docs.begin(), docs.end(), [&](const auto& d) { return d.first == want; });
      REQUIRE(doc != docs.end());  // exactly the joined text's tokens
      std::vector<std::string> in_loss;
      size_t first_in_loss = doc->second.size();
      for (size_t i = 0; i + 1 < doc->first.size(); ++i)
        if (doc->second[i]) {
          in_loss.push_back(tok.id_to_token(doc->first[i]));
          first_in_loss = std::min(first_in_loss, i);
        }
      CHECK(in_loss == p.in_loss);
      CHECK(doc->second.back());  // the end of text is learned
      // The mask is one run: the prompt's tokens out, everything from the response's first token in.
      for (size_t i = first_in_loss; i < doc->second.size(); ++i) CHECK(doc->second[i]);
    }
  }
}

// Web text that mentions a special token: by default it becomes the token (HF's default), and
// with data.document_masking a mentioned <|endoftext|> cuts its document in two; the run says so.
// --split-special-tokens keeps it text: one end of text per document, the one keel appends.
TEST_CASE("keel tokenize --split-special-tokens encodes special-token text in documents as text",
          "[tokenize][split_special]") {
  TempDir dir;
  const std::vector<std::string> texts = {"GPT-2 ends its texts with <|endoftext|> as a rule.",
                                          "A chat turn starts with <|user|>, they say.", "Nothing special here.",
                                          "<|endoftext|><|endoftext|> twice at the start"};
  {
    std::ofstream f(dir / "docs.jsonl");
    for (const std::string& t : texts) f << json{{"text", t}}.dump() << "\n";
  }
  for (const bool split : {false, true}) {
    INFO("--split-special-tokens " << split);
    TokenizeOptions o;
    o.jsonl = {dir / "docs.jsonl"};
    o.tokenizer = kTokenizers + "gpt2.json";
    o.val_fraction = 0;
    o.threads = 2;
    o.split_special_tokens = split;
    o.out = dir / (split ? "split" : "special");
    std::string log;
    const TokenizeResult r = tokenize_corpus(o, [&](const std::string& line) { log += line + "\n"; });
    Tokenizer tok = Tokenizer::from_file(o.tokenizer);
    tok.set_split_special_tokens(split);
    const TokenFile f = TokenFile::open(o.out + "/train_000.bin");
    std::vector<int32_t> stream;
    for (int64_t i = 0; i < f.num_tokens(); ++i) stream.push_back(static_cast<int32_t>(f.token(i)));
    // Each document is its text's tokens under the setting, then the end of text keel appends.
    int64_t want_tokens = 0;
    for (const std::string& t : texts) {
      std::vector<int32_t> want = tok.encode(t, false);
      want.push_back(r.eot_id);
      want_tokens += static_cast<int64_t>(want.size());
      CHECK(std::search(stream.begin(), stream.end(), want.begin(), want.end()) != stream.end());
    }
    CHECK(static_cast<int64_t>(stream.size()) == want_tokens);
    const auto eots = std::count(stream.begin(), stream.end(), r.eot_id);
    const auto users = std::count(stream.begin(), stream.end(), *tok.token_to_id("<|user|>"));
    CHECK(eots == (split ? 4 : 7));
    CHECK(users == (split ? 0 : 1));
    std::ifstream meta_in(o.out + "/meta.json");
    CHECK(json::parse(meta_in)["split_special_tokens"] == split);
    if (split) {
      CHECK(log.find("hold the text of a special token") == std::string::npos);
    } else {
      CHECK_THAT(log, Catch::Contains("NOTE 3 documents hold the text of a special token (<|endoftext|>, <|user|>), "
                                      "encoded as that token") &&
                          Catch::Contains("--split-special-tokens encodes such text as ordinary text"));
    }
  }
  // The post-processor's BOS is no text of the document: it is not counted.
  TokenizeOptions bos;
  bos.jsonl = {dir / "docs.jsonl"};
  bos.tokenizer = kTokenizers + "llama2.json";
  bos.add_special_tokens = true;
  bos.val_fraction = 0;
  bos.out = dir / "bos";
  std::string log;
  tokenize_corpus(bos, [&](const std::string& line) { log += line + "\n"; });
  CHECK(log.find("hold the text of a special token") == std::string::npos);
  // With --chat the template's own special tokens stay special: test_chat_template.cpp.
}

TEST_CASE("One Tokenizer encodes from several threads at once", "[tokenize][tokenizer]") {
  // The regex matcher once kept the text it scanned in the shared Regex: two threads
  // encoding at once read each other's text (and crashed). Every thread must get the ids
  // that one thread alone gets.
  const Tokenizer tok = Tokenizer::from_file(kTokenizers + "gpt2.json");
  std::vector<std::string> texts;
  const Corpus corpus = Corpus::jsonl({kDir + "corpus.jsonl"}, "text", 1);
  for (size_t k = 0; k < corpus.size(); ++k) texts.push_back(corpus.document(k).text);
  std::vector<std::vector<int32_t>> serial;
  for (const std::string& t : texts) serial.push_back(tok.encode(t));
  std::vector<size_t> wrong(4, 0);
  std::vector<std::thread> pool;
  for (size_t t = 0; t < wrong.size(); ++t)
    pool.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (size_t k = 0; k < texts.size(); ++k) wrong[t] += tok.encode(texts[(k + t * 7) % texts.size()]) != serial[(k + t * 7) % texts.size()];
    });
  for (auto& th : pool) th.join();
  CHECK(wrong == std::vector<size_t>(4, 0));
}

}  // namespace
}  // namespace keel::data
