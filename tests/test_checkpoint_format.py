"""The typed `occult` block (`occult_ft.checkpoint.format`): one definition of a pruned checkpoint, read
back from every version written so far, refusing contradictions; and the one path apply -> save -> load."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.apply import apply_occult
from occult_ft.checkpoint import (
    BLOCK_VERSION,
    LEGACY_SIMILARITY_FILES,
    OCCULT_KEY,
    SIMILARITY_FILE,
    CheckpointError,
    OccultBlock,
    PlacementRecord,
    block_placement,
    describe_checkpoint,
    model_block,
    read_block,
    save_pruned,
)
from occult_ft.checkpoint.card import build_model_card
from occult_ft.checkpoint.load import from_pretrained, load_model_and_tokenizer
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig, pruned_routers, router_similarity, unpruned_routing

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _model(model_type="olmoe", seed=0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def _placement(model, devices=4, nodes=1, seed=0) -> Placement:
    layers = find_moe_layers(model)
    e = layers[0].num_experts
    g = torch.Generator().manual_seed(seed)
    groups = {}
    for layer in layers:
        perm = torch.randperm(e, generator=g).tolist()
        groups[layer.index] = [
            sorted(perm[d * e // devices : (d + 1) * e // devices]) for d in range(devices)
        ]
    return Placement(
        model=None,
        model_type=layers[0].arch.model_type,
        num_experts=e,
        num_devices=devices,
        num_nodes=nodes,
        algorithm="test",
        groups=groups,
        metrics={},
    )


def _similarity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = find_moe_layers(model)[0].num_experts
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(e, e, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


def _ids(vocab=100):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


# ---- the block itself ------------------------------------------------------------------------------------
def test_a_block_survives_its_json_form():
    block = OccultBlock.build(
        PruningConfig(4, 2, "similarity", num_nodes=2, max_nodes_per_token=1),
        PlacementRecord("search", {0: ((0, 5), (1, 2), (3, 7), (4, 6)), 1: ((0, 1), (2, 3), (4, 5), (6, 7))}),
        base_model="org/model",
        model_type="olmoe",
        train_mode="moe",
        comm_complexity_after={"mean": 1.5},
    )
    text = json.dumps(block.to_dict())
    again = OccultBlock.from_dict(json.loads(text))
    assert again == block
    assert again.to_dict()["version"] == BLOCK_VERSION
    assert again.extra == {"train_mode": "moe", "comm_complexity_after": {"mean": 1.5}}


@pytest.mark.parametrize(
    "pruning, pruned",
    [
        (PruningConfig(4, None), False),  # no budget: recorded as no pruning
        (PruningConfig(4, 4), False),  # M = D restricts nothing
        (PruningConfig(4, 2), True),
        (PruningConfig(4, None, num_nodes=2, max_nodes_per_token=1), True),  # a node budget alone
        (PruningConfig(4, None, num_nodes=2, max_nodes_per_token=2), False),
    ],
)
def test_pruned_means_a_device_or_a_node_budget_restricts_the_routing(pruning, pruned):
    block = OccultBlock.build(pruning)
    assert block.pruned is pruned
    assert OccultBlock.from_dict(block.to_dict()).pruned is pruned


@pytest.mark.parametrize(
    "data, match",
    [
        ({"version": BLOCK_VERSION + 1}, "written by a newer occult_ft"),
        (
            {"num_devices": 2, "placement": {"layers": {"0": [[0, 1], [2, 3], [4, 5], [6, 7]]}}},
            "lists 4 groups",
        ),
        (
            {"num_devices": 4, "max_devices_per_token": 5},
            "max_devices_per_token=5 must be between 1 and devices=4",
        ),
        ({"num_devices": 4, "num_nodes": 3}, "num_nodes=3 must be a positive integer dividing num_devices=4"),
        ({"max_devices_per_token": 2}, "devices=None must be a positive integer"),
        (
            {"num_devices": 2, "placement": {"layers": {"1": [[0], [1]], "01": [[1], [0]]}}},
            "lists MoE layer 1 twice",
        ),
        (
            {"num_devices": 2, "placement": {"layers": {"0": [[0, 1], [1, 2]]}}},
            "not a partition of the 4 experts",
        ),
        ({"num_devices": 2, "placement": {"layers": {"x": [[0], [1]]}}}, "layer key 'x' is not an integer"),
        ({"placed": "yes"}, "placed='yes' must be true or false"),
        ({"expert_order": "shuffled"}, "expert_order='shuffled' must be one of placed, original"),
        ([1, 2], "must be a JSON object, got list"),
    ],
)
def test_a_broken_block_is_one_line_naming_the_file(data, match):
    with pytest.raises(CheckpointError, match=match) as err:
        OccultBlock.from_dict(data, "ckpt/config.json (occult)")
    assert str(err.value).startswith("ckpt/config.json (occult)") and "\n" not in str(err.value)


def test_a_checkpoint_whose_block_contradicts_its_placement_is_refused(tmp_path):
    # a hand-edited config.json: the block says 2 devices, its placement lists 4 groups (one per device)
    shutil.copytree(FIXTURES / "pruned-v0.1", tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_file.read_text())
    config[OCCULT_KEY].update(num_devices=2, max_devices_per_token=1)
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_devices=2 but its placement lists 4 groups"):
        from_pretrained(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=str(config_file)):
        describe_checkpoint(str(tmp_path / "ckpt"))


# ---- checkpoints of earlier releases ------------------------------------------------------------------------
def test_a_checkpoint_written_by_occult_ft_0_1_loads_with_its_pruned_routing():
    path = str(FIXTURES / "pruned-v0.1")
    block = read_block(path)
    assert block.version == 1 and block.placed and block.pruned
    assert block.pruning == PruningConfig(4, 2, "similarity")
    assert block.placement.algorithm == "occult" and block.base_model == "tiny-olmoe"
    model = from_pretrained(path)
    recorded = torch.load(FIXTURES / "pruned-v0.1-logits.pt")
    with torch.no_grad():
        logits = model(recorded["input_ids"]).logits.float()
    torch.testing.assert_close(logits, recorded["logits"], rtol=1e-5, atol=1e-5)
    assert all(router.occult_config.max_devices_per_token == 2 for _, router in pruned_routers(model))


def test_an_earlier_release_s_checkpoint_saved_again_keeps_no_file_that_looks_like_weights(tmp_path):
    # occult_ft 0.1 wrote its tables as occult_similarity.safetensors: vLLM loaded them as weights
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "pruned-v0.1", folder)
    assert (folder / LEGACY_SIMILARITY_FILES[0]).is_file() and describe_checkpoint(folder).has_similarity
    model = from_pretrained(str(folder))
    model.save_pretrained(folder)  # over itself: the tables move to today's name
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    assert (folder / SIMILARITY_FILE).is_file()
    recorded = torch.load(FIXTURES / "pruned-v0.1-logits.pt")
    with torch.no_grad():
        logits = from_pretrained(str(folder))(recorded["input_ids"]).logits.float()
    torch.testing.assert_close(logits, recorded["logits"], rtol=1e-5, atol=1e-5)


def test_blocks_of_occult_ft_0_1_adapters_and_unpruned_runs_read_back():
    adapter = OccultBlock.from_dict(json.loads((FIXTURES / "adapter-occult_config-v0.1.json").read_text()))
    assert adapter.version == 1 and not adapter.placed and adapter.expert_order == "original"
    assert adapter.pruning == PruningConfig(4, None, "score", num_nodes=2, max_nodes_per_token=1)
    assert adapter.pruned and adapter.extra["train_mode"] == "lora"
    assert block_placement(adapter, "olmoe").groups == {
        0: [[0, 1], [2, 3], [4, 5], [6, 7]],
        1: [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    unpruned = OccultBlock.from_dict(json.loads((FIXTURES / "unpruned-block-v0.1.json").read_text()))
    assert unpruned.pruning is None and not unpruned.pruned and unpruned.num_devices == 4


# ---- one path: apply -> save_pretrained -> from_pretrained ----------------------------------------------------
@pytest.mark.parametrize("criterion", ["score", "similarity"])
def test_plain_save_pretrained_after_apply_occult_writes_a_complete_pruned_checkpoint(tmp_path, criterion):
    model = _model()
    placement = _placement(model)
    pruning = PruningConfig(4, 2, criterion)
    apply_occult(model, placement, pruning, _similarity(model) if criterion == "similarity" else None)
    out = tmp_path / "ckpt"
    model.save_pretrained(out)  # stock method name, the model's own save
    block = read_block(out)
    assert block.pruning == pruning and block_placement(block).groups == placement.groups
    assert (out / SIMILARITY_FILE).is_file() == (criterion == "similarity")
    assert (out / "occult_pruned_routing.py").is_file() and (out / "README.md").is_file()
    reloaded = from_pretrained(str(out))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, rtol=0, atol=0)


WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.npz")  # what loaders take for shards


@pytest.mark.parametrize("save", ["save_pretrained", "save_pruned"])
def test_only_weight_shards_match_the_globs_weight_loaders_use(tmp_path, save):
    model = _model()
    apply_occult(model, _placement(model), PruningConfig(4, 1, "similarity"), _similarity(model))
    out = tmp_path / "ckpt"
    model.save_pretrained(out) if save == "save_pretrained" else save_pruned(model, str(out))
    matched = sorted({p.name for pattern in WEIGHT_GLOBS for p in out.glob(pattern)})
    assert matched == ["model.safetensors"], matched
    assert (out / SIMILARITY_FILE).is_file() and not SIMILARITY_FILE.endswith(".safetensors")


@pytest.mark.parametrize(
    "model_type, pruning, stock_name",
    [
        ("olmoe", PruningConfig(4, 2, "score"), False),  # remote code: a class vLLM does not know
        ("qwen3_moe", PruningConfig(4, 1, "similarity"), False),
        ("olmoe", None, True),  # placement only: vLLM's own routing is the checkpoint's
        ("deepseek_v3", PruningConfig(4, 1, "device_topk_sum"), True),  # native n_group / topk_group
    ],
)
def test_a_budget_stock_loaders_cannot_route_renames_the_architecture(
    tmp_path, model_type, pruning, stock_name
):
    model = _model(model_type)
    placement = _placement(model)
    similarity = _similarity(model) if pruning is not None and pruning.criterion == "similarity" else None
    apply_occult(model, placement, pruning, similarity)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    stock = type(AutoModelForCausalLM.from_config(tiny_config(model_type))).__name__
    assert saved["architectures"] == [stock if stock_name else f"Occult{stock}"]
    # transformers chooses by model_type: the stock class without trust_remote_code, exact with occult_ft
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == stock
    reloaded = from_pretrained(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, rtol=0, atol=0)


def test_save_pruned_reads_the_budget_and_tables_from_the_model(tmp_path):
    # the README's example: apply_occult installed the tables; save_pruned must save them
    model = _model()
    placement = _placement(model)
    pruning = PruningConfig(4, 1, "similarity")
    apply_occult(model, placement, pruning, _similarity(model))
    save_pruned(model, str(tmp_path / "a"))  # no overrides
    save_pruned(model, str(tmp_path / "b"), None, pruning, placement)  # the README's argument list
    for name in ("a", "b"):
        reloaded = from_pretrained(str(tmp_path / name))
        assert model_block(reloaded).pruning == pruning
        with torch.no_grad():
            torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, rtol=0, atol=0)


def test_save_pruned_overrides_what_the_checkpoint_records(tmp_path):
    model = _model()
    apply_occult(model, _placement(model), PruningConfig(4, 2, "score"))
    save_pruned(
        model, str(tmp_path / "c"), pruning=PruningConfig(4, 1, "score"), extra={"base_model": "org/x"}
    )
    block = read_block(tmp_path / "c")
    assert block.pruning.max_devices_per_token == 1 and block.base_model == "org/x"
    assert model_block(model).pruning.max_devices_per_token == 2  # the live model keeps its own


def test_save_pruned_refuses_a_peft_model(tmp_path):
    pytest.importorskip("peft")
    from occult_ft.integrations.peft import apply_lora

    model = _model()
    apply_occult(model, _placement(model), PruningConfig(4, 2, "score"))
    with pytest.raises(ValueError, match="merge it first"):
        save_pruned(apply_lora(model, r=2, alpha=4.0), str(tmp_path / "x"))


def test_a_second_placement_of_a_placed_model_is_refused():
    model = _model()
    apply_occult(model, _placement(model, seed=0))
    with pytest.raises(ValueError, match="already placed .* apply it to the original model"):
        apply_occult(model, _placement(model, seed=1))


def test_a_placement_after_a_budget_alone_is_recorded():
    model = _model()
    apply_occult(model, pruning=PruningConfig(4, 2, "score"))  # stored order = device order, no provenance
    placement = _placement(model)
    apply_occult(model, placement)
    assert block_placement(model_block(model)).groups == placement.groups


def test_a_budget_for_another_device_count_than_the_placement_is_refused():
    model = _model()
    apply_occult(model, _placement(model, devices=4))
    with pytest.raises(ValueError, match="placed for 4 devices"):
        apply_occult(model, pruning=PruningConfig(2, 1, "score"))


# ---- node budgets everywhere ------------------------------------------------------------------------------
NODE_ONLY = PruningConfig(4, None, "score", num_nodes=2, max_nodes_per_token=1)


def test_a_node_only_budget_round_trips_and_is_reported_as_pruned(tmp_path):
    model = _model()
    apply_occult(model, _placement(model, nodes=2), NODE_ONLY)
    out = tmp_path / "nodes"
    model.save_pretrained(out)
    summary = describe_checkpoint(out)
    assert summary.pruned and summary.needs_occult_ft and not summary.native_routing
    card = str(build_model_card(out))
    assert "| max_nodes_per_token | 1 |" in card and "at most 1 of the 2 nodes" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "trust_remote_code=True" in card
    reloaded = from_pretrained(str(out))
    assert all(r.occult_config == NODE_ONLY for _, r in pruned_routers(reloaded))


def test_the_distillation_teacher_of_a_node_only_budget_is_unpruned():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        stock = model(ids).logits
    apply_occult(model, _placement(model, nodes=2), NODE_ONLY)
    with torch.no_grad():
        pruned = model(ids).logits
        with unpruned_routing(model):
            teacher = model(ids).logits
    assert (pruned - stock).abs().max() > 1e-4  # the budget changes the routing
    torch.testing.assert_close(teacher, stock, rtol=1e-5, atol=1e-5)


def test_stock_loading_of_a_node_only_checkpoint_is_said_aloud(tmp_path, caplog):
    model = _model()
    apply_occult(model, _placement(model, nodes=2), NODE_ONLY)
    model.save_pretrained(tmp_path / "n")
    with caplog.at_level("WARNING", logger="occult_ft"):
        load_model_and_tokenizer(str(tmp_path / "n"))
    assert "pruned to 1 node per token" in caplog.text


def test_measuring_a_node_only_checkpoint_reports_its_node_budget(tmp_path, tiny_tokenizer, text_file):
    from occult_ft.evaluation import measure_checkpoint

    model = _model(vocab_size=len(tiny_tokenizer))
    apply_occult(model, _placement(model, nodes=2), NODE_ONLY)
    out = tmp_path / "n"
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    report = measure_checkpoint(out, data=text_file, max_tokens=128, seq_len=32)
    assert report.extra["max_nodes_per_token"] == 1 and report.extra["criterion"] == "score"
    assert report.extra["max_devices_per_token"] is None


def test_native_group_fields_express_a_node_budget_for_deepseek_v3(tmp_path):
    model = _model("deepseek_v3")
    pruning = PruningConfig(4, None, "device_topk_sum", num_nodes=2, max_nodes_per_token=1)
    apply_occult(model, _placement(model, nodes=2), pruning)
    out = tmp_path / "v3"
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["n_group"], config["topk_group"]) == (2, 1)
    assert describe_checkpoint(out).native_routing
    stock = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(stock(_ids()).logits, model(_ids()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model_type, pruning, base",
    [
        # the model's own fields: no group limit (DeepSeek-V3 n_group=1 / V2 greedy), or V3 in groups
        ("deepseek_v3", PruningConfig(4, 2, "device_topk_sum"), {"n_group": 1, "topk_group": 1}),
        ("deepseek_v3", PruningConfig(4, 1, "device_topk_sum"), {"n_group": 2, "topk_group": 1}),
        (
            "deepseek_v2",
            PruningConfig(4, 1, "device_max"),
            {"topk_method": "greedy", "n_group": None, "topk_group": None},
        ),
    ],
)
def test_a_native_budget_keeps_the_models_own_group_fields_for_occult_ft(tmp_path, model_type, pruning, base):
    """config.json carries the budget in the group fields (stock transformers routes pruned), the block
    the model's own; occult_ft's loader puts them back, so the unpruned routing (removed mass, another
    budget) is the model's, while the pruned routing is unchanged; a second save writes the same."""
    from occult_ft.evaluation import evaluate_model

    model = _model(model_type, **base)
    in_groups = (base.get("n_group") or 1) > 1  # a placement may only move whole groups: keep the order
    apply_occult(model, None if in_groups else _placement(model), pruning)
    out = tmp_path / "native"
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved[OCCULT_KEY]["base_routing"] == {k: base.get(k) for k in saved[OCCULT_KEY]["base_routing"]}
    assert saved["n_group"] == 4 and saved["topk_group"] == pruning.max_devices_per_token
    assert describe_checkpoint(out).native_routing
    assert {k: getattr(model.config, k) for k in base} == base  # the live model keeps its own

    reloaded = from_pretrained(str(out))
    assert {k: getattr(reloaded.config, k) for k in base} == base
    ids = _ids()
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, rtol=0, atol=0)
        stock = AutoModelForCausalLM.from_pretrained(out)
        torch.testing.assert_close(stock(_ids()).logits, model(_ids()).logits, rtol=1e-5, atol=1e-5)
    before, after = evaluate_model(model, batches, 4), evaluate_model(reloaded, batches, 4)
    assert before["removed_mass"] > 0 and after["removed_mass"] == pytest.approx(before["removed_mass"])
    again = tmp_path / "again"
    reloaded.save_pretrained(again)
    assert json.loads((again / "config.json").read_text())[OCCULT_KEY] == saved[OCCULT_KEY]


def test_a_checkpoint_loaded_by_stock_transformers_keeps_the_recorded_group_fields(tmp_path):
    # stock loading routes with the native budget fields; saving that model through occult_ft must not
    # record the budget's fields as the model's own
    model = _model("deepseek_v3", n_group=1, topk_group=1)
    apply_occult(model, _placement(model), PruningConfig(4, 2, "device_topk_sum"))
    model.save_pretrained(tmp_path / "a")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    block = read_block(tmp_path / "a")
    save_pruned(stock, str(tmp_path / "b"), pruning=block.pruning, placement=None)
    assert read_block(tmp_path / "b").base_routing == {"n_group": 1, "topk_group": 1}


def test_a_pruned_checkpoint_that_lost_its_block_is_refused_by_every_loader(tmp_path):
    """config.json names the Occult class but its occult block is gone: the experts are stored placed and
    every loader would route them unpruned, so occult_ft, stock transformers with remote code and the
    checkpoint readers all refuse it in one line."""
    from transformers import AutoConfig

    from occult_ft.serving.routing import ServedRouting

    model = _model()
    apply_occult(model, _placement(model), PruningConfig(4, 1, "score"))
    out = tmp_path / "lost"
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0].startswith("Occult")
    del config[OCCULT_KEY]
    (out / "config.json").write_text(json.dumps(config))
    expected = "has no occult block, without which it would route unpruned; put back the config.json"
    for load in (
        lambda: from_pretrained(str(out)),
        lambda: describe_checkpoint(out),
        lambda: AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True),
        lambda: ServedRouting.from_checkpoint(str(out), AutoConfig.from_pretrained(out)),
    ):
        with pytest.raises(ValueError, match=expected) as err:
            load()
        assert "\n" not in str(err.value)
    assert isinstance(AutoModelForCausalLM.from_pretrained(out), torch.nn.Module)  # stock: its own routing


def test_base_routing_is_refused_in_one_line_when_it_is_not_group_fields():
    good = OccultBlock.build(PruningConfig(4, 2, "device_topk_sum"))
    for bad, match in (
        ({"n_group": 1, "num_layers": 2}, "'num_layers': 2 is not a group-routing field"),
        ({"n_group": 1.5}, "'n_group': 1.5 is not a group-routing field"),
        ({}, "must map n_group, topk_group, topk_method"),
    ):
        with pytest.raises(CheckpointError, match=match):
            OccultBlock.from_dict({**good.to_dict(), "base_routing": bad}, "cfg.json")
    with pytest.raises(CheckpointError, match="base_routing is recorded without a budget"):
        OccultBlock.from_dict({"num_devices": 4, "base_routing": {"n_group": 1}}, "cfg.json")


def test_router_similarity_is_what_a_checkpoint_saves(tmp_path):
    model = _model()
    sim = _similarity(model)
    apply_occult(model, None, PruningConfig(4, 2, "similarity"), sim)
    held = router_similarity(model)
    for i, table in sim.items():
        torch.testing.assert_close(held[i], table)
    model.save_pretrained(tmp_path / "s")
    from occult_ft.checkpoint import read_similarity

    for i, table in read_similarity(str(tmp_path / "s")).items():
        torch.testing.assert_close(table, sim[i])
    assert os.path.isfile(tmp_path / "s" / SIMILARITY_FILE)
