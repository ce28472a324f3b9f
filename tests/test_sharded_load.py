"""`occult_ft.checkpoint.sharded` (`load_sharded_model`): a rank built from disk equals the shard of a normally loaded,
placed and sharded model, and reads no expert it does not hold.

The reference is the slow, obvious path: `from_pretrained` the whole model, `apply_occult(placement)`
(permutes experts and router rows), then keep rows [rank * P, (rank + 1) * P) of every fused expert
tensor, exactly what `shard_experts` keeps. Rank r of D is simulated through explicit arguments, so
no process group is needed; one gloo test runs `OccultTrainer` on 2 processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from dist_utils import free_port
from helpers import build_tokenizer, safety_timeout, save_tiny_model

from occult_ft.checkpoint.load import can_load_sharded, load_sharded_model
from occult_ft.checkpoint.sharded import SafetensorsReader, place_sharded, sharded_placement
from occult_ft.models import CORE_MODEL_TYPES, find_moe_layers
from occult_ft.placement import Placement

#: a placement that moves every expert: device d holds the original ids GROUPS[d] (sorted within a
#: device), so the placed order is 2 7 0 5 3 4 1 6 (placed expert j is original expert ORDER[j])
GROUPS = [[2, 7], [0, 5], [3, 4], [1, 6]]
ORDER = [2, 7, 0, 5, 3, 4, 1, 6]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    cache = {}

    def get(model_type: str, **overrides) -> str:
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(model_type)
            cache[key] = save_tiny_model(path, model_type, tokenizer, **overrides)
        return cache[key]

    return get


def placement_for(model) -> Placement:
    layers = find_moe_layers(model)
    return Placement(None, None, 8, 4, 1, "test", {layer.index: GROUPS for layer in layers})


def reference_state(path: str, placement, dtype=torch.float32) -> tuple[dict, dict]:
    """(state dict, non-persistent buffers) of the whole model, loaded normally and placed."""
    from occult_ft.apply import apply_occult
    from occult_ft.checkpoint.load import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(path, dtype=dtype)
    if placement is not None:
        apply_occult(model, placement)
    return model.state_dict(), dict(model.named_buffers())


def assert_is_shard(model, state: dict, buffers: dict, rank: int, per_device: int) -> None:
    got = model.state_dict()
    assert set(got) == set(state)
    for key, tensor in got.items():
        want = state[key]
        if tensor.shape != want.shape:  # a fused expert tensor: this rank's rows of the placed model
            want = want[rank * per_device : (rank + 1) * per_device]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), key
    for key, buffer in model.named_buffers():  # rotary inv_freq is not in the checkpoint
        assert torch.equal(buffer, buffers[key]), key


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
def test_each_rank_equals_the_shard_of_the_placed_model(model_dirs, model_type):
    path = model_dirs(model_type)
    placement = None
    for rank in range(4):
        model = load_sharded_model(path, rank, 4, placement or "sequential")
        if placement is None:
            placement = placement_for(model)
            model = load_sharded_model(path, rank, 4, placement)
            state, buffers = reference_state(path, placement)
        assert_is_shard(model, state, buffers, rank, per_device=2)
        layer = find_moe_layers(model)[0]
        assert layer.experts.occult_shard.rank == rank and layer.experts.num_experts == 2
        assert model.config._experts_implementation == "occult_ep"
        for name in layer.arch.expert_params:
            assert getattr(getattr(layer.experts, name), "occult_expert_shard", False), name


def test_a_rank_reads_only_its_own_experts(model_dirs, monkeypatch):
    # rank 1 of 4 holds placed experts 2, 3 = original experts ORDER[2:4] = 0 and 5
    path = model_dirs("mixtral")
    reads = []
    original = SafetensorsReader.read_into

    def spy(self, key, out, rows=None):
        reads.append((key, rows))
        return original(self, key, out, rows)

    monkeypatch.setattr(SafetensorsReader, "read_into", spy)
    model = load_sharded_model(path, 1, 4, placement_for(load_sharded_model(path, 0, 4)))
    reads.clear()
    load_sharded_model(path, 1, 4, placement_for(model))
    experts_read = {int(m.group(1)) for key, _ in reads if (m := re.search(r"\.experts\.(\d+)\.", key))}
    assert experts_read == {0, 5}
    # each layer: 2 experts x (w1, w3, w2) per-expert tensors; router rows read whole, in placed order
    layers = len(find_moe_layers(model))
    assert sum(1 for key, _ in reads if ".experts." in key) == layers * 2 * 3
    assert {tuple(rows) for key, rows in reads if key.endswith("gate.weight")} == {tuple(ORDER)}


def test_a_checkpoint_with_fused_experts_is_read_row_by_row(model_dirs, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    source = model_dirs("olmoe")
    model = AutoModelForCausalLM.from_pretrained(source)
    fused = tmp_path / "fused"
    model.config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in SafetensorsReader(str(fused)).entries
    placement = placement_for(model)
    state, buffers = reference_state(source, placement)
    for rank in (0, 3):
        assert_is_shard(load_sharded_model(str(fused), rank, 4, placement), state, buffers, rank, 2)


def test_tied_embeddings_are_tied_after_loading(model_dirs):
    path = model_dirs("olmoe", tie_word_embeddings=True)
    model = load_sharded_model(path, 0, 2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    state, buffers = reference_state(path, None)
    assert_is_shard(model, state, buffers, 0, per_device=4)


def test_a_dtype_is_applied_while_reading(model_dirs):
    path = model_dirs("qwen2_moe")
    model = load_sharded_model(path, 2, 4, dtype=torch.bfloat16)
    state, buffers = reference_state(path, None, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert_is_shard(model, state, buffers, 2, per_device=2)


def test_place_sharded_rereads_the_block_of_a_new_placement(model_dirs):
    path = model_dirs("deepseek_v3")
    model = load_sharded_model(path, 3, 4)  # sequential: what `placement: auto` profiles
    placement = placement_for(model)
    place_sharded(model, placement)
    assert sharded_placement(model) is placement
    state, buffers = reference_state(path, placement)
    assert_is_shard(model, state, buffers, 3, per_device=2)


def test_bad_inputs_are_one_line_errors(model_dirs, tmp_path):
    path = model_dirs("olmoe")
    with pytest.raises(
        ValueError, match=r"^rank=4 is outside the expert-parallel group of size 4; use 0..3$"
    ):
        load_sharded_model(path, 4, 4)
    with pytest.raises(
        ValueError,
        match=r"^expert_parallel_size=3 does not divide the 8 experts of each MoE layer; use one of 1, 2, 4, 8$",
    ):
        load_sharded_model(path, 0, 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((open(os.path.join(path, "config.json"))).read())
    assert not can_load_sharded(str(empty)) and can_load_sharded(path)
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors weights"):
        load_sharded_model(str(empty), 0, 2)


def test_a_quantized_checkpoint_is_refused_before_any_tensor_is_read(model_dirs, tmp_path, monkeypatch):
    """FP8 / MXFP4 checkpoints hold codes and scales: read as weights they would train garbage."""
    import shutil

    quantized = tmp_path / "fp8"
    shutil.copytree(model_dirs("olmoe"), quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(SafetensorsReader, "__init__", lambda *a: pytest.fail("read a tensor file"))
    with pytest.raises(
        ValueError, match=r"stores quantized weights \(quant_method='fp8'\); .* dequantize"
    ) as err:
        load_sharded_model(str(quantized), 0, 2)
    assert "\n" not in str(err.value)


# ---- through OccultTrainer on 2 gloo processes ------------------------------------------------------
def _trainer_worker(spec_path: str) -> None:
    """Build OccultTrainer from a model path with expert_parallel_size=2; rank r writes what it read
    and its expert shards."""
    from datasets import Dataset

    from occult_ft.dispatch import expert_shard_parameters
    from occult_ft.trainer import OccultConfig, OccultTrainer

    torch.set_num_threads(1)
    spec = json.loads(open(spec_path).read())
    reads = []
    original = SafetensorsReader.read_into

    def spy(self, key, out, rows=None):
        reads.append(key)
        return original(self, key, out, rows)

    SafetensorsReader.read_into = spy
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (8, 16), generator=gen).tolist()
    rows = [{"input_ids": r, "attention_mask": [1] * 16, "labels": r} for r in ids]
    args = OccultConfig(
        output_dir=spec["out"],
        devices=2,
        expert_parallel_size=2,
        placement=spec["placement"],
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        model_dtype="float32",
        seq_len=16,
    )
    trainer = OccultTrainer(spec["model"], args=args, train_dataset=Dataset.from_list(rows))
    rank = int(os.environ["RANK"])
    out = {
        "reads": reads,
        "shards": {n: p.detach().tolist() for n, p in expert_shard_parameters(trainer.model)},
        "router": find_moe_layers(trainer.model)[0].router.weight.detach().tolist(),
        "budget": trainer.occult.pruning.max_devices_per_token,
        "placement": {str(i): g for i, g in trainer.occult.placement.groups.items()},
    }
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    _trainer_worker(sys.argv[1])
    from occult_ft.dispatch.comm import exit_rank

    exit_rank(0)  # no interpreter finalization: see exit_rank


def run_trainer(model: str, placement: str, tmp_path) -> list[dict]:
    """`_trainer_worker` on 2 gloo processes under torchrun; returns each rank's record."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": model, "out": str(tmp_path), "placement": placement}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), os.path.abspath(__file__), str(spec)],
        env=env, capture_output=True, text=True, timeout=safety_timeout(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def expert_ids(reads: list[str]) -> set[int]:
    return {int(m.group(1)) for key in reads if (m := re.search(r"\.experts\.(\d+)\.", key))}


@pytest.mark.slow
def test_occult_trainer_under_expert_parallelism_reads_only_its_block(model_dirs, tmp_path):
    from transformers import AutoConfig

    path = model_dirs("olmoe")
    groups = [[0, 2, 5, 7], [1, 3, 4, 6]]  # 2 devices
    layers = AutoConfig.from_pretrained(path).num_hidden_layers
    placement = Placement(None, "olmoe", 8, 2, 1, "test", {i: groups for i in range(layers)})
    placement.save(tmp_path / "placement.json")
    results = run_trainer(path, str(tmp_path / "placement.json"), tmp_path)
    state, _ = reference_state(path, placement)
    for rank, got in enumerate(results):
        # rank 0 holds original experts 0 2 5 7, rank 1 holds 1 3 4 6: no other expert key is read
        assert expert_ids(got["reads"]) == set(groups[rank])
        assert got["shards"], "no expert shard on this rank"
        for name, shard in got["shards"].items():
            assert torch.equal(torch.tensor(shard), state[name][rank * 4 : (rank + 1) * 4]), name
        assert torch.equal(torch.tensor(got["router"]), state["model.layers.0.mlp.gate.weight"])
        assert got["budget"] is None


@pytest.mark.slow
def test_a_placed_pruned_checkpoint_is_read_in_its_stored_order_with_its_budget(model_dirs, tmp_path):
    from occult_ft.apply import apply_occult
    from occult_ft.checkpoint import save_pruned
    from occult_ft.checkpoint.load import load_model_and_tokenizer
    from occult_ft.routing import PruningConfig

    path = model_dirs("olmoe")
    model, tokenizer = load_model_and_tokenizer(path)
    layers = find_moe_layers(model)
    placement = Placement(
        None, "olmoe", 8, 2, 1, "test", {x.index: [[0, 2, 5, 7], [1, 3, 4, 6]] for x in layers}
    )
    apply_occult(model, placement)
    checkpoint = save_pruned(model, str(tmp_path / "pruned"), tokenizer, PruningConfig(2, 1), placement)
    results = run_trainer(checkpoint, "sequential", tmp_path)
    state, _ = reference_state(checkpoint, None)  # stored placed: rank r holds stored rows 4r .. 4r+3
    for rank, got in enumerate(results):
        assert expert_ids(got["reads"]) == set(range(4 * rank, 4 * rank + 4))
        for name, shard in got["shards"].items():
            assert torch.equal(torch.tensor(shard), state[name][rank * 4 : (rank + 1) * 4]), name
        assert got["budget"] == 1


@pytest.mark.slow
def test_auto_placement_profiles_the_sequential_shard_then_rereads_the_placed_block(model_dirs, tmp_path):
    path = model_dirs("olmoe")
    results = run_trainer(path, "auto", tmp_path)
    assert results[0]["placement"] == results[1]["placement"]  # rank 0's placement, broadcast
    groups = {int(i): g for i, g in results[0]["placement"].items()}
    placement = Placement(None, "olmoe", 8, 2, 1, "test", groups)
    assert any(g != [[0, 1, 2, 3], [4, 5, 6, 7]] for g in groups.values()), "auto kept the sequential order"
    state, _ = reference_state(path, placement)
    for rank, got in enumerate(results):
        # first the sequential block (stored experts 4r .. 4r+3), then this rank's experts of the placement
        held = {e for g in groups.values() for e in g[rank]}
        assert expert_ids(got["reads"]) == set(range(4 * rank, 4 * rank + 4)) | held
        for name, shard in got["shards"].items():
            assert torch.equal(torch.tensor(shard), state[name][rank * 4 : (rank + 1) * 4]), name
        assert torch.equal(torch.tensor(got["router"]), state["model.layers.0.mlp.gate.weight"])


@pytest.mark.slow
def test_a_deepseek_moe_checkpoint_is_converted_then_read_shard_wise(tmp_path, monkeypatch):
    """DeepSeek-MoE (no transformers type) under expert parallelism: converted once into the cache, the
    conversion read shard-wise, as `occult-ft train` on a DeepSeek-MoE recipe does."""
    from test_convert import deepseek_config, save_deepseek

    from occult_ft.checkpoint import maybe_convert

    monkeypatch.setenv("OCCULT_FT_CACHE", str(tmp_path / "cache"))  # the ranks inherit it
    path = str(tmp_path / "deepseek")
    save_deepseek(path, deepseek_config(num_hidden_layers=2))
    results = run_trainer(path, "sequential", tmp_path)
    converted = maybe_convert(path)  # the ranks' conversion, found in the cache
    assert converted != path
    state, _ = reference_state(converted, None)
    for rank, got in enumerate(results):
        assert expert_ids(got["reads"]) == set(range(4 * rank, 4 * rank + 4))
        assert got["shards"], "no expert shard on this rank"
        for name, shard in got["shards"].items():
            assert torch.equal(torch.tensor(shard), state[name][rank * 4 : (rank + 1) * 4]), name
