// The NCCL transport: collectives of the CUDA backend's buffers, enqueued on its streams and
// waited for against the timeout (nonblocking communicators, polled, aborted on time-out).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>

#include "metrale/communicator.h"

namespace metrale {
class CudaBackend;
}

namespace metrale::cuda {

struct NcclApi;  // cuda/nccl_api.h

// How this rank joins: its place, and how NCCL's unique id (128 bytes) reaches every rank.
// exchange(id, rank) is called on every rank with rank 0's id filled in; on return every
// rank's id holds rank 0's. It throws (kTimeout, kIo, ...) when that cannot happen in time.
struct NcclJoin {
  int rank = 0;
  int size = 1;
  std::function<void(std::span<std::byte> id)> exchange;
};

// A communicator on backend through api. Throws kDriver naming the NCCL call and its error
// when NCCL refuses, kTimeout (after aborting what it began) when the ranks do not all join
// within options.timeout.
std::unique_ptr<Communicator> make_nccl_communicator(CudaBackend& backend, const NcclApi& api,
                                                     const NcclJoin& join,
                                                     const CommunicatorOptions& options);

}  // namespace metrale::cuda
