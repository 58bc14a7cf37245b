// CPU backend matmul throughput (a benchmark, not a test): GFLOP/s by wall time and per core
// (process CPU time, which a shared machine still measures reliably).
//   build/bench/bench_cpu_matmul
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>

#include "kernels/backend.h"

int main() {
  using namespace keel;
  auto be = make_cpu_backend();
  struct Size {
    int64_t M, N, K;
    bool ta, tb;
  };
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (Size s : {Size{1024, 512, 128, false, false}, Size{1024, 512, 128, false, true},
                 Size{1024, 512, 128, true, false}, Size{1024, 1536, 512, false, true},
                 Size{512, 512, 4096, true, false}, Size{2048, 2048, 2048, false, false}}) {
    std::vector<float> a(static_cast<size_t>(s.M * s.K)), b(static_cast<size_t>(s.K * s.N)),
        c(static_cast<size_t>(s.M * s.N));
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    Tensor ta = s.ta ? Tensor(a.data(), DType::F32, {s.K, s.M}) : Tensor(a.data(), DType::F32, {s.M, s.K});
    Tensor tb = s.tb ? Tensor(b.data(), DType::F32, {s.N, s.K}) : Tensor(b.data(), DType::F32, {s.K, s.N});
    Tensor out(c.data(), DType::F32, {s.M, s.N});
    be->matmul(out, ta, tb, s.ta, s.tb);  // warm up (packing buffers, pages)
    int reps = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    double elapsed = 0;
    do {
      be->matmul(out, ta, tb, s.ta, s.tb);
      ++reps;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (elapsed < 1.0);
    const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    const double flop = 2.0 * s.M * s.N * s.K * reps;
    std::printf("matmul M=%lld N=%lld K=%lld ta=%d tb=%d threads=%d: %.1f GFLOP/s wall, %.1f GFLOP/s per core\n",
                static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), s.ta, s.tb,
                omp_get_max_threads(), flop / elapsed / 1e9, flop / cpu / 1e9);
  }
}
