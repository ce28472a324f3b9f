"""The repository itself: no text file carries a merge's conflict markers (one slipped into
docs/DESIGN.md once, where no test read it)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = {
    ".git",
    ".venv",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "build",
}
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".ipynb", ".sh", ""}
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def _text_files():
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if parts & SKIP or not path.is_file() or path.suffix not in TEXT or path.stat().st_size > 2_000_000:
            continue
        yield path


def test_no_file_holds_merge_conflict_markers():
    found = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for match in MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, f"merge conflict markers at {found}; resolve the merge"


def test_the_marker_pattern_finds_a_conflict():
    sample = "a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\n"
    assert len(MARKER.findall(sample)) == 3
    assert not MARKER.findall("a line with ======= inside\n=== heading\n")
