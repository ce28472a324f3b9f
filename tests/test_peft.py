"""LoRA through PEFT: targets per architecture, training, adapter checkpoints with pruned routing, resume."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import SAMPLE_TEXT, save_tiny_model
from transformers import AutoModelForCausalLM, TrainerCallback

import occult_ft
from occult_ft.integrations.peft import is_peft_model, lora_targets
from occult_ft.metrics import contiguous_expert_device, devices_per_token
from occult_ft.models import CORE_MODEL_TYPES, get_arch, tiny_config
from occult_ft.routing import collect_routing, set_recording
from occult_ft.trainer import OccultConfig, OccultTrainer

pytest.importorskip("peft")


def make_config(out, **overrides) -> OccultConfig:
    base = dict(
        output_dir=str(out),
        seq_len=32,
        devices=4,
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        profile_tokens=2000,
        train_mode="lora",
        lora_r=4,
        lora_alpha=8,
        max_devices_per_token=1,
    )
    base.update(overrides)
    return OccultConfig(**base)


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class MaxDevices(TrainerCallback):
    def __init__(self):
        self.worst, self.dev = 0, contiguous_expert_device(8, 4)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for rec in collect_routing(model).values():
            self.worst = max(self.worst, int(devices_per_token(rec.topk_ids, self.dev, 4).max()))


@pytest.fixture(scope="module")
def rows(tiny_tokenizer, tmp_path_factory):
    from occult_ft.data import load_text_dataset, tokenize_dataset

    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join([SAMPLE_TEXT] * 6))
    return tokenize_dataset(load_text_dataset(str(path)), tiny_tokenizer, seq_len=32)


@pytest.mark.parametrize("model_type", list(CORE_MODEL_TYPES))
def test_lora_targets_come_from_the_registry(model_type):
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    targets = lora_targets(model)
    assert targets["modules_to_save"] == [f"mlp.{get_arch(model).router_attr}"]
    assert targets["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert targets["target_modules"] and set(targets["target_modules"]) <= linears & {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    if model_type.startswith("deepseek"):  # MLA: no k_proj / v_proj
        assert targets["target_modules"] == ["q_proj", "o_proj"]
    if model_type == "gpt_oss":
        assert targets["modules_to_save"] == ["mlp.router"]


def test_lora_trains_adapters_and_routers_only_within_budget(tiny_olmoe_dir, rows, tmp_path):
    check = MaxDevices()
    trainer = OccultTrainer(tiny_olmoe_dir, args=make_config(tmp_path), train_dataset=rows, callbacks=[check])
    assert is_peft_model(trainer.model)
    before = params(trainer.model)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = params(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed <= trainable
    assert any("lora_B" in n and "experts" in n for n in changed)  # expert adapters
    assert any("lora_B" in n and "self_attn" in n for n in changed)  # attention adapters
    assert any(".mlp.gate.modules_to_save" in n for n in changed)  # the router itself
    assert not any("base_layer" in n and "lora" not in n for n in changed)
    assert check.worst == 1
    log = [e for e in trainer.state.log_history if "loss" in e][-1]
    assert log["max_token_devices"] == 1 and "removed_mass" in log


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "gate"]])
def test_a_peft_config_reaching_the_routers_trains_them_whole_and_saves(
    tiny_olmoe_dir, rows, tmp_path, targets
):
    """PEFT resolves 'all-linear' (and a v4-style 'gate') on an MoE model to LoRA on the router's weight,
    which hid the routers from occult_ft (no routing logged) and broke the save at the end of the run: the
    routers train whole instead, the other targets keep their LoRA, and the adapter reloads exactly."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    trainer = OccultTrainer(
        tiny_olmoe_dir,
        args=make_config(tmp_path / "run", max_steps=2),
        train_dataset=rows,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    base = trainer.model.get_base_model()
    assert not any(isinstance(layer.mlp.gate, BaseTunerLayer) for layer in base.model.layers)
    before = params(trainer.model)
    trainer.train()
    changed = {n for n, p in params(trainer.model).items() if not torch.equal(before[n], p)}
    assert any(".mlp.gate.modules_to_save" in n for n in changed)  # the routers, whole
    assert any("lora_B" in n and "q_proj" in n for n in changed)  # the user's other targets, LoRA
    log = [e for e in trainer.state.log_history if "loss" in e][-1]
    assert log["max_token_devices"] == 1 and log["comm_complexity"] <= 1
    out = str(tmp_path / "adapter")
    trainer.save_model(out)
    ids = torch.randint(3, 120, (2, 16))
    reloaded = occult_ft.from_pretrained(out)
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_lora_checkpoint_reloads_with_pruned_routing_and_the_same_logits(tiny_olmoe_dir, rows, tmp_path):
    trainer = OccultTrainer(tiny_olmoe_dir, args=make_config(tmp_path / "run"), train_dataset=rows)
    trainer.train()
    out = str(tmp_path / "adapter")
    trainer.save_model(out)
    for name in (
        "adapter_config.json",
        "occult_config.json",
        "occult_similarity.tables",
        "tokenizer.json",
    ):
        assert os.path.isfile(os.path.join(out, name)), name
    block = json.load(open(os.path.join(out, "occult_config.json")))
    assert block["placed"] is False and block["max_devices_per_token"] == 1 and block["train_mode"] == "lora"
    assert block["placement"]["layers"] == {str(k): v for k, v in trainer.occult.placement.groups.items()}
    reloaded = occult_ft.from_pretrained(out)
    ids = torch.randint(3, 120, (2, 16))
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)
    set_recording(reloaded, True)
    logits_of(reloaded, ids)
    records = collect_routing(reloaded)
    assert sorted(records) == [0, 1]
    assert all(
        devices_per_token(r.topk_ids, contiguous_expert_device(8, 4), 4).max() == 1 for r in records.values()
    )


def test_eval_command_loads_a_lora_adapter_with_its_budget(tiny_olmoe_dir, rows, tmp_path, capsys):
    from occult_ft.cli import main

    data = tmp_path / "eval.txt"
    data.write_text(SAMPLE_TEXT * 3)
    trainer = OccultTrainer(
        tiny_olmoe_dir, args=make_config(tmp_path / "run", max_steps=1), train_dataset=rows
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "adapter"), "--data", str(data), "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_devices_per_token"] == 1 and report["comm_complexity"] == 1.0 and report["loss"] > 0


def test_lora_resume_ends_where_the_uninterrupted_run_ends(tiny_olmoe_dir, rows, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3)
    straight = OccultTrainer(tiny_olmoe_dir, args=make_config(tmp_path / "a", **common), train_dataset=rows)
    straight.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-3")
    assert os.path.isfile(os.path.join(checkpoint, "occult_config.json"))
    resumed = OccultTrainer(
        tiny_olmoe_dir,
        args=make_config(tmp_path / "b", resume_from_checkpoint=checkpoint, **common),
        train_dataset=rows,
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    end_a, end_b = params(straight.model), params(resumed.model)
    for name in end_a:
        torch.testing.assert_close(end_b[name], end_a[name], rtol=0, atol=1e-6)
    loss_a = [e for e in straight.state.log_history if "loss" in e][-1]["loss"]
    loss_b = [e for e in resumed.state.log_history if "loss" in e][-1]["loss"]
    assert loss_b == pytest.approx(loss_a, abs=1e-6)


def test_an_adapter_directory_continues_training_without_replacing(tiny_olmoe_dir, rows, tmp_path):
    first = OccultTrainer(tiny_olmoe_dir, args=make_config(tmp_path / "one", max_steps=2), train_dataset=rows)
    first.train()
    first.save_model(str(tmp_path / "adapter"))
    model = occult_ft.from_pretrained(str(tmp_path / "adapter"), is_trainable=True)
    ids = torch.randint(3, 120, (2, 16))
    expected = logits_of(model, ids)
    second = OccultTrainer(model, args=make_config(tmp_path / "two", max_steps=2), train_dataset=rows)
    torch.testing.assert_close(logits_of(second.model, ids), expected)  # not placed a second time
    assert second.occult.placement.groups == first.occult.placement.groups
    second.train()
    with pytest.raises(ValueError, match="set train_mode='lora'"):
        OccultTrainer(
            second.model, args=make_config(tmp_path / "three", train_mode="full"), train_dataset=rows
        )


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_lora_on_other_architectures_reloads_exactly(model_type, tiny_tokenizer, rows, tmp_path):
    overrides = (
        {"num_key_value_heads": 4} if model_type == "deepseek_v3" else {}
    )  # MLA has no grouped KV heads
    base = save_tiny_model(tmp_path / model_type, model_type, tiny_tokenizer, **overrides)
    check = MaxDevices()
    trainer = OccultTrainer(
        base, args=make_config(tmp_path / "run", max_steps=2), train_dataset=rows, callbacks=[check]
    )
    trainer.train()
    assert check.worst == 1
    out = str(tmp_path / "adapter")
    trainer.save_model(out)
    reloaded = occult_ft.from_pretrained(out)
    ids = torch.randint(3, 120, (2, 16))
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_permute_state_dict_moves_lora_factors_with_their_experts():
    """A LoRA model whose state is permuted computes the same function: every expert-indexed tensor
    (base experts, router and its PEFT copies, LoRA A rows and B columns) moved together."""
    from occult_ft.apply import permute_state_dict
    from occult_ft.integrations.peft import apply_lora
    from occult_ft.placement import Placement

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe")).eval()
    peft_model = apply_lora(model, r=2, alpha=4.0)
    with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    groups = {i: [[7, 0], [5, 2], [1, 6], [3, 4]] for i in (0, 1)}
    placement = Placement(None, "olmoe", 8, 4, 1, "test", groups, {})
    ids = torch.randint(3, 100, (2, 12))
    before = logits_of(peft_model, ids)
    state = {k: v.clone() for k, v in peft_model.state_dict().items()}  # live tensors change on load
    moved = permute_state_dict(peft_model, state, placement)
    assert not torch.equal(
        moved["base_model.model.model.layers.0.mlp.experts.lora_A.default.weight"],
        state["base_model.model.model.layers.0.mlp.experts.lora_A.default.weight"],
    )
    peft_model.load_state_dict(moved)
    torch.testing.assert_close(logits_of(peft_model, ids), before, rtol=1e-5, atol=1e-5)
    back = permute_state_dict(peft_model, peft_model.state_dict(), placement, inverse=True)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("budget", [None, 2])
def test_a_saved_adapter_works_in_stock_peft_on_the_stock_base(tiny_olmoe_dir, rows, tmp_path, budget):
    """The adapter a run saves is in the base model's own expert order: `PeftModel.from_pretrained` on
    the unpermuted base computes the trained model (exactly without a budget; with one, only the pruning
    is missing), and occult_ft.from_pretrained still gives the trained, pruned model."""
    from peft import PeftModel

    config = make_config(tmp_path / "run", placement="auto", max_devices_per_token=budget, max_steps=4)
    trainer = OccultTrainer(tiny_olmoe_dir, args=config, train_dataset=rows)
    trainer.train()
    out = str(tmp_path / "adapter")
    trainer.save_model(out)
    assert json.load(open(os.path.join(out, "occult_config.json")))["expert_order"] == "original"
    assert trainer.occult.placement.groups != {  # the test needs a real permutation
        i: [list(range(d * 2, d * 2 + 2)) for d in range(4)] for i in (0, 1)
    }
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_olmoe_dir), out)
    ours = occult_ft.from_pretrained(out)
    ids = torch.tensor([rows[i]["input_ids"] for i in range(4)])
    torch.testing.assert_close(logits_of(ours, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)

    def loss(model):
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    if budget is None:
        torch.testing.assert_close(logits_of(stock, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)
    else:
        assert (
            abs(loss(stock) - loss(ours)) / loss(ours) < 0.02
        )  # a stock-PEFT load of the adapter scores within 2% of occult_ft's
    card = open(os.path.join(out, "README.md")).read()  # written by save_model at the end of training
    assert "PeftModel.from_pretrained" in card
    assert ("without the collaboration pruning" in card) == (budget is not None)


# ---- expert parallelism: the expert LoRA factors shard with the experts ------------------------------
def _lora_with_random_b(seed: int = 0, model_type: str = "olmoe"):
    """A tiny LoRA model (r=2, E=8) whose lora_B is random (PEFT starts it at zero, which would make
    every delta zero and the checks below vacuous)."""
    from occult_ft.integrations.peft import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_config(tiny_config(model_type)), r=2, alpha=4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


class _Engine(torch.nn.Module):
    """A wrapper as DDP, a DeepSpeed engine and accelerate build one: the model under `.module`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def test_unwrap_model_strips_every_wrapper_and_keeps_peft_when_asked():
    from transformers import PreTrainedModel

    from occult_ft.models import unwrap_model

    peft_model = _lora_with_random_b()
    base = peft_model.get_base_model()
    assert isinstance(base, PreTrainedModel)
    wrapped = _Engine(_Engine(peft_model))
    assert unwrap_model(wrapped) is base and unwrap_model(peft_model) is base and unwrap_model(base) is base
    assert unwrap_model(wrapped, keep_peft=True) is peft_model  # the names DDP and saved adapters use
    assert unwrap_model(_Engine(base), keep_peft=True) is base  # no PEFT: as keep_peft=False
    assert is_peft_model(wrapped) and not is_peft_model(_Engine(base))
    assert unwrap_model(None) is None


@pytest.mark.parametrize(
    "model_type, start, count",
    [
        ("olmoe", 0, 4),
        ("olmoe", 4, 4),
        ("olmoe", 2, 2),
        ("olmoe", 7, 1),
        ("gpt_oss", 3, 1),
        ("gpt_oss", 2, 2),
    ],
)
def test_sharded_expert_lora_gives_the_delta_of_its_own_experts(model_type, start, count):
    """Also with one expert left on a rank, where PEFT's own delta is 2-D (its nn.Linear path), which does
    not fit GPT-OSS's (1, in, out) expert tensors: the delta stays per expert, shaped like the weight."""
    from occult_ft.integrations.peft import expert_lora_wrappers, shard_expert_lora
    from occult_ft.models import base_experts, find_moe_layers

    model = _lora_with_random_b(model_type=model_type)
    layer = find_moe_layers(model)[0]
    experts = layer.experts
    wrappers = expert_lora_wrappers(experts)
    assert [w.parameter_name for w in wrappers] == ["down_proj", "gate_up_proj"]  # outermost first
    full = [w.get_delta_weight("default").clone() for w in wrappers]  # (8, ...) each
    base = base_experts(experts)
    for name in ("down_proj", "gate_up_proj", "down_proj_bias", "gate_up_proj_bias"):  # a rank's block only
        if not hasattr(base, name):
            continue
        setattr(base, name, torch.nn.Parameter(getattr(base, name).detach()[start : start + count].clone()))
    base.num_experts = count
    new = shard_expert_lora(experts, start, count)
    assert len(new) == 4 and all(p.occult_expert_shard and p.requires_grad for p in new)
    for wrapper, delta in zip(wrappers, full):
        assert wrapper.num_experts == count and wrapper.lora_A["default"].weight.shape[0] == 2 * count
        assert wrapper.lora_B["default"].weight.shape[1] == 2 * count
        got = wrapper.get_delta_weight("default")
        assert got.shape == getattr(base, wrapper.parameter_name).shape
        torch.testing.assert_close(got, delta[start : start + count])
    # the forward folds the deltas into the local weights (PEFT's parametrisation): shapes must agree
    hidden = torch.randn(5, model.config.hidden_size)
    index = torch.full((5, 2), 0, dtype=torch.long)
    experts(hidden, index, torch.full((5, 2), 0.5))
    with pytest.raises(ValueError, match="already sharded"):
        shard_expert_lora(experts, start, count)


def test_shard_adapter_weights_cuts_a_saved_adapter_to_the_local_experts(tmp_path):
    from peft.utils import load_peft_weights

    from occult_ft.integrations.peft import expert_lora_wrappers, shard_adapter_weights, shard_expert_lora
    from occult_ft.models import find_moe_layers

    model = _lora_with_random_b()
    model.save_pretrained(str(tmp_path))
    saved = load_peft_weights(str(tmp_path), device="cpu")
    for layer in find_moe_layers(model):
        shard_expert_lora(layer.experts, 4, 4)  # the second of two ranks
    cut = shard_adapter_weights(model, saved)
    assert cut.keys() == saved.keys()
    for wrapper in expert_lora_wrappers(find_moe_layers(model)[1].experts):
        for which in ("lora_A", "lora_B"):
            param = getattr(wrapper, which)["default"].weight
            name = next(n for n, p in model.named_parameters() if p is param)
            key = name.replace(f".{which}.default.", f".{which}.")
            torch.testing.assert_close(cut[key], param.detach())  # the factors of experts 4..7, exactly
    router = next(k for k in saved if k.endswith("mlp.gate.weight"))
    assert cut[router] is saved[router]  # replicated weights pass unchanged
