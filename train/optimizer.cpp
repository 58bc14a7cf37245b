#include "train/optimizer.h"

#include <algorithm>
#include <vector>

namespace keel {

DType working_dtype(PrecisionMode mode) {
  switch (mode) {
    case PrecisionMode::FP32: return DType::F32;
    case PrecisionMode::FP16: return DType::F16;
    default: return DType::BF16;
  }
}

DType activation_dtype(PrecisionMode mode) { return working_dtype(mode); }

ParamState::ParamState(const ParamTable& table, Backend& backend, PrecisionMode mode, int dp_size, int dp_rank,
                       bool optimizer)
    : table_(table), be_(backend) {
  const int64_t n = table.local_numel();
  // ZeRO-1: the flat space is padded so the DP ranks' shards are equal; rank r owns
  // [r*S, (r+1)*S) of master and moments.
  const int64_t shard = (n + dp_size - 1) / dp_size;
  padded_ = shard * dp_size;
  optim_begin_ = shard * dp_rank;
  optim_end_ = optim_begin_ + shard;
  auto make = [&](DType t, int64_t count) {
    Tensor x(nullptr, t, {count}, be_.device());
    x.data = be_.allocate(x.bytes());
    allocations_.push_back(x.data);
    return x;
  };
  working = make(working_dtype(mode), padded_);
  if (optimizer) grads = make(DType::F32, padded_);
  if (mode == PrecisionMode::FP32) {
    master = flat_view(working, optim_begin_, shard);
    master_is_working_ = true;
  } else if (mode != PrecisionMode::BF16UnsafeNoMaster) {
    master = make(DType::F32, shard);
  }
  if (optimizer) {
    m = make(DType::F32, shard);
    v = make(DType::F32, shard);
  }
}

ParamState::~ParamState() {
  for (void* p : allocations_) be_.release(p);
}

Tensor ParamState::flat_view(const Tensor& buffer, int64_t flat_begin, int64_t n) const {
  // Shard buffers (master unless it is a view of working, m, v) start at optim_begin.
  const bool shard_buffer = buffer.numel() != padded_;
  const int64_t index = shard_buffer ? flat_begin - optim_begin_ : flat_begin;
  if (index < 0 || index + n > buffer.numel())
    throw std::out_of_range("ParamState::flat_view: elements [" + std::to_string(flat_begin) + ", " +
                            std::to_string(flat_begin + n) + ") are outside this buffer");
  return buffer.elements(index, index + n);
}

void ParamState::load_fp32(const float* values) {
  const int64_t n = table_.local_numel();
  // Working weights: every tensor, rounded from the fp32 values in chunks through an fp32
  // staging buffer: the first moments (zeroed below) where this state has them, else one of at
  // most 64 MiB. Never a whole-model buffer: it came on top of the activations, already
  // allocated, and was a run's peak (the 1B Llama of bench/: 4.6 GiB over its training steps).
  if (working.dtype == DType::F32) {
    be_.copy_from_host(flat_view(working, 0, n), values);
  } else if (n > 0) {
    const bool own = m.empty();
    Tensor staging = own ? Tensor(nullptr, DType::F32, {std::min<int64_t>(n, int64_t{16} << 20)}, be_.device()) : m;
    if (own) staging.data = be_.allocate(staging.bytes());
    const int64_t chunk = staging.numel();
    for (int64_t at = 0; at < n; at += chunk) {
      const Tensor part = staging.elements(0, std::min(chunk, n - at));
      be_.copy_from_host(part, values + at);
      be_.convert(flat_view(working, at, part.numel()), part);
    }
    if (own) be_.release(staging.data);
  }
  // Masters: this rank's shard, exact.
  if (has_master() && !master_is_working_) {
    const int64_t end = std::min(optim_end_, n);
    if (end > optim_begin_)
      be_.copy_from_host(flat_view(master, optim_begin_, end - optim_begin_), values + optim_begin_);
  }
  if (!m.empty()) be_.fill(m, 0.0f);
  if (!v.empty()) be_.fill(v, 0.0f);
  adam_step = 0;
}

void ParamState::init(uint64_t seed) {
  std::vector<float> host(static_cast<size_t>(table_.local_numel()));
  for (const ParamSpec& p : table_.params()) init_param(p, seed, host.data() + p.offset);
  load_fp32(host.data());
}

namespace {
void flat_to_host(Backend& be, const Tensor& flat, float* out) {
  if (flat.dtype == DType::F32) {
    be.copy_to_host(out, flat);
    return;
  }
  std::vector<uint16_t> raw(static_cast<size_t>(flat.numel()));
  be.copy_to_host(raw.data(), flat);
  for (size_t i = 0; i < raw.size(); ++i)
    out[i] = flat.dtype == DType::BF16 ? bf16_to_f32(raw[i]) : f16_to_f32(raw[i]);
}
}  // namespace

void ParamState::working_to_host(float* out) const { flat_to_host(be_, flat_view(working, 0, table_.local_numel()), out); }

void ParamState::master_to_host(float* out) const {
  const int64_t end = std::min(optim_end_, table_.local_numel());
  if (end <= optim_begin_) return;
  const Tensor& src = has_master() ? master : working;
  flat_to_host(be_, flat_view(src, optim_begin_, end - optim_begin_), out + optim_begin_);
}

void adamw_update(ParamState& s, const ParamTable& table, Backend& be, const OptimizerConfig& opt, double lr,
                  float grad_scale, const WorkingRounding& rounding) {
  s.adam_step += 1;
  AdamWParams a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(opt.beta1);
  a.beta2 = static_cast<float>(opt.beta2);
  a.eps = static_cast<float>(opt.eps);
  a.step = s.adam_step;
  a.grad_scale = grad_scale;
  a.stochastic_rounding = rounding.stochastic;
  // AdamW is elementwise: update the part of each tensor inside this rank's shard. Without
  // stochastic rounding (whose random stream is per tensor) the whole shard is one call, its
  // tensors runs of weight decay (neighbours with the same decay merged): the same arithmetic per
  // element, one or two launches instead of one per tensor (GPT-2 small: 196 tensors).
  auto update = [&](int64_t begin, int64_t n) {
    Tensor master = s.has_master() ? s.flat_view(s.master, begin, n) : Tensor();
    be.adamw(master, s.flat_view(s.working, begin, n), s.flat_view(s.grads, begin, n), s.flat_view(s.m, begin, n),
             s.flat_view(s.v, begin, n), a);
  };
  std::vector<AdamWDecayRun> runs;  // ends relative to shard_begin
  int64_t shard_begin = -1, shard_end = -1;
  for (const ParamSpec& p : table.params()) {
    const int64_t begin = std::max(p.offset, s.optim_begin()), end = std::min(p.offset + p.numel, s.optim_end());
    if (begin >= end) continue;
    const float decay = p.decay ? static_cast<float>(opt.weight_decay) : 0.0f;
    if (rounding.stochastic) {
      a.weight_decay = decay;
      // param_key mixes the seed fully: folding the shard in first gives each TP shard its own stream.
      a.rounding_seed = param_key(p, rounding.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(p.shard_begin)));
      a.rounding_index0 = begin - p.offset;
      update(begin, end - begin);
      continue;
    }
    if (shard_begin < 0) shard_begin = begin;
    shard_end = end;  // the table's tensors are contiguous: the shard's parts are too
    if (!runs.empty() && runs.back().weight_decay == decay)
      runs.back().end = end - shard_begin;
    else
      runs.push_back({end - shard_begin, decay});
  }
  if (!runs.empty()) {
    a.decay_runs = runs;
    update(shard_begin, shard_end - shard_begin);
  }
}

LossScaler::LossScaler(const LossScaleConfig& cfg, bool enabled)
    : cfg_(cfg), enabled_(enabled), scale_(enabled ? cfg.initial : 1.0), hysteresis_tracker_(cfg.hysteresis) {}

bool LossScaler::update(bool overflow) {
  if (!enabled_) return false;
  if (overflow) {
    growth_tracker_ = 0;
    // Overflows left before the next cut; 0 means every overflow cuts until the scale grows.
    // It stays at 0 rather than counting below it: the checkpoint records it as a count.
    hysteresis_tracker_ = std::max<int64_t>(hysteresis_tracker_ - 1, 0);
    if (hysteresis_tracker_ <= 0) {
      if (scale_ <= cfg_.min) return true;  // nothing left to back off to
      scale_ = std::max(scale_ * cfg_.backoff_factor, cfg_.min);
    }
    return false;
  }
  growth_tracker_ += 1;
  if (growth_tracker_ >= cfg_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = cfg_.hysteresis;
    scale_ *= cfg_.growth_factor;
  }
  return false;
}

void LossScaler::restore(double scale, int64_t growth_tracker, int64_t hysteresis_tracker) {
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  hysteresis_tracker_ = std::max<int64_t>(hysteresis_tracker, 0);  // earlier keels saved -1, -2, ...
}

}  // namespace keel
