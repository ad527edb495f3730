// One whole model lifecycle, the same on every backend: make the backend (discovery and module
// loading happen in the caller's factory) → ModelScope → weights (ops::WeightsResource, and
// alloc_weights through pinned staging), op scratch, buffers, a stream and an event → every op
// (fill_u32, axpy_f32, copy_2d, cast_bf16_to_e4m3, w4a16_gemm on the decode, tiled and e4m3
// routes) checked against a float64 reference on fresh random data into poisoned outputs →
// capture a graph of ops, replay it twice, check again → teardown. The fault sweeps run it once
// per injected failure, the soaks thousands of times, the GPU soak on real hardware.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"

namespace metrale::testing::reliability {

// Sizes of one lifecycle. K must be a multiple of 32 (MXFP4 blocks).
struct Shapes {
  std::int64_t n = 48, k = 64;  // both weight matrices are [N, K]
  std::int64_t m_decode = 3, m_tiled = 20, m_e4m3 = 9;
  std::size_t elems = 1000;  // fill_u32, axpy_f32 and cast_bf16_to_e4m3 length
};

// Small shapes for the soaks: every step still runs, each a few microseconds.
inline constexpr Shapes kSoakShapes{
    .n = 16, .k = 32, .m_decode = 1, .m_tiled = 2, .m_e4m3 = 2, .elems = 64};

struct Hooks {
  // Makes the backend: discovery and module loading. May throw metrale::Error.
  std::function<std::unique_ptr<Backend>()> make_backend;
  // Called at teardown, after every other model resource was released and before the op scratch
  // and the ledger sweep: returns the streams, events and graphs still alive (0 when the backend
  // cannot say). A CPU sweep also reads its fault counts here, while the backend still exists.
  std::function<std::size_t(Backend&)> at_teardown;
};

// What one run did.
struct Outcome {
  std::optional<Error> error;   // the metrale::Error a step threw, when one did
  std::string other_exception;  // what() of any other exception (a failure wherever it occurs)
  bool verified = false;        // every step ran and every result matched its reference
  bool scope_built = false;     // make_backend returned, so the teardown figures below are real
  TeardownReport teardown;
  std::size_t live_bytes_after = 0;  // ledger, after teardown
  std::size_t live_allocs_after = 0;
  std::size_t handles_at_teardown = 0;  // what Hooks::at_teardown returned
  // The error's message, or "" when the run completed.
  std::string message() const { return error ? error->what() : other_exception; }
};

// Runs one lifecycle with data from gen. Never throws (a result mismatch is other_exception,
// starting "verification:"); always tears the model down when it was built.
Outcome run_lifecycle(const Hooks& hooks, const Shapes& shapes, std::mt19937_64& gen);

}  // namespace metrale::testing::reliability
