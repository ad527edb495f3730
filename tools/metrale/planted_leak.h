// A testing switch for the metrale-planted-leak test build: there check and bench leave one
// allocation that no resource owns, so the ledger sweep at teardown finds it and the CLI must
// fail, naming planted_leak.cpp:line (tests/CMakeLists.txt, cli.*_fails_on_a_swept_leak). Only
// planted_leak.cpp differs between the two programs, compiled with METRALE_CLI_PLANT_LEAK for
// the test build; the installed metrale never defines it.
#pragma once

#include "metrale/backend.h"

namespace metrale::cli {

// Allocates 4321 bytes that nobody frees, in the test build only; does nothing otherwise.
void plant_leak_for_tests(Backend& backend);

}  // namespace metrale::cli
