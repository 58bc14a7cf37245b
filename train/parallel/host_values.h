// Small host values combined over the ranks of a group: per-layer maxima, per-tensor sums, a
// line of text from every rank. The values travel through a temporary tensor on the backend's
// device, since a device communicator (NcclComm) moves device memory only. Not for the hot
// path: each call allocates and synchronises.
#pragma once

#include <string>
#include <vector>

#include "kernels/backend.h"
#include "train/parallel/comm.h"

namespace keel::parallel {

// Elementwise sum; each double travels as hi + lo fp32 parts, both summed (in rank order on
// MpiComm). Where one rank holds a value and the others zero (the last pipeline stage's loss,
// a rank's own entries), it arrives to ~2^-48 relative; a sum of several non-zero values is
// rounded once to fp32 (~2^-24 of the total) in its high parts.
std::vector<double> sum_over_ranks(Comm& c, Backend& be, const std::vector<double>& x);

// Elementwise max that keeps NaN: a NaN on any rank gives NaN. NCCL's float max is fmaxf and
// returns the other operand, so a NaN is carried as a 0/1 flag beside the values.
std::vector<float> max_over_ranks(Comm& c, Backend& be, const std::vector<float>& x);

// Every rank's text, in rank order; each is cut to 1023 bytes.
std::vector<std::string> gather_text(Comm& c, Backend& be, const std::string& mine);

}  // namespace keel::parallel
