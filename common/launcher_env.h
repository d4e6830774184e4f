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

// The rank a per-process file is named by (the debug and metrics files' %r): the launcher's while
// its job covers the communicator the other rank is taken from (`comm_size` ranks), else the rank
// in that communicator; -1 (name it by the pid) without either. A communicator larger than the
// launcher's job means the processes were started below the launcher (srun with one task a node,
// then torch.multiprocessing.spawn of a worker a GPU) and share its rank; one no larger (tensor
// or pipeline parallelism's data-parallel group) means its rank is shared by a node's processes.
inline int file_name_rank(int launcher_rank, int launcher_size, int comm_rank, int comm_size) {
  if (launcher_rank >= 0 && (comm_rank < 0 || launcher_size < 0 || comm_size <= launcher_size))
    return launcher_rank;
  return comm_rank < 0 ? -1 : comm_rank;
}

}  // namespace dq
