#include "train/host_memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <vector>

#include "train/plan.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

// A cgroup interface file's value in bytes: nullopt when it is missing, unreadable or "max".
std::optional<double> bytes_in(const fs::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word == "max") return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(word.c_str(), &end);
  if (end == word.c_str() || *end != '\0' || v < 0) return std::nullopt;
  return v;
}

// The value of `key` in a memory.stat ("key value" lines); 0 when absent.
double stat_value(const fs::path& file, const std::string& key) {
  std::ifstream in(file);
  std::string k;
  double v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return 0;
}

// One cgroup's memory limit, if it sets one: what is left under it.
struct CgroupLimit {
  fs::path dir;
  double limit = 0, used = 0;
};

// The limits along `path` (from /proc/self/cgroup) and its ancestors under the hierarchy's
// mount `root`. A container without its own cgroup namespace sees the host's path for its
// cgroup, which is then the mount's root: the walk reaches that too.
std::vector<CgroupLimit> limits_along(const fs::path& root, const std::string& path, bool v2) {
  const char* limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
  const char* usage_file = v2 ? "memory.current" : "memory.usage_in_bytes";
  const char* inactive = v2 ? "inactive_file" : "total_inactive_file";
  constexpr double kV1Unlimited = 4.611686018427388e18;  // 2^62: v1 writes "no limit" as ~2^63
  std::vector<CgroupLimit> out;
  for (fs::path p = fs::path(path).lexically_normal();; p = p.parent_path()) {
    const fs::path dir = p.relative_path().empty() ? root : root / p.relative_path();
    const std::optional<double> limit = bytes_in(dir / limit_file), usage = bytes_in(dir / usage_file);
    if (limit && usage && (v2 || *limit < kV1Unlimited)) {
      const double used = std::max(0.0, *usage - stat_value(dir / "memory.stat", inactive));
      out.push_back({dir, *limit, used});
    }
    if (p == p.root_path() || p.empty()) break;
  }
  return out;
}

}  // namespace

HostMemory host_memory(const fs::path& proc, const fs::path& cgroup) {
  HostMemory best;
  auto consider = [&](double available, const std::string& source, const std::string& key) {
    available = std::max(0.0, available);
    if (best.available < 0 || available < best.available) best.available = available, best.source = source;
    best.limits.push_back({available, source, key});
  };
  {
    std::ifstream in(proc / "meminfo");
    std::string line;
    long long kib = 0;
    while (std::getline(in, line))
      if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kib) == 1)
        consider(static_cast<double>(kib) * 1024, "MemAvailable in " + (proc / "meminfo").string(), "meminfo");
  }
  // /proc/self/cgroup: "0::PATH" for cgroup v2, "ID:CONTROLLERS:PATH" for each v1 hierarchy.
  std::ifstream in(proc / "self" / "cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::vector<CgroupLimit> limits;
    std::string version;
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      // Unified at the top when the system has only v2, else (hybrid) beside the v1 hierarchies.
      const fs::path root = fs::exists(cgroup / "cgroup.controllers") ? cgroup : cgroup / "unified";
      limits = limits_along(root, path, true);
      version = "v2";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      limits = limits_along(cgroup / "memory", path, false);
      version = "v1";
    }
    for (const CgroupLimit& c : limits)
      consider(c.limit - c.used, "the cgroup " + version + " limit of " + c.dir.string() + ": " +
                                     (version == "v2" ? "memory.max " : "memory.limit_in_bytes ") +
                                     plan::format_bytes(c.limit) + " less " + plan::format_bytes(c.used) + " in use",
               c.dir.string());
  }
  return best;
}

// Keys travel hashed: a cgroup path can be long, and equal keys are all that matters.
std::string memory_limit_ids(const HostMemory& m, const std::string& host) {
  std::string ids = host;
  for (const MemoryLimit& l : m.limits) {
    ids += ' ';
    ids += std::to_string(std::hash<std::string>{}(l.key));
  }
  return ids;
}

std::vector<int> ranks_sharing(const HostMemory& mine, const std::string& host, const std::vector<std::string>& all) {
  std::vector<int> sharing;
  for (const MemoryLimit& l : mine.limits) {
    const std::string id = std::to_string(std::hash<std::string>{}(l.key));
    int n = 0;
    for (const std::string& other : all) {
      std::istringstream in(other);
      std::string other_host, other_id;
      in >> other_host;
      if (other_host != host) continue;
      while (in >> other_id)
        if (other_id == id) {
          ++n;
          break;
        }
    }
    sharing.push_back(std::max(n, 1));
  }
  return sharing;
}

std::string check_host_memory(const RunConfig& cfg, const HostMemory& host, const std::vector<int>& sharing) {
  // A background save (checkpoint.async) copies the rank's state to host memory on top of what
  // the backend holds: on the CPU that is the same memory, so a run that fits until its first
  // interval save would be killed there.
  double per_rank = 0, save_copy = 0;
  for (int s = 0; s < cfg.parallel.pp; ++s) {
    const double copy = plan::async_save_host_bytes(cfg, s), total = plan::planned_backend_bytes(cfg, s, false) + copy;
    if (total > per_rank) per_rank = total, save_copy = copy;
  }
  // The limit short by the most, with the ranks under it.
  const MemoryLimit* worst = nullptr;
  int ranks = 1;
  double worst_short = 0;
  for (size_t i = 0; i < host.limits.size(); ++i) {
    const int n = i < sharing.size() ? sharing[i] : 1;
    const double short_by = per_rank * n - host.limits[i].available;
    if (short_by > worst_short) worst = &host.limits[i], ranks = n, worst_short = short_by;
  }
  if (!worst) return "";
  const std::string under = ranks > 1 ? " for its " + std::to_string(ranks) +
                                             " ranks under this limit on this host (up to " +
                                             plan::format_bytes(per_rank) + " each)"
                                       : "";
  const std::string what = "the run needs about " + plan::format_bytes(per_rank * ranks) + " of host memory" + under +
                           " (keel plan's figure: weights, gradients, optimizer state and activations" +
                           (save_copy > 0 ? ", and the " + plan::format_bytes(save_copy) +
                                                " host copy a background save (checkpoint.async) writes from"
                                          : "") +
                           "), but the host has " + plan::format_bytes(worst->available) + " available (" +
                           worst->source + ")";
  if (cfg.health.host_memory_check == "warn")
    return what + "; starting anyway, as health.host_memory_check is \"warn\"";
  // What keel plan can then search over: each rank's share of the limit, less its save copy.
  const double share = worst->available / ranks - save_copy;
  const std::string plan_hint =
      share >= 1 << 20 ? "; keel plan --config " + (cfg.source.empty() ? "CONFIG" : cfg.source) +
                             " --cpu --gpus " + std::to_string(cfg.parallel.world()) + " --gpu-mem " +
                             std::to_string(static_cast<int64_t>(share / (1 << 20))) +
                             "MiB --headroom 0 (with this run's --set options) lists the layouts, micro-batches "
                             "and recomputation that fit each rank's share"
                       : "";
  throw ConfigError(what + ". Use a smaller model, train.micro_batch or train.seq_len, train.recompute, more hosts "
                    "under mpirun, or a GPU" + plan_hint + ". If the run fits all the same (swap, or an estimate "
                    "too high for it), --set health.host_memory_check=warn starts it with a warning");
}

}  // namespace keel
