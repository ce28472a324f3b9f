"""`occult-ft --help` and argument errors answer at once: no torch, transformers or deepspeed is imported
to build a parser, and the process takes under 0.5 s of CPU (`import torch` alone takes about 2.3 s of
CPU, `occult-ft --help` about 0.13 s, both measured with /usr/bin/time on a loaded 2-core machine;
Python's own start is about 0.05 s). CPU time, not wall time: other processes on a loaded machine do not count."""

import os
import subprocess
import sys

import pytest

from occult_ft.cli import COMMANDS

HEAVY = ("torch", "transformers", "deepspeed", "datasets", "peft", "huggingface_hub", "numpy")
CPU_LIMIT_S = 0.5

# a help and the argument errors a user meets first (unknown, misspelt, abbreviated, missing, bad value)
CASES = [
    ["--help"],
    [],
    ["plce"],
    ["place", "p.safetensors", "--devcies", "4", "--out", "x.json"],
    ["place", "p.safetensors", "--device", "4", "--out", "x.json"],
    ["place", "p.safetensors", "--out", "x.json"],
    ["analyze", "m", "--data", "d", "--devices", "two"],
    ["profile", "m", "--data", "d", "--out", "p", "--max_token", "3"],
    ["prune", "m", "--placement", "p.json", "--out", "o", "--criterion", "vibes"],
    ["bench", "--synthetic", "--devices", "-2"],
]


def _cpu_seconds(argv: list[str]) -> tuple[int, float, str]:
    """Exit status, CPU seconds (user + system, from the child's own rusage) and stderr of
    `python -m occult_ft ARGV`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: exec the CLI with stderr into the pipe
        os.close(r)
        os.dup2(w, 2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execve(sys.executable, [sys.executable, "-m", "occult_ft", *argv], env)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, err


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a) or "no-args")
def test_help_and_argument_errors_take_under_half_a_second_of_cpu(argv):
    code, cpu, err = _cpu_seconds(argv)
    assert "Traceback" not in err, err
    if argv not in (["--help"], []):  # no command prints the help (status 2)
        assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    assert cpu < CPU_LIMIT_S, f"occult-ft {' '.join(argv)} took {cpu:.2f} s of CPU"


def test_building_every_parser_imports_no_heavy_library():
    code = (
        "import sys; from occult_ft.cli import build_parser; p = build_parser(); "
        "p.format_help(); [a.choices[c].format_help() for a in p._subparsers._group_actions for c in a.choices]; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"building the parsers imported {res.stdout.strip()}"


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_module_imports_no_heavy_library(name):
    """Each module is also runnable alone (`python -m occult_ft.commands.NAME --help`)."""
    code = (
        f"import sys; import occult_ft.commands.{name}; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "", (res.stdout, res.stderr)


# ---- hostile recipes: refused by the bounded YAML reader, before anything heavy is imported ------------
def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A recipe of one valid field whose value is `levels` lists of `width` aliases to the previous list:
    a few hundred bytes that expand to width**levels leaves (9**9 = 387,420,489)."""
    parts = ["&l0 [" + ", ".join(['"lol"'] * width) + "]"]
    parts += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "learning_rate: [" + ", ".join(parts) + "]\n"


HOSTILE_RECIPES = {
    "alias-bomb": (_alias_bomb(), "expands to more than 100000 YAML nodes through its aliases"),
    "merge-key-bomb": (
        "a: &a {x: 1, y: 1}\n"
        + "".join(f"m{i}: &m{i} {{k{i}a: *{'a' if i == 0 else f'm{i - 1}'}, k{i}b: *{'a' if i == 0 else f'm{i - 1}'}}}\n" for i in range(40))
        + "learning_rate: *m39\n",
        "expands to more than 100000 YAML nodes",
    ),
    "recursive-alias": ("learning_rate: &a [1, *a]\n", "has an alias (*name) inside the value it names"),
    "deep-nesting": ("learning_rate: " + "[" * 5000 + "]" * 5000 + "\n", "nests its values too deeply"),
    "huge-file": ("learning_rate: 1.0e-4\n" + "# padding\n" * 120_000, "over the 1048576 a recipe may hold"),
    "not-yaml": ("learning_rate: [1, 2\n", "is not valid YAML at line 2"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE_RECIPES))
def test_a_hostile_recipe_is_one_line_before_anything_heavy_loads(tmp_path, case):
    """`occult-ft train BOMB.yaml` refuses an alias bomb, a recursive alias, nesting
    deeper than the stack, a file of megabytes and broken YAML in one line naming the recipe, without
    expanding anything and before torch or transformers is imported (the previous behaviour: an alias
    bomb ran until it was killed)."""
    from helpers import safety_timeout

    text, message = HOSTILE_RECIPES[case]
    recipe = tmp_path / "BOMB.yaml"
    recipe.write_text(text)
    code = (
        "import sys; from occult_ft.cli import main; "
        f"rc = main(['train', {str(recipe)!r}]); "
        f"print(rc, ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=safety_timeout(60)
    )
    assert res.stdout.split() == ["2"], (res.stdout, res.stderr)  # status 2, nothing heavy imported
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"occult-ft train: error: recipe {str(recipe)!r} "), lines
    assert message in lines[0], lines


def test_a_recipe_may_still_use_a_few_aliases(tmp_path, capsys):
    """Aliases are YAML, and a recipe may use them: only their expansion is bounded."""
    from occult_ft.cli import main as cli_main
    from occult_ft.commands._common import read_yaml
    from occult_ft.commands.train import parse_config

    recipe = tmp_path / "aliases.yaml"
    recipe.write_text(
        "model_name_or_path: embedded\ndataset: &data embedded\neval_dataset: *data\nseq_len: &n 64\n"
        "profile_tokens: *n\nreport_to: none\n"
    )
    config = parse_config([str(recipe), "--output_dir", str(tmp_path / "out")])
    assert config.eval_dataset == "embedded" and config.profile_tokens == 64
    assert read_yaml(str(recipe))["eval_dataset"] == "embedded"
    # the bound counts every expanded node: 9**6 leaves are over it; 9**5 leaves (about 75,000 nodes) are not
    (tmp_path / "b6.yaml").write_text(_alias_bomb(levels=6))
    (tmp_path / "b5.yaml").write_text(_alias_bomb(levels=5))
    with pytest.raises(ValueError, match="expands to more than 100000 YAML nodes"):
        read_yaml(str(tmp_path / "b6.yaml"))
    assert len(read_yaml(str(tmp_path / "b5.yaml"))["learning_rate"]) == 5
    # every other reader of recipes goes through it: `occult-ft plan` too
    assert cli_main(["plan", str(tmp_path / "b6.yaml")]) == 2
    assert "expands to more than 100000 YAML nodes" in capsys.readouterr().err
