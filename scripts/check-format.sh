#!/usr/bin/env bash
# Fails when a tracked C++ or CUDA file differs from what .clang-format asks for.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t files < <(git ls-files '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh')
bad=()
for f in "${files[@]}"; do
  [[ -f "$f" ]] || continue
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check-format: run clang-format -i on: ${bad[*]}" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
