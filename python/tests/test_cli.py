"""python -m metrale mirrors the CLI: info, check and bench, with its exit codes; Ctrl-C during a
bench stops it after the case it is timing, with the model torn down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metrale", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_info_json_lists_the_cpu_backend():
    r = _run("info", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert any(b["name"] == "cpu" and b["available"] for b in doc["backends"])


def test_check_passes_on_the_cpu():
    r = _run("check", "--backend", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr


def test_bench_json_and_bad_usage():
    r = _run("bench", "--backend", "cpu", "--shapes", "256x512", "--m", "1,4", "--repeats", "2",
             "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["passed"] and doc["live_bytes_after_teardown"] == 0
    assert {e["M"] for e in doc["layers"]} == {1, 4}
    assert _run("bench", "--m", "x").returncode == 2
    assert _run("frobnicate").returncode == 2


def test_ctrl_c_stops_a_bench_cleanly():
    # A bench that would run for minutes (24 cases of seconds each); SIGINT to the process
    # group of `python -m metrale`, as a terminal sends it.
    child = subprocess.Popen(
        [sys.executable, "-m", "metrale", "bench", "--backend", "cpu", "--shapes",
         "4096x4096,4096x4096,4096x4096", "--m", "1,2,3,4,5,6,7,8", "--repeats", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # As a terminal's job: a test run launched in the background inherits SIGINT ignored,
        # and Python then never turns it into KeyboardInterrupt to pass on.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(4)  # past start-up: the CLI handles SIGINT from its first line on
    assert child.poll() is None, "the bench ended before it was interrupted"
    os.killpg(child.pid, signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, out + err
    assert "metrale bench: interrupted after" in err and "teardown left 0 bytes" in err, err


def test_plot_from_a_real_bench(tmp_path):
    r = _run("bench", "--backend", "cpu", "--shapes", "256x512,512x256", "--m", "1,8",
             "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = tmp_path / "bench.json"
    doc.write_text(r.stdout)
    png = tmp_path / "roofline.png"
    r = _run("plot", str(doc), "-o", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
