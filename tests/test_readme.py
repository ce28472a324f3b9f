"""Every Python block of every documentation page runs as written: README.md, the pages of docs/ and the
repository pages the site includes (mkdocs.yml, `extra.repo_pages`). A page's blocks run top to bottom in
one namespace (as a reader pastes them), in a fresh working directory, offline (the embedded model and
corpus).

Two markers, HTML comments a reader of the page does not see (CONTRIBUTING.md, "Documentation"):
`<!-- docs-test: skip REASON -->` on the line before a block leaves that block out (it needs a GPU, the
network or a cluster); `<!-- docs-test: slow REASON -->` anywhere in a page runs the page in the slow tier
(it trains)."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b[^>]*-->[ \t]*\n$")
SLOW = re.compile(r"<!--\s*docs-test:\s*slow\b")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of a Markdown text that is not marked skip."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in BLOCK.finditer(text)
        if not SKIP.search(text[: m.start()])
    ]


def doc_pages() -> list[pathlib.Path]:
    """The Markdown pages of the documentation site: the repository pages, then docs/."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    repo_pages = [ROOT / path for path in config["extra"]["repo_pages"]]
    return repo_pages + sorted((ROOT / config["docs_dir"]).rglob("*.md"))


def run_page(page: pathlib.Path) -> None:
    """Run a page's blocks in one namespace, each compiled under `PAGE:LINE` for tracebacks."""
    namespace: dict = {"__name__": "__docs__"}
    for line, code in python_blocks(page.read_text()):
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102 - the page's own code


def _params():
    for page in doc_pages():
        text = page.read_text()
        if python_blocks(text):
            marks = [pytest.mark.slow] if SLOW.search(text) else []
            yield pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


def test_the_block_finder_finds_blocks_and_their_lines():
    text = "intro\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n```python\ny = x + 1\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x + 1\n")]


def test_a_block_marked_skip_is_left_out_and_only_that_one():
    text = "```python\na = 1\n```\n<!-- docs-test: skip needs a GPU -->\n```python\nb = 2\n```\n```python\nc = 3\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n"), (9, "c = 3\n")]
    assert SLOW.search("<!-- docs-test: slow (trains) -->") and not SLOW.search(text)


def test_the_pages_are_the_readme_and_every_docs_page():
    pages = {str(p.relative_to(ROOT)) for p in doc_pages()}
    assert {"README.md", "CONTRIBUTING.md", "docs/fine-tuning.md", "docs/DESIGN.md"} <= pages
    assert python_blocks(README.read_text()), "README.md has no Python block"


@pytest.mark.parametrize("page", list(_params()))
def test_every_python_block_of_a_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)
