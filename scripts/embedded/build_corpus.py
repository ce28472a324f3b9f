"""Rebuild the embedded corpus (`occult_ft/embedded/corpus/`) from openly licensed sources.

The corpus mixes three kinds of real text so that the experts of the embedded MoE have something
to specialise on:

    prose      Jane Austen, "Pride and Prejudice" (public domain), read from the Debian package
               `r-cran-janeaustenr` (the R package's lazy-load data base, parsed here without R);
    satire     Ambrose Bierce, "The Devil's Dictionary" (public domain), from the Debian package
               `dict-devil` (a dictd database: a gzip'ed text plus a base64 offset index);
    code+docs  CPython standard-library modules (source with their docstrings) and the language
               reference topics of `pydoc_data.topics` (PSF License), from the running interpreter.

Document convention of the output `.txt` files: documents are separated by one blank line and
contain no blank line themselves (prose paragraphs; one dictionary entry; one top-level Python
function or class with its inner blank lines removed; one reference paragraph), so that
`occult_ft.data.load_text_dataset` gives back exactly these documents.

Train / eval: the documents of every source, in source order, are cut into runs of
`RUN_DOCS` consecutive documents; run number r goes to eval when r % EVAL_EVERY == EVAL_OFFSET
(5% of every source, contiguous passages never seen in training), otherwise to train.

Instructions (`instructions.jsonl`, Alpaca rows instruction/input/output), from train documents only,
sampled with `random.Random(SEED)`:

    "Explain what this Python function does."          input: a function's source with its docstring
                                                       removed; output: the docstring's first paragraph
    "Continue this passage."                           input: the first sentences of an Austen
                                                       paragraph; output: the remaining sentences
    "Define this word as The Devil's Dictionary does." input: the headword; output: its definition

Usage (needs `apt-get update` once for the two Debian packages; nothing else leaves the machine):

    python scripts/embedded/build_corpus.py [--out DIR] [--debs DIR]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import random
import re
import struct
import subprocess
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

__all__ = [
    "read_r_lazyload",
    "austen_documents",
    "devil_documents",
    "stdlib_code_documents",
    "reference_documents",
    "split_train_eval",
    "make_instructions",
    "build",
    "main",
]

DEBIAN_PACKAGES = ("r-cran-janeaustenr", "dict-devil")
STDLIB_MODULES = (
    "textwrap",
    "string",
    "fractions",
    "statistics",
    "heapq",
    "bisect",
    "functools",
    "shlex",
    "glob",
    "fnmatch",
    "calendar",
    "colorsys",
    "json/__init__",
    "json/encoder",
    "json/decoder",
    "csv",
    "queue",
    "contextlib",
    "pprint",
    "numbers",
    "random",
    "copy",
    "base64",
    "graphlib",
    "reprlib",
    "sched",
    "abc",
    "operator",
    "weakref",
    "gettext",
    "tempfile",
    "posixpath",
    "genericpath",
    "html/parser",
    "urllib/parse",
    "secrets",
    "hmac",
    "uuid",
    "cmd",
    "codeop",
    "timeit",
    "collections/__init__",
    "dataclasses",
    "pathlib",
    "shutil",
    "difflib",
    "argparse",
    "ipaddress",
    "enum",
)
CODE_BUDGET_CHARS = 520_000  # whole modules are taken in STDLIB_MODULES order until this is reached
REFERENCE_BUDGET_CHARS = 200_000  # pydoc topics, in sorted topic order
RUN_DOCS = 20
EVAL_EVERY = 20
EVAL_OFFSET = 7
SEED = 0
NUM_INSTRUCTIONS = {"explain": 160, "continue": 160, "define": 100}


# ---- R lazy-load data base (janeaustenr) ----------------------------------------------------------
class _RReader:
    """Minimal reader of R's XDR serialization: vectors, lists, symbols and pairlists.

    Vectors come back as Python lists; a vector with attributes comes back as (values, attributes)
    where attributes is a dict (e.g. {"names": [...]}); pairlists as dicts {tag: value}.
    """

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialization (starts with {data[:2]!r})")
        self.data, self.pos, self.refs = data, 2, []
        version = self._int()
        self._int(), self._int()  # writer's R version, oldest R version that can read it
        if version == 3:
            encoding_length = self._int()  # followed by the name of the native encoding
            self.pos += encoding_length

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: the length follows as two ints
            n = (self._int() << 32) + self._int()
        return n

    def item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 241, 242, 250, 251, 252, 253):  # NULL, special environments, missing arg
            return None
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8 or self._int()) - 1]
        if kind == 1:  # symbol: its name follows as a CHARSXP
            symbol = self.item()
            self.refs.append(symbol)
            return symbol
        if kind in (2, 6, 239, 240):  # pairlist / language object: a linked list of (tag, value)
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            head = {tag: self.item()}
            rest = self.item()
            return {**head, **rest} if isinstance(rest, dict) else head
        if kind == 9:  # CHARSXP: a string, length -1 for NA
            n = self._int()
            if n == -1:
                return None
            text = self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return text
        n = self._length()
        if kind in (10, 13):  # logical, integer
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # character vector, list, expression
            values = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"R object type {kind} is not supported by this reader")
        return (values, self.item()) if has_attr else values


def _named(obj) -> dict:
    values, attributes = obj
    return dict(zip(attributes["names"], values))


def read_r_lazyload(rdx_path: Path, rdb_path: Path) -> dict[str, list]:
    """Every object of an R lazy-load data base (`Rdata.rdx` + `Rdata.rdb`), by name.

    The `.rdx` is a gzip'ed serialization of list(variables = list(name = c(offset, length)), ...);
    each object in the `.rdb` is a 4-byte big-endian size followed by a zlib stream of its
    serialization.
    """
    index = _named(_RReader(gzip.decompress(rdx_path.read_bytes())).item())
    blob = rdb_path.read_bytes()
    out = {}
    for name, (offset, length) in _named(index["variables"]).items():
        chunk = blob[offset : offset + length]
        (size,) = struct.unpack(">i", chunk[:4])
        data = zlib.decompress(chunk[4:])
        if len(data) != size:
            raise ValueError(f"R object {name!r}: expected {size} bytes, got {len(data)}")
        out[name] = _RReader(data).item()
    return out


# ---- documents of each source ------------------------------------------------------------------
def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n").rstrip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def austen_documents(lines: list[str | None]) -> list[str]:
    """Paragraphs of a novel given as the R package's one-string-per-line vector."""
    return _paragraphs("\n".join(line or "" for line in lines))


def _dictd_number(code: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    value = 0
    for char in code:
        value = value * 64 + alphabet.index(char)
    return value


def devil_documents(dict_dz: Path, index: Path) -> list[tuple[str | None, str]]:
    """(headword, entry) for every entry of the dictd database, blank lines inside an entry removed.

    The headword is None for the few entries not written "WORD, part-of-speech." (letters, R.I.P.).
    """
    text = gzip.decompress(dict_dz.read_bytes())
    spans = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        word, offset, length = line.split("\t")
        if not word.startswith("00database"):
            spans.setdefault((_dictd_number(offset), _dictd_number(length)), word)
    entries = []
    for (offset, length), _ in sorted(spans.items()):
        entry = text[offset : offset + length].decode("utf-8").strip("\n")
        body = "\n".join(line.rstrip() for line in entry.splitlines() if line.strip())
        head = re.match(r"([A-Z][A-Z'\- ]*[A-Z])[,.]", body)  # "ABASEMENT, n.  ..." -> ABASEMENT
        entries.append((head.group(1) if head else None, body))
    return entries


def _no_blank_lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_code_documents(
    modules=STDLIB_MODULES, budget: int = CODE_BUDGET_CHARS
) -> list[tuple[str, str, ast.AST]]:
    """(module, source, node): the module docstring and each top-level function/class, blank lines removed."""
    out, total = [], 0
    for module in modules:
        path = _stdlib_dir() / f"{module}.py"
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        for node in tree.body:
            is_doc = (
                isinstance(node, ast.Expr)
                and isinstance(getattr(node, "value", None), ast.Constant)
                and isinstance(node.value.value, str)
                and node is tree.body[0]
            )
            if not is_doc and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            segment = _no_blank_lines("\n".join(lines[start - 1 : node.end_lineno]))
            out.append((module, segment, node))
            total += len(segment) + 2
        if total >= budget:
            break
    return out


def reference_documents(budget: int = REFERENCE_BUDGET_CHARS) -> list[str]:
    """Paragraphs of the Python language reference shipped as `pydoc_data.topics`."""
    from pydoc_data.topics import topics

    out, total = [], 0
    for name in sorted(topics):
        for paragraph in _paragraphs(topics[name]):
            out.append(paragraph)
            total += len(paragraph) + 2
        if total >= budget:
            break
    return out


def split_train_eval(docs: list) -> tuple[list, list]:
    """Contiguous runs of RUN_DOCS documents; every EVAL_EVERY-th run (offset EVAL_OFFSET) is eval."""
    train, evaluation = [], []
    for i, doc in enumerate(docs):
        (evaluation if (i // RUN_DOCS) % EVAL_EVERY == EVAL_OFFSET else train).append(doc)
    return train, evaluation


# ---- instructions ------------------------------------------------------------------------------
_ABBREVIATIONS = {"Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Esq.", "Rev.", '"Mr.', '"Mrs.'}
_SENTENCE_END = re.compile(r'(?<=[.!?])["\')_]*\s+(?=["\'(_]*[A-Z])')


def _explain_examples(code_docs: list[tuple[str, str, ast.AST]]) -> list[dict]:
    """Functions (top level or methods) with a docstring; input = source without the docstring."""
    examples, sources = [], {}
    for module, _segment, node in code_docs:
        funcs = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            funcs = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if module not in sources:
            sources[module] = _stdlib_dir().joinpath(f"{module}.py").read_text(encoding="utf-8").splitlines()
        source = sources[module]
        for func in funcs:
            doc = ast.get_docstring(func, clean=True)
            if not doc or not func.body[1:]:
                continue
            summary = doc.split("\n\n")[0].strip()
            ds = func.body[0]
            start = min([func.lineno] + [d.lineno for d in func.decorator_list])
            kept = source[start - 1 : ds.lineno - 1] + source[ds.end_lineno : func.end_lineno]
            body = _no_blank_lines(_dedent("\n".join(kept)))
            if 40 <= len(summary) <= 400 and 80 <= len(body) <= 700:
                examples.append(
                    {
                        "instruction": "Explain what this Python function does.",
                        "input": body,
                        "output": " ".join(summary.split()),
                    }
                )
    return examples


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[indent:] for x in lines)


def _continue_examples(paragraphs: list[str]) -> list[dict]:
    """Austen paragraphs of 3+ sentences, cut at the sentence boundary nearest the middle."""
    examples = []
    for paragraph in paragraphs:
        flat = " ".join(paragraph.split())
        if not 250 <= len(flat) <= 900:
            continue
        cuts = [
            m.end()
            for m in _SENTENCE_END.finditer(flat)
            if flat[: m.start()].rsplit(" ", 1)[-1] not in _ABBREVIATIONS
        ]
        if len(cuts) < 2:
            continue
        cut = min(cuts, key=lambda c: abs(c - len(flat) / 2))
        examples.append(
            {
                "instruction": "Continue this passage.",
                "input": flat[:cut].rstrip(),
                "output": flat[cut:].strip(),
            }
        )
    return examples


def _define_examples(entries: list[tuple[str, str]]) -> list[dict]:
    """Devil's Dictionary entries: input = headword, output = the definition after it."""
    examples = []
    for word, body in entries:
        if word is None:
            continue
        first = body.split("\n    ")[0]  # the prose definition, before any indented verse or quote
        definition = re.sub(rf"^{re.escape(word)}[,.]?\s*", "", " ".join(first.split()))
        if 30 <= len(definition) <= 500:
            examples.append(
                {
                    "instruction": "Define this word as The Devil's Dictionary does.",
                    "input": word.title(),
                    "output": definition,
                }
            )
    return examples


def make_instructions(code_docs, austen_paragraphs, devil_entries, seed: int = SEED) -> list[dict]:
    """The Alpaca rows described in the module docstring, in a seeded random order."""
    rng = random.Random(seed)
    pools = {
        "explain": _explain_examples(code_docs),
        "continue": _continue_examples(austen_paragraphs),
        "define": _define_examples(devil_entries),
    }
    rows = []
    for kind, pool in pools.items():
        rows += rng.sample(pool, min(NUM_INSTRUCTIONS[kind], len(pool)))
    rng.shuffle(rows)
    return rows


# ---- driver ------------------------------------------------------------------------------------
def _fetch_debs(debs: Path) -> dict[str, Path]:
    """The two Debian packages, downloaded with `apt-get download` unless already in `debs`."""
    debs.mkdir(parents=True, exist_ok=True)
    found = {}
    for package in DEBIAN_PACKAGES:
        hits = sorted(debs.glob(f"{package}_*.deb"))
        if not hits:
            subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
            hits = sorted(debs.glob(f"{package}_*.deb"))
        found[package] = hits[-1]
    return found


def _extract(deb: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    return into


def build(out: Path, debs: Path) -> dict:
    """Write train.txt, eval.txt and instructions.jsonl into `out`; return a summary for SOURCES.md."""
    packages = _fetch_debs(debs)
    with tempfile.TemporaryDirectory() as tmp:
        austen_root = _extract(packages["r-cran-janeaustenr"], Path(tmp) / "austen")
        devil_root = _extract(packages["dict-devil"], Path(tmp) / "devil")
        data_dir = austen_root / "usr/lib/R/site-library/janeaustenr/data"
        novels = read_r_lazyload(data_dir / "Rdata.rdx", data_dir / "Rdata.rdb")
        devil = devil_documents(
            devil_root / "usr/share/dictd/devil.dict.dz", devil_root / "usr/share/dictd/devil.index"
        )
    austen = austen_documents(novels["prideprejudice"])
    code = stdlib_code_documents()
    reference = reference_documents()

    sources = {
        "austen": (austen, austen),
        "devil": ([body for _, body in devil], devil),
        "code": ([segment for _, segment, _ in code], code),
        "reference": (reference, reference),
    }
    train_docs, eval_docs, train_items, summary = [], [], {}, {}
    for name, (docs, items) in sources.items():
        tr_idx, ev_idx = split_train_eval(list(range(len(docs))))
        train_docs += [docs[i] for i in tr_idx]
        eval_docs += [docs[i] for i in ev_idx]
        train_items[name] = [items[i] for i in tr_idx]
        summary[name] = {
            "documents": len(docs),
            "train_chars": sum(len(docs[i]) + 2 for i in tr_idx),
            "eval_chars": sum(len(docs[i]) + 2 for i in ev_idx),
        }
    instructions = make_instructions(train_items["code"], train_items["austen"], train_items["devil"])

    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n\n".join(train_docs) + "\n", encoding="utf-8")
    (out / "eval.txt").write_text("\n\n".join(eval_docs) + "\n", encoding="utf-8")
    with (out / "instructions.jsonl").open("w", encoding="utf-8") as f:
        for row in instructions:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary["packages"] = {
        p: f"{d.name} sha256={hashlib.sha256(d.read_bytes()).hexdigest()}" for p, d in packages.items()
    }
    summary["python"] = sys.version.split()[0]
    summary["instructions"] = {
        kind: sum(r["instruction"].startswith(prefix) for r in instructions)
        for kind, prefix in (("explain", "Explain"), ("continue", "Continue"), ("define", "Define"))
    }
    summary["files"] = {
        p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.suffix in (".txt", ".jsonl")
    }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parents[2] / "occult_ft" / "embedded"  # the package data it rebuilds
    parser.add_argument("--out", type=Path, default=here / "corpus", help="output directory")
    parser.add_argument(
        "--debs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "occult_corpus_debs",
        help="where the Debian packages are (downloaded with apt-get if missing)",
    )
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.debs), indent=2))


if __name__ == "__main__":
    main()
