// MPI, reached only through this table of function pointers and predefined handles. The real
// table is filled at run time from OpenMPI's libmpi.so.40 (never linked); the handles
// MPI_COMM_WORLD, MPI_BYTE and MPI_ERRORS_RETURN are OpenMPI's global objects, looked up by
// name, because mpi.h's macros for them would make the linker want the library. Nothing outside
// src/comm includes mpi.h.
#pragma once

// OpenMPI's C++ bindings are deprecated and unused; its header is not written for this
// project's warnings.
#define OMPI_SKIP_MPICXX 1
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wcast-function-type"
#include <mpi.h>
#pragma GCC diagnostic pop

namespace metrale::comm {

// Every MPI entry point metrale uses.
#define METRALE_MPI_FUNCTIONS(X) \
  X(MPI_Get_library_version)     \
  X(MPI_Initialized)             \
  X(MPI_Finalized)               \
  X(MPI_Init_thread)             \
  X(MPI_Finalize)                \
  X(MPI_Comm_idup)               \
  X(MPI_Comm_free)               \
  X(MPI_Comm_rank)               \
  X(MPI_Comm_size)               \
  X(MPI_Comm_set_errhandler)     \
  X(MPI_Iallgather)              \
  X(MPI_Ibcast)                  \
  X(MPI_Isend)                   \
  X(MPI_Irecv)                   \
  X(MPI_Test)                    \
  X(MPI_Cancel)                  \
  X(MPI_Request_free)            \
  X(MPI_Error_string)

// The table. Function members are named after the entry points and typed from mpi.h.
struct MpiApi {
#define METRALE_MPI_MEMBER(name) decltype(&::name) name = nullptr;
  METRALE_MPI_FUNCTIONS(METRALE_MPI_MEMBER)
#undef METRALE_MPI_MEMBER
  MPI_Comm comm_world = nullptr;           // ompi_mpi_comm_world
  MPI_Datatype byte = nullptr;             // ompi_mpi_byte
  MPI_Errhandler errors_return = nullptr;  // ompi_mpi_errors_return
  MPI_Request request_null = nullptr;      // ompi_request_null
};

}  // namespace metrale::comm
