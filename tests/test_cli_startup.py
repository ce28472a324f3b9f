"""`occult-ft --help` and argument errors answer at once: no torch, transformers or deepspeed is imported
to build a parser, and the process takes under 0.5 s of CPU (the issue's figure; Python's own start is
about 0.05 s). CPU time, not wall time: other processes on a loaded machine do not count."""

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
