// The pipeline schedule (train/pipeline_schedule.h), played out for many (stages, chunks,
// micro-batches): every op once, in dependency order, every message sent and received in the
// same tick, the slots it reports enough, and the bubble the interleaving promises.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "train/pipeline_schedule.h"

using namespace keel;

namespace {

// Checks one schedule; returns the ticks at which each (backward, virtual stage, micro-batch) ran.
std::map<std::tuple<bool, int, int>, int> check_schedule(const PipeSchedule& sc) {
  const int P = sc.stages, v = sc.chunks, M = sc.micro_batches, V = P * v;
  std::map<std::tuple<bool, int, int>, int> ran;
  for (int s = 0; s < P; ++s) {
    REQUIRE(sc.ticks[static_cast<size_t>(s)].size() == static_cast<size_t>(sc.num_ticks()));
    for (int t = 0; t < sc.num_ticks(); ++t) {
      const PipeTick& k = sc.ticks[static_cast<size_t>(s)][static_cast<size_t>(t)];
      if (k.op.none()) {
        CHECK_FALSE(k.send_forward);
        CHECK_FALSE(k.send_backward);
        continue;
      }
      const int vs = sc.virtual_stage(s, k.op.chunk);
      const auto key = std::make_tuple(k.op.backward, vs, k.op.micro_batch);
      CHECK(ran.count(key) == 0);  // once
      ran[key] = t;
      // The message this op sends is received by the neighbour in the same tick.
      if (k.send_forward) {
        const PipeTick& to = sc.ticks[static_cast<size_t>((s + 1) % P)][static_cast<size_t>(t)];
        CHECK(to.recv_forward.micro_batch == k.op.micro_batch);
        CHECK(sc.virtual_stage((s + 1) % P, to.recv_forward.chunk) == vs + 1);
      }
      if (k.send_backward) {
        const PipeTick& to = sc.ticks[static_cast<size_t>((s + P - 1) % P)][static_cast<size_t>(t)];
        CHECK(to.recv_backward.micro_batch == k.op.micro_batch);
        CHECK(sc.virtual_stage((s + P - 1) % P, to.recv_backward.chunk) == vs - 1);
      }
      CHECK(k.send_forward == (!k.op.backward && vs < V - 1));
      CHECK(k.send_backward == (k.op.backward && vs > 0));
    }
  }
  // Every op once, after what it needs.
  CHECK(ran.size() == static_cast<size_t>((sc.training ? 2 : 1) * V * M));
  for (int mb = 0; mb < M; ++mb)
    for (int vs = 0; vs < V; ++vs) {
      REQUIRE(ran.count({false, vs, mb}));
      if (vs > 0) CHECK(ran[{false, vs, mb}] > ran[{false, vs - 1, mb}]);
      if (!sc.training) continue;
      REQUIRE(ran.count({true, vs, mb}));
      CHECK(ran[{true, vs, mb}] > (vs == V - 1 ? ran[{false, vs, mb}] : ran[{true, vs + 1, mb}]));
    }
  // Each chunk's reported last backward is the last tick with a backward of it (the DP
  // gradient buckets take its gradients as final after it).
  for (int s = 0; s < P; ++s)
    for (int c = 0; c < v; ++c) {
      int last = -1;
      for (int mb = 0; mb < M && sc.training; ++mb) last = std::max(last, ran[{true, sc.virtual_stage(s, c), mb}]);
      CHECK(sc.last_backward[static_cast<size_t>(s)][static_cast<size_t>(c)] == last);
    }
  // The reported slots hold every micro-batch between its input's arrival and its backward:
  // replay each chunk's occupancy with slot = micro_batch % slots and never overwrite a live one.
  for (int s = 0; s < P; ++s)
    for (int c = 0; c < v; ++c) {
      const int slots = sc.activation_slots[static_cast<size_t>(s)][static_cast<size_t>(c)];
      REQUIRE(slots >= 1);
      std::map<int, int> live;  // slot -> micro-batch
      for (int t = 0; t < sc.num_ticks(); ++t) {
        const PipeTick& k = sc.ticks[static_cast<size_t>(s)][static_cast<size_t>(t)];
        const bool first_stage = sc.virtual_stage(s, c) == 0;
        if (k.op.chunk == c && !k.op.backward && first_stage) {
          CHECK(live.count(k.op.micro_batch % slots) == 0);
          live[k.op.micro_batch % slots] = k.op.micro_batch;
        }
        if (k.op.chunk == c && (k.op.backward || !sc.training)) {
          // forward-only frees the slot after the tick's send; training at its backward
          if (k.op.backward) live.erase(k.op.micro_batch % slots);
        }
        if (k.recv_forward.chunk == c) {
          CHECK(live.count(k.recv_forward.micro_batch % slots) == 0);
          live[k.recv_forward.micro_batch % slots] = k.recv_forward.micro_batch;
        }
        if (!sc.training && k.op.chunk == c) live.erase(k.op.micro_batch % slots);
      }
    }
  return ran;
}

}  // namespace

TEST_CASE("pipeline schedules play out for every size, interleaved or not", "[pipeline_schedule]") {
  for (int P : {1, 2, 3, 4, 5, 8})
    for (int v : {1, 2, 3, 4}) {
      if (P == 1 && v > 1) continue;
      for (int M = 1; M <= 3 * P + 1; ++M)
        for (bool training : {true, false}) {
          INFO("P " << P << " v " << v << " M " << M << (training ? " training" : " forward only"));
          const PipeSchedule sc = pipeline_schedule(P, v, M, training);
          check_schedule(sc);
          // 1F1B's first stage holds pp micro-batches (later stages one more than the
          // trainer's 1F1B loop: here an input lands in its slot a tick before its forward).
          if (training && v == 1) CHECK(sc.activation_slots[0][0] == std::min(P, M));
        }
    }
}

TEST_CASE("interleaving shrinks the pipeline bubble by the number of chunks", "[pipeline_schedule]") {
  // In ticks of one chunk's forward or backward (a stage's 1/v), a training step with M a
  // multiple of P takes 2 M v + 2 (P - 1) ticks: the fill and drain cost 2 (P - 1) chunk
  // ticks, i.e. (P - 1) / v stage times instead of P - 1 (Narayanan et al. 2021).
  for (int P : {2, 4, 8})
    for (int v : {1, 2, 4})
      for (int groups : {1, 2, 3}) {
        const int M = P * groups;
        INFO("P " << P << " v " << v << " M " << M);
        const PipeSchedule sc = pipeline_schedule(P, v, M, true);
        CHECK(sc.num_ticks() == 2 * M * v + 2 * (P - 1));
        for (int s = 0; s < P; ++s) CHECK(sc.busy_ticks(s) == 2 * M * v);
        if (v > 1 && M > P) {
          // Megatron's warm-up on rank 0: (P - 1) * 2 + (v - 1) * P forwards, then the steady
          // state's first forward, before the first backward.
          int warm = 0;
          for (const PipeTick& k : sc.ticks[0]) {
            if (k.op.backward && !k.op.none()) break;
            warm += k.op.none() ? 0 : 1;
          }
          CHECK(warm == (P - 1) * 2 + (v - 1) * P + 1);
        }
      }
  CHECK(pipeline_schedule(4, 2, 8, true).describe() ==
        "interleaved 1F1B: 4 stages x 2 chunks, 8 micro-batches: 38 ticks of 32 ops per rank (6 idle, bubble 16%)");
}

TEST_CASE("micro-batch counts that the stages do not divide keep the bubble and memory of a multiple",
          "[pipeline_schedule]") {
  // Groups of the stage count or more, as even as possible, the larger first.
  CHECK(micro_batch_groups(4, 8) == std::vector<int>{4, 4});
  CHECK(micro_batch_groups(4, 3) == std::vector<int>{3});
  CHECK(micro_batch_groups(4, 9) == std::vector<int>{5, 4});
  CHECK(micro_batch_groups(4, 11) == std::vector<int>{6, 5});
  const std::vector<int> g = micro_batch_groups(12, 512);  // 42 groups: 8 of 13, then 34 of 12
  CHECK(g.size() == 42);
  CHECK((g.front() == 13 && g[7] == 13 && g[8] == 12 && g.back() == 12));
  CHECK(std::accumulate(g.begin(), g.end(), 0) == 512);
  auto slots = [](const PipeSchedule& sc, int s) {
    int n = 0;
    for (int x : sc.activation_slots[static_cast<size_t>(s)]) n += x;
    return n;
  };
  // Megatron's groups of P with a smaller last one stalled here: the warm-up grew until nearly
  // every forward ran first (P=12 v=6 M=512: all 3072 chunk activations in flight, 2 x the
  // ticks' bubble). Now: the ticks of a multiple of P (2 M v + 2 (P - 1)), the warm-up of the
  // first group's size, and on every rank fewer activation slots than twice those of the next
  // multiple of P (the larger groups hold more micro-batches in flight; 1.65x at worst over
  // P <= 16, v <= 8, M <= 100).
  struct Size {
    int P, v, M;
  };
  std::vector<Size> sizes = {{12, 6, 512}, {10, 2, 512}, {8, 4, 66}, {32, 2, 2040}};
  for (int P : {2, 3, 4, 5, 8})
    for (int v : {2, 3, 4})
      for (int M = P + 1; M <= 3 * P + 1; ++M)
        if (M % P != 0) sizes.push_back({P, v, M});
  for (const auto& [P, v, M] : sizes) {
    INFO("P " << P << " v " << v << " M " << M);
    const PipeSchedule sc = pipeline_schedule(P, v, M, true);
    check_schedule(sc);
    CHECK(sc.num_ticks() == 2 * M * v + 2 * (P - 1));
    const int G = micro_batch_groups(P, M).front();
    int warm = 0;
    for (const PipeTick& k : sc.ticks[0]) {
      if (k.op.backward && !k.op.none()) break;
      warm += k.op.none() ? 0 : 1;
    }
    CHECK(warm == std::min(M * v, (P - 1) * 2 + (v - 1) * G + 1));
    const PipeSchedule multiple = pipeline_schedule(P, v, (M / P + 1) * P, true);
    for (int s = 0; s < P; ++s) CHECK(slots(sc, s) < 2 * slots(multiple, s));
  }
}

TEST_CASE("a batch-size ramp-up's smaller steps keep within the whole batch's slots", "[pipeline_schedule]") {
  // 6 micro-batches at P=4 v=2 in one group: rank 0's second chunk holds all 6 at once; the
  // whole batch of 8 (two groups of 4) holds 4 there. The step's capped order holds 4 too.
  const PipeSchedule whole = pipeline_schedule(4, 2, 8, true);
  REQUIRE(whole.activation_slots[0][1] == 4);
  REQUIRE(pipeline_schedule(4, 2, 6, true).activation_slots[0][1] == 6);
  CHECK(pipeline_step_schedule(4, 2, 6, whole.activation_slots).activation_slots[0][1] <= 4);
  // Every step size below the largest: a valid schedule, on every rank's chunk within the
  // largest step's slots, in at most twice pipeline_schedule's ticks (1.8x at worst over P,
  // v <= 16 and largest <= 48); the largest itself, and steps whose schedule fits, unchanged.
  for (int P : {2, 3, 4, 5, 8})
    for (int v : {2, 3, 4})
      for (int largest = P; largest <= 3 * P + 1; ++largest) {
        const PipeSchedule big = pipeline_schedule(P, v, largest, true);
        CHECK(pipeline_step_schedule(P, v, largest, big.activation_slots).ticks.size() == big.ticks.size());
        for (int M = 1; M < largest; ++M) {
          INFO("P " << P << " v " << v << " M " << M << " largest " << largest);
          const PipeSchedule plain = pipeline_schedule(P, v, M, true), step = pipeline_step_schedule(P, v, M, big.activation_slots);
          check_schedule(step);
          bool plain_fits = true;
          for (size_t r = 0; r < size_t(P); ++r)
            for (size_t c = 0; c < size_t(v); ++c) {
              CHECK(step.activation_slots[r][c] <= big.activation_slots[r][c]);
              plain_fits = plain_fits && plain.activation_slots[r][c] <= big.activation_slots[r][c];
            }
          if (plain_fits) CHECK(step.num_ticks() == plain.num_ticks());
          CHECK(step.num_ticks() <= 2 * plain.num_ticks());
        }
      }
  // pipeline_slots, what the trainer allocates: the whole batch's, ramp-up or not.
  CHECK(pipeline_slots(4, 2, {8, 2, 4, 6}).activation == pipeline_slots(4, 2, {8}).activation);
}

TEST_CASE("pipeline schedule arguments are checked", "[pipeline_schedule]") {
  CHECK_THROWS_WITH(pipeline_schedule(0, 1, 4, true), Catch::Contains("must be >= 1"));
  CHECK_THROWS_WITH(pipeline_schedule(2, 0, 4, true), Catch::Contains("must be >= 1"));
  CHECK_THROWS_WITH(pipeline_schedule(2, 2, 0, true), Catch::Contains("must be >= 1"));
}
