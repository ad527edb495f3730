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

# One line per stage with the minutes so far, so a slow CI run says where its time went.
start=$SECONDS
stage() { printf '== test.sh: %s (at %d:%02d)\n' "$1" $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)); }

stage "dependencies, format, layering"
scripts/install-deps.sh
scripts/check-format.sh
scripts/check-layering.sh

jobs=$(nproc)
stage "ci build"
cmake --preset ci
cmake --build --preset ci -j "$jobs"
stage "ci tests"
ctest --preset ci -j "$jobs"
stage "python package"
# The Python package, installed by pip over the ci tree (the library is not built again).
scripts/python-test.sh

stage "asan build"
# The sanitizer trees copy the ci tree's kernel modules (Note [kernel images from another tree]).
cmake --preset asan -DMETRALE_KERNEL_IMAGES_FROM="$PWD/build"
cmake --build --preset asan -j "$jobs"
stage "asan tests"
ctest --preset asan -j "$jobs"

stage "tsan build and tests"
cmake --preset tsan -DMETRALE_KERNEL_IMAGES_FROM="$PWD/build"
cmake --build --preset tsan -j "$jobs"
ctest --preset tsan -j "$jobs"

stage "fuzz"
scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
stage "done"
