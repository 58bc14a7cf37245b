// The interleaved pipeline schedule (Narayanan et al. 2021, "Efficient Large-Scale Language
// Model Training on GPU Clusters"; Megatron's virtual pipeline stages).
//
// With `chunks` = v model chunks per rank, the layers are cut into P * v virtual stages and rank
// s holds virtual stages s, s + P, ..., s + (v - 1) P. A micro-batch goes round the ring of
// ranks v times, so the warm-up and drain of the pipeline take 1/v of the time they take with
// one chunk: the bubble shrinks from (P - 1) / M to (P - 1) / (v M) of the step, for v times the
// point-to-point messages.
//
// The schedule is a pure function of (P, v, M, training), computed alike on every rank:
// - each rank's order of work is Megatron's: micro-batches in groups of P, a group's forwards
//   through chunk 0, then chunk 1, ..., backwards through the chunks in reverse; a warm-up of
//   (P - s - 1) * 2 + (v - 1) * P forwards (all of them when M == P), then one forward and one
//   backward alternately, then the remaining backwards. (One chunk: classic 1F1B, a warm-up of
//   P - s - 1.)
// - M not a multiple of P (Megatron refuses it): the groups are made as even as possible and
//   none smaller than P (micro_batch_groups), and the warm-up counts the first group's size G in
//   place of P. A group smaller than P would leave each chunk's next forward waiting for its
//   input to come round the ring: bubbles, and with 1F1B's strict alternation a stall that only
//   a far longer warm-up (up to every forward first: all of the step's activations at once)
//   resolves. With groups of P or more the step takes the 2 M v + 2 (P - 1) ticks of a multiple
//   of P, and the activations in flight grow with G (< 2 P) instead of with M.
// - every chunk runs its micro-batches' forwards, and their backwards, in micro-batch order
//   whatever the grouping, so gradients accumulate in the same order: the same bits.
// - that order is played out in lockstep ticks: in a tick every rank runs its next op if the op's
//   input has arrived, then every rank exchanges what the tick produced with its two
//   neighbours, in one batch of sends and receives (Comm::exchange). Every message is sent and
//   received in the same tick, so the exchange cannot deadlock whatever the message sizes or the
//   transport's buffering.
// The simulation also yields how many micro-batches each chunk holds at once (its activation
// slots) and how many received output gradients wait for their backward (gradient slots).
#pragma once

#include <string>
#include <vector>

namespace keel {

struct PipeOp {
  bool backward = false;
  int chunk = -1;  // -1: none (an idle tick, or no message)
  int micro_batch = -1;
  bool none() const { return chunk < 0; }
};

struct PipeTick {
  PipeOp op;                   // this rank's compute
  bool send_forward = false;   // op's output goes to the next rank (rank + 1, ring)
  bool send_backward = false;  // op's input gradient goes to the previous rank
  PipeOp recv_forward;         // the input of (chunk, micro-batch) arrives from the previous rank
  PipeOp recv_backward;        // the output gradient of (chunk, micro-batch) arrives from the next rank
};

struct PipeSchedule {
  int stages = 1, chunks = 1, micro_batches = 0;
  bool training = true;
  std::vector<std::vector<PipeTick>> ticks;  // [rank][tick]: every rank has the same number of ticks
  // [rank][chunk]: the most micro-batches whose activations the chunk keeps at once (from the
  // exchange that delivers the input, or the forward on the first virtual stage, until the
  // backward; until the send when not training), and the most received output gradients that
  // wait for their backward. Slot of a micro-batch: micro_batch % count (both are filled and
  // emptied in micro-batch order, so that slot is always free).
  std::vector<std::vector<int>> activation_slots, gradient_slots;
  // [rank][chunk]: the tick of the chunk's last backward, after which its gradients are final
  // for the step (-1: none, when not training).
  std::vector<std::vector<int>> last_backward;

  int virtual_stage(int rank, int chunk) const { return chunk * stages + rank; }
  int num_ticks() const { return ticks.empty() ? 0 : static_cast<int>(ticks[0].size()); }
  int busy_ticks(int rank) const;  // ticks in which the rank computes
  std::string describe() const;    // "interleaved 1F1B: 4 stages x 2 chunks, 8 micro-batches, 40 ticks ..."
};

// Throws std::invalid_argument for stages, chunks or micro_batches < 1. Any number of
// micro-batches plays out (see above for M not a multiple of P).
PipeSchedule pipeline_schedule(int stages, int chunks, int micro_batches, bool training);

// A training step of M micro-batches within `cap` ([rank][chunk] activation slots: those of the
// run's largest step, for a batch-size ramp-up's smaller steps; empty: no cap):
// pipeline_schedule's, unless that keeps more micro-batches in flight on some rank's chunk
// (fewer, larger groups; or, below P micro-batches, every forward first). Then a greedy order
// within the cap: groups of P (the last smaller), and each tick a rank runs its next backward if
// its input is there, else its next forward if its input is there and the slots it fills are
// free. Each chunk still runs its micro-batches in order (the same bits); the price is ticks
// (1.1x pipeline_schedule's at the median, 1.8x at worst, over P, v <= 16 and step sizes below
// a largest <= 48), on the ramp-up's steps only, instead of memory for the whole run.
PipeSchedule pipeline_step_schedule(int stages, int chunks, int micro_batches,
                                    const std::vector<std::vector<int>>& cap);

// What a run's interleaved schedules need of each rank's chunks, [rank][chunk]: the most
// activation and gradient slots over training steps of each of `training_counts` micro-batches
// (pipeline_step_schedule: a batch-size ramp-up has several sizes, held within the largest's
// activation slots) and forward-only passes of 1 to `stages` (evaluation runs `stages` at a
// time, the last pass fewer). The trainer allocates these; keel plan counts them.
struct PipeSlots {
  std::vector<std::vector<int>> activation, gradient;
};
PipeSlots pipeline_slots(int stages, int chunks, const std::vector<int>& training_counts);

// The sizes of the groups of micro-batches the interleaved order takes in turn: M / P groups of
// P when P divides M, else of M / (M / P) and one more (the larger first); one group when M <= P.
std::vector<int> micro_batch_groups(int stages, int micro_batches);

}  // namespace keel
