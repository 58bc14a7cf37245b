#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "data/checksum.h"
#include "train/schedule.h"

namespace keel {

ModelShard shard_for(const RunConfig& cfg, const parallel::Grid& grid) {
  ModelShard sh = pipeline_stage(cfg.model, grid.pp_size(), grid.pp_rank(), cfg.parallel.embedding_slot);
  sh.tp_rank = grid.tp_rank();
  sh.tp_size = grid.tp_size();
  return sh;
}

namespace {
parallel::Grid single_rank() { return parallel::Grid(1, 0, 1, 1, 1); }
}  // namespace

Trainer::Trainer(const RunConfig& cfg, Backend& backend, const parallel::Grid* grid, parallel::CommGroups* comms)
    : cfg_(cfg),
      be_(backend),
      grid_(grid ? *grid : single_rank()),
      local_comms_(comms ? parallel::CommGroups{} : parallel::make_local_comms(backend.device())),
      comms_(comms ? comms : &local_comms_),
      table_(cfg.model, shard_for(cfg, grid_)),
      scaler_(cfg.precision.loss_scale, cfg.precision.mode == PrecisionMode::FP16),
      spikes_(cfg.health) {
  if (grid_.tp_size() != cfg.parallel.tp || grid_.pp_size() != cfg.parallel.pp || grid_.dp_size() != cfg.parallel.dp)
    throw std::invalid_argument("Trainer: the grid (" + grid_.layout() + ") does not match parallel.tp/pp/dp of the config");
  state_ = std::make_unique<ParamState>(table_, be_, cfg.precision.mode, grid_.dp_size(), grid_.dp_rank());
  // 1F1B keeps at most (stages after this one + 1) micro-batches in flight on a stage, and
  // never more than a step has (global_batch is the largest batch, ramp-up included).
  const int slots = static_cast<int>(std::clamp<int64_t>(grid_.pp_size() - grid_.pp_rank(), 1,
                                                         cfg.grad_accum_steps(cfg.train.global_batch)));
  model_ = std::make_unique<Transformer>(table_, be_, activation_dtype(cfg.precision.mode),
                                         static_cast<int>(cfg.train.micro_batch), static_cast<int>(cfg.train.seq_len),
                                         slots, grid_.tp_size() > 1 ? comms_->tp.get() : nullptr,
                                         cfg.train.recomputed_layers_per_stage(), cfg.parallel.sequence_parallel,
                                         cfg.train.logits_chunk_rows, cfg.data.document_masking);
  model_->bind(state_->working, state_->grads);
  {
    const int64_t ob = state_->optim_begin(), oe = std::min(state_->optim_end(), table_.local_numel());
    for (const ParamSpec& p : table_.params()) {
      const int64_t a = std::max(p.offset, ob), b = std::min(p.offset + p.numel, oe);
      if (a >= b || !table_.is_primary(p)) continue;
      if (!primary_ranges_.empty() && primary_ranges_.back().second == a)
        primary_ranges_.back().second = b;
      else
        primary_ranges_.emplace_back(a, b);
    }
  }
  if (cfg.health.frozen_check_interval > 0) frozen_ = std::make_unique<FrozenDetector>(table_, *state_, cfg.health);
  const ParamTable full(cfg.model);
  for (const ParamSpec& p : full.params()) full_names_.push_back(p.name);
  for (Tensor* t : {&scalar_f32_, &scalar_i32_}) {
    *t = Tensor(nullptr, t == &scalar_f32_ ? DType::F32 : DType::I32, {2}, be_.device());
    t->data = be_.allocate(t->bytes());
    allocations_.push_back(t->data);
  }
}

Trainer::~Trainer() {
  for (void* p : allocations_) be_.release(p);
}

double Trainer::all_reduce_sum(parallel::Comm& c, double x) {
  if (c.size() == 1) return x;
  // A double as hi + lo fp32 parts: both are summed (in rank order) and recombined.
  const float parts[2] = {static_cast<float>(x), static_cast<float>(x - static_cast<float>(x))};
  be_.copy_from_host(scalar_f32_, parts);
  c.all_reduce(scalar_f32_);
  float out[2];
  be_.copy_to_host(out, scalar_f32_);
  return static_cast<double>(out[0]) + out[1];
}

int64_t Trainer::all_reduce_sum(parallel::Comm& c, int64_t x) {
  if (c.size() == 1) return x;
  // int64 as two int32 halves: low 31 bits and the rest, each summed without overflow for
  // any realistic count.
  const int32_t parts[2] = {static_cast<int32_t>(x & 0x7fffffff), static_cast<int32_t>(x >> 31)};
  be_.copy_from_host(scalar_i32_, parts);
  c.all_reduce(scalar_i32_);
  int32_t out[2];
  be_.copy_to_host(out, scalar_i32_);
  return static_cast<int64_t>(out[0]) + (static_cast<int64_t>(out[1]) << 31);
}

double Trainer::run_pipeline(const std::vector<MicroBatch>& mbs, float dloss, bool backward) {
  const int M = static_cast<int>(mbs.size());
  const int P = grid_.pp_size(), s = grid_.pp_rank();
  const bool first = s == 0, last = s == P - 1;
  parallel::Comm& pp = *comms_->pp;
  const int slots = model_->slots();
  double loss_sum = 0;
  int next_fwd = 0, next_bwd = 0;

  // Training passes dloss to forward too: a chunked head runs its backward there.
  const std::optional<float> head_dloss = backward ? std::optional<float>(dloss) : std::nullopt;
  auto forward = [&](int mb) {
    auto r = model_->forward(mb % slots, first ? mbs[mb].inputs.data() : nullptr, last ? mbs[mb].targets.data() : nullptr,
                             head_dloss, mbs[mb].positions.empty() ? nullptr : mbs[mb].positions.data());
    loss_sum += r.loss_sum;
  };
  auto recv_forward = [&](int mb) {
    if (!first) pp.recv(model_->stage_input(mb % slots), s - 1);
  };
  auto send_forward = [&](int mb) {
    if (!last) pp.send(model_->stage_output(mb % slots), s + 1);
  };

  if (!backward) {  // evaluation: forward only, one micro-batch after another
    for (int mb = 0; mb < M; ++mb) {
      recv_forward(mb);
      forward(mb);
      send_forward(mb);
    }
    return loss_sum;
  }

  // 1F1B (PipeDream-Flush): stage s runs P - s - 1 forwards ahead, then alternates one
  // forward and one backward, then drains the backwards. Send/recv pairs with a neighbour
  // that also sends to us go through sendrecv so neither side waits on the other.
  const int warmup = std::min(P - s - 1, M);
  const int steady = M - warmup;
  for (int i = 0; i < warmup; ++i) {
    recv_forward(next_fwd);
    forward(next_fwd);
    send_forward(next_fwd);
    ++next_fwd;
  }
  if (steady > 0) recv_forward(next_fwd);
  for (int i = 0; i < steady; ++i) {
    forward(next_fwd);
    const int done_fwd = next_fwd++;
    if (!last) pp.sendrecv(model_->stage_output(done_fwd % slots), s + 1, model_->grad_output(), s + 1);
    model_->backward(next_bwd % slots, dloss);
    ++next_bwd;
    if (i + 1 < steady) {
      if (!first) pp.sendrecv(model_->grad_input(), s - 1, model_->stage_input(next_fwd % slots), s - 1);
    } else if (!first) {
      pp.send(model_->grad_input(), s - 1);
    }
  }
  for (int i = 0; i < warmup; ++i) {
    if (!last) pp.recv(model_->grad_output(), s + 1);
    model_->backward(next_bwd % slots, dloss);
    ++next_bwd;
    if (!first) pp.send(model_->grad_input(), s - 1);
  }
  return loss_sum;
}

// The tied input/output embedding lives on the first stage (tok_embed) and, as a copy, on the
// last (for the head). Their gradients are summed, so both copies take the identical update
// and never drift apart (the BLOOM restart-spike bug was exactly this sum missing).
void Trainer::sync_tied_embedding() {
  if (!cfg_.model.tied_embeddings || grid_.pp_size() == 1 || !grid_.holds_embedding()) return;
  comms_->embedding->all_reduce(model_->grad("tok_embed"));
}

StepStats Trainer::step(const std::vector<MicroBatch>& micro_batches, int64_t iteration, bool collect_stats) {
  StepStats st;
  st.iteration = iteration;
  parallel::Comm& dp = *comms_->dp;
  parallel::Comm& world = *comms_->world;
  st.global_batch = static_cast<int64_t>(micro_batches.size()) * cfg_.train.micro_batch * grid_.dp_size();
  int64_t valid = 0;
  for (const MicroBatch& mb : micro_batches)
    valid += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  st.valid_tokens = all_reduce_sum(dp, valid);
  st.loss_scale = scaler_.scale();

  // The step's loss is the mean over every valid target token of the global batch, so each
  // token's loss enters the gradient with weight 1/valid_tokens (times the fp16 loss scale),
  // and the DP reduction of the gradients is a plain sum.
  be_.fill(state_->grads, 0.0f);
  const float dloss = st.valid_tokens > 0 ? st.loss_scale / static_cast<float>(st.valid_tokens) : 0.0f;
  // Per-layer headroom: max |layer output| in forward, max |layer input gradient| in backward.
  std::vector<float> act_max, grad_max;
  if (collect_stats) {
    act_max.assign(static_cast<size_t>(cfg_.model.n_layers), 0.0f);
    grad_max.assign(act_max.size(), 0.0f);
    model_->set_probe([&](const Transformer::OpProbe& p) {
      if (p.layer < 0) return;
      const bool act = !p.backward && std::strcmp(p.op, "layer output (residual add)") == 0;
      const bool grad = p.backward && std::strcmp(p.op, "layer input gradient (attn_norm backward)") == 0;
      if (!act && !grad) return;
      float& slot = (act ? act_max : grad_max)[static_cast<size_t>(p.layer)];
      const float m = be_.max_abs(p.out);
      slot = std::isnan(m) || std::isnan(slot) ? std::nanf("") : std::max(slot, m);
    });
  }
  double loss_sum = run_pipeline(micro_batches, dloss, true);
  if (collect_stats) {
    model_->set_probe(nullptr);
    st.act_max = all_reduce_max(*comms_->world, act_max);
    st.grad_max = all_reduce_max(*comms_->world, grad_max);
  }
  loss_sum = all_reduce_sum(*comms_->pp, loss_sum);  // the last stage's loss, to every stage
  loss_sum = all_reduce_sum(dp, loss_sum);
  st.loss = st.valid_tokens > 0 ? loss_sum / static_cast<double>(st.valid_tokens) : 0.0;

  model_->sum_sequence_parallel_grads();
  sync_tied_embedding();
  const int64_t n = table_.local_numel();
  const int64_t ob = state_->optim_begin(), oe = std::min(state_->optim_end(), n);
  if (grid_.dp_size() > 1) {
    // This rank's block of the summed gradient lands in place in its own shard.
    dp.reduce_scatter(state_->flat_view(state_->grads, state_->optim_begin(), state_->optim_end() - state_->optim_begin()),
                      state_->grads);
  }

  // Over this rank's shard, each parameter once: TP replicas and the tied copy are skipped
  // (they hold the same values as the primary copy on another rank). The primary tensors are
  // merged into contiguous ranges (usually a handful), so a GPU syncs a few times, not per tensor.
  // Non-finite values are counted over the whole shard: the primary ranges in one pass with
  // the norm (grad_stats), the replica gaps between them on their own.
  double sum_sq = 0;
  int64_t zeros = 0, nonfinite = 0, counted_to = ob;
  for (const auto& [a, b] : primary_ranges_) {
    if (a > counted_to) nonfinite += be_.count_nonfinite(state_->flat_view(state_->grads, counted_to, a - counted_to));
    const Backend::GradStats g = be_.grad_stats(state_->flat_view(state_->grads, a, b - a));
    sum_sq += g.sum_squares;
    zeros += g.zeros;
    nonfinite += g.nonfinite;
    counted_to = b;
  }
  if (oe > counted_to) nonfinite += be_.count_nonfinite(state_->flat_view(state_->grads, counted_to, oe - counted_to));
  sum_sq = all_reduce_sum(world, sum_sq);
  nonfinite = all_reduce_sum(world, nonfinite);
  st.num_zeros = all_reduce_sum(world, zeros);

  st.nonfinite = !std::isfinite(st.loss) || nonfinite > 0 || !std::isfinite(sum_sq);
  st.scale_exhausted = scaler_.update(st.nonfinite);
  if (st.nonfinite) {
    // Applying a non-finite gradient would poison masters and moments for good: skip, and find
    // the op where the first inf/nan appeared.
    st.skipped = true;
    st.grad_norm = std::nan("");
    if (cfg_.health.localize_nonfinite) st.nonfinite_report = localize_nonfinite(micro_batches, dloss);
    return st;
  }

  st.grad_norm = std::sqrt(sum_sq) / st.loss_scale;
  const SpikeDetector::Verdict spike = spikes_.observe(st.loss, st.grad_norm);
  if (spike.any()) {
    st.spike = true;
    st.spike_text = spikes_.describe(spike, st.loss, st.grad_norm);
    if (cfg_.health.spike_action != "warn") {  // skip (or rewind, which the run loop does)
      st.skipped = true;
      return st;
    }
  }
  // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
  double clip = 1.0;
  if (cfg_.optimizer.grad_clip > 0) clip = std::min(1.0, cfg_.optimizer.grad_clip / (st.grad_norm + 1e-6));
  st.lr = learning_rate(cfg_, iteration);
  adamw_update(*state_, table_, be_, cfg_.optimizer, st.lr, static_cast<float>(clip / st.loss_scale),
               {cfg_.precision.stochastic_rounding, cfg_.train.seed});
  if (grid_.dp_size() > 1) {
    // Every rank updated its shard of the working weights; gather the whole back.
    dp.all_gather(state_->working, state_->flat_view(state_->working, state_->optim_begin(),
                                                     state_->optim_end() - state_->optim_begin()));
  }
  if (frozen_ && ++applied_since_frozen_check_ >= cfg_.health.frozen_check_interval) {
    applied_since_frozen_check_ = 0;
    check_frozen(st);
  }
  return st;
}

int Trainer::check_replicas() {
  // Test hook: KEEL_FAULT_TIED_DRIFT=1 nudges the last stage's tied copy once, to prove the
  // check catches copies that drift apart.
  static bool drift = std::getenv("KEEL_FAULT_TIED_DRIFT") != nullptr;
  int checked = 0;
  using parallel::GroupKind;
  auto compare = [&](parallel::Comm& group, GroupKind kind, const ParamSpec& p) {
    Tensor w = model_->weight(p.name);
    if (drift && p.tied_copy) {
      std::vector<char> bytes(w.bytes());
      be_.copy_to_host(bytes.data(), w);
      bytes[0] ^= 1;
      be_.copy_from_host(w, bytes.data());
      drift = false;
    }
    std::vector<char> bytes(w.bytes());
    be_.copy_to_host(bytes.data(), w);
    const auto crc = static_cast<int32_t>(data::crc32c(0, bytes.data(), bytes.size()));
    std::vector<int32_t> all(static_cast<size_t>(group.size()));
    Tensor mine(nullptr, DType::I32, {1}, be_.device()), gathered(nullptr, DType::I32, {group.size()}, be_.device());
    mine.data = be_.allocate(4);
    gathered.data = be_.allocate(all.size() * 4);
    be_.copy_from_host(mine, &crc);
    group.all_gather(gathered, mine);
    be_.copy_to_host(all.data(), gathered);
    be_.release(mine.data);
    be_.release(gathered.data);
    ++checked;
    if (std::all_of(all.begin(), all.end(), [&](int32_t c) { return c == all[0]; })) return;
    const auto members = grid_.members(kind);
    std::string msg = "replica mismatch: the working weights of " + p.name + " differ between the ranks that hold " +
                      (kind == GroupKind::Embedding ? "the tied input/output embedding copies (first and last stage)"
                                                    : "TP replicas of it") +
                      ":";
    for (size_t r = 0; r < all.size(); ++r)
      msg += "\n  world rank " + std::to_string(members[r]) + ": crc32c " + data::crc32c_hex(static_cast<uint32_t>(all[r]));
    msg += "\nThe copies were updated differently (their gradients were not summed the same way); the run is "
           "stopped before they drift further. Resume from the last checkpoint.";
    throw ReplicaMismatch(msg);
  };
  if (cfg_.model.tied_embeddings && grid_.pp_size() > 1 && grid_.holds_embedding())
    compare(*comms_->embedding, GroupKind::Embedding, table_.at("tok_embed"));
  if (grid_.tp_size() > 1)
    for (const ParamSpec& p : table_.params())
      if (p.split == TpSplit::None) compare(*comms_->tp, GroupKind::TP, p);
  return checked;
}

double Trainer::evaluate(const std::vector<MicroBatch>& micro_batches) {
  int64_t valid = 0;
  for (const MicroBatch& mb : micro_batches)
    valid += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  valid = all_reduce_sum(*comms_->dp, valid);
  double loss_sum = run_pipeline(micro_batches, 0.0f, false);
  loss_sum = all_reduce_sum(*comms_->pp, loss_sum);
  loss_sum = all_reduce_sum(*comms_->dp, loss_sum);
  return valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
}

}  // namespace keel
