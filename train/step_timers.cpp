#include "train/step_timers.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "model/param_table.h"

namespace keel {

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int group_index(parallel::GroupKind g) { return static_cast<int>(g); }

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, ms < 10 ? "%.2f" : "%.1f", ms);
  return b;
}
}  // namespace

// ---- StepTimers -------------------------------------------------------------------------------

const std::vector<std::string>& StepTimers::columns() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {"step", phase_name(Data), phase_name(ForwardBackward), "compute"};
    for (Phase p : {GradReduce, GradNorm, Optimizer, ParamGather}) n.push_back(phase_name(p));
    for (parallel::GroupKind g : parallel::kAllGroups) n.push_back(std::string(parallel::group_name(g)) + "-comm");
    return n;
  }();
  return names;
}

void StepTimers::start_step(bool timed) {
  timed_ = timed;
  current_ = -1;
  phase_s_.fill(0);
  phase_comm_s_.fill(0);
  group_s_.fill(0);
}

const char* StepTimers::phase_name(Phase p) {
  static const char* const names[kPhases] = {"data", "forward-backward", "grad-reduce", "grad-norm", "optimizer",
                                             "param-gather"};
  return names[p];
}

StepTimers::Scope::Scope(StepTimers& t, Phase p) : range_(phase_name(p)), t_(t.timed_ ? &t : nullptr), p_(p) {
  if (!t_) return;
  t_->drain_();  // what was queued before belongs to the phase before
  t_->current_ = p;
  start_ = Clock::now();
}

StepTimers::Scope::~Scope() {
  if (!t_) return;
  t_->drain_();
  t_->phase_s_[p_] += seconds_since(start_);
  t_->current_ = -1;
}

void StepTimers::add_comm(parallel::GroupKind g, double seconds) {
  group_s_[static_cast<size_t>(group_index(g))] += seconds;
  if (current_ >= 0) phase_comm_s_[static_cast<size_t>(current_)] += seconds;
}

std::vector<double> StepTimers::sample(double step_ms) const {
  auto phase_ms = [&](Phase p) { return phase_s_[static_cast<size_t>(p)] * 1e3; };
  const double compute = std::max(0.0, phase_ms(ForwardBackward) - phase_comm_s_[ForwardBackward] * 1e3);
  std::vector<double> ms = {step_ms,         phase_ms(Data),      phase_ms(ForwardBackward), compute,
                            phase_ms(GradReduce), phase_ms(GradNorm), phase_ms(Optimizer),       phase_ms(ParamGather)};
  for (double s : group_s_) ms.push_back(s * 1e3);
  return ms;
}

// ---- TimedComm --------------------------------------------------------------------------------

namespace {
// A profiler range name for each collective (TimedComm::Op order) on each group ("tp all_reduce").
const char* comm_range_name(parallel::GroupKind g, int op) {
  static const char* const ops[] = {"all_reduce", "reduce_scatter", "reduce",   "all_gather", "broadcast",
                                    "send",       "recv",           "sendrecv", "barrier"};
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n(StepTimers::kGroups * std::size(ops));
    for (parallel::GroupKind k : parallel::kAllGroups)
      for (size_t o = 0; o < std::size(ops); ++o)
        n[static_cast<size_t>(group_index(k)) * std::size(ops) + o] = std::string(parallel::group_name(k)) + " " + ops[o];
    return n;
  }();
  return names[static_cast<size_t>(group_index(g)) * std::size(ops) + static_cast<size_t>(op)].c_str();
}
}  // namespace

template <class F>
void TimedComm::timed(Op op, F&& call) {
  const ProfileRange range(comm_range_name(group_, op));
  if (!timers_.timed() || inner_.size() == 1) {  // a group of one does not communicate
    call();
    return;
  }
  inner_.wait_idle();  // the device work queued before the call is not communication
  const Clock::time_point start = Clock::now();
  call();
  inner_.wait_idle();
  timers_.add_comm(group_, seconds_since(start));
}

void TimedComm::all_reduce(const Tensor& t, parallel::ReduceOp op) {
  timed(AllReduce, [&] { inner_.all_reduce(t, op); });
}
void TimedComm::reduce_scatter(const Tensor& out, const Tensor& in) {
  timed(ReduceScatter, [&] { inner_.reduce_scatter(out, in); });
}
void TimedComm::reduce(const Tensor& t, int root) {
  timed(Reduce, [&] { inner_.reduce(t, root); });
}
void TimedComm::reduce_async(const Tensor& t, int root) {
  timed(Reduce, [&] { inner_.reduce_async(t, root); });  // wait_idle includes the side stream
}
void TimedComm::all_gather(const Tensor& out, const Tensor& in) {
  timed(AllGather, [&] { inner_.all_gather(out, in); });
}
void TimedComm::broadcast(const Tensor& t, int root) {
  timed(Broadcast, [&] { inner_.broadcast(t, root); });
}
void TimedComm::broadcast_async(const Tensor& t, int root) {
  timed(Broadcast, [&] { inner_.broadcast_async(t, root); });
}
void TimedComm::send(const Tensor& t, int peer) {
  timed(Send, [&] { inner_.send(t, peer); });
}
void TimedComm::recv(const Tensor& t, int peer) {
  timed(Recv, [&] { inner_.recv(t, peer); });
}
void TimedComm::sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) {
  timed(SendRecv, [&] { inner_.sendrecv(send_t, send_peer, recv_t, recv_peer); });
}
void TimedComm::barrier() {
  timed(Barrier, [&] { inner_.barrier(); });
}

parallel::CommGroups timed_comms(const parallel::CommGroups& comms, StepTimers& timers) {
  using parallel::GroupKind;
  parallel::CommGroups g;
  g.world = std::make_unique<TimedComm>(*comms.world, GroupKind::World, timers);
  g.tp = std::make_unique<TimedComm>(*comms.tp, GroupKind::TP, timers);
  g.pp = std::make_unique<TimedComm>(*comms.pp, GroupKind::PP, timers);
  g.dp = std::make_unique<TimedComm>(*comms.dp, GroupKind::DP, timers);
  g.embedding = std::make_unique<TimedComm>(*comms.embedding, GroupKind::Embedding, timers);
  return g;
}

// ---- summary over ranks -----------------------------------------------------------------------

TimersSummary summarize_timers(const std::vector<RankTimes>& ranks, int64_t step, double ratio) {
  TimersSummary s;
  const std::vector<std::string>& cols = StepTimers::columns();
  const size_t n = ranks.size();
  if (n == 0) return s;
  auto column = [&](const char* name) { return static_cast<size_t>(std::find(cols.begin(), cols.end(), name) - cols.begin()); };
  const size_t compute = column("compute"), forward_backward = column("forward-backward");
  bool compute_differs = false;  // else compute is forward-backward again (nothing communicated inside)
  for (const RankTimes& r : ranks) {
    if (r.ms.size() != cols.size())
      throw std::runtime_error("timers: world rank " + std::to_string(r.world_rank) + " sent " +
                               std::to_string(r.ms.size()) + " values for " + std::to_string(cols.size()) + " columns");
    compute_differs |= r.ms[compute] != r.ms[forward_backward];
  }
  s.record = {{"event", "timers"}, {"step", step}, {"ranks", n}};
  std::string line = "timers at step " + std::to_string(step) +
                     (n > 1 ? " (ms, min-max over " + std::to_string(n) + " ranks):" : " (ms):");
  bool first = true;
  for (size_t c = 0; c < cols.size(); ++c) {
    size_t lo = 0, hi = 0;
    for (size_t r = 0; r < n; ++r) {
      if (ranks[r].ms[c] < ranks[lo].ms[c]) lo = r;
      if (ranks[r].ms[c] > ranks[hi].ms[c]) hi = r;
    }
    const double mn = ranks[lo].ms[c], mx = ranks[hi].ms[c];
    s.record["ms"][cols[c]] = {{"min", mn}, {"max", mx}, {"max_rank", ranks[hi].world_rank}};
    // Phases and groups this layout does not have (or that round to nothing) stay off the line.
    if (c != 0 && (mx < 0.005 || (c == compute && !compute_differs))) continue;
    line += std::string(first ? " " : " | ") + cols[c] + " " + fmt_ms(mn);
    if (n > 1) line += "-" + fmt_ms(mx);
    if (n > 1 && c == compute) line += " (rank " + std::to_string(ranks[hi].world_rank) + ")";
    first = false;
  }
  s.line = line;

  if (ratio <= 0) return s;
  // Ranks of one pipeline stage do the same work; compare each with its stage's lower median
  // (with two ranks, the faster one).
  std::map<int, std::vector<const RankTimes*>> stages;
  for (const RankTimes& r : ranks) stages[r.pp].push_back(&r);
  for (auto& [stage, members] : stages) {
    if (members.size() < 2) continue;
    std::vector<double> t;
    for (const RankTimes* r : members) t.push_back(r->ms[compute]);
    std::sort(t.begin(), t.end());
    const double median = t[(t.size() - 1) / 2];
    for (const RankTimes* r : members) {
      const double x = r->ms[compute];
      if (x < ratio * median || x - median < 1.0) continue;
      Straggler g{r->world_rank, x, median, static_cast<int>(members.size()), {}};
      char b[320];
      std::snprintf(b, sizeof b,
                    "world rank %d (tp %d, pp %d, dp %d%s%s) computed for %s ms at step %lld, %.2fx the %s ms of a "
                    "typical rank of pipeline stage %d (%zu ranks)",
                    r->world_rank, r->tp, r->pp, r->dp, r->host.empty() ? "" : ", host ", r->host.c_str(),
                    fmt_ms(x).c_str(), static_cast<long long>(step), median > 0 ? x / median : 0.0,
                    fmt_ms(median).c_str(), stage, members.size());
      g.text = b;
      s.record["stragglers"].push_back(
          {{"rank", g.world_rank}, {"host", r->host}, {"compute_ms", x}, {"stage_median_ms", median}});
      s.stragglers.push_back(std::move(g));
    }
  }
  return s;
}

std::optional<PipelineBalance> pipeline_balance(const std::vector<RankTimes>& ranks, const std::vector<int>& stage_layers,
                                                const std::vector<int>& max_layers, int chunks) {
  if (chunks < 1 || stage_layers.size() % static_cast<size_t>(chunks) != 0) return std::nullopt;
  const size_t P = stage_layers.size() / static_cast<size_t>(chunks);  // pipeline ranks
  if (P < 3) return std::nullopt;
  std::vector<int> rank_layers(P, 0);  // over the rank's chunks (virtual stages c * P + s)
  for (size_t i = 0; i < stage_layers.size(); ++i) rank_layers[i % P] += stage_layers[i];
  const std::vector<std::string>& cols = StepTimers::columns();
  const size_t compute = static_cast<size_t>(std::find(cols.begin(), cols.end(), "compute") - cols.begin());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[(v.size() - 1) / 2];
  };
  std::vector<std::vector<double>> by_stage(P);
  for (const RankTimes& r : ranks)
    if (r.pp >= 0 && static_cast<size_t>(r.pp) < P && r.ms.size() == cols.size())
      by_stage[static_cast<size_t>(r.pp)].push_back(r.ms[compute]);
  PipelineBalance b;
  std::vector<double> per_layer;
  int n_layers = 0;
  for (size_t s = 0; s < P; ++s) {
    if (by_stage[s].empty()) return std::nullopt;
    b.stage_ms.push_back(median(by_stage[s]));
    n_layers += rank_layers[s];
    if (s > 0 && s + 1 < P && rank_layers[s] > 0) per_layer.push_back(b.stage_ms[s] / rank_layers[s]);
  }
  if (per_layer.empty()) return std::nullopt;
  const double layer_ms = median(per_layer);
  if (!(layer_ms > 0)) return std::nullopt;
  std::vector<double> rest(P);
  for (size_t s = 0; s < P; ++s) rest[s] = std::max(0.0, b.stage_ms[s] - rank_layers[s] * layer_ms);
  b.layers = balanced_pipeline_layers(rest, layer_ms, n_layers, max_layers, chunks);
  if (b.layers.empty() || b.layers == stage_layers) return std::nullopt;
  const bool memory_bound =
      !max_layers.empty() && balanced_pipeline_layers(rest, layer_ms, n_layers, {}, chunks) != b.layers;
  std::vector<int> after(P, 0);
  for (size_t i = 0; i < b.layers.size(); ++i) after[i % P] += b.layers[i];
  for (size_t s = 0; s < P; ++s) b.slowest_after_ms = std::max(b.slowest_after_ms, rest[s] + after[s] * layer_ms);
  const auto slowest = std::max_element(b.stage_ms.begin(), b.stage_ms.end());
  if (b.slowest_after_ms > 0.9 * *slowest) return std::nullopt;
  const size_t at = static_cast<size_t>(slowest - b.stage_ms.begin());
  b.text = "a step's compute takes " + fmt_ms(*std::min_element(b.stage_ms.begin(), b.stage_ms.end())) + "-" +
           fmt_ms(*slowest) + " ms a pipeline stage, stage " + std::to_string(at) + " (" +
           std::to_string(rank_layers[at]) + " layers" +
           (chunks > 1 ? " in " + std::to_string(chunks) + " chunks" : std::string()) +
           (at == 0 ? " + embedding" : at + 1 == P ? " + head" : "") + ") the slowest, a layer about " +
           fmt_ms(layer_ms) + " ms; parallel.pipeline_layers " + nlohmann::json(b.layers).dump() + " would even them" +
           (memory_bound ? " as far as each stage's memory allows (keel plan)" : "") + " (slowest stage about " +
           fmt_ms(b.slowest_after_ms) + " ms)";
  return b;
}

}  // namespace keel
