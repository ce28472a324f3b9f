"""Train the embedded tokenizer and base MoE from scratch on the embedded corpus (CPU, minutes).

Steps:
    1. a byte-level BPE tokenizer (`tokenizers`) on corpus/train.txt, saved as a transformers
       `PreTrainedTokenizerFast` (eos = bos = `<|endoftext|>`, pad = `<|pad|>`);
    2. an `OlmoeForCausalLM` from random initialisation, trained with AdamW, linear warm-up and
       cosine decay on packed `seq_len` blocks of train.txt (`occult_ft.data`), with the router
       load-balancing loss (`router_aux_loss_coef`) so experts stay in use while they specialise;
    3. save_pretrained (safetensors, weights stored in `--save-dtype`, config dtype float32 so that
       `from_pretrained` gives fp32 parameters) and TRAINING.md: command, losses, wall time, and the
       routing's comm_complexity on eval.txt for 4 devices (sequential placement, the random-placement
       expectation, and, when `occult_ft.placement` is importable, a co-activation-aware placement).

The unigram baseline is the cross-entropy of eval tokens under the add-one-smoothed train unigram
distribution; a model that learned nothing beyond token frequencies scores about that.

Usage:
    nice -n 10 python scripts/embedded/train_base.py [--max-steps N] [--out DIR] ...
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from occult_ft.data import load_text_dataset, tokenize_dataset
from occult_ft.embedded import embedded_data_path
from occult_ft.metrics import (
    comm_complexity,
    contiguous_expert_device,
    expert_device_from_groups,
    intra_share,
    random_placement_comm_complexity,
)
from occult_ft.models import find_moe_layers

__all__ = [
    "train_tokenizer",
    "base_config",
    "evaluate",
    "unigram_cross_entropy",
    "router_topk_ids",
    "train",
    "build_parser",
    "main",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts` (every byte is representable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=512,
        padding_side="right",
    )


def base_config(tokenizer, args: argparse.Namespace):
    """The OlmoeConfig of the embedded model (shape from the command-line arguments)."""
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.expert_width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=False,
        max_position_embeddings=512,
        router_aux_loss_coef=args.aux_coef,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _blocks(tokenizer, split: str, seq_len: int) -> torch.Tensor:
    ds = tokenize_dataset(load_text_dataset(embedded_data_path(split)), tokenizer, seq_len, packing=True)
    return torch.tensor(ds["input_ids"], dtype=torch.long)


@torch.no_grad()
def evaluate(model, blocks_BS: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over all tokens of `blocks_BS` (router aux loss excluded)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks_BS), batch_size):
        batch = blocks_BS[i : i + batch_size]
        out = model(input_ids=batch, labels=batch, output_router_logits=False)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += out.loss.item() * n
        count += n
    model.train()
    return total / count


def unigram_cross_entropy(train_BS: torch.Tensor, eval_BS: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of the eval next tokens under the add-one-smoothed train unigram distribution."""
    counts = torch.bincount(train_BS.flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[eval_BS[:, 1:].flatten()].mean().item()


@torch.no_grad()
def router_topk_ids(model, blocks_BS: torch.Tensor, batch_size: int = 32) -> dict[int, torch.Tensor]:
    """Per MoE layer index, the (T, K) expert ids every token of `blocks_BS` was routed to."""
    layers = find_moe_layers(model)
    recorded: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
    hooks = [
        layer.router.register_forward_hook(
            lambda mod, args, out, i=layer.index: recorded[i].append(out[2].detach())
        )
        for layer in layers
    ]
    try:
        model.eval()
        for i in range(0, len(blocks_BS), batch_size):
            model(input_ids=blocks_BS[i : i + batch_size])
    finally:
        for hook in hooks:
            hook.remove()
        model.train()
    return {i: torch.cat(ids).reshape(-1, ids[0].shape[-1]) for i, ids in recorded.items()}


def _routing_numbers(topk: dict[int, torch.Tensor], num_experts: int, top_k: int, devices: int) -> dict:
    seq = contiguous_expert_device(num_experts, devices)
    out = {
        "devices": devices,
        "sequential_per_layer": [round(comm_complexity(ids, seq, devices), 3) for ids in topk.values()],
        "sequential_intra_share": round(
            sum(intra_share(ids, seq, devices) for ids in topk.values()) / len(topk), 3
        ),
        "random_expectation": round(random_placement_comm_complexity(num_experts, top_k, devices), 3),
        "random_intra_share": round((num_experts / devices - 1) / (num_experts - 1), 3),
    }
    out["sequential"] = round(sum(out["sequential_per_layer"]) / len(topk), 3)
    # expert usage balance: fraction of routed slots on the busiest expert vs uniform
    loads = [torch.bincount(ids.flatten(), minlength=num_experts).float() for ids in topk.values()]
    out["max_expert_load_over_mean"] = round(max((load.max() / load.mean()).item() for load in loads), 3)
    try:
        from occult_ft.placement import place_layer
    except ImportError:
        return out
    placed = []
    for ids in topk.values():
        groups = place_layer(ids, num_experts, devices, algorithm="occult")
        placed.append(comm_complexity(ids, expert_device_from_groups(groups, num_experts), devices))
    out["occult_placement_per_layer"] = [round(c, 3) for c in placed]
    out["occult_placement"] = round(sum(placed) / len(placed), 3)
    return out


def train(args: argparse.Namespace) -> dict:
    """Run steps 1-3 of the module docstring; returns the numbers written to TRAINING.md."""
    from transformers import OlmoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_texts = load_text_dataset(embedded_data_path("train"))["text"]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    tokenizer.save_pretrained(out_dir)
    train_BS = _blocks(tokenizer, "train", args.seq_len)
    eval_BS = _blocks(tokenizer, "eval", args.seq_len)
    unigram = unigram_cross_entropy(train_BS, eval_BS, len(tokenizer))
    print(
        f"tokenizer: {len(tokenizer)} tokens; train {train_BS.numel()} tokens ({len(train_BS)} blocks), "
        f"eval {eval_BS.numel()}; unigram eval CE {unigram:.3f}",
        flush=True,
    )

    model = OlmoeForCausalLM(base_config(tokenizer, args))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    budget_s = args.max_minutes * 60

    def progress(step: int, elapsed: float) -> float:
        """Schedule position in [0, 1]: the step fraction or the wall-time fraction, whichever is ahead."""
        return max(step / args.max_steps, elapsed / budget_s)

    def lr_at(step: int, elapsed: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, progress(step, elapsed))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))

    gen = torch.Generator().manual_seed(args.seed)
    order, cursor, history = torch.randperm(len(train_BS), generator=gen), 0, []
    train_start, step, ema = time.time(), 0, None
    probe = eval_BS[:64]
    model.train()
    while progress(step, time.time() - train_start) < 1.0:
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train_BS), generator=gen), 0
        batch = train_BS[order[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        lr = lr_at(step, time.time() - train_start)
        for group in optim.param_groups:
            group["lr"] = lr
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        optim.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        ce = out.loss.item() - args.aux_coef * out.aux_loss.item()
        ema = ce if ema is None else 0.98 * ema + 0.02 * ce
        step += 1
        if step % args.log_every == 0:
            elapsed = time.time() - train_start
            history.append(
                {
                    "step": step,
                    "train_ce_ema": round(ema, 4),
                    "aux": round(out.aux_loss.item(), 4),
                    "lr": lr,
                    "minutes": round(elapsed / 60, 2),
                }
            )
            if step % (args.log_every * 10) == 0:
                history[-1]["eval_ce_probe"] = round(evaluate(model, probe), 4)
            print(json.dumps(history[-1]), flush=True)
    train_seconds = time.time() - train_start

    # store in save_dtype, report the losses of the weights as stored
    model = model.to(getattr(torch, args.save_dtype)).float()
    eval_ce = evaluate(model, eval_BS)
    sample = train_BS[torch.randperm(len(train_BS), generator=gen)[: len(eval_BS)]]
    train_ce = evaluate(model, sample)
    topk = router_topk_ids(model, eval_BS)
    routing = _routing_numbers(topk, args.experts, args.top_k, args.devices)

    model.to(getattr(torch, args.save_dtype)).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # save_pretrained records the stored dtype; declare float32 so that from_pretrained (dtype "auto")
    # upcasts the stored weights exactly and fine-tuning starts in fp32
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    results = {
        "parameters": params,
        "steps": step,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_minutes": round(train_seconds / 60, 2),
        "total_minutes": round((time.time() - started) / 60, 2),
        "train_ce": round(train_ce, 4),
        "eval_ce": round(eval_ce, 4),
        "unigram_eval_ce": round(unigram, 4),
        "eval_ppl": round(math.exp(eval_ce), 2),
        "train_tokens": int(train_BS.numel()),
        "eval_tokens": int(eval_BS.numel()),
        "routing": routing,
        "history": history,
    }
    _write_report(out_dir, args, results)
    return results


def _write_report(out_dir: Path, args: argparse.Namespace, r: dict) -> None:
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file() and p.name != "TRAINING.md")
    routing = r["routing"]
    lines = [
        "# The embedded base model",
        "",
        "An `OlmoeForCausalLM` trained from scratch on `corpus/train.txt` by `scripts/embedded/train_base.py`.",
        "",
        "## Command",
        "",
        "```",
        f"nice -n 10 python scripts/embedded/train_base.py {shlex.join(sys.argv[1:])}".rstrip(),
        "```",
        "",
        "## Shape",
        "",
        f"- hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.experts} experts, top-{args.top_k}, "
        f"expert width {args.expert_width}, norm_topk_prob False, router_aux_loss_coef {args.aux_coef}",
        f"- vocabulary: byte-level BPE of {args.vocab_size} tokens (`<|endoftext|>` eos/bos, `<|pad|>` pad), "
        f"tied embeddings, max_position_embeddings 512",
        f"- {r['parameters'] / 1e6:.2f}M parameters, stored as {args.save_dtype} (config dtype float32: "
        f"`from_pretrained` returns fp32); directory size {size / 1e6:.2f} MB",
        "",
        "## Training",
        "",
        f"- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), lr {args.lr} with {args.warmup} "
        f"warm-up steps, then cosine decay to {args.min_lr} over max(step / {args.max_steps}, "
        f"training minutes / {args.max_minutes:g}) (the schedule ends on whichever budget runs out first), "
        f"batch {args.batch_size} x {args.seq_len} packed tokens (shuffled blocks), grad clip 1.0, seed {args.seed}, "
        f"torch threads {args.threads} (on the shared 2-core machine 2 threads ran about 8x slower per step)",
        f"- {r['steps']} steps, {r['tokens_seen']:,} tokens seen ({r['tokens_seen'] / r['train_tokens']:.1f} epochs of "
        f"{r['train_tokens']:,} train tokens); wall time {r['train_minutes']} min of training, "
        f"{r['total_minutes']} min in all (2 shared CPU cores)",
        "",
        "## Losses (nats per token, weights as stored)",
        "",
        "| | cross-entropy |",
        "|---|---|",
        f"| train (a sample of {r['eval_tokens']:,} tokens) | {r['train_ce']} |",
        f"| eval (`corpus/eval.txt`, {r['eval_tokens']:,} tokens) | {r['eval_ce']} (perplexity {r['eval_ppl']}) |",
        f"| unigram baseline on eval | {r['unigram_eval_ce']} |",
        "",
        f"## Routing on eval text ({routing['devices']} devices)",
        "",
        "comm_complexity = mean number of distinct devices hosting a token's top-k experts "
        "(`occult_ft.metrics.comm_complexity` on the router top-k ids of every layer).",
        "",
        "| placement | comm_complexity | per layer |",
        "|---|---|---|",
        f"| sequential (device d holds experts 8d..8d+7) | {routing['sequential']} | {routing['sequential_per_layer']} |",
        f"| random, uniform routing (`random_placement_comm_complexity({args.experts}, {args.top_k}, {routing['devices']})`) "
        f"| {routing['random_expectation']} | |",
    ]
    if "occult_placement" in routing:
        lines.append(
            f'| `occult_ft.placement.place_layer(..., algorithm="occult")` on the same tokens '
            f"| {routing['occult_placement']} | {routing['occult_placement_per_layer']} |"
        )
    lines += [
        "",
        f"intra-device share of co-selected pairs, sequential: {routing['sequential_intra_share']} "
        f"(random placement: {routing['random_intra_share']}); busiest expert's load / mean load, worst layer: "
        f"{routing['max_expert_load_over_mean']}.",
        "",
        "## Loss curve",
        "",
        "Train CE is an exponential moving average (0.98) of the batch cross-entropy; the eval probe is the first",
        "64 eval blocks.",
        "",
        "| step | train CE (EMA) | eval CE (probe) | aux loss | lr | minutes |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {h['step']} | {h['train_ce_ema']} | {h['eval_ce_probe']} | {h['aux']} | {h['lr']:.2e} | {h['minutes']} |"
        for h in r["history"]
        if "eval_ce_probe" in h
    ]
    (out_dir / "TRAINING.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out_dir / "training_results.json").write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    here = Path(__file__).resolve().parents[2] / "occult_ft" / "embedded"  # the package data it rebuilds
    p = argparse.ArgumentParser(description="Train the embedded tokenizer and OLMoE base model on CPU.")
    p.add_argument("--out", default=str(here / "model"), help="output directory (model + tokenizer)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--expert-width", type=int, default=48, help="expert intermediate size")
    p.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss coefficient")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training block")
    p.add_argument("--batch-size", type=int, default=16, help="blocks per step")
    p.add_argument(
        "--max-steps",
        type=int,
        default=2500,
        help="optimizer steps; the cosine schedule follows the step or the wall-time fraction, whichever is ahead",
    )
    p.add_argument(
        "--max-minutes", type=float, default=10.0, help="training wall-time budget (see --max-steps)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="final learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--devices", type=int, default=4, help="expert-parallel devices for the routing report")
    p.add_argument(
        "--save-dtype", default="bfloat16", choices=["float32", "bfloat16"], help="stored weight dtype"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: on a shared 2-core machine, 2 threads ran 8x slower per step)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--log-every", type=int, default=25, help="steps between log lines")
    return p


def main(argv: list[str] | None = None) -> None:
    results = train(build_parser().parse_args(argv))
    print(json.dumps({k: v for k, v in results.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
