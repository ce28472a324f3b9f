"""Run a function on N gloo processes on 127.0.0.1 (CPU), for distributed tests.

`run_distributed(fn, world_size, *args)` spawns `world_size` fresh interpreters (start method
"spawn"), initialises a gloo process group in each (the ranks meet through a file, no TCP port), calls
`fn(rank, world_size, *args)` and returns the per-rank results (index = rank). A worker exception
is re-raised in the test process with the worker's traceback; a hang is killed after `timeout`
seconds. `fn` must be importable (defined at module level) and its result picklable. Workers run
with one CPU thread (`OMP_NUM_THREADS=1`) so several ranks share a small machine.
"""

from __future__ import annotations

import os
import queue as queue_mod
import random
import shutil
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp
from helpers import safety_timeout

__all__ = ["ephemeral_ports", "free_port", "run_distributed"]


# torch's and DeepSpeed's default rendezvous ports: a launcher left on its default may be using them
_DEFAULT_PORTS = range(29400, 29600)


def ephemeral_ports() -> range:
    """The ports the kernel numbers the local end of a connection from (Linux's ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1, free a moment ago, for a launcher that needs one (torchrun's
    --master_port, accelerate's, DeepSpeed's, a server's).

    Between this check and the launcher's bind another process may take the port. Tests run on two
    pytest-xdist workers, each opening gloo connections whose client ends the kernel numbers from its
    ephemeral range, so a port found with bind(0) - in that range - was taken by the other worker's
    connections now and then (EADDRINUSE in CI). This one is drawn outside the ephemeral range, where
    only an explicit bind can take it."""
    ephemeral = ephemeral_ports()
    pool = [p for p in range(15000, 65536) if p not in ephemeral and p not in _DEFAULT_PORTS]
    draw = random.SystemRandom()
    for _ in range(200 if pool else 0):
        port = draw.choice(pool)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # nothing outside: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    fn,
    rank: int,
    world_size: int,
    rendezvous: str,
    results,
    args,
    collective_timeout_s: float,
    backend: str = "gloo",
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method="file://" + rendezvous,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from occult_ft.dispatch.comm import close_process_group

        close_process_group()  # the groups and the sub-groups occult_ft cached: their threads end here


def process_group_backend(device: str, world_size: int) -> str:
    """The backend a test on `device` runs its ranks with: NCCL when every rank has its own GPU, else
    gloo (also over CUDA tensors: NCCL refuses two ranks on one GPU, gloo does not)."""
    import torch

    if device == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    collective_timeout_s: float = 45.0,
    backend: str = "gloo",
):
    """Run `fn(rank, world_size, *args)` on `world_size` processes (`backend`: gloo, or nccl with one GPU
    per rank); return [result of rank 0, ...]. `timeout` and `collective_timeout_s` are base figures,
    scaled by `helpers.TIMEOUT_SCALE` (safety nets against a hang, not speed checks); callers pass
    base figures too."""
    timeout, collective_timeout_s = safety_timeout(timeout), safety_timeout(collective_timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    meeting = tempfile.mkdtemp(prefix="occult-test-dist-")
    rendezvous = os.path.join(meeting, "rendezvous")
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children at start
    try:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, rendezvous, results, args, collective_timeout_s, backend),
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved

    outcome: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (ok, value)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(meeting, ignore_errors=True)

    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if failures or missing:
        detail = "\n".join(failures)
        if missing:
            detail += f"\nranks {missing} returned nothing within {timeout:.0f} s (exit codes "
            detail += f"{[procs[r].exitcode for r in missing]})"
        raise RuntimeError(f"distributed run of {getattr(fn, '__name__', fn)} failed:\n{detail}")
    return [outcome[r][1] for r in range(world_size)]
