#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build for sm_90a (plus the other embedded targets), run the
# gpu-labelled tests, the GEMM numerics suite on the CUDA backend, the GPU GEMM benchmark with its
# peers (cuBLASLt in the same binary, torch from bench/gemm_peers.py), `metrale check --backend
# cuda`, `metrale bench --model llama3-70b`, the GPU soak and the rest of the suite, then print a
# summary table last. A 450 s budget (DEVICE_CHECK_BUDGET_S) keeps it inside 8 minutes whatever
# a step does.
# Packages: where .devdeps/ holds the .debs from scripts/device-deps.sh, they are unpacked into
# /tmp/devdeps first (the device machine has no package registry).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device-check}
mkdir -p "$out"
build=build-device
declare -a rows
t0=$(date +%s)

# The whole run stays inside 8 minutes: each step's limit is cut to what is left of the budget,
# and a step with nothing left is skipped (and says so in the summary).
budget=${DEVICE_CHECK_BUDGET_S:-450}
step() {  # step NAME LIMIT_S COMMAND...: runs under a time limit, logs to $out/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((t0 + budget - $(date +%s)))
  if ((left < 5)); then
    rows+=("$name|SKIPPED|budget spent")
    return
  fi
  ((limit > left)) && limit=$left
  local s=$(date +%s) rc=0
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if ((rc == 0)); then rows+=("$name|PASS|$(($(date +%s) - s))s")
  elif ((rc == 124)); then rows+=("$name|TIMEOUT|${limit}s")
  else rows+=("$name|FAIL ($rc)|$(($(date +%s) - s))s"); fi
  tail -n 25 "$out/$name.log"
}

if compgen -G ".devdeps/*.deb" >/dev/null; then
  for d in .devdeps/*.deb; do dpkg -x "$d" /tmp/devdeps; done
  export CMAKE_PREFIX_PATH=/tmp/devdeps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=/tmp/devdeps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CPATH=/tmp/devdeps/usr/include${CPATH:+:$CPATH}
fi

# The cuobjdump and nvdisasm wheels (scripts/device-deps.sh), unpacked onto PATH for the
# offline fatbin test.
if compgen -G ".devdeps/wheels/*.whl" >/dev/null; then
  for w in .devdeps/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/devdeps/wheels; done
  for b in /tmp/devdeps/wheels/nvidia/*/bin; do chmod +x "$b"/*; PATH="$b:$PATH"; done
  export PATH
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>/dev/null ||
  echo "no nvidia-smi: no NVIDIA driver here" >"$out/gpu.txt"
# Most important first, so a slow build leaves the budget to the GPU checks, not to the rest.
step configure 60 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON
step build 180 cmake --build "$build" -j "$(nproc)"
step info 20 "$build/metrale" info
step gpu-tests 60 ctest --test-dir "$build" -L gpu -E "GpuSoak|gpu.ops_numerics_suite" --output-on-failure
# The numerics suite of part 1, unchanged, on the CUDA backend (its "/cuda" instances; ctest
# gpu.ops_numerics_suite), with its own limit.
step numerics-cuda 90 "$build/tests/ops_tests" --gtest_filter='*/cuda' --gtest_brief=1
# Every Llama-3 shape at M = 1, 16, 4096 against the copy bandwidth and cuBLASLt BF16 measured
# in the same run; then torch's peers on the same shapes (a line saying why where torch is absent).
step bench-gemm-gpu 120 "$build/bench/bench_gemm_gpu" --quick --json "$out/gemm.jsonl"
step peers 90 sh -c "python3 bench/gemm_peers.py --quick > '$out/peers.jsonl'"
step check-cuda 30 "$build/metrale" check --backend cuda
step bench-70b 60 "$build/metrale" bench --backend cuda --model llama3-70b --m 1,16,4096
# 200 load-run-teardown cycles on the GPU, each verified, each back to zero live bytes and the
# driver's free memory after cycle 1 (tests/gpu/soak_test.cpp); its own step, for its own limit.
step gpu-soak 90 env METRALE_GPU_SOAK_CYCLES=200 "$build/tests/gpu_tests" --gtest_filter='GpuSoak.*'
step other-tests 90 ctest --test-dir "$build" -LE "gpu|nogpu" -j "$(nproc)" --output-on-failure
step bench-op-cache 20 "$build/bench/bench_op_cache" --benchmark_min_time=0.2

echo
echo "== device-check summary ($(cat "$out/gpu.txt" 2>/dev/null | head -1)), $(($(date +%s) - t0))s =="
printf '%-16s %-10s %s\n' step result time
for r in "${rows[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-16s %-10s %s\n' "$a" "$b" "$c"; done
skipped=$(grep -c "\*\*\*Skipped" "$out/gpu-tests.log" 2>/dev/null || true)
echo "gpu tests skipped: ${skipped:-0} (a skip means no usable GPU: see $out/gpu-tests.log)"
grep -h "^soak gpu" "$out/gpu-soak.log" 2>/dev/null ||
  echo "gpu soak: no figures (skipped or failed: see $out/gpu-soak.log)"
python3 scripts/gpu_summary.py "$out/gemm.jsonl" "$out/peers.jsonl" 2>&1 || true
