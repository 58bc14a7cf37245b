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

ParamState::ParamState(const ParamTable& table, Backend& backend, PrecisionMode mode) : table_(table), be_(backend) {
  const int64_t n = table.local_numel();
  auto make = [&](DType t) {
    Tensor x(nullptr, t, {n}, be_.device());
    x.data = be_.allocate(x.bytes());
    allocations_.push_back(x.data);
    return x;
  };
  working = make(working_dtype(mode));
  grads = make(DType::F32);
  if (mode == PrecisionMode::FP32)
    master = working;
  else if (mode != PrecisionMode::BF16UnsafeNoMaster)
    master = make(DType::F32);
  m = make(DType::F32);
  v = make(DType::F32);
}

ParamState::~ParamState() {
  for (void* p : allocations_) be_.release(p);
}

Tensor ParamState::slice(const Tensor& flat, const ParamSpec& p) const {
  Tensor t = flat;
  t.data = static_cast<char*>(flat.data) + p.offset * dtype_size(flat.dtype);
  t.ndim = static_cast<int>(p.local_shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = p.local_shape[i];
  return t;
}

void ParamState::load_fp32(const float* values) {
  const int64_t n = table_.local_numel();
  Tensor host_view(const_cast<float*>(values), DType::F32, {n});
  if (has_master()) {
    be_.copy_from_host(master, values);
    if (master.data != working.data) be_.convert(working, master);
  } else {
    // No master: round the fp32 values straight into the working dtype.
    Tensor staging(nullptr, DType::F32, {n}, be_.device());
    staging.data = be_.allocate(staging.bytes());
    be_.copy_from_host(staging, values);
    be_.convert(working, staging);
    be_.release(staging.data);
  }
  be_.fill(m, 0.0f);
  be_.fill(v, 0.0f);
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

void ParamState::working_to_host(float* out) const { flat_to_host(be_, working, out); }
void ParamState::master_to_host(float* out) const { flat_to_host(be_, has_master() ? master : working, out); }

void adamw_update(ParamState& s, const ParamTable& table, Backend& be, const OptimizerConfig& opt, double lr,
                  float grad_scale) {
  s.adam_step += 1;
  AdamWParams a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(opt.beta1);
  a.beta2 = static_cast<float>(opt.beta2);
  a.eps = static_cast<float>(opt.eps);
  a.step = s.adam_step;
  a.grad_scale = grad_scale;
  for (const ParamSpec& p : table.params()) {
    a.weight_decay = p.decay ? static_cast<float>(opt.weight_decay) : 0.0f;
    Tensor master = s.has_master() ? s.slice(s.master, p) : Tensor();
    be.adamw(master, s.slice(s.working, p), s.slice(s.grads, p), s.slice(s.m, p), s.slice(s.v, p), a);
  }
}

LossScaler::LossScaler(const LossScaleConfig& cfg, bool enabled)
    : cfg_(cfg), enabled_(enabled), scale_(enabled ? cfg.initial : 1.0), hysteresis_tracker_(cfg.hysteresis) {}

bool LossScaler::update(bool overflow) {
  if (!enabled_) return false;
  if (overflow) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
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
  hysteresis_tracker_ = hysteresis_tracker;
}

}  // namespace keel
