"""MkDocs hooks of the documentation site (mkdocs.yml: `hooks:`): one copy of every page; and a griffe
extension (mkdocs.yml: the python handler's `extensions:`) that documents dataclass fields by their help.

The README and a few other Markdown files of the repository (`extra.repo_pages` in mkdocs.yml: repository
path -> page of the site) are pages of the site as they are, without a copy in docs/. Their links, and the
links of docs/ pages into the repository, are written for GitHub (`docs/results.md`, `../README.md`); this
hook rewrites each relative link to the page that holds its target on the site, and turns a link to a
repository file the site does not hold (a recipe, a notebook, a script) into its text, so `mkdocs build
--strict` checks every link that remains.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import posixpath
import re
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)


def repo_pages(config) -> dict[str, str]:
    """Repository path -> site page, from mkdocs.yml's `extra.repo_pages`."""
    return dict(config["extra"].get("repo_pages", {}))


def docs_prefix(config) -> str:
    """The docs directory as a repository path ('docs')."""
    return Path(config["docs_dir"]).resolve().relative_to(ROOT).as_posix()


def on_files(files, config):
    from mkdocs.structure.files import File

    for repo_path, page in repo_pages(config).items():
        text = (ROOT / repo_path).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=text))
    return files


def site_target(target: str, page_repo_path: str, page_uri: str, config) -> str | None:
    """The link `target` of a page (at `page_repo_path` in the repository, `page_uri` on the site) as a
    link between site pages; None for a repository file the site does not hold; a target that exists
    nowhere is returned as it is, so that mkdocs reports it."""
    path, sep, anchor = target.partition("#")
    if not path:
        return target  # an anchor on the same page
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), path))
    pages = repo_pages(config)
    prefix = docs_prefix(config) + "/"
    if resolved in pages:
        uri = pages[resolved]
    elif resolved.startswith(prefix):
        uri = resolved[len(prefix) :]  # a page of docs/ (mkdocs reports it when it is missing)
    elif (ROOT / resolved).exists():
        return None  # a repository file the site does not hold
    else:
        return target  # nothing there: left for mkdocs to report
    relative = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
    return relative + sep + anchor


def rewrite_links(markdown: str, page_repo_path: str, page_uri: str, config) -> str:
    """`markdown` with its relative links pointed at site pages (code blocks left as they are)."""

    def one(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match.group(0)  # a URL or an absolute path
        new = site_target(target, page_repo_path, page_uri, config)
        if new is None:
            return text if not bang else match.group(0)
        return f"{bang}[{text}]({new})"

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(LINK.sub(one, markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(LINK.sub(one, markdown[last:]))
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    by_page = {uri: repo_path for repo_path, uri in repo_pages(config).items()}
    uri = page.file.src_uri
    repo_path = by_page.get(uri, f"{docs_prefix(config)}/{uri}")
    return rewrite_links(markdown, repo_path, uri, config)


class FieldHelp(griffe.Extension):
    """A dataclass field declared `field(..., metadata={"help": ...})` (`OccultConfig`, the pattern of
    `TrainingArguments` that the command line reads) gets its help string as its docstring in the API
    reference. The help is read from the imported class, so help strings built at import time come out
    as users see them in `--help`."""

    def on_class_members(self, *, node, cls, agent, **kwargs) -> None:
        if not isinstance(node, ast.ClassDef) or not any(_is_help_field(stmt) for stmt in node.body):
            return
        klass = getattr(importlib.import_module(cls.module.path), cls.name)
        for spec in dataclasses.fields(klass):
            member = cls.members.get(spec.name)
            if member is not None and not member.docstring and spec.metadata.get("help"):
                member.docstring = griffe.Docstring(spec.metadata["help"], parent=member)


def _is_help_field(stmt: ast.stmt) -> bool:
    """`name: type = field(..., metadata=...)`."""
    call = stmt.value if isinstance(stmt, ast.AnnAssign) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "field"
        and any(keyword.arg == "metadata" for keyword in call.keywords)
    )
