"""The notebooks in notebooks/: each runs top to bottom without an error, and is committed with its figures.

Execution uses nbclient with the kernel named `python3`, which must start *this* interpreter (the venv,
where occult_ft is installed): jupyter_client replaces an argv[0] of `python` / `python3` /
`python3.X` by `sys.executable`, and an absolute argv[0] must be `sys.executable` itself. Otherwise
(e.g. a system-wide `python3` spec pointing at another Python) the test writes a temporary `python3`
spec for `sys.executable` and puts its directory first on JUPYTER_PATH. Nothing is installed and the
notebooks on disk are not modified (outputs are produced in memory).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import safety_timeout

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# a safety net: the slowest cell (a short fine-tune) takes well under a minute on 2 quiet CPU cores
CELL_TIMEOUT_S = safety_timeout(300)
KERNEL = "python3"


def _resolves_to_this_python(argv0: str) -> bool:
    aliases = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    # no realpath: a venv's python is a symlink to the system one but sees other packages
    return argv0 in aliases or os.path.abspath(argv0) == os.path.abspath(sys.executable)


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv0 = KernelSpecManager().get_kernel_spec(KERNEL).argv[0]
    except NoSuchKernel:
        argv0 = None
    if argv0 is not None and _resolves_to_this_python(argv0):
        yield KERNEL
        return
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (occult_ft tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")])))
        assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
        yield KERNEL


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert names[:4] == [
        "01_quickstart.ipynb",
        "02_coactivation_and_placement.ipynb",
        "03_pruned_finetuning.ipynb",
        "04_communication.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs(path):
    """Figures show on a repository page only when the outputs are saved in the file."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), (
        f"{path.name}: run every cell before committing"
    )
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} was saved with an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} holds no figure"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, kernel_name):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
