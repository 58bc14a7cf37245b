// The CUDA emulator's cub::DeviceRadixSort::SortPairs (the one cub call keel makes): a stable
// sort of (key, value) pairs by the key bits [begin_bit, end_bit), on the host. The size query
// (temp == nullptr) asks for one byte, so the caller's temporary allocation is exercised too.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace cub {

struct DeviceRadixSort {
  template <class K, class V>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, int n, int begin_bit = 0, int end_bit = sizeof(K) * 8,
                               cudaStream_t = nullptr, bool = false) {
    if (temp == nullptr) {
      temp_bytes = 1;
      return cudaSuccess;
    }
    const unsigned long long width = static_cast<unsigned long long>(end_bit - begin_bit);
    const unsigned long long mask = width >= 64 ? ~0ull : (1ull << width) - 1;
    auto bits = [&](K k) { return (static_cast<unsigned long long>(k) >> begin_bit) & mask; };
    std::vector<int> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return bits(keys_in[x]) < bits(keys_in[y]); });
    std::vector<K> k(static_cast<size_t>(n));
    std::vector<V> v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      k[static_cast<size_t>(i)] = keys_in[order[static_cast<size_t>(i)]];
      v[static_cast<size_t>(i)] = values_in[order[static_cast<size_t>(i)]];
    }
    std::copy(k.begin(), k.end(), keys_out);
    std::copy(v.begin(), v.end(), values_out);
    return cudaSuccess;
  }
};

}  // namespace cub
