#!/usr/bin/env bash
# Installs the Debian packages metrale builds and tests with, only when one is missing.
# The CUDA toolkit is optional and never installed here: where nvcc exists the build finds it.
set -euo pipefail

# clang-16 and libclang-rt-16-dev: libFuzzer for scripts/fuzz.sh (clang 14 lacks
# __builtin_source_location, which <source_location> needs). OpenMPI: mpi.h for the MPI
# transport (its library is loaded at run time) and mpirun for the multi-rank tests.
packages=(cmake ninja-build g++ git libfmt-dev libcli11-dev nlohmann-json3-dev python3-venv python3-dev
  libgtest-dev libgmock-dev libbenchmark-dev clang-format python3 python3-pip
  clang-16 libclang-rt-16-dev openmpi-bin libopenmpi-dev)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  sudo=""
  [[ "$(id -u)" -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The safetensors tests write their files with the reference Python package (and numpy), run by
# the python3 on PATH, so that is the interpreter they go to. A Debian-managed python3 refuses a
# plain pip install (PEP 668); the packages then go to the user's site directory.
if ! python3 -c "import safetensors, numpy" 2>/dev/null; then
  echo "install-deps: installing the Python packages safetensors and numpy for $(command -v python3)"
  python3 -m pip install -q safetensors numpy ||
    python3 -m pip install -q --user --break-system-packages safetensors numpy
fi

# cuobjdump and nvdisasm (NVIDIA's PyPI wheels; the toolkit here ships neither): the offline
# fatbin test reads the kernels' published symbols and their SASS with them.
if ! python3 -c "import nvidia, os, sys; p = list(nvidia.__path__)[0]; sys.exit(not any(os.path.exists(os.path.join(p, d, 'bin', 'nvdisasm')) for d in os.listdir(p)))" 2>/dev/null; then
  echo "install-deps: installing nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm for $(command -v python3)"
  python3 -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    python3 -m pip install -q --user --break-system-packages nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
fi
