#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build for sm_90a (plus the other embedded targets), run the
# gpu-labelled tests, the GEMM numerics suite on the CUDA backend, the GPU GEMM benchmark with its
# peers (cuBLASLt in the same binary, torch from bench/gemm_peers.py), `metrale check --backend
# cuda`, `metrale bench --model llama3-70b`, the GPU soak and the rest of the suite, then print a
# summary table last. A 450 s budget (DEVICE_CHECK_BUDGET_S) keeps it inside 8 minutes whatever
# a step does.
# Packages: where .devdeps/ holds the .debs from scripts/device-deps.sh, they are unpacked into
# /tmp/devdeps first (the device machine has no package registry). Where .devdeps/build-device
# holds a build made by `scripts/device-deps.sh --prebuild` (build-device.tgz) and its programs start here, it is
# used as it is, which saves the minute or two of device time a build costs; else it builds here.
# Every log, the JSON results and the summary come back as $OUT/device-check.tgz (the device tool
# returns at most 8 files), the summary also as $OUT/summary.txt.
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
# DEVICE_CHECK_ONLY="a b": only those steps (a rerun after a fix), the others listed as not asked.
only=${DEVICE_CHECK_ONLY:-}
step() {  # step NAME LIMIT_S COMMAND...: runs under a time limit, logs to $out/NAME.log
  local name=$1 limit=$2
  shift 2
  if [[ -n "$only" && " $only " != *" $name "* ]]; then
    rows+=("$name|-|not asked (DEVICE_CHECK_ONLY)")
    return
  fi
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

devdeps_lib=/tmp/devdeps/usr/lib/x86_64-linux-gnu
if compgen -G ".devdeps/*.deb" >/dev/null; then
  for d in .devdeps/*.deb; do dpkg -x "$d" /tmp/devdeps; done
  export CMAKE_PREFIX_PATH=/tmp/devdeps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=$devdeps_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CPATH=/tmp/devdeps/usr/include${CPATH:+:$CPATH}
fi

# The cuobjdump and nvdisasm wheels (scripts/device-deps.sh), unpacked onto PATH for the
# offline fatbin test.
if compgen -G ".devdeps/wheels/*.whl" >/dev/null; then
  for w in .devdeps/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/devdeps/wheels; done
  for b in /tmp/devdeps/wheels/nvidia/*/bin; do chmod +x "$b"/*; PATH="$b:$PATH"; done
  export PATH
fi

# cuBLASLt says why it refuses a call (its errors only) in the logs of the steps that call it.
export CUBLASLT_LOG_LEVEL=${CUBLASLT_LOG_LEVEL:-1}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>/dev/null ||
  echo "no nvidia-smi: no NVIDIA driver here" >"$out/gpu.txt"
# On a GPU a skipped gpu or /cuda case fails its step (scripts/gtest-no-skips.sh): a skip there is
# a check that did not happen. Without one the skips are expected and the summary says why.
no_skips=scripts/gtest-no-skips.sh
grep -q "no NVIDIA driver" "$out/gpu.txt" && export METRALE_SKIPS_ALLOWED=1
# Most important first, so a slow build leaves the budget to the GPU checks, not to the rest.
# cuBLASLt (the BF16 roof) from the toolkit or from PyTorch's wheels, where the loader lacks it.
if ! ldconfig -p 2>/dev/null | grep -q libcublasLt; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in os.listdir(p)))' 2>/dev/null); do
    compgen -G "$d/libcublasLt.so*" >/dev/null && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
fi
# The Python package for the image's python3 (the one with torch), built in the background on
# 6 of the cores while the GPU steps run (the library and its fatbins again: the carried build is
# for this machine's Python, not the image's); its CUDA tests run last (python-gpu).
# Stage by stage, each named in the log, so a crash says where; the torch operator's C++ build is
# its own stage, and where it alone fails the tests run on the Python operator and say so.
py_pid=
if [[ -z "$only" || " $only " == *" python-gpu "* ]] &&
  python3 -c "import torch, nanobind, scikit_build_core" 2>/dev/null; then
  (
    set -e
    export PYTHONPATH=/tmp/metrale-py
    # Only the packages' libraries (libfmt): the CUDA libraries the steps above put on the path
    # are not torch's, and torch loading them aborted its import (free(): invalid pointer, run 6).
    export LD_LIBRARY_PATH=$devdeps_lib
    echo "== pip install"
    CMAKE_BUILD_PARALLEL_LEVEL=6 python3 -m pip install -q --no-build-isolation --no-deps \
      --no-index --target /tmp/metrale-py .
    echo "== import metrale"
    python3 -c "import metrale; print(metrale.__file__, metrale.backends())"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
    # torch first: with metrale's extension (and the carried libfmt.so.9) loaded before it, the
    # image's torch 2.11 aborted in its own import (free(): invalid pointer; run 6, 2026-12-04:
    # docs/GPU.md). In that order everything below passed.
    echo "== import metrale.torch, Python operator"
    METRALE_TORCH_NATIVE=0 python3 -c "import torch, metrale.torch as mt; print(mt.native())"
    echo "== import metrale.torch, C++ operator"
    python3 -c "import torch, metrale.torch as mt; print(mt.native())" ||
      touch /tmp/metrale-py/.no-native
  ) >"$out/python-build.log" 2>&1 &
  py_pid=$!
fi
prebuilt=no
if [[ -f .devdeps/build-device.tgz ]]; then
  mkdir -p .devdeps/build-device && tar -C .devdeps/build-device -xzf .devdeps/build-device.tgz
fi
if [[ -x .devdeps/build-device/metrale ]]; then
  rm -rf "$build" && cp -a .devdeps/build-device "$build"
  # ctest's files name the directory the build was configured in: point it here.
  src=$(cat .devdeps/build-device/.source-dir)
  if [[ "$src" != "$PWD" && ! -e "$src" ]]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
  "$build/metrale" --help >/dev/null 2>"$out/prebuilt.log" && prebuilt=yes
fi
if [[ $prebuilt == yes ]]; then
  rows+=("build|PREBUILT|carried")
else
  rm -rf "$build"
  step configure 60 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON
  step build 180 cmake --build "$build" -j "$(nproc)"
fi
step info 20 "$build/metrale" info
step gpu-tests 60 "$no_skips" "$build/tests/gpu_tests" --gtest_filter=-GpuSoak.*
# Each route forced over a few shapes against the CPU backend, case by case: which rows and
# columns are wrong or unwritten, and the inputs of every wrong case in probe.bin for offline study.
step probe 60 "$build/bench/bench_gemm_gpu_probe" --dump "$out"
# The numerics suite of part 1, unchanged, on the CUDA backend (its "/cuda" instances; ctest
# gpu.ops_numerics_suite), with its own limit.
# Not the two cases that skip on CUDA by design (the shape log needs its switch, which ctest's
# gemm_shape_log sets; only the CPU backend checks ranges against its blocks).
step numerics-cuda 90 "$no_skips" "$build/tests/ops_tests" \
  --gtest_filter='*/cuda:-GemmLogs.*:GemmArgs.RangesOutsideAnAllocationOnTheCpu/*'
# A failure there: the first failing test again under compute-sanitizer's memcheck, which names
# an out-of-bounds or misaligned access by kernel and address.
first_failed=$(grep -m1 -oP '^\[  FAILED  \] \K\S+/cuda' "$out/numerics-cuda.log" 2>/dev/null || true)
if [[ -n "$first_failed" ]] && command -v compute-sanitizer >/dev/null; then
  step memcheck 60 compute-sanitizer --tool memcheck --print-limit 20 \
    "$build/tests/ops_tests" --gtest_filter="$first_failed"
fi
# Every Llama-3 shape at M = 1, 16, 4096 against the copy bandwidth and cuBLASLt BF16 measured
# in the same run.
step bench-gemm-gpu 150 "$build/bench/bench_gemm_gpu" --quick --json "$out/gemm.jsonl"
step check-cuda 30 "$build/metrale" check --backend cuda
# Every route side by side with cuBLASLt BF16 (--compare-routes is the default on a GPU), the
# W8A8 column included (--allow-e4m3): the measured crossovers for docs/PERF.md's table, as JSON
# for the summary (gpu_summary.py prints the ratios).
# (--compare-routes named: the GPU default did not reach the JSON in run 6.)
step bench-70b 150 sh -c "'$build/metrale' bench --backend cuda --model llama3-70b \
  --m 1,16,256,4096 --allow-e4m3 --compare-routes --json > '$out/bench70b.json'"
# An MoE layer's grouped GEMMs on the GPU (opted in: no device has run them), each case checked
# against float64: the touched experts' bytes per second against the read roof.
step bench-moe 40 sh -c "'$build/metrale' bench --backend cuda --moe gpt-oss-20b \
  --allow-unverified --m 1,16,128 --repeats 5 --json > '$out/bench_moe.json'"
# The prefill route over the experts (gemm_grouped_fused, Note [grouped fused tiles]) at 32 and
# 256 rows an expert (gpt-oss-20b: 32 experts, top 4), and the decode kernels on the same
# shapes (bench_moe_decode.json) for the ratio.
step bench-moe-fused 60 sh -c "'$build/metrale' bench --backend cuda --moe gpt-oss-20b \
  --allow-unverified --moe-route fused --m 256,2048 --skew 0 --repeats 5 --json \
  > '$out/bench_moe_fused.json' && '$build/metrale' bench --backend cuda --moe gpt-oss-20b \
  --allow-unverified --moe-route decode --m 256,2048 --skew 0 --repeats 5 --json \
  > '$out/bench_moe_decode.json'"
# INT4 experts' prefill kernel (gemm_grouped_int4_fused, Note [grouped fused INT4]) and their
# decode kernel on Qwen3-30B-A3B-GPTQ-Int4's layers (groups of 128, FP16 scales) at 16 and 128
# rows an expert, each case checked against float64 (the fused one held to its weights' one
# rounding): the ratio that would set where kAuto takes it.
step bench-moe-int4 90 sh -c "'$build/metrale' bench --backend cuda --moe qwen3-30b-a3b-int4 \
  --allow-unverified --moe-route fused --m 256,2048 --skew 0 --repeats 5 --json \
  > '$out/bench_moe_int4_fused.json' && '$build/metrale' bench --backend cuda \
  --moe qwen3-30b-a3b-int4 --allow-unverified --moe-route decode --m 256,2048 --skew 0 \
  --repeats 5 --json > '$out/bench_moe_int4_decode.json'"
# FP8 experts' prefill kernel (gemm_grouped_e4m3_block128_tiled, Note [grouped FP8 tiles]) and
# their decode kernel on Qwen3-30B-A3B-FP8's layers at 16 and 128 rows an expert (128 experts,
# top 8), each case checked against float64: the ratio that would set its _min_m.
step bench-moe-fp8 60 sh -c "'$build/metrale' bench --backend cuda --moe qwen3-30b-a3b-fp8 \
  --allow-unverified --moe-route tiled --m 256,2048 --skew 0 --repeats 5 --json \
  > '$out/bench_moe_fp8_tiled.json' && '$build/metrale' bench --backend cuda \
  --moe qwen3-30b-a3b-fp8 --allow-unverified --moe-route decode --m 256,2048 --skew 0 \
  --repeats 5 --json > '$out/bench_moe_fp8_decode.json'"
# torch's peers on the same shapes (a line saying why where torch is absent).
step peers 90 sh -c "python3 bench/gemm_peers.py --quick > '$out/peers.jsonl'"
# 200 load-run-teardown cycles on the GPU, each verified, each back to zero live bytes and the
# driver's free memory after cycle 1 (tests/gpu/soak_test.cpp); its own step, for its own limit.
step gpu-soak 90 env METRALE_GPU_SOAK_CYCLES=200 "$no_skips" "$build/tests/gpu_tests" --gtest_filter='GpuSoak.*'
# The rest of the suite; not the two tests that run nvcc or a CMake install (minutes, and the
# same here as on the CPU machine).
# A carried build also skips cuda.fatbin_offline: it names the disassemblers by their paths on
# the machine that built it, and it read these very fatbins there.
skip="kernels_do_not_spill"
[[ $prebuilt == yes ]] && skip+="|cuda.fatbin_offline"
# And the tests that run the building machine's own tools or objects, which do not travel: its
# cmake's path (cmake -E env), its nvcc, and the object files the budget script disassembles.
[[ $prebuilt == yes ]] && skip+="|cpu.decode_avx2_budget|cuda.kernels_wgmma_not_serialized_planted"
[[ $prebuilt == yes ]] && skip+="|core.gtest_no_skips_allowed|cli.info_without_transports"
# Not the comm label either: MPI is the CPU's transport and the device machine has no OpenMPI
# (NCCL's one-rank test is in gpu-tests).
step other-tests 90 ctest --test-dir "$build" -LE "gpu|nogpu|install|comm" -E "$skip" \
  -j "$(nproc)" --output-on-failure
step bench-op-cache 20 "$build/bench/bench_op_cache" --benchmark_min_time=0.2
# Where time is left: Nsight Compute on the decode and tiled kernels of the 70B down layer
# (DRAM throughput and stall reasons; clocks left as they are).
if command -v ncu >/dev/null; then
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats"
  sections+=" --section LaunchStats --section Occupancy"
  step ncu 60 sh -c "for m in 1 4096; do ncu --clock-control none $sections -k regex:gemm_ -c 2 \
    $build/metrale bench --backend cuda --shapes 8192x28672 --m \$m --repeats 1; done"
fi

# The Python CUDA tests (python/tests/test_gpu.py): torch CUDA tensors through DLPack, the torch
# op and a whole transformers model on CUDA. A skip fails the step, as in gtest-no-skips.sh.
if [[ -n "$py_pid" ]]; then
  while kill -0 "$py_pid" 2>/dev/null && ((t0 + budget - $(date +%s) > 40)); do sleep 1; done
  if kill -0 "$py_pid" 2>/dev/null; then
    kill "$py_pid"
    rows+=("python-gpu|SKIPPED|its build outran the budget (python-build.log)")
  elif ! wait "$py_pid"; then
    tail -n 12 "$out/python-build.log"
    rows+=("python-gpu|FAIL|the package did not build or import (python-build.log)")
  else
    tail -n 12 "$out/python-build.log"
    native=
    [[ -e /tmp/metrale-py/.no-native ]] && native="METRALE_TORCH_NATIVE=0"
    [[ -n "$native" ]] && rows+=("python-op|FAIL|the C++ operator did not load (python-build.log)")
    step python-gpu 90 bash -c "set -o pipefail; $native PYTHONPATH=/tmp/metrale-py \
      LD_LIBRARY_PATH=$devdeps_lib python3 -c \
      \"import torch, sys, pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', \
      'python/tests/test_gpu.py']))\" 2>&1 | tee /tmp/pytest-gpu.log || exit
      ! grep -q skipped /tmp/pytest-gpu.log || { echo 'a skip on a GPU machine'; exit 3; }"
  fi
elif [[ -n "$only" && " $only " != *" python-gpu "* ]]; then
  rows+=("python-gpu|-|not asked (DEVICE_CHECK_ONLY)")
else
  rows+=("python-gpu|SKIPPED|python3 lacks torch, nanobind or scikit-build-core")
fi

{
echo
echo "== device-check summary ($(cat "$out/gpu.txt" 2>/dev/null | head -1)), $(($(date +%s) - t0))s =="
printf '%-16s %-10s %s\n' step result time
for r in "${rows[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-16s %-10s %s\n' "$a" "$b" "$c"; done
for log in gpu-tests numerics-cuda gpu-soak; do
  skipped=$(grep -m1 -oP '^\[  SKIPPED \] \K\d+(?= tests?,)' "$out/$log.log" 2>/dev/null || true)
  echo "$log skipped: ${skipped:-0}${METRALE_SKIPS_ALLOWED:+ (allowed: no GPU here)}"
done
grep -h "^soak gpu" "$out/gpu-soak.log" 2>/dev/null ||
  echo "gpu soak: no figures (skipped or failed: see $out/gpu-soak.log)"
python3 scripts/gpu_summary.py "$out/gemm.jsonl" "$out/peers.jsonl" "$out/bench70b.json" 2>&1 || true
} 2>&1 | tee /tmp/device-check-summary.txt
tar czf /tmp/device-check.tgz -C "$out" . && rm -rf "${out:?}"/* &&
  mv /tmp/device-check.tgz "$out/" && cp /tmp/device-check-summary.txt "$out/summary.txt"
