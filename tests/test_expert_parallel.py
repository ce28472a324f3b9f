"""Expert-parallel `OccultTrainer` on 2 and 4 gloo processes (CPU, fp32, no DeepSpeed) against one process.

The oracle is a single-process run with the same global batch: per_device_train_batch_size * W rows
per step, read in the same (sequential) order, so step i of every run sees the same 8 rows. Under
expert parallelism each rank feeds 8 / W of them and holds E / D experts per layer; Trainer's loss
(token sum / global token count * W) averaged over W ranks is the global mean, so the per-step
losses must agree up to float rounding (the all-to-all sums expert outputs in another order):
relative difference <= 1e-3 per step over 10 steps, with and without pruning, and so must the
gradient norms (the sharp check: AdamW hides a wrong constant factor on the expert gradients, the
norm does not; clipping is on). The balance loss is off in these comparisons: like any data-parallel
run, expert parallelism averages per-micro-batch balance losses, which is not the balance loss of the
whole global batch.

Spawning interpreters is the expensive part, so each world size is launched once per session
(module-scoped fixture) and runs all of its cases one after another in the same processes; each test
then checks its own case. This file is also the worker: `torchrun ... test_expert_parallel.py SPEC`.

Cases per launch (D = expert_parallel_size, M = max_devices_per_token):
    W=2, `accelerate launch`: D=2 (evaluated, saved); D=2 with M=1; D=2 with 2 accumulated
        micro-batches; resume (4 steps + checkpoint, then 4 more from it); W % D error (D=4)
    W=4, torchrun: D=4; D=4 with M=1; D=2 (two replicas of each shard); D=2 with M=1; devices=4 on
        expert-parallel groups of 2 (with and without M=1)
    W=2, torchrun: `occult-ft train recipe.yaml --expert_parallel_size 2`
    LoRA (train_mode="lora", r=2; the expert LoRA factors shard with the experts), against single-process
    LoRA: W=2 `accelerate launch`, D=2: plain (saved adapter), M=1, resume (4 steps + checkpoint, then 4
    more); W=4 torchrun: D=4 plain, D=2 (two replicas) with M=1
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
from helpers import safety_timeout

try:
    from .dist_utils import free_port
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from dist_utils import free_port

GLOBAL_BATCH = 8
STEPS = 10
SEQ_LEN = 16
NUM_ROWS = GLOBAL_BATCH * STEPS
REL_TOL = 1e-3


# ---- shared by the test process and the workers ----------------------------------------------------
def training_rows(vocab_size: int, seed: int = 0):
    """NUM_ROWS full rows (no padding), identical in every process: counting sequences with a random
    start and stride 1-3, learnable enough that the loss moves over 10 steps."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size - 3, (NUM_ROWS, 1), generator=gen)
    stride = torch.randint(1, 4, (NUM_ROWS, 1), generator=gen)
    ids = ((start + stride * torch.arange(SEQ_LEN)) % (vocab_size - 3) + 3).tolist()
    return Dataset.from_list([{"input_ids": r, "attention_mask": [1] * SEQ_LEN, "labels": r} for r in ids])


def run_config(out: str, world: int, **overrides):
    """The OccultConfig of every run here: fp32 AdamW, constant LR, sequential data; clipping at 0.05,
    below the gradient norm of most steps (0.03-0.3), so the clipping path is exercised."""
    from occult_ft.trainer import OccultConfig

    base = dict(
        output_dir=out,
        seq_len=SEQ_LEN,
        devices=2,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        profile_tokens=512,
        train_mode="moe",
        balance_loss_coef=0.0,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        max_grad_norm=0.05,
        model_dtype="float32",
    )
    base.update(overrides)
    return OccultConfig(**base)


def train_case(
    model_dir: str,
    out: str,
    world: int,
    overrides: dict,
    save: str | None = None,
    resume: str | None = None,
    evaluate: bool = False,
) -> dict:
    """Train one case; returns the logged per-step losses, gradient norms and routing metrics (and the
    loss on the first 2 * GLOBAL_BATCH rows with `evaluate`)."""
    from transformers import AutoTokenizer

    from occult_ft.trainer import OccultTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = run_config(out, world, **overrides)
    trainer = OccultTrainer(
        model_dir, args=args, train_dataset=training_rows(len(tokenizer)), processing_class=tokenizer
    )
    trainer.train(resume_from_checkpoint=resume)
    if save:
        trainer.save_model(save)
    metrics = (
        trainer.evaluate(training_rows(len(tokenizer)).select(range(2 * GLOBAL_BATCH))) if evaluate else {}
    )
    logs = [e for e in trainer.state.log_history if "loss" in e]
    result = {
        "losses": [e["loss"] for e in logs],
        "steps": [e["step"] for e in logs],
        "comm_complexity": [e["comm_complexity"] for e in logs],
        "max_token_devices": max(e["max_token_devices"] for e in logs),
        "grad_norm": [e.get("grad_norm") for e in logs],
        "eval_loss": metrics.get("eval_loss"),
        "eval_comm_complexity": metrics.get("eval_comm_complexity"),
        "load_imbalance": [e["load_imbalance"] for e in logs],
    }
    from occult_ft.routing import router_device_bias

    bias = router_device_bias(trainer.model)  # the pruned cases' device bias, at the end of the run
    result["device_bias"] = {str(i): v.tolist() for i, v in bias.items()} if bias else None
    if trainer.expert_parallel is not None:
        from occult_ft.dispatch import expert_shard_parameters

        shards = expert_shard_parameters(trainer.model)
        result["groups"] = {
            "ep": list(trainer.expert_parallel.ep_ranks),
            "edp": list(trainer.expert_parallel.edp_ranks),
            "source": trainer.expert_parallel.source,
        }
        result["shard_rows"] = int(shards[0][1].shape[0]) if shards else 0
        from occult_ft.models import unwrap_model

        base = unwrap_model(trainer.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        result["read_sharded"] = getattr(base, "occult_sharded_source", None) is not None
        from occult_ft.models import base_experts, find_moe_layers

        shard = base_experts(find_moe_layers(base)[0].experts).occult_shard
        result["exchange"] = [shard.exchange, shard.chunks, shard.capacity]
        result["overlap_local"] = shard.overlap_local
        result["overlap_shared"] = shard.overlap_shared
        besides = [
            getattr(base_experts(layer.experts), "occult_beside", None) for layer in find_moe_layers(base)
        ]
        # times the kernel's shared-MLP output served a block (exchange_overlap_shared), over all layers
        result["shared_served"] = sum(b.served for b in besides if b is not None) if any(besides) else None
        # how the input embedding's gradient went at the last step (EmbeddingGradientReducer); None: DDP
        reducer = trainer.embedding_reducer
        result["embedding_apart"] = reducer.last_mode if reducer is not None else None
    return result


def _worker(spec_path: str) -> None:
    """Run every case of the spec on this rank; rank 0 writes {name: result or {"error": ...}}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    results = {}
    for case in spec["cases"]:
        try:
            results[case["name"]] = train_case(
                spec["model"],
                os.path.join(spec["out"], case["name"]),
                spec["world"],
                case["overrides"],
                save=case.get("save"),
                resume=case.get("resume"),
                evaluate=case.get("evaluate", False),
            )
        except Exception as err:  # recorded, so the test can check one-line errors and report failures
            results[case["name"]] = {
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-3000:],
            }
            if not case.get("expect_error"):
                break
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(results, f)


def launch(launcher: list[str], spec: dict, tmp_path, timeout: float = 300.0) -> dict:
    """Write the spec, run this file as the worker under `launcher`, return rank 0's results."""
    spec = {**spec, "result": str(tmp_path / "results.json")}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".cache", "torch_extensions")
        ),
        "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p
        ),
    }
    proc = subprocess.run(
        [*launcher, os.path.abspath(__file__), str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=safety_timeout(timeout),
    )
    if proc.returncode != 0 and (tmp_path / "results.json").exists():  # rank 0 recorded why it stopped
        failed = {
            k: v["trace"]
            for k, v in json.loads((tmp_path / "results.json").read_text()).items()
            if "trace" in v
        }
        assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "results.json").read_text())


def torchrun(world: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]


def accelerate_launch(world: int) -> list[str]:
    # on a CPU-only machine `--multi_gpu` starts `world` gloo processes through torchrun (use_cpu=True)
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(world),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


def deepspeed_launch(world: int) -> list[str]:
    # the DeepSpeed launcher passes --local_rank=N to the script; on CPU --num_gpus counts processes
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(world),
        "--master_port",
        str(free_port()),
    ]


def assert_same_trajectory(result: dict, reference: dict, what: str) -> float:
    """Per-step relative loss difference <= REL_TOL over all STEPS steps; returns the worst one."""
    assert "error" not in result, f"{what}: {result.get('trace', result.get('error'))}"
    assert result["steps"] == reference["steps"] == list(range(1, STEPS + 1)), what
    worst = 0.0
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"]), start=1):
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        assert rel <= REL_TOL, f"{what}: step {step} loss {got} vs single-process {want} (rel {rel:.2e})"
    return worst


if __name__ == "__main__":
    _worker(
        [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    )  # the deepspeed launcher adds --local_rank=N
    from occult_ft.dispatch.comm import exit_rank

    exit_rank(0)  # no interpreter finalization: see exit_rank


# ---- the tests --------------------------------------------------------------------------------------
# the pruned runs also balance devices, the bias fitted on the first micro-batch: its loads are summed over
# the processes, so every world size fits the single process's bias on the same global batch
PRUNING = {
    "plain": {},
    "pruned": {"max_devices_per_token": 1, "device_bias_rate": 0.001, "device_bias_init": "first_batch"},
}


def single_process_references(model_dir: str, out, devices: tuple[int, ...] = (2, 4)) -> dict:
    """Single-process runs (global batch on one process) for every pruning case and device count; the
    plain run for devices=2 is also evaluated and saved to out/final."""
    results = {}
    for d in devices:
        for name, overrides in PRUNING.items():
            first = name == "plain" and d == 2
            results[(name, d)] = train_case(
                model_dir,
                str(out / f"{name}-{d}"),
                1,
                {**overrides, "devices": d},
                save=str(out / "final") if first else None,
                evaluate=first,
            )
    if 2 in devices:  # every parameter trains: the input embedding's gradient is reduced apart from DDP
        results[("full", 2)] = train_case(
            model_dir, str(out / "full-2"), 1, {"devices": 2, "train_mode": "full"}
        )
    results["final"] = str(out / "final")
    return results


def check_trajectory(result: dict, reference: dict, what: str) -> float:
    """Losses (rel <= 1e-3) and gradient norms (rel <= 1e-3) of all STEPS steps match the single process.

    The norm is the sharp check: AdamW is nearly invariant to a constant factor on the expert
    gradients, the norm (which also drives the clipping) is not."""
    worst = assert_same_trajectory(result, reference, what)
    for step, (got, want) in enumerate(zip(result["grad_norm"], reference["grad_norm"]), start=1):
        assert got == pytest.approx(want, rel=REL_TOL), f"{what}: grad_norm at step {step}: {got} vs {want}"
    return worst


def check_device_bias(result: dict, reference: dict, what: str) -> None:
    """The bias fitted on the first micro-batch and moved after every step is the single process's: the
    loads are summed over processes before the rule sees them (a fit on one rank's rows would differ)."""
    assert reference["device_bias"] and result["device_bias"], what
    assert result["device_bias"].keys() == reference["device_bias"].keys(), what
    for layer, want in reference["device_bias"].items():
        assert result["device_bias"][layer] == pytest.approx(want, abs=1e-6), f"{what}: layer {layer}"
    assert any(v != 0 for b in reference["device_bias"].values() for v in b), what


@pytest.fixture(scope="module")
def reference(tiny_olmoe_dir, tmp_path_factory):
    return single_process_references(tiny_olmoe_dir, tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def world2(tiny_olmoe_dir, tmp_path_factory):
    """W=2, D=2 under `accelerate launch` (DDP for the replicated parameters)."""
    tmp = tmp_path_factory.mktemp("ep2")
    ckpt = str(tmp / "first" / "checkpoint-4")
    cases = [
        dict(name="plain", overrides=dict(expert_parallel_size=2), save=str(tmp / "final"), evaluate=True),
        dict(name="pruned", overrides=dict(expert_parallel_size=2, **PRUNING["pruned"])),
        dict(
            name="accumulated",
            overrides=dict(
                expert_parallel_size=2,
                per_device_train_batch_size=GLOBAL_BATCH // 4,
                gradient_accumulation_steps=2,
            ),
        ),
        *(  # every parameter trains, 2 micro-batches per step; the input embedding's gradient reduced
            # apart from DDP (the default), or left to DDP: the same run
            dict(
                name=name,
                overrides=dict(
                    expert_parallel_size=2,
                    train_mode="full",
                    per_device_train_batch_size=GLOBAL_BATCH // 4,
                    gradient_accumulation_steps=2,
                    embedding_gradient_overlap=apart,
                ),
            )
            for name, apart in (("full", True), ("full_embedding_ddp", False))
        ),
        dict(
            name="first",
            overrides=dict(expert_parallel_size=2, max_steps=4, save_strategy="steps", save_steps=4),
        ),
        dict(name="resumed", overrides=dict(expert_parallel_size=2, max_steps=8), resume=ckpt),
        dict(name="bad_world", overrides=dict(expert_parallel_size=4, devices=4), expect_error=True),
    ]
    results = launch(
        accelerate_launch(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp
    )
    return {**results, "final": str(tmp / "final"), "checkpoint": ckpt}


@pytest.fixture(scope="module")
def world4(tiny_olmoe_dir, tmp_path_factory):
    """W=4 under torchrun: D=4 (one copy of the experts) and D=2 (two replicas of each shard)."""
    tmp = tmp_path_factory.mktemp("ep4")
    cases = [
        dict(name=f"{name}-{d}", overrides=dict(expert_parallel_size=d, devices=d, **overrides))
        for d in (4, 2)
        for name, overrides in PRUNING.items()
    ]
    # placed and budgeted for 4 devices, trained on expert-parallel groups of 2 processes
    cases += [
        dict(name=f"{name}-ep2-d4", overrides=dict(expert_parallel_size=2, devices=4, **overrides))
        for name, overrides in PRUNING.items()
    ]
    return launch(torchrun(4), dict(model=tiny_olmoe_dir, out=str(tmp), world=4, cases=cases), tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "pruned", "accumulated", "full", "full_embedding_ddp"])
def test_two_processes_reproduce_the_single_process_run(world2, reference, name):
    result = world2[name]
    want = {"pruned": "pruned", "full": "full", "full_embedding_ddp": "full"}.get(name, "plain")
    check_trajectory(result, reference[(want, 2)], f"W=2 D=2 {name}")
    # the input embedding's gradient: reduced apart from DDP when it trains (as rows: a micro-batch's
    # tokens are fewer bytes than the table here) unless turned off; `moe` training freezes it
    assert result["embedding_apart"] == ("rows" if name == "full" else None)
    assert result["groups"] == {"ep": [0, 1], "edp": [0], "source": "torch"}
    assert result["shard_rows"] == 4  # each rank holds 4 of the 8 experts of a layer
    if name == "pruned":
        assert result["max_token_devices"] == 1 and set(result["comm_complexity"]) == {1.0}
        check_device_bias(result, reference[("pruned", 2)], "W=2 D=2 pruned")


@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("plain", 4), ("pruned", 4), ("plain", 2), ("pruned", 2)])
def test_four_processes_reproduce_the_single_process_run(world4, reference, name, size):
    result = world4[f"{name}-{size}"]
    check_trajectory(result, reference[(name, size)], f"W=4 D={size} {name}")
    if name == "pruned":
        check_device_bias(result, reference[(name, size)], f"W=4 D={size} pruned")
    # rank 0: EP = consecutive ranks, EDP = rank 0 of every EP group
    assert result["groups"]["ep"] == list(range(size)) and result["groups"]["edp"] == list(range(0, 4, size))
    assert result["shard_rows"] == 8 // size


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "pruned"])
def test_a_layout_of_4_devices_trains_on_groups_of_2_processes(world4, reference, name):
    """devices=4 (placement and budget) with expert_parallel_size=2: each process holds two devices'
    experts; the run equals the single-process run placed and pruned for 4 devices."""
    result = world4[f"{name}-ep2-d4"]
    check_trajectory(result, reference[(name, 4)], f"W=4 EP=2 D=4 {name}")
    assert result["groups"]["ep"] == [0, 1] and result["shard_rows"] == 4


@pytest.mark.slow
def test_evaluation_under_expert_parallelism_matches_one_process(world2, reference):
    got, want = world2["plain"], reference[("plain", 2)]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert got["eval_comm_complexity"] == pytest.approx(want["eval_comm_complexity"], rel=1e-6)


@pytest.mark.slow
def test_checkpoint_is_a_standard_hf_checkpoint_equal_to_the_single_process_model(world2, reference):
    from transformers import AutoModelForCausalLM

    import occult_ft

    config = json.load(open(os.path.join(world2["final"], "config.json")))
    assert config["occult"]["num_devices"] == 2 and "occult_ep" not in json.dumps(config)
    single = AutoModelForCausalLM.from_pretrained(reference["final"])
    plain = AutoModelForCausalLM.from_pretrained(world2["final"])
    ours = occult_ft.from_pretrained(world2["final"])
    # the full expert tensors came back (8 experts), not one rank's shard; AdamW lifts float rounding in
    # near-zero gradients to ~1e-5 over 10 steps, against updates of ~1e-2 per step
    for layer in range(2):
        experts, expected = plain.model.layers[layer].mlp.experts, single.model.layers[layer].mlp.experts
        assert experts.gate_up_proj.shape[0] == experts.down_proj.shape[0] == 8
        torch.testing.assert_close(experts.gate_up_proj, expected.gate_up_proj, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(experts.down_proj, expected.down_proj, rtol=1e-3, atol=1e-4)
    ids = torch.randint(3, 120, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = single.eval()(input_ids=ids).logits
        for model in (plain, ours):
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_resume_continues_like_the_uninterrupted_run(world2):
    first, resumed, straight = world2["first"], world2["resumed"], world2["plain"]
    assert "error" not in resumed, resumed.get("trace")
    files = os.listdir(world2["checkpoint"])
    assert "model.safetensors" in files  # the gathered HF weights
    assert {"optimizer_expert_shard_0_of_2.pt", "optimizer_expert_shard_1_of_2.pt"} <= set(files)
    assert first["losses"] == pytest.approx(straight["losses"][:4], rel=1e-6)
    assert resumed["steps"][-4:] == [5, 6, 7, 8]
    assert resumed["losses"][-4:] == pytest.approx(straight["losses"][4:8], rel=1e-6)
    assert resumed["grad_norm"][-4:] == pytest.approx(straight["grad_norm"][4:8], rel=1e-6)


@pytest.mark.slow
def test_a_world_size_that_d_does_not_divide_is_a_one_line_error(world2):
    error = world2["bad_world"]["error"]
    assert error.startswith(
        "ValueError: expert_parallel_size=4 does not divide the world size 2; launch a multiple of 4"
    )
    assert len(error.splitlines()) == 1


@pytest.mark.slow
def test_cli_train_with_expert_parallel_size_under_torchrun(tiny_olmoe_dir, text_file, tmp_path):
    """`occult-ft train recipe.yaml --expert_parallel_size 2` on 2 processes writes a full HF checkpoint."""
    import yaml
    from transformers import AutoModelForCausalLM

    recipe, out = tmp_path / "recipe.yaml", tmp_path / "out"
    recipe.write_text(
        yaml.safe_dump(
            dict(
                model_name_or_path=tiny_olmoe_dir,
                dataset=text_file,
                output_dir=str(out),
                seq_len=SEQ_LEN,
                devices=2,
                max_devices_per_token=1,
                max_steps=2,
                per_device_train_batch_size=2,
                use_cpu=True,
                disable_tqdm=True,
                logging_steps=1,
                save_strategy="no",
                profile_tokens=256,
                report_to="none",
            )
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [*torchrun(2), "-m", "occult_ft.commands.train", str(recipe), "--expert_parallel_size", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=safety_timeout(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [e for e in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in e]
    assert len(logs) == 2 and all(e["max_token_devices"] == 1 and e["balance_loss"] > 0 for e in logs)
    assert json.load(open(out / "config.json"))["occult"]["max_devices_per_token"] == 1
    assert (
        AutoModelForCausalLM.from_pretrained(str(out)).model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    )


# ---- LoRA under expert parallelism ------------------------------------------------------------------
LORA = dict(train_mode="lora", lora_r=2, lora_alpha=4)


def lora_references(model_dir: str, out) -> dict:
    """Single-process LoRA runs: plain and pruned for devices=2 (the plain one saved to out/final) and
    plain for devices=4."""
    results = {}
    for name, d in (("plain", 2), ("pruned", 2), ("plain", 4)):
        first = (name, d) == ("plain", 2)
        results[(name, d)] = train_case(
            model_dir,
            str(out / f"{name}-{d}"),
            1,
            {**LORA, **PRUNING[name], "devices": d},
            save=str(out / "final") if first else None,
        )
    results["final"] = str(out / "final")
    return results


def assert_same_adapter(adapter: str, reference: str) -> None:
    """Two adapter directories hold the same tensors under the same keys (the gathered expert factors
    have the single-process shapes, A (r * E, in) and B (out, r * E)); AdamW lifts float rounding in
    near-zero gradients to ~1e-5 over 10 steps, against updates of ~1e-2 per step."""
    from safetensors.torch import load_file

    got = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    want = load_file(os.path.join(reference, "adapter_model.safetensors"))
    assert got.keys() == want.keys()
    expert_a = [k for k in got if "experts" in k and "lora_A" in k]
    assert expert_a and all(got[k].shape[0] == 2 * 8 for k in expert_a)  # r=2 times all 8 experts
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-4, msg=key)


@pytest.fixture(scope="module")
def lora_reference(tiny_olmoe_dir, tmp_path_factory):
    return lora_references(tiny_olmoe_dir, tmp_path_factory.mktemp("lora-single"))


@pytest.fixture(scope="module")
def lora_world2(tiny_olmoe_dir, tmp_path_factory):
    """LoRA, W=2, D=2 under `accelerate launch`."""
    tmp = tmp_path_factory.mktemp("lora-ep2")
    ckpt = str(tmp / "first" / "checkpoint-4")
    ep = dict(expert_parallel_size=2, **LORA)
    cases = [
        dict(name="plain", overrides=ep, save=str(tmp / "final")),
        dict(name="pruned", overrides=dict(**ep, **PRUNING["pruned"])),
        dict(name="first", overrides=dict(**ep, max_steps=4, save_strategy="steps", save_steps=4)),
        dict(name="resumed", overrides=dict(**ep, max_steps=8), resume=ckpt),
    ]
    results = launch(
        accelerate_launch(2), dict(model=tiny_olmoe_dir, out=str(tmp), world=2, cases=cases), tmp
    )
    return {**results, "final": str(tmp / "final"), "checkpoint": ckpt}


@pytest.fixture(scope="module")
def lora_world4(tiny_olmoe_dir, tmp_path_factory):
    """LoRA, W=4 under torchrun: D=4, and D=2 (two replicas of each shard) pruned."""
    tmp = tmp_path_factory.mktemp("lora-ep4")
    cases = [
        dict(name="plain-4", overrides=dict(expert_parallel_size=4, devices=4, **LORA)),
        dict(name="pruned-2", overrides=dict(expert_parallel_size=2, **LORA, **PRUNING["pruned"])),
    ]
    return launch(torchrun(4), dict(model=tiny_olmoe_dir, out=str(tmp), world=4, cases=cases), tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "pruned"])
def test_lora_on_two_processes_reproduces_the_single_process_lora_run(lora_world2, lora_reference, name):
    result = lora_world2[name]
    worst = check_trajectory(result, lora_reference[(name, 2)], f"LoRA W=2 D=2 {name}")
    print(f"LoRA W=2 D=2 {name}: largest per-step relative loss difference {worst:.2e}")
    assert result["shard_rows"] == 4  # the first expert shard: 4 of the 8 experts of a layer
    assert result["read_sharded"]  # each rank read only its experts from disk, LoRA included
    if name == "pruned":
        assert result["max_token_devices"] == 1


@pytest.mark.slow
@pytest.mark.extended  # LoRA under EP on 2 processes and plain EP on 4 run in `make test`
@pytest.mark.parametrize("name, size", [("plain", 4), ("pruned", 2)])
def test_lora_on_four_processes_reproduces_the_single_process_lora_run(
    lora_world4, lora_reference, name, size
):
    result = lora_world4[f"{name}-{size}"]
    worst = check_trajectory(result, lora_reference[(name, size)], f"LoRA W=4 D={size} {name}")
    print(f"LoRA W=4 D={size} {name}: largest per-step relative loss difference {worst:.2e}")
    assert result["groups"]["ep"] == list(range(size)) and result["groups"]["edp"] == list(range(0, 4, size))


@pytest.mark.slow
def test_lora_adapter_saved_under_expert_parallelism_is_the_single_process_adapter(
    lora_world2, lora_reference
):
    import occult_ft
    from occult_ft.integrations.peft import is_peft_model

    assert_same_adapter(lora_world2["final"], lora_reference["final"])
    ours, single = (
        occult_ft.from_pretrained(lora_world2["final"]),
        occult_ft.from_pretrained(lora_reference["final"]),
    )
    assert is_peft_model(ours)
    ids = torch.randint(3, 120, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = single.eval()(input_ids=ids).logits
        torch.testing.assert_close(ours.eval()(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_lora_resume_under_expert_parallelism_continues_like_the_uninterrupted_run(lora_world2):
    first, resumed, straight = lora_world2["first"], lora_world2["resumed"], lora_world2["plain"]
    assert "error" not in resumed, resumed.get("trace")
    files = os.listdir(lora_world2["checkpoint"])
    assert "adapter_model.safetensors" in files
    assert {"optimizer_expert_shard_0_of_2.pt", "optimizer_expert_shard_1_of_2.pt"} <= set(files)
    assert first["losses"] == pytest.approx(straight["losses"][:4], rel=1e-6)
    assert resumed["steps"][-4:] == [5, 6, 7, 8]
    assert resumed["losses"][-4:] == pytest.approx(straight["losses"][4:8], rel=1e-6)
    assert resumed["grad_norm"][-4:] == pytest.approx(straight["grad_norm"][4:8], rel=1e-6)


def test_d_that_does_not_divide_the_experts_or_the_world_is_a_one_line_error():
    from occult_ft.trainer.expert_parallel import check_expert_parallel_size

    with pytest.raises(
        ValueError,
        match=r"^expert_parallel_size=3 does not divide the 8 experts of each MoE layer; use one of 1, 2, 4, 8$",
    ):
        check_expert_parallel_size(3, 6, 8)
    with pytest.raises(
        ValueError,
        match=r"^expert_parallel_size=3 does not divide the world size 4; launch a multiple of 3 processes or set --expert_parallel_size to a divisor of 4 \(1, 2, 4\)$",
    ):
        check_expert_parallel_size(3, 4, 8)
    check_expert_parallel_size(2, 4, 8)  # fine


def test_one_process_with_expert_parallel_size_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^expert_parallel_size=2 does not divide the world size 1"):
        run_config(str(tmp_path), 1, expert_parallel_size=2)


def test_combinations_the_config_refuses_fail_before_the_model_is_loaded(tmp_path):
    """ZeRO-3 with expert parallelism is refused by `check_before_loading`, so loading a model path that does
    not exist never starts (the error is DeepSpeed's stage, not a missing file); LoRA passes the check."""
    from types import SimpleNamespace

    from occult_ft.trainer.config import check_before_loading
    from occult_ft.trainer.loading import load_training_model

    zero3 = {"zero_optimization": {"stage": 3}}
    args = SimpleNamespace(
        expert_parallel_size=2, deepspeed=zero3, max_grad_norm=1.0, model_dtype="float32", train_mode="lora"
    )
    with pytest.raises(ValueError, match=r"^expert_parallel_size=2 works with DeepSpeed ZeRO stages 0-2"):
        load_training_model(str(tmp_path / "no-such-model"), args)
    check_before_loading(SimpleNamespace(expert_parallel_size=2, deepspeed=None, max_grad_norm=1.0))
    with pytest.raises(
        ValueError, match="ZeRO stage 3 partitions every weight"
    ):  # placement needs whole tensors
        check_before_loading(SimpleNamespace(expert_parallel_size=1, deepspeed=zero3, max_grad_norm=1.0))
