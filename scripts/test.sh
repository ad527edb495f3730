#!/usr/bin/env bash
# Every test, from a fresh checkout: formatting, the warnings-as-errors build and its tests
# (build/), then the whole suite again under AddressSanitizer + UBSan (build-asan/).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
scripts/check-format.sh

jobs=$(nproc)
cmake --preset ci
cmake --build --preset ci -j "$jobs"
ctest --preset ci -j "$jobs"

cmake --preset asan
cmake --build --preset asan -j "$jobs"
ctest --preset asan -j "$jobs"
