// The rules every transport shares (include/metrale/communicator.h): argument checks, the
// failure latch, telling the other ranks, and release. A transport supplies the raw_* calls.
#include "metrale/communicator.h"

#include <fmt/format.h>

#include <limits>
#include <mutex>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale {

std::string_view to_string(ReduceType type) noexcept {
  switch (type) {
    case ReduceType::kBf16:
      return "bf16";
    case ReduceType::kF32:
      return "f32";
  }
  return "unknown";
}

struct Communicator::Latch {
  mutable std::mutex mu;
  std::string failure;  // the first failure; "" while none
  bool released = false;
};

Communicator::Communicator(Backend& backend, int rank, int size, std::chrono::milliseconds timeout)
    : backend_(backend),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      latch_(std::make_unique<Latch>()) {}

Communicator::~Communicator() = default;

bool Communicator::failed() const {
  std::lock_guard lock(latch_->mu);
  return !latch_->failure.empty();
}

std::string Communicator::failure() const {
  std::lock_guard lock(latch_->mu);
  return latch_->failure;
}

void Communicator::latch(const std::string& message) noexcept {
  std::lock_guard lock(latch_->mu);
  if (latch_->failure.empty()) latch_->failure = message.empty() ? "unknown failure" : message;
}

void Communicator::abort(std::string_view reason) noexcept {
  std::string message;
  try {
    message = fmt::format("rank {} of {} failed: {}", rank_, size_, reason);
  } catch (...) {
    message = "a rank failed";
  }
  bool first = false;
  {
    std::lock_guard lock(latch_->mu);
    if (latch_->released) return;
    first = latch_->failure.empty();
  }
  latch(std::string(reason));
  // Only the first failure is sent: a peer that already heard of one learns nothing new.
  if (first) raw_abort(message);
}

// A collective is checked on a live communicator first: a bad argument is refused before the
// transport is touched, so it latches nothing and the ranks stay in step. A failure once the
// transport has the call latches and is sent to the other ranks before it goes on to the
// caller (Note [collective failures] in docs/NOTES.md).
void Communicator::require_live(std::string_view api) const {
  std::lock_guard lock(latch_->mu);
  if (latch_->released) throw Error(ErrorCode::kState, api, "the communicator was released");
  if (!latch_->failure.empty()) {
    throw Error(ErrorCode::kState, api,
                fmt::format("the communicator failed earlier: {}", latch_->failure));
  }
}

template <class F>
void Communicator::run(std::string_view api, F&& body) {
  try {
    body();
  } catch (const Error& e) {
    abort(e.what());
    throw;
  } catch (const std::exception& e) {
    abort(e.what());
    throw Error(ErrorCode::kInternal, api, e.what());
  }
}

namespace {

std::size_t element_bytes(ReduceType type) {
  return type == ReduceType::kBf16 ? 2 : 4;
}

// The bytes of count elements, refusing a product that does not fit.
std::size_t checked_bytes(std::string_view api, std::size_t count, std::size_t each) {
  if (count > std::numeric_limits<std::size_t>::max() / each) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("count {} overflows a byte size", count));
  }
  return count * each;
}

void require_pointer(std::string_view api, std::string_view what, DevicePtr p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("{} is null", what));
}

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlap(DevicePtr a, std::size_t a_bytes, DevicePtr b, std::size_t b_bytes) {
  return a.address() < b.address() + b_bytes && b.address() < a.address() + a_bytes;
}

}  // namespace

void Communicator::all_reduce_sum(DevicePtr in, DevicePtr out, std::size_t count, ReduceType type,
                                  StreamHandle stream) {
  constexpr std::string_view kApi = "Communicator::all_reduce_sum";
  require_live(kApi);
  if (count == 0) return;
  const std::size_t bytes = checked_bytes(kApi, count, element_bytes(type));
  require_pointer(kApi, "in", in);
  require_pointer(kApi, "out", out);
  backend_.check_range(kApi, "in", in, bytes);
  backend_.check_range(kApi, "out", out, bytes);
  if (in != out && overlap(in, bytes, out, bytes)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                "in and out overlap without being the same buffer");
  }
  const StreamHandle s = stream ? stream : backend_.default_stream();
  run(kApi, [&] { raw_all_reduce_sum(in, out, count, type, s); });
}

void Communicator::all_gather(DevicePtr in, DevicePtr out, std::size_t bytes, StreamHandle stream) {
  constexpr std::string_view kApi = "Communicator::all_gather";
  require_live(kApi);
  if (bytes == 0) return;
  const std::size_t total = checked_bytes(kApi, bytes, static_cast<std::size_t>(size_));
  require_pointer(kApi, "in", in);
  require_pointer(kApi, "out", out);
  backend_.check_range(kApi, "in", in, bytes);
  backend_.check_range(kApi, "out", out, total);
  // In place means this rank's piece already sits at its slot of out, as NCCL allows.
  const DevicePtr own_slot = out.offset(static_cast<std::uint64_t>(rank_) * bytes);
  if (in != own_slot && overlap(in, bytes, out, total)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("in overlaps out without being rank {}'s slot of it", rank_));
  }
  const StreamHandle s = stream ? stream : backend_.default_stream();
  run(kApi, [&] { raw_all_gather(in, out, bytes, s); });
}

void Communicator::broadcast(DevicePtr buffer, std::size_t bytes, int root, StreamHandle stream) {
  constexpr std::string_view kApi = "Communicator::broadcast";
  require_live(kApi);
  if (root < 0 || root >= size_) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("root {} is not a rank of {}", root, size_));
  }
  if (bytes == 0) return;
  require_pointer(kApi, "buffer", buffer);
  backend_.check_range(kApi, "buffer", buffer, bytes);
  const StreamHandle s = stream ? stream : backend_.default_stream();
  run(kApi, [&] { raw_broadcast(buffer, bytes, root, s); });
}

void Communicator::barrier() {
  require_live("Communicator::barrier");
  run("Communicator::barrier", [&] { raw_barrier(); });
}

void Communicator::release() {
  {
    std::lock_guard lock(latch_->mu);
    if (latch_->released) return;
    latch_->released = true;
  }
  raw_release();
}

void CommunicatorResource::release(Backend& /*backend*/) {
  if (comm_) comm_->release();
}

}  // namespace metrale
