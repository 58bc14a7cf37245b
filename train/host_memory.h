// Host memory for a run on the CPU backend, which keeps its state and activations there: how
// much this process may still take, and the check that refuses a run that cannot fit before
// anything is allocated (it would otherwise die in std::bad_alloc or, minutes later, by the OOM
// killer without a word).
#pragma once

#include <filesystem>
#include <string>

#include "train/config.h"

namespace keel {

struct HostMemory {
  double available = -1;  // bytes; < 0: nothing could be read
  std::string source;    // whose figure: "MemAvailable in /proc/meminfo", "the cgroup v2 limit of DIR: ..."
};

// The least of the host's MemAvailable (<proc>/meminfo) and, for the process's cgroup
// (<proc>/self/cgroup) and each of its ancestors that sets a memory limit, that limit less what
// the cgroup uses. In a container or a Slurm job the cgroup's limit is the real one: past it the
// OOM killer ends the job however much the host has free.
//   cgroup v2: memory.max - memory.current, under <cgroup> (or <cgroup>/unified, hybrid systems)
//   cgroup v1: memory.limit_in_bytes - memory.usage_in_bytes, under <cgroup>/memory
// "max", or a v1 limit of 2^62 bytes or more (the kernel's "unlimited"), is no limit. Usage does
// not count the inactive page cache (memory.stat), which the kernel reclaims before it kills, as
// MemAvailable does not (Kubernetes' working set is the same figure).
HostMemory host_memory(const std::filesystem::path& proc = "/proc",
                       const std::filesystem::path& cgroup = "/sys/fs/cgroup");

// The run `cfg` with `ranks_on_host` ranks on this host, each counted at the heaviest pipeline
// stage's figure (keel plan's), against `host`. Too much: a ConfigError with both sizes and what
// would help, or with health.host_memory_check "warn" the warning to print instead. "" when it
// fits or nothing is known of the host.
std::string check_host_memory(const RunConfig& cfg, int ranks_on_host, const HostMemory& host);

}  // namespace keel
