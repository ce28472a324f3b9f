"""A LoRA adapter trained by occult_ft, loaded two ways, evaluated side by side on held-out text.

    python benchmarks/stock_peft.py [--steps 60] [--budget 2]

The embedded OLMoE is fine-tuned with LoRA (placement `auto`, budget `--budget` devices per token of 4,
similarity criterion) and the adapter saved. It is then loaded
  - with `occult_ft.from_pretrained(adapter)` (placed, pruned: what was trained), and
  - with stock `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)` on the
    stock base (no occult_ft code: the adapter is stored in the base model's own expert order, so only
    the pruning is missing),
and both are evaluated on the shipped held-out text (issue 9's target: the stock loss within 2%), beside
the base model without the adapter.
"""

from __future__ import annotations

import argparse
import json
import tempfile


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--budget", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    args = ap.parse_args(argv)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import occult_ft
    from occult_ft.checkpoint.load import load_tokenizer
    from occult_ft.embedded import embedded_model_path
    from occult_ft.evaluation import data_batches, evaluate_model
    from occult_ft.trainer import OccultConfig, train

    out = tempfile.mkdtemp(prefix="occult-stock-peft-")
    config = OccultConfig(
        output_dir=out, model_name_or_path="embedded", dataset="embedded", seq_len=128, devices=4,
        placement="auto", max_devices_per_token=args.budget, criterion="similarity", train_mode="lora",
        lora_r=8, lora_alpha=16, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=max(1, args.steps // 5), save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        use_cpu=True,
    )  # fmt: skip
    train(config)
    base = embedded_model_path()
    batches = data_batches(load_tokenizer(base), "embedded", 128, 16, args.eval_tokens)
    ours = evaluate_model(occult_ft.from_pretrained(out), batches, 4)
    stock = evaluate_model(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out), batches, 4
    )
    base_loss = evaluate_model(AutoModelForCausalLM.from_pretrained(base), batches, 4)
    report = {
        "budget": args.budget,
        "steps": args.steps,
        "eval_loss_occult_ft_from_pretrained": round(ours["loss"], 4),
        "eval_loss_stock_peft_on_stock_base": round(stock["loss"], 4),
        "eval_loss_base_model": round(base_loss["loss"], 4),
        "relative_difference": round(abs(stock["loss"] - ours["loss"]) / ours["loss"], 4),
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
