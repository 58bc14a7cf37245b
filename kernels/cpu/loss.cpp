// Softmax cross-entropy split into per-shard statistics, loss and an in-place backward, so that
// the vocab can be sharded (each shard holds logits columns [vocab_start, vocab_start + V)).
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace keel {

using cpu::Named;

namespace {

// Every per-row tensor must hold N values; returns N.
int64_t check_rows(const char* op, const Tensor& targets, std::initializer_list<Named> per_row) {
  cpu::check_dtype(op, {"targets", targets}, DType::I32);
  const int64_t N = targets.numel();
  for (const Named& t : per_row)
    if (t.t.numel() != N) cpu::fail(op, std::string(t.name) + " must have one value per target", {t, {"targets", targets}});
  return N;
}

}  // namespace

void CpuBackend::xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit,
                            const Tensor& logits, const Tensor& targets, int64_t vocab_start) {
  const char* op = "xent_stats";
  cpu::check_float(op, {"logits", logits});
  for (Named t : {Named{"row_max", row_max}, Named{"sumexp", sumexp}, Named{"target_logit", target_logit}})
    cpu::check_dtype(op, t, DType::F32);
  const int64_t N = check_rows(op, targets, {{"row_max", row_max}, {"sumexp", sumexp}, {"target_logit", target_logit}});
  if (cpu::rows(logits) != N) cpu::fail(op, "logits must have one row per target", {{"logits", logits}, {"targets", targets}});
  const int64_t V = logits.cols();
  const int32_t* tgt = targets.as<const int32_t>();
#pragma omp parallel if (N * V >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = cpu::read_f32(logits, n * V, V, buf.data());
      float m = -INFINITY;
      for (int64_t j = 0; j < V; ++j) m = x[j] > m ? x[j] : m;
      // sum of exp(x - m) as 8 interleaved partial sums combined in a fixed tree
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= V; j += 8)
        for (int l = 0; l < 8; ++l) acc[l] += std::exp(x[j + l] - m);
      float se = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      for (; j < V; ++j) se += std::exp(x[j] - m);
      const int64_t local = static_cast<int64_t>(tgt[n]) - vocab_start;
      row_max.as<float>()[n] = m;
      sumexp.as<float>()[n] = se;
      target_logit.as<float>()[n] = tgt[n] >= 0 && local >= 0 && local < V ? x[local] : 0.0f;
    }
  }
}

void CpuBackend::xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) {
  const char* op = "xent_rescale";
  for (Named t : {Named{"sumexp", sumexp}, Named{"local_max", local_max}, Named{"global_max", global_max}})
    cpu::check_dtype(op, t, DType::F32);
  const int64_t N = sumexp.numel();
  if (local_max.numel() != N || global_max.numel() != N)
    cpu::fail(op, "all three need one value per row",
              {{"sumexp", sumexp}, {"local_max", local_max}, {"global_max", global_max}});
  float* s = sumexp.as<float>();
  const float* lm = local_max.as<const float>();
  const float* gm = global_max.as<const float>();
  for (int64_t n = 0; n < N; ++n) s[n] *= std::exp(lm[n] - gm[n]);
}

void CpuBackend::xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                           const Tensor& target_logit, const Tensor& targets) {
  const char* op = "xent_loss";
  cpu::check_float(op, {"losses", losses});
  for (Named t : {Named{"lse", lse}, Named{"row_max", row_max}, Named{"sumexp", sumexp},
                  Named{"target_logit", target_logit}})
    cpu::check_dtype(op, t, DType::F32);
  const int64_t N = check_rows(op, targets, {{"losses", losses}, {"lse", lse}, {"row_max", row_max},
                                             {"sumexp", sumexp}, {"target_logit", target_logit}});
  const int32_t* tgt = targets.as<const int32_t>();
  std::vector<float> loss(static_cast<size_t>(N));
#pragma omp parallel for schedule(static) if (N >= cpu::kMinParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    const float l = row_max.as<const float>()[n] + std::log(sumexp.as<const float>()[n]);
    lse.as<float>()[n] = l;
    loss[n] = tgt[n] < 0 ? 0.0f : l - target_logit.as<const float>()[n];
  }
  if (N) cpu::store_f32(losses, 0, N, loss.data());
}

void CpuBackend::xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                               int64_t vocab_start) {
  const char* op = "xent_backward";
  cpu::check_float(op, {"logits", logits});
  cpu::check_dtype(op, {"lse", lse}, DType::F32);
  const int64_t N = check_rows(op, targets, {{"lse", lse}});
  if (cpu::rows(logits) != N) cpu::fail(op, "logits must have one row per target", {{"logits", logits}, {"targets", targets}});
  const int64_t V = logits.cols();
  const int32_t* tgt = targets.as<const int32_t>();
#pragma omp parallel if (N * V >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      if (tgt[n] < 0) {
        std::fill(buf.begin(), buf.end(), 0.0f);
      } else {
        cpu::load_f32(logits, n * V, V, buf.data());
        const float l = lse.as<const float>()[n];
        for (int64_t j = 0; j < V; ++j) buf[j] = std::exp(buf[j] - l);
        const int64_t local = static_cast<int64_t>(tgt[n]) - vocab_start;
        if (local >= 0 && local < V) buf[local] -= 1.0f;
        for (int64_t j = 0; j < V; ++j) buf[j] *= dloss;
      }
      cpu::store_f32(logits, n * V, V, buf.data());
    }
  }
}

}  // namespace keel
