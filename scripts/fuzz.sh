#!/usr/bin/env bash
# The libFuzzer targets (fuzz/, docs/RELIABILITY.md, "Fuzzing"): builds the fuzz preset (clang 16,
# ASan + UBSan, build-fuzz/), replays every kept crash input (fuzz/regressions/<target>/), then
# runs each target for SECONDS (default 60) on a copy of its committed corpus, so the corpus in
# the tree never grows. Fails if any target crashes; prints the executions of each at the end.
# Crash inputs are left in build-fuzz/artifacts/.
#
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}

scripts/install-deps.sh
cmake --preset fuzz >/dev/null
targets=(fuzz_module_image fuzz_safetensors fuzz_gemm_args)
cmake --build --preset fuzz -j "$(nproc)" --target "${targets[@]}"

# The reader's and the ops' errors are exceptions, and ASan's fake stacks for use-after-return
# are garbage-collected on every throw: a third of the run time with them on. Leaks and every
# other check stay on; an exit on the first report keeps the input.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_stack_use_after_return=0:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

declare -A extra=(
  [fuzz_module_image]="-dict=fuzz/module_image.dict"
  [fuzz_safetensors]="-dict=fuzz/safetensors.dict -max_len=1024"
  [fuzz_gemm_args]=""
)
artifacts=build-fuzz/artifacts
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"

failed=()
summary=()
for t in "${targets[@]}"; do
  bin=build-fuzz/fuzz/$t
  cp -r "fuzz/corpus/$t" "$work/$t-corpus"
  regressions=(fuzz/regressions/"$t"/*)
  seeds=("$work/$t-corpus")
  if [[ -e ${regressions[0]} ]]; then
    seeds+=("fuzz/regressions/$t")  # read as seeds too; new inputs go to the copy only
    echo "fuzz: $t: replaying ${#regressions[@]} kept crash input(s)"
    if ! "$bin" "${regressions[@]}" >"$work/$t.replay.log" 2>&1; then
      tail -n 40 "$work/$t.replay.log"
      failed+=("$t (a kept crash input crashes again)")
      continue
    fi
  fi
  echo "fuzz: $t: ${seconds} s on a copy of fuzz/corpus/$t"
  # shellcheck disable=SC2086  # extra holds several flags
  if "$bin" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$t-" ${extra[$t]} "${seeds[@]}" >"$work/$t.log" 2>&1; then
    status=ok
  else
    status=CRASH
    tail -n 60 "$work/$t.log"
    failed+=("$t (see $artifacts/)")
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/$t.log")
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$work/$t.log" | tail -n 1)
  summary+=("$(printf '%-18s %-6s %12s executions %8s/s  %s' "$t" "$status" "${execs:-?}" \
    "${rate:-?}" "${cov:-}")")
done

echo
echo "fuzz: results"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
  printf 'fuzz: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
