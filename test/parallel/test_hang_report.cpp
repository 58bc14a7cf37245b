// Hang diagnosis without MPI (train/parallel/hang_report.h): the wording of operations, the
// ring, the fault-injection spec, and the offline report built from hand-made dumps (the
// multi-rank tests in test/parallel/mpi make real ones).
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "common/temp_dir.h"
#include "train/parallel/hang_report.h"

using namespace keel;
using namespace keel::parallel;
using nlohmann::json;

namespace {

OpInfo collective(const std::string& op, const std::string& group, int index, int64_t seq, double start = 100) {
  OpInfo o;
  o.op = op;
  o.group = group;
  o.group_index = index;
  o.seq = seq;
  o.start = start;
  o.state = "completed";
  o.end = start + 0.01;
  return o;
}

OpInfo send(int group_index, int stage, int to_stage, int to_world, int64_t n, double start = 100) {
  OpInfo o;
  o.op = "send";
  o.group = "pp";
  o.group_index = group_index;
  o.group_rank = stage;
  o.send_peer = to_stage;
  o.send_world = to_world;
  o.send_seq = n;
  o.start = start;
  return o;
}

OpInfo posted(OpInfo o) {
  o.state = "posted";
  o.end = 0;
  return o;
}

json group(const std::string& name, int index, int rank, std::vector<int> members, int64_t collectives,
           std::vector<int64_t> sends_to = {}, std::vector<int64_t> recvs_from = {}) {
  if (sends_to.empty()) sends_to.assign(members.size(), 0);
  if (recvs_from.empty()) recvs_from.assign(members.size(), 0);
  return {{"group", name},          {"index", index},       {"rank", rank},
          {"members", members},     {"collectives", collectives}, {"sends_to", sends_to},
          {"recvs_from", recvs_from}};
}

json dump(int rank, int world, const std::vector<OpInfo>& ops, const json& groups, const std::string& reason = "asked",
          double dumped_at = 105, const std::string& job = "job-1") {
  json j = {{"format", "keel-hang-dump"}, {"version", 1},       {"job", job},          {"world_rank", rank},
            {"world_size", world},        {"host", "node" + std::to_string(rank / 8)}, {"pid", 1000 + rank},
            {"reason", reason},           {"dumped_at", dumped_at}, {"timeout_s", 5.0}, {"groups", groups}};
  if (reason == "asked") j["asked_by"] = 12;
  json arr = json::array();
  std::optional<OpInfo> waiting, done;
  for (const OpInfo& o : ops) {
    arr.push_back(op_json(o));
    if (o.state == "posted") waiting = o;
    if (o.state == "completed") done = o;
  }
  j["ops"] = arr;
  j["waiting"] = waiting ? op_json(*waiting) : json();
  j["last_completed"] = done ? op_json(*done) : json();
  return j;
}

}  // namespace

TEST_CASE("hang report: one wording for every kind of operation", "[parallel][hang]") {
  CHECK(op_title(collective("all_reduce", "tp", 3, 411)) == "all_reduce #411 of tp group 3");
  CHECK(op_title(send(2, 3, 4, 16, 412)) == "pp send #412 stage 3 -> 4 (pp group 2)");
  OpInfo recv;
  recv.op = "recv";
  recv.group = "tp";
  recv.group_rank = 1;
  recv.recv_peer = 0;
  recv.recv_seq = 7;
  CHECK(op_title(recv) == "tp recv #7 rank 1 <- 0 (tp group 0)");
  OpInfo both = send(2, 3, 4, 16, 5);
  both.op = "sendrecv";
  both.recv_peer = 4;
  both.recv_world = 16;
  both.recv_seq = 6;
  CHECK(op_title(both) == "pp sendrecv stage 3: send #5 -> 4, recv #6 <- 4 (pp group 2)");
  // Round trip through the dump format.
  const OpInfo back = op_from_json(op_json(both));
  CHECK(back.same_op(both));
  CHECK(op_title(back) == op_title(both));
}

TEST_CASE("hang report: the ring keeps the last 256 operations and finishes only live entries", "[parallel][hang]") {
  OpRecorder rec;
  uint64_t first_id = 0;
  for (int i = 0; i < 300; ++i) {
    OpRecord& r = rec.post(1000 + i);
    r.op = "all_reduce";
    r.group = "dp";
    r.seq = i + 1;
    if (i == 0) first_id = r.id;
    if (i < 299) rec.finish(r.id, OpState::Completed);
  }
  const auto snap = rec.snapshot();
  REQUIRE(snap.size() == OpRecorder::kCapacity);
  CHECK(snap.front().seq == 300 - 256 + 1);
  CHECK(snap.back().seq == 300);
  CHECK(snap.back().state == OpState::Posted);
  REQUIRE(rec.last_completed());
  CHECK(rec.last_completed()->seq == 299);
  CHECK(rec.find(first_id) == nullptr);  // overwritten
  rec.finish(first_id, OpState::Failed);  // no effect on the slot's new owner (operation 257)
  REQUIRE(rec.find(first_id + OpRecorder::kCapacity) != nullptr);
  CHECK(rec.find(first_id + OpRecorder::kCapacity)->state == OpState::Completed);
}

TEST_CASE("hang report: KEEL_FAULT_SKIP_COLLECTIVE is parsed strictly", "[parallel][hang]") {
  auto f = parse_collective_fault("rank=2,op=all_reduce,group=dp,seq=5");
  REQUIRE(f);
  CHECK(f->world_rank == 2);
  CHECK(f->op == "all_reduce");
  CHECK(f->group == "dp");
  CHECK(f->seq == 5);
  CHECK(parse_collective_fault("rank=0,op=reduce_scatter,group=dp,call=2")->call == 2);
  CHECK_FALSE(parse_collective_fault(""));
  CHECK_THROWS_WITH(parse_collective_fault("rank=2,op=all_reduce,group=dp"),
                    Catch::Contains("needs rank, op, group, and one of seq or call"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=2,op=send,group=pp,seq=1"), Catch::Contains("op must be a collective"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=x,op=all_reduce,group=dp,seq=1"), Catch::Contains("rank must be an integer"));
  CHECK_THROWS_WITH(parse_collective_fault("rank=1,colour=red"), Catch::Contains("unknown key \"colour\""));
}

TEST_CASE("hang report: a pipeline send whose receiver never posted it, as the issue words it", "[parallel][hang]") {
  // World rank 12 (stage 3 of pp group 2) waits in its send #412 to stage 4 (world rank 16); rank
  // 16 has received 411 messages from stage 3 and is stuck in a TP all-reduce instead.
  std::vector<int> pp_members = {0, 4, 8, 12, 16};
  const json d12 = dump(12, 20, {collective("all_reduce", "tp", 3, 900), posted(send(2, 3, 4, 16, 412, 100))},
                        json::array({group("pp", 2, 3, pp_members, 0, {0, 0, 0, 0, 412}, {0, 0, 411, 0, 0})}), "timeout", 105);
  const json d16 = dump(16, 20, {collective("all_reduce", "tp", 4, 411), posted(collective("all_reduce", "tp", 4, 412, 101))},
                        json::array({group("pp", 2, 4, pp_members, 0, {0, 0, 0, 0, 0}, {0, 0, 0, 411, 0})}), "asked", 105);
  const HangAnalysis a = analyze_hang({d12, d16});
  REQUIRE(!a.findings.empty());
  CHECK(format_finding(a.findings[0]) ==
        "pp send #412 stage 3 -> 4 (pp group 2) [world ranks 12, 16]: world rank 16 never arrived; it last completed "
        "all_reduce #411 of tp group 4 and is now waiting in all_reduce #412 of tp group 4 (stuck 5.0 s, 1 of 2 ranks "
        "waiting)");
  CHECK(a.world_size == 20);
  CHECK(a.timeout == 5.0);
  CHECK(a.rank_lines[16].find("world rank 16 (host node2, pid 1016): waiting in all_reduce #412 of tp group 4") == 0);
  CHECK(a.rank_lines[3] == "world rank 3: no dump; nobody asked it (it was in no stuck operation's group) or it was "
                           "killed before writing");
}

TEST_CASE("hang report: ranks with no dump are named from the stuck rank's answers", "[parallel][hang]") {
  // dp group 0 = world ranks 0-3; rank 0 timed out in all_reduce #9. Rank 1 answered (it is in
  // a tp all-reduce, 8 dp collectives started) but left no dump; rank 2 never answered; rank 3
  // got past #9 (10 started).
  json d0 = dump(0, 4, {collective("all_reduce", "dp", 0, 8), posted(collective("all_reduce", "dp", 0, 9))},
                 json::array({group("dp", 0, 0, {0, 1, 2, 3}, 9)}), "timeout");
  d0["diagnosis"] = {
      {"findings", json::array()},
      {"peers",
       {{{"world_rank", 1}, {"answered", true}, {"collectives", 8},
         {"waiting", op_json(posted(collective("all_reduce", "tp", 0, 77)))},
         {"last_completed", op_json(collective("all_reduce", "dp", 0, 8))}},
        {{"world_rank", 2}, {"answered", false}},
        {{"world_rank", 3}, {"answered", true}, {"collectives", 10}, {"waiting", nullptr}, {"last_completed", nullptr}}}}};
  const HangAnalysis a = analyze_hang({d0});
  REQUIRE(a.findings.size() == 1);
  CHECK(format_finding(a.findings[0], false) ==
        "all_reduce #9 of dp group 0 [world ranks 0-3]: world rank 1 never arrived; it last completed all_reduce #8 of dp "
        "group 0 and is now waiting in all_reduce #77 of tp group 0; world rank 2 never arrived and gave no answer (busy "
        "outside keel's communication: computing, hung in other code, or dead)");
  CHECK(a.rank_lines[2] == "world rank 2: no dump and no answer to world rank 0: busy outside keel's communication "
                           "(computing, hung in other code) or dead");
}

TEST_CASE("hang report: dumps are read from a run directory, older jobs and broken files are left out",
          "[parallel][hang]") {
  test::TempDir dir("hang-dumps");
  std::filesystem::create_directories(dir / "hang");
  std::ofstream(dir / "hang/hang-rank0.json")
      << dump(0, 2, {posted(collective("barrier", "world", 0, 1))}, json::array({group("world", 0, 0, {0, 1}, 1)}), "timeout", 200).dump();
  std::ofstream(dir / "hang/hang-rank1.json")
      << dump(1, 2, {posted(collective("barrier", "world", 0, 1))}, json::array({group("world", 0, 1, {0, 1}, 1)}), "asked", 50, "old").dump();
  std::ofstream(dir / "hang/hang-rank2.json") << "{ not json";
  const HangDumps d = read_hang_dumps(dir.path.string());
  CHECK(d.dir == dir / "hang");
  REQUIRE(d.dumps.size() == 1);
  CHECK(d.dumps[0]["world_rank"] == 0);
  REQUIRE(d.notes.size() == 2);
  CHECK(d.notes[0].find("hang-rank2.json cannot be read") == 0);
  CHECK(d.notes[1] == "1 dump(s) of an earlier job (not job-1) left out");
  const std::string text = format_hang_analysis(analyze_hang(d.dumps), d);
  CHECK(text.find("hang: barrier #1 of world group 0 [world ranks 0, 1]: world rank 1 never arrived and gave no answer") !=
        std::string::npos);
  CHECK_THROWS_WITH(read_hang_dumps(dir / "nothing"), Catch::Contains("is not a directory"));
}

// ---- BlockingCallWatch: in a child process, since a firing watch ends the process ----------

namespace {

struct ChildResult {
  int exit_code = -1;
  std::string stderr_text;
  double seconds = 0;
};

// Runs body() in a forked child with stderr captured; the child exits 0 if body returns.
ChildResult run_child(const std::function<void()>& body) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    body();
    _exit(0);
  }
  close(fds[1]);
  ChildResult r;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) r.stderr_text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

}  // namespace

TEST_CASE("a host call stuck past its timeout is named, and the process ends instead of hanging",
          "[parallel][hang][watch]") {
  const ChildResult stuck = run_child([] {
    const std::string op = "communicator setup", who = "world rank 3, NCCL group tp (nccl rank 1 of 2)";
    BlockingCallWatch watch("ncclCommInitRank", op, who, 0.3);
    std::this_thread::sleep_for(std::chrono::seconds(20));  // a call that never returns
  });
  INFO(stuck.stderr_text);
  CHECK(stuck.exit_code == 1);
  CHECK(stuck.seconds < 10);
  CHECK_THAT(stuck.stderr_text, Catch::Contains("keel hang report: world rank 3, NCCL group tp (nccl rank 1 of 2): "
                                                "ncclCommInitRank for communicator setup has not returned after 0.3 s") &&
                                    Catch::Contains("Ending this process"));
}

TEST_CASE("host calls that return in time never fire the watch, however long the process runs after",
          "[parallel][hang][watch]") {
  const ChildResult fine = run_child([] {
    for (int call = 0; call < 3; ++call) {
      {
        const std::string op = "all_reduce #" + std::to_string(call), who = "world rank 0";
        BlockingCallWatch watch("ncclAllReduce", op, who, 0.3);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // well past the timeout, unwatched
    }
  });
  INFO(fine.stderr_text);
  CHECK(fine.exit_code == 0);
  CHECK(fine.stderr_text.find("hang report") == std::string::npos);
}
