// Finding NCCL at run time. Loading never crashes and never throws: a machine without a usable
// library gets a reason that starts with "NCCL unavailable:", and the rest of metrale works.
#pragma once

#include <string>

namespace metrale::cuda {

struct NcclApi;  // cuda/nccl_api.h

// The first ncclGetVersion (major * 10000 + minor * 100 + patch) with every entry point of the
// table and nonblocking communicators: 2.14.0.
inline constexpr int kMinNcclVersion = 21400;

struct NcclLoad {
  const NcclApi* api = nullptr;  // null when the library is unusable
  std::string reason;            // "NCCL unavailable: ..." when api is null
  std::string library;           // the file loaded (or last tried)
  int version = 0;               // ncclGetVersion, when it could be asked
};

// "2.28.9" for 22809.
std::string nccl_version_string(int version);

// Loads libnccl.so.2 once per process (thread-safe; METRALE_NCCL_LIBRARY, when set, is the
// one file tried) and returns the same result every time.
const NcclLoad& load_nccl();

// Loads the named library without caching (tests point it at missing files and libraries that
// lack the entry points). On success the library stays loaded for the rest of the process.
NcclLoad load_nccl_from(const char* library);

}  // namespace metrale::cuda
