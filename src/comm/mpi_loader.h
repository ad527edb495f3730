// Finding MPI at run time. Loading never crashes and never throws: a machine without OpenMPI
// gets a reason that starts with "MPI unavailable:", and nothing else changes. Initializing MPI
// is separate (mpi_world), since only a process that joins ranks should do it.
#pragma once

#include <chrono>
#include <string>

namespace metrale::comm {

struct MpiApi;  // comm/mpi_api.h

struct MpiLoad {
  const MpiApi* api = nullptr;  // null when the library is unusable
  std::string reason;           // "MPI unavailable: ..." when api is null
  std::string library;          // the file loaded (or tried)
  std::string version;          // MPI_Get_library_version's first line, when loaded
};

// Loads libmpi.so.40 (or METRALE_MPI_LIBRARY) once per process (thread-safe) and returns the
// same result every time.
const MpiLoad& load_mpi();

// Loads the named library without caching (tests point it at missing files and at libraries
// without the entry points). On success the library stays loaded for the rest of the process.
MpiLoad load_mpi_from(const char* library);

// This process in MPI_COMM_WORLD, MPI initialized on first use (thread level MULTIPLE; finalized
// at exit when metrale initialized it).
struct MpiWorld {
  int rank = 0;
  int size = 1;
};

// Initializes MPI on api (once per process) and returns this process's place in the world.
// Throws Error(kUnavailable) when MPI cannot be initialized or lacks MPI_THREAD_MULTIPLE.
MpiWorld mpi_world(const MpiApi& api);

// Marks this process's MPI world as one a collective failed in (a peer may be gone): metrale's
// MPI_Finalize at exit, which waits on every rank, then gets at most max(wait, 5 s), the longest
// such wait, before the process ends with its own exit status without it (Note [MPI transport]).
// Safe from any thread, never throws.
void bound_mpi_finalize(std::chrono::milliseconds wait) noexcept;

// The text of an MPI error code ("MPI_ERR_TRUNCATE: message truncated").
std::string mpi_error_text(const MpiApi& api, int code);

}  // namespace metrale::comm
