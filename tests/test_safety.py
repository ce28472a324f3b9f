"""Nothing lost, nothing silently wrong: every write atomic, every bad input a one-line error, case by case through the commands, the trainer and
the Python API (tiny real models, real Trainer runs). The families behind them have their own files:
the output-path check and the directory swap (`test_fileio.py`), the row validator
(`test_data_rows.py`), resume (`test_resume.py`), bf16 updates (`test_optim.py`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import save_tiny_model

import occult_ft
from occult_ft.cli import main
from occult_ft.fileio import ReadError
from occult_ft.trainer import OccultConfig, OccultTrainer

SECRET = "secret-xyz-0123456789"


def run_cli(*args) -> int:
    return main([str(a) for a in args])


def _tree(path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, n), path): open(os.path.join(root, n), "rb").read()
        for root, _, names in os.walk(path)
        for n in names
    }


def _user_project(path):
    (path / "src").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes")
    (path / "src" / "main.py").write_text("print('mine')")
    return path


def _config(out, model=None, data=None, **overrides) -> OccultConfig:
    base = dict(
        output_dir=str(out),
        model_name_or_path=model,
        dataset=data,
        seq_len=32,
        devices=4,
        placement="sequential",
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        train_mode="full",
        balance_loss_coef=0.0,
    )
    base.update(overrides)
    return OccultConfig(**base)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_olmoe_dir, text_file):
    """A 2-step full run through `occult_ft.trainer.train`, with a Hub token set (push off)."""
    from occult_ft.trainer import train

    out = tmp_path_factory.mktemp("run") / "out"
    train(_config(out, tiny_olmoe_dir, text_file, hub_token=SECRET))
    return out


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory, tiny_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral", tiny_tokenizer)


# ---- user data deleted ------------------------------------------------------------------------------
def test_prune_into_a_directory_of_user_files_is_refused_and_they_stay(tmp_path, tiny_olmoe_dir, capsys):
    user = _user_project(tmp_path / "project")
    before = _tree(user)
    argv = ["prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", 4, "--out", user]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert "holds files occult_ft did not write (notes.txt, src/)" in err and err.count("\n") == 1
    assert _tree(user) == before


@pytest.mark.parametrize("out", ["", "."])
def test_prune_into_an_empty_path_or_the_working_directory_is_refused(
    tmp_path, tiny_olmoe_dir, capsys, monkeypatch, out
):
    work = _user_project(tmp_path / "work")
    monkeypatch.chdir(work)
    before = _tree(work)
    assert run_cli("prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", 4, "--out", out) == 2
    err = capsys.readouterr().err
    assert ("--out is empty" if out == "" else "is the working directory") in err
    assert _tree(work) == before


def test_prune_replaces_its_own_earlier_output_and_nothing_else(tmp_path, tiny_olmoe_dir, capsys):
    out = tmp_path / "pruned"
    argv = ["prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", 4, "--out", out]
    assert run_cli(*argv) == 0
    assert (
        run_cli(*argv, "--max-devices-per-token", 1, "--criterion", "score") == 0
    )  # an artifact of ours: replaced whole
    assert json.load(open(out / "config.json"))["occult"]["max_devices_per_token"] == 1
    assert sorted(os.listdir(tmp_path)) == ["pruned"]


def test_train_into_an_output_dir_holding_the_users_readme_is_refused_before_loading(
    tmp_path, tiny_olmoe_dir, text_file, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# my project\n")
    argv = ["train", "--model_name_or_path", tiny_olmoe_dir, "--dataset", text_file, "--output_dir", out]
    assert run_cli(*argv, "--use_cpu", "true", "--report_to", "none", "--max_steps", 1) == 2
    assert "holds files of yours that training would overwrite (README.md)" in capsys.readouterr().err
    assert (out / "README.md").read_text() == "# my project\n" and os.listdir(out) == ["README.md"]


def test_a_training_output_dir_may_be_trained_into_again(run, tiny_olmoe_dir, text_file):
    from occult_ft.trainer.config import check_output_dir

    check_output_dir(_config(run, tiny_olmoe_dir, text_file))  # its own earlier output: fine


def test_every_file_of_a_run_gets_the_umask_permissions(run):
    mask = os.umask(0o022)
    os.umask(mask)
    for root, dirs, files in os.walk(run):
        for name in files:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o666 & ~mask, name
        for name in dirs:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o777 & ~mask, name


# ---- wrong results that load and run ------------------------------------------------------------------
def test_a_diverging_run_stops_at_the_step_and_saves_nothing_non_finite(
    tmp_path, tiny_olmoe_dir, text_file, capsys
):
    out = tmp_path / "diverged"
    argv = ["train", "--model_name_or_path", tiny_olmoe_dir, "--dataset", text_file, "--output_dir", out]
    flags = dict(
        learning_rate=1e10, max_steps=6, save_steps=1, save_strategy="steps", use_cpu="true", report_to="none",
        seq_len=32, devices=4, placement="sequential", train_mode="full", per_device_train_batch_size=4,
        disable_tqdm="true",
    )  # fmt: skip
    assert run_cli(*argv, *[x for k, v in flags.items() for x in (f"--{k}", v)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        "error: step " in err and "so training stopped before applying it" in err and "learning_rate" in err
    )
    assert not (out / "model.safetensors").exists()  # no result was saved
    from safetensors.torch import load_file

    for name in os.listdir(out) if out.exists() else []:
        for tensor in load_file(out / name / "model.safetensors").values():
            assert torch.isfinite(tensor).all(), name  # a checkpoint, if any, holds finite weights only


def test_non_finite_weights_are_never_saved(tmp_path, tiny_olmoe_dir, text_file):
    from occult_ft.data import load_text_dataset
    from occult_ft.trainer.guards import NonFiniteError

    trainer = OccultTrainer(
        tiny_olmoe_dir,
        args=_config(tmp_path / "o", save_strategy="no"),
        train_dataset=load_text_dataset(text_file),
    )
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"weight tensors hold NaN or inf \(model\.embed_tokens\.weight"):
        trainer.save_model(str(tmp_path / "result"))
    assert not (tmp_path / "result" / "model.safetensors").exists()


def test_a_negative_epoch_count_is_refused(capsys):
    assert run_cli("train", "--num_train_epochs", -1, "--use_cpu", "true", "--report_to", "none") == 2
    assert "num_train_epochs=-1.0 gives no training step" in capsys.readouterr().err


def test_resuming_a_run_from_another_models_checkpoint_names_the_checkpoint(
    run, tiny_mixtral_dir, text_file, tmp_path
):
    from occult_ft.data import load_text_dataset

    checkpoint = str(run / "checkpoint-2")
    args = _config(tmp_path / "m", resume_from_checkpoint=checkpoint)
    with pytest.raises(
        ValueError, match=rf"checkpoint '{checkpoint}' is not of this run's model: its model_type is 'olmoe'"
    ):
        OccultTrainer(tiny_mixtral_dir, args=args, train_dataset=load_text_dataset(text_file))


@pytest.fixture(scope="module")
def olmoe_adapter(tmp_path_factory, tiny_olmoe_dir, text_file):
    pytest.importorskip("peft")
    from occult_ft.data import load_text_dataset

    tmp = tmp_path_factory.mktemp("lora")
    args = _config(tmp / "run", train_mode="lora", lora_r=4, lora_alpha=8, max_steps=1, save_steps=1)
    trainer = OccultTrainer(tiny_olmoe_dir, args=args, train_dataset=load_text_dataset(text_file))
    trainer.train()
    trainer.save_model(str(tmp / "adapter"))
    return tmp


def _rebased(adapter_dir, base, to) -> str:
    shutil.copytree(adapter_dir, to)
    cfg = json.load(open(to / "adapter_config.json"))
    cfg["base_model_name_or_path"] = base
    (to / "adapter_config.json").write_text(json.dumps(cfg))
    return str(to)


def test_an_olmoe_adapter_on_a_mixtral_base_is_refused_on_every_occult_ft_path(
    olmoe_adapter, tiny_mixtral_dir, text_file, tmp_path
):
    from occult_ft.data import load_text_dataset

    wrong = _rebased(olmoe_adapter / "adapter", tiny_mixtral_dir, tmp_path / "wrong")
    match = "was trained on a olmoe model but its base is a mixtral model"
    with pytest.raises(ValueError, match=match):  # occult_ft.from_pretrained
        occult_ft.from_pretrained(wrong)
    args = _config(tmp_path / "cont", wrong, text_file, train_mode="lora")
    with pytest.raises(ValueError, match=match):  # OccultTrainer continuing the adapter
        OccultTrainer(wrong, args=args, train_dataset=load_text_dataset(text_file))
    ckpt = str(olmoe_adapter / "run" / "checkpoint-1")
    args = _config(tmp_path / "res", train_mode="lora", lora_r=4, lora_alpha=8, resume_from_checkpoint=ckpt)
    with pytest.raises(ValueError, match="its model_type is 'olmoe'"):  # resuming its checkpoint on Mixtral
        OccultTrainer(tiny_mixtral_dir, args=args, train_dataset=load_text_dataset(text_file))


# ---- a secret published ---------------------------------------------------------------------------------
def test_the_hub_token_is_in_no_file_of_the_run_and_training_state_is_not_uploaded(run):
    from occult_ft.hub import upload_file_list

    leaked = [name for name, data in _tree(run).items() if SECRET.encode() in data]
    assert leaked == []
    args = torch.load(run / "training_args.bin", weights_only=False)
    assert args.hub_token is None and args.learning_rate == 1e-3  # the rest is kept
    uploaded = upload_file_list(run)
    assert "model.safetensors" in uploaded
    assert not any(n in uploaded for n in ("training_args.bin", "optimizer.pt", "scheduler.pt"))


# ---- errors that name what is wrong ------------------------------------------------------------------------
def test_a_garbage_similarity_file_names_the_file(tmp_path, tiny_olmoe_dir):
    out = tmp_path / "pruned"
    assert run_cli(
        "prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", 4, "--max-devices-per-token", 1, "--criterion", "score", "--out", out
    ) == 0  # fmt: skip
    (out / "occult_similarity.tables").write_bytes(os.urandom(300))
    with pytest.raises(
        ReadError, match=r"could not read .*occult_similarity.tables: it is not a complete safetensors"
    ):
        occult_ft.from_pretrained(str(out))


def test_a_half_truncated_model_file_names_the_file(tmp_path, tiny_olmoe_dir, text_file, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_olmoe_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert run_cli("eval", broken, "--data", text_file, "--seq-len", 32, "--max-tokens", 256) == 2
    err = capsys.readouterr().err
    assert f"could not read {broken}/model.safetensors: it is not a complete safetensors file" in err


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_malicious_pickle_in_a_checkpoint_is_refused_naming_it_and_runs_nothing(
    run, tmp_path, tiny_olmoe_dir, text_file, monkeypatch
):
    from occult_ft.data import load_text_dataset

    monkeypatch.chdir(tmp_path)
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(run / "checkpoint-2", checkpoint)
    torch.save({"state": _Payload()}, checkpoint / "optimizer.pt")
    args = _config(tmp_path / "resumed", max_steps=3)
    trainer = OccultTrainer(tiny_olmoe_dir, args=args, train_dataset=load_text_dataset(text_file))
    with pytest.raises(
        ReadError, match=r"could not read .*checkpoint-2/optimizer.pt: it holds Python objects"
    ):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not (tmp_path / "PWNED").exists()


def test_config_and_recipe_values_of_the_wrong_type_are_one_line(tmp_path):
    from occult_ft.commands.train import parse_config

    with pytest.raises(ValueError, match=r"lora_alpha='32' must be a number, e\.g\. lora_alpha=32\.0"):
        OccultConfig(lora_alpha="32", use_cpu=True, report_to="none")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: [1, 2]\nuse_cpu: true\nreport_to: none\n")
    with pytest.raises(ValueError, match=rf"recipe '{recipe}': learning_rate=\[1, 2\] is not a number"):
        parse_config([str(recipe)])
    recipe.write_bytes(b"learning_rate: \xa5\n")
    with pytest.raises(ReadError, match=r"r.yaml: it is not UTF-8 text"):
        parse_config([str(recipe)])


def test_an_empty_output_dir_is_one_line(capsys):
    assert run_cli("train", "--output_dir", "", "--use_cpu", "true", "--report_to", "none") == 2
    assert "output_dir='' is empty" in capsys.readouterr().err


def test_streaming_an_empty_or_blank_jsonl_names_the_file(tmp_path, tiny_olmoe_dir, capsys):
    for name, content in (("empty.jsonl", ""), ("blank.jsonl", '{"text": ""}\n{"text": "  "}\n')):
        data = tmp_path / name
        data.write_text(content)
        argv = ["train", "--model_name_or_path", tiny_olmoe_dir, "--dataset", data, "--streaming", "true"]
        flags = ["--max_steps", 2, "--use_cpu", "true", "--report_to", "none", "--output_dir", tmp_path / "o"]
        assert run_cli(*argv, *flags, "--placement", "sequential", "--devices", 4, "--seq_len", 32) == 2
        assert f"dataset '{data}' is empty" in capsys.readouterr().err


def test_latin1_data_names_the_file_before_any_model_loads(tmp_path, capsys):
    data = tmp_path / "latin.txt"
    data.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert (
        run_cli("profile", "no-such-model-dir/x/y", "--data", data, "--out", tmp_path / "p.safetensors") == 2
    )
    assert f"could not read {data}: it is not UTF-8 text (byte 0xe9 at offset 3)" in capsys.readouterr().err


def test_the_token_survives_in_memory_copies_but_no_pickle(tmp_path):
    import copy
    import pickle

    args = OccultConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", hub_token=SECRET)
    assert copy.deepcopy(args).hub_token == SECRET and copy.copy(args).hub_token == SECRET
    assert SECRET.encode() not in pickle.dumps(args) and pickle.loads(pickle.dumps(args)).hub_token is None


def test_a_streamed_file_too_short_for_one_example_is_one_line_naming_it(tmp_path, tiny_olmoe_dir):
    from occult_ft.trainer import train

    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "a single short row"}\n')  # packed: not one full block of 32 tokens
    config = _config(tmp_path / "out", tiny_olmoe_dir, str(data), streaming=True, max_steps=2)
    with pytest.raises(ValueError, match=rf"dataset '{data}' gives no training example of seq_len=32 tokens"):
        train(config)


def test_a_run_that_took_no_step_is_refused_and_saves_nothing(
    tmp_path, tiny_olmoe_dir, text_file, monkeypatch
):
    """The pipeline's last line of defence, whatever made the data loader yield nothing."""
    from occult_ft.trainer import train

    def no_batches(self, *args, **kwargs):  # a data loader without a single batch
        self.control.should_training_stop = True

    monkeypatch.setattr(OccultTrainer, "_run_epoch", no_batches)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"the run took no optimizer step .*; nothing was saved"):
        train(_config(out, tiny_olmoe_dir, text_file, save_strategy="no"))
    assert not (out / "model.safetensors").exists()


def test_fewer_rows_than_one_batch_with_drop_last_is_one_line(tmp_path, tiny_olmoe_dir, text_file):
    from occult_ft.data import load_text_dataset

    rows = load_text_dataset(text_file).select(range(1))
    args = _config(tmp_path / "o", dataloader_drop_last=True, per_device_train_batch_size=8, packing=False)
    trainer = OccultTrainer(tiny_olmoe_dir, args=args, train_dataset=rows)
    with pytest.raises(
        ValueError, match=r"train_dataset has 1 rows, fewer than one batch of 8 .*dataloader_drop_last"
    ):
        trainer.train()
