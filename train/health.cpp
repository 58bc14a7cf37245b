#include "train/health.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "train/format.h"
#include "train/optimizer.h"

namespace keel {

namespace {
bool name_has(const std::string& name, const char* what) { return name.find(what) != std::string::npos; }

}  // namespace

std::string param_group_table(const ParamTable& table, double weight_decay) {
  struct Group {
    int64_t tensors = 0, params = 0;
    std::map<std::string, int64_t> roles;
    std::string example;
  };
  Group decay, no_decay;
  for (const ParamSpec& p : table.params()) {
    if (p.tied_copy) continue;
    Group& g = p.decay ? decay : no_decay;
    ++g.tensors;
    g.params += p.logical_numel();
    ++g.roles[role_name(p.role)];
    if (g.example.empty()) g.example = p.name;
  }
  std::ostringstream o;
  o << "optimizer groups (weight decay by role):\n";
  o << "  group              tensors  parameters  roles\n";
  auto row = [&](const char* label, const Group& g) {
    std::string roles;
    for (const auto& [r, n] : g.roles) roles += (roles.empty() ? "" : ", ") + std::to_string(n) + " " + r;
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-18s %7lld  %10s  %s\n", label, static_cast<long long>(g.tensors),
                  human_count(static_cast<double>(g.params)).c_str(), roles.c_str());
    o << buf;
  };
  char label[48];
  std::snprintf(label, sizeof label, "decay %.3g", weight_decay);
  row(label, decay);
  row("no decay", no_decay);
  return o.str();
}

// Independent of how roles were assigned: 1-D tensors (norm gains and biases) never decay,
// 2-D ones (matrices and embeddings) always do, and a name that says "norm" has the norm role.
std::vector<std::string> audit_param_groups(const std::vector<ParamSpec>& params) {
  std::vector<std::string> problems;
  for (const ParamSpec& p : params) {
    const std::string role = role_name(p.role);
    if (p.shape.size() == 1 && p.decay)
      problems.push_back(p.name + " (" + role + ", 1-D) is in the weight-decay group: norms and biases must not "
                         "decay (decay pulls a norm gain towards 0, and restoring it from a checkpoint then shows as "
                         "a loss spike)");
    if (p.shape.size() == 2 && !p.decay)
      problems.push_back(p.name + " (" + role + ", 2-D) is not in the weight-decay group: matrices and embeddings decay");
    if (name_has(p.name, "norm") && p.role != Role::Norm && p.role != Role::Bias)
      problems.push_back(p.name + " is named like a norm parameter but has role " + role);
  }
  return problems;
}

// ---------------------------------------------------------------------------------------

FrozenDetector::FrozenDetector(const ParamTable& table, const ParamState& state, const HealthConfig& cfg) : cfg_(cfg) {
  constexpr int64_t kSample = 64;
  for (const ParamSpec& p : table.params()) {
    if (!table.is_primary(p)) continue;
    const int64_t a = std::max(p.offset, state.optim_begin());
    const int64_t b = std::min(p.offset + p.numel, std::min(state.optim_end(), table.local_numel()));
    if (a >= b) continue;
    Track t;
    t.name = p.name;
    t.n = std::min(kSample, b - a);
    // A spread-out but fixed place inside the tensor's range (hash of the name).
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : p.name) h = (h ^ c) * 1099511628211ull;
    t.begin = a + static_cast<int64_t>(h % static_cast<uint64_t>(b - a - t.n + 1));
    t.staged_at = samples_;
    samples_ += t.n;
    tracks_.push_back(std::move(t));
  }
}

FrozenDetector::~FrozenDetector() {
  if (staging_backend_) staging_backend_->release(staging_.data);
}

FrozenDetector::Result FrozenDetector::check(const ParamState& state, Backend& be) {
  Result r;
  if (tracks_.empty()) return r;
  const Tensor& values = state.has_master() ? state.master : state.working;
  if (!staging_backend_) {
    staging_ = Tensor(nullptr, DType::F32, {2 * samples_}, values.device);
    staging_.data = be.allocate(staging_.bytes());
    staging_backend_ = &be;
  }
  for (const Track& t : tracks_) {  // bf16/fp16 values widen exactly
    be.convert(staging_.elements(t.staged_at, t.staged_at + t.n), state.flat_view(values, t.begin, t.n));
    be.convert(staging_.elements(samples_ + t.staged_at, samples_ + t.staged_at + t.n),
               state.flat_view(state.grads, t.begin, t.n));
  }
  std::vector<float> staged(static_cast<size_t>(2 * samples_));
  be.copy_to_host(staged.data(), staging_);
  for (Track& t : tracks_) {
    const auto at = staged.begin() + t.staged_at;
    const std::vector<float> cur(at, at + t.n), grad(at + samples_, at + samples_ + t.n);
    if (t.primed) {
      int64_t with_grad = 0, stuck = 0;
      for (size_t i = 0; i < cur.size(); ++i) {
        if (grad[i] == 0.0f || !std::isfinite(grad[i])) continue;
        ++with_grad;
        stuck += cur[i] == t.prev[i];
      }
      const bool frozen_now = with_grad > 0 && static_cast<double>(stuck) >= cfg_.frozen_fraction * with_grad;
      t.frozen_checks = frozen_now ? t.frozen_checks + 1 : 0;
      if (t.frozen_checks >= cfg_.frozen_window && !t.reported) {
        t.reported = true;
        std::vector<float> mags(cur.size());
        for (size_t i = 0; i < cur.size(); ++i) mags[i] = std::fabs(cur[i]);
        std::nth_element(mags.begin(), mags.begin() + static_cast<std::ptrdiff_t>(mags.size() / 2), mags.end());
        r.newly_frozen.emplace_back(t.name, mags[mags.size() / 2]);
      }
    }
    t.prev = cur;
    t.primed = true;
  }
  return r;
}

std::string explain_frozen(const std::string& name, float typical_abs, double lr, DType stored, bool has_master) {
  char buf[1024];
  const int mantissa = stored == DType::BF16 ? 7 : stored == DType::F16 ? 10 : 23;
  const double spacing = typical_abs > 0 ? std::ldexp(1.0, static_cast<int>(std::floor(std::log2(typical_abs))) - mantissa)
                                         : 0.0;
  if (!has_master && stored != DType::F32 && lr < spacing / 2) {
    std::snprintf(buf, sizeof buf,
                  "%s has not moved although its gradient is non-zero: its values are around %.3g and are stored "
                  "only in %s, whose spacing there is %.3g (2^%d), so AdamW's updates of about lr = %.2g per step "
                  "(below half a spacing) round away every time. Remedy: keep fp32 master weights "
                  "(precision.mode = \"bf16\" instead of \"bf16-unsafe-no-master\").",
                  name.c_str(), typical_abs, std::string(dtype_name(stored)).c_str(), spacing,
                  static_cast<int>(std::floor(std::log2(spacing))), lr);
  } else {
    std::snprintf(buf, sizeof buf,
                  "%s has not moved although its gradient is non-zero (values around %.3g, lr %.2g, %s%s): the "
                  "optimizer is not updating it. Check that it is in an optimizer group and that its learning rate "
                  "is not zero.",
                  name.c_str(), typical_abs, lr, std::string(dtype_name(stored)).c_str(),
                  has_master ? " with fp32 masters" : "");
  }
  return buf;
}

// ---------------------------------------------------------------------------------------

double SpikeDetector::Running::z(double x) const {
  const double sd = std::sqrt(std::max(var, 1e-12 * mean * mean + 1e-30));
  return (x - mean) / sd;
}

// Exponential moving mean and variance (West's update) with a time constant of ~20 steps, so
// the fast early descent is forgotten by the time the detector is armed.
void SpikeDetector::Running::add(double x) {
  const double alpha = std::max(1.0 / static_cast<double>(n + 1), 0.05);
  const double d = x - mean;
  mean += alpha * d;
  var = (1 - alpha) * (var + alpha * d * d);
  ++n;
}

SpikeDetector::Verdict SpikeDetector::observe(double loss, double grad_norm) {
  Verdict v;
  if (!std::isfinite(loss) || !std::isfinite(grad_norm)) return v;
  const bool armed = loss_.n >= cfg_.spike_warmup;
  v.loss_z = loss_.z(loss);
  v.norm_z = norm_.z(grad_norm);
  if (armed) {
    v.loss_spike = v.loss_z > cfg_.spike_zscore && loss > loss_.mean * (1 + cfg_.spike_min_jump);
    v.norm_spike = v.norm_z > cfg_.spike_zscore && grad_norm > norm_.mean * cfg_.spike_norm_ratio;
  }
  streak_ = v.any() ? streak_ + 1 : 0;
  if (streak_ >= kLevelShiftSteps) {
    v.level_shift = true;
    loss_ = Running{};
    norm_ = Running{};
    streak_ = 0;
  }
  if (!v.any() || v.level_shift) {
    loss_.add(loss);
    norm_.add(grad_norm);
  }
  return v;
}

nlohmann::json SpikeDetector::to_json() const {
  return {{"loss", {loss_.mean, loss_.var, loss_.n}}, {"grad_norm", {norm_.mean, norm_.var, norm_.n}}, {"streak", streak_}};
}

void SpikeDetector::restore(const nlohmann::json& j, bool keep_streak) {
  const auto running = [](const nlohmann::json& a) {
    return Running{a.at(0).get<double>(), a.at(1).get<double>(), a.at(2).get<int64_t>()};
  };
  loss_ = running(j.at("loss"));
  norm_ = running(j.at("grad_norm"));
  if (!keep_streak) streak_ = j.at("streak").get<int64_t>();
}

std::string SpikeDetector::describe(const Verdict& v, double loss, double grad_norm) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s%s%s (loss %.4f, z %.1f; grad norm %.3g, z %.1f)", v.loss_spike ? "loss spike" : "",
                v.loss_spike && v.norm_spike ? " and " : "", v.norm_spike ? "grad-norm spike" : "", loss, v.loss_z,
                grad_norm, v.norm_z);
  std::string text = buf;
  if (v.level_shift)
    text.append("; ")
        .append(std::to_string(kLevelShiftSteps))
        .append(" steps in a row were flagged: taken as a new level, the spike check re-arms after "
                "health.spike_warmup (")
        .append(std::to_string(cfg_.spike_warmup))
        .append(") steps");
  return text;
}

}  // namespace keel
