"""python -m metrale info|check|bench [...]: the metrale CLI; python -m metrale plot: bench plots;
python -m metrale bench-model: a whole model through metrale.torch against torch BF16."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional


def cli_path() -> Path:
    """The CLI the wheel ships beside the extension."""
    return Path(__file__).parent / "bin" / "metrale"


def main(argv: Optional[list] = None) -> int:
    """Runs the command; returns its exit code (0 ok, 1 a check failed, 2 bad usage or input,
    130 interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plot":
        from .plot import main as plot_main

        return plot_main(argv[1:])
    if argv and argv[0] == "bench-model":
        from .bench_model import main as bench_model_main

        return bench_model_main(argv[1:])
    cli = cli_path()
    if not os.access(cli, os.X_OK):
        print(f"metrale: the CLI is missing from this install ({cli})", file=sys.stderr)
        return 2
    # The CLI gets a process group of its own, so a terminal's Ctrl-C reaches this process
    # alone and is passed on exactly once per press: the CLI stops after the case it is timing
    # on the first, tears the model down and exits 130, and ends at once on a second.
    child = subprocess.Popen([str(cli), *argv], preexec_fn=os.setpgrp)
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main())
