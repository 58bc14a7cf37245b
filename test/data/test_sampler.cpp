// Windows and the sample -> window map: windows stay inside files, targets are the next-token
// shift, every epoch visits every window once, and the map is a pure function of (seed, index).
#include <algorithm>
#include <set>

#include "data/sampler.h"
#include "data_test_util.h"

using namespace keel::data;
using namespace keel::data::test;
using Catch::Contains;

namespace {

// Token at position p of file f encodes both (f * 10000 + p), so any read can be traced back
// to where it came from.
uint32_t traced_token(size_t f, int64_t p) { return static_cast<uint32_t>(f * 10000 + p); }
constexpr uint32_t kTracedVocab = 100000;

std::vector<std::string> write_traced_files(const TempDir& dir, const std::vector<int64_t>& sizes) {
  std::vector<std::string> paths;
  for (size_t f = 0; f < sizes.size(); ++f) {
    std::vector<uint32_t> tokens;
    for (int64_t p = 0; p < sizes[f]; ++p) tokens.push_back(traced_token(f, p));
    paths.push_back(dir / ("shard_" + std::to_string(f) + ".bin"));
    write_llmc_shard(paths.back(), tokens, /*u32=*/true);
  }
  return paths;
}

// A dataset with exactly `windows` windows of seq_len 1 (tokens are all 0).
Sampler sampler_with_windows(const TempDir& dir, int64_t windows, uint64_t seed, bool shuffle = true) {
  const std::string path = dir / (std::to_string(windows) + "_windows.bin");
  write_llmc_shard(path, std::vector<uint32_t>(static_cast<size_t>(windows + 1), 0), false);
  return Sampler(TokenDataset::open({path}, 1, 1), seed, shuffle);
}

std::vector<int64_t> epoch_order(const Sampler& s, int64_t epoch) {
  std::vector<int64_t> order;
  for (int64_t j = 0; j < s.num_windows(); ++j) order.push_back(s.window_of(epoch * s.num_windows() + j));
  return order;
}

}  // namespace

TEST_CASE("windows: per-file counts, prefix sums, no crossing, next-token targets", "[data][sampler]") {
  TempDir dir;
  // 101 tokens -> 12 windows of 8; 7 tokens -> none; 50 -> 6; 9 -> exactly 1.
  const std::vector<int64_t> sizes{101, 7, 50, 9};
  const int L = 8;
  TokenDataset ds = TokenDataset::open(write_traced_files(dir, sizes), L, kTracedVocab);
  REQUIRE(ds.num_windows() == 12 + 0 + 6 + 1);
  CHECK(ds.num_tokens() == 101 + 7 + 50 + 9);
  CHECK(ds.locate(0).file == 0);
  CHECK(ds.locate(11).file == 0);
  CHECK(ds.locate(11).start == 88);
  CHECK(ds.locate(12).file == 2);  // the 7-token file holds no window and is skipped
  CHECK(ds.locate(12).start == 0);
  CHECK(ds.locate(18).file == 3);

  std::vector<int32_t> in(L), tgt(L);
  for (int64_t w = 0; w < ds.num_windows(); ++w) {
    const auto loc = ds.locate(w);
    ds.read_window(w, in.data(), tgt.data());
    for (int k = 0; k < L; ++k) {
      // Every token of the window comes from the same file, at consecutive positions.
      REQUIRE(in[k] == static_cast<int32_t>(traced_token(loc.file, loc.start + k)));
      REQUIRE(tgt[k] == static_cast<int32_t>(traced_token(loc.file, loc.start + k + 1)));
      REQUIRE(loc.start + k + 1 < sizes[loc.file]);
    }
  }
  CHECK_THROWS_AS(ds.locate(ds.num_windows()), DataError);
  CHECK_THROWS_AS(ds.locate(-1), DataError);
}

TEST_CASE("each epoch visits every window exactly once", "[data][sampler]") {
  TempDir dir;
  for (int64_t W : {1, 2, 3, 5, 64, 65, 1000, 4097, 100003}) {
    Sampler s = sampler_with_windows(dir, W, /*seed=*/1234);
    REQUIRE(s.num_windows() == W);
    for (int64_t epoch : {0, 1, 7}) {
      std::vector<char> seen(static_cast<size_t>(W), 0);
      for (int64_t j = 0; j < W; ++j) {
        const int64_t w = s.window_of(epoch * W + j);
        REQUIRE(w >= 0);
        REQUIRE(w < W);
        REQUIRE(seen[static_cast<size_t>(w)] == 0);
        seen[static_cast<size_t>(w)] = 1;
      }
      CHECK(s.epoch_of(epoch * W) == epoch);
      CHECK(s.epoch_of(epoch * W + W - 1) == epoch);
    }
  }
}

TEST_CASE("the order differs per epoch and per seed, and is not the identity", "[data][sampler]") {
  TempDir dir;
  const int64_t W = 1000;
  Sampler a = sampler_with_windows(dir, W, 1);
  Sampler b = sampler_with_windows(dir, W, 2);
  const std::vector<int64_t> a0 = epoch_order(a, 0), a1 = epoch_order(a, 1), b0 = epoch_order(b, 0);
  std::vector<int64_t> identity(W);
  for (int64_t j = 0; j < W; ++j) identity[static_cast<size_t>(j)] = j;
  CHECK(a0 != a1);
  CHECK(a0 != b0);
  CHECK(a0 != identity);
  // A shuffle, not a near-identity: few windows stay in place (about one expected).
  int64_t fixed = 0;
  for (int64_t j = 0; j < W; ++j) fixed += a0[static_cast<size_t>(j)] == j;
  CHECK(fixed < 10);

  Sampler in_order = sampler_with_windows(dir, W, 1, /*shuffle=*/false);
  CHECK(epoch_order(in_order, 0) == identity);
  CHECK(epoch_order(in_order, 3) == identity);
}

TEST_CASE("the map is a pure function of (seed, sample): resuming reads the same tokens", "[data][sampler]") {
  TempDir dir;
  const std::vector<std::string> paths = write_traced_files(dir, {333, 41, 129});
  const int L = 4;
  // Two samplers built independently (files opened twice) agree on everything.
  Sampler first(TokenDataset::open(paths, L, kTracedVocab), 42, true);
  Sampler second(TokenDataset::open(paths, L, kTracedVocab), 42, true);
  const int64_t W = first.num_windows();
  REQUIRE(W == 83 + 10 + 32);

  const int count = static_cast<int>(2 * W + 17);  // crosses two epoch boundaries
  std::vector<int32_t> in1(count * L), tgt1(count * L), in2(count * L), tgt2(count * L);
  first.fill(0, count, in1.data(), tgt1.data());
  // The second run consumes the same samples in uneven pieces, as a resumed run would.
  int64_t done = 0;
  for (int piece : {1, 30, 100, count - 131}) {
    second.fill(done, piece, in2.data() + done * L, tgt2.data() + done * L);
    done += piece;
  }
  REQUIRE(done == count);
  CHECK(in1 == in2);
  CHECK(tgt1 == tgt2);

  // fill() writes exactly the tokens of the chosen windows, targets shifted by one.
  for (int s = 0; s < count; ++s) {
    const auto loc = first.dataset().locate(first.window_of(s));
    for (int k = 0; k < L; ++k) {
      REQUIRE(in1[s * L + k] == static_cast<int32_t>(traced_token(loc.file, loc.start + k)));
      REQUIRE(tgt1[s * L + k] == static_cast<int32_t>(traced_token(loc.file, loc.start + k + 1)));
    }
  }
  // Epoch boundaries: samples W..2W-1 are again every window once.
  std::set<int64_t> epoch1;
  for (int64_t s = W; s < 2 * W; ++s) epoch1.insert(first.window_of(s));
  CHECK(static_cast<int64_t>(epoch1.size()) == W);
  CHECK(first.epoch_of(W - 1) == 0);
  CHECK(first.epoch_of(W) == 1);
  CHECK_THROWS_AS(first.epoch_of(-1), DataError);
}

TEST_CASE("sampling a Megatron dataset reads its flat token stream", "[data][sampler]") {
  TempDir dir;
  const std::string prefix = dir / "docs";
  write_megatron_dataset(prefix, {{1, 2, 3, 4, 5}, {6, 7}, {8, 9, 10}}, MegatronDtype::int32);
  Sampler s(TokenDataset::open({prefix}, 3, 11), 0, /*shuffle=*/false);
  REQUIRE(s.num_windows() == 3);  // 10 tokens: windows start at 0, 3, 6
  std::vector<int32_t> in(9), tgt(9);
  s.fill(0, 3, in.data(), tgt.data());
  CHECK(in == std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(tgt == std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 9, 10});
}

TEST_CASE("sampler errors name the file, the position and the vocab", "[data][sampler][errors]") {
  TempDir dir;
  SECTION("token >= vocab") {
    const std::string path = dir / "oov.bin";
    std::vector<uint32_t> tokens(20, 3);
    tokens[13] = 600;
    write_llmc_shard(path, tokens, false);
    Sampler s(TokenDataset::open({path}, 4, 500), 0, false);
    std::vector<int32_t> in(8), tgt(8);
    s.fill(0, 2, in.data(), tgt.data());  // windows 0 and 1 cover tokens 0..8: all fine
    CHECK_THAT(data_error_of([&] { s.fill(3, 1, in.data(), tgt.data()); }),  // tokens 12..16
               Contains(path) && Contains("token 600") && Contains("position 13") && Contains("vocab size 500"));
  }
  SECTION("the last target is checked too") {
    const std::string path = dir / "oov_tail.bin";
    std::vector<uint32_t> tokens(5, 1);
    tokens[4] = 9;
    write_llmc_shard(path, tokens, false);
    Sampler s(TokenDataset::open({path}, 4, 5), 0, false);
    std::vector<int32_t> in(4), tgt(4);
    CHECK_THAT(data_error_of([&] { s.fill(0, 1, in.data(), tgt.data()); }),
               Contains("token 9") && Contains("position 4"));
  }
  SECTION("uint32 tokens beyond int32 are still caught") {
    const std::string path = dir / "huge_id.bin";
    write_llmc_shard(path, {1, 2, 3000000000u, 4}, true);
    Sampler s(TokenDataset::open({path}, 3, 50000), 0, false);
    std::vector<int32_t> in(3), tgt(3);
    CHECK_THAT(data_error_of([&] { s.fill(0, 1, in.data(), tgt.data()); }), Contains("token 3000000000"));
  }
  SECTION("no window fits") {
    const std::string path = dir / "tiny.bin";
    write_llmc_shard(path, {1, 2, 3}, false);
    CHECK_THAT(data_error_of([&] { TokenDataset::open({path}, 8, 10); }),
               Contains("no training windows") && Contains("seq_len + 1 = 9") && Contains(path) && Contains("has only 3") &&
                   Contains("Lower train.seq_len"));
    // Validation data says so, and the field that named the files opens the message.
    CHECK_THAT(data_error_of([&] { TokenDataset::open({path}, 8, 10, DataUse::validation, "data.val_sets.web"); }),
               Catch::StartsWith("data.val_sets.web: no validation windows: a window needs seq_len + 1 = 9"));
  }
  SECTION("the field names every error") {
    const std::string path = dir / "late.bin";
    std::vector<uint32_t> tokens(29, 1);
    tokens[28] = 10;
    write_llmc_shard(path, tokens, false);
    const TokenDataset d = TokenDataset::open({path}, 4, 10, DataUse::validation, "data.val");
    const std::string says = "data.val: '" + path + "': token 10 at position 28 is outside the vocabulary";
    CHECK_THAT(data_error_of([&] { d.check_vocab(1000); }), Catch::StartsWith(says));
    std::vector<int32_t> in(4), tgt(4);
    CHECK_THAT(data_error_of([&] { d.read_window(6, in.data(), tgt.data()); }), Catch::StartsWith(says));  // its last target
    write_bytes(dir / "broken.bin", {1, 2, 3});
    CHECK_THAT(data_error_of([&] { TokenDataset::open({dir / "broken.bin"}, 4, 10, DataUse::validation, "data.val"); }),
               Catch::StartsWith("data.val: ") && Contains(dir / "broken.bin"));
  }
}

TEST_CASE("the shuffled order of one source is pinned: existing runs resume onto the same data", "[data][sampler]") {
  // Values from the sampler as it was before blends existed (commit 1a39d77); a change here
  // silently changes what every resumed run reads.
  TempDir dir;
  const Sampler s = sampler_with_windows(dir, 1000, 42);
  std::vector<int64_t> got;
  for (int64_t i : {0, 1, 2, 3, 999, 1000, 1001, 123456}) got.push_back(s.window_of(i));
  CHECK(got == std::vector<int64_t>{971, 324, 600, 460, 297, 53, 767, 780});
}

namespace {

// A blend of sources whose windows are traced: source d's file holds tokens d*10000 + p.
std::vector<TokenDataset> traced_sources(const TempDir& dir, const std::vector<int64_t>& sizes, int L) {
  std::vector<TokenDataset> out;
  for (const std::string& path : write_traced_files(dir, sizes)) out.push_back(TokenDataset::open({path}, L, kTracedVocab));
  return out;
}

}  // namespace

TEST_CASE("a blend follows its weights in every prefix, and each source walks its own epochs", "[data][sampler][blend]") {
  const std::vector<double> raw = {7, 2, 1};  // normalized to 0.7, 0.2, 0.1
  const Blend blend(raw);
  REQUIRE(blend.num_sources() == 3);
  CHECK(blend.weight(0) == Approx(0.7));
  int64_t total = 0;
  for (size_t d = 0; d < 3; ++d) total += blend.per_period(d);
  CHECK(total == Blend::kPeriod);

  // Over three periods: every prefix n has each source's count within one sample of w_d * n
  // (the greedy bound; the per-period counts differ from w_d * kPeriod by less than one, so the
  // drift after q periods is below q samples), and source d's local indices are 0, 1, 2, ...
  // in order: no sample of a source is skipped or read twice.
  std::vector<int64_t> count(3, 0);
  double worst = 0;
  for (int64_t i = 0; i < 3 * Blend::kPeriod; ++i) {
    const Blend::Pick p = blend.pick(i);
    REQUIRE(p.source < 3);
    REQUIRE(p.local == count[p.source]);
    ++count[p.source];
    for (size_t d = 0; d < 3; ++d)
      worst = std::max(worst, std::abs(double(count[d]) - blend.weight(d) * double(i + 1)) - double(i / Blend::kPeriod));
  }
  CHECK(worst <= 1.0);
  for (size_t d = 0; d < 3; ++d) CHECK(count[d] == 3 * blend.per_period(d));
  // A short prefix already has the proportions: 100 samples are 70 / 20 / 10.
  std::vector<int64_t> first100(3, 0);
  for (int64_t i = 0; i < 100; ++i) ++first100[blend.pick(i).source];
  CHECK(first100 == std::vector<int64_t>{70, 20, 10});
}

TEST_CASE("a blended sampler reads each source's own shuffled windows and resumes exactly", "[data][sampler][blend]") {
  TempDir dir;
  const int L = 4;
  // Source 0: 50 windows (upweighted: it repeats), source 1: 400 windows.
  Sampler a(traced_sources(dir, {201, 1601}, L), {3, 1}, 42, true);
  Sampler b(traced_sources(dir, {201, 1601}, L), {3, 1}, 42, true);
  REQUIRE(a.num_sources() == 2);
  CHECK(a.weight(0) == Approx(0.75));
  CHECK(a.num_windows() == 450);
  CHECK_THROWS_AS(a.dataset(), std::logic_error);

  const int count = 600;
  std::vector<int32_t> in1(count * L), tgt1(count * L), in2(count * L), tgt2(count * L);
  a.fill(0, count, in1.data(), tgt1.data());
  int64_t done = 0;
  for (int piece : {7, 250, count - 257}) {  // resumed in pieces
    b.fill(done, piece, in2.data() + done * L, tgt2.data() + done * L);
    done += piece;
  }
  CHECK(in1 == in2);
  CHECK(tgt1 == tgt2);

  // Every sample's tokens come from the file of its source; source 0's first 50 local samples
  // are each of its windows once (one epoch), the next 50 again once, in another order.
  std::vector<std::vector<int64_t>> by_source(2);
  for (int s = 0; s < count; ++s) {
    const Sampler::Location loc = a.locate(s);
    const auto at = a.source(loc.source).locate(loc.window);
    REQUIRE(in1[s * L] == static_cast<int32_t>(traced_token(loc.source, at.start)));
    by_source[loc.source].push_back(loc.window);
    CHECK(loc.epoch == loc.local / a.source(loc.source).num_windows());
  }
  CHECK(by_source[0].size() == 450);  // 3/4 of 600
  const std::set<int64_t> epoch0(by_source[0].begin(), by_source[0].begin() + 50);
  const std::set<int64_t> epoch1(by_source[0].begin() + 50, by_source[0].begin() + 100);
  CHECK(epoch0.size() == 50);
  CHECK(epoch1.size() == 50);
  CHECK(std::vector<int64_t>(by_source[0].begin(), by_source[0].begin() + 50) !=
        std::vector<int64_t>(by_source[0].begin() + 50, by_source[0].begin() + 100));
  // The two sources are shuffled under different keys (not the same permutation).
  CHECK(by_source[1].size() == 150);

  // A blend of one source reads what the plain sampler reads.
  Sampler one(traced_sources(dir, {201}, L), {5}, 42, true);
  Sampler plain(TokenDataset::open({dir / "shard_0.bin"}, L, kTracedVocab), 42, true);
  for (int64_t s = 0; s < 120; ++s) REQUIRE(one.window_of(s) == plain.window_of(s));
}

TEST_CASE("blend weights that cannot be honoured are refused with the weight named", "[data][sampler][blend][errors]") {
  CHECK_THROWS_WITH(Blend({1.0, 0.0}), Contains("blend weight 1 is 0.000000") && Contains("positive and finite"));
  CHECK_THROWS_WITH(Blend({1.0, -2.0}), Contains("blend weight 1"));
  CHECK_THROWS_WITH(Blend({1.0, std::nan("")}), Contains("blend weight 1"));
  CHECK_THROWS_WITH(Blend({1e6, 1.0}), Contains("blend weight 1") && Contains("smallest share"));
  CHECK_THROWS_WITH(Blend(std::vector<double>{}), Contains("at least one source"));
  TempDir dir;
  CHECK_THROWS_WITH(Sampler(traced_sources(dir, {20, 20}, 4), {1.0}, 1, true), Contains("2 sources got 1 weights"));
}
