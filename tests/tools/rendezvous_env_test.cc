// read_job_env(): rank, size and local rank from the launcher's variables.
#include <gtest/gtest.h>

#include <cstdlib>

#include "tools/run/rendezvous.h"

namespace {

constexpr const char* kVariables[] = {"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "PMI_RANK",
                                      "PMI_SIZE",
                                      "MPI_LOCALRANKID",
                                      "SLURM_PROCID",
                                      "SLURM_NTASKS",
                                      "SLURM_LOCALID"};

// A multi-rank job also needs a rendezvous: MASTER_ADDR and MASTER_PORT (loopback, never used).
void clear_launcher() {
  for (const char* v : kVariables) unsetenv(v);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29999", 1);
}

TEST(RendezvousEnv, TheFirstLaunchersFamilyGivesRankSizeAndLocalRank) {
  clear_launcher();
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("SLURM_PROCID", "0", 1);  // an outer launcher's: the innermost wins
  setenv("SLURM_NTASKS", "2", 1);
  dq::rendezvous::JobEnv job;
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.rank, 3);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  clear_launcher();
}

// Slurm's PMI-2 plugin (srun --mpi=pmi2) sets PMI_RANK and PMI_SIZE but not MPI_LOCALRANKID: the
// local rank is Slurm's for the same task (its rank agrees), not the global rank, which on two
// nodes of 4 tasks placed cyclically gave rank 2 the device of local rank 2 instead of 1.
TEST(RendezvousEnv, ALocalRankMissingFromItsFamilyComesFromTheSameTasksOther) {
  clear_launcher();
  setenv("PMI_RANK", "5", 1);
  setenv("PMI_SIZE", "8", 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "1", 1);
  dq::rendezvous::JobEnv job;
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.local_rank, 1);
  // Slurm's variables of another step (an sbatch script's: rank 0): not this task's.
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_LOCALID", "0", 1);
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.local_rank, 5);
  clear_launcher();
}

}  // namespace
