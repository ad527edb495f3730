// The metrale CLI's commands. Each returns the process exit code: 0 ok, 1 a check failed,
// 2 bad usage or input.
#pragma once

#include <string>

namespace metrale::cli {

struct CommonOptions {
  std::string backend = "auto";  // auto, cpu or cuda
  bool json = false;             // one JSON document on stdout instead of tables
};

// Lists every backend, its availability (or the reason it is unavailable), and the loaded
// modules with each kernel's published metadata.
int run_info(const CommonOptions& options);

// Runs the self-check on the chosen backend: every op end to end against a float64 reference,
// capture and replay, scratch, and a teardown that must leave zero live bytes.
int run_check(const CommonOptions& options);

}  // namespace metrale::cli
