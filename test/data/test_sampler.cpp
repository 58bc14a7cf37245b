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

// ---- a blend whose weights change during the run (BlendSchedule) ----------------------------

namespace {

// Walks samples [0, n) of `schedule` and checks what a change of weights must keep: each source's
// local indices are 0, 1, 2, ... (no repeat, no gap), counts(i) agrees with the walk at every i
// in `probes`, and inside segment s the sources come in the order segment s's own Blend gives.
void check_walk(const BlendSchedule& schedule, int64_t n, const std::vector<int64_t>& probes) {
  const auto& segs = schedule.segments();
  std::vector<Blend> blends;
  for (const BlendSegment& seg : segs) blends.emplace_back(seg.weights);
  std::vector<int64_t> next(schedule.num_sources(), 0);
  size_t s = 0, p = 0;
  for (int64_t i = 0; i <= n; ++i) {
    while (p < probes.size() && probes[p] == i) {
      INFO("counts at " << i);
      REQUIRE(schedule.counts(i) == next);
      ++p;
    }
    if (i == n) break;
    while (s + 1 < segs.size() && segs[s + 1].from_sample <= i) ++s;
    const Blend::Pick got = schedule.pick(i);
    INFO("sample " << i << " (segment " << s << ")");
    REQUIRE(got.source == blends[s].pick(i - segs[s].from_sample).source);
    REQUIRE(got.local == next[got.source]);
    ++next[got.source];
  }
  REQUIRE(p == probes.size());  // every probe was reached
}

}  // namespace

TEST_CASE("blend counts are exact at and across period boundaries", "[data][sampler][blend]") {
  const Blend blend({7, 2, 1});
  const int64_t P = Blend::kPeriod;
  const std::vector<int64_t> probes = {0, 1, 2, 99, P - 1, P, P + 1, 2 * P - 3, 2 * P, 3 * P + 12345};
  std::vector<int64_t> count(3, 0);
  size_t p = 0;
  for (int64_t i = 0; i <= probes.back(); ++i) {
    if (i == probes[p]) {
      INFO("n = " << i);
      CHECK(blend.counts(i) == count);
      ++p;
    }
    if (i < probes.back()) ++count[blend.pick(i).source];
  }
  // Whole periods are per_period times the count; counts(n)[d] is the next local index of d.
  CHECK(blend.counts(5 * P) == std::vector<int64_t>{5 * blend.per_period(0), 5 * blend.per_period(1),
                                                    5 * blend.per_period(2)});
  CHECK_THROWS_WITH(blend.counts(-1), Contains("must be >= 0"));
}

TEST_CASE("a blend history of one segment reads exactly what the plain blend reads", "[data][sampler][blend]") {
  const Blend plain({0.7, 0.3});
  const BlendSchedule same({{0, {0.7, 0.3}}});
  for (int64_t i = 0; i < 2 * Blend::kPeriod + 1000; ++i) {
    const Blend::Pick a = plain.pick(i), b = same.pick(i);
    REQUIRE(a.source == b.source);
    REQUIRE(a.local == b.local);
  }
  CHECK(same.counts(Blend::kPeriod + 7) == plain.counts(Blend::kPeriod + 7));
  // Resuming with the same weights, or weights of the same shares, keeps the history as it is.
  const std::vector<BlendSegment> h = {{0, {0.7, 0.3}}};
  CHECK(BlendSchedule::continued(h, 160, {0.7, 0.3}) == h);
  CHECK(BlendSchedule::continued(h, 160, {7, 3}) == h);  // 7/10 and 0.7/1 are the same double
}

TEST_CASE("a change of blend weights continues every source where it left off", "[data][sampler][blend]") {
  // The annealing move: 0.7 / 0.3 for 160 samples, then 0.5 / 0.5. At sample 160 source 0 has
  // given 112 samples and source 1 48; they continue at 112 and 48 (the weights alone would put
  // both at 80: 80-111 of source 0 read twice, 48-79 of source 1 never).
  const std::vector<BlendSegment> history = BlendSchedule::continued({{0, {0.7, 0.3}}}, 160, {0.5, 0.5});
  REQUIRE(history == std::vector<BlendSegment>{{0, {0.7, 0.3}}, {160, {0.5, 0.5}}});
  const BlendSchedule schedule(history);
  CHECK(schedule.counts(160) == std::vector<int64_t>{112, 48});
  CHECK(Blend({0.5, 0.5}).counts(160) == std::vector<int64_t>{80, 80});  // what today's map would jump to
  std::vector<int64_t> first(2, -1);
  for (int64_t i = 160; first[0] < 0 || first[1] < 0; ++i) {
    const Blend::Pick p = schedule.pick(i);
    if (first[p.source] < 0) first[p.source] = p.local;
  }
  CHECK(first == std::vector<int64_t>{112, 48});
  // From the change on, the new shares hold in every prefix: 100 samples later, 50 more each.
  CHECK(schedule.counts(260) == std::vector<int64_t>{162, 98});
  check_walk(schedule, 3000, {0, 159, 160, 161, 1000, 3000});
}

TEST_CASE("several changes in a row, across period boundaries, keep every source's walk whole", "[data][sampler][blend]") {
  const int64_t P = Blend::kPeriod;
  // Segment lengths that are not multiples of the period, changes before and after its end, and
  // a segment longer than two periods (its offsets come from whole periods plus a remainder).
  std::vector<BlendSegment> h = {{0, {7, 2, 1}}};
  h = BlendSchedule::continued(h, 1000, {1, 1, 1});
  h = BlendSchedule::continued(h, P + 17, {1, 5, 2});
  h = BlendSchedule::continued(h, P + 400, {3, 1, 1});
  h = BlendSchedule::continued(h, 3 * P + 5, {3, 1, 1});  // unchanged: no segment
  h = BlendSchedule::continued(h, 3 * P + 9, {1, 1, 8});
  REQUIRE(h.size() == 5);
  CHECK(h.back().from_sample == 3 * P + 9);
  const BlendSchedule schedule(h);
  check_walk(schedule, 4 * P + 100,
             {0, 999, 1000, 1001, P - 1, P, P + 16, P + 17, P + 18, P + 399, P + 400, 2 * P, 2 * P + 401, 3 * P + 9,
              3 * P + 10, 4 * P, 4 * P + 100});
  // Each segment's counts follow its own weights: over segment 3 (P + 400 .. 3P + 9) source 0
  // got 3/5 of the samples (to within the greedy bound, one sample per period).
  const auto a = schedule.counts(P + 400), b = schedule.counts(3 * P + 9);
  CHECK(std::abs(double(b[0] - a[0]) - 0.6 * double(2 * P - 391)) <= 3.0);
}

TEST_CASE("continuing a blend history: rewinds, a change at the same sample, a return to earlier weights",
          "[data][sampler][blend]") {
  const std::vector<BlendSegment> h = {{0, {0.7, 0.3}}, {160, {0.5, 0.5}}, {320, {0.2, 0.8}}};
  // A rewind to sample 200 with other weights: the segment from 320 belongs to the abandoned run.
  CHECK(BlendSchedule::continued(h, 200, {0.1, 0.9}) ==
        std::vector<BlendSegment>{{0, {0.7, 0.3}}, {160, {0.5, 0.5}}, {200, {0.1, 0.9}}});
  // A segment that starts at the resumed sample read nothing: new weights replace it, and weights
  // equal to the segment before it drop it (that segment simply goes on).
  CHECK(BlendSchedule::continued(h, 320, {0.4, 0.6}) ==
        std::vector<BlendSegment>{{0, {0.7, 0.3}}, {160, {0.5, 0.5}}, {320, {0.4, 0.6}}});
  CHECK(BlendSchedule::continued(h, 320, {0.5, 0.5}) ==
        std::vector<BlendSegment>{{0, {0.7, 0.3}}, {160, {0.5, 0.5}}});
  CHECK(BlendSchedule::continued(h, 0, {1, 2}) == std::vector<BlendSegment>{{0, {1, 2}}});
  // Back to earlier weights later on is a new segment: the period restarts there.
  CHECK(BlendSchedule::continued(h, 400, {0.7, 0.3}).back() == BlendSegment{400, {0.7, 0.3}});
}

TEST_CASE("a blend history that cannot be followed is refused with the reason", "[data][sampler][blend][errors]") {
  CHECK_THROWS_WITH(BlendSchedule(std::vector<BlendSegment>{}), Contains("at least one segment"));
  CHECK_THROWS_WITH(BlendSchedule({{5, {1, 1}}}), Contains("must start at sample 0"));
  CHECK_THROWS_WITH(BlendSchedule({{0, {1, 1}}, {10, {1, 2}}, {10, {2, 1}}}),
                    Contains("segment 2 starts at sample 10, not after segment 1's 10"));
  CHECK_THROWS_WITH(BlendSchedule({{0, {1, 1}}, {10, {1, 2, 3}}}), Contains("segment 1 has 3 weights, segment 0 has 2"));
  CHECK_THROWS_WITH(BlendSchedule({{0, {1, 1}}, {10, {1, 0}}}),
                    Contains("the blend from sample 10: blend weight 1 is 0.000000"));
  TempDir dir;
  Sampler two(traced_sources(dir, {40, 40}, 4), {1, 1}, 3, true);
  CHECK_THROWS_WITH(two.set_blend_history({{0, {1, 1, 1}}}), Contains("history of 3 sources given to a blend of 2"));
  CHECK_THROWS(two.set_blend_history({{0, {1, 1}}, {0, {1, 2}}}));
  CHECK(two.blend_history() == std::vector<BlendSegment>{{0, {1, 1}}});  // a refused history changes nothing
  Sampler one(TokenDataset::open({dir / "shard_0.bin"}, 4, kTracedVocab), 3, true);
  CHECK_THROWS_WITH(one.set_blend_history({{0, {1, 1}}}), Contains("sampler of one source"));
  CHECK(one.samples_per_source(17) == std::vector<int64_t>{17});
}

TEST_CASE("a blended sampler whose weights change reads each source's shuffled walk on, without repeats",
          "[data][sampler][blend]") {
  TempDir dir;
  const int L = 4;
  // Source 0: 50 windows, source 1: 60; shuffled. The reference never changes its weights and
  // reads long enough that each of its sources' walks covers the changed sampler's.
  Sampler reference(traced_sources(dir, {201, 241}, L), {0.7, 0.3}, 9, true);
  Sampler changed(traced_sources(dir, {201, 241}, L), {0.5, 0.5}, 9, true);
  changed.set_blend_history({{0, {0.7, 0.3}}, {160, {0.5, 0.5}}, {230, {0.1, 0.9}}});
  CHECK(changed.weight(1) == Approx(0.9));  // the current shares
  CHECK(changed.samples_per_source(230) == std::vector<int64_t>{147, 83});  // 112 + 35, 48 + 35
  std::vector<std::vector<int64_t>> want(2), got(2);
  for (int64_t i = 0; i < 1000; ++i) {
    const Sampler::Location r = reference.locate(i);
    want[r.source].push_back(r.window);
  }
  std::vector<int32_t> in(L), tgt(L);
  for (int64_t i = 0; i < 330; ++i) {
    const Sampler::Location c = changed.locate(i);
    if (i < 160) {  // before the first change: what the run always read
      const Sampler::Location r = reference.locate(i);
      REQUIRE((c.source == r.source && c.local == r.local && c.window == r.window));
    }
    got[c.source].push_back(c.window);
    changed.fill(i, 1, in.data(), tgt.data());  // and the tokens come from that window of that source
    REQUIRE(in[0] == static_cast<int32_t>(traced_token(c.source, changed.source(c.source).locate(c.window).start)));
  }
  // Each source's windows are its uninterrupted walk's, in order: none read twice, none skipped
  // (within each epoch of the walk, every window once).
  for (size_t d = 0; d < 2; ++d) {
    INFO("source " << d);
    REQUIRE(got[d].size() <= want[d].size());
    CHECK(got[d] == std::vector<int64_t>(want[d].begin(), want[d].begin() + static_cast<long>(got[d].size())));
  }
  CHECK(got[1].size() == 83 + 90);  // 9/10 of the last 100
}
