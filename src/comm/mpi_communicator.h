// The MPI transport (OpenMPI, loaded at run time): collectives of any backend through host
// staging, one rank per process of MPI_COMM_WORLD (started with mpirun -np N).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>

#include "metrale/communicator.h"

namespace metrale::comm {

// A rank and the number of ranks.
struct MpiPlace {
  int rank = 0;
  int size = 1;
};

// Joins every process of MPI_COMM_WORLD (MPI initialized on first use). Throws kUnavailable
// when MPI does not load or initialize, kInvalidArgument when options' rank or size disagree
// with MPI's, kTimeout when the ranks do not all join within options.timeout.
std::unique_ptr<Communicator> make_mpi_communicator(Backend& backend,
                                                    const CommunicatorOptions& options);

// Copies root's bytes to every process of MPI_COMM_WORLD (how NCCL's unique id travels when no
// id file is given). Throws like make_mpi_communicator.
void mpi_broadcast_bytes(std::span<std::byte> bytes, int root, std::chrono::milliseconds timeout);

// This process's place in MPI_COMM_WORLD (MPI initialized on first use); throws kUnavailable.
MpiPlace mpi_place();

}  // namespace metrale::comm
