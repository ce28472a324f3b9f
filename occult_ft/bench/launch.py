"""Running a benchmark worker module on D processes, and saying why a run failed.

    launch_workers   `torchrun` on this machine (or one agent per node of an emulated cluster); the
                     per-rank results the worker gathered, or {"error": the reason and the log}
    failure_reason   the line of a failed run's logs that says why (a rank's exception, a signal, an exit)

Used by the train-step benchmark (`step_worker`) and the generation benchmark (`generate_worker`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from ..fileio import atomic_write_text, read_text
from .cluster import EmulatedCluster

__all__ = ["failure_reason", "launch_workers"]

# an exception line as Python prints it, possibly behind torchrun's "[rank3]: " tag
_EXCEPTION = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?([\w.]*(?:Error|Exception): .*)$")
# torchrun's failure summary for a rank that died without a Python traceback
_SIGNAL = re.compile(r"traceback\s*:\s*(Signal \d+ \(\w+\) received by PID \d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def failure_reason(out: str, fallback: str = "no output") -> str:
    """Why the run whose logs (`*.txt`, `*.log`, every node's and rank's: the failing rank may live
    anywhere) are in `out` failed: the last exception line (torchrun's own ChildFailedError aside), else
    the signal or exit code torchrun reports for the rank, else the logs' last line, else `fallback`."""
    lines: list[str] = []
    for name in sorted(os.listdir(out)):
        if name.endswith((".txt", ".log")):
            with open(os.path.join(out, name), errors="replace") as f:
                lines += [ln.rstrip() for ln in f if ln.strip()]
    for ln in reversed(lines):
        m = _EXCEPTION.match(ln.strip())
        if m and "ChildFailedError" not in ln:
            return m.group(1)
    for pattern, say in ((_SIGNAL, "a rank died: {}"), (_EXITCODE, "a rank exited with status {}")):
        for ln in reversed(lines):
            m = pattern.search(ln)
            if m:
                return say.format(m.group(1))
    return lines[-1].strip() if lines else fallback


def _worker_env(threads: int) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }


def launch_workers(
    module: str,
    spec: dict,
    out: str,
    devices: int,
    threads: int,
    timeout_s: float,
    cluster: EmulatedCluster | None = None,
) -> dict:
    """Run `python -m module SPEC.json` on `devices` processes with `spec` (plus "result", the file the
    worker writes its gathered per-rank list to) saved in `out`; returns {"ranks": that list} or
    {"error": why, with the log to read}. On this machine torchrun runs `--standalone`: its rendezvous
    store binds a free port itself, so concurrent launches never race for one."""
    spec = {**spec, "result": os.path.join(out, "result.json")}
    spec_path = atomic_write_text(os.path.join(out, "spec.json"), json.dumps(spec))
    env = _worker_env(threads)
    args = ["-m", module, spec_path]
    log = os.path.join(out, "log.txt")
    try:
        if cluster is not None:
            status, log = cluster.torchrun(args, env, out, timeout_s)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc_per_node", str(devices), *args]
            with open(log, "w") as f:
                status = subprocess.run(
                    cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s
                ).returncode
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s (logs in {out})"}
    if status != 0 or not os.path.isfile(spec["result"]):
        return {"error": f"{failure_reason(out)[:400]} (log {log})"}
    return {"ranks": json.loads(read_text(spec["result"]))}
