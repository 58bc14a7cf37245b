// Host values combined over ranks (train/parallel/host_values.h), through a two-rank group whose
// other rank is simulated: its Max is fmaxf, as NCCL's float max is, so a NaN on one rank is
// dropped by the reduction itself and must survive through the flag.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "train/parallel/host_values.h"

using namespace keel;
using namespace keel::parallel;

namespace {

// Rank 0 of two; the peer's contribution to each collective is `peer` (F32 or I32 elements,
// or the peer's bytes for all_gather).
class TwoRankComm final : public Comm {
 public:
  std::vector<float> peer;
  std::string peer_text;
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view name() const override { return "world"; }
  Device device() const override { return Device::CPU; }
  void all_reduce(const Tensor& t, ReduceOp op) override {
    REQUIRE(t.dtype == DType::F32);
    REQUIRE(static_cast<size_t>(t.numel()) == peer.size());
    float* x = static_cast<float*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i)
      x[i] = op == ReduceOp::Sum ? x[i] + peer[static_cast<size_t>(i)] : std::fmax(x[i], peer[static_cast<size_t>(i)]);
  }
  void all_gather(const Tensor& out, const Tensor& in) override {
    const size_t bytes = static_cast<size_t>(in.numel()) * 4;
    REQUIRE(static_cast<size_t>(out.numel()) * 4 == 2 * bytes);
    std::memcpy(out.data, in.data, bytes);
    char* theirs = static_cast<char*>(out.data) + bytes;
    std::memset(theirs, 0, bytes);
    std::memcpy(theirs, peer_text.data(), std::min(peer_text.size(), bytes - 1));
  }
  void reduce_scatter(const Tensor&, const Tensor&) override { FAIL("not used"); }
  void reduce(const Tensor&, int) override { FAIL("not used"); }
  void broadcast(const Tensor&, int) override { FAIL("not used"); }
  void send(const Tensor&, int) override { FAIL("not used"); }
  void recv(const Tensor&, int) override { FAIL("not used"); }
  void sendrecv(const Tensor&, int, const Tensor&, int) override { FAIL("not used"); }
  void barrier() override {}
};

}  // namespace

TEST_CASE("max over ranks keeps a NaN that an fmaxf reduction drops", "[parallel][host_values]") {
  CpuBackend be;
  TwoRankComm c;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Per element: NaN here, NaN there, both, neither (each side larger once), inf against NaN.
  const std::vector<float> mine{nan, 1.0f, nan, 3.0f, 0.5f, inf};
  // The flags go through the same all_reduce, after the values.
  c.peer = {2.0f, nan, nan, 2.5f, 4.0f, nan};
  c.peer.resize(12, 0.0f);
  for (size_t i = 0; i < 6; ++i) c.peer[6 + i] = std::isnan(c.peer[i]) ? 1.0f : 0.0f;
  for (size_t i = 0; i < 6; ++i) if (std::isnan(c.peer[i])) c.peer[i] = -inf;
  const std::vector<float> got = max_over_ranks(c, be, mine);
  REQUIRE(got.size() == 6);
  CHECK(std::isnan(got[0]));
  CHECK(std::isnan(got[1]));
  CHECK(std::isnan(got[2]));
  CHECK(got[3] == 3.0f);
  CHECK(got[4] == 4.0f);
  CHECK(std::isnan(got[5]));

  // The plain fmaxf reduction this guards against: NaN vanishes.
  std::vector<float> raw{nan, 1.0f};
  c.peer = {2.0f, nan};
  c.all_reduce(Tensor(raw.data(), DType::F32, {2}), ReduceOp::Max);
  CHECK(raw == std::vector<float>{2.0f, 1.0f});
}

TEST_CASE("sum over ranks: a value beside zeros arrives at double precision", "[parallel][host_values]") {
  CpuBackend be;
  TwoRankComm c;
  const double x = 1.0 + 1e-12, y = 12345.678901234;
  // The peer holds zeros for the first two entries (as the other pipeline stages do for the
  // last stage's loss) and 3.25 (exact in fp32) beside y, as its hi/lo parts.
  c.peer = {0.0f, 0.0f, 0.0f, 0.0f, 3.25f, 0.0f};
  const std::vector<double> got = sum_over_ranks(c, be, {x, -y, y});
  REQUIRE(got.size() == 3);
  CHECK(std::abs(got[0] - x) < 1e-15);  // fp32 alone would give 1.0
  CHECK(std::abs(got[1] + y) < 1e-11);
  // Two non-zero values: the high parts' sum is rounded to fp32 (2^-24 of 12348.9).
  CHECK(std::abs(got[2] - (y + 3.25)) < 12348.93 * 0x1p-24);
}

TEST_CASE("gather_text returns every rank's line in rank order", "[parallel][host_values]") {
  CpuBackend be;
  TwoRankComm c;
  c.peer_text = "rank 1 says hello";
  const std::vector<std::string> got = gather_text(c, be, std::string(2000, 'x'));
  REQUIRE(got.size() == 2);
  CHECK(got[0] == std::string(1023, 'x'));  // cut to 1023 bytes
  CHECK(got[1] == "rank 1 says hello");
}
