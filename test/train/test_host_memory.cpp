// Host memory on the CPU backend (train/host_memory.h): the least of MemAvailable and the
// process's cgroup limits, read from fake /proc and /sys/fs/cgroup trees, and the start-up
// check with its override.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/run_config.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "train/host_memory.h"
#include "model/param_table.h"
#include "train/plan.h"

using namespace keel;
namespace fs = std::filesystem;

namespace {

constexpr double GiB = 1024.0 * 1024 * 1024;

// A fake machine: proc/ and cgroup/ under a temp dir, written a file at a time.
struct FakeHost {
  test::TempDir dir{"host-memory"};
  fs::path proc = dir.path / "proc", cgroup = dir.path / "cgroup";
  FakeHost() {
    fs::create_directories(proc / "self");
    fs::create_directories(cgroup);
  }
  void write(const fs::path& file, const std::string& text) const {
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }
  void mem_available(double bytes) const {
    write(proc / "meminfo", "MemTotal:       65536000 kB\nMemFree:         1000 kB\nMemAvailable:   " +
                                std::to_string(static_cast<long long>(bytes / 1024)) + " kB\n");
  }
  HostMemory read() const { return host_memory(proc, cgroup); }
};

std::string bytes(double b) { return std::to_string(static_cast<long long>(b)); }

}  // namespace

TEST_CASE("host_memory: MemAvailable, or the tightest cgroup v2 limit along the process's cgroup", "[memory][cgroup]") {
  FakeHost h;
  h.mem_available(16 * GiB);
  h.write(h.proc / "self/cgroup", "0::/slurm/job_7/step_0\n");
  h.write(h.cgroup / "cgroup.controllers", "cpu memory\n");  // only v2 on this host
  const fs::path job = h.cgroup / "slurm/job_7", step = job / "step_0";

  SECTION("no limit anywhere: MemAvailable") {
    h.write(job / "memory.max", "max\n");
    h.write(job / "memory.current", bytes(3 * GiB));
    const HostMemory m = h.read();
    CHECK(m.available == 16 * GiB);
    CHECK(m.source == "MemAvailable in " + (h.proc / "meminfo").string());
  }
  SECTION("the job's limit less its use, the inactive page cache not counted as used") {
    h.write(job / "memory.max", bytes(8 * GiB) + "\n");
    h.write(job / "memory.current", bytes(3 * GiB) + "\n");
    h.write(job / "memory.stat", "anon 1073741824\nfile 2147483648\ninactive_file " + bytes(1 * GiB) + "\n");
    h.write(step / "memory.max", "max\n");
    h.write(step / "memory.current", bytes(1 * GiB) + "\n");
    const HostMemory m = h.read();
    CHECK(m.available == 6 * GiB);
    CHECK(m.source == "the cgroup v2 limit of " + job.string() + ": memory.max " + plan::format_bytes(8 * GiB) +
                          " less " + plan::format_bytes(2 * GiB) + " in use");
    // A tighter limit further down (the step's) is the one that applies.
    h.write(step / "memory.max", bytes(1.5 * GiB) + "\n");
    CHECK(h.read().available == 0.5 * GiB);
    CHECK(h.read().source.rfind("the cgroup v2 limit of " + step.string() + ": ", 0) == 0);
    // And MemAvailable when the host has less than every limit leaves.
    h.mem_available(0.25 * GiB);
    CHECK(h.read().available == 0.25 * GiB);
  }
  SECTION("a cgroup already over its limit has nothing left, which is not 'unknown'") {
    h.write(job / "memory.max", bytes(1 * GiB));
    h.write(job / "memory.current", bytes(1.2 * GiB));
    CHECK(h.read().available == 0);
  }
}

TEST_CASE("host_memory: cgroup v1 limits, unlimited ones ignored, containers and hybrid hosts", "[memory][cgroup]") {
  FakeHost h;
  h.mem_available(16 * GiB);
  const fs::path memory = h.cgroup / "memory";

  SECTION("a container: the host's path in /proc/self/cgroup, its own cgroup at the mount's root") {
    h.write(h.proc / "self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n");
    h.write(memory / "memory.limit_in_bytes", bytes(4 * GiB) + "\n");
    h.write(memory / "memory.usage_in_bytes", bytes(2 * GiB) + "\n");
    h.write(memory / "memory.stat", "cache 1073741824\ninactive_file 9\ntotal_inactive_file " + bytes(0.5 * GiB) + "\n");
    const HostMemory m = h.read();
    CHECK(m.available == 2.5 * GiB);
    CHECK(m.source == "the cgroup v1 limit of " + memory.string() + ": memory.limit_in_bytes " +
                          plan::format_bytes(4 * GiB) + " less " + plan::format_bytes(1.5 * GiB) + " in use");
  }
  SECTION("the kernel's 'unlimited' (about 2^63) is no limit") {
    h.write(h.proc / "self/cgroup", "4:memory:/user.slice\n");
    h.write(memory / "user.slice/memory.limit_in_bytes", "9223372036854771712\n");
    h.write(memory / "user.slice/memory.usage_in_bytes", bytes(2 * GiB));
    h.write(memory / "memory.limit_in_bytes", "9223372036854771712\n");
    h.write(memory / "memory.usage_in_bytes", bytes(9 * GiB));
    CHECK(h.read().available == 16 * GiB);
  }
  SECTION("hybrid: v2 without the memory controller beside v1's memory hierarchy, listed with others") {
    h.write(h.proc / "self/cgroup", "0::/job\n3:cpu,memory:/job\n");
    h.write(h.cgroup / "unified/cgroup.controllers", "\n");
    h.write(h.cgroup / "unified/job/memory.current", bytes(5 * GiB));  // no memory.max: no limit
    h.write(memory / "job/memory.limit_in_bytes", bytes(3 * GiB));
    h.write(memory / "job/memory.usage_in_bytes", bytes(1 * GiB));
    const HostMemory m = h.read();
    CHECK(m.available == 2 * GiB);
    CHECK(m.source.rfind("the cgroup v1 limit of " + (memory / "job").string() + ": ", 0) == 0);
  }
  SECTION("nothing readable: unknown") {
    fs::remove(h.proc / "meminfo");
    CHECK(h.read().available < 0);
  }
}

TEST_CASE("check_host_memory: refused naming the limit and the override, or a warning under \"warn\"",
          "[memory][cgroup][config]") {
  RunConfig cfg = test::make_config(test::tiny_run_json());
  const double needs = plan::planned_backend_bytes(cfg, 0, false);
  REQUIRE(needs > 64 * 1024);
  const MemoryLimit job{64 * 1024, "the cgroup v2 limit of /sys/fs/cgroup/job: memory.max 9 MiB less 8 MiB in use",
                        "/sys/fs/cgroup/job"};
  const MemoryLimit host{2 * needs, "MemAvailable in /proc/meminfo", "meminfo"};
  const HostMemory small{job.available, job.source, {host, job}};
  CHECK_THROWS_AS(check_host_memory(cfg, small), ConfigError);
  CHECK_THROWS_WITH(check_host_memory(cfg, small, {2, 2}),
                    Catch::StartsWith("the run needs about " + plan::format_bytes(2 * needs) +
                                      " of host memory for its 2 ranks under this limit on this host (up to " +
                                      plan::format_bytes(needs) + " each)") &&
                        Catch::Contains("but the host has 64.0 KiB available (" + job.source + ")") &&
                        Catch::EndsWith("--set health.host_memory_check=warn starts it with a warning"));
  CHECK(check_host_memory(cfg, {host.available, host.source, {host}}).empty());
  CHECK(check_host_memory(cfg, {host.available, host.source, {host}}, {2}).empty());  // exactly enough
  CHECK_THROWS_WITH(check_host_memory(cfg, {host.available, host.source, {host}}, {3}),
                    Catch::Contains("for its 3 ranks under this limit") && Catch::Contains("(MemAvailable in /proc/meminfo)"));
  CHECK(check_host_memory(cfg, {}).empty());  // nothing known of the host
  // Where a rank's share is at least 1 MiB, keel plan is pointed at it: here half what a run with
  // a larger vocabulary needs.
  const RunConfig wide = test::make_config(test::tiny_run_json(), {{"model", {{"vocab_size", 8192}}}});
  const double wide_needs = plan::planned_backend_bytes(wide, 0, false);
  REQUIRE(wide_needs >= 2 << 20);
  const MemoryLimit tight{wide_needs, "MemAvailable in /proc/meminfo", "meminfo"};
  const std::string share = std::to_string(static_cast<int64_t>(wide_needs / 2 / (1 << 20))) + "MiB";
  CHECK_THROWS_WITH(check_host_memory(wide, {tight.available, tight.source, {tight}}, {2}),
                    Catch::Contains("; keel plan --config test.json --cpu --gpus 1 --gpu-mem " + share +
                                    " --headroom 0 (with this run's --set options) lists the layouts"));
  CHECK_THROWS_WITH(check_host_memory(cfg, small), !Catch::Contains("keel plan --config"));  // 64 KiB: no plan fits
  cfg = test::make_config(test::tiny_run_json(), {{"health", {{"host_memory_check", "warn"}}}});
  const std::string warning = check_host_memory(cfg, small);
  CHECK_THAT(warning, Catch::Contains("available (" + small.source + ")") &&
                          Catch::EndsWith("; starting anyway, as health.host_memory_check is \"warn\""));
  CHECK_THROWS_WITH(test::make_config(test::tiny_run_json(), {{"health", {{"host_memory_check", "off"}}}}),
                    Catch::Contains("health.host_memory_check: \"off\" is not allowed (allowed: error, warn)"));
}

// A background save copies the rank's weights, masters and moments to host memory while its files
// are written (checkpoint.async, which both BLOOM configs set): on the CPU that is the same memory
// the run trains in, so a run that fits only without the copy would be killed at its first save.
TEST_CASE("check_host_memory counts the host copy of a background save (checkpoint.async)", "[memory][config]") {
  const nlohmann::json bf16 = {{"precision", {{"mode", "bf16"}}}};
  const RunConfig plain = test::make_config(test::tiny_run_json(), bf16);
  const RunConfig async =
      test::make_config(test::tiny_run_json(), {{"precision", {{"mode", "bf16"}}}, {"checkpoint", {{"async", true}}}});
  const double needs = plan::planned_backend_bytes(plain, 0, false);
  const double copy = plan::async_save_host_bytes(async, 0);
  CHECK(plan::async_save_host_bytes(plain, 0) == 0);
  CHECK(plan::planned_backend_bytes(async, 0, false) == needs);
  // weights (bf16) + fp32 masters + Adam m and v: 14 of the 18 bytes per parameter.
  const ParamTable table(plain.model);
  CHECK(copy == Approx(14.0 * static_cast<double>(table.local_numel())));
  const MemoryLimit host{needs + copy / 2, "MemAvailable in /proc/meminfo", "meminfo"};
  const HostMemory mem{host.available, host.source, {host}};
  CHECK(check_host_memory(plain, mem).empty());
  CHECK_THROWS_WITH(check_host_memory(async, mem),
                    Catch::StartsWith("the run needs about " + plan::format_bytes(needs + copy) + " of host memory") &&
                        Catch::Contains("and the " + plan::format_bytes(copy) +
                                        " host copy a background save (checkpoint.async) writes from"));
}

// Ranks on one node: a limit they share (the node's MemAvailable, the job's cgroup) must hold
// all of them; a Slurm per-task cgroup holds its own rank only. Told apart by host and cgroup path.
TEST_CASE("host memory over ranks: a shared limit counts every rank under it, a per-task cgroup its own",
          "[memory][cgroup]") {
  const RunConfig cfg = test::make_config(test::tiny_run_json());
  const double needs = plan::planned_backend_bytes(cfg, 0, false);
  FakeHost h;
  h.mem_available(16 * GiB);
  h.write(h.cgroup / "cgroup.controllers", "cpu memory\n");
  const fs::path job = h.cgroup / "slurm/job_7";
  for (const char* task : {"task_0", "task_1"}) {
    h.write(job / "step_0" / task / "memory.max", bytes(1.5 * needs) + "\n");  // room for one rank each
    h.write(job / "step_0" / task / "memory.current", "0\n");
  }
  h.write(job / "memory.current", "0\n");
  // The second rank on the node: another /proc/self/cgroup, the same cgroup tree.
  const fs::path proc1 = h.dir.path / "proc1";
  h.write(proc1 / "meminfo", test::read_file(h.proc / "meminfo"));
  h.write(h.proc / "self/cgroup", "0::/slurm/job_7/step_0/task_0\n");
  h.write(proc1 / "self/cgroup", "0::/slurm/job_7/step_0/task_1\n");

  SECTION("the job's cgroup holds both ranks: refused only when it cannot") {
    h.write(job / "memory.max", bytes(1.5 * needs) + "\n");
    const HostMemory rank0 = h.read(), rank1 = host_memory(proc1, h.cgroup);
    REQUIRE(rank0.limits.size() == 3);  // MemAvailable, task_0, the job
    const std::vector<std::string> ids = {memory_limit_ids(rank0, "node1"), memory_limit_ids(rank1, "node1")};
    CHECK(ranks_sharing(rank0, "node1", ids) == std::vector<int>{2, 1, 2});
    CHECK_THROWS_WITH(check_host_memory(cfg, rank0, ranks_sharing(rank0, "node1", ids)),
                      Catch::Contains("for its 2 ranks under this limit on this host") &&
                          Catch::Contains("the cgroup v2 limit of " + job.string() + ": memory.max"));
    // On two nodes, each rank is alone under its limits.
    const std::vector<std::string> apart = {memory_limit_ids(rank0, "node1"), memory_limit_ids(rank1, "node2")};
    CHECK(ranks_sharing(rank0, "node1", apart) == std::vector<int>{1, 1, 1});
    CHECK(check_host_memory(cfg, rank0, ranks_sharing(rank0, "node1", apart)).empty());
  }
  SECTION("per-task cgroups under an unlimited job: each holds one rank, not the node's count") {
    h.write(job / "memory.max", "max\n");
    const HostMemory rank0 = h.read(), rank1 = host_memory(proc1, h.cgroup);
    const std::vector<std::string> ids = {memory_limit_ids(rank0, "node1"), memory_limit_ids(rank1, "node1")};
    CHECK(ranks_sharing(rank0, "node1", ids) == std::vector<int>{2, 1});
    CHECK(check_host_memory(cfg, rank0, ranks_sharing(rank0, "node1", ids)).empty());
  }
}
