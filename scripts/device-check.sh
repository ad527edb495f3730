#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build for sm_90a (plus the other embedded targets), run the
# gpu-labelled tests, the rest of the suite, `metrale check --backend cuda`,
# `metrale bench --model llama3-70b` and the benchmarks, then print a summary table last. Meant to finish well inside 8 minutes on an H100/H200.
# Packages: where .devdeps/ holds the .debs from scripts/device-deps.sh, they are unpacked into
# /tmp/devdeps first (the device machine has no package registry).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device-check}
mkdir -p "$out"
build=build-device
declare -a rows
t0=$(date +%s)

step() {  # step NAME COMMAND...: runs, logs to $out/NAME.log, records pass/fail and seconds
  local name=$1
  shift
  local s=$(date +%s)
  if "$@" >"$out/$name.log" 2>&1; then rows+=("$name|PASS|$(($(date +%s) - s))s")
  else rows+=("$name|FAIL ($?)|$(($(date +%s) - s))s"); fi
  tail -n 25 "$out/$name.log"
}

if compgen -G ".devdeps/*.deb" >/dev/null; then
  for d in .devdeps/*.deb; do dpkg -x "$d" /tmp/devdeps; done
  export CMAKE_PREFIX_PATH=/tmp/devdeps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=/tmp/devdeps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CPATH=/tmp/devdeps/usr/include${CPATH:+:$CPATH}
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON
step build cmake --build "$build" -j "$(nproc)"
step info "$build/metrale" info
step gpu-tests ctest --test-dir "$build" -L gpu --output-on-failure
step other-tests ctest --test-dir "$build" -LE "gpu|nogpu" -j "$(nproc)" --output-on-failure
step check-cuda "$build/metrale" check --backend cuda
step bench-70b "$build/metrale" bench --backend cuda --model llama3-70b --m 1,16,4096
step bench-op-cache "$build/bench/bench_op_cache" --benchmark_min_time=0.2

echo
echo "== device-check summary ($(cat "$out/gpu.txt" 2>/dev/null | head -1)), $(($(date +%s) - t0))s =="
printf '%-16s %-10s %s\n' step result time
for r in "${rows[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-16s %-10s %s\n' "$a" "$b" "$c"; done
skipped=$(grep -c "Skipped" "$out/gpu-tests.log" 2>/dev/null || true)
echo "gpu tests skipped: ${skipped:-0} (a skip means no usable GPU: see $out/gpu-tests.log)"
