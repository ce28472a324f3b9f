"""Every shipped real-model recipe runs as written except for size.

Each recipe is launched as its header says (`torchrun --nproc_per_node N -m occult_ft.cli train
recipes/NAME.yaml`, gloo on CPU) with only size fields overridden: the same model type at a tiny width
(DeepSeek-MoE in its original `deepseek` layout, converted on the fly), the same `train_mode`,
expert-parallel layout, placement, budget and criterion, the shipped Alpaca-shaped instruction rows,
two optimizer steps. The saved checkpoint or LoRA adapter then reloads with its budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import build_tokenizer, save_tiny_model

try:
    from .dist_utils import free_port
except ImportError:
    from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
MODELS = yaml.safe_load((RECIPES / "models.yaml").read_text())["models"]
REAL = sorted(p.name for p in RECIPES.glob("*.yaml") if p.name not in ("models.yaml", "tiny.yaml"))
INSTRUCTIONS = ROOT / "occult_ft" / "embedded" / "corpus" / "instructions.jsonl"


def _tiny_model(model_type: str, path: Path) -> str:
    tokenizer = build_tokenizer()
    if model_type == "deepseek":  # no transformers model type: the original layout, converted on load
        from test_convert import deepseek_config, save_deepseek

        save_deepseek(path, deepseek_config(num_hidden_layers=2))
        tokenizer.save_pretrained(path)
        return str(path)
    return save_tiny_model(path, model_type, tokenizer, max_position_embeddings=512)  # the recipes' seq_len


def _launch_line(name: str) -> list[str]:
    for line in (RECIPES / name).read_text().splitlines():
        text = line.lstrip("# ").strip()
        if text.startswith("torchrun --nproc_per_node"):
            return text.split()
    raise AssertionError(f"{name}: no torchrun launch line")


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_recipe_runs_as_written_at_tiny_width(name, tmp_path):
    recipe = yaml.safe_load((RECIPES / name).read_text())
    facts = MODELS[recipe["model_name_or_path"]]
    model = _tiny_model(facts["model_type"], tmp_path / "model")
    words = _launch_line(name)  # torchrun --nproc_per_node N -m occult_ft.cli train recipes/NAME.yaml
    procs = int(words[words.index("--nproc_per_node") + 1])
    assert procs == recipe["expert_parallel_size"]
    out = tmp_path / "out"
    sizes = [
        "--model_name_or_path", model,
        "--dataset", str(INSTRUCTIONS),
        "--max_steps", "2",
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1",
        "--profile_tokens", "1024",
        "--warmup_steps", "0",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--output_dir", str(out),
        "--disable_tqdm", "true",
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        *words[words.index("-m") :], *sizes,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "OCCULT_FT_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 0, "\n".join(errors)[-3000:] or proc.stderr[-3000:]
    assert "saved the pruned model" in proc.stdout

    import occult_ft
    from occult_ft.checkpoint import read_block

    block = read_block(str(out))
    assert block.pruning.max_devices_per_token == recipe["max_devices_per_token"]
    assert block.pruning.criterion == recipe["criterion"] and block.num_devices == recipe["devices"]
    assert block.extra["train_mode"] == recipe["train_mode"]
    adapter = (out / "adapter_config.json").is_file()
    assert adapter == (recipe["train_mode"] == "lora")
    reloaded = occult_ft.from_pretrained(str(out))
    from occult_ft.routing import pruned_routers

    budgets = {router.occult_config.max_devices_per_token for _, router in pruned_routers(reloaded)}
    assert budgets == {recipe["max_devices_per_token"]}
    trained = json.loads((out / "all_results.json").read_text())
    assert trained["train_loss"] > 0
