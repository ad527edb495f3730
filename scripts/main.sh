#!/usr/bin/env bash
# The main job, from a fresh checkout: install what is missing, build, show the backends
# (`metrale info`), then benchmark Llama-3 8B's GEMMs on the best device present, every result
# checked and the model torn down to zero bytes (`metrale bench`). Arguments go to the bench.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target metrale-cli
build/metrale info
build/metrale bench "$@"
