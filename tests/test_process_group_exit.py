"""Leaving torch.distributed: a rank that reaches interpreter exit with its gloo group alive can abort
there (SIGABRT, "terminate called without an active exception") after a run that succeeded, and torchrun
then reports the launch as failed (once in CI, once in ~130 two-rank training launches on 2 busy cores;
the cause is in pytorch/pytorch#179291). `close_process_group` destroys
the groups and drops the sub-groups occult_ft caches, so their threads end at once; the Occult trainers
and expert-parallel loading register it to run at exit. Launched ranks (the CLI, the benchmark and test
workers) leave through `exit_rank`: DDP keeps the default group alive past any close, and its threads
with it, so they skip interpreter finalization altogether."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from occult_ft.dispatch import comm

try:
    from .dist_utils import ephemeral_ports, free_port, run_distributed
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import ephemeral_ports, free_port, run_distributed

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from occult_ft.dispatch.comm import close_process_group_at_exit
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if sys.argv[1] == "register":
        close_process_group_at_exit()
        close_process_group_at_exit()  # once per process, however often it is asked
    atexit._run_exitfuncs()  # what the interpreter runs at exit, before tearing modules down
    print("alive" if dist.is_initialized() else "closed")
    if dist.is_initialized():
        dist.destroy_process_group()
    """
)


def _run_script(script: str, mode: str) -> subprocess.CompletedProcess:
    """`python -c script mode` on one CPU thread; its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _exit_state(mode: str) -> str:
    done = _run_script(SCRIPT, mode)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_the_group_is_closed_at_exit_once_registered_and_left_alone_otherwise():
    assert _exit_state("register") == "closed"
    assert _exit_state("none") == "alive"


def test_close_process_group_waits_then_destroys_and_is_a_no_op_without_a_group():
    comm.close_process_group(wait_for_others=True)  # no group: nothing to do
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm.close_process_group(wait_for_others=True)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_occult_trainer_registers_the_close_at_exit(tiny_olmoe_dir, tmp_path, monkeypatch):
    from datasets import Dataset

    from occult_ft.trainer import OccultConfig, OccultTrainer

    registered = []
    monkeypatch.setattr(comm, "_CLOSE_AT_EXIT", False)
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn))
    rows = [{"input_ids": [3, 4, 5, 6], "attention_mask": [1] * 4, "labels": [3, 4, 5, 6]}] * 2
    args = OccultConfig(
        output_dir=str(tmp_path / "run"), devices=2, use_cpu=True, report_to="none", seq_len=4, max_steps=1
    )
    OccultTrainer(tiny_olmoe_dir, args=args, train_dataset=Dataset.from_list(rows))
    assert registered == [comm.close_process_group]


def _gloo_threads() -> int:
    """Threads of this process that gloo process groups run their collectives on."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def _threads_before_and_after_close(rank: int, world: int) -> tuple[int, int]:
    import torch

    from occult_ft.dispatch import node_groups
    from occult_ft.trainer.expert_parallel import expert_parallel_groups

    groups = expert_parallel_groups(world)  # cached EP and EDP sub-groups
    nodes = node_groups(world, groups.ep_group)  # cached inter- and intra-node sub-groups
    base = torch.arange(8.0).reshape(4, 2)
    pending = comm.start_exchange([base + 10 * rank], [2, 2], [2, 2], groups.ep_group)  # async, as the layers
    (got,) = pending.wait()  # rows [2 * rank, 2 * rank + 2) of every rank, in rank order
    want = torch.cat([base[2 * rank : 2 * rank + 2] + 10 * peer for peer in range(world)])
    assert torch.equal(got, want)
    del groups, nodes, pending
    before = _gloo_threads()
    comm.close_process_group()
    return before, _gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_close_process_group_ends_the_threads_of_cached_sub_groups():
    for before, after in run_distributed(_threads_before_and_after_close, 2):
        assert before >= 6  # the default group and at least two cached sub-groups, two threads each
        assert after == 0


EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from occult_ft.dispatch.comm import exit_rank
    if sys.argv[1] == "rank":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(lambda: print(" exit-functions-ran group-open=" + str(dist.is_initialized()), end=""))
    print("unflushed", end="")
    exit_rank(3)
    """
)


@pytest.mark.parametrize("mode", ["rank", "plain"])
def test_exit_rank_runs_the_exit_functions_flushes_and_keeps_the_code(mode):
    done = _run_script(EXIT_SCRIPT, mode)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "unflushed exit-functions-ran group-open=False"


def test_the_console_script_exits_without_loading_torch_when_no_model_ran():
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch' in sys.modules))\n"
        "sys.argv = ['occult-ft']\n"
        "from occult_ft.cli import entry\n"
        "entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # no command: the help, and main's code
    assert "occult-ft" in done.stdout and done.stdout.split()[-1] == "False"


def test_the_launchers_port_is_drawn_outside_the_kernels_ephemeral_range():
    # a port in that range can be taken, between the check and the launcher's bind, by the client end
    # of any connection the other pytest-xdist worker opens (EADDRINUSE once in CI)
    ephemeral = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert not ports & set(ephemeral), sorted(ports)
    assert len(ports) > 1  # drawn at random: two workers do not keep meeting on one port
