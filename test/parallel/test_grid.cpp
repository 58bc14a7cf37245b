// The parallel grid: coordinates, group memberships, the embedding group, launcher variables.
// Every layout of 8 ranks (tp, pp, dp in {1, 2, 4, 8}, product 8) and every layout of 2 and 4.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "train/parallel/grid.h"

using namespace keel::parallel;

namespace {

struct Layout {
  int tp, pp, dp;
};

std::vector<Layout> layouts_of(int world) {
  std::vector<Layout> out;
  for (int tp = 1; tp <= world; tp *= 2)
    for (int pp = 1; pp <= world; pp *= 2)
      for (int dp = 1; dp <= world; dp *= 2)
        if (tp * pp * dp == world) out.push_back({tp, pp, dp});
  return out;
}

std::string name_of(const Layout& l) {
  return "tp" + std::to_string(l.tp) + " pp" + std::to_string(l.pp) + " dp" + std::to_string(l.dp);
}

// Everything a layout must satisfy, checked from every rank's point of view.
void check_layout(int world, const Layout& l) {
  INFO("world " << world << ", " << name_of(l));
  std::map<GroupKind, std::set<std::vector<int>>> distinct;  // the groups, as seen by all ranks
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    Grid g(world, rank, l.tp, l.pp, l.dp);
    const GridCoord c = g.coord();
    // Megatron order: tp fastest, then dp, then pp.
    CHECK(rank == c.pp * l.dp * l.tp + c.dp * l.tp + c.tp);
    CHECK(g.rank_of(c) == rank);
    CHECK(g.tp_rank() == c.tp);
    CHECK(g.pp_rank() == c.pp);
    CHECK(g.dp_rank() == c.dp);

    const auto tp = g.tp_group(), pp = g.pp_group(), dp = g.dp_group(), emb = g.embedding_group();
    REQUIRE(static_cast<int>(tp.size()) == l.tp);
    REQUIRE(static_cast<int>(pp.size()) == l.pp);
    REQUIRE(static_cast<int>(dp.size()) == l.dp);
    // This rank sits at its own coordinate in each group.
    CHECK(tp[c.tp] == rank);
    CHECK(pp[c.pp] == rank);
    CHECK(dp[c.dp] == rank);
    for (int i = 0; i < l.tp; ++i) {
      CHECK(tp[i] == tp[0] + i);  // TP ranks adjacent: one node
      CHECK(g.coord_of(tp[i]) == GridCoord{i, c.pp, c.dp});
    }
    for (int i = 0; i < l.dp; ++i) {
      CHECK(dp[i] == dp[0] + i * l.tp);
      CHECK(g.coord_of(dp[i]) == GridCoord{c.tp, c.pp, i});
    }
    for (int i = 0; i < l.pp; ++i) {
      CHECK(pp[i] == pp[0] + i * l.tp * l.dp);
      CHECK(g.coord_of(pp[i]) == GridCoord{c.tp, i, c.dp});
    }
    // Embedding group: first and last stage with this rank's (tp, dp); alone otherwise.
    CHECK(g.is_first_stage() == (c.pp == 0));
    CHECK(g.is_last_stage() == (c.pp == l.pp - 1));
    CHECK(g.holds_embedding() == (c.pp == 0 || c.pp == l.pp - 1));
    if (l.pp > 1 && g.holds_embedding()) {
      REQUIRE(emb.size() == 2);
      CHECK(emb[0] == g.rank_of({c.tp, 0, c.dp}));
      CHECK(emb[1] == g.rank_of({c.tp, l.pp - 1, c.dp}));
      CHECK(emb[0] == pp.front());
      CHECK(emb[1] == pp.back());
    } else {
      CHECK(emb == std::vector<int>{rank});
    }
    CHECK(g.members(GroupKind::World).size() == static_cast<size_t>(world));
    // Every member of a group sees the same group (groups are consistent across ranks).
    for (GroupKind k : kAllGroups) {
      const auto mine = g.members(k);
      CHECK(std::find(mine.begin(), mine.end(), rank) != mine.end());
      for (int m : mine) CHECK(g.members_of(k, m) == mine);
      distinct[k].insert(mine);
    }
  }
  // The groups of each kind partition the world.
  for (GroupKind k : kAllGroups) {
    INFO("group " << group_name(k));
    std::multiset<int> covered;
    for (const auto& grp : distinct[k]) covered.insert(grp.begin(), grp.end());
    CHECK(covered.size() == static_cast<size_t>(world));
    CHECK(std::set<int>(covered.begin(), covered.end()).size() == static_cast<size_t>(world));
  }
  // Group numbers (hang reports: "tp group 3"): the same for every member, distinct between
  // groups, and in the order of the groups' lowest ranks.
  for (GroupKind k : kAllGroups) {
    INFO("group index of " << group_name(k));
    std::map<int, std::vector<int>> by_lowest;  // lowest member -> (index per member)
    for (int rank = 0; rank < world; ++rank) {
      Grid g(world, rank, l.tp, l.pp, l.dp);
      by_lowest[g.members(k).front()].push_back(g.group_index(k));
    }
    int expected = 0;
    for (const auto& [lowest, indices] : by_lowest) {
      if (indices.size() == 1 && k == GroupKind::Embedding) continue;  // a group of one: its rank
      for (int i : indices) CHECK(i == expected);
      ++expected;
    }
  }
  CHECK(distinct[GroupKind::TP].size() == static_cast<size_t>(world / l.tp));
  CHECK(distinct[GroupKind::PP].size() == static_cast<size_t>(world / l.pp));
  CHECK(distinct[GroupKind::DP].size() == static_cast<size_t>(world / l.dp));
}

}  // namespace

TEST_CASE("grid: every layout of 8 ranks", "[parallel][grid]") {
  const auto layouts = layouts_of(8);
  REQUIRE(layouts.size() == 10);  // (1,1,8) (1,2,4) (1,4,2) (1,8,1) (2,1,4) (2,2,2) (2,4,1) (4,1,2) (4,2,1) (8,1,1)
  for (const Layout& l : layouts) check_layout(8, l);
}

TEST_CASE("grid: every layout of 1, 2 and 4 ranks", "[parallel][grid]") {
  CHECK(layouts_of(2).size() == 3);
  CHECK(layouts_of(4).size() == 6);
  for (int world : {1, 2, 4})
    for (const Layout& l : layouts_of(world)) check_layout(world, l);
}

TEST_CASE("grid: worked example tp 2 x pp 2 x dp 2", "[parallel][grid]") {
  Grid g(8, 5, 2, 2, 2);
  CHECK(g.coord() == GridCoord{1, 1, 0});
  CHECK(g.tp_group() == std::vector<int>{4, 5});
  CHECK(g.dp_group() == std::vector<int>{5, 7});
  CHECK(g.pp_group() == std::vector<int>{1, 5});
  CHECK(g.embedding_group() == std::vector<int>{1, 5});
  CHECK(g.layout() == "tp 2 x pp 2 x dp 2");
  LaunchInfo li;
  li.local_rank = 5;
  li.local_size = 8;
  li.host = "node07";
  CHECK(g.describe(li) == "rank 5 of 8: tp 1/2, pp 1/2, dp 0/2, local rank 5 of 8 on host node07");
}

TEST_CASE("grid: embedding group skips middle stages", "[parallel][grid]") {
  // tp 2 x pp 4: stages 0 and 3 hold the tied embedding; stages 1 and 2 are alone.
  for (int r = 0; r < 8; ++r) {
    Grid g(8, r, 2, 4, 1);
    const int stage = r / 2, t = r % 2;
    if (stage == 0 || stage == 3)
      CHECK(g.embedding_group() == std::vector<int>{t, 6 + t});
    else
      CHECK(g.embedding_group() == std::vector<int>{r});
  }
}

TEST_CASE("grid: a layout that does not fit the world is an error naming all four numbers", "[parallel][grid]") {
  try {
    Grid(8, 0, 2, 2, 3);
    FAIL("no error");
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("tp=2") != std::string::npos);
    CHECK(msg.find("pp=2") != std::string::npos);
    CHECK(msg.find("dp=3") != std::string::npos);
    CHECK(msg.find("= 12") != std::string::npos);
    CHECK(msg.find("world size is 8") != std::string::npos);
    CHECK(msg.find("dp=2") != std::string::npos);         // the suggested fix
    CHECK(msg.find("mpirun -np 12") != std::string::npos);  // or launch that many ranks
  }
  // 6 ranks with tp 4 x pp 1: no dp fits; the message still says what to do.
  try {
    Grid(6, 0, 4, 1, 2);
    FAIL("no error");
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("world size is 6") != std::string::npos);
    CHECK(msg.find("set parallel.tp * parallel.pp * parallel.dp to 6") != std::string::npos);
  }
  CHECK_THROWS_AS(Grid(4, 0, 0, 4, 1), std::invalid_argument);
  CHECK_THROWS_AS(Grid(4, 4, 2, 2, 1), std::invalid_argument);
  CHECK_THROWS_AS(Grid(4, -1, 2, 2, 1), std::invalid_argument);
  Grid g(4, 0, 2, 2, 1);
  CHECK_THROWS_AS(g.coord_of(4), std::out_of_range);
  CHECK_THROWS_AS(g.rank_of({2, 0, 0}), std::out_of_range);
}

TEST_CASE("launch info: ranks from mpirun, MPICH, srun, none without a launcher", "[parallel][grid]") {
  auto from = [](std::map<std::string, std::string> env) {
    return LaunchInfo::from_lookup(
        [&](const char* name) -> const char* {
          auto it = env.find(name);
          return it == env.end() ? nullptr : it->second.c_str();
        },
        "hostA");
  };
  SECTION("no launcher: a world of one") {
    LaunchInfo li = from({{"LOCAL_RANK", "0"}});
    CHECK_FALSE(li.launched());
    CHECK(li.world_rank == 0);
    CHECK(li.world_size == 1);
    CHECK(li.host == "hostA");
  }
  SECTION("Open MPI wins over SLURM (mpirun inside an allocation)") {
    LaunchInfo li = from({{"OMPI_COMM_WORLD_RANK", "5"},
                          {"OMPI_COMM_WORLD_SIZE", "8"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                          {"SLURM_PROCID", "0"},
                          {"SLURM_NTASKS", "1"},
                          {"SLURM_LOCALID", "0"}});
    CHECK(li.launched());
    CHECK(li.rank_variable == "OMPI_COMM_WORLD_RANK");
    CHECK(li.world_rank == 5);
    CHECK(li.world_size == 8);
    CHECK(li.local_rank == 1);
    CHECK(li.local_size == 4);
  }
  SECTION("MPICH / Intel MPI (PMI, MPI_LOCALRANKID)") {
    LaunchInfo li = from({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
    CHECK(li.rank_variable == "PMI_RANK");
    CHECK(li.world_rank == 3);
    CHECK(li.local_rank == 1);
    CHECK(li.local_size == 2);
  }
  SECTION("srun: local size from SLURM_TASKS_PER_NODE for this node") {
    LaunchInfo li = from({{"SLURM_PROCID", "9"},
                          {"SLURM_NTASKS", "11"},
                          {"SLURM_LOCALID", "1"},
                          {"SLURM_NODEID", "2"},
                          {"SLURM_TASKS_PER_NODE", "4(x2),3"}});
    CHECK(li.rank_variable == "SLURM_PROCID");
    CHECK(li.world_rank == 9);
    CHECK(li.world_size == 11);
    CHECK(li.local_rank == 1);
    CHECK(li.local_size == 3);
  }
  SECTION("torchrun-style LOCAL_RANK only sets the local rank") {
    LaunchInfo li = from({{"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}});
    CHECK_FALSE(li.launched());
    CHECK(li.local_rank == 2);
    CHECK(li.local_size == 4);
  }
  SECTION("a SLURM batch step without a task count is not a launch") {
    CHECK_FALSE(from({{"SLURM_PROCID", "0"}}).launched());
  }
  SECTION("malformed values are errors naming the variable") {
    CHECK_THROWS_WITH(from({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
                      Catch::Contains("OMPI_COMM_WORLD_RANK"));
    CHECK_THROWS_WITH(from({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}}), Catch::Contains("not below PMI_SIZE"));
  }
}
