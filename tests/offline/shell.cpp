#include "shell.h"

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>

namespace metrale::offline {

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

Ran run(const std::string& command) {
  Ran r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[65536];
  std::size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, got);
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

std::string cuobjdump_command(const std::string& cuobjdump, const std::string& nvdisasm,
                              const std::string& args) {
  const std::string dir = std::filesystem::path(nvdisasm).parent_path().string();
  return "PATH=" + quoted(dir) + ":\"$PATH\" " + quoted(cuobjdump) + " " + args;
}

std::string missing_disassemblers(const std::string& cuobjdump, const std::string& nvdisasm) {
  if (cuobjdump.empty() || nvdisasm.empty()) {
    return "cuobjdump or nvdisasm was not found when cmake ran: run scripts/install-deps.sh (it "
           "installs nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm), then re-run cmake";
  }
  for (const std::string& tool : {cuobjdump, nvdisasm}) {
    if (!std::filesystem::exists(tool)) return tool + " is gone: run scripts/install-deps.sh";
  }
  return {};
}

}  // namespace metrale::offline
