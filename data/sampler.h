// Training samples: windows of seq_len + 1 consecutive tokens, addressed by a global sample
// index (the count of samples consumed so far), shuffled by a pure function of (seed, index).
//
// Because the sample -> window map needs no state, a run resumed at consumed sample c reads
// exactly what the uninterrupted run read from c on, on any number of DP ranks: DP rank r of a
// global batch of G samples starting at c takes samples c + r*G/dp ... c + (r+1)*G/dp - 1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/loss_mask.h"
#include "data/token_file.h"

namespace keel::data {

// What a dataset is read for: its errors say "no training windows" or "no validation windows".
enum class DataUse { training, validation };

// The windows of a list of token files. File f contributes floor((n_f - 1) / seq_len)
// non-overlapping windows starting at token 0, seq_len, 2*seq_len, ...; windows never cross
// files. Every token read is checked against the vocab size. A token file with a loss-mask
// sidecar (data/loss_mask.h, picked up automatically) turns the targets it masks into -1.
// `field` names the data in every error (a config field such as "data.val_sets.web", which
// then opens the message); empty: the errors name the files only.
class TokenDataset {
 public:
  TokenDataset(std::vector<TokenFile> files, int seq_len, uint32_t vocab_size, DataUse use = DataUse::training,
               std::string field = "");
  // Opens each path with TokenFile::open.
  static TokenDataset open(const std::vector<std::string>& paths, int seq_len, uint32_t vocab_size,
                           DataUse use = DataUse::training, const std::string& field = "");

  int seq_len() const { return seq_len_; }
  uint32_t vocab_size() const { return vocab_size_; }
  int64_t num_windows() const { return window_offsets_.back(); }
  int64_t num_tokens() const { return num_tokens_; }  // in all files, windows or not
  size_t num_files() const { return files_.size(); }
  const TokenFile& file(size_t f) const { return files_.at(f); }
  // The loss-mask sidecar of file f, if it has one.
  const LossMask* loss_mask(size_t f) const { return masks_.at(f) ? &*masks_.at(f) : nullptr; }
  size_t num_masked_files() const;

  // When the dataset holds at most `max_tokens` tokens, scans all of them for ids >= vocab_size
  // and throws the same DataError as read_window would: bad data fails at start-up, before a
  // run writes anything. Larger datasets rely on the per-window check. Returns whether it scanned.
  bool check_vocab(int64_t max_tokens) const;

  struct WindowLocation {
    size_t file;
    int64_t start;  // token offset of the window's first token in that file
  };
  WindowLocation locate(int64_t window) const;

  // Writes the window's first seq_len tokens to inputs and the next-token shift to targets
  // (targets[k] = inputs[k + 1], the last one being token seq_len of the window), with -1 for
  // targets the file's loss mask leaves out. A token >= vocab_size throws DataError naming the
  // field, the file, the position and the value.
  void read_window(int64_t window, int32_t* inputs, int32_t* targets) const;

 private:
  std::vector<TokenFile> files_;
  std::vector<std::optional<LossMask>> masks_;  // per file; nullopt = every target counts
  std::vector<int64_t> window_offsets_;  // prefix sums: file f holds windows [off[f], off[f+1])
  int seq_len_;
  uint32_t vocab_size_;
  int64_t num_tokens_ = 0;
  std::string field_;  // names the data in errors; "" names none

  // "field: " or "".
  std::string prefix() const { return field_.empty() ? std::string() : field_ + ": "; }
  [[noreturn]] void throw_out_of_vocab(const TokenFile& f, uint32_t token, int64_t position) const;
};

// The order in which a blend of sources is read (Megatron's --data-path w1 p1 w2 p2 ...):
// global sample i goes to source d(i) as that source's l(i)-th sample, l counting 0, 1, 2, ...
// per source. Over one period of kPeriod samples, position j goes to the source furthest behind
// its share, argmax_d w_d (j + 1) - c_d (c_d: positions already given to d; ties to the lower d),
// so every prefix of a period follows the weights to within about one sample per source; the
// period then repeats, so the realized fractions stay within 1/kPeriod of the weights for the
// whole run. The map is a pure function of i in O(1) (two table lookups), which is what
// resuming and the DP split need, exactly as for one source.
class Blend {
 public:
  static constexpr int64_t kPeriod = int64_t{1} << 16;
  // Positive finite weights, normalized here; each must be at least 1/kPeriod of the total.
  // Throws DataError naming the bad weight.
  explicit Blend(const std::vector<double>& weights);

  struct Pick {
    size_t source;
    int64_t local;  // the source's own sample index
  };
  Pick pick(int64_t sample) const;
  // How many of the first n samples (0 .. n-1) each source gets: for source d that is
  // (n / kPeriod) * per_period(d) plus the positions j < n % kPeriod given to d. Exact, and what
  // pick(n).local would be for a sample of d at n: the source's next local index.
  std::vector<int64_t> counts(int64_t n) const;
  size_t num_sources() const { return weights_.size(); }
  double weight(size_t source) const { return weights_.at(source); }  // normalized
  const std::vector<double>& weights() const { return weights_; }     // normalized
  int64_t per_period(size_t source) const { return per_period_.at(source); }

 private:
  std::vector<double> weights_;
  std::vector<uint16_t> source_of_;  // per position of the period
  std::vector<uint32_t> rank_;       // earlier positions of the period given to the same source
  std::vector<int64_t> per_period_;  // positions of the period per source
};

// One stretch of a run's blend: from global sample `from_sample` on (until the next segment's),
// the sources get these weights (as data.train_weights gives them, not normalized).
struct BlendSegment {
  int64_t from_sample = 0;
  std::vector<double> weights;
  bool operator==(const BlendSegment&) const = default;
};

// A blend whose weights changed during the run (a resume with other data.train_weights, e.g. to
// up-weight a high-quality source for the end of training): segments s = 0, 1, ... with
// from_0 = 0 < from_1 < ... . Inside segment s, sample i goes where segment s's own Blend sends
// i - from_s, and each source continues from where the earlier segments left it:
//   local = offset_s[d] + blend_s.pick(i - from_s).local,
//   offset_s[d] = sum over r < s of blend_r.counts(from_{r+1} - from_r)[d].
// So every source's local indices stay 0, 1, 2, ... across a change: nothing of a source is read
// twice or skipped, exactly as in a run that never changed its weights. A history of one segment
// is that Blend itself (offsets 0): such a run reads what it always read.
class BlendSchedule {
 public:
  // Throws DataError unless the segments start at 0, grow strictly and have one weight per
  // source each (and weights Blend accepts).
  explicit BlendSchedule(std::vector<BlendSegment> segments);

  Blend::Pick pick(int64_t sample) const;
  // How many of the first n samples each source gets, over all segments.
  std::vector<int64_t> counts(int64_t n) const;
  size_t num_sources() const { return blends_.front().num_sources(); }
  const std::vector<BlendSegment>& segments() const { return segments_; }
  const Blend& current() const { return blends_.back(); }  // the last segment's

  // `history` continued with `weights` from sample `from` on (a resume at `from`): unchanged
  // when the last segment already has these weights (as normalized), else with a segment
  // appended at `from`. A last segment that starts at `from` itself (saved before it read
  // anything) is replaced; segments after `from` are dropped (they cannot be in a checkpoint
  // taken at `from`, but a rewind must never keep them).
  static std::vector<BlendSegment> continued(std::vector<BlendSegment> history, int64_t from,
                                             const std::vector<double>& weights);

 private:
  std::vector<BlendSegment> segments_;
  std::vector<Blend> blends_;                 // per segment
  std::vector<std::vector<int64_t>> offsets_;  // per segment, per source: samples taken before it
};

// Maps sample indices to windows. Epoch e = sample / W, and the window is perm_{seed,e}(sample
// % W), a pseudo-random bijection of [0, W) evaluated in O(1) memory (see window_of). Without
// shuffle, sample i reads window i % W (the validation order).
//
// With several sources (a weighted blend), a Blend first sends each sample to a source and its
// local index; each source then walks its own epochs as above, under its own seed (source 0
// keeps `seed`, so a one-source blend reads what the plain sampler reads).
class Sampler {
 public:
  Sampler(TokenDataset dataset, uint64_t seed, bool shuffle);
  // A weighted blend (weights as Blend takes them, one per source).
  Sampler(std::vector<TokenDataset> sources, const std::vector<double>& weights, uint64_t seed, bool shuffle);

  size_t num_sources() const { return sources_.size(); }
  const TokenDataset& source(size_t k) const { return sources_.at(k).dataset; }
  // Source k's share of the samples from the last weight change on (normalized weight).
  double weight(size_t k) const { return blend_ ? blend_->current().weight(k) : 1.0; }
  // A blend's history (one segment, from sample 0, unless the weights changed during the run),
  // and its replacement by one restored from a checkpoint (throws DataError for a history of
  // another number of sources, or one BlendSchedule refuses). An unblended sampler has none.
  const std::vector<BlendSegment>& blend_history() const;
  void set_blend_history(std::vector<BlendSegment> history);
  // How many of the first n samples each source gets ({n} for one source).
  std::vector<int64_t> samples_per_source(int64_t n) const;
  // The one source of an unblended sampler (throws std::logic_error for a blend).
  const TokenDataset& dataset() const;
  int seq_len() const { return sources_.front().dataset.seq_len(); }
  int64_t num_windows() const;  // over all sources

  // Where a sample comes from: the source, the source's own sample index, its epoch over that
  // source and the window it reads.
  struct Location {
    size_t source;
    int64_t local;
    int64_t epoch;
    int64_t window;
  };
  Location locate(int64_t sample) const;
  int64_t epoch_of(int64_t sample) const { return locate(sample).epoch; }
  int64_t window_of(int64_t sample) const { return locate(sample).window; }

  // Samples first_sample .. first_sample + count - 1 into inputs and targets, count * seq_len
  // int32 each (sample k at offset k * seq_len).
  void fill(int64_t first_sample, int count, int32_t* inputs, int32_t* targets) const;

 private:
  struct Source {
    TokenDataset dataset;
    uint64_t seed;
    int half_bits;  // the Feistel network permutes [0, 4^half_bits) ⊇ [0, W)
  };
  Source make_source(TokenDataset dataset, uint64_t seed) const;
  int64_t permute(const Source& s, int64_t local, int64_t* epoch) const;

  std::vector<Source> sources_;
  std::optional<BlendSchedule> blend_;  // with more than one source
  bool shuffle_;
};

}  // namespace keel::data
