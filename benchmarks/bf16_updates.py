"""How much of an AdamW update bf16 weights keep: torch AdamW on bf16 weights vs occult_ft's
CompensatedAdamW vs the float32 run, on random weights and through OccultTrainer (issue 18's figures).

    python benchmarks/bf16_updates.py [--weights 1000000] [--steps 10] [--lr 2e-5] [--skip-trainer]

Part 1: `--weights` weights of std 0.02, a fixed gradient direction plus fresh noise per step, the same
gradients for every optimizer. Part 2: a tiny OLMoE (hidden 64, 8 experts) trained `train_mode=moe` for
`--steps` steps on the embedded corpus with `model_dtype` float32 and bfloat16, same data and seed.
Printed per contender: the share of the weights that changed (of those the float32 run moved by at least
one bf16 step) and the mean |update| relative to the float32 run's. Deterministic on CPU; no timing.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from occult_ft.trainer.optim import CompensatedAdamW


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.float())[1] - 8)


def moved(before: torch.Tensor, after: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(share changed among the weights the float32 run moved by >= one bf16 step, mean |update| ratio)."""
    delta = after.float() - before.float()
    far = reference.abs() >= _bf16_step(before)
    return float((delta[far] != 0).float().mean()), float(delta.abs().mean() / reference.abs().mean())


def random_weights(n: int, steps: int, lr: float) -> dict[str, tuple[float, float]]:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, generator=gen) * 0.02).bfloat16()
    direction = torch.randn(n, generator=gen)
    grads = [direction + 0.5 * torch.randn(n, generator=gen) for _ in range(steps)]

    def train(start, cls):
        p = torch.nn.Parameter(start.clone())
        opt = cls([p], lr=lr, weight_decay=0.0)
        for g in grads:
            p.grad = g.to(p.dtype)
            opt.step()
        return p.detach()

    reference = train(w.float(), torch.optim.AdamW) - w.float()
    return {
        "torch AdamW, bf16 weights": moved(w, train(w, torch.optim.AdamW), reference),
        "CompensatedAdamW, bf16 weights": moved(w, train(w, CompensatedAdamW), reference),
    }


def through_the_trainer(steps: int, lr: float) -> dict[str, tuple[float, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from occult_ft.data import load_text_dataset
    from occult_ft.embedded import embedded_model_path
    from occult_ft.models import find_moe_layers, tiny_config
    from occult_ft.trainer import OccultConfig, OccultTrainer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    tmp = tempfile.mkdtemp(prefix="bf16-updates-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("olmoe", vocab_size=len(tokenizer))).save_pretrained(
        tmp + "/m"
    )
    tokenizer.save_pretrained(tmp + "/m")
    rows = load_text_dataset("embedded", split="train").select(range(400))

    def run(dtype, **kwargs):
        args = OccultConfig(
            output_dir=f"{tmp}/{dtype}-{len(kwargs)}", model_dtype=dtype, train_mode="moe", learning_rate=lr,
            lr_scheduler_type="constant", max_steps=steps, per_device_train_batch_size=4, seq_len=64,
            devices=4, placement="sequential", balance_loss_coef=0.0, save_strategy="no", report_to="none",
            disable_tqdm=True, use_cpu=True, seed=0, train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = OccultTrainer(tmp + "/m", args=args, train_dataset=rows, **kwargs)
        flat = lambda: torch.cat(  # noqa: E731
            [
                p.detach().float().flatten()
                for layer in find_moe_layers(trainer.model)
                for p in layer.experts.parameters()
            ]
        )
        before = flat()
        trainer.train()
        return before, flat() - before

    _, reference = run("float32")
    before, ours = run("bfloat16")
    _, plain = run("bfloat16", optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": lr}))
    return {
        "OccultTrainer, bf16, torch AdamW": moved(before, before + plain, reference),
        "OccultTrainer, bf16 (CompensatedAdamW)": moved(before, before + ours, reference),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--skip-trainer", action="store_true")
    args = parser.parse_args()
    results = random_weights(args.weights, args.steps, args.lr)
    if not args.skip_trainer:
        results.update(through_the_trainer(args.steps, args.lr))
    print(f"{'contender':42s} {'share moved':>12s} {'mean update vs fp32':>20s}")
    for name, (share, ratio) in results.items():
        print(f"{name:42s} {share:12.3f} {ratio:20.3f}")


if __name__ == "__main__":
    main()
