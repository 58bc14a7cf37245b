// The op-level profile's bookkeeping (KEEL_CUDA_PROFILE): sums per op and per (op, shapes), and
// a report ordered by time.
#include <catch2/catch.hpp>

#include "kernels/op_time_table.h"

using namespace keel;

TEST_CASE("op time table: sums per op and per shape, heaviest first", "[profile]") {
  OpTimeTable t;
  t.add("matmul", "out=[8, 16] bf16", 2.0);
  t.add("matmul", "out=[8, 16] bf16", 3.0);
  t.add("matmul", "out=[8, 32] bf16", 4.0);
  t.add("rmsnorm_forward", "out=[8, 16] bf16", 0.5);
  t.add("attention_forward", "qkv=[8, 48] bf16", 0.5);
  CHECK(t.calls("matmul") == 3);
  CHECK(t.ms("matmul") == Approx(9.0));
  CHECK(t.calls("adamw") == 0);
  CHECK(t.total_ms() == Approx(10.0));

  const std::string r = t.report(2);
  // op table: matmul (90%) before the two 0.5 ms ops, which keep name order
  const auto mm = r.find("matmul "), attn = r.find("attention_forward "), norm = r.find("rmsnorm_forward ");
  REQUIRE(mm != std::string::npos);
  REQUIRE(attn != std::string::npos);
  REQUIRE(norm != std::string::npos);
  CHECK(mm < attn);
  CHECK(attn < norm);
  CHECK(r.find("90.0%") != std::string::npos);
  CHECK(r.find("3000.0") != std::string::npos);  // mean us per matmul call
  // shape table: the two-call [8, 16] matmul (5 ms) first, then [8, 32] (4 ms); top 2 only
  const auto first = r.find("out=[8, 16] bf16"), second = r.find("out=[8, 32] bf16");
  REQUIRE(first != std::string::npos);
  REQUIRE(second != std::string::npos);
  CHECK(first < second);
  CHECK(r.find("2 x  matmul  out=[8, 16] bf16") != std::string::npos);
  CHECK(r.find("qkv=[8, 48]") == std::string::npos);
}
