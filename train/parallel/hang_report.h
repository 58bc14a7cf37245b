// Hang diagnosis: what every rank was doing when a collective stopped making progress.
//
// MpiComm records each operation it runs (op, group, sequence number, peer, size, start and
// end) in a small per-process ring, OpRecorder: the last 256, a few stores per operation.
// When its watchdog fires (mpi_comm.h), the stuck rank asks its group what they are doing,
// prints one line per stuck operation ("keel hang report: ...") and writes
// <dump dir>/hang-rank<R>.json: its ring, its groups' counters and that diagnosis. It also asks
// every other rank to write theirs; a rank waiting in any keel operation does so at once, a
// rank busy elsewhere cannot (the others' dumps still name it). `keel doctor hang DIR` reads the
// files back and prints the same lines: both sides word them with format_finding().
//
// Nothing here needs MPI: the offline analysis and the tests use it as it is.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/dtype.h"

namespace keel::parallel {

// ---- where dumps go ----------------------------------------------------------------------

// Process-wide dump directory for hang-rank<R>.json. Empty (the default): no files, the
// diagnosis goes to stderr only. KEEL_HANG_DUMP_DIR in the environment, when set and not
// empty, wins over what the program set (so a user can redirect a run's dumps).
void set_hang_dump_directory(const std::string& dir);
std::string hang_dump_directory();
std::string hang_dump_file_name(int world_rank);  // "hang-rank3.json"

// ---- one operation -----------------------------------------------------------------------

enum class OpState : uint8_t { Posted, Completed, Failed };
std::string_view op_state_name(OpState s);  // "posted", "completed", "failed"

// What the ring holds: plain data, static strings, steady-clock times, so that recording
// allocates nothing.
struct OpRecord {
  uint64_t id = 0;          // process-wide operation number (1, 2, ...); 0: empty slot
  const char* op = "";      // "all_reduce", "reduce_scatter", "reduce", "all_gather", "broadcast",
                            // "barrier", "send", "recv", "sendrecv" (static strings)
  const char* group = "";   // "tp", "pp", "dp", "embedding", "world" (static strings)
  int32_t group_index = 0;  // which group of that kind (Grid::group_index)
  int32_t group_rank = 0;   // this rank within it
  int64_t seq = 0;          // collectives: number on the group, 1-based; point to point: 0
  int32_t send_peer = -1, recv_peer = -1;    // point to point: group ranks
  int32_t send_world = -1, recv_world = -1;  // the same peers as world ranks
  int64_t send_seq = 0, recv_seq = 0;        // number of this send to / receive from that peer
  int64_t elements = 0;
  DType dtype = DType::F32;
  OpState state = OpState::Posted;
  int64_t start_ns = 0, end_ns = 0;  // steady clock
};

// The same operation as reports and dumps carry it (strings, wall-clock seconds).
struct OpInfo {
  std::string op, group;
  int group_index = 0, group_rank = 0;
  int64_t seq = 0;
  int send_peer = -1, recv_peer = -1, send_world = -1, recv_world = -1;
  int64_t send_seq = 0, recv_seq = 0;
  int64_t elements = 0;
  std::string dtype = "f32";
  std::string state = "posted";
  double start = 0, end = 0;  // Unix time, seconds; end 0 while not finished

  bool p2p() const { return send_peer >= 0 || recv_peer >= 0; }
  // Same operation of the same group (on any rank): what a stuck rank and a dump agree on.
  bool same_op(const OpInfo& o) const;
};

// The one wording of an operation, everywhere (live diagnosis, dumps, keel doctor hang):
//   "all_reduce #411 of tp group 3"
//   "pp send #412 stage 3 -> 4 (pp group 2)"        (pp ranks are stages; other groups: "rank")
//   "pp recv #7 stage 4 <- 3 (pp group 2)"
//   "pp sendrecv stage 3: send #5 -> 4, recv #6 <- 4 (pp group 2)"
std::string op_title(const OpInfo& op);

OpInfo op_info(const OpRecord& r);  // steady-clock times converted to Unix time
nlohmann::json op_json(const OpInfo& op);
OpInfo op_from_json(const nlohmann::json& j);  // throws std::runtime_error naming the field

// Steady clock (what the ring stores) <-> Unix seconds (what dumps from several hosts share).
int64_t steady_now_ns();
double unix_now();
double steady_ns_to_unix(int64_t ns);

// ---- the per-process ring ----------------------------------------------------------------

class OpRecorder {
 public:
  static constexpr size_t kCapacity = 256;
  // Claims the next slot (overwriting the oldest), numbers it, state Posted, started at
  // start_ns (steady clock); the caller fills the rest. The reference stays valid until
  // kCapacity more operations are posted.
  OpRecord& post(int64_t start_ns);
  // Marks operation `id` finished (no effect when it has been overwritten since).
  void finish(uint64_t id, OpState state);
  std::vector<OpRecord> snapshot() const;        // oldest first, filled slots only
  std::optional<OpRecord> last_completed() const;
  const OpRecord* find(uint64_t id) const;        // nullptr once overwritten
  uint64_t posted() const { return next_id_; }   // operations posted so far
  void clear();                                   // tests

 private:
  std::array<OpRecord, kCapacity> ring_{};
  uint64_t next_id_ = 0;
};

OpRecorder& op_recorder();  // this process's (only the thread that talks to MPI records)

// ---- test-only fault injection ------------------------------------------------------------

// KEEL_FAULT_SKIP_COLLECTIVE="rank=2,op=all_reduce,group=dp,seq=5": world rank 2 silently
// skips (never calls) all_reduce #5 of its dp group, as a rank running different code would;
// the others wait there until the watchdog reports it. call=N instead of seq=N picks the N-th
// call of that collective on the group (robust to how many other collectives a step makes).
// For the hang tests; never set it in a run.
struct CollectiveFault {
  int world_rank = -1;
  std::string op, group;
  int64_t seq = 0;   // collective number on the group, or 0
  int64_t call = 0;  // or: the call-th call of `op` on the group
};
// Parses the variable's value; nullopt for an empty one. Throws std::invalid_argument naming
// the variable and what is wrong.
std::optional<CollectiveFault> parse_collective_fault(const std::string& text);

// ---- findings: one stuck operation -------------------------------------------------------

// A member that has not arrived at the operation (or called a different one at that point, or
// came only after the others had timed out).
struct MissingRank {
  int world_rank = -1;
  bool answered = true;                 // false: no answer and no dump (busy outside keel, or dead)
  bool mismatch = false;                // it is in a different operation at this very point
  // Waiting in an earlier collective of the same group: held up there (on its way), not the one
  // that is missing. Overlapped reductions put several collectives of a group in flight.
  bool behind = false;
  // > 0: it did arrive, this many seconds after the first waiter and after that waiter's watchdog
  // had fired. A rank that was stopped or starved (kill -STOP, swapping) wakes when the job is
  // aborted, walks into the operation and answers the dump request, so its dump alone looks on time.
  double late_seconds = 0;
  std::optional<OpInfo> slow_in;         // late: the operation before, when most of the delay was spent in it
  std::optional<OpInfo> last_completed;  // its last completed operation, when known
  std::optional<OpInfo> waiting_in;      // the keel operation it waits in now, when it does
};

struct HangFinding {
  OpInfo op;                    // the stuck operation (as the stuck rank recorded it)
  std::vector<int> members;     // world ranks taking part (the group, or the two p2p ends)
  std::vector<int> waiting;     // world ranks stuck in it
  std::vector<MissingRank> missing;
  double stuck_seconds = 0;     // longest wait among the stuck ranks
};

// "reduce_scatter #7 of dp group 0 [world ranks 0, 1, 2, 3]: world rank 2 never arrived; it
//  last completed all_reduce #6 of dp group 0 and is now waiting in all_reduce #3 of world
//  group 0 (stuck 3.0 s, 3 of 4 ranks waiting)". with_time = false leaves out the parenthesis
// (the part that differs between the live report and the dumps). Ranks that are only behind
// come last, after the ones the operation really waits for.
std::string format_finding(const HangFinding& f, bool with_time = true);

// Orders findings: the most-arrived operation first (its missing ranks are the likeliest
// culprits), then the longest stuck, then by operation and rank, so that ties always come out
// the same way.
void sort_findings(std::vector<HangFinding>& findings);

// ---- host calls that block without returning control ----------------------------------------

// The watchdog works by polling while a rank waits. Some host calls wait inside themselves and
// cannot be polled: NCCL's communicator setup (ncclCommInitRank waits for every rank of the
// group) and the connection NCCL sets up inside the first operation between two ranks (lazy
// connect). While a BlockingCallWatch lives, a helper thread of the process (it looks every
// 50 ms) watches the call: if it has not returned after timeout_s, the thread prints one
// "keel hang report: <who>: <call> for <op> ..." line and what usually causes it, then ends the
// process with exit code 1, so that mpirun or srun end the job instead of leaving it hanging.
// Arming and disarming are a few atomic stores (it guards every NCCL operation): `who` and `op`
// are referenced, not copied, and must not change while the watch lives; the text is made only
// when the watch fires. One watch at a time (the thread that talks to the communicators).
class BlockingCallWatch {
 public:
  BlockingCallWatch(const char* call, const std::string& op, const std::string& who, double timeout_s);
  ~BlockingCallWatch();
  BlockingCallWatch(const BlockingCallWatch&) = delete;
  BlockingCallWatch& operator=(const BlockingCallWatch&) = delete;
};

// ---- the offline report ------------------------------------------------------------------

struct HangDumps {
  std::string dir;
  std::vector<nlohmann::json> dumps;  // one per rank, of the newest job
  std::vector<std::string> notes;     // unreadable files, dumps of older jobs left out, ...
};
// Reads every hang-rank*.json of `dir` (or of dir/hang when dir is a run directory). Throws
// std::runtime_error when there is none.
HangDumps read_hang_dumps(const std::string& dir);

// analyze_hang follows wait chains: a missing rank that waits in another stuck operation (or is
// behind in its own group) is a victim, and the operations it waits in are followed until a
// missing rank that is silent, waits nowhere, is late, or is in a different operation. Those
// operations come first, the one most ranks wait on (directly or through others) at the head;
// sort_findings breaks the remaining ties.
struct HangAnalysis {
  std::vector<HangFinding> findings;  // the headline first (see above)
  std::vector<std::string> rank_lines;  // one per world rank: what it was doing, from its dump or the others'
  std::vector<std::string> notes;
  int world_size = 0;
  double timeout = 0;
};
HangAnalysis analyze_hang(const std::vector<nlohmann::json>& dumps);
// The whole text `keel doctor hang` prints: "hang: <finding>", "also stuck: <finding>", then
// the ranks, then notes.
std::string format_hang_analysis(const HangAnalysis& a, const HangDumps& source);

}  // namespace keel::parallel
