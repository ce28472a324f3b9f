"""Every shipped real-model recipe runs as written except for size.

Each recipe is launched as its header says (`torchrun --nproc_per_node N -m occult_ft.cli train
recipes/NAME.yaml`, gloo on CPU) with only size fields overridden: the same model type at a tiny width
(DeepSeek-MoE in its original `deepseek` layout, converted on the fly; Kimi-K2 under its own `kimi_k2`
model type), the same `train_mode`, expert-parallel layout, exchange, placement, budget and criterion,
the shipped Alpaca-shaped instruction rows, two optimizer steps with a checkpoint after each (the
recipe's own `save_strategy: steps`, at `save_steps` 1). The saved checkpoint or LoRA adapter then
reloads with its budget, beside its checkpoints.

A multi-node recipe (`torchrun --nnodes N --nproc_per_node G --rdzv_backend c10d ...`) cannot bring its
32 or 64 processes to a CI machine: it runs on 2 "nodes" of 2 processes, two torchrun agents on this
machine meeting at the c10d rendezvous, with devices, nodes and expert_parallel_size scaled to that
(4 devices, 2 nodes) and its budgets scaled by the same factors (rounded up, and at least what holds the
tiny model's top-k), so the two-stage exchange and the node budget still act.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_tokenizer, safety_timeout, save_tiny_model

from occult_ft.commands._common import read_yaml

try:
    from .dist_utils import free_port
except ImportError:
    from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
MODELS = read_yaml(str(RECIPES / "models.yaml"), "model facts")["models"]
REAL = sorted(p.name for p in RECIPES.glob("*.yaml") if p.name not in ("models.yaml", "tiny.yaml"))
INSTRUCTIONS = ROOT / "occult_ft" / "embedded" / "corpus" / "instructions.jsonl"
#: the multi-node recipes' scaled layout: 2 nodes of 2 processes
NODES, PER_NODE = 2, 2


def _tiny_model(facts: dict, path: Path, seq_len: int) -> str:
    model_type = facts["model_type"]
    tokenizer = build_tokenizer()
    if model_type == "deepseek":  # no transformers model type: the original layout, converted on load
        from test_convert import deepseek_config, save_deepseek

        save_deepseek(path, deepseek_config(num_hidden_layers=2))
        tokenizer.save_pretrained(path)
        return str(path)
    out = save_tiny_model(path, model_type, tokenizer, max_position_embeddings=max(512, seq_len))
    if facts.get("config_model_type"):  # Kimi-K2: `kimi_k2` naming the DeepseekV3ForCausalLM architecture
        config = json.loads((path / "config.json").read_text())
        config["model_type"] = facts["config_model_type"]
        config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}  # not shipped: unused
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _launch_line(name: str) -> list[str]:
    for line in (RECIPES / name).read_text().splitlines():
        text = line.lstrip("# ").strip()
        if text.startswith("torchrun --n"):
            return text.split()
    raise AssertionError(f"{name}: no torchrun launch line")


def _flag(words: list[str], flag: str, default=None):
    return words[words.index(flag) + 1] if flag in words else default


def _scaled_layout(recipe: dict, model_dir: str) -> dict:
    """devices, nodes and budgets of a multi-node recipe on NODES x PER_NODE processes."""
    from occult_ft.configs import load_model_config
    from occult_ft.models import config_num_experts, config_top_k

    config = load_model_config(model_dir)
    experts, top_k = config_num_experts(config), config_top_k(config)
    devices = NODES * PER_NODE
    per_device = experts // devices
    layout = {"devices": devices, "expert_parallel_size": devices, "nodes": NODES}
    m, n = recipe.get("max_devices_per_token"), recipe.get("max_nodes_per_token")
    if m is not None:
        layout["max_devices_per_token"] = max(
            math.ceil(top_k / per_device), math.ceil(m * devices / recipe["devices"])
        )
    if n is not None:
        layout["max_nodes_per_token"] = max(
            math.ceil(top_k / (per_device * PER_NODE)), math.ceil(n * NODES / recipe["nodes"])
        )
        assert layout["max_nodes_per_token"] < NODES, "the scaled node budget must still prune"
    return layout


#: run by `make test` (CI): a single-node `moe` recipe (OLMoE), a single-node LoRA one (Mixtral) and a
#: multi-node LoRA one on the two-stage exchange (GLM-4.7); the other ten carry `extended` (`make
#: test-all`, about 11 more minutes on 2 cores).
IN_CI = ("olmoe-1b-7b.yaml", "mixtral-8x7b.yaml", "glm-4.7.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n if n in IN_CI else pytest.param(n, marks=pytest.mark.extended) for n in REAL]
)
def test_recipe_runs_as_written_at_tiny_width(name, tmp_path):
    recipe = read_yaml(str(RECIPES / name))
    facts = MODELS[recipe["model_name_or_path"]]
    model = _tiny_model(facts, tmp_path / "model", recipe["seq_len"])
    words = _launch_line(
        name
    )  # torchrun [--nnodes N] --nproc_per_node G ... -m occult_ft.cli train recipes/NAME.yaml
    nnodes, procs = int(_flag(words, "--nnodes", 1)), int(words[words.index("--nproc_per_node") + 1])
    assert nnodes * procs == recipe["expert_parallel_size"]
    want = {k: recipe.get(k) for k in ("devices", "nodes", "max_devices_per_token", "max_nodes_per_token")}
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
        "--save_steps", "1",  # the recipe's save_strategy (steps) and save_total_limit, a checkpoint each step
        "--output_dir", str(out),
        "--disable_tqdm", "true",
    ]  # fmt: skip
    if nnodes > 1:
        layout = _scaled_layout(recipe, model)
        want.update(layout)
        for key, value in layout.items():
            sizes += [f"--{key}", str(value)]
        nnodes, procs = NODES, PER_NODE
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if "--nnodes" in words:  # the multi-node form: one agent per node, meeting at the c10d rendezvous
        launcher += [
            "--nnodes", str(nnodes), "--nproc_per_node", str(procs),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        ]  # fmt: skip
        assert _flag(words, "--rdzv_backend") == "c10d"
    else:
        launcher += ["--nproc_per_node", str(procs), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    command = [*launcher, *words[words.index("-m") :], *sizes]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "OCCULT_FT_DEBUG": "1",
        "OCCULT_FT_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    agents = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(nnodes if "--nnodes" in words else 1)
    ]
    results = [agent.communicate(timeout=safety_timeout(600)) for agent in agents]
    stdout = "".join(o for o, _ in results)
    for agent, (_, stderr) in zip(agents, results):
        errors = [line for line in stderr.splitlines() if "error" in line.lower()]
        assert agent.returncode == 0, "\n".join(errors)[-3000:] or stderr[-3000:]
    assert (
        "saved the LoRA adapter" if recipe["train_mode"] == "lora" else "saved the pruned model"
    ) in stdout

    import occult_ft
    from occult_ft.checkpoint import read_block

    block = read_block(str(out))
    assert block.pruning.max_devices_per_token == want["max_devices_per_token"]
    assert block.pruning.max_nodes_per_token == want["max_nodes_per_token"]
    assert block.pruning.criterion == recipe["criterion"] and block.num_devices == want["devices"]
    assert block.num_nodes == want["nodes"]
    assert block.extra["train_mode"] == recipe["train_mode"]
    adapter = (out / "adapter_config.json").is_file()
    assert adapter == (recipe["train_mode"] == "lora")
    reloaded = occult_ft.from_pretrained(str(out))
    from occult_ft.routing import pruned_routers

    budgets = {
        (router.occult_config.max_devices_per_token, router.occult_config.max_nodes_per_token)
        for _, router in pruned_routers(reloaded)
    }
    assert budgets == {(want["max_devices_per_token"], want["max_nodes_per_token"])}
    trained = json.loads((out / "all_results.json").read_text())
    assert trained["train_loss"] > 0
    # the checkpoints the run kept (save_total_limit 2) and every file beside them are the run's own
    from occult_ft.fileio import foreign_entries

    assert recipe["save_strategy"] == "steps" and recipe["save_total_limit"] >= 2
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    assert foreign_entries(out) == []
