"""The whole transformers MoE family, table-driven over what the installed transformers ships.

The list is discovered (`occult_ft.models.moe_family`: every model type whose experts module carries
`@use_experts_implementation`), never typed here. Every member is either supported or refused; for each
refused one the test asserts its one-line refusal before any weight loads. For each supported one a
tiny model (a few layers, hidden 64, 8 experts, top-2, the architecture's dense layers) is built once
(module-scoped fixture, routers re-drawn at random so that routing is diverse) and checked:

- the router self-check passes on every MoE layer (the registry's maths reproduce the model's router);
- the MoE layers found in the model are the ones its config names (`moe_layer_indices`);
- unpruned occult routing (the pruned router class with no budget) gives the stock logits (<= 1e-5);
- a random placement is an exact permutation (stock logits <= 1e-5);
- with budgets of 1 and 2 of 4 devices no token reaches more devices than its budget, counted by a
  hook on every experts module (what the experts actually receive), and the budget of 1 changes
  something (tokens spanned two devices before);
- occult_ft's expert-parallel local compute (`local_moe_forward`) equals the stock experts module;
- LoRA (occult_ft's targets) trains the expert factors and the router copy of the pruned model;
- the memory plan counts the model's parameters exactly;
- the `trust_remote_code` file routes as occult_ft's loader does (all types in one fresh subprocess
  that cannot import occult_ft), and the budget matters on the inputs used.

Expert-parallel exactness over processes runs for one representative per router convention in
`tests/test_family_ep.py`.
"""

from __future__ import annotations

import copy
import json
import os
import site
import subprocess
import sys
import time

import pytest
import torch

from occult_ft.apply import apply_occult
from occult_ft.checkpoint import describe_checkpoint, save_pruned
from occult_ft.checkpoint.load import from_pretrained
from occult_ft.checkpoint.remote_code import remote_class_name
from occult_ft.dispatch.local import local_moe_forward
from occult_ft.dispatch.reference import expert_weights
from occult_ft.models import (
    UnsupportedModelError,
    auto_model_class,
    check_layer_routing,
    find_moe_layers,
    get_arch,
    lookup_arch,
    moe_family,
    moe_layer_indices,
    refusal,
    supported_model_types,
    tiny_config,
)
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig

FAMILY = moe_family()
SUPPORTED = [t for t in FAMILY if lookup_arch(t) is not None]
REFUSED = [t for t in FAMILY if lookup_arch(t) is None]
DEVICES = 4  # 8 experts: 2 per device, so top-2 fits a budget of 1


def test_the_family_is_the_installed_transformers_moe_family():
    # the discovery finds the recent MoE families (GLM-4.x, DeepSeek-V3.2, Qwen3-Next, Qwen3.5, MiniMax-M2,
    # GPT-OSS), and about 65 folders of them in the installed transformers 5.x
    assert {"glm4_moe", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "minimax_m2", "gpt_oss"} <= set(FAMILY)
    assert len(FAMILY) >= 60
    assert "llama" not in FAMILY and "qwen3" not in FAMILY  # dense models are not in it


def test_every_member_is_supported_or_refused_and_nothing_else_is_registered():
    undecided = [t for t in FAMILY if lookup_arch(t) is None and refusal(t) is None]
    assert not undecided, f"add a MoEArch entry or a refusal for {undecided}"
    assert set(supported_model_types()) <= set(FAMILY)


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_type_fails_with_its_line_before_any_weight_loads(model_type, tmp_path):
    from transformers import AutoConfig

    from occult_ft.checkpoint.load import load_model_and_tokenizer

    line = refusal(model_type)
    assert line.startswith(f"{model_type}: ") and "\n" not in line
    with pytest.raises(UnsupportedModelError) as err:
        get_arch(AutoConfig.for_model(model_type))
    assert str(err.value) == line
    # a folder with a config.json and no weights: the loader stops at the config, with the same line
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        load_model_and_tokenizer(str(tmp_path))
    assert str(err.value) == line


# ---- one tiny model per supported type ----------------------------------------------------------------
def _randomize_routers(model, seed: int) -> None:
    """Diverse routing: router matrices ~ N(0, 4/H), biases ~ N(0, 0.01), scales ~ 1 + N(0, 0.01)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in find_moe_layers(model, check=False):
            named = [*layer.router.named_parameters(), *layer.router.named_buffers()]
            named += [
                (n, getattr(layer.block, n)) for n in layer.arch.block_params if hasattr(layer.block, n)
            ]
            for name, tensor in named:
                if not tensor.is_floating_point():
                    continue
                noise = torch.randn(tensor.shape, generator=gen)
                if tensor.dim() >= 2 and tensor.shape[0] > 1:
                    value = noise * 2 / tensor.shape[-1] ** 0.5
                else:
                    value = 1 + 0.1 * noise if "scale" in name else 0.1 * noise
                tensor.copy_(value.to(tensor.dtype))


@pytest.fixture(scope="module", params=SUPPORTED)
def case(request):
    model_type = request.param
    torch.manual_seed(0)
    config = tiny_config(model_type)
    model = auto_model_class(config).from_config(config).float().eval()
    _randomize_routers(model, seed=1)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
    return dict(model_type=model_type, config=config, model=model, ids=ids, logits=logits)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_router_self_check_passes_on_every_moe_layer(case):
    for layer in find_moe_layers(case["model"]):
        check_layer_routing(layer)


def test_moe_layers_are_the_ones_the_config_names(case):
    layers = find_moe_layers(case["model"])
    assert [layer.index for layer in layers] == moe_layer_indices(case["config"])
    assert all(layer.num_experts == 8 and layer.top_k == 2 for layer in layers)


def test_unpruned_occult_routing_gives_the_stock_logits(case):
    model = apply_occult(copy.deepcopy(case["model"]), pruning=PruningConfig(DEVICES))
    assert all(getattr(layer.router, "_occult_pruned", False) for layer in find_moe_layers(model))
    torch.testing.assert_close(_logits(model, case["ids"]), case["logits"], atol=1e-5, rtol=0)


def _random_placement(model, seed: int) -> Placement:
    gen = torch.Generator().manual_seed(seed)
    layers = find_moe_layers(model)
    groups = {}
    for layer in layers:
        order = torch.randperm(layer.num_experts, generator=gen).view(DEVICES, -1)
        groups[layer.index] = [sorted(row.tolist()) for row in order]
    return Placement(None, get_arch(model).model_type, layers[0].num_experts, DEVICES, 1, "random", groups)


def test_random_placement_is_an_exact_permutation(case):
    model = copy.deepcopy(case["model"])
    placement = _random_placement(model, seed=3)
    apply_occult(model, placement=placement, pruning=PruningConfig(DEVICES))
    before = [layer.router for layer in find_moe_layers(case["model"])][0]
    after = [layer.router for layer in find_moe_layers(model)][0]
    assert not all(torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))  # it moved
    torch.testing.assert_close(_logits(model, case["ids"]), case["logits"], atol=1e-5, rtol=0)


def _devices_reached(model, ids) -> list[int]:
    """Per MoE layer, the most devices a token's experts span, read off what each experts module gets."""
    seen = []

    def hook(module, args, kwargs):
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        per_device = module.occult_num_experts // DEVICES
        devices = top_k_index.long() // per_device
        seen.append(max(len(set(row)) for row in devices.tolist()))

    handles = []
    for layer in find_moe_layers(model):
        layer.experts.occult_num_experts = layer.num_experts
        handles.append(layer.experts.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        _logits(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("budget", [1, 2])
def test_no_token_reaches_more_devices_than_its_budget(case, budget):
    unpruned = _devices_reached(copy.deepcopy(case["model"]), case["ids"])
    model = apply_occult(copy.deepcopy(case["model"]), pruning=PruningConfig(DEVICES, budget))
    reached = _devices_reached(model, case["ids"])
    assert len(reached) == len(unpruned) == len(find_moe_layers(model))
    assert max(reached) <= budget, reached
    if budget == 1:
        assert max(unpruned) > 1  # the budget has work to do on these tokens
        assert (_logits(model, case["ids"]) - case["logits"]).abs().max() > 1e-4


def test_expert_parallel_local_compute_equals_the_stock_experts(case):
    layer = find_moe_layers(case["model"])[0]
    gen = torch.Generator().manual_seed(4)
    width = expert_weights(layer.experts)["up_EIO"].shape[1]  # the experts' input (MuSE: a projection)
    hidden = torch.randn(20, width, generator=gen)
    ids = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:2] for _ in range(20)])
    weights = torch.rand(20, 2, generator=gen)
    with torch.no_grad():
        want = layer.experts(hidden, ids, weights)
        got = local_moe_forward(hidden, ids, weights, layer.experts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lora_trains_expert_factors_and_the_router_of_the_pruned_model(case):
    from occult_ft.integrations.peft import apply_lora

    model = apply_occult(copy.deepcopy(case["model"]), pruning=PruningConfig(DEVICES, 1))
    peft_model = apply_lora(model, r=2, alpha=4, seed=0)
    peft_model.train()
    peft_model(case["ids"], labels=case["ids"]).loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    experts = [g for n, g in grads.items() if ".experts." in n and "lora_B" in n]
    routers = [g for n, g in grads.items() if "modules_to_save" in n]
    assert experts and all(g is not None for g in experts)
    assert any(g.abs().sum() > 0 for g in experts)
    assert routers and any(g is not None and g.abs().sum() > 0 for g in routers)


def test_memory_plan_counts_the_parameters_exactly(case):
    from occult_ft.plan import count_params

    counts = count_params(case["config"])
    model = case["model"]
    assert counts.total.numel == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in find_moe_layers(model) for p in layer.experts.parameters())
    assert counts.expert.numel == experts


# ---- the trust_remote_code file, every supported type in one fresh subprocess --------------------------
_REMOTE = r"""
import importlib.abc, importlib.util, json, sys
sys.path.extend(json.loads(sys.argv[1]))
class _Hide(importlib.abc.MetaPathFinder):  # an editable or regular install of occult_ft: unreachable
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "occult_ft":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Hide())
import torch
import transformers

out = {}
ids = torch.load(sys.argv[3])
for name, (path, auto) in json.loads(sys.argv[2]).items():
    model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).float().eval()
    with torch.no_grad():
        out[name] = {"class": type(model).__name__, "logits": model(ids).logits}
torch.save(out, sys.argv[4])
"""


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Save every supported type pruned to 1 of 4 devices; load each with occult_ft here and with stock
    transformers + trust_remote_code in one subprocess."""
    root = tmp_path_factory.mktemp("family-remote")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.save(ids, root / "ids.pt")
    dirs, ref, stock, remote_code = {}, {}, {}, {}
    for model_type in SUPPORTED:
        torch.manual_seed(0)
        config = tiny_config(model_type)
        model = auto_model_class(config).from_config(config).float().eval()
        _randomize_routers(model, seed=1)
        stock[model_type] = _logits(model, ids)
        apply_occult(model, pruning=PruningConfig(DEVICES, 1))
        path = save_pruned(model, str(root / model_type), pruning=PruningConfig(DEVICES, 1))
        dirs[model_type] = (path, auto_model_class(config).__name__)
        remote_code[model_type] = describe_checkpoint(path).remote_code
        ref[model_type] = _logits(from_pretrained(path).float(), ids)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "HF_HUB_OFFLINE": "1"}
    env.update(
        HF_HOME=str(root / "hf"), HF_MODULES_CACHE=str(root / "modules"), TOKENIZERS_PARALLELISM="false"
    )
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-I", "-S", "-c", _REMOTE, json.dumps(site.getsitepackages())]
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, json.dumps(dirs), str(root / "ids.pt"), str(root / "out.pt")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(root / "out.pt")
    return dict(got=got, ref=ref, stock=stock, remote_code=remote_code, seconds=time.perf_counter() - start)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_remote_code_routes_like_occult_ft(remote, model_type):
    got = remote["got"][model_type]
    # DeepSeek-V2-style routers write the budget in their own fields (no remote code needed)
    native = not remote["remote_code"][model_type]
    assert native == (get_arch(model_type).native_group_routing == "max")
    assert got["class"] == remote_class_name(model_type)[len("Occult") if native else 0 :]
    torch.testing.assert_close(got["logits"], remote["ref"][model_type], atol=1e-5, rtol=0)
    # the budget matters on these inputs: matching occult_ft is not matching the stock routing
    assert (remote["ref"][model_type] - remote["stock"][model_type]).abs().max() > 1e-4
