#include "data/packing.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>

namespace keel::data {

std::string_view pack_overflow_name(PackOverflow p) {
  switch (p) {
    case PackOverflow::drop: return "drop";
    case PackOverflow::truncate: return "truncate";
    case PackOverflow::split: return "split";
  }
  return "?";
}

std::vector<std::vector<size_t>> best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity) {
  std::vector<size_t> order(lengths.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<size_t>> windows;
  // Room left -> window, for the windows that have any. Equal room: the window opened first
  // (a multimap keeps equal keys in insertion order and lower_bound finds the first).
  std::multimap<int64_t, size_t> room;
  for (size_t i : order) {
    const int64_t len = lengths[i];
    if (len < 1 || len > capacity)
      throw std::invalid_argument("best_fit_decreasing: item " + std::to_string(i) + " has length " + std::to_string(len) +
                                  ", outside 1.." + std::to_string(capacity));
    auto it = room.lower_bound(len);  // the fullest window it fits in
    size_t w;
    int64_t left;
    if (it == room.end()) {
      w = windows.size();
      windows.emplace_back();
      left = capacity - len;
    } else {
      w = it->second;
      left = it->first - len;
      room.erase(it);
    }
    windows[w].push_back(i);
    if (left > 0) room.emplace(left, w);
  }
  return windows;
}

}  // namespace keel::data
