#!/usr/bin/env bash
# Fails (exit 1, naming file:line and the rule) when a room of the tree reaches one it must not
# (docs/ARCHITECTURE.md, table of rooms):
#   core-no-backend    src/core includes cpu/, cuda/ or registry/ (or the CPU backend's header)
#   backends-apart     src/cpu and src/cuda include each other
#   ops-no-backend     src/ops includes cpu/ or cuda/ (ops reach backends through backend.h)
#   kernels-abi-only   src/kernels includes a backend, ops, io or registry
#   comm-no-backend    src/comm includes a backend, ops or the registry (transports reach
#                      buffers through backend.h)
#   bench-no-tools     bench/ compiles a source file from tools/ (it links the toolkit instead)
#   public-internal    an installed header includes an internal one (not under include/metrale/)
#   install-list       a header under include/metrale/ is missing from the install list in
#                      cmake/install.cmake, or the list names a header that is not there
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'EOF'
import os, re, subprocess, sys

# "path:rule" pairs that are allowed to break a rule. Keep it empty: fix the code instead.
ALLOWED = []

# Public headers that belong to a backend's room, not to core's.
PUBLIC_ROOM = {"metrale/cpu_backend.h": "cpu"}

FORBIDDEN = {  # room -> {room it must not include: rule}
    "core": {"cpu": "core-no-backend", "cuda": "core-no-backend", "registry": "core-no-backend"},
    "cpu": {"cuda": "backends-apart"},
    "cuda": {"cpu": "backends-apart"},
    "ops": {"cpu": "ops-no-backend", "cuda": "ops-no-backend"},
    "kernels": {r: "kernels-abi-only" for r in ("cpu", "cuda", "ops", "io", "registry")},
    "comm": {r: "comm-no-backend" for r in ("cpu", "cuda", "ops", "registry")},
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE = re.compile(r'(?:\$\{[A-Z_]+\}/|\.\./|^|[\s"(])(tools/[^\s")]*\.(?:cpp|cc|cxx|c|cu))\b')


def tracked():
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True, text=True).stdout
        return [f for f in out.splitlines() if os.path.isfile(f)]
    except (OSError, subprocess.CalledProcessError):
        return [os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk(".") for f in fs]


def includes(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                yield n, m.group(1), m.group(2)


def room_of_include(path, quote, target):
    """The room an include of `target` from `path` reaches, as the compiler resolves it: a
    quoted include next to the file first, then src/ and include/."""
    if target in PUBLIC_ROOM:
        return PUBLIC_ROOM[target]
    if target.startswith("metrale/"):
        return "public"
    if quote == '"':
        local = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.isfile(local) and local.startswith("src" + os.sep):
            return local.split(os.sep)[1]
    if os.path.isfile(os.path.join("src", target)):
        return target.split("/")[0]
    return None  # a system or third-party header


def installed_headers():
    """The explicit list in cmake/install.cmake (METRALE_PUBLIC_HEADERS)."""
    text = open("cmake/install.cmake", encoding="utf-8").read()
    m = re.search(r"set\(\s*METRALE_PUBLIC_HEADERS(.*?)\)", text, re.S)
    if not m:
        return None
    body = re.sub(r"#.*", "", m.group(1))
    return [h.replace("${PROJECT_SOURCE_DIR}/", "") for h in body.split()]


problems = []


def report(path, line, rule, message):
    if f"{path}:{rule}" not in ALLOWED:
        problems.append(f"{path}:{line}: {rule}: {message}")


files = tracked()
code = [f for f in files if f.endswith((".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".def"))]

for path in code:
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "src" or parts[1] not in FORBIDDEN:
        continue
    for n, quote, target in includes(path):
        reached = room_of_include(path, quote, target)
        rule = FORBIDDEN[parts[1]].get(reached)
        if rule:
            report(path, n, rule, f"src/{parts[1]} includes {target} (room {reached}/)")

for path in sorted(f for f in files if f.startswith("bench/") and
                   (f.endswith("CMakeLists.txt") or f.endswith(".cmake"))):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            code_part = line.split("#", 1)[0]
            for m in SOURCE.finditer(code_part):
                report(path, n, "bench-no-tools", f"bench compiles {m.group(1)}; link the toolkit")

listed = installed_headers()
public = sorted(f for f in files if f.startswith("include/metrale/") and f.endswith((".h", ".hpp")))
if listed is None:
    report("cmake/install.cmake", 1, "install-list", "no set(METRALE_PUBLIC_HEADERS ...) list")
    listed = public
for h in public:
    if h not in listed:
        report(h, 1, "install-list", "public header missing from METRALE_PUBLIC_HEADERS")
for h in listed:
    if not h.startswith("include/metrale/") or not os.path.isfile(h):
        report("cmake/install.cmake", 1, "install-list", f"installs {h}, not a file under include/metrale/")
for h in sorted(set(listed) | set(public)):
    if not os.path.isfile(h):
        continue
    for n, quote, target in includes(h):
        reached = room_of_include(h, quote, target)
        if target.startswith("metrale/"):
            if "include/" + target not in listed:
                report(h, n, "public-internal", f"includes {target}, which is not installed")
        elif reached is not None or quote == '"':
            report(h, n, "public-internal", f"installed header includes internal {target}")

for p in problems:
    print(p)
if problems:
    print(f"check-layering: {len(problems)} violation(s)")
    sys.exit(1)
print(f"check-layering: {len(code)} files, no violation")
EOF
