"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "True"  # model.report.clean
    assert float(out[1]) < 8e-3  # the normalized error it prints
