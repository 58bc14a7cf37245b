#include "train/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>

namespace keel {

namespace {

// The most intervals [starts[i], ends[i]] (closed, in half-ticks) that overlap at one point:
// the starts and the ends merged in time order, a start before an end at a tie. (A chunk fills
// and empties its slots in micro-batch order, so both come sorted; sorted here if not.)
int max_overlap(std::vector<int> starts, std::vector<int> ends) {
  if (!std::is_sorted(starts.begin(), starts.end())) std::sort(starts.begin(), starts.end());
  if (!std::is_sorted(ends.begin(), ends.end())) std::sort(ends.begin(), ends.end());
  int open = 0, most = 0;
  for (size_t a = 0, b = 0; a < starts.size();) {
    if (starts[a] <= ends[b]) {
      most = std::max(most, ++open);
      ++a;
    } else {
      --open;
      ++b;
    }
  }
  return most;
}

}  // namespace

int PipeSchedule::busy_ticks(int rank) const {
  int n = 0;
  for (const PipeTick& t : ticks.at(static_cast<size_t>(rank))) n += t.op.none() ? 0 : 1;
  return n;
}

std::string PipeSchedule::describe() const {
  int busy = 0;
  for (int s = 0; s < stages; ++s) busy = std::max(busy, busy_ticks(s));
  const int idle = num_ticks() - busy;
  return std::string(chunks > 1 ? "interleaved 1F1B" : "1F1B") + ": " + std::to_string(stages) + " stages x " +
         std::to_string(chunks) + " chunk" + (chunks > 1 ? "s" : "") + ", " + std::to_string(micro_batches) +
         " micro-batches: " + std::to_string(num_ticks()) + " ticks of " + std::to_string(busy) + " ops per rank (" +
         std::to_string(idle) + " idle, bubble " +
         std::to_string(static_cast<int>(100.0 * idle / std::max(1, num_ticks()) + 0.5)) + "%)";
}

namespace {

// Plays a step out. Without `cap`: each rank's static order, Megatron's, with every rank's
// warm-up lengthened by `extra` forwards. With `cap` ([rank][chunk], training only): the greedy
// order that keeps each chunk within cap micro-batches (pipeline_step_schedule). False when the
// orders stall (a rank's next op waits for one that waits for it).
bool simulate(int P, int v, int M, bool training, int extra, const std::vector<std::vector<int>>* cap,
              PipeSchedule& sc) {
  sc = {};
  sc.stages = P;
  sc.chunks = v;
  sc.micro_batches = M;
  sc.training = training;
  const int V = P * v, K = M * v;

  // Each rank's forwards and backwards: micro-batches in groups (micro_batch_groups; under a cap
  // groups of P, the last smaller), a group's forwards through chunk 0, 1, ..., its backwards
  // through chunk v - 1, v - 2, ...
  std::vector<int> groups = micro_batch_groups(P, M);
  if (cap) {
    groups.clear();
    for (int left = M; left > 0; left -= P) groups.push_back(std::min(left, P));
  }
  std::vector<PipeOp> forwards, backwards;
  for (int g = 0, first = 0; g < static_cast<int>(groups.size()); first += groups[static_cast<size_t>(g++)])
    for (int c = 0; c < v; ++c)
      for (int mb = first; mb < first + groups[static_cast<size_t>(g)]; ++mb) {
        forwards.push_back({false, c, mb});
        backwards.push_back({true, v - 1 - c, mb});
      }
  // Megatron's warm-up, for the first group's size G: a chunk's first forward of a group comes
  // (v - 1) G forwards after the group's first.
  const int G = M < P ? P : groups.front();
  std::vector<std::vector<PipeOp>> order(static_cast<size_t>(P));
  for (int s = 0; s < P && !cap; ++s) {
    std::vector<PipeOp>& o = order[static_cast<size_t>(s)];
    if (!training) {
      o = forwards;
      continue;
    }
    const int warmup = std::min(K, extra + (v == 1 ? P - s - 1 : M == P ? K : (P - s - 1) * 2 + (v - 1) * G));
    size_t f = 0, b = 0;
    while (f < static_cast<size_t>(warmup)) o.push_back(forwards[f++]);
    while (f < forwards.size()) {
      o.push_back(forwards[f++]);
      o.push_back(backwards[b++]);
    }
    while (b < backwards.size()) o.push_back(backwards[b++]);
  }

  // Play the orders out. ready_*[vs][mb]: the first tick at which the op's input is there.
  constexpr int kNever = 1 << 30;
  const std::vector<std::vector<int>> never(static_cast<size_t>(V), std::vector<int>(static_cast<size_t>(M), kNever));
  std::vector<std::vector<int>> ready_fwd = never, ready_bwd = never;
  std::fill(ready_fwd[0].begin(), ready_fwd[0].end(), 0);  // the first virtual stage reads tokens
  // Half-tick times of each (vs, mb): 2t = the compute of tick t, 2t + 1 = its exchange.
  std::vector<std::vector<int>> act_start = never, act_end = never, grad_start = never, grad_end = never;
  sc.ticks.assign(static_cast<size_t>(P), {});
  for (auto& r : sc.ticks) r.reserve(static_cast<size_t>(2 * K + 2 * P));  // a step's ticks, mostly
  // Static: next[s] into order[s]. Capped: next_fwd[s] and next_bwd[s] into forwards and
  // backwards, and each virtual stage's micro-batches held (from the exchange that delivers the
  // input, or the forward on virtual stage 0, until the backward).
  std::vector<size_t> next(static_cast<size_t>(P), 0), next_fwd = next, next_bwd = next;
  std::vector<int> held(cap ? static_cast<size_t>(V) : 0, 0), taken = held, freed = held;
  auto all_done = [&] {
    for (size_t s = 0; s < static_cast<size_t>(P); ++s)
      if (cap ? next_bwd[s] < backwards.size() : next[s] < order[s].size()) return false;
    return true;
  };
  auto ready = [&](const PipeOp& op, int s, int t) {
    const size_t vu = static_cast<size_t>(sc.virtual_stage(s, op.chunk)), mu = static_cast<size_t>(op.micro_batch);
    return (op.backward ? ready_bwd : ready_fwd)[vu][mu] <= t;
  };
  // Capped: a rank's next backward when its input is there (it frees a slot), else its next
  // forward when its input is there and the slots it fills are free (the next virtual stage's,
  // where it sends its output, and on virtual stage 0 its own), counting what each chunk held at
  // the tick's start and what this tick already gave it.
  auto room = [&](int u) {
    const size_t uu = static_cast<size_t>(u);
    return held[uu] + taken[uu] < (*cap)[static_cast<size_t>(u % P)][static_cast<size_t>(u / P)];
  };
  auto pick = [&](int s, int t) -> std::optional<PipeOp> {
    const size_t su = static_cast<size_t>(s);
    if (!cap) {
      if (next[su] == order[su].size() || !ready(order[su][next[su]], s, t)) return std::nullopt;
      return order[su][next[su]++];
    }
    if (next_bwd[su] < backwards.size() && ready(backwards[next_bwd[su]], s, t)) return backwards[next_bwd[su]++];
    if (next_fwd[su] == forwards.size() || !ready(forwards[next_fwd[su]], s, t)) return std::nullopt;
    const int vs = sc.virtual_stage(s, forwards[next_fwd[su]].chunk);
    if ((vs == 0 && !room(0)) || (vs < V - 1 && !room(vs + 1))) return std::nullopt;
    if (vs == 0) ++taken[0];
    if (vs < V - 1) ++taken[static_cast<size_t>(vs + 1)];
    return forwards[next_fwd[su]++];
  };
  for (int t = 0; !all_done(); ++t) {
    for (auto& r : sc.ticks) r.emplace_back();
    bool progressed = false;
    for (int s = 0; s < P; ++s) {
      const size_t su = static_cast<size_t>(s);
      const std::optional<PipeOp> picked = pick(s, t);
      if (!picked) continue;
      const PipeOp op = *picked;
      const int vs = sc.virtual_stage(s, op.chunk);
      const size_t vu = static_cast<size_t>(vs), mu = static_cast<size_t>(op.micro_batch);
      if (cap && op.backward) ++freed[vu];
      progressed = true;
      PipeTick& me = sc.ticks[su].back();
      me.op = op;
      const int next_rank = (s + 1) % P, prev_rank = (s + P - 1) % P;
      if (!op.backward) {
        if (vs == 0) act_start[vu][mu] = 2 * t;
        act_end[vu][mu] = 2 * t + 1;  // until its output is sent (training: until its backward, below)
        if (vs == V - 1) {
          if (training) ready_bwd[vu][mu] = t + 1;  // the loss's gradient is here
        } else {
          me.send_forward = true;
          const int to_chunk = op.chunk + (s == P - 1 ? 1 : 0);
          sc.ticks[static_cast<size_t>(next_rank)].back().recv_forward = {false, to_chunk, op.micro_batch};
          ready_fwd[vu + 1][mu] = t + 1;
          act_start[vu + 1][mu] = 2 * t + 1;
        }
      } else {
        act_end[vu][mu] = 2 * t;
        if (vs != V - 1) grad_end[vu][mu] = 2 * t;
        if (vs > 0) {
          me.send_backward = true;
          const int to_chunk = op.chunk - (s == 0 ? 1 : 0);
          sc.ticks[static_cast<size_t>(prev_rank)].back().recv_backward = {true, to_chunk, op.micro_batch};
          ready_bwd[vu - 1][mu] = t + 1;
          grad_start[vu - 1][mu] = 2 * t + 1;
        }
      }
    }
    if (!progressed) return false;
    for (size_t u = 0; u < held.size(); ++u) held[u] += taken[u] - freed[u], taken[u] = freed[u] = 0;
  }

  sc.activation_slots.assign(static_cast<size_t>(P), std::vector<int>(static_cast<size_t>(v), 0));
  sc.gradient_slots = sc.activation_slots;
  sc.last_backward.assign(static_cast<size_t>(P), std::vector<int>(static_cast<size_t>(v), -1));
  for (size_t s = 0; s < sc.ticks.size(); ++s)
    for (size_t t = 0; t < sc.ticks[s].size(); ++t)
      if (const PipeOp& op = sc.ticks[s][t].op; !op.none() && op.backward)
        sc.last_backward[s][static_cast<size_t>(op.chunk)] = static_cast<int>(t);
  for (int s = 0; s < P; ++s)
    for (int c = 0; c < v; ++c) {
      const size_t vu = static_cast<size_t>(sc.virtual_stage(s, c));
      const bool grads = training && vu + 1 < static_cast<size_t>(V);
      sc.activation_slots[static_cast<size_t>(s)][static_cast<size_t>(c)] = max_overlap(act_start[vu], act_end[vu]);
      sc.gradient_slots[static_cast<size_t>(s)][static_cast<size_t>(c)] =
          grads ? max_overlap(grad_start[vu], grad_end[vu]) : 0;
    }
  return true;
}

}  // namespace

namespace {

bool within(const std::vector<std::vector<int>>& slots, const std::vector<std::vector<int>>& cap) {
  for (size_t s = 0; s < slots.size(); ++s)
    for (size_t c = 0; c < slots[s].size(); ++c)
      if (slots[s][c] > cap[s][c]) return false;
  return true;
}

}  // namespace

PipeSchedule pipeline_step_schedule(int P, int v, int M, const std::vector<std::vector<int>>& cap) {
  PipeSchedule sc = pipeline_schedule(P, v, M, true);
  if (cap.empty() || within(sc.activation_slots, cap)) return sc;
  PipeSchedule capped;
  if (simulate(P, v, M, true, 0, &cap, capped)) return capped;
  return sc;  // (not seen for P, v <= 16 and step sizes below a largest <= 48: all play out capped)
}

PipeSlots pipeline_slots(int P, int v, const std::vector<int>& training_counts) {
  // Kept per (P, v, counts): keel plan asks again for each layout it re-plans (the split
  // searches, the balance advice), and a ramp-up's step sizes take a large pipeline tens of
  // milliseconds to play out. A few ints an entry.
  static std::mutex mutex;
  static std::map<std::tuple<int, int, std::vector<int>>, PipeSlots> kept;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(P, v, training_counts);
  if (const auto it = kept.find(key); it != kept.end()) return it->second;
  PipeSlots slots;
  slots.activation.assign(static_cast<size_t>(P), std::vector<int>(static_cast<size_t>(v), 1));
  slots.gradient.assign(static_cast<size_t>(P), std::vector<int>(static_cast<size_t>(v), 0));
  auto need = [&](const PipeSchedule& sc) {
    for (size_t s = 0; s < static_cast<size_t>(P); ++s)
      for (size_t c = 0; c < static_cast<size_t>(v); ++c) {
        slots.activation[s][c] = std::max(slots.activation[s][c], sc.activation_slots[s][c]);
        slots.gradient[s][c] = std::max(slots.gradient[s][c], sc.gradient_slots[s][c]);
      }
  };
  // Each training step as the trainer runs it: within the largest step's slots (the largest's
  // own schedule is within them).
  const int largest = training_counts.empty() ? 0 : *std::max_element(training_counts.begin(), training_counts.end());
  if (largest > 0) {
    const std::vector<std::vector<int>> cap = pipeline_schedule(P, v, largest, true).activation_slots;
    for (int m : training_counts) need(pipeline_step_schedule(P, v, m, cap));
  }
  for (int m = 1; m <= P; ++m) need(pipeline_schedule(P, v, m, false));
  kept.emplace(key, slots);
  return slots;
}

std::vector<int> micro_batch_groups(int P, int M) {
  if (M <= P) return {M};
  // M / P groups, the first M % (M / P) of them one larger: no group is smaller than P.
  const int n = M / P;
  std::vector<int> groups(static_cast<size_t>(n), M / n);
  for (int g = 0; g < M % n; ++g) ++groups[static_cast<size_t>(g)];
  return groups;
}

PipeSchedule pipeline_schedule(int P, int v, int M, bool training) {
  if (P < 1 || v < 1 || M < 1)
    throw std::invalid_argument("pipeline schedule: stages (" + std::to_string(P) + "), chunks (" + std::to_string(v) +
                                ") and micro-batches (" + std::to_string(M) + ") must be >= 1");
  // Megatron's warm-up plays out with groups of P or more, with no tick beyond 2 M v + 2 (P - 1)
  // (played out once for every P <= 16, v <= 16 and M <= 200; test_pipeline_schedule keeps a
  // smaller range and some large pipelines); a longer warm-up is the fallback (at worst every
  // forward first, which always plays out).
  PipeSchedule sc;
  for (int extra = 0; extra <= M * v; ++extra)
    if (simulate(P, v, M, training, extra, nullptr, sc)) return sc;
  throw std::logic_error("pipeline schedule: no warm-up plays out (" + std::to_string(P) + " stages, " +
                         std::to_string(v) + " chunks, " + std::to_string(M) + " micro-batches)");
}

}  // namespace keel
