#!/usr/bin/env bash
# gtest-no-skips.sh PROGRAM [ARG...]: runs a GoogleTest program, passes its output through, and
# exits with the program's own status when it failed, else 3 when it skipped any case, else 0.
# On a machine with a GPU a skipped gpu or /cuda case is a check that did not happen, never a
# pass: scripts/device-check.sh runs its GPU steps through this. METRALE_SKIPS_ALLOWED=1 lets
# skips through (device-check sets it where it finds no GPU, so its summary still tells a
# missing GPU from a failing one).
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# A failure is reported as itself, whatever else skipped.
((rc != 0)) && exit "$rc"
# GoogleTest prints "[  SKIPPED ] Suite.Case (N ms)" for each skipped case (and the name again,
# without the time, in its closing list).
skipped=$(grep -c '^\[  SKIPPED \] [^0-9].* ([0-9]* ms)$' "$log")
if ((skipped > 0)) && [[ ${METRALE_SKIPS_ALLOWED:-0} != 1 ]]; then
  echo "gtest-no-skips: $1 skipped $skipped case(s); on a GPU machine a skip is a failure" >&2
  exit 3
fi
exit "$rc"
