// The variables in which launchers tell a process its rank, its job's size and its rank on its
// node: one table for every reader (the log's and the metrics file's %r, the rendezvous of
// dynamiq-run and dynamiq-perf), so that all of them take the same family.
#pragma once

namespace dq {

// In order: torchrun (and dynamiq-run), Open MPI's mpirun, PMI (MPICH, Intel MPI), SLURM's srun.
// The innermost launcher first: mpirun inside a Slurm allocation (an sbatch script) hands its
// processes the batch step's SLURM_PROCID (0) and SLURM_NTASKS beside its own ranks.
struct LauncherVariables {
  const char* rank;
  const char* size;
  const char* local_rank;
};
inline constexpr LauncherVariables kLauncherVariables[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

}  // namespace dq
