// Host memory for a run on the CPU backend, which keeps its state and activations there: how
// much this process may still take, and the check that refuses a run that cannot fit before
// anything is allocated (it would otherwise die in std::bad_alloc or, minutes later, by the OOM
// killer without a word).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "train/config.h"

namespace keel {

// One limit on the memory a process may take, and what is left under it.
struct MemoryLimit {
  double available = 0;  // bytes
  std::string source;    // whose figure: "MemAvailable in /proc/meminfo", "the cgroup v2 limit of DIR: ..."
  // Which limit it is: "meminfo" for the host's, else the cgroup's directory. Ranks on one host
  // under limits with the same key share them (the host's memory, a job's cgroup); a Slurm
  // per-task cgroup is each rank's own.
  std::string key;
};

struct HostMemory {
  double available = -1;  // bytes, the tightest of `limits`; < 0: nothing could be read
  std::string source;    // that limit's source
  std::vector<MemoryLimit> limits;
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

// What identifies a rank's limits to the other ranks: its host and its limits' keys.
std::string memory_limit_ids(const HostMemory& m, const std::string& host);
// For each of `mine`'s limits, how many ranks are under it: the ranks (`all`: every rank's
// memory_limit_ids, this one's among them) on the same host with a limit of the same key.
std::vector<int> ranks_sharing(const HostMemory& mine, const std::string& host, const std::vector<std::string>& all);

// The run `cfg` against this rank's limits, each shared by `sharing[i]` ranks (ranks_sharing;
// missing entries: 1), every rank counted at the heaviest pipeline stage's figure (keel plan's).
// Too much under any limit: a ConfigError with both sizes and what would help, or with
// health.host_memory_check "warn" the warning to print instead. "" when it fits or nothing is
// known of the host.
std::string check_host_memory(const RunConfig& cfg, const HostMemory& host, const std::vector<int>& sharing = {});

}  // namespace keel
