#!/usr/bin/env bash
# Installs the Debian packages metrale builds and tests with, only when one is missing.
# The CUDA toolkit is optional and never installed here: where nvcc exists the build finds it.
set -euo pipefail

packages=(cmake ninja-build g++ git libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev clang-format)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
((${#missing[@]} == 0)) && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[[ "$(id -u)" -ne 0 ]] && sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
