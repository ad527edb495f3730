#include "ops/pack_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "metrale/error.h"

namespace metrale::ops::pack {

void check_source(std::string_view api, const HostQuantWeights& w, std::int64_t pad_n,
                  std::int64_t pad_k) {
  if (w.format != WeightFormat::kNvfp4 && w.format != WeightFormat::kMxfp4) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("unknown weight format {}", static_cast<int>(w.format)));
  }
  if (w.layout != WeightLayout::kRowMajor && w.layout != WeightLayout::kTransposed) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("unknown weight layout {}", static_cast<int>(w.layout)));
  }
  const int group = group_size(w.format);
  if (w.n <= 0) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("n = {} <= 0", w.n));
  if (w.k <= 0) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("k = {} <= 0", w.k));
  if (w.k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("k = {} is not a multiple of {}'s group of {}", w.k,
                            to_string(w.format), group));
  }
  // The padded buffers must be addressable too.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 4;
  if (w.n > kMax / (w.k + pad_k) - pad_n) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("n = {} x k = {} is too large to address", w.n, w.k));
  }
  const auto codes = static_cast<std::size_t>(w.n * (w.k / 2));
  const auto scales = static_cast<std::size_t>(w.n * (w.k / group));
  if (w.codes.size() != codes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} weights of n = {}, k = {} need {} code bytes, got {}",
                            to_string(w.format), w.n, w.k, codes, w.codes.size()));
  }
  if (w.scales.size() != scales) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} weights of n = {}, k = {} need {} scale bytes, got {}",
                            to_string(w.format), w.n, w.k, scales, w.scales.size()));
  }
}

void split(std::int64_t count, std::int64_t per_thread,
           void (*fn)(void* context, std::int64_t begin, std::int64_t end), void* context) {
  const std::int64_t hw = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  const std::int64_t parts = std::clamp<std::int64_t>(count / std::max<std::int64_t>(1, per_thread),
                                                      1, std::min<std::int64_t>(hw, 16));
  std::vector<std::thread> threads;
  std::int64_t done = 0;
  try {
    for (std::int64_t i = 1; i < parts; ++i) {
      const std::int64_t b = count * i / parts, e = count * (i + 1) / parts;
      threads.emplace_back(fn, context, b, e);
      done = e;
    }
  } catch (const std::system_error&) {
    // No thread to spare: the ranges not started run on this thread below.
  }
  fn(context, 0, count / parts);
  if (done < count) fn(context, std::max(done, count / parts), count);
  for (std::thread& t : threads) t.join();
}

}  // namespace metrale::ops::pack
