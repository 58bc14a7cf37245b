#include "train/parallel/grid.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "data/file_io.h"

namespace keel::parallel {

std::string_view group_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::World: return "world";
    case GroupKind::TP: return "tp";
    case GroupKind::PP: return "pp";
    case GroupKind::DP: return "dp";
    case GroupKind::Embedding: return "embedding";
  }
  return "?";
}

// ---- launcher environment --------------------------------------------------------------

namespace {

// A non-negative integer from the environment; throws naming the variable when malformed.
int parse_count(const char* name, const char* text) {
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 0 || v > 1 << 24)
    throw std::runtime_error(std::string("launcher environment: ") + name + "=\"" + text +
                             "\" is not a rank or process count");
  return static_cast<int>(v);
}

// SLURM_TASKS_PER_NODE looks like "4(x2),3": 4 tasks on each of the first two nodes, 3 on
// the third. Returns the count for node `node`, or -1 when it cannot be read.
int slurm_tasks_on_node(const std::string& spec, int node) {
  size_t pos = 0;
  int seen = 0;
  while (pos < spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int count = 0, repeat = 1;
    size_t paren = item.find("(x");
    try {
      count = std::stoi(item.substr(0, paren));
      if (paren != std::string::npos) repeat = std::stoi(item.substr(paren + 2));
    } catch (const std::exception&) {
      return -1;
    }
    if (node < seen + repeat) return count;
    seen += repeat;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return -1;
}

}  // namespace

LaunchInfo LaunchInfo::from_environment() {
  return from_lookup([](const char* name) { return std::getenv(name); }, data::detail::this_host());
}

LaunchInfo LaunchInfo::from_lookup(const EnvLookup& getenv_fn, std::string host) {
  LaunchInfo info;
  info.host = host.empty() ? "?" : std::move(host);

  // World rank and size: Open MPI, then MPICH/Intel MPI (PMI), then SLURM's srun.
  static constexpr const char* kWorld[][2] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, {"PMI_RANK", "PMI_SIZE"}, {"SLURM_PROCID", "SLURM_NTASKS"}};
  for (const auto& [rank_var, size_var] : kWorld) {
    const char* r = getenv_fn(rank_var);
    if (!r) continue;
    const char* s = getenv_fn(size_var);
    if (!s) continue;  // e.g. a SLURM batch step without --ntasks: not a launch of ranks
    info.world_rank = parse_count(rank_var, r);
    info.world_size = parse_count(size_var, s);
    info.rank_variable = rank_var;
    if (info.world_size < 1 || info.world_rank >= info.world_size)
      throw std::runtime_error(std::string("launcher environment: ") + rank_var + "=" + r + " is not below " +
                               size_var + "=" + s);
    break;
  }

  // Local rank (which GPU), with the matching local size where the launcher gives one.
  if (const char* r = getenv_fn("OMPI_COMM_WORLD_LOCAL_RANK")) {
    info.local_rank = parse_count("OMPI_COMM_WORLD_LOCAL_RANK", r);
    if (const char* s = getenv_fn("OMPI_COMM_WORLD_LOCAL_SIZE"))
      info.local_size = parse_count("OMPI_COMM_WORLD_LOCAL_SIZE", s);
  } else if (const char* r = getenv_fn("SLURM_LOCALID")) {
    info.local_rank = parse_count("SLURM_LOCALID", r);
    const char* per_node = getenv_fn("SLURM_TASKS_PER_NODE");
    const char* node = getenv_fn("SLURM_NODEID");
    int n = per_node && node ? slurm_tasks_on_node(per_node, parse_count("SLURM_NODEID", node)) : -1;
    info.local_size = n > 0 ? n : info.local_rank + 1;
  } else if (const char* r = getenv_fn("LOCAL_RANK")) {
    info.local_rank = parse_count("LOCAL_RANK", r);
    if (const char* s = getenv_fn("LOCAL_WORLD_SIZE")) info.local_size = parse_count("LOCAL_WORLD_SIZE", s);
  } else if (const char* r = getenv_fn("MPI_LOCALRANKID")) {
    info.local_rank = parse_count("MPI_LOCALRANKID", r);
    if (const char* s = getenv_fn("MPI_LOCALNRANKS")) info.local_size = parse_count("MPI_LOCALNRANKS", s);
  }
  // A launcher that gave a local rank but no (or a too small) local size: at least rank + 1.
  info.local_size = std::max(info.local_size, info.local_rank + 1);
  return info;
}

// ---- grid ----------------------------------------------------------------------------------

Grid::Grid(int world_size, int rank, int tp, int pp, int dp)
    : world_size_(world_size), rank_(rank), tp_(tp), pp_(pp), dp_(dp) {
  if (tp < 1 || pp < 1 || dp < 1)
    throw std::invalid_argument("parallel layout tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) +
                                " dp=" + std::to_string(dp) + ": every size must be at least 1");
  if (static_cast<long long>(tp) * pp * dp != world_size) {
    const long long product = static_cast<long long>(tp) * pp * dp;
    std::string fix = "set parallel.tp * parallel.pp * parallel.dp to " + std::to_string(world_size);
    if (world_size % (tp * pp) == 0)
      fix += " (e.g. keep tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " and set dp=" +
             std::to_string(world_size / (tp * pp)) + ")";
    fix += ", or launch " + std::to_string(product) + " ranks (mpirun -np " + std::to_string(product) +
           " / srun -n " + std::to_string(product) + ")";
    throw std::invalid_argument("parallel layout tp=" + std::to_string(tp) + " x pp=" + std::to_string(pp) +
                                " x dp=" + std::to_string(dp) + " = " + std::to_string(product) +
                                " ranks, but the world size is " + std::to_string(world_size) + ": " + fix);
  }
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("parallel grid: rank " + std::to_string(rank) + " is outside a world of " +
                                std::to_string(world_size));
}

GridCoord Grid::coord_of(int rank) const {
  if (rank < 0 || rank >= world_size_)
    throw std::out_of_range("Grid::coord_of: rank " + std::to_string(rank) + " outside a world of " +
                            std::to_string(world_size_));
  return GridCoord{rank % tp_, rank / (tp_ * dp_), (rank / tp_) % dp_};
}

int Grid::rank_of(GridCoord c) const {
  if (c.tp < 0 || c.tp >= tp_ || c.pp < 0 || c.pp >= pp_ || c.dp < 0 || c.dp >= dp_)
    throw std::out_of_range("Grid::rank_of: (tp " + std::to_string(c.tp) + ", pp " + std::to_string(c.pp) +
                            ", dp " + std::to_string(c.dp) + ") is outside " + layout());
  return c.pp * dp_ * tp_ + c.dp * tp_ + c.tp;
}

std::vector<int> Grid::members_of(GroupKind kind, int rank) const {
  const GridCoord me = coord_of(rank);
  std::vector<int> out;
  switch (kind) {
    case GroupKind::World:
      for (int r = 0; r < world_size_; ++r) out.push_back(r);
      break;
    case GroupKind::TP:
      for (int t = 0; t < tp_; ++t) out.push_back(rank_of({t, me.pp, me.dp}));
      break;
    case GroupKind::PP:
      for (int p = 0; p < pp_; ++p) out.push_back(rank_of({me.tp, p, me.dp}));
      break;
    case GroupKind::DP:
      for (int d = 0; d < dp_; ++d) out.push_back(rank_of({me.tp, me.pp, d}));
      break;
    case GroupKind::Embedding:
      if (pp_ > 1 && (me.pp == 0 || me.pp == pp_ - 1)) {
        out.push_back(rank_of({me.tp, 0, me.dp}));
        out.push_back(rank_of({me.tp, pp_ - 1, me.dp}));
      } else {
        out.push_back(rank);
      }
      break;
  }
  return out;
}

int Grid::group_index_of(GroupKind kind, int rank) const {
  const GridCoord c = coord_of(rank);
  switch (kind) {
    case GroupKind::World: return 0;
    case GroupKind::TP: return c.pp * dp_ + c.dp;  // lowest member pp*dp*tp + dp*tp: in that order
    case GroupKind::PP: return c.dp * tp_ + c.tp;  // lowest member dp*tp + tp (stage 0)
    case GroupKind::DP: return c.pp * tp_ + c.tp;  // lowest member pp*dp*tp + tp
    case GroupKind::Embedding:
      if (pp_ > 1 && (c.pp == 0 || c.pp == pp_ - 1)) return c.dp * tp_ + c.tp;
      return rank;
  }
  return 0;
}

std::string Grid::layout() const {
  return "tp " + std::to_string(tp_) + " x pp " + std::to_string(pp_) + " x dp " + std::to_string(dp_);
}

std::string Grid::describe(const LaunchInfo& launch) const {
  const GridCoord c = coord();
  return "rank " + std::to_string(rank_) + " of " + std::to_string(world_size_) + ": tp " + std::to_string(c.tp) +
         "/" + std::to_string(tp_) + ", pp " + std::to_string(c.pp) + "/" + std::to_string(pp_) + ", dp " +
         std::to_string(c.dp) + "/" + std::to_string(dp_) + ", local rank " + std::to_string(launch.local_rank) +
         " of " + std::to_string(launch.local_size) + " on host " + launch.host;
}

}  // namespace keel::parallel
