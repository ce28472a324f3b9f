"""The documentation site's link rewriting (scripts/mkdocs_hooks.py): links written for GitHub point at the
site's pages, a repository file the site does not hold becomes text, a missing target is left for
`mkdocs build --strict` to report, and code blocks are not touched. `make docs` builds the whole site."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytest.importorskip("griffe", reason="the docs extra (mkdocs, mkdocstrings) is not installed")
_spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)

CONFIG = {**yaml.safe_load((ROOT / "mkdocs.yml").read_text()), "docs_dir": str(ROOT / "docs")}


def rewrite(markdown: str, repo_path: str) -> str:
    page_uri = CONFIG["extra"]["repo_pages"].get(repo_path) or repo_path.removeprefix("docs/")
    return hooks.rewrite_links(markdown, repo_path, page_uri, CONFIG)


def test_readme_links_into_docs_point_at_the_pages():
    text = "see [results](docs/results.md#exchange-benchmark) and [CONTRIBUTING.md](CONTRIBUTING.md)"
    assert rewrite(text, "README.md") == (
        "see [results](results.md#exchange-benchmark) and [CONTRIBUTING.md](contributing.md)"
    )


def test_docs_links_back_into_the_repository_point_at_the_site_pages():
    text = "[README](../README.md#python-api), [launchers](../recipes/README.md), [same page](#a), ![f](figures/bench.png)"
    assert rewrite(text, "docs/results.md") == (
        "[README](index.md#python-api), [launchers](recipe-launchers.md), [same page](#a), ![f](figures/bench.png)"
    )


def test_a_repository_file_the_site_does_not_hold_becomes_text_and_a_missing_one_stays():
    text = "[`01_quickstart.ipynb`](01_quickstart.ipynb) and [gone](no_such_notebook.ipynb)"
    assert rewrite(text, "notebooks/README.md") == "`01_quickstart.ipynb` and [gone](no_such_notebook.ipynb)"
    assert rewrite("[missing page](nope.md)", "docs/api.md") == "[missing page](nope.md)"


def test_links_inside_code_blocks_and_urls_are_left_alone():
    text = "```bash\necho [x](docs/results.md)\n```\n[paper](https://arxiv.org/abs/2505.13345)\n"
    assert rewrite(text, "README.md") == text


def test_every_repository_page_exists():
    for repo_path in CONFIG["extra"]["repo_pages"]:
        assert (ROOT / repo_path).is_file(), (
            f"mkdocs.yml extra.repo_pages names {repo_path}, which is missing"
        )
