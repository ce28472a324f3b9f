"""Leaving torch.distributed: a rank that reaches interpreter exit with its gloo group alive can abort
there (SIGABRT, "terminate called without an active exception") after a run that succeeded, and torchrun
then reports the launch as failed (once in CI, once in ~130 two-rank training launches on 2 busy cores;
the cause is in pytorch/pytorch#179291). The Occult trainers and expert-parallel loading register
`close_process_group` to run at exit, before Python tears its modules down; the CLI and the benchmark
workers close the group themselves."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import textwrap

import torch.distributed as dist

from occult_ft.dispatch import comm

try:
    from .dist_utils import free_port
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import free_port

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from occult_ft.dispatch.comm import close_process_group_at_exit
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if sys.argv[1] == "register":
        close_process_group_at_exit()
        close_process_group_at_exit()  # once per process, however often it is asked
    atexit._run_exitfuncs()  # what the interpreter runs at exit, before tearing modules down
    print("alive" if dist.is_initialized() else "closed")
    if dist.is_initialized():
        dist.destroy_process_group()
    """
)


def _exit_state(mode: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(port=free_port()), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_the_group_is_closed_at_exit_once_registered_and_left_alone_otherwise():
    assert _exit_state("register") == "closed"
    assert _exit_state("none") == "alive"


def test_close_process_group_waits_then_destroys_and_is_a_no_op_without_a_group():
    comm.close_process_group(wait_for_others=True)  # no group: nothing to do
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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
