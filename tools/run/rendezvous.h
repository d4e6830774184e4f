// Rendezvous for a few opaque bytes (an ncclUniqueId) among the ranks of one job.
// Rank 0 publishes, the others wait for it with a timeout. Two transports:
//  - dynamiq-run: a file $DYNAMIQ_RUN_DIR/<key>, written atomically (temp file + rename);
//  - torchrun and friends (no DYNAMIQ_RUN_DIR): TCP, rank 0 serves on MASTER_ADDR:MASTER_PORT+1
//    (MASTER_PORT itself belongs to torch's own store).
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"

namespace dq::rendezvous {

struct JobEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string run_dir;      // DYNAMIQ_RUN_DIR; empty: use TCP
  std::string master_addr;  // MASTER_ADDR
  int master_port = -1;     // MASTER_PORT
  double timeout_s = 120;   // DYNAMIQ_RENDEZVOUS_TIMEOUT (seconds)
};

// Reads the rank, size and local rank from torchrun's RANK, WORLD_SIZE, LOCAL_RANK, else Open
// MPI's, else PMI's, else SLURM's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (the first family
// set; a local rank its family lacks from a later family of the same task's rank), and
// DYNAMIQ_RUN_DIR, MASTER_ADDR, MASTER_PORT, DYNAMIQ_RENDEZVOUS_TIMEOUT. None of them set: one
// rank (rank 0 of 1). Several ranks with neither DYNAMIQ_RUN_DIR nor MASTER_ADDR and MASTER_PORT:
// kInvalidArgument, with a message saying what to set.
Status read_job_env(JobEnv* out);

// Rank 0 passes `size` bytes in `data` and publishes them under `key` ([A-Za-z0-9._-], at
// most 64 characters, used once per job); every other rank gets them into `data`.
// Fails with kTimeout when the bytes do not arrive within env.timeout_s.
Status share_bytes(const JobEnv& env, const char* key, void* data, size_t size);

}  // namespace dq::rendezvous
