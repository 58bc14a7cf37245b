#include "kernels/alibi.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace keel {

std::vector<float> alibi_slopes(int n_heads) {
  if (n_heads <= 0) throw std::invalid_argument("alibi_slopes: n_heads must be positive, got " + std::to_string(n_heads));
  int p = 1;
  while (p * 2 <= n_heads) p *= 2;
  std::vector<float> slopes;
  slopes.reserve(static_cast<size_t>(n_heads));
  for (int h = 0; h < p; ++h) slopes.push_back(static_cast<float>(std::exp2(-8.0 * (h + 1) / p)));
  for (int k = 0; k < n_heads - p; ++k) slopes.push_back(static_cast<float>(std::exp2(-4.0 * (2 * k + 1) / p)));
  return slopes;
}

}  // namespace keel
