#!/usr/bin/env bash
# Run HERE (a machine with the package registry) before a device run: downloads the Debian
# packages the build needs into .devdeps/ (ignored by git), which the device run carries and
# scripts/device-check.sh unpacks, since the GPU machine has no package registry.
# With --prebuild it also builds what device-check.sh runs (Release, CUDA on) here and keeps the
# programs, ctest's files and the fatbins (no objects) in .devdeps/build-device.tgz, so the device
# minutes go to the GPU, not to the compiler; device-check.sh builds there if they do not start.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >> .git/info/exclude
mkdir -p .devdeps
cd .devdeps
apt-get download libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev \
  libbenchmark-dev libbenchmark1debian >/dev/null
ls -1 *.deb
# cuobjdump and nvdisasm (NVIDIA's PyPI wheels, ~5.5 MB): ctest cuda.fatbin_offline reads the
# fatbins with them, and the device machine's toolkit may lack them as this one's does.
python3 -m pip download -q --no-deps -d wheels nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
ls -1 wheels/*.whl
if [[ "${1:-}" == --prebuild ]]; then
  cd ..
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON >/dev/null
  cmake --build build-device
  rm -rf .devdeps/build-device
  # -h: links (the stub driver points into this machine's toolkit) travel as files.
  tar -C build-device -hcf - --exclude "*.o" --exclude "*.a" --exclude CMakeFiles --exclude ".ninja*" . \
    | (mkdir -p .devdeps/build-device && tar -C .devdeps/build-device -xf -)
  echo "$PWD" >.devdeps/build-device/.source-dir
  # Stripped and compressed: each program links the library statically, and the 66 MB they take
  # as they are would not fit a device call's 64 MiB with the tree (device-check.sh unpacks it).
  find .devdeps/build-device -type f -perm -u+x -exec strip --strip-unneeded {} + 2>/dev/null || true
  tar -C .devdeps/build-device -czf .devdeps/build-device.tgz . && rm -rf .devdeps/build-device
  du -sh .devdeps/build-device.tgz
fi
