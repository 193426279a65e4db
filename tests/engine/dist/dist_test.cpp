// The ranks from the launchers' environment (engine/dist/world.h).
#include "engine/dist/world.h"

#include <gtest/gtest.h>

#include <map>

namespace zo::engine::dist {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(WorldFromEnv, NoLauncherIsOneProcess) {
  auto w = world_from_env(env_of({}));
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_FALSE(w->distributed());
  EXPECT_EQ(w->world_size, 1u);
  EXPECT_EQ(w->describe(), "one process");
}

TEST(WorldFromEnv, AWorldOfOneNeedsNoRendezvous) {
  auto w = world_from_env(env_of({{"WORLD_SIZE", "1"}, {"RANK", "0"}}));
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_FALSE(w->distributed());
}

TEST(WorldFromEnv, ReadsTorchrun) {
  auto w = world_from_env(env_of({{"WORLD_SIZE", "4"},
                                  {"RANK", "3"},
                                  {"LOCAL_RANK", "1"},
                                  {"LOCAL_WORLD_SIZE", "2"},
                                  {"MASTER_ADDR", "node0"},
                                  {"MASTER_PORT", "29500"},
                                  {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                  {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->rank, 3u);
  EXPECT_EQ(w->world_size, 4u);
  EXPECT_EQ(w->local_rank, 1u);
  EXPECT_EQ(w->local_world_size, 2u);
  EXPECT_EQ(w->master_addr, "node0");
  EXPECT_EQ(w->master_port, 29500);
  EXPECT_TRUE(w->agent_store);
  EXPECT_EQ(w->store_prefix, "zoffload/2/");
  EXPECT_EQ(w->describe(), "rank 3 of 4 (torchrun)");
}

TEST(WorldFromEnv, ReadsOpenMpiMpichAndSrun) {
  auto ompi = world_from_env(env_of({{"OMPI_COMM_WORLD_SIZE", "2"},
                                     {"OMPI_COMM_WORLD_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"MASTER_ADDR", "h"},
                                     {"MASTER_PORT", "1"}}));
  ASSERT_TRUE(ompi.is_ok()) << ompi.status().to_string();
  EXPECT_EQ(ompi->launcher, "Open MPI");
  EXPECT_EQ(ompi->rank, 1u);
  EXPECT_FALSE(ompi->agent_store);
  auto pmi = world_from_env(env_of({{"PMI_SIZE", "3"}, {"PMI_RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "2"}}));
  ASSERT_TRUE(pmi.is_ok()) << pmi.status().to_string();
  EXPECT_EQ(pmi->launcher, "MPICH/Intel MPI");
  EXPECT_EQ(pmi->rank, 2u);
  auto srun = world_from_env(env_of({{"SLURM_STEP_NUM_TASKS", "2"},
                                     {"SLURM_PROCID", "0"},
                                     {"SLURM_LOCALID", "0"},
                                     {"MASTER_ADDR", "h"},
                                     {"MASTER_PORT", "3"}}));
  ASSERT_TRUE(srun.is_ok()) << srun.status().to_string();
  EXPECT_EQ(srun->launcher, "srun");
  EXPECT_EQ(srun->world_size, 2u);
}

void expect_refused(std::map<std::string, std::string> vars, const std::string& needle) {
  auto w = world_from_env(env_of(std::move(vars)));
  ASSERT_FALSE(w.is_ok()) << "accepted, expected an error with: " << needle;
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find(needle), std::string::npos) << w.status().message();
}

TEST(WorldFromEnv, RefusesWhatItCannotServeNamingTheVariable) {
  expect_refused({{"WORLD_SIZE", "two"}}, "WORLD_SIZE=two (set by torchrun) is not a count");
  expect_refused({{"WORLD_SIZE", "0"}}, "WORLD_SIZE=0");
  expect_refused({{"WORLD_SIZE", "2"}}, "RANK is not set");
  expect_refused({{"WORLD_SIZE", "2"}, {"RANK", "2"}},
                 "RANK=2 (set by torchrun) is over the last rank, WORLD_SIZE - 1 = 1");
  expect_refused({{"WORLD_SIZE", "2"}, {"RANK", "-1"}}, "RANK=-1 (set by torchrun) is not a count");
  expect_refused({{"WORLD_SIZE", "2"}, {"RANK", "1"}}, "rank 1 of 2 (torchrun): MASTER_ADDR is not set");
  expect_refused({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT is not set");
  expect_refused({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
                 "MASTER_PORT=70000 is not a port");
}

TEST(VisibleDeviceForRank, GivesEachLocalRankItsOwnGpu) {
  WorldInfo w;
  EXPECT_FALSE(visible_device_for_rank(w, std::nullopt)->has_value()) << "one process keeps what it sees";
  w.world_size = 4;
  w.rank = 3;
  w.local_rank = 1;
  w.launcher = "torchrun";
  EXPECT_EQ(visible_device_for_rank(w, std::nullopt)->value_or("unchanged"), "1");
  EXPECT_EQ(visible_device_for_rank(w, "4,5,6")->value_or("unchanged"), "5");
  EXPECT_EQ(visible_device_for_rank(w, "GPU-aa,GPU-bb")->value_or("unchanged"), "GPU-bb");
  EXPECT_FALSE(visible_device_for_rank(w, "7")->has_value()) << "a launcher that bound one GPU per process";
  EXPECT_FALSE(visible_device_for_rank(w, "")->has_value()) << "no GPU at all";
  w.local_rank = 2;
  auto r = visible_device_for_rank(w, "0,1");
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("local rank 2 of its node, but CUDA_VISIBLE_DEVICES=0,1 lists 2 GPUs"),
            std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace zo::engine::dist
