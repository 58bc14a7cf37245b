// Where a rank sits in the 3D (tensor x pipeline x data) parallel grid, and who its group
// partners are. Pure logic: no MPI here, so every layout can be checked in a plain unit test.
//
// Rank order (Megatron's): tp fastest, then dp, then pp:
//     rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
// so the ranks of one TP group are adjacent and land on one node under the usual block
// placement of mpirun/srun (TP all-reduces every layer; it needs the fastest links).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::parallel {

// The groups a rank belongs to. Embedding: the first and the last pipeline stage ranks with
// the same (tp, dp) coordinates, where the tied input/output embedding copies live.
enum class GroupKind { World, TP, PP, DP, Embedding };
inline constexpr GroupKind kAllGroups[] = {GroupKind::World, GroupKind::TP, GroupKind::PP, GroupKind::DP,
                                           GroupKind::Embedding};
std::string_view group_name(GroupKind kind);  // "world", "tp", "pp", "dp", "embedding"

// What the launcher (mpirun, srun, mpiexec.hydra) told this process through its environment.
struct LaunchInfo {
  int world_rank = 0;
  int world_size = 1;
  int local_rank = 0;  // rank among the processes on this host (picks the GPU)
  int local_size = 1;
  std::string rank_variable;  // the variable the world rank came from; empty: no launcher
  std::string host;

  bool launched() const { return !rank_variable.empty(); }

  // Reads OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, SLURM_PROCID/NTASKS (world) and
  // OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK, MPI_LOCALRANKID (local), first
  // present wins. Throws std::runtime_error on a malformed or inconsistent value.
  static LaunchInfo from_environment();
  using EnvLookup = std::function<const char*(const char*)>;  // getenv, or a map in tests
  static LaunchInfo from_lookup(const EnvLookup& getenv_fn, std::string host = "");
};

struct GridCoord {
  int tp = 0, pp = 0, dp = 0;
  bool operator==(const GridCoord&) const = default;
};

class Grid {
 public:
  // Throws std::invalid_argument when tp*pp*dp != world_size (naming all four numbers and
  // how to fix it), when a size is < 1, or when rank is outside [0, world_size).
  Grid(int world_size, int rank, int tp, int pp, int dp);

  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }
  int dp_size() const { return dp_; }

  GridCoord coord() const { return coord_of(rank_); }
  int tp_rank() const { return coord().tp; }
  int pp_rank() const { return coord().pp; }
  int dp_rank() const { return coord().dp; }
  GridCoord coord_of(int rank) const;
  int rank_of(GridCoord c) const;

  bool is_first_stage() const { return pp_rank() == 0; }
  bool is_last_stage() const { return pp_rank() == pp_ - 1; }
  // True on the first and last stage: the ranks that hold a copy of the tied embedding.
  bool holds_embedding() const { return is_first_stage() || is_last_stage(); }

  // World ranks of this rank's group, in group-rank order (index = rank within the group).
  // TP by tp coordinate, PP by stage, DP by dp coordinate, World by rank. Embedding:
  // {first stage, last stage} on those stages; on a middle stage (and when pp == 1) just this
  // rank, so collectives on it are no-ops.
  std::vector<int> members(GroupKind kind) const { return members_of(kind, rank_); }
  std::vector<int> members_of(GroupKind kind, int rank) const;
  std::vector<int> tp_group() const { return members(GroupKind::TP); }
  std::vector<int> pp_group() const { return members(GroupKind::PP); }
  std::vector<int> dp_group() const { return members(GroupKind::DP); }
  std::vector<int> embedding_group() const { return members(GroupKind::Embedding); }
  // Which group of that kind this rank's is, numbered in the order of their lowest world rank
  // ("tp group 3" = the fourth TP group): the number hang reports print. World: 0. An
  // embedding "group" of one rank (middle stages, pp == 1) gets the rank's world rank.
  int group_index(GroupKind kind) const { return group_index_of(kind, rank_); }
  int group_index_of(GroupKind kind, int rank) const;

  // "rank 5 of 8: tp 1/2, pp 1/2, dp 0/2, local rank 5 of 8 on host node07"
  std::string describe(const LaunchInfo& launch) const;
  std::string layout() const;  // "tp 2 x pp 2 x dp 2"

 private:
  int world_size_, rank_, tp_, pp_, dp_;
};

}  // namespace keel::parallel
