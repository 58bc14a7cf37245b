// Python's random.Random(seed) for the draws keel needs: Mersenne Twister MT19937 seeded as
// CPython seeds it from an int, getrandbits, and random.shuffle. keel tokenize uses it so that a
// seed splits documents into train and val exactly as scripts/prepare_data.py does.
//
// Facts used (CPython's Modules/_randommodule.c and Lib/random.py; Matsumoto & Nishimura 1998):
//   seed(n)        init_by_array over the 32-bit words of |n|, least significant first ([0] for 0)
//   getrandbits(k) k <= 32: the top k bits of one output; k > 32: 32-bit words, least
//                  significant word first, the last one shifted down to the bits left
//   shuffle(x)     for i = n-1 down to 1: j = randbelow(i + 1), swap x[i], x[j];
//                  randbelow(m) draws getrandbits(bit_length(m)) until the value is < m
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace keel::data {

class PythonRandom {
 public:
  explicit PythonRandom(uint64_t seed);

  uint32_t next_u32();             // one tempered MT19937 output (genrand_uint32)
  uint64_t getrandbits(int k);     // 1 <= k <= 64
  uint64_t randbelow(uint64_t n);  // uniform in [0, n), n >= 1

  template <class T>
  void shuffle(std::vector<T>& x) {
    for (std::size_t i = x.size(); i-- > 1;) std::swap(x[i], x[randbelow(i + 1)]);
  }

 private:
  static constexpr int kN = 624;
  void refill();
  std::array<uint32_t, kN> mt_{};
  int index_ = kN;
};

}  // namespace keel::data
