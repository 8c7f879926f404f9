"""Every Python example in README.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples() -> None:
    assert BLOCKS, "README.md lost its Python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = BLOCKS[index].replace("/tmp/ckpt.pt", str(tmp_path / "ckpt.pt"))
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "__readme__"})
