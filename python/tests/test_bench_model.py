"""python -m metrale bench-model: a checkpoint folder or a --shape model timed through
metrale.torch beside torch BF16, its JSON and its exit codes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import need

need("torch")
need("transformers")

MODELS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metrale", "bench-model", *args],
                          capture_output=True, text=True, timeout=600)


def _check(doc: dict, prompt: int, decode: int) -> None:
    assert doc["prefill"]["tokens"] == prompt and doc["decode"]["tokens"] == decode
    for row in (doc["prefill"], doc["decode"]):
        assert row["metrale_tok_s"] > 0 and row["torch_tok_s"] > 0
        assert abs(row["ratio"] - row["metrale_tok_s"] / row["torch_tok_s"]) < 1e-9
        assert 0 < row["gemm_share"] < 1


@pytest.mark.parametrize("folder", ["qwen3-ct-nvfp4a16", "llama-transformers-fp8"])
def test_a_checkpoint_folder(folder):
    r = _run(str(MODELS / folder), "--prompt", "8", "--decode", "2", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    arch = "Qwen3" if folder.startswith("qwen3") else "Llama"
    assert f"{arch}ForCausalLM, 2 layer(s), 14 linears on metrale" in doc["model"]
    _check(doc, 8, 2)


def test_a_shape_and_the_table():
    r = _run("--shape", "llama3-8b", "--layers", "1", "--prompt", "4", "--decode", "1",
             "--repeat", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "model: --shape llama3-8b, 1 layer(s), 7 linears nvfp4"
    assert lines[3].startswith("prefill (4 tok)") and lines[4].startswith("decode (1 tok)")


def test_bad_usage_exits_2(tmp_path):
    assert _run().returncode == 2
    assert _run("--shape", "llama3-8b", "--prompt", "0").returncode == 2
    r = _run(str(tmp_path))
    assert r.returncode == 2 and "metrale bench-model:" in r.stderr and str(tmp_path) in r.stderr
