// The MPI transport. Every collective is one nonblocking MPI call on host staging, waited on by
// polling against the timeout, with a header per rank that says which collective this is (its
// number, kind and size), so ranks that disagree get an error naming both calls instead of
// garbage. A second duplicate of the world carries abort messages: each rank keeps a receive
// posted on it and checks it while it waits. See Note [MPI transport] in docs/NOTES.md.
#include "comm/mpi_communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_api.h"
#include "comm/mpi_loader.h"
#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Which collective a header belongs to.
enum class Kind : std::uint32_t {
  kJoin = 1,
  kReduceBf16,
  kReduceF32,
  kGather,
  kBroadcast,
  kBarrier
};

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::kJoin:
      return "create";
    case Kind::kReduceBf16:
      return "all_reduce_sum(bf16)";
    case Kind::kReduceF32:
      return "all_reduce_sum(f32)";
    case Kind::kGather:
      return "all_gather";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
  }
  return "unknown";
}

// Leads each rank's piece of a collective. 32 bytes keep the payload 16-byte aligned.
struct Header {
  std::uint64_t sequence = 0;  // the collective's number on this communicator, from 1
  std::uint32_t kind = 0;
  std::uint32_t rank = 0;
  std::uint64_t bytes = 0;  // payload bytes of one rank
  std::uint64_t magic = kMagic;
  static constexpr std::uint64_t kMagic = 0x6d6574726c636f6dULL;  // "metrlcom"
};
static_assert(sizeof(Header) == 32);

constexpr int kAbortTag = 7;
constexpr std::size_t kAbortBytes = 1024;

// Staging MPI may still write after a call gave up on it (an MPI collective cannot be
// cancelled). It is kept for the life of the process rather than freed under MPI.
void keep_forever(std::vector<std::byte>&& bytes) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::vector<std::byte>>;
  std::lock_guard lock(mu);
  kept->push_back(std::move(bytes));
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(Backend& backend, const MpiApi& api, int rank, int size,
                  std::chrono::milliseconds timeout, MPI_Comm data, MPI_Comm control)
      : Communicator(backend, rank, size, timeout),
        api_(api),
        data_(data),
        control_(control),
        abort_recv_(api.request_null) {}

  ~MpiCommunicator() override {
    try {
      release();
    } catch (...) {  // a destructor reports nothing: release() is where failures surface
    }
  }

  std::string_view transport() const noexcept override { return "mpi"; }

  // Checks that every rank joined, within the timeout, and takes rank 0's token as this group's;
  // then posts the abort receive.
  void join() {
    std::uint64_t token = 0;
    if (rank() == 0) {
      std::random_device device;
      while (token == 0) token = (std::uint64_t{device()} << 32) ^ device();
    }
    std::memcpy(payload_in(sizeof token), &token, sizeof token);
    exchange("Communicator::create", Kind::kJoin, sizeof token);
    std::memcpy(&token_, payload_of(0, sizeof token), sizeof token);
    post_abort_receive();
  }

 protected:
  void raw_all_reduce_sum(DevicePtr in, DevicePtr out, std::size_t count, ReduceType type,
                          StreamHandle stream) override {
    constexpr std::string_view kApi = "Communicator::all_reduce_sum";
    const bool bf16 = type == ReduceType::kBf16;
    const std::size_t each = bf16 ? 2 : 4;
    const std::size_t bytes = count * each;
    backend().copy_d2h_after(payload_in(bytes), in, bytes, stream);
    exchange(kApi, bf16 ? Kind::kReduceBf16 : Kind::kReduceF32, bytes);
    // Rank order, one FP32 sum per element, one rounding: the same bits on every rank and run.
    sum_.assign(count, 0.0f);
    for (int r = 0; r < size(); ++r) {
      const std::byte* piece = payload_of(r, bytes);
      if (bf16) {
        for (std::size_t i = 0; i < count; ++i) {
          std::uint16_t h;
          std::memcpy(&h, piece + i * 2, 2);
          sum_[i] += num::bf16_to_f32(h);
        }
      } else {
        for (std::size_t i = 0; i < count; ++i) {
          float f;
          std::memcpy(&f, piece + i * 4, 4);
          sum_[i] += f;
        }
      }
    }
    if (bf16) {
      result_.resize(bytes);
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t h = num::f32_to_bf16(sum_[i]);
        std::memcpy(result_.data() + i * 2, &h, 2);
      }
      backend().copy_h2d(out, result_.data(), bytes);
    } else {
      backend().copy_h2d(out, sum_.data(), bytes);
    }
  }

  void raw_all_gather(DevicePtr in, DevicePtr out, std::size_t bytes,
                      StreamHandle stream) override {
    backend().copy_d2h_after(payload_in(bytes), in, bytes, stream);
    exchange("Communicator::all_gather", Kind::kGather, bytes);
    result_.resize(bytes * static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r) {
      std::memcpy(result_.data() + static_cast<std::size_t>(r) * bytes, payload_of(r, bytes),
                  bytes);
    }
    backend().copy_h2d(out, result_.data(), result_.size());
  }

  void raw_broadcast(DevicePtr buffer, std::size_t bytes, int root, StreamHandle stream) override {
    constexpr std::string_view kApi = "Communicator::broadcast";
    const std::size_t piece = piece_bytes(kApi, bytes);
    in_.resize(piece);
    const Header mine = header(Kind::kBroadcast, bytes);
    std::memcpy(in_.data(), &mine, sizeof mine);
    if (rank() == root) {
      backend().copy_d2h_after(in_.data() + sizeof(Header), buffer, bytes, stream);
    } else {
      backend().synchronize(stream);  // nothing queued before may still read the buffer
    }
    check_abort(kApi);
    MPI_Request request = api_.request_null;
    check(kApi, "MPI_Ibcast",
          api_.MPI_Ibcast(in_.data(), static_cast<int>(piece), api_.byte, root, data_, &request));
    wait(kApi, request, mine);
    if (rank() != root) {
      Header theirs;
      std::memcpy(&theirs, in_.data(), sizeof theirs);
      theirs.rank = static_cast<std::uint32_t>(root);  // the root wrote its own rank
      match(kApi, mine, theirs, root);
      backend().copy_h2d(buffer, in_.data() + sizeof(Header), bytes);
    }
  }

  void raw_barrier() override { exchange("Communicator::barrier", Kind::kBarrier, 0); }

  void raw_abort(const std::string& message) noexcept override {
    bound_mpi_finalize(timeout());  // a group that failed may have lost a rank
    // One message to each other rank; small sends complete eagerly. Waits at most 200 ms so an
    // abort on a group whose peers are gone cannot hang.
    // The group's token first: OpenMPI reuses a freed communicator's context id, so a message
    // sent to a group that is gone can reach a later one, which must know it is not its own.
    abort_text_.assign(reinterpret_cast<const char*>(&token_), sizeof token_);
    abort_text_.append(message, 0, kAbortBytes - 1 - sizeof token_);
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      MPI_Request request = api_.request_null;
      if (api_.MPI_Isend(abort_text_.data(), static_cast<int>(abort_text_.size()), api_.byte, r,
                         kAbortTag, control_, &request) == MPI_SUCCESS) {
        sends.push_back(request);
      }
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(200);
    for (MPI_Request& request : sends) {
      int done = 0;
      while (request != api_.request_null &&
             api_.MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0 &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (done == 0 && request != api_.request_null) {
        api_.MPI_Request_free(&request);
        sends_pending_ = true;  // the text must outlive the send
      }
    }
  }

  void raw_release() override {
    if (abort_recv_ != api_.request_null) {
      api_.MPI_Cancel(&abort_recv_);
      int done = 0;
      const auto deadline = Clock::now() + std::chrono::seconds(1);
      while (api_.MPI_Test(&abort_recv_, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done == 0 &&
             Clock::now() < deadline) {
        std::this_thread::yield();
      }
      if (done == 0) keep_forever(std::move(abort_in_));
    }
    if (in_flight_) {
      keep_forever(std::move(in_));
      keep_forever(std::move(all_));
    }
    if (sends_pending_) {
      std::vector<std::byte> text(abort_text_.size());
      std::memcpy(text.data(), abort_text_.data(), text.size());
      keep_forever(std::move(text));
    }
    // OpenMPI hands a freed communicator's context id to the next one made, and messages still
    // travelling to the old one are then matched by the new one: a collective given up on, or
    // abort messages, would corrupt a later group (seen with four ranks: a new group's first
    // exchange completed on stale data). So the communicators of a group that failed anywhere
    // are kept for the life of the process; a clean group's are freed.
    if (failed()) return;
    const int a = api_.MPI_Comm_free(&data_);
    const int b = api_.MPI_Comm_free(&control_);
    if (a != MPI_SUCCESS || b != MPI_SUCCESS) {
      throw Error(ErrorCode::kDriver, "Communicator::release",
                  "MPI_Comm_free: " + mpi_error_text(api_, a != MPI_SUCCESS ? a : b));
    }
  }

 private:
  Header header(Kind kind, std::size_t bytes) const {
    Header h;
    h.sequence = sequence_;
    h.kind = static_cast<std::uint32_t>(kind);
    h.rank = static_cast<std::uint32_t>(rank());
    h.bytes = bytes;
    return h;
  }

  // A rank's piece (header and payload) as MPI counts it.
  static std::size_t piece_bytes(std::string_view api, std::size_t bytes) {
    constexpr std::size_t kLimit = 0x7fffffff - sizeof(Header);
    if (bytes > kLimit) {
      throw Error(
          ErrorCode::kInvalidArgument, api,
          fmt::format("{} bytes per rank exceed MPI's count limit ({} bytes)", bytes, kLimit));
    }
    return sizeof(Header) + bytes;
  }

  // Where this rank's payload is staged before exchange().
  std::byte* payload_in(std::size_t bytes) {
    in_.resize(sizeof(Header) + bytes);
    return in_.data() + sizeof(Header);
  }
  const std::byte* payload_of(int r, std::size_t bytes) const {
    return all_.data() + static_cast<std::size_t>(r) * (sizeof(Header) + bytes) + sizeof(Header);
  }

  // All-gathers this rank's header and staged payload into all_, then checks every header.
  void exchange(std::string_view api, Kind kind, std::size_t bytes) {
    ++sequence_;
    const std::size_t piece = piece_bytes(api, bytes);
    in_.resize(piece);
    const Header mine = header(kind, bytes);
    std::memcpy(in_.data(), &mine, sizeof mine);
    all_.resize(piece * static_cast<std::size_t>(size()));
    check_abort(api);
    MPI_Request request = api_.request_null;
    check(api, "MPI_Iallgather",
          api_.MPI_Iallgather(in_.data(), static_cast<int>(piece), api_.byte, all_.data(),
                              static_cast<int>(piece), api_.byte, data_, &request));
    wait(api, request, mine);
    for (int r = 0; r < size(); ++r) {
      Header theirs;
      std::memcpy(&theirs, all_.data() + static_cast<std::size_t>(r) * piece, sizeof theirs);
      match(api, mine, theirs, r);
    }
  }

  // Throws, naming both calls, when rank r's header is not this rank's call.
  void match(std::string_view api, const Header& mine, const Header& theirs, int r) const {
    if (theirs.magic == Header::kMagic && theirs.sequence == mine.sequence &&
        theirs.kind == mine.kind && theirs.bytes == mine.bytes) {
      return;
    }
    throw Error(
        ErrorCode::kState, api,
        fmt::format("rank {} made collective #{} a {} of {} bytes, but rank {} made it a "
                    "{} of {} bytes: the ranks called different collectives",
                    r, theirs.sequence, kind_name(static_cast<Kind>(theirs.kind)), theirs.bytes,
                    rank(), kind_name(static_cast<Kind>(mine.kind)), mine.bytes));
  }

  void check(std::string_view api, std::string_view call, int rc) const {
    if (rc != MPI_SUCCESS) {
      throw Error(ErrorCode::kDriver, api, fmt::format("{}: {}", call, mpi_error_text(api_, rc)));
    }
  }

  void post_abort_receive() {
    abort_in_.assign(kAbortBytes, std::byte{0});
    check("Communicator::create", "MPI_Irecv",
          api_.MPI_Irecv(abort_in_.data(), static_cast<int>(kAbortBytes), api_.byte, MPI_ANY_SOURCE,
                         kAbortTag, control_, &abort_recv_));
  }

  // Throws the first other rank's abort message of this group when one has arrived; a message
  // of an earlier group (see raw_abort) is dropped and the receive posted again.
  void check_abort(std::string_view api) {
    while (abort_recv_ != api_.request_null) {
      int arrived = 0;
      check(api, "MPI_Test", api_.MPI_Test(&abort_recv_, &arrived, MPI_STATUS_IGNORE));
      if (arrived == 0) return;
      std::uint64_t token = 0;
      std::memcpy(&token, abort_in_.data(), sizeof token);
      if (token != token_) {
        post_abort_receive();
        continue;
      }
      // A C string after the token; the buffer was zeroed and holds at most kAbortBytes - 1.
      const char* text = reinterpret_cast<const char*>(abort_in_.data() + sizeof token);
      throw Error(ErrorCode::kState, api,
                  fmt::format("{} (this rank: {} of {})", text, rank(), size()));
    }
  }

  // Polls request until it completes, an abort arrives or the timeout passes. While it is in
  // flight the staging is MPI's: on any way out but completion, release keeps it forever.
  void wait(std::string_view api, MPI_Request& request, const Header& mine) {
    in_flight_ = true;
    const auto start = Clock::now();
    const auto deadline = start + timeout();
    for (std::uint64_t spins = 0;; ++spins) {
      int done = 0;
      check(api, "MPI_Test", api_.MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done != 0) {
        in_flight_ = false;
        return;
      }
      check_abort(api);
      if (Clock::now() >= deadline) {
        throw Error(ErrorCode::kTimeout, api,
                    fmt::format("collective #{} ({}, {} bytes per rank) did not complete within "
                                "{} ms on rank {} of {}: another rank is stuck, gone, or never "
                                "made this call",
                                mine.sequence, kind_name(static_cast<Kind>(mine.kind)), mine.bytes,
                                timeout().count(), rank(), size()));
      }
      // Spin briefly (a collective among processes on one node takes microseconds), then
      // sleep so a long wait does not take a core from the ranks it waits for.
      if (spins < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  const MpiApi& api_;
  MPI_Comm data_;
  MPI_Comm control_;
  MPI_Request abort_recv_ = nullptr;  // set to api_.request_null by the constructor
  std::uint64_t sequence_ = 0;
  std::uint64_t token_ = 0;     // rank 0's random number, the same on every rank of the group
  bool in_flight_ = false;      // a collective was left pending (its buffers are MPI's)
  bool sends_pending_ = false;  // an abort send was left pending (its text is MPI's)
  std::vector<std::byte> in_, all_, result_, abort_in_;
  std::vector<float> sum_;
  std::string abort_text_;
};

// Polls request until it completes (true) or the deadline passes (false, the request left
// pending); a failed MPI_Test throws kDriver under api.
bool settled(const MpiApi& api, std::string_view api_name, MPI_Request& request,
             Clock::time_point deadline) {
  for (;;) {
    int done = 0;
    const int rc = api.MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      throw Error(ErrorCode::kDriver, api_name, "MPI_Test: " + mpi_error_text(api, rc));
    }
    if (done != 0) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// MPI_Comm_idup, waited on against the deadline (MPI_Comm_dup would block without a limit).
MPI_Comm duplicate(const MpiApi& api, Clock::time_point deadline,
                   std::chrono::milliseconds timeout) {
  constexpr std::string_view kApi = "Communicator::create";
  MPI_Comm comm = nullptr;
  MPI_Request request = api.request_null;
  int rc = api.MPI_Comm_idup(api.comm_world, &comm, &request);
  if (rc != MPI_SUCCESS) {
    throw Error(ErrorCode::kDriver, kApi, "MPI_Comm_idup: " + mpi_error_text(api, rc));
  }
  if (!settled(api, kApi, request, deadline)) {
    throw Error(ErrorCode::kTimeout, kApi,
                fmt::format("the ranks did not all join within {} ms", timeout.count()));
  }
  rc = api.MPI_Comm_set_errhandler(comm, api.errors_return);
  if (rc != MPI_SUCCESS) {
    api.MPI_Comm_free(&comm);
    throw Error(ErrorCode::kDriver, kApi, "MPI_Comm_set_errhandler: " + mpi_error_text(api, rc));
  }
  return comm;
}

const MpiApi& loaded_api() {
  const MpiLoad& load = load_mpi();
  if (load.api == nullptr)
    throw Error(ErrorCode::kUnavailable, "Communicator::create", load.reason);
  return *load.api;
}

}  // namespace

MpiPlace mpi_place() {
  const MpiWorld world = mpi_world(loaded_api());
  return {world.rank, world.size};
}

void mpi_broadcast_bytes(std::span<std::byte> bytes, int root, std::chrono::milliseconds timeout) {
  constexpr std::string_view kApi = "Communicator::create";
  const MpiApi& api = loaded_api();
  mpi_world(api);
  const auto deadline = Clock::now() + timeout;
  MPI_Comm comm = duplicate(api, deadline, timeout);
  // MPI's own copy: if the wait gives up, MPI may still write it, so it is then kept forever.
  std::vector<std::byte> staging(bytes.begin(), bytes.end());
  MPI_Request request = api.request_null;
  const int rc = api.MPI_Ibcast(staging.data(), static_cast<int>(staging.size()), api.byte, root,
                                comm, &request);
  if (rc != MPI_SUCCESS) {
    api.MPI_Comm_free(&comm);
    throw Error(ErrorCode::kDriver, kApi, "MPI_Ibcast: " + mpi_error_text(api, rc));
  }
  if (!settled(api, kApi, request, deadline)) {
    // Left pending: the staging and the communicator stay MPI's (Note [MPI transport]: a freed
    // communicator's id is reused, and the broadcast's messages would reach its successor).
    keep_forever(std::move(staging));
    throw Error(ErrorCode::kTimeout, kApi,
                fmt::format("rank {}'s NCCL id did not reach every rank within {} ms", root,
                            timeout.count()));
  }
  api.MPI_Comm_free(&comm);
  std::copy(staging.begin(), staging.end(), bytes.begin());
}

std::unique_ptr<Communicator> make_mpi_communicator(Backend& backend,
                                                    const CommunicatorOptions& options) {
  constexpr std::string_view kApi = "Communicator::create";
  const MpiApi& api = loaded_api();
  const MpiWorld world = mpi_world(api);
  if ((options.rank >= 0 && options.rank != world.rank) ||
      (options.size >= 0 && options.size != world.size)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("rank {} of {} was asked for, but MPI says this process is rank {} "
                            "of {}",
                            options.rank, options.size, world.rank, world.size));
  }
  const auto deadline = Clock::now() + options.timeout;
  MPI_Comm data = duplicate(api, deadline, options.timeout);
  MPI_Comm control = nullptr;
  try {
    control = duplicate(api, deadline, options.timeout);
  } catch (...) {
    api.MPI_Comm_free(&data);
    throw;
  }
  auto comm = std::make_unique<MpiCommunicator>(backend, api, world.rank, world.size,
                                                options.timeout, data, control);
  comm->join();
  return comm;
}

}  // namespace metrale::comm
