#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "data/checksum.h"
#include "data/file_io.h"
#include "train/schedule.h"
#include "train/pipeline_schedule.h"
#include "train/parallel/host_values.h"

namespace keel {

std::vector<ModelShard> chunks_for(const RunConfig& cfg, const parallel::Grid& grid) {
  std::vector<ModelShard> chunks = pipeline_chunks(cfg.model, grid.pp_size(), static_cast<int>(cfg.parallel.virtual_stages),
                                                   grid.pp_rank(), cfg.parallel.pipeline_split());
  for (ModelShard& sh : chunks) {
    sh.tp_rank = grid.tp_rank();
    sh.tp_size = grid.tp_size();
  }
  return chunks;
}

namespace {
parallel::Grid single_rank() { return parallel::Grid(1, 0, 1, 1, 1); }

// Reports a chunk's final gradients during one backward (its last of the step): see
// Transformer::set_grads_ready. A null fn reports nothing.
class GradsReadyScope {
 public:
  GradsReadyScope(Transformer& m, const Transformer::GradsReadyFn& fn, bool last) : m_(last && fn ? &m : nullptr) {
    if (m_) m_->set_grads_ready(fn);
  }
  ~GradsReadyScope() {
    if (m_) m_->set_grads_ready(nullptr);
  }
  GradsReadyScope(const GradsReadyScope&) = delete;
  GradsReadyScope& operator=(const GradsReadyScope&) = delete;

 private:
  Transformer* m_;
};

// One point-to-point move of the pipeline: send and/or receive (both at once when both).
void transfer(parallel::Comm& pp, const std::optional<Tensor>& send, int to, const std::optional<Tensor>& recv,
              int from) {
  if (send && recv)
    pp.sendrecv(*send, to, *recv, from);
  else if (send)
    pp.send(*send, to);
  else if (recv)
    pp.recv(*recv, from);
}
}  // namespace

Trainer::Trainer(const RunConfig& cfg, Backend& backend, const parallel::Grid* grid, parallel::CommGroups* comms,
                 bool forward_only)
    : cfg_(cfg),
      be_(backend),
      grid_(grid ? *grid : single_rank()),
      local_comms_(comms ? parallel::CommGroups{} : parallel::make_local_comms(backend.device())),
      timers_([&backend] { backend.synchronize(); }),
      timed_comms_(timed_comms(comms ? *comms : local_comms_, timers_)),
      comms_(&timed_comms_),
      table_(cfg.model, chunks_for(cfg, grid_)),
      scaler_(cfg.precision.loss_scale, cfg.precision.mode == PrecisionMode::FP16),
      spikes_(cfg.health) {
  if (grid_.tp_size() != cfg.parallel.tp || grid_.pp_size() != cfg.parallel.pp || grid_.dp_size() != cfg.parallel.dp)
    throw std::invalid_argument("Trainer: the grid (" + grid_.layout() + ") does not match parallel.tp/pp/dp of the config");
  state_ = std::make_unique<ParamState>(table_, be_, cfg.precision.mode, grid_.dp_size(), grid_.dp_rank(), !forward_only);
  if (!forward_only) grad_writes_ = std::make_unique<GradWrites>(be_, state_->grads);
  const int n_chunks = table_.num_chunks();
  std::vector<int> slots(static_cast<size_t>(n_chunks), 1), grad_slots(static_cast<size_t>(n_chunks), 0);
  if (n_chunks == 1) {
    // 1F1B keeps at most (stages after this one + 1) micro-batches in flight on a stage, and
    // never more than a step has (global_batch is the largest batch, ramp-up included).
    slots[0] = static_cast<int>(std::clamp<int64_t>(grid_.pp_size() - grid_.pp_rank(), 1,
                                                    cfg.grad_accum_steps(cfg.train.global_batch)));
  } else {
    // Interleaved: what the schedules of every step size need (training over the ramp-up, and
    // evaluation). Played out here only for their sizes (a large pipeline's schedule is
    // megabytes; the run keeps the one it is using, see schedule()).
    const PipeSlots need = pipeline_slots(grid_.pp_size(), n_chunks,
                                          cfg.step_micro_batch_counts(cfg.train.micro_batch, cfg.parallel.dp));
    slots = need.activation[static_cast<size_t>(grid_.pp_rank())];
    grad_slots = need.gradient[static_cast<size_t>(grid_.pp_rank())];
    // A ramp-up's smaller steps run within the whole batch's slots (schedule()).
    step_cap_ = pipeline_schedule(grid_.pp_size(), n_chunks, static_cast<int>(cfg.grad_accum_steps(cfg.train.global_batch)),
                                  true)
                    .activation_slots;
  }
  // Recomputation counts layers from the stage's first: over its chunks in order.
  int recompute_left = cfg.train.recomputed_layers_per_stage();
  for (int c = 0; c < n_chunks; ++c) {
    const ModelShard& sh = table_.chunk_shard(c);
    chunks_.push_back(std::make_unique<Transformer>(
        table_.chunk(c), be_, activation_dtype(cfg.precision.mode), static_cast<int>(cfg.train.micro_batch),
        static_cast<int>(cfg.train.seq_len), slots[static_cast<size_t>(c)],
        grid_.tp_size() > 1 ? comms_->tp.get() : nullptr, RecomputePolicy{recompute_left, cfg.train.selective_recompute()},
        cfg.parallel.sequence_parallel, cfg.train.logits_chunk_rows, cfg.takes_document_positions(),
        c > 0 ? chunks_.front().get() : nullptr));
    recompute_left = std::max(0, recompute_left - (sh.end_layer - sh.first_layer));
    chunks_.back()->bind(state_->working, state_->grads, grad_writes_.get());
    std::vector<Tensor> pool;
    for (int i = 0; i < grad_slots[static_cast<size_t>(c)]; ++i) {
      Tensor t = chunks_.back()->grad_output();
      t.data = be_.allocate(t.bytes());
      allocations_.push_back(t.data);
      pool.push_back(t);
    }
    grad_pool_.push_back(std::move(pool));
  }
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
  const int64_t shard = state_->optim_end() - state_->optim_begin();  // ZeRO-1: each DP rank's block
  const int64_t bucket = parallel::grad_bucket_elements(cfg.parallel.grad_bucket_size, grid_.dp_size());
  if (!forward_only && grid_.dp_size() > 1 && cfg.parallel.overlap_grad_reduce) {
    // The tied embedding's copies are summed over the embedding group after the pipeline
    // (sync_tied_embedding): their DP reduction waits for that.
    std::vector<parallel::GradBuckets::Range> deferred;
    if (holds_tied_copy()) {
      const ParamSpec& p = table_.at("tok_embed");
      deferred.emplace_back(p.offset, p.offset + p.numel);
    }
    grad_buckets_ = std::make_unique<parallel::GradBuckets>(*comms_->dp, state_->grads, shard, bucket, std::move(deferred));
  }
  if (!forward_only && grid_.dp_size() > 1 && cfg.parallel.overlap_param_gather) {
    std::vector<int64_t> ends;
    for (const auto& m : chunks_) {
      const std::vector<int64_t> e = m->group_ends();
      ends.insert(ends.end(), e.begin(), e.end());
    }
    param_gather_ = std::make_unique<parallel::ParamGather>(*comms_->dp, state_->working, shard, bucket, std::move(ends));
    for (auto& m : chunks_) m->set_params_needed([this](int64_t end) { param_gather_->need(end); });
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

const PipeSchedule& Trainer::schedule(int micro_batches, bool training) {
  std::optional<PipeSchedule>& cached = training ? training_schedule_ : eval_schedule_;
  if (cached && cached->micro_batches == micro_batches) return *cached;
  const int P = grid_.pp_size(), v = table_.num_chunks();
  if (!training) return *(cached = pipeline_schedule(P, v, micro_batches, false));
  return *(cached = pipeline_step_schedule(P, v, micro_batches, step_cap_));
}

double Trainer::run_pipeline(const std::vector<MicroBatch>& mbs, float dloss, bool backward, double* token_losses) {
  if (backward && token_losses) throw std::logic_error("run_pipeline: per-token losses are for evaluation only");
  if (chunks_.size() == 1) return run_1f1b(mbs, dloss, backward, token_losses);
  if (backward) return run_interleaved(mbs.data(), static_cast<int>(mbs.size()), dloss, true, nullptr);
  // Evaluation: pp micro-batches at a time (the slots are sized for that).
  double loss_sum = 0;
  const int M = static_cast<int>(mbs.size()), P = grid_.pp_size();
  for (int first = 0; first < M; first += P)
    loss_sum += run_interleaved(mbs.data() + first, std::min(P, M - first), 0.0f, false,
                                token_losses ? token_losses + first * cfg_.train.micro_batch * cfg_.train.seq_len : nullptr);
  return loss_sum;
}

void Trainer::add_token_losses(const Transformer& m, int slot, double* out) {
  const Tensor rows = m.row_losses(slot);
  std::vector<float> host(static_cast<size_t>(rows.numel()));
  be_.copy_to_host(host.data(), rows);
  for (size_t i = 0; i < host.size(); ++i) out[i] += static_cast<double>(host[i]);
}

std::vector<double> Trainer::token_losses(const std::vector<MicroBatch>& micro_batches) {
  settle_params();
  std::vector<double> out(micro_batches.size() * static_cast<size_t>(cfg_.train.micro_batch * cfg_.train.seq_len), 0.0);
  run_pipeline(micro_batches, 0.0f, false, out.data());
  // Only the last stage holds them (the others add zeros): exact at double precision.
  return parallel::sum_over_ranks(*comms_->pp, be_, out);
}

// The schedule's ticks (train/pipeline_schedule.h): compute this rank's op, then the tick's
// forward-direction move (to the next rank, from the previous) and its backward-direction move.
// Every rank moves in the same order, so each move's partner is in the same move.
double Trainer::run_interleaved(const MicroBatch* mbs, int M, float dloss, bool backward, double* token_losses) {
  const PipeSchedule& sc = schedule(M, backward);
  const int P = grid_.pp_size(), s = grid_.pp_rank(), V = P * static_cast<int>(chunks_.size());
  const int next = (s + 1) % P, prev = (s + P - 1) % P;
  parallel::Comm& pp = *comms_->pp;
  const std::optional<float> head_dloss = backward ? std::optional<float>(dloss) : std::nullopt;
  auto slot = [&](int chunk, int mb) { return mb % chunks_[static_cast<size_t>(chunk)]->slots(); };
  auto grad_buffer = [&](int chunk, int mb) {
    const std::vector<Tensor>& pool = grad_pool_[static_cast<size_t>(chunk)];
    if (pool.empty()) throw std::logic_error("interleaved pipeline: chunk " + std::to_string(chunk) + " has no gradient buffer");
    return pool[static_cast<size_t>(mb) % pool.size()];
  };
  const std::vector<PipeTick>& ticks = sc.ticks[static_cast<size_t>(s)];
  const std::vector<int>& last_backward = sc.last_backward[static_cast<size_t>(s)];
  double loss_sum = 0;
  for (size_t i = 0; i < ticks.size(); ++i) {
    const PipeTick& k = ticks[i];
    std::optional<Tensor> send_fwd, recv_fwd, send_bwd, recv_bwd;
    if (!k.op.none()) {
      Transformer& m = *chunks_[static_cast<size_t>(k.op.chunk)];
      const int vs = sc.virtual_stage(s, k.op.chunk), mb = k.op.micro_batch;
      const MicroBatch& b = mbs[mb];
      if (!k.op.backward) {
        loss_sum += m.forward(slot(k.op.chunk, mb), vs == 0 ? b.inputs.data() : nullptr,
                              vs == V - 1 ? b.targets.data() : nullptr, head_dloss,
                              b.positions.empty() ? nullptr : b.positions.data())
                        .loss_sum;
        if (token_losses && vs == V - 1)
          add_token_losses(m, slot(k.op.chunk, mb), token_losses + int64_t{mb} * m.micro_batch() * m.seq_len());
        if (k.send_forward) send_fwd = m.stage_output(slot(k.op.chunk, mb));
      } else {
        if (vs != V - 1) be_.convert(m.grad_output(), grad_buffer(k.op.chunk, mb));
        const GradsReadyScope reporting(m, grads_ready_,
                                        last_backward[static_cast<size_t>(k.op.chunk)] == static_cast<int>(i));
        m.backward(slot(k.op.chunk, mb), dloss);
        if (k.send_backward) send_bwd = m.grad_input();
      }
    }
    if (!k.recv_forward.none())
      recv_fwd = chunks_[static_cast<size_t>(k.recv_forward.chunk)]->stage_input(
          slot(k.recv_forward.chunk, k.recv_forward.micro_batch));
    if (!k.recv_backward.none()) recv_bwd = grad_buffer(k.recv_backward.chunk, k.recv_backward.micro_batch);
    transfer(pp, send_fwd, next, recv_fwd, prev);
    transfer(pp, send_bwd, prev, recv_bwd, next);
  }
  return loss_sum;
}

double Trainer::run_1f1b(const std::vector<MicroBatch>& mbs, float dloss, bool backward, double* token_losses) {
  Transformer* const model = chunks_.front().get();
  const int M = static_cast<int>(mbs.size());
  const int P = grid_.pp_size(), s = grid_.pp_rank();
  const bool first = s == 0, last = s == P - 1;
  parallel::Comm& pp = *comms_->pp;
  const int slots = model->slots();
  double loss_sum = 0;
  int next_fwd = 0, next_bwd = 0;

  // Training passes dloss to forward too: a chunked head runs its backward there.
  const std::optional<float> head_dloss = backward ? std::optional<float>(dloss) : std::nullopt;
  auto forward = [&](int mb) {
    auto r = model->forward(mb % slots, first ? mbs[mb].inputs.data() : nullptr, last ? mbs[mb].targets.data() : nullptr,
                             head_dloss, mbs[mb].positions.empty() ? nullptr : mbs[mb].positions.data());
    loss_sum += r.loss_sum;
    if (token_losses && last)
      add_token_losses(*model, mb % slots, token_losses + int64_t{mb} * model->micro_batch() * model->seq_len());
  };
  auto recv_forward = [&](int mb) {
    if (!first) pp.recv(model->stage_input(mb % slots), s - 1);
  };
  auto send_forward = [&](int mb) {
    if (!last) pp.send(model->stage_output(mb % slots), s + 1);
  };
  auto backward_next = [&] {  // micro-batches go backward in order: the last one's is the step's last
    const GradsReadyScope reporting(*model, grads_ready_, next_bwd == M - 1);
    model->backward(next_bwd % slots, dloss);
    ++next_bwd;
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
    if (!last) pp.sendrecv(model->stage_output(done_fwd % slots), s + 1, model->grad_output(), s + 1);
    backward_next();
    if (i + 1 < steady) {
      if (!first) pp.sendrecv(model->grad_input(), s - 1, model->stage_input(next_fwd % slots), s - 1);
    } else if (!first) {
      pp.send(model->grad_input(), s - 1);
    }
  }
  for (int i = 0; i < warmup; ++i) {
    if (!last) pp.recv(model->grad_output(), s + 1);
    backward_next();
    if (!first) pp.send(model->grad_input(), s - 1);
  }
  return loss_sum;
}

// The tied input/output embedding lives on the first stage (tok_embed) and, as a copy, on the
// last (for the head). Their gradients are summed, so both copies take the identical update
// and never drift apart (the BLOOM restart-spike bug was exactly this sum missing).
void Trainer::sync_tied_embedding() {
  if (!holds_tied_copy()) return;
  comms_->embedding->all_reduce(param_view(state_->grads, table_.at("tok_embed")));
}

StepStats Trainer::step(const std::vector<MicroBatch>& micro_batches, int64_t iteration, bool collect_stats) {
  if (state_->grads.empty()) throw std::logic_error("Trainer::step: this trainer was built for evaluation only");
  StepStats st;
  st.iteration = iteration;
  // The schedule's rate for this step, reported also when the update is skipped (as Megatron does).
  st.lr = learning_rate(cfg_, iteration);
  parallel::Comm& dp = *comms_->dp;
  parallel::Comm& world = *comms_->world;
  st.global_batch = static_cast<int64_t>(micro_batches.size()) * cfg_.train.micro_batch * grid_.dp_size();
  // Timed as forward-backward: the pipeline, and the reductions of the step's token count and
  // loss (where DP replicas wait for each other without SP, TP or tied gradients to reduce).
  std::optional<StepTimers::Scope> fb_timer(std::in_place, timers_, StepTimers::ForwardBackward);
  int64_t valid = 0;
  for (const MicroBatch& mb : micro_batches)
    valid += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  st.valid_tokens = all_reduce_sum(dp, valid);
  st.loss_scale = scaler_.scale();
  if (st.valid_tokens == 0) {
    // Every target of the global batch is masked (an SFT window holding only prompt): the mean
    // loss over zero tokens is undefined and the gradient is zero. An update would still move
    // the weights by Adam's momentum and the weight decay and advance Adam's step, a phantom
    // step, so it is skipped (as Megatron's NaN loss would be). Every rank of the step sees
    // the same count (all-reduced over DP; TP and PP ranks read the same batches).
    st.skipped = true;
    st.loss = std::nan("");
    st.grad_norm = std::nan("");
    return st;
  }

  // The step's loss is the mean over every valid target token of the global batch, so each
  // token's loss enters the gradient with weight 1/valid_tokens (times the fp16 loss scale),
  // and the DP reduction of the gradients is a plain sum. Each gradient's first contribution
  // stores it; what none wrote is zero-filled after the pipeline (no fill of the whole buffer).
  grad_writes_->begin_step();
  const float dloss = st.loss_scale / static_cast<float>(st.valid_tokens);
  // Per-layer headroom: max |layer output| in forward, max |layer input gradient| in backward.
  std::vector<float> act_max, grad_max;
  if (collect_stats) {
    act_max.assign(static_cast<size_t>(cfg_.model.n_layers), 0.0f);
    grad_max.assign(act_max.size(), 0.0f);
    set_probe([&](int, const Transformer::OpProbe& p) {
      if (p.layer < 0) return;
      const bool act = !p.backward && (std::strcmp(p.op, Transformer::kLayerOutputOp) == 0 ||
                                       std::strcmp(p.op, Transformer::kLayerOutputFusedOp) == 0);
      const bool grad = p.backward && std::strcmp(p.op, "layer input gradient (attn_norm backward)") == 0;
      if (!act && !grad) return;
      float& slot = (act ? act_max : grad_max)[static_cast<size_t>(p.layer)];
      const float m = be_.max_abs(p.out);
      slot = std::isnan(m) || std::isnan(slot) ? std::nanf("") : std::max(slot, m);
    });
  }
  slow_rank_fault(static_cast<int>(micro_batches.size()));
  double loss_sum = 0;
  {
    // With DP overlap, the chunks' last backward hands each finished group of gradients to the
    // buckets: in this pipeline only (the non-finite re-run below must not reduce).
    if (grad_buckets_) {
      grad_buckets_->begin_step();
      grads_ready_ = [this](int64_t b, int64_t e) { grad_buckets_->ready(b, e); };
    }
    struct Clear {
      Transformer::GradsReadyFn& fn;
      ~Clear() { fn = nullptr; }
    } clear{grads_ready_};
    loss_sum = run_pipeline(micro_batches, dloss, true);
  }
  settle_params();  // the forward waited for every bucket it read; the rest before the update
  grad_writes_->finish_step();
  if (collect_stats) {
    set_probe(nullptr);
    st.act_max = parallel::max_over_ranks(*comms_->world, be_, act_max);
    st.grad_max = parallel::max_over_ranks(*comms_->world, be_, grad_max);
  }
  loss_sum = all_reduce_sum(*comms_->pp, loss_sum);  // the last stage's loss, to every stage
  loss_sum = all_reduce_sum(dp, loss_sum);
  st.loss = loss_sum / static_cast<double>(st.valid_tokens);
  fb_timer.reset();

  const int64_t n = table_.local_numel();
  const int64_t ob = state_->optim_begin(), oe = std::min(state_->optim_end(), n);
  {
    const StepTimers::Scope timed = timers_.phase(StepTimers::GradReduce);
    for (auto& m : chunks_) m->sum_tp_partial_grads();
    sync_tied_embedding();
    if (grad_buckets_) {
      grad_buckets_->finish();  // what the backward did not reduce already
    } else if (grid_.dp_size() > 1) {
      // This rank's block of the summed gradient lands in place in its own shard.
      dp.reduce_scatter(state_->flat_view(state_->grads, state_->optim_begin(), state_->optim_end() - state_->optim_begin()),
                        state_->grads);
    }
  }

  // Over this rank's shard, each parameter once: TP replicas and the tied copy are skipped
  // (they hold the same values as the primary copy on another rank). The primary tensors are
  // merged into contiguous ranges (usually a handful), so a GPU syncs a few times, not per tensor.
  // Non-finite values are counted over the whole shard: the primary ranges in one pass with
  // the norm (grad_stats), the replica gaps between them on their own.
  double sum_sq = 0;
  int64_t zeros = 0, nonfinite = 0, counted_to = ob;
  std::optional<StepTimers::Scope> norm_timer(std::in_place, timers_, StepTimers::GradNorm);
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
  norm_timer.reset();

  st.nonfinite = !std::isfinite(st.loss) || nonfinite > 0 || !std::isfinite(sum_sq);
  // The scaler learns only whether the gradients fitted at this scale (as PyTorch's GradScaler and
  // Megatron's DynamicGradScaler): a step the spike check skips below still counts toward growth.
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
  {
    const StepTimers::Scope timed = timers_.phase(StepTimers::Optimizer);
    adamw_update(*state_, table_, be_, cfg_.optimizer, st.lr, static_cast<float>(clip / st.loss_scale),
                 {cfg_.precision.stochastic_rounding, cfg_.train.seed});
  }
  if (grid_.dp_size() > 1) {
    const StepTimers::Scope timed = timers_.phase(StepTimers::ParamGather);
    // Every rank updated its shard of the working weights; gather the whole back (or start to,
    // the rest following the next forward).
    if (param_gather_)
      param_gather_->begin();
    else
      dp.all_gather(state_->working, state_->flat_view(state_->working, state_->optim_begin(),
                                                       state_->optim_end() - state_->optim_begin()));
  }
  if (frozen_ && ++applied_since_frozen_check_ >= cfg_.health.frozen_check_interval) {
    applied_since_frozen_check_ = 0;
    check_frozen(st);
  }
  return st;
}

void Trainer::slow_rank_fault(int micro_batches) {
  // rank R sleeps N ms per micro-batch (a throttled GPU); with per_layer_ms, every rank also
  // sleeps M ms per micro-batch for each layer it holds (layers that cost the same everywhere).
  struct Fault {
    int rank = -1;
    long long ms = 0, per_layer_ms = 0;
  };
  static const Fault fault = [] {
    Fault f;
    const char* v = std::getenv("KEEL_FAULT_SLOW_RANK");
    const int n = v ? std::sscanf(v, "rank=%d,ms=%lld,per_layer_ms=%lld", &f.rank, &f.ms, &f.per_layer_ms) : 0;
    if (v && (n < 2 || f.ms < 0 || f.per_layer_ms < 0))
      throw std::invalid_argument(std::string("KEEL_FAULT_SLOW_RANK=\"") + v +
                                  "\": expected rank=R,ms=N or rank=R,ms=N,per_layer_ms=M");
    return f;
  }();
  long long ms = fault.rank == grid_.rank() ? fault.ms : 0;
  for (const auto& chunk : chunks_) {
    const ModelShard& sh = chunk->table().shard();
    ms += fault.per_layer_ms * (sh.end_layer - sh.first_layer);
  }
  if (ms == 0) return;
  static bool said = false;
  if (!std::exchange(said, true))
    std::fprintf(stderr, "keel: KEEL_FAULT_SLOW_RANK: world rank %d sleeps %lld ms per micro-batch (test fault)\n",
                 grid_.rank(), ms);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms * micro_batches));
}

std::vector<RankTimes> Trainer::gather_timers(double step_ms) {
  const std::vector<double> mine = timers_.sample(step_ms);
  timers_.start_step(false);
  static const std::string host = [] {  // one word: the text is split at spaces below
    std::string h = data::detail::this_host();
    std::replace(h.begin(), h.end(), ' ', '_');
    return h.empty() ? std::string("?") : h;
  }();
  std::string text = host;
  for (double x : mine) {
    char b[32];
    std::snprintf(b, sizeof b, " %.4f", x);
    text += b;
  }
  std::vector<RankTimes> all;
  const std::vector<std::string> texts = parallel::gather_text(*comms_->world, be_, text);
  for (int r = 0; r < static_cast<int>(texts.size()); ++r) {
    RankTimes t;
    t.world_rank = r;
    const parallel::GridCoord c = grid_.coord_of(r);
    t.tp = c.tp;
    t.pp = c.pp;
    t.dp = c.dp;
    std::istringstream in(texts[static_cast<size_t>(r)]);
    in >> t.host;
    if (t.host == "?") t.host.clear();
    for (double x; in >> x;) t.ms.push_back(x);
    all.push_back(std::move(t));
  }
  return all;
}

void Trainer::set_probe(const std::function<void(int chunk, const Transformer::OpProbe&)>& fn) {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (!fn) {
      chunks_[c]->set_probe(nullptr);
      continue;
    }
    chunks_[c]->set_probe([fn, c](const Transformer::OpProbe& p) { fn(static_cast<int>(c), p); });
  }
}

ParamState& Trainer::state() {
  if (param_gather_ && param_gather_->pending())
    throw std::logic_error("Trainer::state() while the DP weight gather (parallel.overlap_param_gather) is pending: "
                           "call settle_params() on every rank first");
  return *state_;
}

int Trainer::check_replicas() {
  settle_params();
  // Test hook: KEEL_FAULT_TIED_DRIFT=1 nudges the last stage's tied copy once, to prove the
  // check catches copies that drift apart.
  static bool drift = std::getenv("KEEL_FAULT_TIED_DRIFT") != nullptr;
  int checked = 0;
  using parallel::GroupKind;
  auto compare = [&](parallel::Comm& group, GroupKind kind, const ParamSpec& p) {
    Tensor w = param_view(state_->working, p);
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
  if (holds_tied_copy()) compare(*comms_->embedding, GroupKind::Embedding, table_.at("tok_embed"));
  if (grid_.tp_size() > 1)
    for (const ParamSpec& p : table_.params())
      if (p.split == TpSplit::None) compare(*comms_->tp, GroupKind::TP, p);
  return checked;
}

double Trainer::evaluate(const std::vector<MicroBatch>& micro_batches, int64_t* loss_tokens) {
  settle_params();
  int64_t valid = 0;
  for (const MicroBatch& mb : micro_batches)
    valid += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  valid = all_reduce_sum(*comms_->dp, valid);
  if (loss_tokens) *loss_tokens = valid;
  double loss_sum = run_pipeline(micro_batches, 0.0f, false);
  loss_sum = all_reduce_sum(*comms_->pp, loss_sum);
  loss_sum = all_reduce_sum(*comms_->dp, loss_sum);
  return valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
}

}  // namespace keel
