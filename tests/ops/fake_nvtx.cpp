// A stand-in libnvToolsExt.so.1 for the NVTX test (ctest ops.nvtx puts its folder on
// LD_LIBRARY_PATH): it keeps the ranges pushed and popped so the test can read them back.
#include <mutex>
#include <string>
#include <vector>

namespace {
std::mutex g_mu;
std::vector<std::string> g_pushed;
int g_depth = 0;
}  // namespace

extern "C" {

int nvtxRangePushA(const char* message) {
  std::lock_guard lock(g_mu);
  g_pushed.emplace_back(message != nullptr ? message : "");
  return g_depth++;
}

int nvtxRangePop() {
  std::lock_guard lock(g_mu);
  return --g_depth;
}

// Ranges open now (pushes minus pops).
int fake_nvtx_depth() {
  std::lock_guard lock(g_mu);
  return g_depth;
}

// How many pushes named message there were.
int fake_nvtx_pushes(const char* message) {
  std::lock_guard lock(g_mu);
  int n = 0;
  for (const std::string& m : g_pushed) n += m == message ? 1 : 0;
  return n;
}
}
