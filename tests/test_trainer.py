"""OccultTrainer / OccultConfig / `occult-ft train` and `occult-ft eval` on tiny models (CPU, seconds each)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from helpers import SAMPLE_TEXT, safety_timeout, save_tiny_model
from transformers import TrainerCallback

import occult_ft
from occult_ft.cli import main
from occult_ft.metrics import contiguous_expert_device, devices_per_token
from occult_ft.routing import RouterRecord, collect_routing, set_recording
from occult_ft.trainer import OccultConfig, OccultTrainer, balance_loss, balance_loss_factor, train

ROUTING_KEYS = (
    "comm_complexity",
    "intra_share",
    "removed_mass",
    "load_imbalance",
    "max_token_devices",
    "balance_loss",
)


def make_config(out, **overrides) -> OccultConfig:
    base = dict(
        output_dir=str(out),
        seq_len=32,
        devices=4,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        learning_rate=5e-3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        profile_tokens=2000,
    )
    base.update(overrides)
    return OccultConfig(**base)


def train_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def flat_params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class BudgetCheck(TrainerCallback):
    """After every optimizer step, the routing of the last forward must respect the budget."""

    def __init__(self, budget: int, num_experts: int = 8, num_devices: int = 4):
        self.budget, self.dev = budget, contiguous_expert_device(num_experts, num_devices)
        self.num_devices, self.steps, self.worst = num_devices, 0, 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        records = collect_routing(model)
        assert records, "the routers recorded nothing during training"
        for rec in records.values():
            self.worst = max(
                self.worst, int(devices_per_token(rec.topk_ids, self.dev, self.num_devices).max())
            )
        self.steps += 1


@pytest.fixture(scope="module")
def data(tiny_tokenizer, tmp_path_factory):
    from occult_ft.data import load_text_dataset, tokenize_dataset

    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join([SAMPLE_TEXT] * 6))
    return str(path), tokenize_dataset(load_text_dataset(str(path)), tiny_tokenizer, seq_len=32)


# ---- the balance loss, worked by hand ----------------------------------------------------------------------------
def test_balance_loss_is_k_for_uniform_routing_and_e_for_collapse():
    # E=4, K=1, 4 tokens each on a different expert, uniform probabilities: f = P = 1/4 -> 4 * 4 * 1/16 = 1 = K
    uniform = RouterRecord(torch.arange(4).unsqueeze(1), torch.full((4, 4), 0.25), torch.zeros(4))
    assert balance_loss({0: uniform}).item() == pytest.approx(1.0)
    # every token on expert 0 with all the probability: f_0 = P_0 = 1 -> 4 * 1 = E
    collapsed = RouterRecord(torch.zeros(4, 1, dtype=torch.long), torch.eye(4)[[0, 0, 0, 0]], torch.zeros(4))
    assert balance_loss({1: collapsed}).item() == pytest.approx(4.0)
    # layers are pooled as transformers pools them: 8 rows, counts (5, 1, 1, 1), probability sums
    # (1+4, 1, 1, 1) -> f = P = (5, 1, 1, 1) / 8 -> 4 * (25 + 1 + 1 + 1) / 64 = 1.75
    assert balance_loss({0: uniform, 1: collapsed}).item() == pytest.approx(1.75)
    # K=2, uniform: tokens pick (0,1), (2,3), (0,2), (1,3): every expert in 2 of 4 tokens, f = 1/2 each,
    # P = 1/4 -> 4 * 4 * 1/8 = 2 = K (transformers' scale: the slots are not normalised away)
    pairs = RouterRecord(
        torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]), torch.full((4, 4), 0.25), torch.zeros(4)
    )
    assert balance_loss({0: pairs}).item() == pytest.approx(2.0)
    # masked tokens are ignored: only token 0 (expert 0, prob 1) counts -> E * 1 * 1 = 4
    probs = torch.eye(4)
    rec = RouterRecord(torch.arange(4).unsqueeze(1), probs, torch.zeros(4))
    assert balance_loss({0: rec}, torch.tensor([True, False, False, False])).item() == pytest.approx(4.0)
    assert balance_loss({0: rec}, torch.zeros(4, dtype=torch.bool)).item() == 0.0  # nothing to balance
    # sigmoid-style scores are normalised per token: 2 * uniform scores behave as uniform
    assert balance_loss(
        {0: RouterRecord(uniform.topk_ids, uniform.probs * 2, uniform.removed_mass)}
    ).item() == pytest.approx(1.0)


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
def test_unpruned_balance_loss_equals_the_models_own(model_type):
    """Same logits, same top-k, no pruning: our loss is transformers' `load_balancing_loss_func`, so the
    model's `router_aux_loss_coef` means the same for `balance_loss_coef`."""
    import importlib

    own = importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"
    ).load_balancing_loss_func
    gen = torch.Generator().manual_seed(3)
    E, K, T = 8, 2, 96
    logits = tuple(torch.randn(T, E, generator=gen) * 2 for _ in range(3))  # 3 layers
    records = {
        i: RouterRecord(torch.softmax(x, -1).topk(K, -1).indices, torch.softmax(x, -1), torch.zeros(T))
        for i, x in enumerate(logits)
    }
    torch.testing.assert_close(balance_loss(records), own(logits, E, K), rtol=0, atol=1e-6)
    # with padding: transformers weights rows by the attention mask, we drop the masked rows
    mask_BS = torch.rand(4, T // 4, generator=gen) > 0.3
    torch.testing.assert_close(
        balance_loss(records, mask_BS.flatten()), own(logits, E, K, mask_BS), rtol=0, atol=1e-6
    )

    # and on a real model: the recorded routing of its own forward
    from transformers import AutoModelForCausalLM

    from occult_ft.models import tiny_config
    from occult_ft.routing import PruningConfig, apply_pruning

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    apply_pruning(model, PruningConfig(num_devices=4))  # no budget: records only
    set_recording(model, True, keep_graph=True)
    out = model(torch.randint(0, 128, (2, 16)), output_router_logits=True)
    expected = own(out.router_logits, 8, 2)  # tiny configs: 8 experts, top-2
    torch.testing.assert_close(balance_loss(collect_routing(model)), expected, rtol=0, atol=1e-6)


def test_balance_loss_factor_divides_only_when_trainer_does_not():
    assert balance_loss_factor(True, 4) == 0.25  # LM loss normalised over the accumulated batch
    assert balance_loss_factor(False, 4) == 1.0  # Trainer divides the whole loss by 4 itself


# ---- training ------------------------------------------------------------------------------------------------------
def test_training_lowers_loss_logs_routing_metrics_and_keeps_every_token_in_budget(
    tiny_olmoe_dir, tiny_tokenizer, data, tmp_path
):
    cfg = make_config(
        tmp_path, max_steps=8, max_devices_per_token=1, train_mode="full", criterion="similarity"
    )
    check = BudgetCheck(budget=1)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1], callbacks=[check])
    trainer.train()
    logs = train_logs(trainer)
    assert len(logs) == 8
    for entry in logs:
        assert all(key in entry for key in ROUTING_KEYS), entry
        # M=1: every token reaches exactly one device, so every co-selected pair is intra-device
        assert (
            entry["comm_complexity"] == 1.0
            and entry["intra_share"] == 1.0
            and entry["max_token_devices"] == 1
        )
        assert 0.0 <= entry["removed_mass"] < 1.0 and entry["load_imbalance"] >= 1.0
    assert sum(e["loss"] for e in logs[-2:]) < sum(e["loss"] for e in logs[:2])
    assert check.steps == 8 and check.worst == 1


def test_unpruned_training_still_logs_routing_metrics(tiny_olmoe_dir, data, tmp_path):
    cfg = make_config(tmp_path, max_steps=2, placement="sequential", criterion="score")
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    trainer.train()
    for entry in train_logs(trainer):
        assert entry["removed_mass"] == 0.0 and 1.0 <= entry["comm_complexity"] <= 2.0


def test_moe_mode_trains_moe_blocks_only(tiny_olmoe_dir, data, tmp_path):
    cfg = make_config(tmp_path, max_steps=3, max_devices_per_token=2, train_mode="moe", criterion="score")
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    before = flat_params(trainer.model)
    trainer.train()
    after = flat_params(trainer.model)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    moe = {name for name in before if ".mlp." in name}
    assert moe and changed == moe  # routers and experts of every layer moved, nothing else did
    assert any(".mlp.gate." in n for n in changed) and any(".mlp.experts." in n for n in changed)


def test_model_aux_loss_is_off_and_balance_loss_enters_the_loss(tiny_olmoe_dir, data, tmp_path):
    """Loss with coef c minus loss with coef 0 on the same batch is exactly c * the balance loss."""
    cfg = make_config(tmp_path, max_devices_per_token=1, criterion="score", balance_loss_coef=0.5)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    assert trainer.model.router_aux_loss_coef == 0.0
    batch = trainer.data_collator([data[1][i] for i in range(2)])
    trainer.model.train()
    with_aux = trainer.compute_loss(trainer.model, dict(batch))
    # with a budget the balance loss includes the device-load term (the trainer's expert -> device map)
    mask = batch["attention_mask"].flatten().bool()
    aux = balance_loss(collect_routing(trainer.model), mask, trainer.occult.expert_device, cfg.devices)
    trainer.args.balance_loss_coef = 0.0
    without = trainer.compute_loss(trainer.model, dict(batch))
    torch.testing.assert_close(with_aux - without, 0.5 * aux, rtol=1e-5, atol=1e-6)


def test_balance_loss_is_not_scaled_by_world_size(tiny_olmoe_dir, data, tmp_path, monkeypatch):
    """Trainer multiplies the token-averaged LM loss by the process count; the balance term must stay a mean."""
    cfg = make_config(tmp_path, max_devices_per_token=1, criterion="score", balance_loss_coef=0.5)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    batch = trainer.data_collator([data[1][i] for i in range(2)])
    items = (batch["labels"][:, 1:] != -100).sum()
    trainer.model.train()
    single = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=items)
    # with a budget the balance loss includes the device-load term (the trainer's expert -> device map)
    mask = batch["attention_mask"].flatten().bool()
    aux = balance_loss(collect_routing(trainer.model), mask, trainer.occult.expert_device, cfg.devices)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    double = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=items)
    lm = single - 0.5 * aux
    torch.testing.assert_close(double, 2 * lm + 0.5 * aux, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_gives_the_same_step_as_one_big_batch(tiny_olmoe_dir, tiny_tokenizer, tmp_path):
    """1 x batch 4 vs 2 accumulated x batch 2 on 4 identical rows: each micro-batch's balance loss equals the
    full batch's, so the logged loss and the SGD step agree only if the balance term is divided by 2."""
    from datasets import Dataset

    row = {"input_ids": list(range(3, 35)), "attention_mask": [1] * 32, "labels": list(range(3, 35))}
    rows = Dataset.from_list([row] * 4)
    results = []
    for accumulation, batch in ((1, 4), (2, 2)):
        cfg = make_config(
            tmp_path / f"ga{accumulation}",
            max_steps=1,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_devices_per_token=1,
            criterion="score",
            placement="sequential",
            balance_loss_coef=5.0,
            optim="sgd",
            learning_rate=0.5,
            lr_scheduler_type="constant",
        )
        trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows, processing_class=tiny_tokenizer)
        trainer.train()
        results.append((train_logs(trainer)[0], flat_params(trainer.model)))
    (log1, params1), (log2, params2) = results
    assert log2["loss"] == pytest.approx(log1["loss"], rel=1e-5)
    assert log2["balance_loss"] == pytest.approx(log1["balance_loss"], rel=1e-5)
    for name in params1:
        torch.testing.assert_close(params2[name], params1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("resume_in", ["config", "train"])
def test_resume_ends_where_the_uninterrupted_run_ends(tiny_olmoe_dir, data, tmp_path, resume_in):
    common = dict(
        max_steps=6, max_devices_per_token=1, train_mode="full", save_strategy="steps", save_steps=3
    )
    straight = OccultTrainer(
        tiny_olmoe_dir, args=make_config(tmp_path / "a", **common), train_dataset=data[1]
    )
    straight.train()
    checkpoint = str(tmp_path / "a" / "checkpoint-3")
    extra = {"resume_from_checkpoint": checkpoint} if resume_in == "config" else {}
    resumed = OccultTrainer(
        tiny_olmoe_dir, args=make_config(tmp_path / "b", **common, **extra), train_dataset=data[1]
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.occult.placement.groups == straight.occult.placement.groups
    end_a, end_b = flat_params(straight.model), flat_params(resumed.model)
    for name in end_a:
        torch.testing.assert_close(end_b[name], end_a[name], rtol=0, atol=1e-6)
    assert train_logs(resumed)[-1]["loss"] == pytest.approx(train_logs(straight)[-1]["loss"], abs=1e-6)


def test_full_checkpoint_reloads_with_pruned_routing_and_the_same_logits(tiny_olmoe_dir, data, tmp_path):
    cfg = make_config(tmp_path / "run", max_steps=3, max_devices_per_token=1, train_mode="full")
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    trainer.train()
    out = str(tmp_path / "final")
    trainer.save_model(out)
    block = json.load(open(os.path.join(out, "config.json")))["occult"]
    assert block["placed"] and block["max_devices_per_token"] == 1 and block["criterion"] == "similarity"
    assert block["placement"]["algorithm"] == "search" and sorted(block["placement"]["layers"]) == ["0", "1"]
    assert os.path.isfile(os.path.join(out, "occult_similarity.safetensors"))
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # stock transformers with trust_remote_code routes with the budget too (tests/test_remote_code.py)
    assert os.path.isfile(os.path.join(out, "occult_pruned_routing.py"))
    assert json.load(open(os.path.join(out, "config.json")))["auto_map"] == {
        "AutoModelForCausalLM": "occult_pruned_routing.OccultOlmoeForCausalLM"
    }
    reloaded = occult_ft.from_pretrained(out)
    ids = torch.randint(3, 120, (2, 16))
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)
    set_recording(reloaded, True)
    logits_of(reloaded, ids)
    for rec in collect_routing(reloaded).values():
        assert devices_per_token(rec.topk_ids, contiguous_expert_device(8, 4), 4).max() == 1


def test_a_pruned_checkpoint_continues_training_without_replacing(tiny_olmoe_dir, data, tmp_path):
    first = OccultTrainer(
        tiny_olmoe_dir,
        args=make_config(tmp_path / "one", max_steps=2, max_devices_per_token=2),
        train_dataset=data[1],
    )
    first.train()
    first.save_model(str(tmp_path / "one-final"))
    cfg = make_config(tmp_path / "two", max_steps=2, max_devices_per_token=1, placement="auto")
    model = occult_ft.from_pretrained(str(tmp_path / "one-final"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    second = OccultTrainer(model, args=cfg, train_dataset=data[1])
    # no second permutation: the weights are untouched until training starts
    assert all(torch.equal(before[k], v) for k, v in second.model.state_dict().items() if k in before)
    assert second.occult.placement.groups == first.occult.placement.groups
    second.train()
    assert train_logs(second)[-1]["max_token_devices"] == 1


def test_evaluate_reports_perplexity_and_routing(tiny_olmoe_dir, data, tmp_path):
    cfg = make_config(tmp_path, max_devices_per_token=1, per_device_eval_batch_size=8)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1], eval_dataset=data[1])
    metrics = trainer.evaluate()
    assert metrics["eval_perplexity"] == pytest.approx(
        torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-6
    )
    assert (
        metrics["eval_comm_complexity"] == 1.0
        and "eval_removed_mass" in metrics
        and "eval_balance_loss" not in metrics
    )


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_other_architectures_train_within_budget_and_reload(model_type, tiny_tokenizer, data, tmp_path):
    # MLA has no grouped KV heads: the registry's tiny DeepSeek config (2 KV heads) breaks under padding masks
    overrides = {"num_key_value_heads": 4} if model_type == "deepseek_v3" else {}
    model_dir = save_tiny_model(tmp_path / model_type, model_type, tiny_tokenizer, **overrides)
    cfg = make_config(tmp_path / "run", max_steps=2, max_devices_per_token=1, train_mode="full")
    check = BudgetCheck(budget=1)
    trainer = OccultTrainer(model_dir, args=cfg, train_dataset=data[1], callbacks=[check])
    trainer.train()
    assert check.worst == 1 and all(k in train_logs(trainer)[-1] for k in ROUTING_KEYS)
    trainer.save_model(str(tmp_path / "out"))
    reloaded = occult_ft.from_pretrained(str(tmp_path / "out"))
    ids = torch.randint(3, 120, (2, 16))
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model, ids), rtol=1e-5, atol=1e-5)


# ---- configuration errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(criterion="scor"), "criterion='scor' is unknown (did you mean 'score'?)"),
        (dict(train_mode="lorra"), "train_mode='lorra' is unknown (did you mean 'lora'?)"),
        (dict(max_devices_per_token=5), "max_devices_per_token=5 must be between 1 and devices=4"),
        (dict(max_devices_per_token=0), "max_devices_per_token=0 must be between 1 and devices=4"),
        (dict(devices=0), "devices=0 must be a positive integer"),
        (dict(nodes=3), "nodes=3 does not divide devices=4"),
        (dict(placement="missing.json"), "placement='missing.json' is neither auto nor sequential"),
        (dict(placement="seqential"), "did you mean 'sequential'?"),
        (dict(placement_algorithm="greedy"), "placement_algorithm='greedy' is unknown"),
        (dict(max_load_imbalance=0.5), "max_load_imbalance=0.5 must be a number >= 1"),
        (dict(gate_weights="keep"), "gate_weights='keep' is unknown"),
        (dict(expert_parallel_size=3, devices=4), "devices=4 is not a multiple of expert_parallel_size=3"),
        (dict(balance_loss_coef=-1.0), "balance_loss_coef=-1.0 must be >= 0"),
        (dict(lora_dropout=1.5), "lora_dropout=1.5 must be in [0, 1)"),
        (dict(train_mode="lora", lora_dropout=0.1), "does not support dropout; set lora_dropout=0"),
        (dict(model_dtype="fp8"), "model_dtype='fp8' is unknown"),
    ],
)
def test_bad_config_fields_raise_one_clear_error(overrides, message, tmp_path):
    with pytest.raises(ValueError) as err:
        make_config(tmp_path, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(criterion="scor"),
        dict(max_devices_per_token=5),
        dict(gate_weights="keep"),
        dict(devices=0),
        dict(nodes=3),
    ],
)
def test_config_and_pruning_config_share_one_check(overrides, tmp_path):
    """OccultConfig delegates its pruning fields to the router's own check: one message for both."""
    from occult_ft.routing import PruningConfig

    names = dict(devices="num_devices", nodes="num_nodes")
    pruning = {"num_devices": 4, **{names.get(k, k): v for k, v in overrides.items()}}
    with pytest.raises(ValueError) as from_pruning:
        PruningConfig(**pruning)
    with pytest.raises(ValueError) as from_config:
        make_config(tmp_path, **overrides)
    assert str(from_config.value) == str(from_pruning.value)


def test_devices_that_do_not_divide_the_experts_fail_at_construction(tiny_olmoe_dir, data, tmp_path):
    with pytest.raises(
        ValueError, match=r"devices=3 does not divide the 8 experts; use one of \[1, 2, 4, 8\]"
    ):
        OccultTrainer(tiny_olmoe_dir, args=make_config(tmp_path, devices=3), train_dataset=data[1])


def test_reentrant_checkpointing_is_refused_with_the_balance_loss(tmp_path):
    with pytest.raises(ValueError, match="use_reentrant"):
        make_config(
            tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
        )


def test_gradient_checkpointing_keeps_the_balance_loss_gradient(tiny_olmoe_dir, data, tmp_path):
    cfg = make_config(
        tmp_path, max_steps=2, max_devices_per_token=1, gradient_checkpointing=True, train_mode="full"
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])
    trainer.train()
    model = trainer.model
    assert model.is_gradient_checkpointing and train_logs(trainer)[-1]["balance_loss"] > 0
    model.train()
    model(input_ids=torch.randint(3, 120, (2, 16)))
    grad = torch.autograd.grad(balance_loss(collect_routing(model)), model.model.layers[1].mlp.gate.weight)[0]
    assert grad.abs().sum() > 0  # the router probabilities inside the checkpointed layer kept their graph


# ---- the commands ----------------------------------------------------------------------------------------------------
def test_cli_train_from_a_yaml_recipe_then_eval(tiny_olmoe_dir, data, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(
        yaml.safe_dump(
            dict(
                model_name_or_path=tiny_olmoe_dir,
                dataset=data[0],
                eval_dataset=data[0],
                output_dir=str(out),
                seq_len=32,
                devices=4,
                max_devices_per_token=1,
                max_steps=5,
                per_device_train_batch_size=4,
                use_cpu=True,
                disable_tqdm=True,
                logging_steps=1,
                save_strategy="no",
                train_mode="full",
            )
        )
        + "learning_rate: 1e-3\n"
    )  # YAML reads 1e-3 (no dot) as a string; it must still work
    assert (
        main(["train", str(recipe), "--max_steps", "2", "--criterion", "score"]) == 0
    )  # flags override the recipe
    state = json.load(open(out / "trainer_state.json"))
    assert state["global_step"] == 2
    block = json.load(open(out / "config.json"))["occult"]
    assert block["criterion"] == "score" and block["max_devices_per_token"] == 1
    assert "eval_comm_complexity" in json.load(open(out / "all_results.json"))
    capsys.readouterr()
    assert (
        main(["eval", str(out), "--data", data[0], "--seq-len", "32", "--max-tokens", "512", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (
        report["comm_complexity"] == 1.0
        and report["max_devices_per_token"] == 1
        and report["num_devices"] == 4
    )
    assert report["perplexity"] == pytest.approx(torch.tensor(report["loss"]).exp().item(), rel=1e-6)
    assert 0.0 <= report["removed_mass"] < 1.0 and report["intra_share"] == 1.0 and len(report["layers"]) == 2


def test_cli_train_without_recipe(tiny_olmoe_dir, data, tmp_path):
    out = tmp_path / "out"
    assert (
        main(
            [
                "train",
                "--model_name_or_path",
                tiny_olmoe_dir,
                "--dataset",
                data[0],
                "--output_dir",
                str(out),
                "--seq_len",
                "32",
                "--max_steps",
                "1",
                "--use_cpu",
                "--placement",
                "sequential",
                "--criterion",
                "score",
                "--save_strategy",
                "no",
                "--disable_tqdm",
                "true",
            ]
        )
        == 0
    )
    assert json.load(open(out / "config.json"))["occult"]["placement"]["algorithm"] == "sequential"


@pytest.mark.parametrize(
    "recipe_text, argv, message",
    [
        ("lerning_rate: 0.1\n", [], "unknown field 'lerning_rate' in recipe"),
        (
            "",
            ["--max_device_per_token", "2"],
            "unknown field 'max_device_per_token' on the command line; did you mean 'max_devices_per_token'?",
        ),
        ("criterion: scor\n", [], "criterion='scor' is unknown (did you mean 'score'?)"),
        ("seq_len: many\n", [], "seq_len='many' is not a valid int"),
        ("- a\n- b\n", [], "expected a mapping of field: value"),
    ],
)
def test_cli_train_bad_fields_give_one_line_errors(recipe_text, argv, message, tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(recipe_text)
    capsys.readouterr()
    assert main(["train", str(recipe), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("occult-ft train: error:")


def test_eval_on_a_plain_model_measures_routing_for_the_given_devices(tiny_olmoe_dir, data, capsys):
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                tiny_olmoe_dir,
                "--data",
                data[0],
                "--devices",
                "2",
                "--seq-len",
                "32",
                "--max-tokens",
                "256",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (
        report["num_devices"] == 2
        and report["max_devices_per_token"] is None
        and report["removed_mass"] == 0.0
    )
    assert 1.0 <= report["comm_complexity"] <= 2.0 and report["tokens"] >= 256


def test_train_requires_a_model_and_data(tmp_path):
    with pytest.raises(ValueError, match="model_name_or_path is required"):
        train(make_config(tmp_path))
    with pytest.raises(ValueError, match="dataset is required"):
        train(make_config(tmp_path, model_name_or_path="embedded"))


def test_cli_parses_launcher_local_rank_before_the_recipe(tmp_path):
    """`deepspeed --module occult_ft.commands.train recipe.yaml` runs the module with --local_rank=N first."""
    from occult_ft.commands.train import parse_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'o'}\nmax_devices_per_token: 2\nuse_cpu: true\n")
    config = parse_config(["--local_rank=0", str(recipe), "--max_steps", "7"])
    assert (
        config.max_devices_per_token == 2
        and config.max_steps == 7
        and config.output_dir == str(tmp_path / "o")
    )


@pytest.mark.slow
def test_cli_train_under_torchrun_with_two_processes(tiny_olmoe_dir, data, tmp_path):
    import subprocess
    import sys

    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(
        yaml.safe_dump(
            dict(
                model_name_or_path=tiny_olmoe_dir,
                dataset=data[0],
                output_dir=str(out),
                seq_len=32,
                devices=4,
                max_devices_per_token=1,
                max_steps=2,
                per_device_train_batch_size=2,
                disable_tqdm=True,
                logging_steps=1,
                save_strategy="no",
                profile_tokens=1000,
            )
        )
    )  # no use_cpu: CPU processes under a launcher must still train as one data-parallel job
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29533",
            "-m",
            "occult_ft.commands.train",
            str(recipe),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=safety_timeout(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("saved the pruned model") == 1  # one job (rank 0 reports), not two lone runs
    logs = [e for e in json.load(open(out / "trainer_state.json"))["log_history"] if "loss" in e]
    assert len(logs) == 2 and all(e["max_token_devices"] == 1 and e["comm_complexity"] == 1.0 for e in logs)
    assert json.load(open(out / "config.json"))["occult"]["max_devices_per_token"] == 1


def test_push_to_hub_from_training_uploads_the_pruned_checkpoint_with_the_occult_card(
    tiny_olmoe_dir, data, tmp_path, monkeypatch
):
    """`push_to_hub=True`: the final pruned checkpoint, its Occult card and comm_complexity figure go up."""
    from types import SimpleNamespace

    import transformers.utils.hub as hf_hub

    calls = {"create": [], "upload": []}

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            calls["create"].append(repo_id)
            return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, **kw):
            files = sorted(os.listdir(folder_path))
            calls["upload"].append((repo_id, files, open(os.path.join(folder_path, "README.md")).read()))
            return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    monkeypatch.setattr(hf_hub, "_hf_api", FakeApi())
    cfg = make_config(
        tmp_path / "run",
        model_name_or_path=tiny_olmoe_dir,
        dataset=data[0],
        max_steps=2,
        max_devices_per_token=1,
        criterion="score",
        push_to_hub=True,
        hub_model_id="me/tiny-occult",
    )
    trainer, _ = train(cfg)
    assert calls["create"] == ["me/tiny-occult"]
    repo, files, card = calls["upload"][-1]
    assert repo == "me/tiny-occult"
    assert {"config.json", "model.safetensors", "README.md", "comm_complexity.png"} <= set(files)
    assert "max_devices_per_token" in card or "devices per token" in card
    assert "comm_complexity.png" in card and "occult_ft.from_pretrained" in card
    block = json.load(open(os.path.join(cfg.output_dir, "config.json")))["occult"]
    assert block["comm_complexity_after"] == 1.0 and block["comm_complexity_before"] > 1.0


def test_devices_follow_expert_parallel_size_unless_set(tmp_path):
    assert make_config(tmp_path, devices=None).devices == 4
    # one process: devices defaults to 2, so the only complaint left is the world size
    with pytest.raises(ValueError, match="expert_parallel_size=2 does not divide the world size 1"):
        make_config(tmp_path, devices=None, expert_parallel_size=2)
    with pytest.raises(ValueError, match="devices=6 is not a multiple of expert_parallel_size=4"):
        make_config(tmp_path, devices=6, expert_parallel_size=4)


def test_training_a_pruned_checkpoint_keeps_its_budget(tiny_olmoe_dir, data, tmp_path):
    first = make_config(
        tmp_path / "a", max_steps=1, max_devices_per_token=1, criterion="score", placement="sequential"
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=first, train_dataset=data[1])
    trainer.train()
    trainer.save_model(first.output_dir)
    again = make_config(tmp_path / "b", max_steps=2)  # no budget given
    trainer = OccultTrainer(first.output_dir, args=again, train_dataset=data[1])
    trainer.train()
    assert trainer.occult.pruning.max_devices_per_token == 1
    assert again.max_devices_per_token is None  # the run's config is not rewritten behind the user's back
    assert all(e["max_token_devices"] == 1 for e in train_logs(trainer))


# ---- data plumbing: packed instruction rows, streaming, chat rows, seq_len -----------------------------------------
INSTRUCTIONS = [  # 59, 64 and 59 tokens with the tiny tokenizer
    {"instruction": "Add 2 and 3.", "input": "", "output": "The sum is 5."},
    {"instruction": "Say hello.", "input": "", "output": "Hello there, friend."},
    {"instruction": "Name a fox.", "input": "", "output": "The quick fox."},
] * 4


def test_instruction_rows_train_packed_with_the_loss_of_unpacked_rows_and_log_padding_share(
    tiny_olmoe_dir, tiny_tokenizer, tmp_path
):
    from datasets import Dataset

    from occult_ft.data import make_collator, tokenize_dataset, unpack_row

    rows = Dataset.from_list(INSTRUCTIONS)
    cfg = make_config(tmp_path, seq_len=128, max_steps=2, placement="sequential", criterion="score")
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows, processing_class=tiny_tokenizer)
    packed = trainer.train_dataset
    # 12 examples: the four of 64 tokens fill two rows of 128, the eight of 59 go two per row (118)
    assert "position_ids" in packed.column_names
    assert sorted(len(r) for r in packed["input_ids"]) == [118, 118, 118, 118, 128, 128]
    # the trainer's loss on a packed batch is the mean over the same response tokens as on the unpacked
    # examples (each padded alone): the examples do not see each other, whatever the model's use_cache
    model = trainer.model.eval()
    batch = trainer.data_collator([packed[i] for i in range(len(packed))])
    examples = [e for i in range(len(packed)) for e in unpack_row(packed[i])]
    unpacked = make_collator(tiny_tokenizer)(examples)
    assert unpack_row(packed[0])[0]["labels"][0] == -100
    with torch.no_grad():
        got = trainer.compute_loss(model, batch)
        want = trainer.compute_loss(model, unpacked)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # padding_share = padded / positions: both batches hold 64 * 4 + 59 * 8 = 728 real tokens in
    # 6 x 128 = 12 x 64 = 768 positions, so 40 + 40 padded of 1536
    summary = trainer._meters["eval"].summary()
    assert summary["padding_share"] == pytest.approx(80 / 1536)
    model.train()
    trainer.train()
    logs = train_logs(trainer)
    # a micro-batch of 4 packed rows pads at most 4 x 10 of 512 positions
    assert len(logs) == 2 and all(0.0 <= e["padding_share"] <= 40 / 512 for e in logs)
    unpacked_rows = tokenize_dataset(rows, tiny_tokenizer, seq_len=128, packing=False)
    assert len(unpacked_rows) == 12 and "attention_mask" in unpacked_rows.column_names


def test_a_streamed_dataset_trains(tiny_olmoe_dir, tiny_tokenizer, tmp_path):
    from datasets import Dataset

    rows = Dataset.from_list(INSTRUCTIONS).to_iterable_dataset()
    cfg = make_config(tmp_path, seq_len=128, max_steps=2, per_device_train_batch_size=2)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows, processing_class=tiny_tokenizer)
    trainer.train()  # placement=auto profiled the stream too
    assert len(train_logs(trainer)) == 2 and "padding_share" in train_logs(trainer)[0]


def test_messages_rows_need_a_chat_template_and_train_with_one(tiny_olmoe_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    chat = [
        {"role": "user", "content": "Add the numbers 2 and 3."},
        {"role": "assistant", "content": "The sum is 5."},
    ]
    rows = Dataset.from_list([{"messages": chat}] * 4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_olmoe_dir)
    cfg = make_config(tmp_path, seq_len=128, max_steps=1, placement="sequential", criterion="score")
    with pytest.raises(ValueError, match="has no chat template, so 'messages' rows cannot be formatted"):
        OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows, processing_class=tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows, processing_class=tokenizer)
    from occult_ft.data import unpack_row

    row = unpack_row(trainer.train_dataset[0])[0]  # packed: two conversations per row
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    # the trained tokens are the assistant's reply as the template writes it, end-of-turn included
    assert tokenizer.decode(trained) == "The sum is 5.</s>"
    trainer.train()


def test_seq_len_above_the_models_positions_is_one_line_error(tiny_olmoe_dir, data, tmp_path):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_olmoe_dir).max_position_embeddings
    cfg = make_config(tmp_path, seq_len=limit + 1)
    with pytest.raises(
        ValueError, match=f"seq_len={limit + 1} exceeds the model's max_position_embeddings={limit}"
    ):
        OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=data[1])


def test_train_streams_a_jsonl_file_and_needs_max_steps(tiny_olmoe_dir, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in INSTRUCTIONS))
    with pytest.raises(ValueError, match="streaming=True reads the data as it goes.*set max_steps"):
        make_config(tmp_path, streaming=True, max_steps=-1)
    cfg = make_config(
        tmp_path / "out",
        model_name_or_path=tiny_olmoe_dir,
        dataset=str(path),
        streaming=True,
        seq_len=128,
        max_steps=2,
    )
    trainer, metrics = train(cfg)
    from datasets import IterableDataset

    assert isinstance(trainer.train_dataset, IterableDataset) and metrics["train_loss"] > 0
    assert os.path.isfile(tmp_path / "out" / "config.json")


def test_long_phases_are_announced_only_while_progress_bars_are_on(tmp_path, capsys, monkeypatch):
    from occult_ft.trainer.pipeline import announcer

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    loud, quiet = make_config(tmp_path, disable_tqdm=False), make_config(tmp_path, disable_tqdm=True)
    announcer(loud)("loading the model 'x'")
    announcer(quiet)("silent")
    assert capsys.readouterr().err == "occult-ft train: loading the model 'x' ...\n"
    monkeypatch.setenv("LOCAL_RANK", "1")  # other processes of a launch stay quiet
    announcer(loud)("not rank 0")
    assert capsys.readouterr().err == ""


def test_a_pruned_checkpoint_trained_on_with_a_new_budget_saves_the_new_budget(
    tiny_olmoe_dir, data, tmp_path
):
    """The model comes from occult_ft.from_pretrained (its save hook knows the loaded block); the run
    changes the budget, and its checkpoint must record and route with the new one."""
    import occult_ft
    from occult_ft.checkpoint import read_block

    first = make_config(
        tmp_path / "a", max_steps=1, max_devices_per_token=1, criterion="score", placement="sequential"
    )
    trainer = OccultTrainer(tiny_olmoe_dir, args=first, train_dataset=data[1])
    trainer.train()
    trainer.save_model(first.output_dir)
    again = make_config(tmp_path / "b", max_steps=1, max_devices_per_token=2, criterion="score")
    trainer = OccultTrainer(first.output_dir, args=again, train_dataset=data[1])
    trainer.train()
    trainer.save_model(again.output_dir)
    assert read_block(again.output_dir).pruning.max_devices_per_token == 2
    reloaded = occult_ft.from_pretrained(again.output_dir)
    from occult_ft.routing import pruned_routers

    assert {r.occult_config.max_devices_per_token for _, r in pruned_routers(reloaded)} == {2}
