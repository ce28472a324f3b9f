"""Every load line a model card shows is executed, as a reader would run it.

Cards for the Hub: the checkpoint is "pushed" into a Hub cache of the test's own (exactly the files
`occult_ft.hub.staged_upload` would upload, the card as README.md) and the card's code runs in a fresh
Python with HF_HUB_OFFLINE=1 against that cache. Cards of a local folder: the code runs from the folder's
parent. `path/to/NAME` (a local base model the reader must point at) is replaced by the real path.
Each block must leave a `model` whose forward pass runs (and a `tokenizer` when it loads one). The vLLM
block (`llm = LLM(REPO)`) runs in vLLM's own environment (`make vllm-env`; skipped, saying so, without it)
and must generate.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft import hub
from occult_ft.checkpoint import save_pruned
from occult_ft.embedded import embedded_model_path
from occult_ft.models import tiny_config
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig

pytest.importorskip("peft")

GROUPS = [[0, 5], [1, 4], [2, 7], [3, 6]]
REVISION = "0123456789abcdef0123456789abcdef01234567"

RUNNER = """
import json, sys
import torch
for code in json.load(sys.stdin):
    scope = {}
    exec(compile(code, "<card>", "exec"), scope)
    if "model" in scope:
        with torch.no_grad():
            scope["model"](input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    if "tokenizer" in scope:
        assert len(scope["tokenizer"]("a b c")["input_ids"]) > 0
"""


ROOT = pathlib.Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("OCCULT_FT_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
#: the vLLM block's engine runs on CPU here: a small KV cache and memory share (what a GPU reader omits)
VLLM_CPU = 'gpu_memory_utilization=0.1, enforce_eager=True, max_model_len=64, dtype="float32"'
VLLM_RUNNER = """
import json, sys
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":  # vLLM's engine core is a spawned process
    for code in json.load(sys.stdin):
        scope = {}
        exec(compile(code, "<card>", "exec"), scope)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        out = scope["llm"].generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5])], params)
        assert len(out[0].outputs[0].token_ids) == 2
"""


def load_blocks(card: str, lang: str = "python") -> list[str]:
    """The code blocks (python, or `lang`) of the card's "How to load it" section."""
    section = card.split("## How to load it", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def is_vllm(block: str) -> bool:
    return "from vllm" in block


def transformers_blocks(card: str) -> list[str]:
    """The load blocks that run in occult_ft's own environment (all but vLLM's)."""
    return [b for b in load_blocks(card) if not is_vllm(b)]


# files the loaders ask for that a repo may lack; online, the Hub answers 404 and the cache records it
# in `.no_exist` (what an offline reader of the same cache then sees)
PROBED = ("config.json", "generation_config.json", "adapter_config.json", "chat_template.jinja")


def publish(folder: str, repo_id: str, cache) -> None:
    """Put `folder` into the Hub cache `cache` as the main revision of model repo `repo_id`, as a
    download of it would leave it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / REVISION, symlinks=False)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    (repo / ".no_exist" / REVISION).mkdir(parents=True, exist_ok=True)
    for name in PROBED:
        if not os.path.exists(os.path.join(folder, name)):
            (repo / ".no_exist" / REVISION / name).touch()


def push_to_cache(checkpoint: str, repo_id: str, cache) -> str:
    """What `occult-ft push` uploads, published into `cache`; returns the card."""
    card = str(hub.build_model_card(checkpoint, repo_id=repo_id))
    with hub.staged_upload(checkpoint, card) as staged:
        publish(staged, repo_id, cache)
    return card


def run_blocks(
    blocks: list[str], cwd, cache=None, replace: dict[str, str] | None = None, vllm: bool = False
) -> None:
    assert blocks, "the card shows no load line"
    for old, new in (replace or {}).items():
        blocks = [b.replace(old, new) for b in blocks]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    python, runner = sys.executable, RUNNER
    if vllm:  # vLLM's environment, with this checkout's occult_ft (the plugin) first
        python, runner = VLLM_PYTHON, VLLM_RUNNER
        env.pop("VIRTUAL_ENV", None)
        env.update(PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: ~20 s less
    if cache is not None:
        env["HF_HUB_CACHE"] = str(cache)
        # remote code from a fake Hub repo is copied into a modules cache keyed by its fixed commit: a
        # fresh one per test, so code generated by an older occult_ft is never run instead
        env["HF_MODULES_CACHE"] = f"{cache}-modules"
    res = subprocess.run(
        [python, "-c", runner],
        input=json.dumps(blocks),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, "\n---\n".join(blocks) + "\n" + res.stderr[-3000:]


def _placement():
    return Placement(
        model="acme/tiny-olmoe",
        model_type="olmoe",
        num_experts=8,
        num_devices=4,
        num_nodes=1,
        algorithm="search",
        groups={0: GROUPS, 1: GROUPS},
    )


def _save(out, tokenizer, pruning=None, placement=True, model_type="olmoe"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    save_pruned(
        model,
        str(out),
        tokenizer=tokenizer,
        pruning=pruning,
        placement=_placement() if placement else None,
        extra={"base_model": "acme/tiny-olmoe"},
    )
    return str(out)


@pytest.fixture(scope="module")
def full_checkpoints(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("full")
    return {
        "pruned": _save(root / "pruned", tiny_tokenizer, PruningConfig(4, 2, "score")),
        "placed": _save(root / "placed", tiny_tokenizer),
        "native": _save(
            root / "native",
            tiny_tokenizer,
            PruningConfig(4, 2, "device_max"),
            placement=False,
            model_type="deepseek_v2",
        ),
    }


@pytest.mark.slow
#: `placed` loads like `native` (the stock auto class): it runs in `make test-all`
@pytest.mark.parametrize("kind", ["pruned", pytest.param("placed", marks=pytest.mark.extended), "native"])
def test_full_checkpoint_cards_load_as_they_say(full_checkpoints, kind, tmp_path):
    path = full_checkpoints[kind]
    card = push_to_cache(path, f"me/{kind}", tmp_path / "cache")
    blocks = transformers_blocks(card)
    if kind == "pruned":
        assert any("trust_remote_code=True" in b for b in blocks) or "routes with the original top-k" in card
    else:
        assert any("AutoModelForCausalLM.from_pretrained" in b for b in blocks)
    # olmoe and deepseek_v2 are served by occult_ft's vLLM plugin: the card says how (run below)
    assert f"vllm serve me/{kind}" in "".join(load_blocks(card, "bash"))
    assert [b for b in load_blocks(card) if is_vllm(b)] == [
        f'from vllm import LLM\n\nllm = LLM("me/{kind}")\n'
    ]
    run_blocks(blocks, tmp_path, cache=tmp_path / "cache")
    # the card written beside the checkpoint names the folder itself
    local = str(hub.build_model_card(path))
    run_blocks(transformers_blocks(local), os.path.dirname(path))


@pytest.mark.slow
def test_the_card_s_vllm_line_serves_the_pruned_checkpoint(tmp_path, tiny_tokenizer):
    if not os.path.isfile(VLLM_PYTHON):
        pytest.skip(f"vLLM's environment is missing ({VLLM_PYTHON}); build it with `make vllm-env`")
    # one attention head of width 64: what vLLM's CPU attention takes (the tiny config's 16 it does not)
    torch.manual_seed(0)
    config = tiny_config(
        "olmoe", vocab_size=len(tiny_tokenizer), num_attention_heads=1, num_key_value_heads=1, head_dim=64
    )
    path = str(tmp_path / "served")
    save_pruned(
        AutoModelForCausalLM.from_config(config),
        path,
        tokenizer=tiny_tokenizer,
        pruning=PruningConfig(4, 2, "score"),
        placement=_placement(),
        extra={"base_model": "acme/tiny-olmoe"},
    )
    card = push_to_cache(path, "me/served", tmp_path / "cache")
    assert 'pip install "occult-ft[vllm]"\nvllm serve me/served' in "".join(load_blocks(card, "bash"))
    blocks = [b for b in load_blocks(card) if is_vllm(b)]
    run_blocks(
        blocks,
        tmp_path,
        cache=tmp_path / "cache",
        replace={'LLM("me/served")': f'LLM("me/served", {VLLM_CPU})'},
        vllm=True,
    )


# ---- LoRA adapters: on a Hub base, on the embedded model, on a local model ---------------------------
def _train_adapter(base: str, out, rows_dir, env_cache=None):
    """A real adapter from `occult-ft train` (2 LoRA steps)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if env_cache is not None:
        env["HF_HUB_CACHE"] = str(env_cache)
        env["HF_MODULES_CACHE"] = f"{env_cache}-modules"  # as in run_blocks
    cmd = [
        sys.executable,
        "-m",
        "occult_ft",
        "train",
        "--model_name_or_path",
        base,
        "--dataset",
        str(rows_dir),
        "--seq_len",
        "32",
        "--devices",
        "4",
        "--max_devices_per_token",
        "2",
        "--criterion",
        "score",
        "--profile_tokens",
        "512",
        "--train_mode",
        "lora",
        "--lora_r",
        "2",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        str(out),
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "true",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    # no noise a user cannot act on, and a LoRA run is not called a pruned model, once
    output = res.stdout + res.stderr
    for noise in ("accelerator", "pin_memory", "is deprecated", "Warning"):
        assert noise not in output, (noise, output[-3000:])
    assert "pruned model" not in output and output.count(str(out)) <= 2, output[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_olmoe_dir, text_file):
    root = tmp_path_factory.mktemp("adapters")
    cache = root / "base-cache"
    publish(tiny_olmoe_dir, "acme/tiny-olmoe", cache)
    return {
        "cache": cache,
        "hub": _train_adapter("acme/tiny-olmoe", root / "on-hub-base", text_file, env_cache=cache),
        "embedded": _train_adapter("embedded", root / "on-embedded", text_file),
        "local": _train_adapter(tiny_olmoe_dir, root / "on-local-base", text_file),
        "local_base": tiny_olmoe_dir,
    }


@pytest.mark.slow
def test_adapter_configs_name_the_base_portably(adapters):
    """No absolute path of the training machine where a Hub id or `embedded` names the base."""
    read = lambda kind: json.load(open(os.path.join(adapters[kind], "adapter_config.json")))  # noqa: E731
    assert read("hub")["base_model_name_or_path"] == "acme/tiny-olmoe"
    assert read("embedded")["base_model_name_or_path"] == "embedded"
    assert embedded_model_path() not in open(os.path.join(adapters["embedded"], "occult_config.json")).read()
    # a model of this machine only: named by its path here (loads here), by its folder name once pushed
    assert read("local")["base_model_name_or_path"] == adapters["local_base"]


@pytest.mark.slow
#: `embedded` names its base like `hub` (a name, not a path): it runs in `make test-all`
@pytest.mark.parametrize("kind", ["hub", pytest.param("embedded", marks=pytest.mark.extended), "local"])
def test_adapter_cards_load_as_they_say(adapters, kind, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(adapters["cache"], cache)  # the Hub base, where there is one
    path = adapters[kind]
    card = push_to_cache(path, f"me/lora-{kind}", cache)
    blocks = load_blocks(card)
    assert any("occult_ft" in b for b in blocks) and any("PeftModel" in b for b in blocks)
    base_name = os.path.basename(adapters["local_base"])
    replace = {f"path/to/{base_name}": adapters["local_base"]}
    if kind == "local":
        assert f"path/to/{base_name}" in card and adapters["local_base"] not in card
    else:
        assert "path/to/" not in card
    assert not any(is_vllm(b) for b in blocks)  # vLLM's line is for full checkpoints
    run_blocks(blocks, tmp_path, cache=cache, replace=replace)
    local = str(hub.build_model_card(path))
    run_blocks(load_blocks(local), os.path.dirname(path), cache=cache, replace=replace)


@pytest.mark.slow
def test_the_card_the_trainer_writes_loads_as_it_says(adapters):
    card = open(os.path.join(adapters["embedded"], "README.md")).read()
    run_blocks(load_blocks(card), os.path.dirname(adapters["embedded"]))
