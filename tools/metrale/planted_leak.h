// A testing switch, compiled in only by the metrale-planted-leak test build: with
// METRALE_CLI_PLANT_LEAK defined, check and bench leave one allocation that no resource owns, so
// the ledger sweep at teardown finds it and the CLI must fail, naming this file:line
// (tests/CMakeLists.txt, cli.*_fails_on_a_swept_leak). The installed metrale never defines it.
#pragma once

#include "metrale/backend.h"

namespace metrale::cli {

// Allocates 4321 bytes that nobody frees, in the test build only; does nothing otherwise.
inline void plant_leak_for_tests([[maybe_unused]] Backend& backend) {
#ifdef METRALE_CLI_PLANT_LEAK
  (void)backend.alloc(4321);
#endif
}

}  // namespace metrale::cli
