"""The import graph of occult_ft: modules import only their own layer or lower ones, and nothing imports
in a cycle (docs/DESIGN.md, "Layers").

Rules checked on the source (no module is imported):
- every `from occult_ft... import` / `import occult_ft...` of a module in `occult_ft/` names a module of
  the same layer or a lower one (`LAYERS`; a package's layer covers all its modules);
- imports of occult_ft modules sit at module level, except in `occult_ft/commands/` and `occult_ft/cli.py`
  (command start-up stays fast by importing the library only when a command runs);
- the graph of those imports, one node per module, has no cycle;
- no module imports another module's private name (`_name`).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "occult_ft"

#: lowest first; a module may import modules of its own layer or of lower layers. Entries name modules
#: or packages under occult_ft (dotted for a module inside a package); the longest match wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("checks", "fileio", "layout", "replicas", "metrics", "embedded", "hub_access"),
    ("models",),
    ("routing", "placement", "profiling", "dispatch", "integrations"),
    ("checkpoint",),  # the format and its writers (format, save, card, remote_code, convert)
    ("apply",),  # records blocks through checkpoint.format / checkpoint.save
    (
        "checkpoint.load",
        "checkpoint.sharded",
        "configs",
    ),  # loading re-applies a checkpoint's placement and budget
    ("data", "evaluation", "plots", "trainer", "trl", "plan"),  # trl: the trainer on TRL's SFTTrainer
    ("studies", "bench", "hub", "serving"),
    ("commands", "cli", "__main__", "__init__"),
)
#: where function-level imports of occult_ft modules are allowed (command start-up)
LAZY_ALLOWED = ("commands", "cli")
#: debts being paid (none left: the placement package's cycle and private names went with its solver)
KNOWN_DEBT: tuple[str, ...] = ()


def _in_debt(module: str) -> bool:
    return any(module == d or module.startswith(d + ".") for d in KNOWN_DEBT)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    rel = module.split(".", 1)[1] if module != "occult_ft" else "__init__"
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    if best is None:
        raise AssertionError(
            f"module {module} has no layer in tests/test_layers.py LAYERS; add it there and to DESIGN.md"
        )
    return best[0]


def _imports(module: str) -> list[tuple[str, str | None, bool, int]]:
    """(target module, imported name or None, at module level, line) for each occult_ft import."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("occult_ft"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    out.append((sub, None, id(node) in top_level, node.lineno))
                else:
                    out.append((target, alias.name, id(node) in top_level, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("occult_ft"):
                    out.append((alias.name, None, id(node) in top_level, node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    """module -> the modules its import statements run first: the target and, as Python imports a
    package before its modules, every package above the target that is not above the importer."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, top, _ in _imports(module):
            if target not in MODULES or target == module or not (top or not _in_debt(module)):
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                step = ".".join(parts[:i])
                inside = module == step or module.startswith(step + ".")
                if step in MODULES and step != module and not inside:
                    graph[module].add(step)
    return graph


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_stay_in_lower_layers(module):
    mine = _layer(module)
    higher = [
        f"line {line}: {target} (layer {_layer(target)})"
        for target, _, _, line in _imports(module)
        if target in MODULES and _layer(target) > mine
    ]
    assert not higher, f"{module} (layer {mine}) imports higher layers: {higher}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_library_imports_are_at_module_level(module):
    if module.split(".")[1:2] and module.split(".")[1] in LAZY_ALLOWED or _in_debt(module):
        return
    lazy = [f"line {line}: {target}" for target, _, top, line in _imports(module) if not top]
    assert not lazy, f"{module} imports occult_ft modules inside functions (hidden cycles): {lazy}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_modules(module):
    if _in_debt(module):
        return
    private = [
        f"line {line}: {target}.{name}"
        for target, name, _, line in _imports(module)
        if name is not None and name.startswith("_") and target != module
    ]
    assert not private, f"{module} imports private names of other modules: {private}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _find_cycle(_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    # a -> b -> c -> a is found; a DAG is not a cycle
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_importing_a_module_of_a_package_runs_the_package_first():
    # apply imports occult_ft.checkpoint.format, so occult_ft/checkpoint/__init__.py runs before it: were
    # that __init__ to import checkpoint.load (which imports apply), the cycle would be real
    graph = _edges()
    assert "occult_ft.checkpoint" in graph["occult_ft.apply"]
    assert "occult_ft.checkpoint.load" not in graph["occult_ft.checkpoint"]
