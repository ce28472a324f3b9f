"""Distillation from the unpruned model (`occult_ft.trainer.distill`, `OccultConfig.distill_coef`) and the
`unpruned_routing` context manager it uses."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SAMPLE_TEXT

from occult_ft.routing import (
    PruningConfig,
    apply_pruning,
    collect_routing,
    pruned_routers,
    set_recording,
    unpruned_routing,
)
from occult_ft.trainer import OccultConfig, OccultTrainer
from occult_ft.trainer.distill import distillation_kl, teacher_logits


def test_distillation_kl_by_hand():
    # teacher p = (1/2, 1/2), student q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3) = 0.143841
    teacher = torch.zeros(1, 3, 2)
    student = torch.zeros(1, 3, 2)
    student[0, 1, 1] = math.log(3.0)
    student[0, 0, 1] = 7.0  # position 0 predicts label 1, which is -100: ignored
    labels = torch.tensor([[5, -100, 1]])  # only position 1 (predicting label 2) counts
    assert distillation_kl(student, teacher, labels).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    # temperature 2 halves the student's log-odds: q = (1/(1+sqrt 3), sqrt 3/(1+sqrt 3)); times 2^2
    q0 = 1 / (1 + math.sqrt(3))
    expected = 4 * (0.5 * math.log(0.5 / q0) + 0.5 * math.log(0.5 / (1 - q0)))
    assert distillation_kl(student, teacher, labels, temperature=2.0).item() == pytest.approx(
        expected, rel=1e-6
    )
    assert distillation_kl(teacher, teacher, labels).item() == 0.0
    assert distillation_kl(student, teacher, torch.full((1, 3), -100)) is None
    with pytest.raises(ValueError, match="temperature=0"):
        distillation_kl(student, teacher, labels, temperature=0)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_unpruned_routing_lifts_the_budget_and_restores_router_state(tiny_olmoe_dir):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = _model(tiny_olmoe_dir)
    with torch.no_grad():
        unpruned_logits = reference(input_ids=ids).logits
    model = _model(tiny_olmoe_dir)
    apply_pruning(model, PruningConfig(4, 1, "score"))
    set_recording(model, True)
    with torch.no_grad():
        pruned_logits = model(input_ids=ids).logits
    before = {i: r.topk_ids.clone() for i, r in collect_routing(model).items()}
    teacher = teacher_logits(model, {"input_ids": ids, "labels": ids})
    torch.testing.assert_close(teacher, unpruned_logits)  # the teacher routes as the plain model
    assert not torch.allclose(teacher, pruned_logits)  # budget 1 of 4 devices changes the routing
    after = collect_routing(model)
    assert all(torch.equal(after[i].topk_ids, before[i]) for i in before)  # the student's records stay
    assert all(r.occult_config.max_devices_per_token == 1 for _, r in pruned_routers(model))
    with unpruned_routing(model):
        pass
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, pruned_logits)


@pytest.fixture(scope="module")
def rows(tiny_tokenizer, tmp_path_factory):
    from occult_ft.data import load_text_dataset, tokenize_dataset

    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join([SAMPLE_TEXT] * 6))
    return tokenize_dataset(load_text_dataset(str(path)), tiny_tokenizer, seq_len=32)


def _config(out, **overrides):
    base = dict(
        output_dir=str(out),
        seq_len=32,
        devices=4,
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        learning_rate=5e-3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        profile_tokens=2000,
        balance_loss_coef=0.0,
    )
    base.update(overrides)
    return OccultConfig(**base)


def test_distill_coef_adds_coef_times_the_kl_to_the_unpruned_model(tiny_olmoe_dir, rows, tmp_path):
    """Loss with distill_coef c minus loss with 0 on the same batch = c * KL(unpruned || pruned) > 0."""
    cfg = _config(tmp_path, max_devices_per_token=1, criterion="score", distill_coef=0.5)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows)
    with torch.no_grad():  # a random tiny model's logits are near uniform (KL ~ 1e-6): sharpen them
        trainer.model.get_output_embeddings().weight.mul_(30.0)
    batch = trainer.data_collator([rows[i] for i in range(2)])
    trainer.model.train()
    with_kl = trainer.compute_loss(trainer.model, dict(batch))
    with torch.no_grad():
        student = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    kl = distillation_kl(student, teacher_logits(trainer.model, dict(batch)), batch["labels"])
    assert kl.item() > 1e-3
    trainer.args.distill_coef = 0.0
    without = trainer.compute_loss(trainer.model, dict(batch))
    torch.testing.assert_close(with_kl - without, 0.5 * kl, rtol=1e-4, atol=1e-6)
    trainer.args.distill_coef = 0.5
    trainer.train()
    assert all(entry["distill_kl"] > 0 for entry in trainer.state.log_history if "loss" in entry)


def test_the_kl_is_zero_when_the_model_is_unpruned(tiny_olmoe_dir, rows, tmp_path):
    cfg = _config(tmp_path, max_devices_per_token=None, distill_coef=0.5)
    trainer = OccultTrainer(tiny_olmoe_dir, args=cfg, train_dataset=rows)
    batch = trainer.data_collator([rows[i] for i in range(2)])
    trainer.model.eval()
    with torch.no_grad():
        student = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert distillation_kl(student, teacher_logits(trainer.model, dict(batch)), batch["labels"]).item() == 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"distill_coef": -1.0}, "distill_coef=-1.0"),
        ({"distill_temperature": 0.0}, "distill_temperature=0.0"),
    ],
)
def test_bad_distill_fields_raise_one_line(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)
