// Memory, convert/fill/add/scale and whole-tensor reductions.
#include <cstdint>

#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;

TEST_CASE("allocate gives zeroed 64-byte aligned memory, copies are raw bytes", "[memory]") {
  auto be = make_cpu_backend();
  CHECK(be->device() == Device::CPU);
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{4096}, size_t{100000}}) {
    void* p = be->allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
    const auto* c = static_cast<const unsigned char*>(p);
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += c[i] != 0;
    CHECK(nonzero == 0);
    be->release(p);
  }
  const std::vector<float> src = randn(37, 1);
  void* mem = be->allocate(37 * 2);
  Tensor t(mem, DType::BF16, {37});
  std::vector<uint16_t> host(37), back(37);
  for (int i = 0; i < 37; ++i) host[i] = f32_to_bf16(src[i]);
  be->copy_from_host(t, host.data());
  be->copy_to_host(back.data(), t);
  CHECK(back == host);
  be->release(mem);
}

// Outputs are the fp32 result rounded once to the output dtype: compared bit for bit.
TEST_CASE("convert, fill, add, scale round once to the output dtype", "[elementwise]") {
  auto be = make_cpu_backend();
  const int64_t n = 5000;  // several chunks
  std::vector<float> a = randn(n, 1, 1000.0f), b = randn(n, 2, 1000.0f);
  a[0] = 70000.0f;  // above fp16 max
  a[1] = -65520.0f;
  b[0] = b[1] = 0.0f;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(dt));
    HostTensor src = make(DType::F32, {n}, a), other = make(DType::F32, {n}, b), out(dt, {n});
    int bad = 0;
    be->convert(out.t, src.t);
    for (int64_t i = 0; i < n; ++i) bad += out.at(i) != round_to(dt, a[i]);
    be->add(out.t, src.t, other.t);
    for (int64_t i = 0; i < n; ++i) bad += out.at(i) != round_to(dt, a[i] + b[i]);
    be->convert(out.t, src.t);
    be->scale(out.t, 0.37f);
    for (int64_t i = 0; i < n; ++i) bad += out.at(i) != round_to(dt, round_to(dt, a[i]) * 0.37f);
    be->fill(out.t, 1.0f + 1e-4f);
    for (int64_t i = 0; i < n; ++i) bad += out.at(i) != round_to(dt, 1.0f + 1e-4f);
    CHECK(bad == 0);
    if (dt == DType::F16) {
      be->convert(out.t, src.t);
      CHECK(out.at(0) == INFINITY);
      CHECK(out.at(1) == -INFINITY);
    }
  }
  // mixed input dtypes: bf16 + fp16 into fp32
  HostTensor x = make(DType::BF16, {n}, a), y = make(DType::F16, {n}, b), z(DType::F32, {n});
  be->add(z.t, x.t, y.t);
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += z.at(i) != x.at(i) + y.at(i);
  CHECK(bad == 0);
}

// sum and sum_squares accumulate in double: tolerance 1e-12 against a plain double loop (the
// only difference is the order of double additions).
TEST_CASE("sum, sum_squares, max_abs, count_nonfinite, count_zeros", "[reductions]") {
  auto be = make_cpu_backend();
  const int64_t n = 100003;  // ragged last block
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(dt));
    HostTensor x = make(dt, {n}, randn(n, 3, 5.0f));
    double s = 0, ss = 0, mx = 0;
    for (int64_t i = 0; i < n; ++i) {
      s += x.at(i);
      ss += static_cast<double>(x.at(i)) * x.at(i);
      mx = std::max(mx, std::fabs(static_cast<double>(x.at(i))));
    }
    CHECK(std::fabs(be->sum(x.t) - s) <= 1e-12 * ss);
    CHECK(std::fabs(be->sum_squares(x.t) - ss) <= 1e-12 * ss);
    CHECK(be->max_abs(x.t) == mx);
    CHECK(be->count_nonfinite(x.t) == 0);

    x.put(5, 0.0f);
    x.put(99999, -0.0f);
    x.put(77, INFINITY);
    x.put(100002, -INFINITY);
    const int64_t zeros_before = [&] {
      int64_t z = 0;
      for (int64_t i = 0; i < n; ++i) z += x.at(i) == 0.0f;
      return z;
    }();
    CHECK(be->count_zeros(x.t) == zeros_before);
    CHECK(be->count_nonfinite(x.t) == 2);
    CHECK(be->max_abs(x.t) == INFINITY);
    x.put(50000, NAN);
    CHECK(std::isnan(be->max_abs(x.t)));
    CHECK(be->count_nonfinite(x.t) == 3);
    CHECK(std::isnan(be->sum(x.t)));
  }
  HostTensor empty(DType::F32, {0});
  CHECK(be->sum(empty.t) == 0.0);
  CHECK(be->max_abs(empty.t) == 0.0f);
}
