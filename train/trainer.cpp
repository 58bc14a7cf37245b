#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "train/schedule.h"

namespace keel {

Trainer::Trainer(const RunConfig& cfg, Backend& backend)
    : cfg_(cfg),
      be_(backend),
      table_(cfg.model),
      scaler_(cfg.precision.loss_scale, cfg.precision.mode == PrecisionMode::FP16) {
  state_ = std::make_unique<ParamState>(table_, be_, cfg.precision.mode);
  model_ = std::make_unique<Transformer>(table_, be_, activation_dtype(cfg.precision.mode),
                                         static_cast<int>(cfg.train.micro_batch), static_cast<int>(cfg.train.seq_len));
  model_->bind(state_->working, state_->grads);
}

StepStats Trainer::step(const std::vector<MicroBatch>& micro_batches, int64_t iteration) {
  StepStats st;
  st.iteration = iteration;
  st.global_batch = static_cast<int64_t>(micro_batches.size()) * cfg_.train.micro_batch;
  for (const MicroBatch& mb : micro_batches)
    st.valid_tokens += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  st.loss_scale = scaler_.scale();

  // The step's loss is the mean over every valid target token of the global batch, so each
  // token's loss enters the gradient with weight 1/valid_tokens (times the fp16 loss scale).
  be_.fill(state_->grads, 0.0f);
  const float dloss = st.valid_tokens > 0 ? st.loss_scale / static_cast<float>(st.valid_tokens) : 0.0f;
  double loss_sum = 0;
  for (const MicroBatch& mb : micro_batches) {
    loss_sum += model_->forward(mb.inputs.data(), mb.targets.data()).loss_sum;
    model_->backward(dloss);
  }
  st.loss = st.valid_tokens > 0 ? loss_sum / static_cast<double>(st.valid_tokens) : 0.0;

  st.nonfinite = !std::isfinite(st.loss) || be_.count_nonfinite(state_->grads) > 0;
  const bool exhausted = scaler_.update(st.nonfinite);
  if (st.nonfinite) {
    // Applying a non-finite gradient would poison masters and moments for good: skip.
    st.skipped = true;
    st.grad_norm = std::nan("");
    if (exhausted)
      throw std::runtime_error("fp16 loss scale is at its minimum (" + std::to_string(scaler_.scale()) +
                               ") and the gradient still overflows at step " + std::to_string(iteration) +
                               ": the run cannot continue in fp16 (try bf16, or a lower learning rate)");
    return st;
  }

  const double sum_sq = be_.sum_squares(state_->grads);
  st.grad_norm = std::sqrt(sum_sq) / st.loss_scale;
  st.num_zeros = be_.count_zeros(state_->grads);
  // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
  double clip = 1.0;
  if (cfg_.optimizer.grad_clip > 0) clip = std::min(1.0, cfg_.optimizer.grad_clip / (st.grad_norm + 1e-6));
  st.lr = learning_rate(cfg_, iteration);
  adamw_update(*state_, table_, be_, cfg_.optimizer, st.lr, static_cast<float>(clip / st.loss_scale));
  return st;
}

double Trainer::evaluate(const std::vector<MicroBatch>& micro_batches) {
  double loss_sum = 0;
  int64_t valid = 0;
  for (const MicroBatch& mb : micro_batches) {
    auto r = model_->forward(mb.inputs.data(), mb.targets.data());
    loss_sum += r.loss_sum;
    valid += r.n_valid;
  }
  return valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
}

}  // namespace keel
