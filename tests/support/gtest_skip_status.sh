#!/usr/bin/env bash
# gtest_skip_status.sh PROGRAM [ARG...]: runs a whole GoogleTest program as one ctest test and
# gives ctest its verdict, the output passed through:
# - the program's own status when it is not 0 (a failed case, a crash): a skip never hides a
#   failure. SKIP_REGULAR_EXPRESSION would: ctest marks a matching test skipped whatever its
#   exit code (CMake's SKIP_REGULAR_EXPRESSION documentation), so one failed case among skipped
#   ones would read as a skip;
# - 77 when it passed but skipped a case, or ran none (the test sets SKIP_RETURN_CODE 77, so
#   ctest reports it as skipped, "Not Run", and its own exit status stays 0): a case that
#   skipped was not checked, and a run that checked only some of its cases is not a pass;
# - 0 when every case it ran passed.
# GoogleTest (1.12) prints "[  SKIPPED ] Suite.Case (N ms)" for each skipped case (and the name
# again, without the time, in its closing list), and
# "[  PASSED  ] 0 tests." when none passed.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if ((rc != 0)); then
  exit "$rc"
fi
skipped=$(grep -c '^\[  SKIPPED \] [^0-9].* ([0-9]* ms)$' "$log")
if ((skipped > 0)); then
  echo "gtest_skip_status: $1 skipped $skipped case(s): reported to ctest as skipped"
  exit 77
fi
if grep -q '^\[  PASSED  \] 0 tests\.' "$log"; then
  echo "gtest_skip_status: $1 ran no case: reported to ctest as skipped"
  exit 77
fi
exit 0
