"""Every file a real training run writes is the run's (`occult_ft.fileio.WRITTEN`), so a run with
periodic checkpoints saves its result and can be resumed into the same `output_dir`; a file of the
user's at a name the run writes still stops the next run before anything loads.

Real runs through the CLI on the tiny OLMoE (hidden 64, 8 experts), two or three steps each: every
`train_mode`, checkpoints every step, resumed from the first one, in one process and expert-parallel
(2 gloo processes under torchrun, one of them with DeepSpeed). The recipe runs of
`tests/test_recipes_run.py` also keep their checkpoints (`--save_steps 1`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import safety_timeout

from occult_ft.cli import main
from occult_ft.fileio import foreign_entries, is_artifact, model_card_writer

try:
    from .dist_utils import free_port
except ImportError:
    from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "moe", "lora")


def _args(model: str, data: str, out, mode: str, steps: int) -> list[str]:
    return [
        "train",
        "--model_name_or_path", model,
        "--dataset", data,
        "--output_dir", str(out),
        "--train_mode", mode,
        "--seq_len", "32",
        "--per_device_train_batch_size", "2",
        "--profile_tokens", "256",
        "--max_devices_per_token", "1",
        "--save_strategy", "steps",
        "--save_steps", "1",
        "--max_steps", str(steps),
        "--logging_steps", "1",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--seed", "0",
    ]  # fmt: skip


def assert_run_output(out: Path, mode: str, checkpoints: list[int]) -> None:
    """`out` is a finished run's output: the result of `mode` at the top, its card, the checkpoints
    named, and nothing the ownership rule does not know (every file is a writer's, none the user's)."""
    assert foreign_entries(out) == [] and is_artifact(out), foreign_entries(out)
    found = sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert found == checkpoints
    result = "adapter_config.json" if mode == "lora" else "config.json"
    assert (out / result).is_file() and model_card_writer(out / "README.md") == "occult_ft"
    for step in checkpoints:
        folder = out / f"checkpoint-{step}"
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step
        assert (folder / result).is_file()
        # the card the checkpoint's writer put there: PEFT's beside an adapter, occult_ft's beside a model
        assert model_card_writer(folder / "README.md") == ("PEFT" if mode == "lora" else "occult_ft")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_run_with_checkpoints_saves_resumes_and_still_refuses_a_users_readme(
    mode, tmp_path, tiny_olmoe_dir, text_file, capsys
):
    out = tmp_path / "run"
    args = _args(tiny_olmoe_dir, text_file, out, mode, steps=2)
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    assert_run_output(out, mode, [1, 2])
    # resumed from the first checkpoint into the same directory: checkpoint-2 is written again, then 3
    resumed = [
        *_args(tiny_olmoe_dir, text_file, out, mode, steps=3),
        "--resume_from_checkpoint",
        str(out / "checkpoint-1"),
    ]
    assert main(resumed) == 0, capsys.readouterr().err[-2000:]
    assert_run_output(out, mode, [1, 2, 3])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    # a README.md of the user's where the run writes its card: refused before anything loads, left as it is
    (out / "README.md").write_text("# my notes on this run\n")
    capsys.readouterr()
    assert main(resumed) == 2
    assert "holds files of yours that training would overwrite (README.md)" in capsys.readouterr().err
    assert (out / "README.md").read_text() == "# my notes on this run\n"


def _torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OCCULT_FT_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [*launcher, "-m", "occult_ft.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=safety_timeout(600),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, deepspeed",
    [
        ("lora", False),
        pytest.param("moe", True, marks=pytest.mark.extended),
        pytest.param("full", False, marks=pytest.mark.extended),
    ],
)
def test_an_expert_parallel_run_with_checkpoints_saves_and_resumes(
    mode, deepspeed, tmp_path, tiny_olmoe_dir, text_file
):
    """2 gloo processes, 4 experts each; rank 0 decides the final save's output check for both (the other
    rank can get there while rank 0 still writes the last checkpoint)."""
    out = tmp_path / "run"
    layout = ["--expert_parallel_size", "2", "--devices", "2"]
    if deepspeed:
        layout += ["--deepspeed", str(ROOT / "recipes" / "ds_zero1.json")]
    done = _torchrun([*_args(tiny_olmoe_dir, text_file, out, mode, steps=2), *layout], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_run_output(out, mode, [1, 2])
    if deepspeed:  # DeepSpeed's own state in every checkpoint, recognised as its
        assert {"latest", "zero_to_fp32.py", "zero_to_torch.py", "global_step2"} <= set(
            os.listdir(out / "checkpoint-2")
        )
    else:  # one RNG state per process
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(out / "checkpoint-2"))
    resume = ["--resume_from_checkpoint", str(out / "checkpoint-1")]
    done = _torchrun([*_args(tiny_olmoe_dir, text_file, out, mode, steps=3), *layout, *resume], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_run_output(out, mode, [1, 2, 3])
