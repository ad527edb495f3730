// Running the disassemblers from the offline tests: a command line's words quoted for the shell,
// a command's exit status and output, and cuobjdump's command line with nvdisasm on its PATH.
#pragma once

#include <string>

namespace metrale::offline {

// s as one single-quoted shell word.
std::string quoted(const std::string& s);

struct Ran {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs a shell command, its stdout and stderr together; status -1 when it could not run or did
// not exit.
Ran run(const std::string& command);

// The command line of cuobjdump (at `cuobjdump`) with `args`: cuobjdump prints SASS through
// nvdisasm, which it looks for on PATH, so `nvdisasm`'s folder goes first there.
std::string cuobjdump_command(const std::string& cuobjdump, const std::string& nvdisasm,
                              const std::string& args);

// Why the offline tests cannot run the disassemblers found when cmake ran (not found then, or
// gone since), or empty when both are there.
std::string missing_disassemblers(const std::string& cuobjdump, const std::string& nvdisasm);

}  // namespace metrale::offline
