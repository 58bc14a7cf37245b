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
// micro-batches plays out: when a last, smaller group stalls Megatron's warm-up (it assumes M is
// a multiple of P), every rank's warm-up is lengthened until the schedule plays out.
PipeSchedule pipeline_schedule(int stages, int chunks, int micro_batches, bool training);

}  // namespace keel
