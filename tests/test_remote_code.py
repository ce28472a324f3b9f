"""Remote code in pruned checkpoints (`occult_ft.checkpoint.remote_code`): stock transformers with
`trust_remote_code=True`, on a Python that cannot import occult_ft, routes exactly like
`occult_ft.from_pretrained`; without it, the stock class loads as before.

One subprocess (`python -I -S` with only site-packages on sys.path, cwd outside the repo, offline)
loads every checkpoint twice and writes the logits back; the tests compare them here."""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys

import pytest
import torch
from helpers import safety_timeout
from transformers import AutoModelForCausalLM

from occult_ft import hub
from occult_ft.apply import apply_occult
from occult_ft.checkpoint import (
    SIMILARITY_FILE,
    OccultBlock,
    describe_checkpoint,
    occult_config_fields,
    save_pruned,
)
from occult_ft.checkpoint.load import from_pretrained
from occult_ft.checkpoint.remote_code import (
    REMOTE_CODE_FILE,
    remote_auto_map,
    remote_class_name,
    remote_code_source,
)
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers, tiny_config
from occult_ft.routing import PruningConfig

TYPES = ["olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
# D=2 devices of 4 experts, budget M=1, top-2: every token whose two experts straddle the devices is
# pruned, and `score` (top-2 of the admitted 4) and `similarity` (the dropped expert's most similar of
# the admitted 3) can choose differently. DeepSeek-V2 with `score` is native (n_group/topk_group):
# no remote code, tested separately.
CASES = {
    f"{t}-{c}": (t, PruningConfig(2, 1, c))
    for t in TYPES
    for c in ("score", "similarity")
    if (t, c) != ("deepseek_v2", "score")
}
# a node budget alone (4 devices on 2 nodes, 1 node per token) with preserve_mass gate weights
CASES["olmoe-node-budget"] = ("olmoe", PruningConfig(4, None, "score", "preserve_mass", 2, 1))
# a device selection bias learnt by device balancing (block version 3): DeepSeek-V3's native budget
# cannot carry it, so it goes through remote code too
BIASED = {
    "olmoe-device-bias": ("olmoe", PruningConfig(2, 1, "similarity")),
    "deepseek_v3-device-bias": ("deepseek_v3", PruningConfig(2, 1, "device_topk_sum")),
}
CASES.update(BIASED)
DEVICE_BIAS = torch.tensor([0.15, -0.15])

_SCRIPT = r"""
import importlib.abc, importlib.util, json, sys
sys.path.extend(json.loads(sys.argv[1]))
if importlib.util.find_spec("occult_ft") is not None:  # a regular (non-editable) install: hide it
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "occult_ft":
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _Hide())
try:
    import occult_ft
    occult_ft_importable = True
except ImportError:
    occult_ft_importable = False
import torch
from transformers import AutoModelForCausalLM

ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
out = {"occult_ft_importable": occult_ft_importable}
for name, path in json.loads(sys.argv[3]).items():
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    try:
        remote = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    except ValueError as err:
        with torch.no_grad():
            out[name] = {"remote_error": str(err), "plain_class": type(plain).__name__, "plain": plain(ids).logits}
        continue
    with torch.no_grad():
        out[name] = {
            "remote_class": type(remote).__name__,
            "remote": remote(ids).logits,
            "plain_class": type(plain).__name__,
            "plain": plain(ids).logits,
        }
    if name == "olmoe-similarity":  # a remote model saves (code and tables) and reloads the same
        remote.save_pretrained(path + "-resaved")
        again = AutoModelForCausalLM.from_pretrained(path + "-resaved", trust_remote_code=True)
        with torch.no_grad():
            out[name]["resaved"] = again(ids).logits
torch.save(out, sys.argv[2])
"""


def _ids():
    return torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def _model(model_type, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()


def _similarity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(layer.num_experts, layer.num_experts, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


def _save(path, model_type, pruning, biased=False) -> str:
    model = _model(model_type)
    similarity = _similarity(model) if pruning.criterion == "similarity" else None
    bias = {layer.index: DEVICE_BIAS for layer in find_moe_layers(model)} if biased else None
    apply_occult(model, pruning=pruning, similarity=similarity, device_bias=bias)
    return save_pruned(model, str(path), pruning=pruning, similarity=similarity)


@torch.no_grad()
def _logits(model):
    return model.eval()(_ids()).logits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Save every case, load each with occult_ft here and with stock transformers in the subprocess."""
    root = tmp_path_factory.mktemp("remote")
    dirs = {name: _save(root / name, t, p, name in BIASED) for name, (t, p) in CASES.items()}
    ref = {name: _logits(from_pretrained(path)) for name, path in dirs.items()}
    # without its tables a similarity checkpoint is refused (it would route by something else)
    dirs["olmoe-no-tables"] = str(shutil.copytree(dirs["olmoe-similarity"], root / "olmoe-no-tables"))
    os.remove(os.path.join(dirs["olmoe-no-tables"], SIMILARITY_FILE))
    # a checkpoint loaded by occult_ft and saved again carries the code again
    from_pretrained(dirs["olmoe-score"]).save_pretrained(root / "olmoe-resaved")
    dirs["olmoe-resaved"], ref["olmoe-resaved"] = str(root / "olmoe-resaved"), ref["olmoe-score"]
    unpruned = {name: _logits(AutoModelForCausalLM.from_pretrained(path)) for name, path in dirs.items()}

    results = root / "results.pt"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "HF_HUB_OFFLINE": "1"}
    env.update(
        HF_HOME=str(root / "hf"), HF_MODULES_CACHE=str(root / "modules"), TOKENIZERS_PARALLELISM="false"
    )
    cmd = [sys.executable, "-I", "-S", "-c", _SCRIPT, json.dumps(site.getsitepackages()), str(results)]
    proc = subprocess.run(
        [*cmd, json.dumps(dirs)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=safety_timeout(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(dirs=dirs, ref=ref, unpruned=unpruned, got=torch.load(results), stderr=proc.stderr)


@pytest.mark.slow
def test_the_subprocess_cannot_import_occult_ft(run):
    assert run["got"]["occult_ft_importable"] is False


@pytest.mark.parametrize("name", [*CASES, "olmoe-resaved"])
def test_trust_remote_code_routes_like_occult_ft(run, name):
    model_type = CASES.get(name, CASES["olmoe-score"])[0]
    got = run["got"][name]
    assert got["remote_class"] == remote_class_name(model_type)
    # the saved config names the remote class: a serving engine without the budget refuses it (vLLM has
    # no `Occult<Base>` class) instead of serving the checkpoint with the unpruned routing
    saved = json.loads(open(os.path.join(run["dirs"][name], "config.json")).read())
    assert saved["architectures"] == [remote_class_name(model_type)]
    torch.testing.assert_close(got["remote"], run["ref"][name], atol=1e-5, rtol=0)
    # the budget matters on these inputs, so matching occult_ft is not matching the stock routing
    assert (run["ref"][name] - run["unpruned"][name]).abs().max() > 1e-3


@pytest.mark.parametrize("name", [*CASES, "olmoe-no-tables", "olmoe-resaved"])
def test_without_trust_remote_code_the_stock_class_loads_unpruned(run, name):
    got = run["got"][name]
    assert got["plain_class"] == remote_class_name(CASES.get(name, CASES["olmoe-score"])[0])[len("Occult") :]
    torch.testing.assert_close(got["plain"], run["unpruned"][name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(BIASED))
def test_the_device_bias_is_used(run, name):
    """The biased checkpoints do not route like the same weights and budget without the bias."""
    model_type, pruning = BIASED[name]
    stock = AutoModelForCausalLM.from_pretrained(run["dirs"][name])
    similarity = _similarity(stock) if pruning.criterion == "similarity" else None
    unbiased = _logits(apply_occult(stock, pruning=pruning, similarity=similarity))
    assert (run["got"][name]["remote"] - unbiased).abs().max() > 1e-4


@pytest.mark.parametrize("model_type", TYPES)
def test_similarity_tables_are_used(run, model_type):
    """The similarity checkpoints do not route like `score` would on the same weights."""
    stock = AutoModelForCausalLM.from_pretrained(run["dirs"][f"{model_type}-similarity"])
    score = _logits(apply_occult(stock, pruning=PruningConfig(2, 1, "score")))
    assert (run["got"][f"{model_type}-similarity"]["remote"] - score).abs().max() > 1e-4


def test_missing_similarity_tables_are_refused_in_one_line(run):
    error = run["got"]["olmoe-no-tables"]["remote_error"]
    assert f"{SIMILARITY_FILE} was not found" in error and "put the checkpoint's" in error
    assert "\n" not in error
    with pytest.raises(ValueError, match="similarity"):  # occult_ft's own loader refuses it as well
        from_pretrained(run["dirs"]["olmoe-no-tables"])


def test_a_remote_model_saves_code_and_tables_and_reloads_the_same(run):
    resaved = run["dirs"]["olmoe-similarity"] + "-resaved"
    assert {REMOTE_CODE_FILE, SIMILARITY_FILE} <= set(os.listdir(resaved))
    torch.testing.assert_close(run["got"]["olmoe-similarity"]["resaved"], run["ref"]["olmoe-similarity"])


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
def test_generated_code_compiles_and_imports_no_occult_ft(model_type):
    tree = ast.parse(remote_code_source(model_type))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.split(".")[0] == "occult_ft" for m in modules)
    assert {"torch", "transformers"} <= {m.split(".")[0] for m in modules if m}
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert remote_class_name(model_type) in classes


@pytest.mark.parametrize(
    "model_type, pruning",
    [
        ("olmoe", None),  # placement only: the stock routing is the checkpoint's
        ("olmoe", PruningConfig(2, 2, "score")),  # a budget of every device is no budget
        ("deepseek_v2", PruningConfig(2, 1, "score")),  # native group_limited_greedy fields
        ("deepseek_v3", PruningConfig(2, 1, "device_topk_sum")),  # native n_group / topk_group
    ],
)
def test_no_remote_code_without_an_active_non_native_budget(tmp_path, model_type, pruning):
    save_pruned(_model(model_type), str(tmp_path), pruning=pruning)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "auto_map" not in config and not (tmp_path / REMOTE_CODE_FILE).exists()
    assert not describe_checkpoint(tmp_path).remote_code


def test_occult_config_fields_restores_auto_map_and_drops_a_stale_entry():
    config = tiny_config("olmoe")
    config.auto_map = {**remote_auto_map("olmoe"), "AutoTokenizer": "mine.Tok"}
    with occult_config_fields(config, OccultBlock()):  # nothing to route: our entry goes
        assert config.auto_map == {"AutoTokenizer": "mine.Tok"}
    with occult_config_fields(config, OccultBlock.build(PruningConfig(2, 1)), save_dir="/nonexistent"):
        assert config.auto_map == {**remote_auto_map("olmoe"), "AutoTokenizer": "mine.Tok"}
    assert config.auto_map == {**remote_auto_map("olmoe"), "AutoTokenizer": "mine.Tok"}


def test_loading_with_occult_ft_drops_the_auto_map_entry(run):
    model = from_pretrained(run["dirs"]["olmoe-score"])
    assert getattr(model.config, "auto_map", None) is None  # a later stock save cannot point at no file


def test_card_offers_trust_remote_code(run):
    path = run["dirs"]["qwen3_moe-score"]
    assert describe_checkpoint(path).remote_code
    text = hub.build_model_card(path, repo_id="me/qwen3-occult").text
    assert 'AutoModelForCausalLM.from_pretrained("me/qwen3-occult", trust_remote_code=True)' in text
    assert "routes with the original top-k" in text
