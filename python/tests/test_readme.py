"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import need

README = Path(__file__).resolve().parents[2] / "README.md"


def run_section(heading: str, capsys, monkeypatch=None) -> list:
    """Runs the first Python block after `heading` (from the repository root when monkeypatch is
    given, as a reader runs it) and returns the lines it printed."""
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)
    if monkeypatch is not None:
        monkeypatch.chdir(README.parent)
    exec(compile(code, "README.md", "exec"), {})
    return capsys.readouterr().out.splitlines()


def test_readme_example_runs(capsys):
    out = run_section("## Python", capsys)
    assert out[-1] == "True"  # model.report.clean
    assert float(out[1]) < 8e-3  # the normalized error it prints


def test_readme_checkpoint_example_runs(capsys, monkeypatch):
    """The checkpoint-folder example, from the repository root as a reader runs it."""
    out = run_section("### A checkpoint folder", capsys, monkeypatch)
    assert out[0].startswith("tests/fixtures/checkpoints/ct-fp8-block/model.safetensors: 7 "
                             "layer(s) compressed-tensors FP8 block-128; ")
    assert out[1] == "(4, 64)"
    assert out[2] == "(4, 128) model.embed_tokens.weight"  # lm_head: vocab 128
    assert out[3] == "True"  # torn down clean


def test_readme_torch_example_runs(capsys, monkeypatch):
    """The PyTorch section, from the repository root as a reader runs it."""
    need("torch")
    need("transformers")
    out = run_section("## Use it with PyTorch", capsys, monkeypatch)
    assert out[0] == "Linear(in_features=128, out_features=64, format=nvfp4)"
    assert out[1].startswith("[1, 17, 42, 5, ") and len(out[1].split(",")) == 12
    assert out[2] == "torch.Size([1, 4, 128])"
    assert out[3] == "True"  # torn down clean


def test_readme_moe_example_runs(capsys, monkeypatch):
    need("torch")
    need("transformers")
    out = run_section("### Mixture of experts", capsys, monkeypatch)
    assert out[0].startswith("MoeExperts(num_experts=8, hidden_dim=256")
    assert out[1] == "torch.Size([1, 4, 256])"
    assert out[2] == "True"
    assert out[3] == "(3, 256)"

