"""The command line behaves like the tools its users know: one flag style in every command, no
abbreviations, the closest match for a typo, defaults shown once in every help, `train --help` with the
Occult fields first, one default pruning criterion, errors known from the flags before any model loads,
one fast line for a Hub id that cannot be reached, and phase lines or progress bars on long phases."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from dist_utils import free_port

from occult_ft.cli import COMMANDS, build_parser, main
from occult_ft.commands import _choices
from occult_ft.commands._common import read_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def argparse_commands():
    """Commands parsed by argparse itself (train and plan hand their fields to HfArgumentParser)."""
    return [name for name in COMMANDS if name not in ("train", "plan")]


def fail(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ---- one flag style ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", argparse_commands())
def test_every_long_option_takes_both_spellings(name):
    parser = subparsers()[name]
    options = [
        o for o in parser._option_string_actions if o.startswith("--") and len(o) > 2 and o != "--help"
    ]
    assert options
    for option in options:
        other = "--" + (option[2:].replace("-", "_") if "-" in option else option[2:].replace("_", "-"))
        assert parser.normalise_flags([other, "1"])[0] == option
        assert parser.normalise_flags([f"{other}=1"]) == [f"{option}=1"]


def test_both_spellings_reach_the_same_value():
    parse = build_parser().parse_args
    a = parse(["analyze", "m", "--data", "d", "--devices", "4", "--max_tokens", "7", "--seq_len=9"])
    b = parse(["analyze", "m", "--data", "d", "--devices", "4", "--max-tokens", "7", "--seq-len=9"])
    assert (a.max_tokens, a.seq_len) == (b.max_tokens, b.seq_len) == (7, 9)


def test_abbreviations_are_refused_with_the_full_name(capsys):
    err = fail(capsys, "place", "p.safetensors", "--device", "4", "--out", "x.json")
    assert err.startswith("occult-ft place: error: unrecognized argument --device; did you mean --devices?")


def test_a_misspelt_flag_is_named_before_required_ones_are_checked(capsys):
    err = fail(capsys, "place", "p.safetensors", "--devcies", "4", "--out", "x.json")
    assert "--devcies; did you mean --devices?" in err and "required" not in err
    err = fail(capsys, "analyze", "m", "--data", "d", "--devices", "4", "--max_tokenz", "5")
    assert err.startswith("occult-ft analyze: error:") and "did you mean --max-tokens?" in err


def test_a_misspelt_command_gets_the_closest_one(capsys):
    err = fail(capsys, "plce", "x")
    assert "unknown command 'plce'; did you mean 'place'?" in err


def test_values_that_look_like_options_are_left_alone():
    args = build_parser().parse_args(["bench", "--synthetic", "--devices", "2", "--warmup", "-1"])
    assert args.warmup == -1


def test_plan_names_a_misspelt_flag_of_its_own(capsys):
    assert main(["plan", "tiny", "--gpu", "4"]) == 2
    assert "unknown flag --gpu; did you mean --gpus?" in capsys.readouterr().err


def test_train_takes_both_spellings_and_refuses_abbreviations():
    from occult_ft.commands.train import parse_config

    a = parse_config(["tiny", "--max_steps", "3", "--per-device-train-batch-size", "2"])
    assert (a.max_steps, a.per_device_train_batch_size) == (3, 2)
    with pytest.raises(
        ValueError, match="unknown field 'max_step' on the command line; did you mean 'max_steps'"
    ):
        parse_config(["tiny", "--max_step", "3"])


# ---- help ---------------------------------------------------------------------------------------------
def _action_help(parser, action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return formatter.format_help()


@pytest.mark.parametrize("name", argparse_commands())
def test_every_default_is_shown_once(name):
    parser = subparsers()[name]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        text = " ".join(_action_help(parser, action).split())
        assert text.lower().count("default") <= 1, (name, text)
        meaningful = action.default not in (None, False) and not action.required
        if meaningful:
            assert "default" in text.lower(), (name, text)


def test_descriptions_keep_their_lines():
    """`eval --help`'s metric table is printed as written, not reflowed."""
    text = subparsers()["eval"].format_help()
    assert "\n    loss, perplexity          mean next-token cross-entropy" in text
    assert "\n    comm_complexity           mean devices a token reaches" in text


def test_train_help_shows_the_recipe_and_the_occult_fields_first(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: occult-ft train [RECIPE] [--field value ...]")
    titles = [
        "Occult: model and data:",
        "Occult: placement and pruning:",
        "Occult: training:",
        "inherited from transformers.TrainingArguments:",
    ]
    where = [text.index(t) for t in titles]
    assert where == sorted(where) and "other Occult fields" not in text
    first_option = text[where[0] :].split("\n")[1].strip()
    assert first_option.startswith("--model_name_or_path, --model-name-or-path")
    assert text.index("--max_devices_per_token") < text.index("--per_device_train_batch_size")
    for line in text.splitlines():
        assert line.count("(default") <= 1, line
    options = [line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  --")]
    assert len(options) == len(set(options))


def test_every_occult_field_has_a_help_group():
    from transformers import TrainingArguments

    from occult_ft.commands.train import FIELD_GROUPS
    from occult_ft.trainer import OccultConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(OccultConfig) if f.name not in inherited]
    grouped = [n for names in FIELD_GROUPS.values() for n in names]
    assert set(own) <= set(grouped) and len(grouped) == len(set(grouped))


# ---- names and defaults -------------------------------------------------------------------------------
def test_the_parsers_choices_are_the_librarys():
    from occult_ft.bench import BACKENDS, DTYPES
    from occult_ft.bench.costmodel import CLUSTER_PRESETS
    from occult_ft.embedded import EMBEDDED_SPLITS
    from occult_ft.placement import DEFAULT_ALGORITHM, PLACEMENT_ALGORITHMS
    from occult_ft.routing import CRITERIA, GATE_WEIGHT_POLICIES
    from occult_ft.studies.tasks import TASK_INFO

    assert _choices.CRITERIA == tuple(CRITERIA)
    assert _choices.GATE_WEIGHT_POLICIES == tuple(GATE_WEIGHT_POLICIES)
    assert _choices.PLACEMENT_ALGORITHMS == tuple(PLACEMENT_ALGORITHMS)
    assert _choices.DEFAULT_ALGORITHM == DEFAULT_ALGORITHM
    assert _choices.BENCH_BACKENDS == tuple(BACKENDS) and _choices.BENCH_DTYPES == tuple(DTYPES)
    assert _choices.CLUSTER_PRESETS == tuple(CLUSTER_PRESETS)
    assert _choices.TASK_INFO == dict(TASK_INFO)
    assert _choices.EMBEDDED_SPLITS == tuple(EMBEDDED_SPLITS)


def test_one_default_pruning_criterion_everywhere():
    from occult_ft.studies.finetune import DemoSettings
    from occult_ft.trainer import OccultConfig

    default = _choices.DEFAULT_CRITERION
    assert OccultConfig.__dataclass_fields__["criterion"].default == default
    assert DemoSettings().criterion == default
    for name in ("prune", "analyze", "demo", "study"):
        (action,) = [a for a in subparsers()[name]._actions if a.dest == "criterion"]
        assert action.default == default, name
    for recipe in os.listdir(os.path.join(ROOT, "recipes")):
        if recipe.endswith(".yaml") and recipe != "models.yaml":
            fields = read_yaml(os.path.join(ROOT, "recipes", recipe)) or {}
            if fields.get("max_devices_per_token") is None and fields.get("max_nodes_per_token") is not None:
                # a node-only budget kept in the model's own group fields (DeepSeek-V3.2): the criterion is
                # the model's group ranking, so stock transformers routes as trained
                assert fields.get("criterion") == "device_topk_sum", recipe
                continue
            assert fields.get("criterion", default) == default, recipe


def test_the_similarity_default_without_a_profile_says_what_to_pass(capsys, tiny_olmoe_dir):
    code = main(
        ["prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", "4"]
        + ["--max-devices-per-token", "2", "--out", "/tmp/never-written"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--criterion similarity (the default)" in err and "--profile" in err
    assert not os.path.exists("/tmp/never-written")


# ---- errors before any model loads ---------------------------------------------------------------
def test_a_missing_reporter_is_named_before_any_model_loads(monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed here")
    import occult_ft.trainer

    monkeypatch.setattr(occult_ft.trainer, "train", lambda config: pytest.fail("the run started"))
    assert main(["train", "tiny", "--report_to", "tensorboard"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "occult-ft train: error: --report_to tensorboard needs tensorboard, which is not installed: "
        "pip install tensorboard (or --report_to none)"
    )


def test_recipes_may_use_the_current_or_the_deprecated_checkpointing_name(tmp_path):
    from occult_ft.commands.train import parse_config

    for name in ("gradient_checkpointing", "activation_checkpointing"):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"model_name_or_path: embedded\ndataset: embedded\n{name}: true\n")
        config = parse_config([str(recipe)])
        assert config.gradient_checkpointing is True


# ---- Hub ids that cannot be reached --------------------------------------------------------------------
@pytest.fixture
def hub_down(monkeypatch, tmp_path):
    """No offline mode, an empty Hub cache, and an endpoint that refuses connections at once."""
    port = free_port()  # outside the ephemeral range: no client socket of another test lands on it
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    return env


def _cli(env, *argv):
    return subprocess.run(
        [sys.executable, "-m", "occult_ft", *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("command", ["profile", "eval", "analyze", "prune", "convert", "train"])
def test_a_model_id_the_hub_cannot_serve_is_one_line_naming_the_endpoint(
    hub_down, tmp_path, text_file, command
):
    argv = {
        "profile": ["profile", "acme/no-such-moe", "--data", text_file, "--out", tmp_path / "p.safetensors"],
        "eval": ["eval", "acme/no-such-moe", "--data", text_file],
        "analyze": ["analyze", "acme/no-such-moe", "--data", text_file, "--devices", "4"],
        "prune": [
            "prune",
            "acme/no-such-moe",
            "--placement",
            "sequential",
            "--devices",
            "4",
            "--out",
            tmp_path / "o",
        ],
        "convert": ["convert", "acme/no-such-moe", "--out", tmp_path / "o"],
        "train": ["train", "--model_name_or_path", "acme/no-such-moe", "--dataset", text_file],
    }[command]
    res = _cli(hub_down, *argv)
    err = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in err and "Retrying" not in err, err
    assert err.startswith(f"occult-ft {command}: error: model 'acme/no-such-moe'")
    assert hub_down["HF_ENDPOINT"] in err and "pass a local model directory" in err


def test_a_dataset_id_the_hub_cannot_serve_does_not_suggest_a_hub_id(hub_down, tmp_path, tiny_olmoe_dir):
    res = _cli(hub_down, "profile", tiny_olmoe_dir, "--data", "acme/no-such-data", "--out", tmp_path / "p")
    err = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in err, err
    assert "dataset 'acme/no-such-data'" in err and hub_down["HF_ENDPOINT"] in err
    assert "Hub dataset id" not in err and "a local .txt / .jsonl / .json file" in err


def test_a_cached_model_is_read_from_the_cache_when_the_hub_is_down(
    hub_down, tmp_path, tiny_olmoe_dir, text_file
):
    revision = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-olmoe"
    shutil.copytree(tiny_olmoe_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    out = tmp_path / "p.safetensors"
    res = _cli(hub_down, "profile", "acme/tiny-olmoe", "--data", text_file, "--out", out, "--max-tokens", 256)
    assert res.returncode == 0, res.stderr
    assert (
        "note: the Hub at" in res.stderr
        and "cannot be reached" in res.stderr
        and "Retrying" not in res.stderr
    )
    assert out.exists()


# ---- phases say what they do ---------------------------------------------------------------------------
def test_profile_says_when_the_data_ran_out_and_reads_the_training_split(
    tmp_path, tiny_olmoe_dir, text_file, capsys
):
    out = tmp_path / "p.safetensors"
    assert (
        main(["profile", tiny_olmoe_dir, "--data", text_file, "--out", str(out), "--max-tokens", "1000000"])
        == 0
    )
    captured = capsys.readouterr()
    assert "profiling" in captured.err  # its progress bar
    assert f"note: --data {text_file} ran out after" in captured.err and "1,000,000 tokens" in captured.err
    args = build_parser().parse_args(["profile", "m", "--data", "embedded", "--out", "p"])
    assert args.split is None and args.embedded_split == "train"
    args = build_parser().parse_args(["eval", "m", "--data", "embedded"])
    assert args.embedded_split == "eval"


def test_analyze_and_place_show_their_progress(tmp_path, tiny_olmoe_dir, text_file, capsys):
    prof = tmp_path / "p.safetensors"
    assert (
        main(["profile", tiny_olmoe_dir, "--data", text_file, "--out", str(prof), "--max-tokens", "400"]) == 0
    )
    capsys.readouterr()
    assert main(["place", str(prof), "--devices", "4", "--out", str(tmp_path / "pl.json")]) == 0
    assert (
        "occult-ft place: placing the 8 experts of 2 layers on 4 devices with solver ..."
        in capsys.readouterr().err
    )
    assert (
        main(["analyze", tiny_olmoe_dir, "--data", text_file, "--devices", "4", "--max-tokens", "400"]) == 0
    )
    assert "profiling" in capsys.readouterr().err


# ---- the repository ----------------------------------------------------------------------------------
def test_gitignore_lists_no_tracked_file():
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    res = subprocess.run(
        ["git", "ls-files", "--cached", "--ignored", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout.strip() == "", res.stdout


@pytest.mark.slow
def test_eval_of_a_training_output_evaluates_as_the_trainer_did(tmp_path, tiny_olmoe_dir, text_file, capsys):
    """seq_len and eval data default to the run's (recorded in its block): the loss is the trainer's own
    final eval loss on the same data, and the command says which settings it took."""
    from occult_ft.trainer import OccultConfig, train

    config = OccultConfig(
        output_dir=str(tmp_path / "run"),
        model_name_or_path=tiny_olmoe_dir,
        dataset=text_file,
        eval_dataset=text_file,
        seq_len=32,
        devices=4,
        max_devices_per_token=2,
        criterion="score",
        profile_tokens=512,
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    _, metrics = train(config)
    capsys.readouterr()
    assert main(["eval", config.output_dir, "--json"]) == 0
    captured = capsys.readouterr()
    assert f"evaluating with the training run's settings: data {text_file}, seq_len 32" in captured.err
    result = json.loads(captured.out)
    assert result["loss"] == pytest.approx(metrics["eval_loss"], rel=1e-3)


def test_prune_prints_no_notice_a_user_cannot_act_on(tmp_path, tiny_olmoe_dir):
    """No DeepSpeed accelerator line, no library warning: the one result line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("DS_ACCELERATOR", None)
    out = tmp_path / "o"
    argv = ["prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", "4", "--out", out]
    res = subprocess.run(
        [sys.executable, "-m", "occult_ft", *map(str, argv)], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    for noise in ("accelerator", "Warning", "warn"):
        assert noise not in res.stderr, res.stderr
    assert res.stdout.strip() == f"wrote {out}: experts placed on 4 devices"
