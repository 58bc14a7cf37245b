// keel tokenize --pack (data/packing.h): whole documents per training window. The packed files
// are read back window by window and their documents compared with those of the same corpus
// tokenized without packing (which test_tokenize_corpus.cpp checks against prepare_data.py).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "data/loss_mask.h"
#include "data/packing.h"
#include "data/python_random.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "data/tokenize_corpus.h"
#include "data_test_util.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::TempDir;

const std::string kDir = std::string(KEEL_FIXTURE_DIR) + "/tokenize/";
const std::string kTokenizers = std::string(KEEL_FIXTURE_DIR) + "/tokenizers/";

void quiet(const std::string&) {}

TEST_CASE("best_fit_decreasing puts each item in the fullest window it fits", "[pack]") {
  // Sorted: 5 5 4 3 3 2 2 1. The 3s go to the windows holding a 5 (3 left each, the fullest),
  // the 2s fill the 4's window, the 1 finds no room and opens a fourth.
  const std::vector<int64_t> lengths{3, 5, 2, 4, 1, 5, 3, 2};
  const auto w = best_fit_decreasing(lengths, 8);
  CHECK(w == std::vector<std::vector<size_t>>{{1, 0}, {5, 6}, {3, 2, 7}, {4}});
  CHECK(best_fit_decreasing({}, 8).empty());
  CHECK_THROWS_WITH(best_fit_decreasing({3, 9}, 8), Catch::Contains("item 1") && Catch::Contains("length 9"));
  CHECK_THROWS_WITH(best_fit_decreasing({0}, 8), Catch::Contains("length 0"));

  // Many random lengths: every item exactly once, no window over capacity, and (for items of
  // at most a quarter window, where any-fit packing is nearly perfect) at most one window more
  // than the total length needs.
  std::mt19937_64 rng(7);
  for (int64_t cap : {64, 2048}) {
    std::vector<int64_t> len(3000);
    for (auto& l : len) l = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(cap / 4));
    const auto windows = best_fit_decreasing(len, cap);
    std::vector<int> seen(len.size(), 0);
    size_t over = 0;
    for (const auto& win : windows) {
      int64_t sum = 0;
      for (size_t i : win) sum += len[i], ++seen[i];
      over += sum > cap;
    }
    CHECK(over == 0);
    CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<long>(len.size()));
    const int64_t total = std::accumulate(len.begin(), len.end(), int64_t{0});
    CHECK(static_cast<int64_t>(windows.size()) <= (total + cap - 1) / cap + 1);
  }
}

using Doc = std::pair<std::vector<uint32_t>, std::vector<uint8_t>>;  // tokens, loss mask

std::vector<std::string> split_files(const std::string& dir, const std::string& split) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with(split + "_") && n.ends_with(".bin")) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The documents of unpacked token files: cut after every end of text.
std::vector<Doc> stream_documents(const std::string& dir, const std::string& split, uint32_t eot) {
  std::vector<Doc> docs(1);
  for (const std::string& path : split_files(dir, split)) {
    const TokenFile f = TokenFile::open(path);
    const auto m = LossMask::open_for(f);
    for (int64_t i = 0; i < f.num_tokens(); ++i) {
      docs.back().first.push_back(f.token(i));
      docs.back().second.push_back(m ? m->in_loss(i) : 1);
      if (f.token(i) == eot) docs.emplace_back();
    }
  }
  REQUIRE(docs.back().first.empty());  // the last document ended
  docs.pop_back();
  return docs;
}

struct PackedRead {
  std::vector<Doc> docs;
  int64_t windows = 0, pads = 0, in_loss = 0, tokens = 0;
};

// The documents of packed files, window by window, checking the layout on the way: each file is
// whole windows plus one padding token; a window is documents (each up to and including its end
// of text) and then padding (end of text, out of the loss); its first token is out of the loss.
PackedRead packed_documents(const std::string& dir, const std::string& split, int64_t T, uint32_t eot) {
  PackedRead r;
  for (const std::string& path : split_files(dir, split)) {
    INFO(path);
    const TokenFile f = TokenFile::open(path);
    const auto m = LossMask::open_for(f);
    REQUIRE(m);
    const int64_t n = f.num_tokens();
    r.tokens += n;
    for (int64_t i = 0; i < n; ++i) r.in_loss += m->in_loss(i);
    if (n == 0) continue;
    REQUIRE((n - 1) % T == 0);
    CHECK(f.token(n - 1) == eot);
    CHECK(!m->in_loss(n - 1));
    ++r.pads;
    for (int64_t base = 0; base + 1 < n; base += T) {
      INFO("window at token " << base);
      ++r.windows;
      CHECK(!m->in_loss(base));
      int64_t p = 0;
      while (p < T && f.token(base + p) != eot) {
        Doc d;
        for (bool ended = false; !ended; ++p) {
          REQUIRE(p < T);  // a document that runs past its window
          d.first.push_back(f.token(base + p));
          d.second.push_back(m->in_loss(base + p));
          ended = f.token(base + p) == eot;
        }
        r.docs.push_back(std::move(d));
      }
      CHECK(p > 0);  // no window of padding only
      for (; p < T; ++p, ++r.pads) {
        CHECK(f.token(base + p) == eot);
        CHECK(!m->in_loss(base + p));
      }
    }
  }
  return r;
}

// Documents compared as multisets; a document's first mask byte is out of the comparison (it is
// forced out of the loss where the document starts a window).
std::vector<Doc> normalized(std::vector<Doc> docs) {
  for (Doc& d : docs) d.second.front() = 0;
  std::sort(docs.begin(), docs.end());
  return docs;
}

TEST_CASE("keel tokenize --pack: whole documents per window, padding out of the loss", "[pack]") {
  struct Case {
    std::string name;
    TokenizeOptions base;
    int64_t T;
    std::optional<PackOverflow> overflow;
    PackOverflow effective;
  };
  TokenizeOptions pairs;  // prompt/response pairs, Llama 2's tokenizer with BOS: drop by default
  pairs.jsonl = {kDir + "corpus.jsonl"};
  pairs.tokenizer = kTokenizers + "llama2.json";
  pairs.prompt_loss_mask = true;
  pairs.add_special_tokens = true;
  pairs.seed = 11;
  pairs.val_fraction = 0.1;
  TokenizeOptions text;  // plain documents, GPT-2's tokenizer: split by default
  text.jsonl = {kDir + "corpus.jsonl"};
  text.tokenizer = kTokenizers + "gpt2.json";
  text.val_fraction = 0.1;
  const std::vector<Case> cases{
      {"pairs, default (drop)", pairs, 48, std::nullopt, PackOverflow::drop},
      {"pairs, split", pairs, 48, PackOverflow::split, PackOverflow::split},
      {"text, default (split)", text, 40, std::nullopt, PackOverflow::split},
      {"text, truncate", text, 40, PackOverflow::truncate, PackOverflow::truncate},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    TempDir dir;
    TokenizeOptions plain = c.base;
    plain.out = dir / "plain";
    const TokenizeResult rp = tokenize_corpus(plain, quiet);
    const auto eot = static_cast<uint32_t>(rp.eot_id);

    TokenizeOptions o = c.base;
    o.pack = c.T;
    o.pack_overflow = c.overflow;
    o.shard_tokens = 3 * c.T + 1;  // three windows a shard: several shards, and pools
    std::vector<std::vector<unsigned char>> bytes_of_first;
    for (int threads : {1, 3}) {
      INFO(threads << " threads");
      o.threads = threads;
      o.out = dir / ("packed" + std::to_string(threads));
      const TokenizeResult r = tokenize_corpus(o, quiet);
      for (const std::string split : {"train", "val"}) {
        INFO(split);
        const TokenizedSplit& s = split == "train" ? r.train : r.val;
        const PackedRead got = packed_documents(o.out, split, c.T, eot);
        CHECK(got.windows == s.windows);
        CHECK(got.pads == s.pad_tokens);
        CHECK(got.tokens == s.tokens);
        CHECK(got.in_loss == s.in_loss);
        CHECK(static_cast<int64_t>(split_files(o.out, split).size()) == (s.windows + 2) / 3);

        // The documents expected: those of the unpacked files, a long one dropped, cut to its
        // first window (T - 1 tokens and an end of text out of the loss), or cut into such
        // pieces with the rest, ending as the document ends, last.
        std::vector<Doc> want;
        int64_t shorts = 0, longs = 0, left_out = 0, pieces = 0;
        for (const Doc& d : stream_documents(plain.out, split, eot)) {
          const auto n = static_cast<int64_t>(d.first.size());
          if (n <= c.T) {
            ++shorts;
            want.push_back(d);
            continue;
          }
          ++longs;
          if (c.effective == PackOverflow::drop) {
            left_out += n;
            continue;
          }
          int64_t at = 0;
          for (; n - at > c.T; at += c.T - 1) {
            Doc p{{d.first.begin() + at, d.first.begin() + at + c.T - 1}, {d.second.begin() + at, d.second.begin() + at + c.T - 1}};
            p.first.push_back(eot);
            p.second.push_back(0);
            want.push_back(std::move(p));
            ++pieces;
            if (c.effective == PackOverflow::truncate) break;
          }
          if (c.effective == PackOverflow::truncate) {
            left_out += n - (c.T - 1);
          } else {
            want.push_back({{d.first.begin() + at, d.first.end()}, {d.second.begin() + at, d.second.end()}});
            ++pieces;
          }
        }
        REQUIRE(longs > 0);  // the case exercises its overflow rule
        CHECK(normalized(got.docs) == normalized(want));
        CHECK(s.long_documents == longs);
        CHECK(s.tokens_left_out == left_out);
        CHECK(s.pieces == (c.effective == PackOverflow::split ? pieces : 0));
        CHECK(s.documents == shorts + (c.effective == PackOverflow::drop ? 0 : longs));

        // keel train's reader: exactly the windows, the padding's targets out of the loss.
        std::vector<TokenFile> files;
        for (const std::string& p : split_files(o.out, split)) files.push_back(TokenFile::open(p));
        const TokenDataset ds(std::move(files), static_cast<int>(c.T), static_cast<uint32_t>(r.vocab_size));
        CHECK(ds.num_windows() == s.windows);
        std::vector<int32_t> in(static_cast<size_t>(c.T)), tgt(in.size());
        int64_t counted = 0;
        for (int64_t w = 0; w < ds.num_windows(); ++w) {
          ds.read_window(w, in.data(), tgt.data());
          counted += std::count_if(tgt.begin(), tgt.end(), [](int32_t t) { return t >= 0; });
          for (int64_t k = 0; k + 1 < c.T; ++k)
            if (in[static_cast<size_t>(k)] == static_cast<int32_t>(eot) && in[static_cast<size_t>(k + 1)] == static_cast<int32_t>(eot))
              CHECK(tgt[static_cast<size_t>(k)] == -1);  // padding is never learned
        }
        // Every target in the loss is read by exactly one window (the first token of a window
        // is out of the loss, so the one target windows share never counts).
        CHECK(counted == s.in_loss);
      }
      std::ifstream in(o.out + "/meta.json");
      const json meta = json::parse(in);
      CHECK(meta["pack"]["seq_len"] == c.T);
      CHECK(meta["pack"]["overflow"] == std::string(pack_overflow_name(c.effective)));
      CHECK(meta["pack"]["train"]["windows"] == r.train.windows);
      bytes_of_first.push_back(test::read_bytes(o.out + "/train_000.bin"));
      const auto mask = test::read_bytes(o.out + "/train_000.mask");
      bytes_of_first.back().insert(bytes_of_first.back().end(), mask.begin(), mask.end());
    }
    CHECK(bytes_of_first[0] == bytes_of_first[1]);  // the thread count changes no byte
  }
}

TEST_CASE("keel tokenize --pack: a split whose every document is longer than a window", "[pack]") {
  // 40 prompt/response pairs (GPT-2's tokenizer: "q", "a" and the end of text are 3 tokens);
  // the two that --seed 2 holds out for validation, or all of them, get a long response.
  TempDir dir;
  auto write_pairs = [&](bool all_long) {
    std::vector<size_t> order(40);
    std::iota(order.begin(), order.end(), size_t{0});
    PythonRandom(2).shuffle(order);
    std::vector<bool> long_one(40, all_long);
    long_one[order[0]] = long_one[order[1]] = true;  // round(40 * 0.05) = 2 held out
    std::ofstream f(dir / "pairs.jsonl");
    for (size_t k = 0; k < 40; ++k)
      f << json{{"prompt", "q"}, {"response", long_one[k] ? std::string(200, 'a') : "a"}}.dump() << "\n";
  };
  TokenizeOptions o;
  o.jsonl = {dir / "pairs.jsonl"};
  o.tokenizer = kTokenizers + "gpt2.json";
  o.prompt_loss_mask = true;
  o.seed = 2;
  o.pack = 8;
  std::vector<std::string> log;
  auto said = [&](const std::string& what) {
    return std::any_of(log.begin(), log.end(), [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };

  SECTION("validation: no val file, as with --val-fraction 0, and a note that says why") {
    write_pairs(false);
    o.out = dir / "out";
    const TokenizeResult r = tokenize_corpus(o, [&](const std::string& l) { log.push_back(l); });
    CHECK(r.val.documents == 0);
    CHECK(r.val.long_documents == 2);
    CHECK(r.val.files.empty());
    CHECK(r.train.documents == 38);
    CHECK(fs::exists(dir / "out/train_000.bin"));
    CHECK(!fs::exists(dir / "out/val_000.bin"));
    CHECK(!fs::exists(dir / "out/val_000.mask"));
    std::ifstream in(dir / "out/meta.json");
    const json meta = json::parse(in);
    CHECK(meta["val"]["files"].empty());
    CHECK(meta["pack"]["val"]["long_documents"] == 2);
    CHECK(said("NOTE no val file was written, as with --val-fraction 0: all 2 val documents were dropped"));
  }
  SECTION("training: an error naming the count, the window and --pack-overflow; nothing left behind") {
    write_pairs(true);
    const std::string says = "all 38 training documents are longer than a window of --pack 8 tokens";
    o.out = dir / "new/out";  // made by the run, removed by its error
    std::string msg = test::data_error_of([&] { tokenize_corpus(o, quiet); });
    CHECK_THAT(msg, Catch::Contains(says) && Catch::Contains("--pack-overflow drop, the default") &&
                        Catch::Contains("--pack-overflow truncate or split"));
    CHECK(!fs::exists(dir / "new"));
    // An existing folder keeps what it had, and no staging folder is left in it.
    fs::create_directories(dir / "old");
    std::ofstream(dir / "old/train_000.bin") << "old";
    o.out = dir / "old";
    msg = test::data_error_of([&] { tokenize_corpus(o, quiet); });
    CHECK_THAT(msg, Catch::Contains(says));
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir / "old")) names.push_back(e.path().filename().string());
    CHECK(names == std::vector<std::string>{"train_000.bin"});
    // Kept whole-window pieces instead, the same corpus packs.
    o.pack_overflow = PackOverflow::truncate;
    const TokenizeResult r = tokenize_corpus(o, quiet);
    CHECK(r.train.documents == 38);
    CHECK(r.val.documents == 2);
  }
}

TEST_CASE("keel tokenize --pack: options are checked by name", "[pack]") {
  TempDir dir;
  TokenizeOptions o;
  o.jsonl = {kDir + "corpus.jsonl"};
  o.tokenizer = kTokenizers + "gpt2.json";
  o.out = dir / "out";
  o.pack = 64;
  o.format = TokenOutputFormat::megatron;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--pack") && Catch::Contains("--format megatron"));
  o.format = TokenOutputFormat::llmc;
  o.shard_tokens = 64;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--shard-tokens 64") && Catch::Contains("65"));
  o.shard_tokens = 1000;
  o.pack = 1;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--pack"));
  o.pack = 0;
  o.pack_overflow = PackOverflow::split;
  CHECK_THROWS_WITH(tokenize_corpus(o, quiet), Catch::Contains("--pack-overflow applies to --pack only"));
  CHECK(!fs::exists(dir / "out"));
}

}  // namespace
}  // namespace keel::data
