"""Study tasks (`occult_ft.studies.tasks`): deterministic rows with checkable answers, and exact match by teacher
forcing, checked by hand and against `model.generate` on the embedded model (pruned routing)."""

from __future__ import annotations

import datetime

import pytest
import torch

from occult_ft.studies.tasks import TASKS, exact_match, exact_match_counts, make_task_rows, task_split


def test_date_rows_are_deterministic_distinct_and_correct():
    rows = make_task_rows("dates", 300, seed=4)
    assert rows == make_task_rows("dates", 300, seed=4)
    assert rows != make_task_rows("dates", 300, seed=5)
    assert len({r["instruction"] for r in rows}) == 300
    for r in rows:
        # an independent reading of question and answer: the ISO date in the question, strptime's %B and %d
        iso = r["instruction"].split()[3]
        assert r["instruction"] == f"Write the date {iso} in words." and r["input"] == ""
        assert datetime.datetime.strptime(r["output"], "%B %d, %Y").date() == datetime.date.fromisoformat(iso)
        assert " 0" not in r["output"]  # "April 5", not "April 05"


def test_month_rows_name_the_month_of_their_date():
    rows = make_task_rows("months", 200, seed=0)
    assert len({r["instruction"] for r in rows}) == 200
    for r in rows:
        iso = r["instruction"].removeprefix("Name the month of the date ").removesuffix(".")
        assert r["output"] == datetime.date.fromisoformat(iso).strftime("%B") and r["input"] == ""
    assert {r["output"] for r in rows} == {datetime.date(2000, m, 1).strftime("%B") for m in range(1, 13)}


def test_task_split_is_disjoint_and_the_held_out_rows_do_not_depend_on_the_train_size():
    train, held = task_split("dates", 100, 20)
    assert len(train) == 100 and len(held) == 20
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    assert task_split("dates", 7, 20)[1] == held


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_task_rows("maths", 3), "task='maths' is unknown"),
        (lambda: make_task_rows("dates", 0), "count=0"),
        (lambda: task_split("dates", 3, 0), "eval_rows=0"),
    ],
)
def test_bad_task_arguments_raise_one_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert "dates" in TASKS


def test_exact_match_counts_by_hand():
    # V = 5. Row 0 labels positions 2, 3 with tokens 3, 1: predictions come from positions 1, 2.
    # Row 1 labels positions 1, 2 with tokens 2, 4: position 0 predicts 2 (right), position 1 predicts 0 (wrong).
    # Row 2 has no label: not counted. Expected: 1 exact of 2 answered.
    logits = torch.zeros(3, 4, 5)
    logits[0, 1, 3] = logits[0, 2, 1] = 1.0
    logits[0, 0, 4] = 9.0  # position 0 of row 0 predicts an unlabelled position: ignored
    logits[1, 0, 2] = logits[1, 1, 0] = 1.0
    labels = torch.tensor([[-100, -100, 3, 1], [-100, 2, 4, -100], [-100] * 4])
    assert exact_match_counts(logits, labels) == (1, 2)
    logits[1, 1, 4] = 2.0  # now row 1 is right too
    assert exact_match_counts(logits, labels) == (2, 2)


def test_exact_match_is_greedy_decoding_under_pruned_routing():
    """Label each prompt with the model's own greedy continuation (model.generate): exact match is 1;
    change one answer token: that row no longer matches."""
    from occult_ft.checkpoint.load import load_model_and_tokenizer
    from occult_ft.data import format_prompt
    from occult_ft.routing import PruningConfig, apply_pruning

    model, tok = load_model_and_tokenizer("embedded")
    apply_pruning(model, PruningConfig(4, 1, "score"))
    model.eval()
    batches = []
    for row in make_task_rows("dates", 3, seed=1):
        prompt = tok(format_prompt(row["instruction"], row["input"]), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            full = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        labels = full.clone()
        labels[:, : prompt.shape[1]] = -100
        batches.append({"input_ids": full, "attention_mask": torch.ones_like(full), "labels": labels})
    assert exact_match(model, batches) == 1.0
    wrong = dict(batches[1])
    wrong["labels"] = batches[1]["labels"].clone()
    wrong["labels"][0, -2] = (wrong["labels"][0, -2] + 1) % model.config.vocab_size
    assert exact_match(model, [batches[0], wrong, batches[2]]) == pytest.approx(2 / 3)
