#!/bin/sh
# expect_exit.sh CODE COMMAND [ARG...]: runs COMMAND, passes its output through, and fails unless
# it exits with CODE. It prints "exit CODE as expected" only then, and the ctest cases that use it
# require that line in their PASS_REGULAR_EXPRESSION (which makes ctest ignore the exit status).
want=$1
shift
"$@"
got=$?
if [ "$got" -ne "$want" ]; then
  echo "expect_exit: $1 exited $got, expected $want" >&2
  exit 1
fi
echo "expect_exit: exit $want as expected"
