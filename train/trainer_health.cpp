// The Trainer's health checks that need the model and the communicators: non-finite
// localisation, frozen-parameter reports, restart verification (probe loss, per-tensor norms,
// master consistency). Replica checks are in trainer.cpp.
#include <algorithm>
#include <bit>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "data/checksum.h"
#include "train/parallel/host_values.h"
#include "train/schedule.h"
#include "train/trainer.h"

namespace keel {

namespace {
std::string hex_of(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, 8);
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, bits);
  return buf;
}

// A saved double: nlohmann writes inf and nan as null, read back as nan.
double saved_number(const nlohmann::json& v) { return v.is_number() ? v.get<double>() : std::nan(""); }
}  // namespace

double HealthSnapshot::saved_probe_loss(const nlohmann::json& saved) {
  if (saved.contains("probe_loss") && saved["probe_loss"].is_number()) return saved["probe_loss"].get<double>();
  if (!saved.contains("probe_loss")) return 0;
  const std::string bits = saved.value("probe_loss_bits", std::string());
  if (bits.size() == 16 && bits.find_first_not_of("0123456789abcdef") == std::string::npos) {
    const uint64_t b = std::stoull(bits, nullptr, 16);
    double x;
    std::memcpy(&x, &b, 8);
    return x;
  }
  return std::nan("");  // null: not finite when saved
}

// Re-runs the step's micro-batches with the same loss scale and a check after every op of
// forward and backward; the first op (in dataflow order across the pipeline) whose output holds
// inf or nan is named, with the magnitudes that led to it.
std::string Trainer::localize_nonfinite(const std::vector<MicroBatch>& mbs, float dloss) {
  const DType act = activation_dtype(cfg_.precision.mode);
  int64_t order = 0;
  bool found = false;
  std::string text;
  float prev_max = 0;
  std::string prev_op = "(start)";
  int64_t key = INT64_MAX;
  const int P = grid_.pp_size(), s = grid_.pp_rank();
  set_probe([&](int chunk, const Transformer::OpProbe& p) {
    ++order;
    if (found) return;
    const float m = be_.max_abs(p.out);
    const std::string where = std::string(p.backward ? "backward" : "forward") +
                              (p.layer >= 0 ? ", layer " + std::to_string(p.layer) : std::string(", outside the layers")) +
                              ", " + p.op;
    if (std::isfinite(m)) {
      prev_max = m;
      prev_op = where;
      return;
    }
    found = true;
    // Forward before backward; forward in (virtual) stage order, backward in reverse order.
    const int64_t vs = static_cast<int64_t>(chunk) * P + s, V = static_cast<int64_t>(P) * num_chunks();
    key = p.backward ? (int64_t{1} << 50) + (V - 1 - vs) * (int64_t{1} << 32) + order : vs * (int64_t{1} << 32) + order;
    const std::string scale_note =
        cfg_.precision.mode == PrecisionMode::FP16 && p.backward
            ? " (backward values are multiplied by the fp16 loss scale, " +
                  std::to_string(static_cast<int64_t>(scaler_.scale_value())) + " as of now)"
            : "";
    char buf[900];
    std::snprintf(buf, sizeof buf,
                  "%lld|first non-finite value at %s (pipeline stage %d, tp rank %d, dp rank %d): its output holds "
                  "%s; the op before it (%s) peaked at |x| = %.4g, %s's largest finite value is %.6g%s",
                  static_cast<long long>(key), where.c_str(), s, grid_.tp_rank(), grid_.dp_rank(),
                  std::isnan(m) ? "nan" : "inf", prev_op.c_str(), prev_max, std::string(dtype_name(act)).c_str(),
                  dtype_max(act), scale_note.c_str());
    text = buf;
  });
  be_.fill(state_->grads, 0.0f);
  run_pipeline(mbs, dloss, true);
  set_probe(nullptr);
  be_.fill(state_->grads, 0.0f);

  std::string best;
  int64_t best_key = INT64_MAX;
  for (const std::string& t : parallel::gather_text(*comms_->world, be_, found ? text : std::string())) {
    if (t.empty()) continue;
    const int64_t k = std::stoll(t.substr(0, t.find('|')));
    if (k < best_key) best_key = k, best = t.substr(t.find('|') + 1);
  }
  return best.empty() ? "re-running the step with per-op checks found no non-finite op output (the overflow came "
                        "from the gradient reduction or the loss sum)"
                      : best;
}

void Trainer::check_frozen(StepStats& st) {
  const auto local = frozen_->check(*state_, be_);
  // Tensors live on different ranks: flag and magnitude per model tensor, max over ranks.
  std::vector<float> flag(full_names_.size(), 0.0f), magnitude(full_names_.size(), 0.0f);
  for (const auto& [name, mag] : local.newly_frozen) {
    const auto it = std::find(full_names_.begin(), full_names_.end(), name);
    if (it == full_names_.end()) continue;
    flag[static_cast<size_t>(it - full_names_.begin())] = 1.0f;
    magnitude[static_cast<size_t>(it - full_names_.begin())] = mag;
  }
  flag = parallel::max_over_ranks(*comms_->world, be_, flag);
  magnitude = parallel::max_over_ranks(*comms_->world, be_, magnitude);
  const double lr = learning_rate(cfg_, st.iteration);
  for (size_t i = 0; i < flag.size(); ++i)
    if (flag[i] > 0)
      st.frozen.push_back(explain_frozen(full_names_[i], magnitude[i], lr, state_->working.dtype,
                                         state_->has_master()));
}

HealthSnapshot Trainer::snapshot(const MicroBatch& probe) {
  HealthSnapshot s;
  s.probe_loss = evaluate({probe});
  uint32_t crc = data::crc32c(0, probe.inputs.data(), probe.inputs.size() * sizeof(int32_t));
  crc = data::crc32c(crc, probe.targets.data(), probe.targets.size() * sizeof(int32_t));
  s.probe_batch = std::to_string(probe.inputs.size() / static_cast<size_t>(cfg_.train.seq_len)) + "x" +
                  std::to_string(cfg_.train.seq_len) + " crc32c " + data::crc32c_hex(crc);
  s.working_sumsq.assign(full_names_.size(), 0.0);
  s.master_sumsq.assign(full_names_.size(), 0.0);
  const int64_t ob = state_->optim_begin(), oe = std::min(state_->optim_end(), table_.local_numel());
  for (const ParamSpec& p : table_.params()) {
    if (!table_.is_primary(p)) continue;
    const size_t i = static_cast<size_t>(std::find(full_names_.begin(), full_names_.end(), p.name) - full_names_.begin());
    // Working weights are replicated over DP: DP rank 0 counts them.
    if (grid_.dp_rank() == 0) s.working_sumsq[i] += be_.sum_squares(param_view(state_->working, p));
    const int64_t a = std::max(p.offset, ob), b = std::min(p.offset + p.numel, oe);
    if (state_->has_master() && a < b) s.master_sumsq[i] += be_.sum_squares(state_->flat_view(state_->master, a, b - a));
  }
  s.working_sumsq = parallel::sum_over_ranks(*comms_->world, be_, s.working_sumsq);
  s.master_sumsq = parallel::sum_over_ranks(*comms_->world, be_, s.master_sumsq);
  return s;
}

nlohmann::json Trainer::snapshot_json(const HealthSnapshot& s) const {
  nlohmann::json tensors = nlohmann::json::object();
  for (size_t i = 0; i < full_names_.size(); ++i) tensors[full_names_[i]] = {s.working_sumsq[i], s.master_sumsq[i]};
  return {{"probe_loss", s.probe_loss},
          {"probe_loss_bits", hex_of(s.probe_loss)},
          {"probe_batch", s.probe_batch},
          {"tensor_sumsq", tensors}};
}

std::vector<std::string> Trainer::compare_snapshot(const nlohmann::json& saved, const HealthSnapshot& now,
                                                   bool bitwise, bool compare_masters,
                                                   const std::string& saved_precision, bool compare_probe) const {
  std::vector<std::string> problems;
  const double was = HealthSnapshot::saved_probe_loss(saved);
  const std::string was_bits = saved.value("probe_loss_bits", std::string());
  const std::string this_precision = precision_name(cfg_.precision.mode);
  const bool same_precision = saved_precision.empty() || saved_precision == this_precision;
  // Another layout, or another device or library, sums in another order: fp32 agrees to ~1e-6;
  // bf16/fp16 activations (on either side) to a few of their spacings (2^-8 relative).
  const bool all_fp32 = cfg_.precision.mode == PrecisionMode::FP32 && (same_precision || saved_precision == "fp32");
  const double tol = all_fp32 ? 1e-5 : 1e-2;
  char buf[512];
  if (compare_probe && now.same_probe(saved) &&
      (bitwise ? hex_of(now.probe_loss) != was_bits : std::abs(now.probe_loss - was) > tol * std::abs(was))) {
    std::snprintf(buf, sizeof buf,
                  "the probe batch's loss is %.9g after loading, %.9g when the checkpoint was saved (%s): the model "
                  "does not compute what was saved",
                  now.probe_loss, was,
                  bitwise ? "same layout and arithmetic: the bits must match"
                          : "another layout or arithmetic: must agree within rounding");
    problems.push_back(buf);
  }
  const auto& tensors = saved.value("tensor_sumsq", nlohmann::json::object());
  auto differs = [](double a, double b) { return std::abs(a - b) > 1e-6 * std::max(std::abs(a), std::abs(b)); };
  // Under another precision the working weights are another rounding of the state: compare the
  // copy this run continues from with the saved one it was loaded from (restore_for_resume: the
  // masters from the saved masters, else the weights; working weights of the saved dtype from
  // the saved weights, of another dtype from the saved masters).
  const bool saved_working_same_dtype =
      working_dtype(precision_from_name(saved_precision).value_or(cfg_.precision.mode)) == state_->working.dtype;
  for (size_t i = 0; !same_precision && i < full_names_.size(); ++i) {
    if (!tensors.contains(full_names_[i])) continue;
    const auto& pair = tensors[full_names_[i]];
    const double saved_working = saved_number(pair[0]), saved_master = saved_number(pair[1]);
    const bool now_master = state_->has_master() && !state_->master_is_working();
    const bool from_master = compare_masters && saved_master > 0 && (now_master || !saved_working_same_dtype);
    const double was_sumsq = from_master ? saved_master : saved_working;
    const double is_sumsq = now_master ? now.master_sumsq[i] : now.working_sumsq[i];
    // A working copy rounded from a wider saved one (no masters here): each element moves by at
    // most its unit roundoff u, so |w|^2 by at most 2u relative.
    const bool rounded = !now_master && !saved_working_same_dtype && state_->working.dtype != DType::F32;
    const double bound = !rounded ? 1e-6 : state_->working.dtype == DType::BF16 ? 0x1p-8 : 0x1p-10;
    if (std::abs(is_sumsq - was_sumsq) > bound * std::max(std::abs(is_sumsq), std::abs(was_sumsq))) {
      std::snprintf(buf, sizeof buf, "%s: |%s|^2 = %.9g after loading (%s), |%s|^2 = %.9g when saved (%s)",
                    full_names_[i].c_str(), now_master ? "fp32 master" : "weights", is_sumsq, this_precision.c_str(),
                    from_master ? "fp32 master" : "weights", was_sumsq, saved_precision.c_str());
      problems.push_back(buf);
    }
  }
  for (size_t i = 0; same_precision && i < full_names_.size(); ++i) {
    if (!tensors.contains(full_names_[i])) continue;
    const auto& pair = tensors[full_names_[i]];
    if (differs(now.working_sumsq[i], saved_number(pair[0]))) {
      std::snprintf(buf, sizeof buf, "%s: |weights|^2 = %.9g after loading, %.9g when saved", full_names_[i].c_str(),
                    now.working_sumsq[i], saved_number(pair[0]));
      problems.push_back(buf);
    }
    if (compare_masters && saved_number(pair[1]) > 0 && differs(now.master_sumsq[i], saved_number(pair[1]))) {
      std::snprintf(buf, sizeof buf, "%s: |fp32 master|^2 = %.9g after loading, %.9g when saved",
                    full_names_[i].c_str(), now.master_sumsq[i], saved_number(pair[1]));
      problems.push_back(buf);
    }
  }
  return problems;
}

std::vector<std::string> Trainer::check_master_consistency(bool stochastic) {
  settle_params();
  std::vector<double> bad(full_names_.size(), 0.0), total(full_names_.size(), 0.0);
  if (state_->has_master() && !state_->master_is_working()) {
    const int64_t ob = state_->optim_begin(), oe = std::min(state_->optim_end(), table_.local_numel());
    const DType wt = state_->working.dtype;
    std::vector<float> master;
    std::vector<uint16_t> working;
    for (const ParamSpec& p : table_.params()) {
      const int64_t a = std::max(p.offset, ob), b = std::min(p.offset + p.numel, oe);
      if (a >= b) continue;
      const size_t i = static_cast<size_t>(std::find(full_names_.begin(), full_names_.end(), p.name) - full_names_.begin());
      master.resize(static_cast<size_t>(b - a));
      working.resize(master.size());
      be_.copy_to_host(master.data(), state_->flat_view(state_->master, a, b - a));
      be_.copy_to_host(working.data(), state_->flat_view(state_->working, a, b - a));
      int64_t n_bad = 0;
      for (size_t k = 0; k < master.size(); ++k) {
        const uint16_t rounded = wt == DType::BF16 ? f32_to_bf16(master[k]) : f32_to_f16(master[k]);
        if (rounded == working[k]) continue;
        // Stochastic rounding: the master truncated to bf16, or one step further from zero.
        const uint16_t down = static_cast<uint16_t>(std::bit_cast<uint32_t>(master[k]) >> 16);
        n_bad += !(stochastic && wt == DType::BF16 && std::isfinite(master[k]) &&
                   (working[k] == down || working[k] == static_cast<uint16_t>(down + 1)));
      }
      bad[i] += static_cast<double>(n_bad);
      total[i] += static_cast<double>(master.size());
    }
  }
  bad = parallel::sum_over_ranks(*comms_->world, be_, bad);
  total = parallel::sum_over_ranks(*comms_->world, be_, total);
  std::vector<std::string> out;
  for (size_t i = 0; i < bad.size(); ++i)
    if (bad[i] > 0)
      out.push_back(full_names_[i] + ": " + std::to_string(static_cast<int64_t>(bad[i])) + " of " +
                    std::to_string(static_cast<int64_t>(total[i])) + " fp32 master values do not round to the stored " +
                    std::string(dtype_name(state_->working.dtype)) + " weights");
  return out;
}

}  // namespace keel
