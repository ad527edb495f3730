// Collectives across ranks, for tensor parallelism (docs/ARCHITECTURE.md, "Tensor parallelism").
//
// A Communicator joins `size` processes, one rank each. Every rank calls the same collectives in
// the same order with the same sizes; each works on buffers of the model's backend and returns
// once the result is in place on this rank (a blocking call: see Note [collectives block] in
// docs/NOTES.md). No call waits forever: each has the communicator's timeout, after which it
// throws Error(kTimeout). The first failure of any kind latches: the communicator tells the other
// ranks (so theirs fail at once with this rank's reason, not at their timeout), and every later
// call on it throws Error(kState) naming that first failure.
//
// Two transports implement it: MPI (OpenMPI, loaded at run time; any backend, through host
// staging) and NCCL (loaded at run time; the CUDA backend). create_communicator picks one.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "metrale/handles.h"
#include "metrale/model_scope.h"

namespace metrale {

class Backend;

// The element type of a reduction.
enum class ReduceType { kBf16, kF32 };

// "bf16", "f32".
std::string_view to_string(ReduceType type) noexcept;

// How create_communicator joins the ranks.
struct CommunicatorOptions {
  // "auto" (NCCL on a CUDA backend when it loads, else MPI), "mpi" or "nccl".
  std::string transport = "auto";
  // NCCL's unique id travels through this file (rank 0 writes it, the others wait for it) when
  // set, else through MPI. Use a fresh path per job: rank 0 removes it once every rank joined.
  std::string id_file;
  // With id_file: this process's rank and the number of ranks. -1: from MPI when it is loaded,
  // else from the launcher's environment (OMPI_COMM_WORLD_RANK/SIZE, then RANK/WORLD_SIZE).
  int rank = -1;
  int size = -1;
  // The longest any one call (creation included) may take.
  std::chrono::milliseconds timeout{60'000};
};

// One rank's end of a group of ranks.
class Communicator {
 public:
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator();

  // This process's rank, 0 ≤ rank < size.
  int rank() const noexcept { return rank_; }
  // The number of ranks.
  int size() const noexcept { return size_; }
  // "mpi" or "nccl".
  virtual std::string_view transport() const noexcept = 0;
  // The limit on each call.
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  // The backend whose buffers the collectives take.
  Backend& backend() const noexcept { return backend_; }

  // out[i] = the sum over ranks of in[i], count elements of type; in and out may be the same
  // buffer. Every rank gets the same bits. MPI sums in rank order in FP32 and rounds once (BF16);
  // NCCL sums in its own fixed order (its algorithm for this size and rank count).
  void all_reduce_sum(DevicePtr in, DevicePtr out, std::size_t count, ReduceType type,
                      StreamHandle stream = {});
  // out (size × bytes) = every rank's `bytes` of in, rank r's at offset r × bytes.
  void all_gather(DevicePtr in, DevicePtr out, std::size_t bytes, StreamHandle stream = {});
  // buffer's bytes on every rank = root's.
  void broadcast(DevicePtr buffer, std::size_t bytes, int root, StreamHandle stream = {});
  // Returns once every rank has called it.
  void barrier();

  // Marks this communicator failed with reason and tells the other ranks, so that their current
  // or next call fails at once naming this rank and reason. Call it when this rank cannot go on
  // (an op failed mid-layer); the first failure is the one kept. Never throws.
  void abort(std::string_view reason) noexcept;
  // Whether a call failed or abort() was called.
  bool failed() const;
  // The first failure's message ("" while none).
  std::string failure() const;
  // Gives the transport's resources back; later calls throw kState. A second call does nothing.
  void release();

 protected:
  Communicator(Backend& backend, int rank, int size, std::chrono::milliseconds timeout);

  // ---- what a transport supplies; arguments are checked, the latch is the base's ----
  virtual void raw_all_reduce_sum(DevicePtr in, DevicePtr out, std::size_t count, ReduceType type,
                                  StreamHandle stream) = 0;
  virtual void raw_all_gather(DevicePtr in, DevicePtr out, std::size_t bytes,
                              StreamHandle stream) = 0;
  virtual void raw_broadcast(DevicePtr buffer, std::size_t bytes, int root,
                             StreamHandle stream) = 0;
  virtual void raw_barrier() = 0;
  // Best effort: tell the other ranks this one failed with message. Never throws.
  virtual void raw_abort(const std::string& message) noexcept = 0;
  // Gives everything back; called once, failed or not. May throw.
  virtual void raw_release() = 0;

 private:
  // Throws kState after a failure or release.
  void require_live(std::string_view api) const;
  // Runs one collective's transport part: an error latches and is sent to the other ranks.
  template <class F>
  void run(std::string_view api, F&& body);
  void latch(const std::string& message) noexcept;

  Backend& backend_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  struct Latch;
  std::unique_ptr<Latch> latch_;
};

// A communicator owned by a model: released at teardown, before the buffers it worked on.
class CommunicatorResource final : public ModelResource {
 public:
  explicit CommunicatorResource(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  std::string label() const override { return "communicator"; }
  void release(Backend& backend) override;
  // The communicator (valid until teardown).
  Communicator& get() const noexcept { return *comm_; }

 private:
  std::unique_ptr<Communicator> comm_;
};

// What a process can use for collectives: one entry per transport, as `metrale info` lists them.
struct TransportInfo {
  std::string name;        // "mpi", "nccl"
  bool available = false;  // whether the library loaded
  std::string detail;      // the library and version when available, else why not
};

// Loads (once) and reports every transport; never throws.
std::vector<TransportInfo> discover_transports();

// Joins the ranks on backend's buffers with options' transport, as a resource of scope (so the
// model's teardown releases it). Throws kUnavailable naming why a transport cannot be used,
// kInvalidArgument for bad options, kTimeout when the other ranks do not join in time.
Communicator& create_communicator(ModelScope& scope, const CommunicatorOptions& options = {});

// The same, owned by the caller (released by its destructor when release() was not called).
std::unique_ptr<Communicator> make_communicator(Backend& backend,
                                                const CommunicatorOptions& options = {});

}  // namespace metrale
