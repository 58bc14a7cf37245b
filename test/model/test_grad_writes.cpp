// GradWrites: which gradients a step has written, so the first contribution stores and the
// rest add, and finish_step zero-fills the rest.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "model/grad_writes.h"

using namespace keel;

namespace {
struct Buffer {
  std::vector<float> v;
  Tensor t;
  explicit Buffer(int64_t n) : v(static_cast<size_t>(n), std::nanf("")), t(v.data(), DType::F32, {n}) {}
  Tensor at(int64_t b, int64_t e) const { return t.elements(b, e); }
  bool all_nan(int64_t b, int64_t e) const {
    for (int64_t i = b; i < e; ++i)
      if (!std::isnan(v[static_cast<size_t>(i)])) return false;
    return true;
  }
  bool all_zero(int64_t b, int64_t e) const {
    for (int64_t i = b; i < e; ++i)
      if (v[static_cast<size_t>(i)] != 0.0f) return false;
    return true;
  }
};
}  // namespace

TEST_CASE("GradWrites: the first contribution stores, later ones add, the rest is zero-filled", "[grad_writes]") {
  auto be = make_cpu_backend();
  Buffer g(100);
  GradWrites w(*be, g.t);
  // Before any step everything counts as written (and was zero-filled): ops add.
  CHECK(g.all_zero(0, 100));
  CHECK(w.must_add(g.at(10, 20)));

  std::fill(g.v.begin(), g.v.end(), std::nanf(""));  // what a previous step left, as garbage
  w.begin_step();
  CHECK(w.written() == 0);
  CHECK_FALSE(w.must_add(g.at(10, 20)));  // first: store
  CHECK(w.must_add(g.at(10, 20)));        // second: add
  CHECK(g.all_nan(10, 20));               // nothing was filled: the op stores itself
  CHECK_FALSE(w.must_add({g.at(30, 35), Tensor(), g.at(40, 41)}));  // empty views are skipped
  CHECK(w.written() == 16);

  SECTION("a view partly written is zero-filled where it was not, then added to") {
    CHECK(w.must_add(g.at(15, 25)));
    CHECK(g.all_nan(15, 20));
    CHECK(g.all_zero(20, 25));
    CHECK(w.written() == 21);
  }
  SECTION("a group with one member written: all add, the unwritten ones zero-filled") {
    CHECK(w.must_add({g.at(50, 60), g.at(30, 35)}));
    CHECK(g.all_zero(50, 60));
    CHECK(g.all_nan(30, 35));
  }
  SECTION("prepare_to_add (a scatter) zero-fills only the gaps") {
    w.prepare_to_add(g.at(0, 50));
    CHECK(g.all_zero(0, 10));
    CHECK(g.all_nan(10, 20));
    CHECK(g.all_zero(20, 30));
    CHECK(g.all_nan(30, 35));
    CHECK(g.all_zero(35, 40));
    CHECK(g.all_nan(40, 41));
    CHECK(g.all_zero(41, 50));
    CHECK(g.all_nan(50, 100));
  }
  SECTION("finish_step zero-fills everything unwritten; then ops add until the next step") {
    w.finish_step();
    CHECK(w.written() == 100);
    CHECK(g.all_zero(0, 10));
    CHECK(g.all_nan(10, 20));
    CHECK(g.all_zero(20, 30));
    CHECK(g.all_zero(41, 100));
    CHECK(w.must_add(g.at(0, 100)));
    w.begin_step();
    CHECK_FALSE(w.must_add(g.at(0, 100)));
  }
  SECTION("adjacent writes merge") {
    CHECK_FALSE(w.must_add(g.at(20, 30)));
    CHECK_FALSE(w.must_add(g.at(35, 40)));
    CHECK(w.must_add(g.at(10, 41)));  // all written now: nothing to fill
    CHECK(g.all_nan(10, 41));
  }
}

TEST_CASE("GradWrites: a tensor outside the gradient buffer is a logic error naming both", "[grad_writes]") {
  auto be = make_cpu_backend();
  Buffer g(10), other(10);
  GradWrites w(*be, g.t);
  CHECK_THROWS_WITH(w.must_add(other.t), Catch::Contains("is not a view of the gradient buffer") &&
                                             Catch::Contains("[10] f32"));
  std::vector<uint16_t> half(4);
  CHECK_THROWS_AS(w.must_add(Tensor(half.data(), DType::BF16, {4})), std::logic_error);
  CHECK_THROWS_AS(GradWrites(*be, Tensor(half.data(), DType::BF16, {4})), std::invalid_argument);
}
