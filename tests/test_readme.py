"""Every Python block of README.md runs as written, top to bottom in one namespace (as a reader pastes
them), in a fresh working directory, offline (the embedded model and corpus)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of a Markdown text."""
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_block_finder_finds_blocks_and_their_lines():
    text = "intro\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n```python\ny = x + 1\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x + 1\n")]


def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no Python block"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for line, code in blocks:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
