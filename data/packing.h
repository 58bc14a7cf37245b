// Packing whole documents into training windows (keel tokenize --pack T).
//
// keel's sampler cuts a token file into windows of T inputs (data/sampler.h: window k holds
// tokens kT .. kT+T, the last one only as a target), so a document that runs across a window
// boundary is cut in two. For pretraining text that is harmless; for instruction data it is
// not: the second half of a reply is trained without the prompt it answers. Packed files hold
// whole documents instead: each window is a set of documents followed by padding, and no
// document crosses a window.
//
// The documents of a pool are placed by best-fit decreasing (longest first, each into the
// fullest window that still has room, else a new window), which leaves little padding: it
// needs at most 11/9 of the optimal number of windows plus a constant (Johnson 1973), and in
// practice a few percent more than the total length. Ties are broken by the order of the input, so the layout is a
// pure function of the lengths.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace keel::data {

// What to do with a document longer than a window.
enum class PackOverflow {
  drop,      // leave it out (instruction data: a piece of a conversation teaches the wrong thing)
  truncate,  // keep its first window's worth
  split,     // cut it into window-sized pieces, each a document of its own (pretraining text)
};
std::string_view pack_overflow_name(PackOverflow p);

// Best-fit decreasing: the windows (each a list of indices into `lengths`, in the order they
// were placed) that hold every item of length 1..capacity. Windows come in the order they were
// opened. Throws std::invalid_argument for an item longer than the capacity or not positive.
std::vector<std::vector<size_t>> best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity);

}  // namespace keel::data
