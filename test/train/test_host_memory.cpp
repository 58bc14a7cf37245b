// Host memory on the CPU backend (train/host_memory.h): the least of MemAvailable and the
// process's cgroup limits, read from fake /proc and /sys/fs/cgroup trees, and the start-up
// check with its override.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/run_config.h"
#include "common/temp_dir.h"
#include "train/host_memory.h"
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
  const HostMemory small{64 * 1024, "the cgroup v2 limit of /sys/fs/cgroup/job: memory.max 9 MiB less 8 MiB in use"};
  CHECK_THROWS_AS(check_host_memory(cfg, 1, small), ConfigError);
  CHECK_THROWS_WITH(check_host_memory(cfg, 2, small),
                    Catch::StartsWith("the run needs about " + plan::format_bytes(2 * needs) +
                                      " of host memory for its 2 ranks on this host (up to " +
                                      plan::format_bytes(needs) + " each)") &&
                        Catch::Contains("but the host has 64.0 KiB available (" + small.source + ")") &&
                        Catch::EndsWith("--set health.host_memory_check=warn starts it with a warning"));
  CHECK(check_host_memory(cfg, 1, {2 * needs, "MemAvailable in /proc/meminfo"}).empty());
  CHECK(check_host_memory(cfg, 1, {}).empty());  // nothing known of the host
  cfg = test::make_config(test::tiny_run_json(), {{"health", {{"host_memory_check", "warn"}}}});
  const std::string warning = check_host_memory(cfg, 1, small);
  CHECK_THAT(warning, Catch::Contains("available (" + small.source + ")") &&
                          Catch::EndsWith("; starting anyway, as health.host_memory_check is \"warn\""));
  CHECK_THROWS_WITH(test::make_config(test::tiny_run_json(), {{"health", {{"host_memory_check", "off"}}}}),
                    Catch::Contains("health.host_memory_check: \"off\" is not allowed (allowed: error, warn)"));
}
