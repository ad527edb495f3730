#!/usr/bin/env bash
# Every test, from a fresh checkout: formatting; the warnings-as-errors build and its tests
# (build/); the Python package's pytest suite (scripts/python-test.sh); the whole suite again
# under AddressSanitizer + UBSan (build-asan/); the concurrency tests under ThreadSanitizer
# (build-tsan/); and each libFuzzer target for FUZZ_SECONDS (default 20) on its committed
# corpus, after replaying every kept crash input (build-fuzz/).
set -euo pipefail
cd "$(dirname "$0")/.."
# A failing test's own output in the log. See Note [failing test output in the log] in
# docs/NOTES.md.
export CTEST_OUTPUT_ON_FAILURE=1

scripts/install-deps.sh
scripts/check-format.sh
scripts/check-layering.sh

jobs=$(nproc)
cmake --preset ci
cmake --build --preset ci -j "$jobs"
ctest --preset ci -j "$jobs"
# The Python package, installed by pip over the ci tree (the library is not built again).
scripts/python-test.sh

cmake --preset asan
cmake --build --preset asan -j "$jobs"
ctest --preset asan -j "$jobs"

cmake --preset tsan
cmake --build --preset tsan -j "$jobs"
ctest --preset tsan -j "$jobs"

scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
