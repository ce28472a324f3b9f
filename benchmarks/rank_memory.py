"""Peak resident memory of each rank when an expert-parallel run loads its model: old path vs sharded.

    python benchmarks/rank_memory.py [--paths old new trainer] [--dir DIR] [--nproc 4]

Builds a Mixtral-shaped random model once (8 experts, top-2, bf16, ~2 GB: hidden 1024, 10 layers,
expert intermediate 3584, vocab 32000), saves it with `save_pretrained`, then for each path launches
`--nproc` gloo processes with torchrun (`python -m torch.distributed.run`), each loading the model for
`expert_parallel_size = nproc` as `OccultTrainer` does:

* `baseline`: everything imported, the process group and the expert-parallel groups built, no model;
* `old`: `load_training_model` (the whole model) + `setup_expert_parallel` (cut to this rank's block);
* `new`: `load_sharded_training_model` (only this rank's block is ever read) + `setup_expert_parallel`;
* `trainer`: `OccultTrainer(path, args)` as `occult-ft train` builds it (`train_mode` moe, before the
  optimizer exists: its states are the run's, not the load's).

Each rank reports its peak resident set (`VmHWM` of /proc/self/status). The figure compared with the
target is peak - baseline (the baseline's mean over ranks), against
1.25 x (replicated part + E/D of the experts), the issue's bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

CONFIG = dict(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def build_model(directory: str) -> dict:
    """Save the random bf16 Mixtral-shaped model to `directory` (once); returns its byte counts."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(**CONFIG)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(directory)
        del model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "experts": experts, "replicated": total - experts}


def worker(mode: str, directory: str, out: str) -> None:
    """One rank: load as `mode` says, then write {peak, rss} (bytes) to out/rank{R}.json."""
    import gc

    import torch.distributed as dist

    from occult_ft.trainer import OccultConfig
    from occult_ft.trainer.expert_parallel import expert_parallel_groups, setup_expert_parallel
    from occult_ft.trainer.loading import load_training_model
    from occult_ft.trainer.sharded_load import load_sharded_training_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    args = OccultConfig(
        output_dir=os.path.join(out, "run"),
        devices=world,
        expert_parallel_size=world,
        placement="sequential",
        model_dtype="auto",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    expert_parallel_groups(world)
    if mode == "old":
        model, _ = load_training_model(directory, args)
        setup_expert_parallel(model, args)
    elif mode == "new":
        model, _ = load_sharded_training_model(directory, args)
        setup_expert_parallel(model, args)
    elif mode == "trainer":
        from transformers import default_data_collator

        from occult_ft.trainer import OccultTrainer

        # no data is read (placement sequential), so the collator is only a stand-in for a tokenizer's pad id
        moe = dataclasses.replace(args, train_mode="moe")
        trainer = OccultTrainer(directory, args=moe, data_collator=default_data_collator)
        assert trainer.expert_parallel is not None
    gc.collect()
    dist.barrier()
    result = {"peak": _status("VmHWM"), "rss": _status("VmRSS")}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def launch(mode: str, directory: str, nproc: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"rank_memory_{mode}_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_addr", "127.0.0.1", "--master_port", str(29500 + os.getpid() % 1000),
         os.path.abspath(__file__), "--worker", mode, "--dir", directory, "--out", out],
        env=env, check=True,
    )  # fmt: skip
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--paths", nargs="+", default=["old", "new", "trainer"], choices=["old", "new", "trainer"]
    )
    ap.add_argument("--dir", default=None, help="where the model is saved (default: a new temp dir)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--worker", choices=["baseline", "old", "new", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dir, args.out)
        return
    directory = args.dir or tempfile.mkdtemp(prefix="rank_memory_model_")
    os.makedirs(directory, exist_ok=True)
    sizes = build_model(directory)
    mib = 1 << 20
    held = sizes["replicated"] + sizes["experts"] / args.nproc
    print(
        f"model {sizes['total'] / mib:.0f} MiB (replicated {sizes['replicated'] / mib:.0f} MiB, experts "
        f"{sizes['experts'] / mib:.0f} MiB); a rank holds {held / mib:.0f} MiB; target peak - baseline <= "
        f"1.25 x that = {1.25 * held / mib:.0f} MiB"
    )
    baseline = launch("baseline", directory, args.nproc)
    base = sum(r["peak"] for r in baseline) / len(baseline)
    print(f"baseline (imports + process groups, no model): {base / mib:.0f} MiB per rank")
    for mode in args.paths:
        ranks = launch(mode, directory, args.nproc)
        extra = [r["peak"] - base for r in ranks]
        print(
            f"{mode}: peak - baseline per rank {', '.join(f'{e / mib:.0f}' for e in extra)} MiB; worst "
            f"{max(extra) / held:.2f} x held ({'meets' if max(extra) <= 1.25 * held else 'misses'} the 1.25 x target)"
        )


if __name__ == "__main__":
    main()
