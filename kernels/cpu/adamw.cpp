// AdamW, in PyTorch's torch.optim.AdamW order of operations (single-tensor path):
//   g = grad * grad_scale
//   p = p * (1 - lr*wd)                                  (decoupled weight decay first)
//   m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g g
//   denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p = p - ((lr / (1 - beta1^step)) * m) / denom
// Scalars (bias corrections, step size) are formed in double and rounded to fp32, as PyTorch
// does with its Python-float hyperparameters; each tensor operation rounds to fp32 on its own
// (no fused multiply-add, hence the pragma), so a hand computation can reproduce it bit for bit.
//
// With an empty master the working tensor is the parameter: read as fp32, written back rounded
// to its dtype. In bf16 an update smaller than half the spacing (2^-8 at 1.0) is lost every step,
// which is the "bf16 parameters freeze" failure this mode exists to reproduce.
//
// With a master and a bf16 working copy, AdamWParams::stochastic_rounding writes the working
// copy by stochastic rounding (kernels/stochastic_rounding.h), the same bits as the GPU.
#include <cmath>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/stochastic_rounding.h"

#include "kernels/fp_contract_off.h"  // last: no fused multiply-add below

namespace keel {

using cpu::Named;

void CpuBackend::adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m,
                       const Tensor& v, const AdamWParams& p) {
  const char* op = "adamw";
  cpu::check_float(op, {"working", working});
  cpu::check_float(op, {"grad", grad});
  cpu::check_dtype(op, {"m", m}, DType::F32);
  cpu::check_dtype(op, {"v", v}, DType::F32);
  const bool has_master = !master.empty();
  if (has_master) cpu::check_dtype(op, {"master", master}, DType::F32);
  const int64_t n = working.numel();
  if (grad.numel() != n || m.numel() != n || v.numel() != n || (has_master && master.numel() != n))
    cpu::fail(op, "element counts differ",
              {{"master", master}, {"working", working}, {"grad", grad}, {"m", m}, {"v", v}});
  if (p.step < 1) cpu::fail(op, "step must be >= 1 (1-based), got " + std::to_string(p.step), {});

  const std::vector<AdamWDecayRun> runs = adamw_decay_runs("CpuBackend", p, n);
  const float one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(p.beta1));
  const float one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(p.beta2));
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step));
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step));
  const float step_size = static_cast<float>(p.lr / bias_correction1);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float beta1 = p.beta1, beta2 = p.beta2, eps = p.eps, grad_scale = p.grad_scale;
  const bool write_working = !has_master || working.data != master.data;
  const Tensor& param = has_master ? master : working;
  const bool stochastic = p.stochastic_rounding && has_master && write_working && working.dtype == DType::BF16;
  const uint64_t sr_step = static_cast<uint64_t>(p.step), sr_index0 = static_cast<uint64_t>(p.rounding_index0);

  // Elements [begin, begin + len) of one run, multiplied by its decay factor.
  constexpr int64_t kChunk = 1024;
  auto update = [&](int64_t begin, int64_t len, float decay) {
    float pv[kChunk], gv[kChunk];
    cpu::load_f32(param, begin, len, pv);
    cpu::load_f32(grad, begin, len, gv);
    float* mv = m.as<float>() + begin;
    float* vv = v.as<float>() + begin;
    for (int64_t i = 0; i < len; ++i) {
      const float g = gv[i] * grad_scale;
      float x = pv[i] * decay;
      mv[i] = beta1 * mv[i] + one_minus_b1 * g;
      vv[i] = beta2 * vv[i] + one_minus_b2 * g * g;
      const float denom = std::sqrt(vv[i]) / bias_correction2_sqrt + eps;
      x = x - (step_size * mv[i]) / denom;
      pv[i] = x;
    }
    if (has_master) cpu::store_f32(master, begin, len, pv);
    if (stochastic) {
      uint16_t* w = working.as<uint16_t>() + begin;
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t u = std::bit_cast<uint32_t>(pv[i]);
        const uint64_t index = sr_index0 + static_cast<uint64_t>(begin + i);
        w[i] = std::isfinite(pv[i]) ? bf16_bits_stochastic(u, rounding_bits(p.rounding_seed, sr_step, index))
                                    : f32_to_bf16(pv[i]);
      }
    } else if (write_working) {
      cpu::store_f32(working, begin, len, pv);
    }
  };
  int64_t run_begin = 0;
  for (const AdamWDecayRun& run : runs) {
    const float decay = adamw_decay_factor(p.lr, run.weight_decay);
    cpu::for_chunks(run.end - run_begin, kChunk,
                    [&, run_begin](int64_t chunk, int64_t len) { update(run_begin + chunk, len, decay); });
    run_begin = run.end;
  }
}

}  // namespace keel
