// A fake NCCL for tests: fills an NcclApi table with functions that model one rank's side of
// the library on the fake driver's memory (device pointers are host addresses there). Data moves
// as a group of one would move it (a sum over one rank is a copy), so the transport's mapping of
// each collective onto NCCL's call is what the tests check. Communicators are nonblocking, as
// metrale makes them: init and each call may stay ncclInProgress, and the fake can be told to
// keep them so (a peer that never comes), to fail init or a collective with a status, or to fail
// finalize.
//
// Only one FakeNccl may exist at a time (the table's plain functions reach it through a
// process-wide pointer); constructing a second throws std::logic_error.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/nccl_api.h"

namespace metrale::cuda::testing {

class FakeNccl {
 public:
  FakeNccl();
  FakeNccl(const FakeNccl&) = delete;
  FakeNccl& operator=(const FakeNccl&) = delete;
  ~FakeNccl();

  // The table (valid while this fake lives).
  const NcclApi& api() const;

  // ---- set-up ----
  // ncclCommInitRankConfig returns status (ncclSuccess: normal).
  void fail_init(ncclResult_t status);
  // A communicator made from now on stays ncclInProgress: its peers never arrive.
  void hang_init(bool hang);
  // The next collectives return status (ncclSuccess: normal).
  void fail_collectives(ncclResult_t status);
  // Collectives from now on leave the communicator ncclInProgress (a peer never joins).
  void hang_collectives(bool hang);
  // ncclCommFinalize returns status (ncclSuccess: normal).
  void fail_finalize(ncclResult_t status);

  // ---- observation ----
  // How many times `call` (a name of METRALE_NCCL_FUNCTIONS) was made; std::invalid_argument
  // for any other name.
  std::uint64_t calls(const std::string& call) const;
  // Communicators made and neither destroyed nor aborted.
  int live_comms() const;
  // The rank, size and blocking flag of the last init.
  int last_rank() const;
  int last_size() const;
  int last_blocking() const;
  // The stream of the last collective.
  cudaStream_t last_stream() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace metrale::cuda::testing
