"""metrale.torch's C++ operator (torch_ops.cpp beside this file): built against the installed
torch on first use, cached, loaded, and bound to metrale's GEMM.

The build is one compiler call (c++, or $CXX) on torch's headers, about 10 seconds, cached under
$METRALE_TORCH_CACHE or ~/.cache/metrale/torch-ops by torch version and source. Where it cannot
be built (no compiler, no headers) or METRALE_TORCH_NATIVE=0, load() returns None with the
reason in ``why``, and metrale.torch defines the same operator in Python: slower per call
(docs/PERF.md), the same results and errors.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import _metrale

SOURCE = Path(__file__).with_name("torch_ops.cpp")
why = ""  # why the C++ operator is not in use, when it is not


def _cache_dir() -> Path:
    root = os.environ.get("METRALE_TORCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "metrale", "torch-ops")
    return Path(root)


def _command() -> list:
    """The compiler call, but its output."""
    torch_dir = Path(torch.__file__).parent
    # -fopenmp: at::parallel_for is inline, its OpenMP region compiled here; at run time the
    # region is torch's own libgomp (loaded by torch first, the same soname), so the threads
    # are torch's intra-op threads (Note [one pool with torch]).
    command = [os.environ.get("CXX", "c++"), "-O2", "-std=c++20", "-fPIC", "-shared", "-w",
               "-fopenmp",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-I{torch_dir / 'include'}", f"-I{sysconfig.get_paths()['include']}",
               str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python",
               f"-Wl,-rpath,{torch_dir / 'lib'}"]
    return command


def _build(command: list, out: Path) -> None:
    """Runs `command` into `out`, written whole or not at all (concurrent first uses race on a
    rename, not on a half-written file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(command + ["-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} exited {done.returncode}: "
                               f"{done.stderr.strip().splitlines()[-1:] or ['(no output)']}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(fallback) -> Optional[ctypes.PyDLL]:
    """The C++ operator library, built if need be, loaded into torch (torch.ops.metrale.linear)
    and given metrale's GEMM entry and ``fallback`` (the Python implementation it hands every
    call it does not run itself); None, with ``why`` set, where it cannot be had."""
    global why
    if os.environ.get("METRALE_TORCH_NATIVE", "1") == "0":
        why = "METRALE_TORCH_NATIVE=0"
        return None
    command = _command()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(command).encode() +
                         torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    path = _cache_dir() / f"metrale_torch_ops-{key}.so"
    try:
        if not path.exists():
            print(f"metrale.torch: building its C++ operator against torch {torch.__version__} "
                  f"(once, about 15 s; cached in {path.parent})", file=sys.stderr, flush=True)
            _build(command, path)
        torch.ops.load_library(str(path))
        lib = ctypes.PyDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = f"the C++ operator could not be built or loaded ({e})"
        return None
    lib.metrale_torch_init.argtypes = [ctypes.c_void_p, ctypes.py_object]
    lib.metrale_torch_bind.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.metrale_torch_bind.restype = ctypes.c_int
    lib.metrale_torch_unbind.argtypes = [ctypes.c_int64]
    lib.metrale_torch_timing.argtypes = [ctypes.c_int]
    lib.metrale_torch_share_threads.argtypes = [ctypes.c_int]
    lib.metrale_torch_timed.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 2
    lib.metrale_torch_init(_metrale._native_gemm(), fallback)
    return lib


def bind(lib: ctypes.PyDLL, handle: int, model, weights, fp8: bool) -> None:
    """Tells the C++ operator where handle's model and weights are (their Python objects must
    outlive the binding: metrale.torch's handle table holds them)."""
    if lib.metrale_torch_bind(handle, _metrale._native_ptr(model._m),
                              _metrale._native_ptr(weights), int(fp8), weights.n, weights.k):
        raise RuntimeError(f"metrale.torch: handle {handle} is bound already")


def timed(lib: ctypes.PyDLL) -> tuple:
    """(seconds, calls) the C++ operator has spent in GEMMs while timing was on."""
    ns, calls = ctypes.c_int64(), ctypes.c_int64()
    lib.metrale_torch_timed(ctypes.byref(ns), ctypes.byref(calls))
    return ns.value * 1e-9, calls.value
