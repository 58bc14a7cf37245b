// A world of one rank (no MPI at all), the argument checks every communicator shares, and the
// host reduction arithmetic MpiComm uses (fp32 in rank order, one rounding).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/scoped_env.h"
#include "train/parallel/comm.h"
#include "train/parallel/mpi_comm.h"

using namespace keel;
using namespace keel::parallel;

TEST_CASE("local comm: collectives of one rank are copies or no-ops", "[parallel][comm]") {
  LocalComm c("dp");
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.name() == "dp");
  std::vector<float> a{1.5f, -2.f, 3.f}, b(3, 0.f);
  Tensor ta(a.data(), DType::F32, {3}), tb(b.data(), DType::F32, {3});
  c.all_reduce(ta, ReduceOp::Sum);
  c.all_reduce(ta, ReduceOp::Max);
  CHECK(a == std::vector<float>{1.5f, -2.f, 3.f});
  c.reduce_scatter(tb, ta);
  CHECK(b == a);
  std::fill(b.begin(), b.end(), 0.f);
  c.all_gather(tb, ta);
  CHECK(b == a);
  c.all_gather(ta, ta);  // in place
  c.broadcast(ta, 0);
  c.reduce(ta, 0);
  c.reduce_async(ta, 0);
  c.join_async();
  c.barrier();
  CHECK(a == std::vector<float>{1.5f, -2.f, 3.f});
  CHECK_THROWS_WITH(c.broadcast(ta, 1), Catch::Contains("root 1 is not a rank of the group"));
  CHECK_THROWS_WITH(c.reduce(ta, 1), Catch::Contains("reduce on dp (size 1): root 1 is not a rank of the group"));
  CHECK_THROWS_WITH(c.send(ta, 0), Catch::Contains("to itself"));
  CHECK_THROWS_WITH(c.recv(ta, 1), Catch::Contains("peer 1"));
}

TEST_CASE("comm argument checks name the collective, the group and the shapes", "[parallel][comm]") {
  LocalComm c("tp");
  std::vector<float> a(12), b(5);
  std::vector<uint16_t> h(12);
  Tensor t12(a.data(), DType::F32, {12}), t5(b.data(), DType::F32, {5}), h12(h.data(), DType::BF16, {12});
  CHECK_THROWS_WITH(c.reduce_scatter(t5, t12), Catch::Contains("reduce_scatter on tp (size 1)") &&
                                                   Catch::Contains("must hold 1 x out [5] f32 = 5 elements"));
  CHECK_THROWS_WITH(c.all_gather(t5, t12), Catch::Contains("all_gather on tp"));
  CHECK_THROWS_WITH(c.reduce_scatter(h12, t12), Catch::Contains("differ in dtype"));
  Tensor dev(a.data(), DType::F32, {12}, Device::CUDA);
  CHECK_THROWS_WITH(c.all_reduce(dev), Catch::Contains("device memory") && Catch::Contains("moves host memory"));
  // The per-rank block may be the whole's own block (in place), not some other overlap.
  Tensor out11(a.data(), DType::F32, {11}), in11(a.data() + 1, DType::F32, {11});
  CHECK_THROWS_WITH(c.all_gather(out11, in11), Catch::Contains("all_gather on tp") &&
                                                   Catch::Contains("in overlaps out but is not this rank's block 0"));
  CHECK_THROWS_WITH(c.reduce_scatter(in11, out11), Catch::Contains("reduce_scatter on tp") &&
                                                       Catch::Contains("out overlaps in but is not this rank's block 0"));
  CHECK_NOTHROW(c.all_gather(out11, out11));  // in place
}

TEST_CASE("comm groups: a world of one without MPI", "[parallel][comm]") {
  if (LaunchInfo::from_environment().launched()) {
    WARN("skipped: this test process was started by an MPI launcher");
    return;
  }
  MpiRuntime rt;
  CHECK_FALSE(rt.active());
  CHECK(rt.world_size() == 1);
  Grid g(1, 0, 1, 1, 1);
  CommGroups comms = make_host_comms(g, rt);
  for (GroupKind k : kAllGroups) {
    CHECK(comms[k].size() == 1);
    CHECK(comms[k].name() == group_name(k));
  }
  // A grid of more ranks than the process has is an error that says how to launch it.
  CHECK_THROWS_WITH(make_host_comms(Grid(2, 0, 1, 1, 2), rt), Catch::Contains("mpirun -np 2"));
}

TEST_CASE("comm timeout: KEEL_COMM_TIMEOUT", "[parallel][comm]") {
  const keel::test::ScopedEnv env("KEEL_COMM_TIMEOUT");
  env.set(nullptr);
  CHECK(default_comm_timeout() == 600.0);
  env.set("2.5");
  CHECK(default_comm_timeout() == 2.5);
  env.set("0");
  CHECK(default_comm_timeout() == 0.0);
  env.set("ten");
  CHECK_THROWS_WITH(default_comm_timeout(), Catch::Contains("KEEL_COMM_TIMEOUT=\"ten\""));
}

namespace {

uint16_t bf(float f) { return f32_to_bf16(f); }

}  // namespace

TEST_CASE("host reduction: bf16/f16 sum in fp32 then one rounding, in rank order", "[parallel][comm]") {
  std::vector<float> scratch(4);
  SECTION("bf16: 1 + 2^-8 + 2^-8 is 1 + 2^-7, which per-step rounding would lose") {
    // Rounded at each step, 1 + 2^-8 is a tie that rounds to even (1.0), and so is the next.
    std::vector<uint16_t> r0{bf(1.f)}, r1{bf(0x1p-8f)}, r2{bf(0x1p-8f)}, out(1);
    const void* src[] = {r0.data(), r1.data(), r2.data()};
    reduce_host(out.data(), src, 3, DType::BF16, 1, ReduceOp::Sum, scratch.data());
    CHECK(bf16_to_f32(out[0]) == 1.f + 0x1p-7f);
  }
  SECTION("f16: the same at f16's spacing") {
    std::vector<uint16_t> r0{f32_to_f16(1.f)}, r1{f32_to_f16(0x1p-11f)}, r2{f32_to_f16(0x1p-11f)}, out(1);
    const void* src[] = {r0.data(), r1.data(), r2.data()};
    reduce_host(out.data(), src, 3, DType::F16, 1, ReduceOp::Sum, scratch.data());
    CHECK(f16_to_f32(out[0]) == 1.f + 0x1p-10f);
  }
  SECTION("f32: the order is rank order, ((r0 + r1) + r2)") {
    std::vector<float> r0{1e8f}, r1{-1e8f}, r2{1.f}, out(1);
    const void* src[] = {r0.data(), r1.data(), r2.data()};
    reduce_host(out.data(), src, 3, DType::F32, 1, ReduceOp::Sum, nullptr);
    CHECK(out[0] == 1.f);  // (r1 + r2) + r0 would give 0
  }
  SECTION("max propagates NaN; i32 sums exactly and wraps") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> r0{1.f, nan}, r1{nan, 2.f}, r2{3.f, 5.f}, out(2);
    const void* src[] = {r0.data(), r1.data(), r2.data()};
    reduce_host(out.data(), src, 3, DType::F32, 2, ReduceOp::Max, nullptr);
    CHECK(std::isnan(out[0]));
    CHECK(std::isnan(out[1]));
    std::vector<int32_t> i0{2147483647, 5}, i1{1, -7}, iout(2);
    const void* isrc[] = {i0.data(), i1.data()};
    reduce_host(iout.data(), isrc, 2, DType::I32, 2, ReduceOp::Sum, nullptr);
    CHECK(iout[0] == std::numeric_limits<int32_t>::min());
    CHECK(iout[1] == -2);
  }
}
