// One Python call's plumbing, shared by Model's calls (gemm.cpp, moe.cpp): the caller's arrays
// lent to the backend for the call, the stream it runs on, and its errors named by the call.
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string_view>

#include "arrays.h"
#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/foreign_stream.h"
#include "metrale/ledger.h"

namespace metrale::py {

// The caller's array lent to the backend for one call: borrowed unless the backend owns it
// already, given back (after the device is done with it) when the call ends, however it ends.
class Loan {
 public:
  // ordered: given back without waiting (Backend::unborrow_ordered), for a call queued on its
  // caller's stream.
  Loan(Backend& backend, const LedgerProbe& probe, const ArrayArg& arg, bool ordered)
      : backend_(backend), ordered_(ordered) {
    if (const auto entry = probe.containing(arg.ptr.address())) {
      if (entry->kind != MemoryKind::kBorrowed) return;  // the backend's own: the op checks it
    }
    backend.borrow(arg.ptr, arg.bytes);
    ptr_ = arg.ptr;
  }
  Loan(const Loan&) = delete;
  Loan& operator=(const Loan&) = delete;
  ~Loan() {
    if (!ptr_) return;
    try {
      if (ordered_) {
        backend_.unborrow_ordered(ptr_);
      } else {
        backend_.unborrow(ptr_);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "metrale: %s\n", e.what());  // a destructor must not throw
    }
  }

 private:
  Backend& backend_;
  bool ordered_;
  DevicePtr ptr_;
};

// Where one call's work goes: the model's own stream, waited for before the call returns, or the
// caller's stream (Note [foreign streams] in docs/NOTES.md), adopted for the call and left for
// its owner to wait on.
class CallStream {
 public:
  CallStream(Backend& backend, std::optional<std::uint64_t> raw) : backend_(backend) {
    if (raw) foreign_.emplace(backend, *raw);
  }
  StreamHandle handle() const { return foreign_ ? foreign_->handle() : backend_.default_stream(); }
  // Whether the operands go back in stream order rather than after a wait.
  bool ordered() const { return foreign_.has_value(); }
  // Waits for the call's work when it ran on the model's own stream.
  void finish() const {
    if (!foreign_) backend_.synchronize(backend_.default_stream());
  }

 private:
  Backend& backend_;
  std::optional<ForeignStream> foreign_;
};

inline bool overlap(const ArrayArg& x, const ArrayArg& y) {
  return x.ptr.address() < y.ptr.address() + y.bytes && y.ptr.address() < x.ptr.address() + x.bytes;
}

// Runs make() and re-attributes its Error to api: the user called api, not the op inside it.
template <class F>
auto as_call(std::string_view api, F&& make) {
  try {
    return make();
  } catch (const Error& e) {
    if (e.api() == api) throw;
    throw Error(e.code(), api, e.message());
  }
}

}  // namespace metrale::py
