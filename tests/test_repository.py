"""The repository itself: no text file carries a merge's conflict markers (one slipped into
docs/DESIGN.md once, where no test read it), and the version is written in one place."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re

import occult_ft

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
    "site",
}
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".ipynb", ".sh", ""}
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def _text_files():
    """The repository's text files: caches, builds and virtual environments (any folder holding a
    `pyvenv.cfg`, e.g. the vLLM environment `.venv-vllm`) are not walked into."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if d not in SKIP and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))
        ]
        for name in files:
            path = pathlib.Path(folder, name)
            if path.suffix in TEXT and path.is_file() and path.stat().st_size <= 2_000_000:
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


def test_the_version_is_written_once_in_pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as the `tomli` package (a dev dependency there)
        import tomli as tomllib
    written = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert occult_ft.__version__ == importlib.metadata.version("occult-ft") == written
    copies = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "occult_ft").rglob("*.py")
        if f'"{written}"' in path.read_text(encoding="utf-8")
    ]
    assert not copies, f"the version {written} is written in {copies}; read it from importlib.metadata"


def test_no_test_imports_conftest():
    """Shared helpers are imported from tests/helpers.py; conftest.py holds fixtures, which pytest injects."""
    found = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("*.py")
        if re.search(r"^\s*(from conftest import|import conftest)", path.read_text(encoding="utf-8"), re.M)
    ]
    assert not found, f"{found} import conftest; import the helper from tests/helpers.py"
