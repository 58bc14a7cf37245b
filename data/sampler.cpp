#include "data/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace keel::data {

namespace {

// splitmix64's finalizer: a bijective 64-bit mix whose every output bit depends on every input
// bit, enough to serve as a Feistel round function and for key derivation.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr int kFeistelRounds = 6;  // 4 already give a strong permutation; 2 more mix small domains

}  // namespace

// ---- TokenDataset ------------------------------------------------------------------------

TokenDataset::TokenDataset(std::vector<TokenFile> files, int seq_len, uint32_t vocab_size, DataUse use, std::string field)
    : files_(std::move(files)), seq_len_(seq_len), vocab_size_(vocab_size), field_(std::move(field)) {
  if (seq_len < 1) throw DataError("sequence length must be at least 1, got " + std::to_string(seq_len));
  if (vocab_size < 1) throw DataError("vocab size must be at least 1");
  if (files_.empty()) throw DataError(prefix() + "no token files given");
  try {
    for (const TokenFile& f : files_) masks_.push_back(LossMask::open_for(f));
  } catch (const DataError& e) {
    throw DataError(prefix() + e.what());
  }
  window_offsets_.reserve(files_.size() + 1);
  window_offsets_.push_back(0);
  const TokenFile* largest = &files_.front();
  for (const TokenFile& f : files_) {
    // A window needs seq_len + 1 tokens; consecutive windows share no tokens, so the last
    // target of one window is not the first input of the next.
    window_offsets_.push_back(window_offsets_.back() + (f.num_tokens() - 1) / seq_len);
    num_tokens_ += f.num_tokens();
    if (f.num_tokens() > largest->num_tokens()) largest = &f;
  }
  if (num_windows() == 0) {
    throw DataError(prefix() + (use == DataUse::validation ? "no validation windows" : "no training windows") +
                    ": a window needs seq_len + 1 = " + std::to_string(seq_len + 1) + " tokens, but the largest of the " +
                    std::to_string(files_.size()) + " token file(s), '" + largest->path() + "', has only " +
                    std::to_string(largest->num_tokens()) + ". Lower train.seq_len, or give the " +
                    (use == DataUse::validation ? "validation split more data (keel tokenize --val-fraction)"
                                                : "run more data") +
                    (use == DataUse::validation && !field_.empty() ? ", or leave " + field_ + " out" : ""));
  }
}

TokenDataset TokenDataset::open(const std::vector<std::string>& paths, int seq_len, uint32_t vocab_size, DataUse use,
                                const std::string& field) {
  std::vector<TokenFile> files;
  files.reserve(paths.size());
  for (const std::string& p : paths) {
    try {
      files.push_back(TokenFile::open(p));
    } catch (const DataError& e) {
      if (field.empty()) throw;
      throw DataError(field + ": " + e.what());
    }
  }
  return TokenDataset(std::move(files), seq_len, vocab_size, use, field);
}

TokenDataset::WindowLocation TokenDataset::locate(int64_t window) const {
  if (window < 0 || window >= num_windows()) {
    throw DataError("window " + std::to_string(window) + " is outside [0, " + std::to_string(num_windows()) + ")");
  }
  // The file whose range [off[f], off[f+1]) holds the window; files with no windows have an
  // empty range and are skipped by upper_bound.
  auto it = std::upper_bound(window_offsets_.begin(), window_offsets_.end(), window);
  size_t f = static_cast<size_t>(it - window_offsets_.begin()) - 1;
  return {f, (window - window_offsets_[f]) * seq_len_};
}

size_t TokenDataset::num_masked_files() const {
  size_t n = 0;
  for (const auto& m : masks_) n += m.has_value();
  return n;
}

bool TokenDataset::check_vocab(int64_t max_tokens) const {
  if (num_tokens_ > max_tokens) return false;
  for (const TokenFile& f : files_) {
    const int64_t at = f.find_token_at_least(vocab_size_, 0, f.num_tokens());
    if (at >= 0) throw_out_of_vocab(f, f.token(at), at);
  }
  return true;
}

void TokenDataset::throw_out_of_vocab(const TokenFile& f, uint32_t token, int64_t position) const {
  throw DataError(prefix() + "'" + f.path() + "': token " + std::to_string(token) + " at position " +
                  std::to_string(position) + " is outside the vocabulary (vocab size " + std::to_string(vocab_size_) +
                  "); was the data tokenized for another model?");
}

void TokenDataset::read_window(int64_t window, int32_t* inputs, int32_t* targets) const {
  const WindowLocation loc = locate(window);
  const TokenFile& f = files_[loc.file];
  const size_t n = static_cast<size_t>(seq_len_);
  f.read(loc.start, seq_len_, inputs);
  std::memcpy(targets, inputs + 1, (n - 1) * sizeof(int32_t));
  targets[n - 1] = static_cast<int32_t>(f.token(loc.start + seq_len_));

  // Checked here, on every read, because an out-of-vocab id would index past the embedding
  // table; the loop is cheap next to the step that consumes these tokens.
  auto check = [&](int32_t value, int64_t position) {
    const auto token = static_cast<uint32_t>(value);
    if (token >= vocab_size_) throw_out_of_vocab(f, token, position);
  };
  for (size_t k = 0; k < n; ++k) check(inputs[k], loc.start + static_cast<int64_t>(k));
  check(targets[n - 1], loc.start + seq_len_);

  // Target k is token start + 1 + k of the file; the mask says whether it is learned.
  if (const auto& mask = masks_[loc.file])
    for (size_t k = 0; k < n; ++k)
      if (!mask->in_loss(loc.start + 1 + static_cast<int64_t>(k))) targets[k] = -1;
}

// ---- Blend -------------------------------------------------------------------------------

Blend::Blend(const std::vector<double>& weights) {
  if (weights.empty()) throw DataError("a blend needs at least one source");
  if (weights.size() > 65535) throw DataError("a blend takes at most 65535 sources");
  double total = 0;
  for (size_t d = 0; d < weights.size(); ++d) {
    if (!std::isfinite(weights[d]) || weights[d] <= 0)
      throw DataError("blend weight " + std::to_string(d) + " is " + std::to_string(weights[d]) +
                      " (weights must be positive and finite)");
    total += weights[d];
  }
  for (double w : weights) weights_.push_back(w / total);
  for (size_t d = 0; d < weights_.size(); ++d)
    if (weights_[d] * kPeriod < 1)
      throw DataError("blend weight " + std::to_string(d) + " is " + std::to_string(weights[d]) + ", " +
                      std::to_string(weights_[d]) + " of the total: below the smallest share a blend can give (1/" +
                      std::to_string(kPeriod) + ")");

  // The greedy assignment of one period: each position to the source furthest behind its share.
  per_period_.assign(weights_.size(), 0);
  source_of_.resize(static_cast<size_t>(kPeriod));
  rank_.resize(static_cast<size_t>(kPeriod));
  for (int64_t j = 0; j < kPeriod; ++j) {
    size_t best = 0;
    double best_deficit = -1e300;
    for (size_t d = 0; d < weights_.size(); ++d) {
      const double deficit = weights_[d] * static_cast<double>(j + 1) - static_cast<double>(per_period_[d]);
      if (deficit > best_deficit) best_deficit = deficit, best = d;
    }
    source_of_[static_cast<size_t>(j)] = static_cast<uint16_t>(best);
    rank_[static_cast<size_t>(j)] = static_cast<uint32_t>(per_period_[best]++);
  }
}

Blend::Pick Blend::pick(int64_t sample) const {
  const int64_t period = sample / kPeriod;
  const size_t j = static_cast<size_t>(sample % kPeriod);
  const size_t d = source_of_[j];
  return {d, period * per_period_[d] + rank_[j]};
}

std::vector<int64_t> Blend::counts(int64_t n) const {
  if (n < 0) throw DataError("sample count must be >= 0, got " + std::to_string(n));
  std::vector<int64_t> c(per_period_.size());
  const int64_t whole = n / kPeriod, rest = n % kPeriod;
  for (size_t d = 0; d < c.size(); ++d) c[d] = whole * per_period_[d];
  for (int64_t j = 0; j < rest; ++j) ++c[source_of_[static_cast<size_t>(j)]];
  return c;
}

// ---- BlendSchedule -----------------------------------------------------------------------

namespace {

// The weights as Blend normalizes them: two weight lists with the same normalized values build
// the same period tables, so a "change" between them changes nothing.
std::vector<double> normalized(const std::vector<double>& w) {
  double total = 0;
  for (double x : w) total += x;
  std::vector<double> n;
  for (double x : w) n.push_back(x / total);
  return n;
}

}  // namespace

BlendSchedule::BlendSchedule(std::vector<BlendSegment> segments) : segments_(std::move(segments)) {
  if (segments_.empty()) throw DataError("a blend's history needs at least one segment");
  if (segments_.front().from_sample != 0)
    throw DataError("a blend's history must start at sample 0, its first segment starts at sample " +
                    std::to_string(segments_.front().from_sample));
  for (size_t s = 0; s < segments_.size(); ++s) {
    const BlendSegment& seg = segments_[s];
    if (s > 0 && seg.from_sample <= segments_[s - 1].from_sample)
      throw DataError("a blend's history must go forward: segment " + std::to_string(s) + " starts at sample " +
                      std::to_string(seg.from_sample) + ", not after segment " + std::to_string(s - 1) + "'s " +
                      std::to_string(segments_[s - 1].from_sample));
    if (s > 0 && seg.weights.size() != segments_.front().weights.size())
      throw DataError("a blend's history must keep its sources: segment " + std::to_string(s) + " has " +
                      std::to_string(seg.weights.size()) + " weights, segment 0 has " +
                      std::to_string(segments_.front().weights.size()));
    try {
      blends_.emplace_back(seg.weights);
    } catch (const DataError& e) {
      throw DataError("the blend from sample " + std::to_string(seg.from_sample) + ": " + e.what());
    }
  }
  // Each segment starts every source where the one before left it.
  offsets_.assign(1, std::vector<int64_t>(num_sources(), 0));
  for (size_t s = 0; s + 1 < segments_.size(); ++s) {
    const std::vector<int64_t> got = blends_[s].counts(segments_[s + 1].from_sample - segments_[s].from_sample);
    std::vector<int64_t> next = offsets_[s];
    for (size_t d = 0; d < next.size(); ++d) next[d] += got[d];
    offsets_.push_back(std::move(next));
  }
}

// The last segment that starts at or before `sample` (the segments are few: a linear scan).
static size_t segment_of(const std::vector<BlendSegment>& segments, int64_t sample) {
  size_t s = segments.size() - 1;
  while (s > 0 && segments[s].from_sample > sample) --s;
  return s;
}

Blend::Pick BlendSchedule::pick(int64_t sample) const {
  const size_t s = segment_of(segments_, sample);
  Blend::Pick p = blends_[s].pick(sample - segments_[s].from_sample);
  p.local += offsets_[s][p.source];
  return p;
}

std::vector<int64_t> BlendSchedule::counts(int64_t n) const {
  if (n < 0) throw DataError("sample count must be >= 0, got " + std::to_string(n));
  const size_t s = segment_of(segments_, n);
  std::vector<int64_t> c = blends_[s].counts(n - segments_[s].from_sample);
  for (size_t d = 0; d < c.size(); ++d) c[d] += offsets_[s][d];
  return c;
}

std::vector<BlendSegment> BlendSchedule::continued(std::vector<BlendSegment> history, int64_t from,
                                                   const std::vector<double>& weights) {
  std::erase_if(history, [&](const BlendSegment& seg) { return seg.from_sample >= from; });
  if (history.empty() || normalized(history.back().weights) != normalized(weights))
    history.push_back({history.empty() ? 0 : from, weights});
  return history;
}

// ---- Sampler -----------------------------------------------------------------------------

Sampler::Sampler(TokenDataset dataset, uint64_t seed, bool shuffle) : shuffle_(shuffle) {
  sources_.push_back(make_source(std::move(dataset), seed));
}

Sampler::Sampler(std::vector<TokenDataset> sources, const std::vector<double>& weights, uint64_t seed, bool shuffle)
    : shuffle_(shuffle) {
  if (sources.size() != weights.size())
    throw DataError("a blend of " + std::to_string(sources.size()) + " sources got " + std::to_string(weights.size()) +
                    " weights");
  if (sources.size() > 1) blend_.emplace(std::vector<BlendSegment>{{0, weights}});
  for (size_t k = 0; k < sources.size(); ++k) {
    if (sources[k].seq_len() != sources.front().seq_len())
      throw DataError("the sources of a blend must have one sequence length");
    // Source 0 keeps the run's seed; the others get keys of their own.
    sources_.push_back(make_source(std::move(sources[k]), k == 0 ? seed : mix64(seed + k)));
  }
}

Sampler::Source Sampler::make_source(TokenDataset dataset, uint64_t seed) const {
  // Smallest even bit count 2h with 4^h >= W: the walk below then takes < 4 steps on average.
  const uint64_t W = static_cast<uint64_t>(dataset.num_windows());
  const int bits = W <= 1 ? 1 : std::bit_width(W - 1);
  return {std::move(dataset), seed, std::max(1, (bits + 1) / 2)};
}

const TokenDataset& Sampler::dataset() const {
  if (sources_.size() != 1) throw std::logic_error("Sampler::dataset() on a blend of several sources");
  return sources_.front().dataset;
}

const std::vector<BlendSegment>& Sampler::blend_history() const {
  static const std::vector<BlendSegment> none;
  return blend_ ? blend_->segments() : none;
}

void Sampler::set_blend_history(std::vector<BlendSegment> history) {
  if (!blend_) throw DataError("a blend's history given to a sampler of one source");
  for (const BlendSegment& seg : history)
    if (seg.weights.size() != sources_.size())
      throw DataError("a blend's history of " + std::to_string(seg.weights.size()) + " sources given to a blend of " +
                      std::to_string(sources_.size()));
  BlendSchedule next(std::move(history));  // built first: a refused history leaves the sampler as it was
  blend_.emplace(std::move(next));
}

std::vector<int64_t> Sampler::samples_per_source(int64_t n) const {
  if (!blend_) return {n};
  return blend_->counts(n);
}

int64_t Sampler::num_windows() const {
  int64_t n = 0;
  for (const Source& s : sources_) n += s.dataset.num_windows();
  return n;
}

Sampler::Location Sampler::locate(int64_t sample) const {
  if (sample < 0) throw DataError("sample index must be >= 0, got " + std::to_string(sample));
  Location at{0, sample, 0, 0};
  if (blend_) {
    const Blend::Pick p = blend_->pick(sample);
    at.source = p.source;
    at.local = p.local;
  }
  at.window = permute(sources_[at.source], at.local, &at.epoch);
  return at;
}

// window = perm_{seed,epoch}(local % W), epoch = local / W. perm is a balanced Feistel network
// over 2*half_bits bits keyed by (seed, epoch), restricted to [0, W) by cycle-walking:
// re-encrypting a value that lands outside [0, W) until it lands inside keeps the map a
// bijection of [0, W). No table, O(1) memory, and a pure function of (seed, sample), which
// resuming relies on: any change here changes the data order of existing runs.
int64_t Sampler::permute(const Source& s, int64_t local, int64_t* epoch) const {
  const int64_t W = s.dataset.num_windows();
  if (W <= 0) throw DataError("no windows to sample from");
  *epoch = local / W;
  const uint64_t j = static_cast<uint64_t>(local % W);
  if (!shuffle_) return static_cast<int64_t>(j);

  const uint64_t epoch_key = mix64(mix64(s.seed) ^ static_cast<uint64_t>(*epoch));
  uint64_t round_keys[kFeistelRounds];
  for (int r = 0; r < kFeistelRounds; ++r) round_keys[r] = mix64(epoch_key + static_cast<uint64_t>(r));

  const int h = s.half_bits;
  const uint64_t mask = (uint64_t{1} << h) - 1;
  uint64_t x = j;
  do {
    uint64_t left = x >> h;
    uint64_t right = x & mask;
    for (int r = 0; r < kFeistelRounds; ++r) {
      uint64_t next_right = left ^ (mix64(right ^ round_keys[r]) & mask);
      left = right;
      right = next_right;
    }
    x = (left << h) | right;
  } while (x >= static_cast<uint64_t>(W));
  return static_cast<int64_t>(x);
}

void Sampler::fill(int64_t first_sample, int count, int32_t* inputs, int32_t* targets) const {
  if (count < 0) throw DataError("sample count must be >= 0, got " + std::to_string(count));
  const size_t n = static_cast<size_t>(seq_len());
  for (int s = 0; s < count; ++s) {
    const size_t at = static_cast<size_t>(s) * n;
    const Location loc = locate(first_sample + s);
    sources_[loc.source].dataset.read_window(loc.window, inputs + at, targets + at);
  }
}

}  // namespace keel::data
