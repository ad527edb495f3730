#!/bin/sh
# gtest_output.sh RUN: prints the lines GoogleTest 1.12 prints for one of five runs of two cases,
# and exits with its status (1 when a case failed), for the tests of gtest_skip_status.sh:
# fail_skip (one fails, one skips), pass_skip (one passes, one skips), skip (both skip), none
# (the filter matched nothing), pass (both pass).
run=$1
case $run in
fail_skip) a=FAILED b=SKIPPED passed=0 ;;
pass_skip) a=OK b=SKIPPED passed=1 ;;
skip) a=SKIPPED b=SKIPPED passed=0 ;;
pass) a=OK b=OK passed=2 ;;
none)
  printf '%s\n' '[==========] Running 0 tests from 0 test suites.' \
    '[==========] 0 tests from 0 test suites ran. (0 ms total)' '[  PASSED  ] 0 tests.'
  exit 0
  ;;
*)
  echo "gtest_output.sh: unknown run '$run'" >&2
  exit 2
  ;;
esac
tag() {  # GoogleTest's 10-character result tags
  case $1 in OK) echo '[       OK ]' ;; FAILED) echo '[  FAILED  ]' ;; SKIPPED) echo '[  SKIPPED ]' ;; esac
}
echo '[==========] Running 2 tests from 1 test suite.'
for c in "A $a" "B $b"; do
  set -- $c
  echo "[ RUN      ] Suite.Case$1/cuda"
  [ "$2" = SKIPPED ] && echo "backend 'cuda' is unavailable"
  [ "$2" = FAILED ] && echo "gemm_reference.h:99: Failure"
  echo "$(tag "$2") Suite.Case$1/cuda (0 ms)"
done
echo '[==========] 2 tests from 1 test suite ran. (0 ms total)'
[ "$passed" = 1 ] && echo '[  PASSED  ] 1 test.' || echo "[  PASSED  ] $passed tests."
status=0
for c in "A $a" "B $b"; do
  set -- $c
  [ "$2" = SKIPPED ] && echo "[  SKIPPED ] Suite.Case$1/cuda"
done
if [ "$a" = FAILED ]; then
  echo '[  FAILED  ] 1 test, listed below:'
  echo '[  FAILED  ] Suite.CaseA/cuda'
  echo
  echo ' 1 FAILED TEST'
  status=1
fi
exit $status
