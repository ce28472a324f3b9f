"""The checkpoint owner (`occult_ft.checkpoint`), the atomic writers (`occult_ft.fileio`) and the one place
that applies a placement and a budget (`occult_ft.apply`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from occult_ft.apply import (
    apply_occult,
    placed_copy,
    placed_similarity,
    resolve_placement,
)
from occult_ft.checkpoint import (
    ADAPTER_OCCULT_FILE,
    OCCULT_KEY,
    SIMILARITY_FILE,
    OccultBlock,
    block_placement,
    describe_checkpoint,
    model_block,
    occult_config_fields,
    read_block,
    read_similarity,
    save_pruned,
)
from occult_ft.checkpoint.load import from_pretrained
from occult_ft.fileio import OutputPathError, atomic_directory, atomic_write_text, check_output_path
from occult_ft.models import find_moe_layers, tiny_config
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig, router_similarity


def _model(model_type="olmoe", seed=0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def _shuffled_placement(model, devices=4, seed=0) -> Placement:
    """A random equal-size placement of every MoE layer (original expert ids per device)."""
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
        num_nodes=1,
        algorithm="test",
        groups=groups,
        metrics={},
    )


def _random_similarity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = find_moe_layers(model)[0].num_experts
    out = {}
    for layer in find_moe_layers(model):
        x = torch.rand(e, e, generator=g)
        out[layer.index] = (x + x.T) / 2
    return out


def _ids():
    return torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


# ---- apply ------------------------------------------------------------------------------------------
def test_placed_similarity_is_the_table_indexed_by_the_placed_order():
    model = _model()
    placement = _shuffled_placement(model)
    sim = _random_similarity(model)
    placed = placed_similarity(sim, placement)
    for i, table in sim.items():
        order = placement.expert_order(i)
        # slot a of the placed model holds original expert order[a]: entry (a, b) = sim[order[a], order[b]]
        for a in range(len(order)):
            for b in range(len(order)):
                assert placed[i][a, b] == table[order[a], order[b]]


def test_placement_alone_keeps_the_logits():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
        apply_occult(model, _shuffled_placement(model))
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_placed_copy_leaves_the_original_alone_and_equals_apply_occult():
    model = _model()
    placement = _shuffled_placement(model)
    pruning = PruningConfig(4, 1, "similarity")
    sim = _random_similarity(model)
    reference = apply_occult(_model(), placement, pruning, sim)
    copied = placed_copy(model, placement, pruning, sim)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, reference(ids).logits)
    assert router_similarity(model) is None  # the original has no pruned routers
    held = router_similarity(copied)
    for i, table in placed_similarity(sim, placement).items():
        torch.testing.assert_close(held[i], table)


def test_resolve_placement_checks_devices_and_needs_devices_for_sequential(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="needs the device count"):
        resolve_placement("sequential", model)
    assert resolve_placement("sequential", model, 2).num_devices == 2
    path = tmp_path / "p.json"
    _shuffled_placement(model).save(path)
    with pytest.raises(ValueError, match="devices=2 disagrees with the placement's 4 devices"):
        resolve_placement(str(path), model, 2)


# ---- the occult block ---------------------------------------------------------------------------------
def test_save_pruned_round_trip_block_similarity_and_logits(tmp_path):
    model = _model()
    placement = _shuffled_placement(model)
    pruning = PruningConfig(4, 2, "similarity")
    apply_occult(model, placement, pruning, _random_similarity(model))
    out = str(tmp_path / "ckpt")
    save_pruned(model, out, pruning=pruning, placement=placement, similarity=router_similarity(model))
    block = read_block(out)
    assert block.pruning.max_devices_per_token == 2 and block.pruning.criterion == "similarity"
    assert block.placed is True and block.num_devices == 4
    assert block.pruning == pruning
    assert block_placement(block).groups == placement.groups
    assert set(read_similarity(out)) == {layer.index for layer in find_moe_layers(model)}
    # the live config carries the applied block, as it did before the save
    assert model_block(model) == block
    reloaded = from_pretrained(out)
    assert model_block(reloaded).pruning.max_devices_per_token == 2
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_occult_config_fields_restores_the_config_even_on_error():
    model = _model("deepseek_v3")
    config = model.config
    before = dict(config.__dict__)
    block = OccultBlock.build(PruningConfig(4, 2, "device_topk_sum"))
    with pytest.raises(RuntimeError):
        with occult_config_fields(config, block):
            assert config.n_group == 4 and config.topk_group == 2
            # the block records the model's own group fields the native ones replace
            assert getattr(config, OCCULT_KEY) == {
                **block.to_dict(),
                "base_routing": {"n_group": 1, "topk_group": 1},
            }
            raise RuntimeError("save failed")
    assert config.__dict__ == before


def test_describe_checkpoint_reads_native_routing_from_the_registry(tmp_path):
    model = _model("deepseek_v3")
    pruning = PruningConfig(4, 2, "device_topk_sum")
    apply_occult(model, _shuffled_placement(model), pruning)
    out = str(tmp_path / "v3")
    save_pruned(model, out, pruning=pruning, placement=_shuffled_placement(model))
    summary = describe_checkpoint(out)
    assert summary.kind == "full" and summary.native_routing and not summary.needs_occult_ft
    assert summary.num_experts == 8 and summary.top_k == 2


def test_adapter_block_is_read_from_occult_config_json(tmp_path):
    (tmp_path / ADAPTER_OCCULT_FILE).write_text(json.dumps({"version": 1, "placed": False}))
    (tmp_path / "config.json").write_text(json.dumps({OCCULT_KEY: {"placed": True}}))
    assert read_block(str(tmp_path)) == OccultBlock(placed=False, version=1)
    assert read_block(str(tmp_path / "missing")) is None


# ---- writes that lose nothing ---------------------------------------------------------------------------
def test_save_pruned_over_an_adapter_dir_leaves_no_stale_adapter(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
    (out / SIMILARITY_FILE).write_text("stale")
    model = _model()
    save_pruned(model, str(out), pruning=None, placement=_shuffled_placement(model))
    assert not (out / "adapter_config.json").exists() and not (out / SIMILARITY_FILE).exists()
    assert describe_checkpoint(str(out)).kind == "full"


def test_interrupted_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    model = _model()
    out = str(tmp_path / "ckpt")
    save_pruned(model, out, pruning=PruningConfig(4, 2, "score"), placement=_shuffled_placement(model))
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}

    def crash(self, path, *args, **kwargs):
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write('{"half": ')  # a partial write, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(OSError, match="No space left"):
        save_pruned(model, out, pruning=PruningConfig(4, 1, "score"), placement=_shuffled_placement(model))
    after = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    assert after == before
    assert [n for n in os.listdir(tmp_path) if n != "ckpt"] == []  # the temporary sibling is gone


def test_atomic_directory_replaces_whole_and_cleans_leftovers(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "occult_config.json").write_text("{}")  # an occult_ft adapter ...
    (target / "adapter_model.safetensors").write_text("old")  # ... whose stale weights must go
    (tmp_path / ".d.tmp-leftover").mkdir()  # an earlier write killed with -9
    with atomic_directory(target) as tmp:
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("new")
        assert (target / "adapter_model.safetensors").exists()  # readers see the old one meanwhile
    assert sorted(os.listdir(target)) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_atomic_write_text_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "placement.json"
    atomic_write_text(path, "old")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["placement.json"]


@pytest.mark.parametrize(
    "out, inputs",
    [
        ("model", ["model"]),  # the input itself
        ("model/pruned", ["model"]),  # inside the input
        (".", ["model"]),  # a folder holding the input
        ("profile.safetensors", ["profile.safetensors"]),  # place --out = its own profile
    ],
)
def test_check_output_path_refuses_outputs_that_destroy_an_input(tmp_path, monkeypatch, out, inputs):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "profile.safetensors").write_text("x")
    with pytest.raises(OutputPathError, match="would overwrite the input"):
        check_output_path(out, *inputs)
    check_output_path("elsewhere", *inputs)  # a new sibling is fine
    check_output_path("model", "org/hub-id", directory=True)  # Hub ids are not local inputs


def test_a_nan_similarity_table_is_refused():
    model = _model()
    sim = _random_similarity(model)
    sim[next(iter(sim))][:] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        apply_occult(model, None, PruningConfig(4, 2, "similarity"), sim)


# ---- round trips through stock save_pretrained / push_to_hub / merge_and_unload ------------------------------
def _similarity_checkpoint(tmp_path) -> str:
    model = _model()
    placement = _shuffled_placement(model)
    pruning = PruningConfig(4, 2, "similarity")
    apply_occult(model, placement, pruning, _random_similarity(model))
    out = str(tmp_path / "pruned")
    save_pruned(model, out, pruning=pruning, placement=placement, similarity=router_similarity(model))
    return out


def test_save_pretrained_of_a_loaded_checkpoint_keeps_its_pruned_routing(tmp_path):
    first = from_pretrained(_similarity_checkpoint(tmp_path))
    again = str(tmp_path / "again")
    first.save_pretrained(again)
    assert read_block(again).pruning.criterion == "similarity" and os.path.isfile(
        os.path.join(again, SIMILARITY_FILE)
    )
    second = from_pretrained(again)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, first(ids).logits, rtol=0, atol=0)


def test_push_to_hub_of_a_loaded_checkpoint_uploads_the_pruned_routing(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import transformers.utils.hub as hf_hub
    from huggingface_hub import ModelCard
    from transformers import modeling_utils

    model = from_pretrained(_similarity_checkpoint(tmp_path))
    uploaded = tmp_path / "uploaded"
    api = lambda: SimpleNamespace(create_repo=lambda repo_id, **kw: SimpleNamespace(repo_id=repo_id))  # noqa: E731
    card = lambda *a, **k: ModelCard("---\n---\n")  # noqa: E731
    for module in (hf_hub, modeling_utils):  # push_to_hub / save_pretrained(push_to_hub=True)
        monkeypatch.setattr(module, "hf_api", api)
        monkeypatch.setattr(module, "create_and_tag_model_card", card)
    monkeypatch.setattr(
        type(model), "_upload_modified_files", lambda self, folder, *a, **k: shutil.copytree(folder, uploaded)
    )
    model.push_to_hub("me/pruned")
    assert read_block(str(uploaded)).pruning.max_devices_per_token == 2
    assert (uploaded / SIMILARITY_FILE).is_file() and (uploaded / "occult_pruned_routing.py").is_file()
    shutil.rmtree(uploaded)  # save_pretrained(push_to_hub=True) uploads the side files too
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/pruned", commit_message="m")
    assert (uploaded / SIMILARITY_FILE).is_file() and (uploaded / "occult_pruned_routing.py").is_file()
    assert (tmp_path / "local" / SIMILARITY_FILE).is_file()


def test_a_merged_adapter_saves_a_checkpoint_that_reloads_identically(tmp_path):
    pytest.importorskip("peft")
    from occult_ft.checkpoint import write_adapter_block
    from occult_ft.integrations.peft import apply_lora

    base_dir = str(tmp_path / "base")
    _model(seed=3).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    placement = _shuffled_placement(model)
    pruning = PruningConfig(4, 2, "similarity")
    apply_occult(model, placement, pruning, _random_similarity(model))
    peft_model = apply_lora(model, r=2, alpha=4.0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter)
    from occult_ft.checkpoint import write_similarity

    write_adapter_block(adapter, OccultBlock.build(pruning, placement, placed=False))
    write_similarity(adapter, router_similarity(model))
    loaded = from_pretrained(adapter)
    ids = _ids()
    with torch.no_grad():
        expected = loaded(ids).logits
    merged = loaded.merge_and_unload()
    out = str(tmp_path / "merged")
    merged.save_pretrained(out)
    assert read_block(out).placed is True
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(out)(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_stock_loading_of_a_pruned_checkpoint_is_said_aloud(tmp_path, caplog):
    from occult_ft.checkpoint.load import load_model_and_tokenizer

    path = _similarity_checkpoint(tmp_path)
    with caplog.at_level("WARNING", logger="occult_ft"):
        load_model_and_tokenizer(path)
    assert "pruned to 2 devices per token" in caplog.text and "occult_ft.from_pretrained" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="occult_ft"):
        from_pretrained(path)
    assert "original top-k" not in caplog.text


def test_resume_skips_a_checkpoint_whose_write_was_interrupted(tmp_path):
    """Trainer writes trainer_state.json last: checkpoint-4 without it was killed mid-write."""
    from occult_ft.trainer.prepare import resolve_checkpoint

    for step, complete in ((2, True), (4, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        if complete:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert resolve_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="was not written completely"):
        resolve_checkpoint(str(tmp_path / "checkpoint-4"), str(tmp_path))
