#include "train/doctor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "train/config.h"

namespace keel::doctor {

using nlohmann::json;

namespace {

std::string num(double x, const char* fmt = "%.4g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

std::string percent(double fraction) { return num(100.0 * fraction, "%.1f") + "%"; }

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string join(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
  return s;
}

// "3-5, 9, 12-14": runs of steps collapse.
std::string step_list(std::vector<int64_t> steps, size_t max_runs = 12) {
  std::sort(steps.begin(), steps.end());
  std::vector<std::string> runs;
  for (size_t i = 0; i < steps.size();) {
    size_t j = i;
    while (j + 1 < steps.size() && steps[j + 1] == steps[j] + 1) ++j;
    runs.push_back(j > i ? std::to_string(steps[i]) + "-" + std::to_string(steps[j]) : std::to_string(steps[i]));
    i = j + 1;
  }
  if (runs.size() > max_runs) {
    const size_t more = runs.size() - max_runs;
    runs.resize(max_runs);
    runs.push_back("... (" + std::to_string(more) + " more)");
  }
  return join(runs);
}

std::string states_text(const Checkpoint& ck) { return join(ck.states()); }

bool has_separate_master(const Checkpoint& ck) {
  const auto s = ck.states();
  return std::find(s.begin(), s.end(), "master") != s.end();
}

// One line on a checkpoint: where it is and how its parameters are stored.
std::string checkpoint_line(const Checkpoint& ck) {
  const json& m = ck.meta();
  std::string s = "iteration " + std::to_string(ck.progress().iteration) + ", precision " + ck.precision() +
                  ", working weights " + m.value("weight_dtype", std::string("?")) + ", states: " + states_text(ck);
  if (m.value("master_is_weight", false)) s += " (fp32 run: the weights are the masters)";
  else if (!has_separate_master(ck)) s += " (NO fp32 master copy)";
  return s;
}

// Spacing of a float format at magnitude x: bf16 keeps 8 significant bits, fp16 11.
double spacing_at(const std::string& dtype, double x) {
  const int mantissa_bits = dtype == "bf16" ? 7 : dtype == "f16" ? 10 : 23;
  if (!(x > 0) || !std::isfinite(x)) return 0;
  return std::ldexp(1.0, std::ilogb(x) - mantissa_bits);
}

std::string power_of_two(double x) {
  return "2^" + std::to_string(std::ilogb(x)) + " = " + num(x, "%.2g");
}

double config_lr(const Checkpoint& ck) {
  const json& m = ck.meta();
  if (!m.contains("config")) return 0;
  return m["config"].value("optimizer", json::object()).value("lr", 0.0);
}

}  // namespace

// ---- frozen tensors ------------------------------------------------------------------------

FrozenReport compare_frozen(const Checkpoint& a, const Checkpoint& b, const FrozenOptions& opt) {
  // Between a checkpoint and itself (or an earlier one) nothing moved: every tensor would look frozen.
  const int64_t steps = b.progress().iteration - a.progress().iteration;
  if (steps <= 0)
    throw ConfigError("keel doctor frozen: B must be a later checkpoint than A, but B " + b.path() + " is at iteration " +
                      std::to_string(b.progress().iteration) + " and A " + a.path() + " at iteration " +
                      std::to_string(a.progress().iteration) + "; give the earlier checkpoint first");
  FrozenReport r;
  std::vector<std::string> notes;
  // Two runs' checkpoints: what moved between them says nothing of either run's training.
  const json ca = a.meta().value("config", json::object()), cb = b.meta().value("config", json::object());
  const std::string out_a = ca.value("out", std::string()), out_b = cb.value("out", std::string());
  if (!out_a.empty() && !out_b.empty() && out_a != out_b)
    notes.push_back("A and B were saved by different runs (--out " + out_a + " and " + out_b +
                    "): what moved between them is not what either run's training moved");
  if (a.precision() != b.precision())
    notes.push_back("A was trained in " + a.precision() + " and B in " + b.precision() +
                    ": the precision hints are B's");
  const auto ta = a.tensors("weight"), tb = b.tensors("weight");
  const double lr = std::max(config_lr(a), config_lr(b));
  for (const auto& [name, shape] : ta) {
    auto it = tb.find(name);
    if (it == tb.end()) {
      notes.push_back(name + " is only in A");
      continue;
    }
    if (it->second != shape) {
      notes.push_back(name + ": shapes differ, " + shape_text(shape) + " vs " + shape_text(it->second));
      continue;
    }
    TensorMotion t;
    t.name = name;
    t.state = a.has("master", name) && b.has("master", name) ? "master" : "weight";
    t.dtype = std::string(dtype_name(b.stored_dtype(t.state, name)));
    const std::vector<float> va = a.read_full(t.state, name), vb = b.read_full(t.state, name);
    t.numel = static_cast<int64_t>(va.size());
    int64_t same = 0;
    double sum_abs = 0, sum_change = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      if (std::memcmp(&va[i], &vb[i], sizeof(float)) == 0) ++same;
      const double d = std::fabs(static_cast<double>(vb[i]) - va[i]);
      if (std::isfinite(d)) {
        t.max_change = std::max(t.max_change, d);
        sum_change += d;
      }
      sum_abs += std::fabs(static_cast<double>(va[i]));
    }
    if (t.numel > 0) {
      t.unchanged = static_cast<double>(same) / static_cast<double>(t.numel);
      t.mean_change = sum_change / static_cast<double>(t.numel);
      t.typical = sum_abs / static_cast<double>(t.numel);
    }
    t.frozen = t.numel > 0 && t.unchanged >= opt.threshold;
    if (t.frozen) {
      const bool low_precision = t.dtype == "bf16" || t.dtype == "f16";
      if (t.state == "weight" && low_precision && !b.meta().value("master_is_weight", false)) {
        const double spacing = spacing_at(t.dtype, t.typical);
        t.precision = lr > 0 && lr < spacing / 2;
        const std::string fmt = t.dtype == "bf16" ? "bf16" : "fp16";
        if (t.precision)
          t.hint = "precision: values around " + num(t.typical, "%.3g") + " stored in " + fmt +
                   " with no fp32 master copy (states: " + states_text(b) + "): " + fmt + "'s spacing there is " +
                   power_of_two(spacing) + ", so an AdamW update of about the learning rate (at most " + num(lr, "%.3g") +
                   ") is under half a spacing and rounds away at every step. Train with precision.mode = \"bf16\" "
                   "(fp32 master weights); a run that already froze needs its masters rebuilt (--init-from)";
        else
          t.hint = "stored in " + fmt + " with no fp32 master copy, yet updates of the learning rate (" +
                   num(lr, "%.3g") + ") should show at this magnitude (spacing " + power_of_two(spacing) +
                   "): did it get a gradient at all?";
      } else {
        t.hint = "its " + std::string(t.state == "master" ? "fp32 master" : t.dtype + " weights") +
                 " did not change either: the optimizer never updated it (a zero gradient: not connected to the loss, "
                 "excluded from the optimizer, or every step skipped)";
      }
    }
    r.tensors.push_back(std::move(t));
  }
  for (const auto& [name, shape] : tb)
    if (!ta.count(name)) notes.push_back(name + " is only in B");

  // Frozen first, then the least-moving: most elements unchanged, then the smallest mean change
  // relative to the tensor's magnitude (training moves every element, so the first key often ties).
  auto relative_change = [](const TensorMotion& t) { return t.typical > 0 ? t.mean_change / t.typical : t.mean_change; };
  std::stable_sort(r.tensors.begin(), r.tensors.end(), [&](const TensorMotion& x, const TensorMotion& y) {
    if (x.frozen != y.frozen) return x.frozen;
    if (x.unchanged != y.unchanged) return x.unchanged > y.unchanged;
    return relative_change(x) < relative_change(y);
  });

  std::string& s = r.text;
  s = "keel doctor frozen: A " + a.path() + "\n                    B " + b.path() + "\n";
  s += "  A: " + checkpoint_line(a) + "\n  B: " + checkpoint_line(b) + "\n";
  s += "  " + std::to_string(steps) + " optimizer step(s) apart; compared per tensor: the fp32 master where both have "
       "it, else the stored weights\n";
  int64_t frozen_params = 0, total_params = 0;
  for (const TensorMotion& t : r.tensors) {
    total_params += t.numel;
    if (t.frozen) ++r.frozen, frozen_params += t.numel;
  }
  auto row = [](const TensorMotion& t) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "  %-34s %-6s %-5s %9s %13.4g %13.4g %11.4g\n", t.name.c_str(), t.state.c_str(),
                  t.dtype.c_str(), percent(t.unchanged).c_str(), t.max_change, t.mean_change, t.typical);
    return std::string(buf);
  };
  char header[256];
  std::snprintf(header, sizeof header, "  %-34s %-6s %-5s %9s %13s %13s %11s\n", "tensor", "state", "dtype", "unchanged",
                "max |change|", "mean |change|", "mean |A|");
  if (r.frozen == 0) {
    s += "no frozen tensors: every tensor has more than " + percent(1 - opt.threshold) +
         " of its elements changed\n";
  } else {
    s += "FROZEN: " + std::to_string(r.frozen) + " of " + std::to_string(r.tensors.size()) + " tensors (>= " +
         percent(opt.threshold) + " of elements unchanged), " + std::to_string(frozen_params) + " of " +
         std::to_string(total_params) + " parameters\n" + header;
    std::map<std::string, std::vector<std::string>> by_hint;  // one explanation for the tensors it fits
    std::vector<std::string> hint_order;
    for (const TensorMotion& t : r.tensors) {
      if (!t.frozen) continue;
      s += row(t);
      if (!by_hint.count(t.hint)) hint_order.push_back(t.hint);
      by_hint[t.hint].push_back(t.name);
      r.problems.push_back(t.name + " did not move: " + percent(t.unchanged) + " of its " + std::to_string(t.numel) +
                           " elements unchanged (" + t.state + ", " + t.dtype + ")" +
                           (t.precision ? ": precision" : ""));
    }
    for (const std::string& h : hint_order) s += "  why (" + join(by_hint[h]) + "): " + h + "\n";
  }
  const int moving = static_cast<int>(r.tensors.size()) - r.frozen;
  if (moving > 0) {
    s += "moving: " + std::to_string(moving) + " tensors" +
         (moving > opt.max_moving ? ", the " + std::to_string(opt.max_moving) + " least-moving" : std::string()) + "\n" +
         header;
    int shown = 0;
    for (const TensorMotion& t : r.tensors)
      if (!t.frozen && shown++ < opt.max_moving) s += row(t);
  }
  for (const auto& n : notes) s += "note: " + n + "\n";
  return r;
}

// ---- checkpoint audit ------------------------------------------------------------------------

std::vector<std::string> decay_group_problems(const std::vector<ParamSpec>& params) {
  std::vector<std::string> out;
  for (const ParamSpec& p : params) {
    const std::string what = p.name + " (" + role_name(p.role) + ", " + shape_text(p.shape) + ")";
    const bool vector_like = p.shape.size() <= 1;
    const bool named_norm = p.name.find("norm") != std::string::npos;
    if (p.decay && (p.role == Role::Norm || p.role == Role::Bias || vector_like))
      out.push_back(what + " is in the weight-decay group: decay pulls " +
                    (p.role == Role::Bias ? std::string("a bias") : std::string("a norm gain")) +
                    " toward 0 at every step; norms and biases must not decay (seed 001: a norm misfiled by a class "
                    "check)");
    else if (!p.decay && !vector_like && (p.role == Role::Matrix || p.role == Role::Embedding))
      out.push_back(what + " has no weight decay: matrices and embeddings decay (optimizer.weight_decay)");
    if (named_norm && p.role != Role::Norm && p.role != Role::Bias)
      out.push_back(what + " is named like a norm but its role is " + role_name(p.role) +
                    ": misfiled in the parameter table");
  }
  return out;
}

CkptReport audit_checkpoint(const Checkpoint& ck) {
  CkptReport r;
  const json& m = ck.meta();
  const TrainProgress prog = ck.progress();
  const bool weights_only = m.value("weights_only", false);
  std::string& s = r.text;
  s = "keel doctor ckpt: " + ck.path() + "\n";
  s += "  " + checkpoint_line(ck) + "\n";
  s += "  Adam step " + std::to_string(ck.adam_step()) + ", skipped iterations " + std::to_string(prog.skipped_total) +
       ", saved under " + saved_layout_text(m) + (weights_only ? ", weights only" : "") + "\n";

  // Which states exist for which tensors.
  const auto weights = ck.tensors("weight");
  s += "states:\n";
  for (const std::string& state : {std::string("weight"), std::string("master"), std::string("adam_m"), std::string("adam_v")}) {
    const auto have = ck.tensors(state);
    if (have.empty()) {
      s += "  " + state + ": none\n";
      continue;
    }
    std::vector<std::string> lacking;
    for (const auto& [name, shape] : weights)
      if (!have.count(name)) lacking.push_back(name);
    std::string dtype = std::string(dtype_name(ck.stored_dtype(state, have.begin()->first)));
    s += "  " + state + " (" + dtype + "): " + std::to_string(have.size()) + " tensors" +
         (lacking.empty() ? "" : ", missing for " + join(lacking)) + "\n";
    if (!lacking.empty() && state != "master")
      r.problems.push_back(state + " is missing for " + join(lacking) + ": a resume cannot restore them");
  }

  // Adam's step against the updates the run applied.
  s += "optimizer:\n";
  const int64_t applied = prog.iteration - prog.skipped_total;
  if (weights_only) {
    s += "  weights only: no optimizer state (an --init-from source)\n";
  } else if (ck.adam_step() != applied) {
    r.problems.push_back("Adam step is " + std::to_string(ck.adam_step()) + " but the run applied " +
                         std::to_string(applied) + " updates (iteration " + std::to_string(prog.iteration) + " - " +
                         std::to_string(prog.skipped_total) + " skipped): bias correction " +
                         (ck.adam_step() < applied ? "restarted (a resume that lost Adam's step: a silent LR boost)"
                                                   : "ran ahead of the updates"));
    s += "  Adam step " + std::to_string(ck.adam_step()) + " != " + std::to_string(applied) + " applied updates: PROBLEM\n";
  } else {
    s += "  Adam step " + std::to_string(ck.adam_step()) + " = iteration " + std::to_string(prog.iteration) + " - " +
         std::to_string(prog.skipped_total) + " skipped: consistent\n";
  }

  // Moments: all zero (never restored) or non-finite; every state: non-finite values.
  int moment_tensors = 0;
  for (const auto& [name, shape] : weights) {
    bool zero_m = false, zero_v = false;
    bool has_moments = false;
    for (const std::string& state : ck.states()) {
      if (!ck.has(state, name)) continue;
      const std::vector<float> v = ck.read_full(state, name);
      int64_t bad = 0;
      bool all_zero = true;
      for (float x : v) {
        if (!std::isfinite(x)) ++bad;
        if (x != 0) all_zero = false;
      }
      if (bad) {
        r.nonfinite.push_back(state + "/" + name);
        r.problems.push_back(state + " of " + name + " holds " + std::to_string(bad) + " non-finite value(s) of " +
                             std::to_string(v.size()) + ": resuming would poison the run");
      }
      if (state == "adam_m") zero_m = all_zero, has_moments = true;
      if (state == "adam_v") zero_v = all_zero, has_moments = true;
    }
    if (has_moments) ++moment_tensors;
    if (has_moments && zero_m && zero_v) r.zero_moments.push_back(name);
  }
  if (moment_tensors > 0) {
    const size_t nz = r.zero_moments.size();
    if (ck.adam_step() > 0 && nz == static_cast<size_t>(moment_tensors)) {
      r.problems.push_back("Adam moments are all zero in every tensor, yet Adam step is " + std::to_string(ck.adam_step()) +
                           ": the moments were never restored (a weights-only load that kept the step count?)");
      s += "  moments: all zero in all " + std::to_string(nz) + " tensors: PROBLEM\n";
    } else if (ck.adam_step() > 0 && nz > 0) {
      r.problems.push_back("Adam moments are all zero for " + join(r.zero_moments) + " while Adam step is " +
                           std::to_string(ck.adam_step()) + ": never a gradient (not connected to the loss?) or not restored");
      s += "  moments: all zero in " + std::to_string(nz) + " of " + std::to_string(moment_tensors) + " tensors: PROBLEM\n";
    } else if (ck.adam_step() == 0 && nz < static_cast<size_t>(moment_tensors)) {
      r.problems.push_back("Adam step is 0 but " + std::to_string(moment_tensors - static_cast<int>(nz)) +
                           " tensors have non-zero moments: the first step's bias correction will overweight them");
      s += "  moments: non-zero at Adam step 0: PROBLEM\n";
    } else {
      s += "  moments: " + std::string(ck.adam_step() == 0 ? "zero at Adam step 0 (a fresh optimizer)"
                                                            : "non-zero in every tensor") + "\n";
    }
  }
  if (!r.nonfinite.empty()) s += "  non-finite values in " + join(r.nonfinite) + ": PROBLEM\n";

  // Masters against the working weights: after any step, weight == round(master).
  s += "masters vs working weights:\n";
  if (m.value("master_is_weight", false)) {
    s += "  fp32 run: the weights are the masters\n";
  } else if (!has_separate_master(ck)) {
    const bool unsafe = ck.precision() == "bf16-unsafe-no-master";
    s += "  no fp32 masters: " +
         std::string(unsafe ? "bf16-unsafe-no-master keeps parameters only in bf16; updates below bf16's spacing round "
                              "away (keel doctor frozen shows which tensors stopped moving): PROBLEM"
                            : "weights only") + "\n";
    if (unsafe)
      r.problems.push_back("trained without fp32 master weights (precision.mode bf16-unsafe-no-master): updates smaller "
                           "than bf16's spacing round away, and norm gains near 1 stop training (seed 002). To go on with "
                           "masters, start from its weights: keel train --init-from " + ck.path() +
                           " --set precision.mode=bf16 (fp32 masters built from the weights, Adam moments from zero)");
  } else {
    int checked = 0;
    for (const auto& [name, shape] : weights) {
      if (!ck.has("master", name)) continue;
      ++checked;
      const DType wdt = ck.stored_dtype("weight", name);
      const std::vector<float> master = ck.read_full("master", name), weight = ck.read_full("weight", name);
      int64_t differ = 0;
      double max_diff = 0;
      for (size_t i = 0; i < master.size(); ++i) {
        const float rounded = round_to(wdt, master[i]);
        if (std::memcmp(&rounded, &weight[i], sizeof(float)) == 0) continue;
        ++differ;
        const double d = std::fabs(static_cast<double>(rounded) - weight[i]);
        if (std::isfinite(d)) max_diff = std::max(max_diff, d);
      }
      if (differ == 0) continue;
      r.master_mismatch.push_back(name);
      r.problems.push_back(name + ": master and working weights disagree in " + std::to_string(differ) + " of " +
                           std::to_string(master.size()) + " elements (max |round(master) - weight| " +
                           num(max_diff) + "): the next step overwrites the weights with round(master)");
    }
    if (r.master_mismatch.empty()) {
      s += "  " + std::to_string(checked) + " tensors: round(master) to " + m.value("weight_dtype", std::string("?")) +
           " equals the working weights everywhere\n";
    } else {
      s += "  PROBLEM: " + std::to_string(r.master_mismatch.size()) + " of " + std::to_string(checked) +
           " tensors disagree (" + join(r.master_mismatch) +
           "). The masters are not where these weights came from: masters left at a fresh init (or stale) after a "
           "weights-only load silently replace the loaded weights at the first step (seed 000). Rebuild the masters "
           "from the weights (--init-from this checkpoint's weights)\n";
    }
  }

  // Weight-decay groups, from the parameter table of the saved config.
  s += "weight decay groups (by role, from the saved config):\n";
  try {
    const RunConfig cfg = parse_config(m.at("config"), ck.path() + "/meta.json config");
    const ParamTable table(cfg.model);
    int64_t n[2] = {0, 0}, t[2] = {0, 0};
    std::map<std::string, int> roles[2];
    for (const ParamSpec& p : table.params()) {
      n[p.decay] += p.logical_numel();
      t[p.decay] += 1;
      roles[p.decay][role_name(p.role)] += 1;
    }
    auto roles_text = [](const std::map<std::string, int>& rm) {
      std::vector<std::string> parts;
      for (const auto& [role, count] : rm) parts.push_back(std::to_string(count) + " " + role);
      return join(parts);
    };
    s += "  decay " + num(cfg.optimizer.weight_decay, "%.3g") + ": " + std::to_string(t[1]) + " tensors, " +
         std::to_string(n[1]) + " parameters (" + roles_text(roles[1]) + ")\n";
    s += "  no decay:  " + std::to_string(t[0]) + " tensors, " + std::to_string(n[0]) + " parameters (" +
         roles_text(roles[0]) + ")\n";
    const std::vector<std::string> misfiled = decay_group_problems(table.params());
    for (const auto& p : misfiled) {
      s += "  PROBLEM: " + p + "\n";
      r.problems.push_back(p);
    }
    std::vector<std::string> unknown;
    for (const auto& [name, shape] : weights)
      if (!table.contains(name)) unknown.push_back(name);
    if (!unknown.empty()) {
      r.problems.push_back("tensors the saved config's model does not have: " + join(unknown));
      s += "  PROBLEM: not in the model's parameter table: " + join(unknown) + "\n";
    }
  } catch (const std::exception& e) {
    s += "  cannot rebuild the parameter table from the saved config: " + std::string(e.what()) + "\n";
  }

  // fp16: a scale at its minimum means the run is about to stop.
  if (ck.precision() == "fp16" && m.contains("loss_scaler")) {
    const double scale = m["loss_scaler"].value("scale", 0.0);
    double min_scale = 1.0;
    if (m.contains("config"))
      min_scale = m["config"].value("precision", json::object()).value("loss_scale", json::object()).value("min", 1.0);
    s += "loss scaler: scale " + num(scale, "%.10g") + " (minimum " + num(min_scale, "%.10g") + ")\n";
    if (scale <= min_scale)
      r.problems.push_back("the fp16 loss scale is at its minimum (" + num(scale) +
                           "): gradients overflow even unscaled; the run cannot continue in fp16");
  }

  s += r.problems.empty() ? "verdict: no problems found\n"
                          : "verdict: " + std::to_string(r.problems.size()) + " problem(s):\n";
  for (const auto& p : r.problems) s += "  - " + p + "\n";
  return r;
}

// ---- metrics --------------------------------------------------------------------------------

namespace {

// JSON numbers, or the strings "nan", "inf", "-inf" keel writes for non-finite values.
std::optional<double> number_of(const json& rec, const char* key) {
  if (!rec.contains(key)) return std::nullopt;
  const json& v = rec[key];
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    const std::string t = v.get<std::string>();
    if (t == "nan") return std::nan("");
    if (t == "inf") return INFINITY;
    if (t == "-inf") return -INFINITY;
  }
  return std::nullopt;
}

struct StepRec {
  int64_t step = 0;
  double loss = 0, grad_norm = std::nan("");
  std::optional<double> scale;
  bool skipped = false;
  int64_t nan_total = -1;
};

// Running z-score over the last `window` accepted values: a value at least z standard
// deviations above the mean, and at least min_ratio times the mean, is a spike and is kept out
// of the statistics. The ratio is the training health check's (health.spike_min_jump for the
// loss, health.spike_norm_ratio for the grad norm): late in a run the grad norm varies so little
// that its ordinary 1.2x wander is many deviations, and a healthy run must not read as sick.
class SpikeScan {
 public:
  SpikeScan(const MetricsOptions& o, double min_ratio) : opt_(o), min_ratio_(min_ratio) {}
  // Returns the spike, if x is one.
  std::optional<Spike> observe(int64_t step, double x) {
    if (!std::isfinite(x)) return std::nullopt;
    std::optional<Spike> out;
    if (static_cast<int>(hist_.size()) >= opt_.min_history) {
      const Stats st = stats();
      const double z = (x - st.mean) / st.std;
      if (z >= opt_.z && x >= min_ratio_ * st.mean) out = Spike{step, x, st.mean, z};
    }
    if (!out) {
      hist_.push_back(x);
      if (static_cast<int>(hist_.size()) > opt_.window) hist_.pop_front();
    }
    return out;
  }
  struct Stats {
    double mean = 0, std = 1;
  };
  bool ready() const { return static_cast<int>(hist_.size()) >= opt_.min_history; }
  Stats stats() const {
    Stats st;
    double sum = 0, sq = 0;
    for (double v : hist_) sum += v;
    st.mean = sum / static_cast<double>(hist_.size());
    for (double v : hist_) sq += (v - st.mean) * (v - st.mean);
    // A floor on the deviation: a flat stretch must not turn rounding noise into a spike.
    st.std = std::max(std::sqrt(sq / static_cast<double>(hist_.size())), 1e-3 * std::fabs(st.mean) + 1e-12);
    return st;
  }

 private:
  MetricsOptions opt_;
  double min_ratio_;
  std::deque<double> hist_;
};

// The spike ratios of the run the metrics file belongs to: its config.json, which `keel train
// --out` writes beside metrics.jsonl, else keel's defaults. `from` says which, for the output.
struct RunHealth {
  HealthConfig health;
  std::string from;
};
RunHealth run_health(const std::string& metrics_path) {
  const std::string config = (std::filesystem::path(metrics_path).parent_path() / "config.json").string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config, ec)) return {{}, "keel's defaults (no config.json beside the file)"};
  try {
    std::ifstream in(config);
    return {parse_config(json::parse(in), config).health, "the run's " + config};
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    return {{}, "keel's defaults (" + config + " could not be read: " + why + ")"};
  }
}

std::string spike_line(const Spike& sp) {
  return "step " + std::to_string(sp.step) + ": " + num(sp.value) + " (running mean " + num(sp.mean) + ", z " +
         num(sp.z, "%.1f") + ")";
}

}  // namespace

MetricsReport summarize_metrics(const std::string& path, const MetricsOptions& opt) {
  MetricsReport r;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read metrics file " + path);
  std::map<int64_t, StepRec> by_step;  // a replayed step keeps its last record
  std::map<std::string, std::map<int64_t, double>> vals;  // by step; "": data.val, else data.val_sets' names
  std::map<std::string, int64_t> val_without_loss;        // evaluations reported as nan (no target in the loss)
  std::map<std::string, int64_t> val_nonfinite;           // evaluations whose loss overflowed (targets, no number)
  std::map<std::string, int64_t> val_unexplained;         // nan from a keel that did not record the targets
  struct Resume {
    int64_t step;
    std::string checkpoint;
  };
  std::vector<Resume> resumes;
  struct Rewind {
    int64_t step, to;
    std::string checkpoint;
    std::optional<double> loss;  // of the step that set it off
  };
  std::vector<Rewind> rewinds;
  std::vector<std::pair<int64_t, std::string>> refused_rewinds;  // (step, checkpoint) a rewind found damaged
  // A resume at step S, or a rewind to S, continues from S's checkpoint: the records of later
  // steps belong to the abandoned trajectory (TensorBoard drops them at its restart marker too).
  // A start event (step 0) begins a new run in the same directory: every earlier record is another run's.
  int64_t superseded = 0, other_runs = 0;
  auto restart_at = [&](int64_t s) {
    int64_t dropped = 0;
    for (auto it = by_step.upper_bound(s); it != by_step.end(); it = by_step.erase(it)) ++dropped;
    for (auto& [name, series] : vals) series.erase(series.upper_bound(s), series.end());
    return dropped;
  };
  struct StragglerSeen {
    std::string host;
    double worst = 0;  // compute / the stage's typical compute
    int64_t first = -1, last = -1;
  };
  std::map<int, StragglerSeen> straggler_seen;
  std::vector<std::pair<int64_t, std::string>> frozen;  // the live check's frozen-parameter warnings (step, text)
  std::string balance_line;  // the run's measured pipeline balance advice, if it gave one
  auto ms_list = [](const json& a) {
    std::string t;
    for (const json& x : a) t += (t.empty() ? "" : ", ") + (x.is_number() ? num(x.get<double>(), "%.1f") : "?");
    return "[" + t + "]";
  };
  std::vector<std::string> notes;
  int64_t bad_lines = 0, line_no = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json rec;
    try {
      rec = json::parse(line);
    } catch (const std::exception&) {
      if (++bad_lines <= 3) notes.push_back("line " + std::to_string(line_no) + " is not JSON (a crash mid-write?): skipped");
      continue;
    }
    if (!rec.is_object()) continue;
    if (rec.contains("event")) {
      if (rec["event"] == "resume") {
        resumes.push_back({rec.value("step", int64_t{0}), rec.value("checkpoint", std::string())});
        superseded += restart_at(resumes.back().step);
      }
      if (rec["event"] == "start") other_runs += restart_at(-1);
      if (rec["event"] == "rewind" && rec.contains("to") && rec["to"].is_number_integer()) {
        Rewind rw{rec.value("step", int64_t{0}), rec["to"].get<int64_t>(), rec.value("checkpoint", std::string()), {}};
        if (by_step.count(rw.step)) rw.loss = by_step[rw.step].loss;
        rewinds.push_back(rw);
        superseded += restart_at(rw.to);
      }
      if (rec["event"] == "diverged")  // keel train's: a loss above twice a uniform guess's
        r.problems.push_back("at step " + std::to_string(rec.value("step", int64_t{0})) + " the loss (" +
                             (rec.contains("loss") ? rec["loss"].dump() : std::string("?")) +
                             ") was more than twice a uniform guess's over the vocabulary: the run diverged");
      if (rec["event"] == "rewind_refused")
        refused_rewinds.push_back({rec.value("step", int64_t{0}), rec.value("checkpoint", std::string())});
      if (rec["event"] == "pipeline_balance" && rec.contains("pipeline_layers") && rec["pipeline_layers"].is_array()) {
        r.pipeline_layers.clear();
        for (const json& n : rec["pipeline_layers"])
          if (n.is_number_integer()) r.pipeline_layers.push_back(n.get<int>());
        balance_line = "  pipeline balance at step " + std::to_string(rec.value("step", int64_t{0})) +
                       ": the stages computed " + ms_list(rec.value("stage_compute_ms", json::array())) +
                       " ms a step with parallel.pipeline_layers " +
                       (rec.contains("pipeline_layers_now") ? rec["pipeline_layers_now"].dump() : "?") +
                       "; the run suggested " + json(r.pipeline_layers).dump() + " (slowest stage about " +
                       num(rec.value("slowest_after_ms", 0.0), "%.1f") + " ms)\n";
      }
      if (rec["event"] == "frozen" && rec.contains("warnings") && rec["warnings"].is_array()) {
        const int64_t at = rec.value("step", int64_t{0});
        for (const json& w : rec["warnings"])
          if (w.is_string()) frozen.push_back({at, w.get<std::string>()});
      }
      if (rec["event"] == "timers") {
        ++r.timed_steps;
        if (rec.contains("stragglers") && rec["stragglers"].is_array())
          for (const json& g : rec["stragglers"]) {
            const int rank = g.value("rank", -1);
            ++r.stragglers[rank];
            double ratio = 0;
            if (g.value("stage_median_ms", 0.0) > 0) ratio = g.value("compute_ms", 0.0) / g.value("stage_median_ms", 1.0);
            StragglerSeen& seen = straggler_seen[rank];
            seen.host = g.value("host", std::string());
            seen.worst = std::max(seen.worst, ratio);
            if (seen.first < 0) seen.first = rec.value("step", int64_t{0});
            seen.last = rec.value("step", int64_t{0});
          }
      }
      continue;
    }
    if (!rec.contains("step")) continue;
    const int64_t step = rec["step"].get<int64_t>();
    if (rec.contains("val_loss") || rec.contains("val_losses")) {
      // nan: a set whose evaluated targets were all masked, so it had no loss; kept out of the trend.
      // Beside it, the targets in the loss (val_loss_tokens): a nan with targets is an overflow.
      auto add = [&](const std::string& name, std::optional<double> v, std::optional<double> targets) {
        if (v && std::isfinite(*v)) vals[name][step] = *v;
        else if (v && !targets) ++val_unexplained[name];
        else if (v) ++(*targets == 0 ? val_without_loss : val_nonfinite)[name];
      };
      add("", number_of(rec, "val_loss"), number_of(rec, "val_loss_tokens"));
      const json by_set = rec.value("val_loss_tokens_by_set", json::object());
      if (rec.contains("val_losses") && rec["val_losses"].is_object())
        for (const auto& [name, x] : rec["val_losses"].items())
          add(name, number_of(rec["val_losses"], name.c_str()),
              by_set.is_object() ? number_of(by_set, name.c_str()) : std::nullopt);
      continue;
    }
    auto loss = number_of(rec, "loss");
    if (!loss) continue;
    StepRec s;
    s.step = step;
    s.loss = *loss;
    if (auto g = number_of(rec, "grad_norm")) s.grad_norm = *g;
    s.scale = number_of(rec, "loss_scale");
    s.skipped = rec.value("skipped", false);
    s.nan_total = rec.value("nan_total", int64_t{-1});
    if (by_step.count(step)) ++superseded;
    by_step[step] = s;
  }
  if (bad_lines > 3) notes.push_back(std::to_string(bad_lines) + " lines in all were not JSON");

  std::string& s = r.text;
  s = "keel doctor metrics: " + path + "\n";
  r.steps = static_cast<int64_t>(by_step.size());
  if (by_step.empty()) {
    // An empty or wrong file is not a healthy run: a check built on this command must fail.
    r.problems.push_back(path + " holds no step records (is it a run's metrics.jsonl?)");
    s += "  no step records\nproblem: " + r.problems.back() + "\n";
    for (const auto& n : notes) s += "note: " + n + "\n";
    return r;
  }
  const StepRec& first = by_step.begin()->second;
  const StepRec& last = by_step.rbegin()->second;
  s += "  steps: " + std::to_string(r.steps) + " (" + std::to_string(first.step) + " - " + std::to_string(last.step) + ")" +
       (superseded ? ", " + std::to_string(superseded) +
                         " earlier record(s) superseded by a resume or rewind (the trajectory the run went on with counts)"
                   : std::string()) + "\n";
  if (other_runs)
    s += "  " + std::to_string(other_runs) + " step record(s) of earlier runs in this directory (before the last "
         "{\"event\": \"start\"}) not counted\n";

  // Loss and grad norm: levels and spikes.
  const StepRec* min_rec = nullptr;
  const RunHealth run = run_health(path);  // the live check's ratios, as the run had them
  const double loss_ratio = 1 + run.health.spike_min_jump, norm_ratio = run.health.spike_norm_ratio;
  s += "  spike ratios: health.spike_min_jump " + num(run.health.spike_min_jump) + ", health.spike_norm_ratio " +
       num(norm_ratio) + ", from " + run.from + "\n";
  SpikeScan loss_scan(opt, loss_ratio), norm_scan(opt, norm_ratio);
  int64_t prev_nan = 0;
  std::optional<double> prev_scale;
  double max_norm = 0;
  int64_t max_norm_step = 0;
  std::map<int64_t, SpikeScan::Stats> before_step;  // running loss statistics just before each step
  for (const auto& [step, rec] : by_step) {
    if (loss_scan.ready()) before_step[step] = loss_scan.stats();
    const bool good = std::isfinite(rec.loss) && !rec.skipped;
    if (std::isfinite(rec.loss) && (!min_rec || rec.loss < min_rec->loss)) min_rec = &rec;
    if (good) {
      if (auto sp = loss_scan.observe(step, rec.loss)) r.loss_spikes.push_back(*sp);
      if (std::isfinite(rec.grad_norm)) {
        if (auto sp = norm_scan.observe(step, rec.grad_norm)) r.grad_norm_spikes.push_back(*sp);
        if (rec.grad_norm > max_norm) max_norm = rec.grad_norm, max_norm_step = step;
      }
    }
    if (rec.skipped) r.skipped_steps.push_back(step);
    const bool nan_now = !std::isfinite(rec.loss) || (rec.nan_total >= 0 && rec.nan_total > prev_nan);
    if (nan_now) r.nan_steps.push_back(step);
    if (rec.nan_total >= 0) prev_nan = rec.nan_total;
    if (rec.scale) {
      if (prev_scale && *rec.scale != *prev_scale) r.scale_changes.push_back({step, *prev_scale, *rec.scale});
      r.min_scale = r.min_scale == 0 ? *rec.scale : std::min(r.min_scale, *rec.scale);
      prev_scale = rec.scale;
    }
  }
  s += "  loss: " + num(first.loss) + " at step " + std::to_string(first.step) + " -> " + num(last.loss) + " at step " +
       std::to_string(last.step);
  if (min_rec) s += ", min " + num(min_rec->loss) + " at step " + std::to_string(min_rec->step);
  s += "\n";
  if (max_norm > 0) s += "  grad norm: max " + num(max_norm) + " at step " + std::to_string(max_norm_step) + "\n";
  auto scan_rule = [&](double ratio) {
    return "z >= " + num(opt.z, "%.3g") + " and " + num(ratio, "%.3g") + "x the mean over the last " +
           std::to_string(opt.window) + " steps";
  };
  s += "  loss spikes (" + scan_rule(loss_ratio) + "): " +
       (r.loss_spikes.empty() ? "none" : std::to_string(r.loss_spikes.size())) + "\n";
  for (const Spike& sp : r.loss_spikes) {
    s += "    " + spike_line(sp) + "\n";
    r.problems.push_back("loss spike at " + spike_line(sp));
  }
  s += "  grad norm spikes (" + scan_rule(norm_ratio) + "): " +
       (r.grad_norm_spikes.empty() ? "none" : std::to_string(r.grad_norm_spikes.size())) + "\n";
  for (const Spike& sp : r.grad_norm_spikes) {
    s += "    " + spike_line(sp) + "\n";
    r.problems.push_back("grad norm spike at " + spike_line(sp));
  }

  // Skipped and non-finite steps, and the fp16 loss scale.
  const bool scaled = r.min_scale > 0 && (r.min_scale != 1.0 || !r.scale_changes.empty());
  s += "  skipped steps: " + (r.skipped_steps.empty() ? std::string("none")
                                                     : std::to_string(r.skipped_steps.size()) + " (" +
                                                           step_list(r.skipped_steps) + ")") + "\n";
  s += "  non-finite loss or gradient: " + (r.nan_steps.empty() ? std::string("none")
                                                                 : std::to_string(r.nan_steps.size()) + " (" +
                                                                       step_list(r.nan_steps) + ")") + "\n";
  if (!scaled) {
    if (!r.nan_steps.empty())
      r.problems.push_back("non-finite loss or gradient at steps " + step_list(r.nan_steps) +
                           " without loss scaling (bf16/fp32): something in the model overflows or divides by zero");
  } else {
    int cuts = 0, growths = 0;
    for (const ScaleChange& c : r.scale_changes) (c.to < c.from ? cuts : growths) += 1;
    int64_t min_step = 0;
    for (const auto& [step, rec] : by_step)
      if (rec.scale && *rec.scale == r.min_scale) {
        min_step = step;
        break;
      }
    auto scale_text = [](double x) { return num(x, "%.10g"); };  // powers of two, in full
    s += "  loss scale: " + scale_text(first.scale.value_or(0)) + " at step " + std::to_string(first.step) + ", " +
         std::to_string(cuts) + " cut(s), " + std::to_string(growths) + " growth(s), min " + scale_text(r.min_scale) +
         " from step " + std::to_string(min_step) + ", final " + scale_text(last.scale.value_or(0)) + "\n";
    const size_t show = 12;
    for (size_t i = 0; i < r.scale_changes.size(); ++i) {
      if (i == show) {
        s += "    ... " + std::to_string(r.scale_changes.size() - show) + " more change(s)\n";
        break;
      }
      const ScaleChange& c = r.scale_changes[i];
      s += "    from step " + std::to_string(c.step) + ": " + scale_text(c.from) + " -> " + scale_text(c.to) + "\n";
    }
    if (r.min_scale <= 1.0)
      r.problems.push_back("the fp16 loss scale fell to " + num(r.min_scale) + " at step " + std::to_string(min_step) +
                           ": gradients overflow even unscaled; some layer's activations or gradients exceed fp16's "
                           "range (65504)");
    if (r.skipped_steps.size() * 10 > static_cast<size_t>(r.steps))
      r.problems.push_back(std::to_string(r.skipped_steps.size()) + " of " + std::to_string(r.steps) +
                           " steps skipped for overflow: more than the loss scaler's occasional calibration");
  }

  // Resumes: the first loss after each, against the statistics before it (restart spikes).
  s += "  resumes: " + (resumes.empty() ? std::string("none") : std::to_string(resumes.size())) + "\n";
  for (const Resume& res : resumes) {
    r.resumes.push_back(res.step);
    std::string l = "    at step " + std::to_string(res.step) + (res.checkpoint.empty() ? "" : " from " + res.checkpoint);
    auto after = by_step.upper_bound(res.step);
    if (after != by_step.end() && before_step.count(after->first)) {
      const SpikeScan::Stats st = before_step[after->first];
      const double z = (after->second.loss - st.mean) / st.std;
      l += ": loss " + num(after->second.loss) + " at step " + std::to_string(after->first) + " (running mean before " +
           num(st.mean) + ", z " + num(z, "%.1f") + ")";
      if (z >= opt.z) {
        l += ": RESTART SPIKE";
        r.problems.push_back("restart spike: loss " + num(after->second.loss) + " at step " + std::to_string(after->first) +
                             " right after resuming at step " + std::to_string(res.step) + " (running mean " +
                             num(st.mean) + ", z " + num(z, "%.1f") +
                             "): something the next step depends on was not restored (keel doctor ckpt on that checkpoint)");
      }
    }
    s += l + "\n";
  }

  // Parameters the live check found frozen (health.frozen_check_interval): named again here, as
  // the run's warnings scroll by; each is a problem (seed 002's norms that never trained).
  s += "  frozen parameters (live check): " + (frozen.empty() ? std::string("none") : std::to_string(frozen.size())) +
       "\n";
  for (const auto& [at, text] : frozen) {
    s += "    at step " + std::to_string(at) + ": " + text + "\n";
    r.problems.push_back("frozen parameter at step " + std::to_string(at) + ": " + text);
  }

  // Rewinds (health.spike_action rewind): the spike's step was left out and the run went back.
  s += "  rewinds: " + (rewinds.empty() ? std::string("none") : std::to_string(rewinds.size())) + "\n";
  for (const Rewind& rw : rewinds) {
    r.rewinds.push_back({rw.step, rw.to});
    s += "    at step " + std::to_string(rw.step) + (rw.loss ? " (loss " + num(*rw.loss) + ")" : "") + " back to step " +
         std::to_string(rw.to) + (rw.checkpoint.empty() ? "" : " from " + rw.checkpoint) +
         ": a spike; the steps after it were trained again on the data that followed\n";
  }
  // A rewind refused: the checkpoint it would have loaded failed verification (a problem on disk).
  for (const auto& [at, checkpoint] : refused_rewinds) {
    const std::string text = "at step " + std::to_string(at) + " a spike's rewind refused " +
                             (checkpoint.empty() ? std::string("the latest checkpoint") : checkpoint) +
                             ", which failed verification (keel ckpt verify names what is damaged); the update was "
                             "skipped instead";
    s += "    " + text + "\n";
    r.problems.push_back(text);
  }

  // Validation trends: data.val, then each named set, one evaluation per step.
  std::erase_if(vals, [](const auto& v) { return v.second.empty(); });
  if (vals.empty()) s += "  validation: none\n";
  for (const auto& [name, series] : vals) {
    const auto& [first_step, first_loss] = *series.begin();
    const auto& [last_step, last_loss] = *series.rbegin();
    auto best = std::min_element(series.begin(), series.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
    s += "  validation" + (name.empty() ? std::string() : " (" + name + ")") + ": " + std::to_string(series.size()) +
         " evaluation(s): " + num(first_loss) + " at step " + std::to_string(first_step) + " -> " + num(last_loss) +
         " at step " + std::to_string(last_step) + ", best " + num(best->second) + " at step " + std::to_string(best->first);
    if (series.size() >= 2) {
      const double rise = last_loss - best->second;
      if (rise > 0.02 * std::fabs(best->second))
        s += " (rising since step " + std::to_string(best->first) + ": +" + num(rise) + ", overfitting or diverging)";
      else
        s += last_loss < first_loss ? " (falling)" : " (flat)";
    }
    s += "\n";
  }
  for (const auto& [name, n] : val_without_loss)
    notes.push_back("validation" + (name.empty() ? std::string() : " (" + name + ")") + ": " + std::to_string(n) +
                    " evaluation(s) had no target in the loss (all masked), reported as nan");
  for (const auto& [name, n] : val_unexplained)
    notes.push_back("validation" + (name.empty() ? std::string() : " (" + name + ")") + ": " + std::to_string(n) +
                    " evaluation(s) reported as nan: no target in the loss (all masked), or a forward that "
                    "overflowed (this keel's metrics do not say which)");
  for (const auto& [name, n] : val_nonfinite) {
    const std::string text = "validation" + (name.empty() ? std::string() : " (" + name + ")") + ": " +
                             std::to_string(n) + " evaluation(s) gave a non-finite loss with targets in the loss: "
                             "the forward overflowed (fp16's range, or weights that diverged)";
    s += "    " + text + "\n";
    r.problems.push_back(text);
  }
  // Stragglers (timers records): a rank named at two or more timed steps held the job up.
  if (r.timed_steps > 0) {
    s += "  timers: " + std::to_string(r.timed_steps) + " timed step(s), stragglers: " +
         (r.stragglers.empty() ? std::string("none") : std::to_string(r.stragglers.size())) + "\n";
    for (const auto& [rank, count] : r.stragglers) {
      const StragglerSeen& g = straggler_seen[rank];
      const std::string who = "world rank " + std::to_string(rank) + (g.host.empty() ? "" : " on host " + g.host);
      const std::string what = who + " was slow at " + std::to_string(count) + " of " + std::to_string(r.timed_steps) +
                               " timed steps (steps " + std::to_string(g.first) + " to " + std::to_string(g.last) +
                               "), up to " + num(g.worst, "%.2f") + "x a typical rank of its pipeline stage";
      s += "    " + what + "\n";
      if (count >= 2)
        r.problems.push_back("straggler: " + what + "; every step waits for it (a throttled or shared GPU, a busy node)");
    }
    s += balance_line;
  }
  for (const auto& n : notes) s += "note: " + n + "\n";
  s += r.problems.empty() ? "verdict: healthy\n" : "verdict: " + std::to_string(r.problems.size()) + " problem(s):\n";
  for (const auto& p : r.problems) s += "  - " + p + "\n";
  return r;
}

}  // namespace keel::doctor
