#include "kernels/document_positions.h"

namespace keel {

std::vector<int32_t> document_positions(const int32_t* tokens, int64_t N, int T, int32_t eod) {
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) pos[n] = (n % T == 0 || tokens[n - 1] == eod) ? 0 : pos[n - 1] + 1;
  return pos;
}

std::string document_positions_error(const int32_t* p, int64_t N, int T) {
  if (T <= 0 || N % T != 0)
    return std::to_string(N) + " rows are not whole sequences of T=" + std::to_string(T);
  for (int64_t n = 0; n < N; ++n) {
    if (n % T == 0 ? p[n] == 0 : (p[n] == 0 || p[n] == p[n - 1] + 1)) continue;
    return "positions[" + std::to_string(n) + "] = " + std::to_string(p[n]) + " is not a document position (" +
           (n % T == 0 ? std::string("each sequence starts at 0")
                       : "0 or positions[" + std::to_string(n - 1) + "] + 1 = " + std::to_string(p[n - 1] + 1)) +
           ")";
  }
  return "";
}

}  // namespace keel
