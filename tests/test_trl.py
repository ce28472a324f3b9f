"""Occult inside TRL (`occult_ft.trl`): OccultSFTConfig / OccultSFTTrainer on the embedded model with
TRL's own data shapes, against `OccultTrainer` on the same prepared rows and settings.

The loss comparison: TRL prepares the rows (chat template, completion mask, packing, EOS); the same
prepared rows, turned into occult_ft's tokenized layout (`occult_rows`), train an `OccultTrainer` with the
same Occult and Trainer settings. SFTTrainer's loss is the summed token NLL over the labelled tokens
divided by the batch's label count (TRL's fused LM head), Trainer's is the model's own cross-entropy with
the same normalisation, so the two runs' per-step losses, balance losses and routing metrics agree to
1e-5. Also a worker: `torchrun ... test_trl.py SPEC` runs the 2-process expert-parallel case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl", reason="occult_ft.trl needs TRL: pip install 'occult-ft[trl]'")

from datasets import Dataset  # noqa: E402
from helpers import safety_timeout  # noqa: E402

from occult_ft.embedded import embedded_model_path  # noqa: E402
from occult_ft.metrics import contiguous_expert_device, devices_per_token  # noqa: E402
from occult_ft.routing import collect_routing, router_device_bias, set_recording  # noqa: E402
from occult_ft.trainer import OccultArguments, OccultConfig, OccultTrainer, OccultTrainerMixin  # noqa: E402
from occult_ft.trl import OccultSFTConfig, OccultSFTTrainer  # noqa: E402

TOL = 1e-5
ROUTING = ("comm_complexity", "intra_share", "removed_mass", "load_imbalance", "balance_loss")
# the embedded tokenizer has no chat template: a small one, with TRL's generation markers for
# assistant_only_loss (the assistant's end-of-turn token is inside them, so it is trained)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}assistant: {{ m['content'] }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
FACTS = [
    ("the capital of France", "Paris"),
    ("two plus three", "five"),
    ("the colour of the sky on a clear day", "blue"),
    ("the opposite of cold", "hot"),
    ("the first month of the year", "January"),
    ("the number of days in a week", "seven"),
    ("the largest planet", "Jupiter"),
    ("the language of this sentence", "English"),
]


def shape_rows(shape: str) -> Dataset:
    """TRL's dataset shapes: language modeling under a custom text field, prompt-completion, messages."""
    rows = []
    for i in range(24):
        question, answer = FACTS[i % len(FACTS)]
        text = f"Question {i}: what is {question}? The answer is {answer}." + " More words." * (i % 4)
        if shape in ("text", "packed"):
            rows.append({"content": text})
        elif shape == "prompt_completion":
            rows.append({"prompt": f"Question {i}: what is {question}? ", "completion": f"It is {answer}."})
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {question}? ({i})"},
                        {"role": "assistant", "content": f"It is {answer}."},
                    ]
                }
            )
    return Dataset.from_list(rows)


def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_path())
    tok.chat_template = CHAT_TEMPLATE
    return tok


COMMON = dict(
    devices=4,
    max_devices_per_token=2,
    placement="sequential",
    criterion="score",
    balance_loss_coef=0.01,
    train_mode="moe",
    per_device_train_batch_size=4,
    max_steps=3,
    logging_steps=1,
    learning_rate=1e-3,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    bf16=False,
    seed=0,
    profile_tokens=2000,
)


def sft_config(out, **overrides) -> OccultSFTConfig:
    return OccultSFTConfig(
        **{
            "output_dir": str(out),
            "max_length": 64,
            "gradient_checkpointing": False,
            "dataset_text_field": "content",
            **COMMON,
            **overrides,
        }
    )


def occult_rows(prepared) -> Dataset:
    """TRL's prepared rows in occult_ft's tokenized layout: padded rows with labels, or packed rows whose
    `position_ids` restart at each example (TRL's `seq_lengths`), the first label of each example -100
    (TRL's padding-free collator masks it too)."""
    rows = []
    for row in prepared:
        ids, labels = list(row["input_ids"]), list(row["labels"])
        if "seq_lengths" in row:
            positions = [p for n in row["seq_lengths"] for p in range(n)]
            labels = [-100 if p == 0 else label for p, label in zip(positions, labels)]
            rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
        else:
            rows.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)})
    return Dataset.from_list(rows)


def train_logs(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e]


def assert_same_trajectory(trl_logs: list[dict], occult_logs: list[dict]) -> float:
    """Per-step loss, balance loss and routing metrics equal to TOL; returns the worst loss gap."""
    assert len(trl_logs) == len(occult_logs) > 0
    worst = 0.0
    for step, (a, b) in enumerate(zip(trl_logs, occult_logs), start=1):
        worst = max(worst, abs(a["loss"] - b["loss"]))
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL), f"step {step}: {a['loss']} vs {b['loss']}"
        for key in ROUTING:
            assert a[key] == pytest.approx(b[key], abs=TOL), f"step {step} {key}: {a[key]} vs {b[key]}"
    return worst


def budget_held(model, ids, budget: int, devices: int = 4) -> int:
    """The most devices any token of a forward on `ids` reached (placed models: contiguous devices)."""
    model.eval()
    set_recording(model, True)
    with torch.no_grad():
        model(input_ids=ids)
    records = collect_routing(model)
    assert records, "the model's routers recorded nothing"
    worst = 0
    for rec in records.values():
        dev = contiguous_expert_device(32, devices)  # the embedded model: 32 experts
        worst = max(worst, int(devices_per_token(rec.topk_ids, dev, devices).max()))
    assert worst <= budget
    return worst


# ---- the config: the same Occult fields and checks as OccultConfig ------------------------------------
def test_sft_config_has_every_occult_field_with_the_same_help():
    import dataclasses

    shared = {f.name: f for f in dataclasses.fields(OccultArguments)}
    sft = {f.name: f for f in dataclasses.fields(OccultSFTConfig)}
    occult = {f.name: f for f in dataclasses.fields(OccultConfig)}
    for name, f in shared.items():
        assert name in sft and name in occult
        if name != "train_mode":  # its default (and help) follow SFTTrainer: full
            assert sft[name].metadata == occult[name].metadata == f.metadata, name
            assert sft[name].default == occult[name].default, name
    # TRL's own fields keep TRL's defaults
    assert OccultSFTConfig.__dataclass_fields__["max_length"].default == 1024
    assert OccultSFTConfig.__dataclass_fields__["packing"].default is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(devices=0), "devices=0"),
        (dict(max_devices_per_token=5), "max_devices_per_token=5"),
        (dict(criterion="simlarity"), "did you mean 'similarity'"),
        (dict(exchange="flatt"), "did you mean 'flat'"),
        (dict(expert_parallel_size=2), "does not divide the world size 1"),
        (dict(balance_loss_coef=-1.0), "balance_loss_coef=-1.0 must be >= 0"),
        (dict(device_bias_rate=-0.001), "device_bias_rate=-0.001 must be a finite number >= 0"),
        (dict(profile_tokens="100"), "profile_tokens='100' must be a whole number"),
    ],
)
def test_bad_occult_fields_fail_alike_in_both_configs(overrides, message, tmp_path):
    for config in (OccultConfig, OccultSFTConfig):
        with pytest.raises(ValueError, match=message):
            config(output_dir=str(tmp_path), use_cpu=True, **{"max_devices_per_token": 2, **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(router_aux_loss_coef=0.01), "the model's own balance loss ignores the pruning"),
        (dict(distill_coef=0.5), "fused LM head, which builds no logits"),
        (dict(exchange_capacity="auto", max_length=None), "max_length is None"),
        (
            dict(exchange_capacity=4096, max_length=None),
            "max_length=None leaves the rows a rank routes unbounded",
        ),
        (dict(gradient_checkpointing_kwargs={"use_reentrant": True}), "gives the balance loss no gradient"),
        (dict(label_smoothing_factor=0.1), "second forward without gradient"),
    ],
)
def test_what_does_not_compose_with_sft_is_refused_in_one_line(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        OccultSFTConfig(output_dir=str(tmp_path), use_cpu=True, **overrides)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(compute_loss_func=lambda *a, **k: None), "second forward without gradient"),
        (dict(quantization_config=object()), "quantized weights do not allow"),
        (dict(args=None), "args must be an OccultSFTConfig"),
    ],
)
def test_trainer_arguments_that_do_not_compose_are_refused_before_loading(kwargs, message, tmp_path):
    from transformers import TrainingArguments

    if "args" in kwargs:
        kwargs = {"args": TrainingArguments(output_dir=str(tmp_path))}
    else:
        kwargs = {"args": OccultSFTConfig(output_dir=str(tmp_path), use_cpu=True), **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        OccultSFTTrainer("embedded", train_dataset=shape_rows("text"), **kwargs)


def test_messages_rows_without_a_chat_template_are_refused_in_one_line(tmp_path):
    # the embedded tokenizer has no chat template; TRL itself fails inside with a type error
    with pytest.raises(ValueError, match="'messages' rows need a chat template .* set chat_template_path"):
        OccultSFTTrainer(
            "embedded",
            args=sft_config(tmp_path, assistant_only_loss=True),
            train_dataset=shape_rows("messages"),
        )


def test_the_trl_hooks_overridden_still_exist_with_our_arguments():
    """`OccultSFTTrainer._save_checkpoint` skips SFTTrainer's (TRL's card at every checkpoint) and calls
    Trainer's; `compute_loss` wraps SFTTrainer's own. Both must still exist and take our arguments."""
    import inspect

    from transformers import Trainer
    from trl import SFTTrainer

    for owner in (SFTTrainer, Trainer):
        ours = inspect.signature(OccultSFTTrainer._save_checkpoint).parameters
        assert list(inspect.signature(owner._save_checkpoint).parameters) == list(ours)
    theirs = inspect.signature(SFTTrainer.compute_loss).parameters
    assert list(theirs) == list(inspect.signature(OccultSFTTrainer.compute_loss).parameters)
    # the method order the mixin relies on: its __init__ runs where Trainer.__init__ would
    order = OccultSFTTrainer.__mro__
    assert order.index(SFTTrainer) < order.index(OccultTrainerMixin) == order.index(Trainer) - 1


def test_exchange_capacity_is_checked_against_each_configs_row_length(tmp_path):
    """The capacity bound is batch x the row length each config trains with: seq_len for OccultConfig,
    TRL's max_length for OccultSFTConfig; below it is refused when the config is built, at it accepted."""
    common = dict(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, per_device_eval_batch_size=1
    )
    for config, row in ((OccultConfig, dict(seq_len=32)), (OccultSFTConfig, dict(max_length=32))):
        name = next(iter(row))
        with pytest.raises(ValueError, match=rf"exchange_capacity=63 .* below the 64 tokens .* x {name}=32"):
            config(exchange_capacity=63, **row, **common)
        cfg = config(exchange_capacity=64, **row, **common)
        assert cfg.tokens_per_forward() == 64 and cfg.exchange_capacity_rows() == 64
        assert config(exchange_capacity="auto", **row, **common).exchange_capacity_rows() == 64


def test_sft_config_pickles_without_the_hub_token(tmp_path):
    import pickle

    cfg = OccultSFTConfig(output_dir=str(tmp_path), use_cpu=True, hub_token="hf_secret")
    assert pickle.loads(pickle.dumps(cfg)).hub_token is None and cfg.hub_token == "hf_secret"


# ---- training: TRL's shapes, the loss of OccultTrainer --------------------------------------------------
SHAPES = {
    "text": dict(),  # dataset_text_field="content"
    "prompt_completion": dict(),  # completion-only loss (TRL's default for the shape)
    "messages": dict(assistant_only_loss=True),
    "packed": dict(packing=True, gradient_accumulation_steps=2, per_device_train_batch_size=2),
    "device_bias": dict(device_bias_rate=0.01),  # text rows; the mixin's bias update in both trainers
    # the bias fitted on the first batch first, on TRL's assistant-only chat batches (extra keys included)
    "device_bias_fit": dict(device_bias_rate=0.01, device_bias_init="first_batch", assistant_only_loss=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sft_losses_equal_occult_trainers_on_the_same_prepared_rows(shape, tmp_path):
    tok = tokenizer()
    overrides = SHAPES[shape]
    trl = OccultSFTTrainer(
        "embedded", args=sft_config(tmp_path / "trl", **overrides), train_dataset=shape_rows(shape),
        processing_class=tok,
    )  # fmt: skip
    prepared = trl.train_dataset
    if shape == "prompt_completion":  # completion-only: the prompt tokens carry no label
        assert any(label == -100 for label in prepared[0]["labels"][1:])
    if shape == "packed":
        assert "seq_lengths" in prepared.column_names and len(prepared[0]["seq_lengths"]) > 1
    trl.train()
    occult_overrides = {k: v for k, v in overrides.items() if k in OccultConfig.__dataclass_fields__}
    occult_args = OccultConfig(
        output_dir=str(tmp_path / "occult"), seq_len=64, **{**COMMON, **occult_overrides}
    )
    occult = OccultTrainer(
        "embedded", args=occult_args, train_dataset=occult_rows(prepared), processing_class=tok
    )
    occult.train()
    worst = assert_same_trajectory(train_logs(trl), train_logs(occult))
    print(f"{shape}: worst per-step loss gap {worst:.2e}")
    assert all(e["max_token_devices"] <= 2 for e in train_logs(trl))
    assert {"entropy", "mean_token_accuracy"} <= set(train_logs(trl)[0])  # TRL's own metrics stay
    # the same parameters come out (AdamW normalises each update, so a parameter whose gradient is near
    # zero moves by up to lr whatever its rounding: 1e-4 is a tenth of one step of lr=1e-3)
    theirs = dict(occult.model.named_parameters())
    for name, p in trl.model.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-4)
    if "device_bias_rate" in overrides:  # both moved the same per-device bias after every step
        trl_bias, occult_bias = router_device_bias(trl.model), router_device_bias(occult.model)
        assert trl_bias is not None and occult_bias is not None and set(trl_bias) == set(occult_bias)
        assert any(bool(v.abs().sum() > 0) for v in trl_bias.values())
        for index, bias in occult_bias.items():
            torch.testing.assert_close(trl_bias[index], bias, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_placed_pruned_checkpoint_holds_the_budget_and_loads_three_ways(tmp_path):
    """placement=auto + similarity criterion on TRL's data; the saved model routes within the budget
    when loaded by occult_ft.from_pretrained, stock transformers and the lines of its model card."""
    from test_card_load_lines import run_blocks, transformers_blocks
    from transformers import AutoModelForCausalLM

    import occult_ft

    out = tmp_path / "run"
    args = sft_config(
        out, max_devices_per_token=1, placement="auto", criterion="similarity", max_steps=2,
        placement_algorithm="greedy_pairs", eval_strategy="no",
    )  # fmt: skip
    trainer = OccultSFTTrainer(
        "embedded", args=args, train_dataset=shape_rows("prompt_completion"),
        eval_dataset=shape_rows("prompt_completion").select(range(8)), processing_class=tokenizer(),
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_max_token_devices"] == 1 and metrics["eval_comm_complexity"] == 1.0
    assert "eval_perplexity" in metrics and "eval_mean_token_accuracy" in metrics
    trainer.save_model()
    block = json.loads((out / "config.json").read_text())["occult"]
    assert block["max_devices_per_token"] == 1 and block["placed"] and block["train_mode"] == "moe"
    ids = torch.tensor([trainer.processing_class("What is the capital of France? It is Paris.")["input_ids"]])
    trained = trainer.model.eval()(input_ids=ids).logits.detach()
    loaded = occult_ft.from_pretrained(str(out))
    assert budget_held(loaded, ids, budget=1) == 1
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)
    stock = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    torch.testing.assert_close(stock(input_ids=ids).logits.detach(), trained, rtol=0, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "max_devices_per_token" in card or "devices per token" in card
    run_blocks(transformers_blocks(card), out.parent)


@pytest.mark.slow
def test_lora_through_trls_peft_config_saves_an_adapter_that_loads_pruned(tmp_path):
    from peft import LoraConfig

    import occult_ft

    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        modules_to_save=["mlp.gate"],
    )
    out = tmp_path / "lora"
    args = sft_config(out, train_mode="full", max_steps=2, learning_rate=1e-2, max_devices_per_token=1)
    trainer = OccultSFTTrainer(
        "embedded", args=args, train_dataset=shape_rows("messages"), processing_class=tokenizer(),
        peft_config=lora,
    )  # fmt: skip
    assert args.train_mode == "lora"  # the checkpoints record an adapter run
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n and "experts" in n for n in before)
    trainer.train()
    assert all(e["max_token_devices"] <= 1 for e in train_logs(trainer))
    changed = [
        n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])
    ]
    assert any("lora_B" in n for n in changed) and any("mlp.gate" in n for n in changed)
    trainer.save_model()
    assert (out / "adapter_config.json").exists() and (out / "occult_config.json").exists()
    ids = torch.tensor(
        [trainer.processing_class("user: What is two plus three?\nassistant: It is five.")["input_ids"]]
    )
    trained = trainer.model.eval()(input_ids=ids).logits.detach()
    loaded = occult_ft.from_pretrained(str(out))
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)
    assert budget_held(loaded, ids, budget=1) == 1


@pytest.mark.slow
def test_a_resumed_sft_run_ends_where_the_uninterrupted_one_ends(tmp_path):
    def run(out, **extra):
        args = sft_config(out, max_steps=4, save_strategy="steps", save_steps=2, train_mode="full", **extra)
        return OccultSFTTrainer(
            "embedded", args=args, train_dataset=shape_rows("messages"), processing_class=tokenizer()
        )

    straight = run(tmp_path / "a", assistant_only_loss=True)
    straight.train()
    assert not (tmp_path / "a" / "README.md").exists()  # no TRL card at checkpoints: the Occult one on save
    resumed = run(tmp_path / "b", assistant_only_loss=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    a, b = dict(straight.model.named_parameters()), dict(resumed.model.named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)
    assert train_logs(resumed)[-1]["loss"] == pytest.approx(train_logs(straight)[-1]["loss"], abs=1e-6)


@pytest.mark.slow
def test_push_to_hub_uploads_the_pruned_model_with_the_occult_card(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # offline mode refuses a push up front; the Hub is faked below
    from types import SimpleNamespace

    import transformers.utils.hub as hf_hub

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, **kw):
            card = open(os.path.join(folder_path, "README.md")).read()
            uploads.append((repo_id, sorted(os.listdir(folder_path)), card))
            return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    monkeypatch.setattr(hf_hub, "_hf_api", FakeApi())
    args = sft_config(
        tmp_path / "run", max_steps=1, max_devices_per_token=1, push_to_hub=True, hub_model_id="me/sft-occult",
        dataset="embedded",
    )  # fmt: skip
    trainer = OccultSFTTrainer(
        "embedded", args=args, train_dataset=shape_rows("text"), processing_class=tokenizer()
    )
    trainer.train()
    trainer.push_to_hub()
    repo, files, card = uploads[-1]
    assert repo == "me/sft-occult" and {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert "occult_ft.from_pretrained" in card


# ---- the command line: a recipe through TRL ------------------------------------------------------------
@pytest.mark.slow
def test_cli_train_with_trainer_trl_runs_a_recipe_with_sft_fields(tmp_path):
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for row in shape_rows("prompt_completion"):
            f.write(json.dumps(row) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "model_name_or_path: embedded\n"
        f"dataset: {rows}\n"
        "devices: 4\nmax_devices_per_token: 1\nplacement: sequential\ncriterion: score\n"
        "max_length: 64\npacking: true\ncompletion_only_loss: true\ngradient_checkpointing: false\n"
        "per_device_train_batch_size: 2\nmax_steps: 2\nlogging_steps: 1\nbf16: false\nuse_cpu: true\n"
        "report_to: none\nsave_strategy: 'no'\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "occult_ft.cli", "train", "--trainer", "trl", str(recipe), "--output_dir", str(out)],
        capture_output=True, text=True, env=env, timeout=safety_timeout(120),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved the pruned model" in proc.stdout
    state = json.loads((out / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert len(logs) == 2 and all(e["max_token_devices"] == 1 for e in logs)
    assert "mean_token_accuracy" in logs[0]  # trained by SFTTrainer
    assert json.loads((out / "config.json").read_text())["occult"]["max_devices_per_token"] == 1


def test_recipe_data_becomes_rows_of_trls_shapes(tmp_path):
    """Alpaca rows become prompt-completion rows (occult_ft's prompt template: completion-only loss in
    TRL); text rows come under `dataset_text_field`."""
    from occult_ft.data import format_prompt
    from occult_ft.trl.pipeline import load_sft_rows

    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(
        json.dumps({"instruction": "Add 2 and 3.", "input": "", "output": "5"}) + "\n"
        + json.dumps({"instruction": "Name a colour.", "input": "one word", "output": "blue"}) + "\n"
    )  # fmt: skip
    cfg = OccultSFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, dataset_text_field="body")
    rows = load_sft_rows(str(alpaca), None, cfg)
    assert rows.column_names == ["prompt", "completion"]
    assert rows[1] == {"prompt": format_prompt("Name a colour.", "one word"), "completion": "blue"}
    text = tmp_path / "text.txt"
    text.write_text("first document\n\nsecond document\n")
    rows = load_sft_rows(str(text), None, cfg)
    assert rows.column_names == ["body"] and rows[0]["body"] == "first document"


def test_cli_trainer_flag_refuses_an_unknown_trainer_and_sft_fields_without_trl(tmp_path, capsys):
    from occult_ft.cli import main

    assert main(["train", "--trainer", "trll", "--max_steps", "1"]) != 0
    assert "did you mean 'trl'" in capsys.readouterr().err
    # an SFT field in a plain OccultConfig run names the fix
    assert main(["train", "--max_length", "64", "--output_dir", str(tmp_path / "o")]) != 0
    assert "--trainer trl" in capsys.readouterr().err


def test_train_help_with_trainer_trl_lists_the_occult_fields_then_sftconfigs(capsys):
    from occult_ft.cli import main

    assert main(["train", "--trainer", "trl", "--help"]) == 0
    text = capsys.readouterr().out
    titles = ["Occult: placement and pruning:", "Occult: training:", "inherited from trl.SFTConfig:"]
    where = [text.index(t) for t in titles]
    assert where == sorted(where)
    assert text.index("--max_devices_per_token") < where[2] < text.index("--completion_only_loss")


# ---- expert parallelism on 2 gloo processes ----------------------------------------------------------------
def _ep_worker(spec_path: str) -> None:
    """Both trainers on this rank with expert_parallel_size=2; rank 0 writes their step logs."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    tok = tokenizer()
    ep = dict(expert_parallel_size=2, devices=4)
    trl = OccultSFTTrainer(
        "embedded", args=sft_config(spec["out"] + "/trl", **ep), train_dataset=shape_rows("prompt_completion"),
        processing_class=tok,
    )  # fmt: skip
    trl.train()
    trl.save_model()
    occult = OccultTrainer(
        "embedded",
        args=OccultConfig(output_dir=spec["out"] + "/occult", seq_len=64, **{**COMMON, **ep}),
        train_dataset=occult_rows(trl.train_dataset),
        processing_class=tok,
    )
    occult.train()
    if dist.get_rank() == 0:
        with open(spec["result"], "w") as f:
            json.dump({"trl": train_logs(trl), "occult": train_logs(occult)}, f)
    dist.barrier()


if __name__ == "__main__":
    _ep_worker([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    from occult_ft.dispatch.comm import exit_rank

    exit_rank(0)  # no interpreter finalization: see exit_rank


@pytest.mark.slow
def test_two_process_expert_parallel_sft_equals_occult_trainer(tmp_path):
    from dist_utils import free_port

    import occult_ft

    spec = {"out": str(tmp_path / "ep"), "result": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p
        ),
    }
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
    proc = subprocess.run(
        [*launcher, os.path.abspath(__file__), str(tmp_path / "spec.json")],
        env=env, capture_output=True, text=True, timeout=safety_timeout(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    worst = assert_same_trajectory(result["trl"], result["occult"])
    print(f"2 processes, expert_parallel_size=2: worst per-step loss gap {worst:.2e}")
    assert all(e["max_token_devices"] <= 2 for e in result["trl"])
    # the gathered checkpoint holds every expert in the standard layout, within the budget
    loaded = occult_ft.from_pretrained(spec["out"] + "/trl")
    ids = torch.tensor([tokenizer()("Question 1: what is two plus three? It is five.")["input_ids"]])
    assert budget_held(loaded, ids, budget=2) <= 2


def test_a_float32_checkpoint_of_a_bf16_moe_run_seeds_the_compensation_in_both_trainers(
    tmp_path, tiny_tokenizer
):
    """Both trainers load a float32 checkpoint of a bf16 `moe` run in float32, prepare it, round it as a
    bf16 load would, and start `CompensatedAdamW` from what the rounding lost (`mixin.load_run_model`)."""
    from helpers import save_tiny_model
    from transformers import AutoModelForCausalLM

    from occult_ft.trainer.optim import CompensatedAdamW

    path = save_tiny_model(tmp_path / "m", "olmoe", tiny_tokenizer)
    exact = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    run = dict(train_mode="moe", model_dtype="bfloat16", placement="sequential", max_steps=1)
    rows = shape_rows("text").select(range(8))
    trainers = [
        OccultSFTTrainer(path, args=sft_config(tmp_path / "trl", **run), train_dataset=rows),
        OccultTrainer(path, args=OccultConfig(output_dir=str(tmp_path / "o"), seq_len=64, **{**COMMON, **run}),
                      train_dataset=rows),
    ]  # fmt: skip
    for trainer in trainers:
        optimizer = trainer.create_optimizer()
        inner = getattr(optimizer, "optimizer", optimizer)
        assert isinstance(inner, CompensatedAdamW), type(trainer).__name__
        seeded = 0
        for name, p in trainer.model.named_parameters():
            if p.requires_grad and p.dtype == torch.bfloat16:
                torch.testing.assert_close(p, exact[name].bfloat16(), rtol=0, atol=0)
                lost = (exact[name] - p.float()).bfloat16()
                assert torch.equal(inner.state[p]["compensation"], lost), name
                seeded += int(bool(lost.any()))
        assert seeded > 0, type(trainer).__name__
