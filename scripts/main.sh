#!/usr/bin/env bash
# The main job, from a fresh checkout: install what is missing, build, then show the backends
# (`metrale info`) and run the self-check on the best backend present (`metrale check`).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target metrale-cli
build/metrale info
build/metrale check "$@"
