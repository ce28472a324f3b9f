"""`occult-ft profile | place | prune | analyze` end to end on tiny saved models, and every bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import save_tiny_model
from transformers import AutoModelForCausalLM

import occult_ft
from occult_ft.cli import main
from occult_ft.metrics import contiguous_expert_device, devices_per_token
from occult_ft.models import find_moe_layers
from occult_ft.routing import collect_routing, set_recording


def run_cli(*args):
    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_olmoe_dir, text_file):
    """profile -> place on 4 devices, shared by the tests below."""
    out = tmp_path_factory.mktemp("pipe")
    prof = out / "profile.safetensors"
    assert (
        run_cli(
            "profile",
            tiny_olmoe_dir,
            "--data",
            text_file,
            "--out",
            prof,
            "--seq-len",
            32,
            "--max-tokens",
            2000,
        )
        == 0
    )
    placement = out / "placement.json"
    assert run_cli("place", prof, "--devices", 4, "--out", placement) == 0
    return dict(model=tiny_olmoe_dir, data=text_file, profile=str(prof), placement=str(placement), out=out)


def test_placement_file_is_readable_json_for_the_model(pipeline, tmp_path):
    doc = json.loads(open(pipeline["placement"]).read())
    assert doc["num_experts"] == 8 and doc["num_devices"] == 4 and doc["model_type"] == "olmoe"
    assert doc["model"] == pipeline["model"]
    # a layer that meets its lower bound (gap 0) is proven optimal, whichever algorithm found it
    out = tmp_path / "search.json"
    assert run_cli("place", pipeline["profile"], "--devices", 4, "--algorithm", "search", "--out", out) == 0
    for name in (pipeline["placement"], out):
        layers = json.loads(open(name).read())["metrics"]["layers"].values()
        met = [fig for fig in layers if fig["gap"] is not None and fig["gap"] <= 1e-9]
        assert met and all(fig["optimal"] for fig in met), name


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_prune_without_budget_is_the_same_function(pipeline):
    out = pipeline["out"] / "placed"
    assert run_cli("prune", pipeline["model"], "--placement", pipeline["placement"], "--out", out) == 0
    ids = torch.randint(3, 200, (2, 12))
    ref = AutoModelForCausalLM.from_pretrained(pipeline["model"])
    placed = AutoModelForCausalLM.from_pretrained(out)  # plain transformers
    torch.testing.assert_close(_logits(placed, ids), _logits(ref, ids), atol=1e-5, rtol=1e-5)
    assert os.path.isfile(out / "tokenizer.json")


@pytest.mark.parametrize("criterion", ["score", "similarity", "device_max", "device_topk_sum"])
def test_pruned_checkpoint_loads_with_pruned_routing(pipeline, criterion):
    out = pipeline["out"] / f"pruned-{criterion}"
    assert (
        run_cli(
            "prune",
            pipeline["model"],
            "--placement",
            pipeline["placement"],
            "--max-devices-per-token",
            1,
            "--criterion",
            criterion,
            "--profile",
            pipeline["profile"],
            "--out",
            out,
        )
        == 0
    )
    cfg = json.load(open(out / "config.json"))
    assert cfg["occult"]["max_devices_per_token"] == 1 and cfg["occult"]["criterion"] == criterion
    model = occult_ft.from_pretrained(str(out))
    set_recording(model, True)
    _logits(model, torch.randint(3, 200, (2, 12)))
    records = collect_routing(model)
    assert sorted(records) == [layer.index for layer in find_moe_layers(model)]
    for rec in records.values():
        assert devices_per_token(rec.topk_ids, contiguous_expert_device(8, 4), 4).max() == 1


def test_analyze_json_reports_overall_and_per_layer(pipeline, capsys):
    capsys.readouterr()
    assert (
        run_cli(
            "analyze",
            pipeline["model"],
            "--data",
            pipeline["data"],
            "--devices",
            4,
            "--placement",
            pipeline["placement"],
            "--json",
            "--seq-len",
            32,
            "--max-tokens",
            500,
        )
        == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert 1.0 <= rep["comm_complexity"] <= 2.0 and 0.0 <= rep["intra_share"] <= 1.0
    assert len(rep["layers"]) == 2 and all("comm_complexity" in m for m in rep["layers"])
    assert (
        run_cli(
            "analyze",
            pipeline["model"],
            "--data",
            pipeline["data"],
            "--devices",
            4,
            "--json",
            "--max-devices-per-token",
            1,
            "--criterion",
            "score",
            "--seq-len",
            32,
            "--max-tokens",
            500,
        )
        == 0
    )
    pruned = json.loads(capsys.readouterr().out)
    assert pruned["comm_complexity"] == 1.0


@pytest.mark.parametrize(
    "experts,k,budget,n_group,topk_group",
    [
        (8, 4, 2, 1, 1),  # k // M == 2, like DeepSeek-V3 itself (top-8 in 4 of 8 groups)
        (16, 4, 1, 1, 1),  # k // M == 4: the model's own top-2 group score is used
        (16, 2, 3, 4, 2),  # a model that already routes in groups: the old fields are replaced
    ],
)
def test_deepseek_v3_topk_sum_writes_native_group_fields(
    tmp_path, tiny_tokenizer, experts, k, budget, n_group, topk_group
):
    """Stock transformers routes a device_topk_sum checkpoint exactly like occult_ft does."""
    src = save_tiny_model(
        tmp_path / "v3",
        "deepseek_v3",
        tiny_tokenizer,
        n_routed_experts=experts,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
    )
    out = tmp_path / "v3-pruned"
    assert (
        run_cli(
            "prune",
            src,
            "--placement",
            "sequential",
            "--devices",
            4,
            "--max-devices-per-token",
            budget,
            "--criterion",
            "device_topk_sum",
            "--out",
            out,
        )
        == 0
    )
    cfg = json.load(open(out / "config.json"))
    assert cfg["n_group"] == 4 and cfg["topk_group"] == budget
    stock = AutoModelForCausalLM.from_pretrained(out)
    ours = occult_ft.from_pretrained(str(out))
    ids = torch.randint(3, 200, (2, 16))
    torch.testing.assert_close(_logits(stock, ids), _logits(ours, ids))


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "occult_ft", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "profile" in res.stdout and "place" in res.stdout


# ---- bad input: one line, non-zero exit, no traceback ----------------------------------------------


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "corrupt.json").write_text("{not json")
    (d / "wrong.json").write_text(json.dumps({"format": "something else"}))
    (d / "profile.safetensors").write_bytes(b"garbage")
    return d


def bad_cases(p, bad):
    m, data, prof, place = p["model"], p["data"], p["profile"], p["placement"]
    return [
        (["profile", "/nonexistent/model", "--data", data, "--out", bad / "x"], "does not exist"),
        (["profile", m, "--data", bad / "missing.txt", "--out", bad / "x"], "missing.txt"),
        (["place", bad / "nope.safetensors", "--devices", 4, "--out", bad / "p.json"], "does not exist"),
        (
            ["place", bad / "profile.safetensors", "--devices", 4, "--out", bad / "p.json"],
            "not a readable occult_ft profile",
        ),
        (["place", prof, "--devices", 3, "--out", bad / "p.json"], "devices=3"),
        (["place", prof, "--devices", 4, "--nodes", 3, "--out", bad / "p.json"], "nodes=3"),
        (["place", prof, "--devices", 4, "--algorithm", "magic", "--out", bad / "p.json"], "magic"),
        (["place", prof, "--devices", 4, "--out", prof], "would overwrite the input"),
        (["prune", m, "--placement", bad / "corrupt.json", "--out", bad / "o"], "corrupt.json"),
        (["prune", m, "--placement", bad / "wrong.json", "--out", bad / "o"], "wrong.json"),
        (["prune", m, "--placement", bad / "absent.json", "--out", bad / "o"], "absent.json"),
        (
            [
                "prune",
                m,
                "--placement",
                place,
                "--max-devices-per-token",
                0,
                "--criterion",
                "score",
                "--out",
                bad / "o",
            ],
            "max_devices_per_token=0",
        ),
        (
            [
                "prune",
                m,
                "--placement",
                place,
                "--max-devices-per-token",
                5,
                "--criterion",
                "score",
                "--out",
                bad / "o",
            ],
            "max_devices_per_token=5",
        ),
        (
            [
                "prune",
                m,
                "--placement",
                place,
                "--max-devices-per-token",
                1,
                "--criterion",
                "vibes",
                "--out",
                bad / "o",
            ],
            "invalid choice: 'vibes'",
        ),
        (
            [
                "prune",
                m,
                "--placement",
                place,
                "--max-devices-per-token",
                1,
                "--criterion",
                "similarity",
                "--out",
                bad / "o",
            ],
            "--profile",
        ),
        (["analyze", m, "--data", data, "--devices", 3], "devices=3"),
    ]


def error_line(err: str) -> str:
    """The one error line of a failed command: the last line of stderr, after any progress bars of the
    phases that ran first (nothing else: no traceback, no warning)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and "Traceback" not in err and "Warning" not in err, err
    # progress bars, phase lines (`occult-ft X: placing ... ...`) and notes come before it
    assert all(
        "%|" in line or (line.startswith("occult-ft ") and ": error:" not in line) for line in lines[:-1]
    ), err
    assert lines[-1].startswith("occult-ft ") and ": error:" in lines[-1], err
    return lines[-1]


def test_every_bad_input_gives_one_clear_line(pipeline, bad_files, capsys):
    for argv, needle in bad_cases(pipeline, bad_files):
        capsys.readouterr()
        try:
            code = run_cli(*argv)
        except SystemExit as exc:  # argparse's own checks (choices, types)
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code != 0, argv
        assert needle in error_line(err), (argv, err)


def test_unsupported_model_type_is_one_line(tmp_path, capsys, tiny_tokenizer, text_file):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tiny_tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    ).save_pretrained(tmp_path / "llama")
    tiny_tokenizer.save_pretrained(tmp_path / "llama")
    code = run_cli("profile", tmp_path / "llama", "--data", text_file, "--out", tmp_path / "p")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model_type 'llama' is not supported" in error_line(err)


def test_an_unknown_model_type_is_refused_on_every_path(pipeline, tmp_path, capsys):
    """A config.json whose model_type is no known type (here one carrying code, with the architectures of
    a real class) is refused in one line naming it by every command that reads a model config, before
    anything is written; a type published as another architecture (Kimi-K2's kimi_k2) still reads."""
    from occult_ft.models.family import architecture_model_type

    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(pipeline["model"]):
        os.link(os.path.join(pipeline["model"], name), bad / name)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").unlink()  # a new file, not the shared model's (hard link)
    config["model_type"] = "__import__('os').system('touch PWNED')"
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    for argv in (
        ["prune", bad, "--placement", "sequential", "--devices", 4, "--out", out],
        ["profile", bad, "--data", pipeline["data"], "--out", out],
        ["analyze", bad, "--data", pipeline["data"], "--devices", 4],
        ["eval", bad, "--data", pipeline["data"]],
        ["plan", "--model_name_or_path", bad],
        ["push", bad, "--repo-id", "me/bad", "--dry-run", "--no-figure"],
        ["train", "--model_name_or_path", bad, "--dataset", pipeline["data"], "--output_dir", out,
         "--max_steps", 1, "--use_cpu", "true", "--report_to", "none"],
    ):  # fmt: skip
        capsys.readouterr()
        code = run_cli(*argv)
        line = error_line(capsys.readouterr().err.strip())
        assert code == 2 and "model_type \"__import__('os')" in line and "is not a model type" in line, argv
        assert str(bad / "config.json") in line, argv
        assert not out.exists() and not os.path.exists("PWNED"), argv
    assert architecture_model_type({"model_type": "kimi_k2"}) == "deepseek_v3"
    assert architecture_model_type({"model_type": "olmoe"}) is None


def test_eval_refuses_a_device_count_the_checkpoint_is_not_laid_out_for(pipeline, tmp_path, capsys):
    """A placed checkpoint (no budget) and a pruned one are laid out for their own D: eval refuses another
    --devices before the model loads, as analyze does."""
    placed, pruned = tmp_path / "placed", tmp_path / "pruned"
    common = ["--placement", pipeline["placement"], "--devices", 4]
    assert run_cli("prune", pipeline["model"], *common, "--out", placed) == 0
    assert run_cli("prune", pipeline["model"], *common, "--max-devices-per-token", 1, "--criterion", "score",
                   "--out", pruned) == 0  # fmt: skip
    for path, what in ((placed, "placed"), (pruned, "pruned")):
        capsys.readouterr()
        assert run_cli("eval", path, "--data", pipeline["data"], "--devices", 2) == 2
        line = error_line(capsys.readouterr().err.strip())
        assert f"--devices 2 but {path} is {what} for 4 devices; use --devices 4" in line


def test_plot_is_checked_before_any_work(pipeline, tmp_path, capsys):
    """`place --plot` equal to its --out, or not a .png: refused before the solver runs, nothing written."""
    out = tmp_path / "x.json"
    for plot, message in (
        (out, "is also where this command writes"),
        (tmp_path / "f.svg", "does not end in .png"),
    ):
        capsys.readouterr()
        assert run_cli("place", pipeline["profile"], "--devices", 4, "--out", out, "--plot", plot) == 2
        assert message in error_line(capsys.readouterr().err.strip())
        assert not out.exists()
    capsys.readouterr()
    argv = ["analyze", pipeline["model"], "--data", pipeline["data"], "--devices", 4]
    assert run_cli(*argv, "--plot", tmp_path / "n.txt") == 2
    assert "does not end in .png" in error_line(capsys.readouterr().err.strip())


def test_eval_reads_about_max_tokens_not_a_whole_batch_more(pipeline, capsys):
    capsys.readouterr()
    argv = [
        "eval",
        pipeline["model"],
        "--data",
        pipeline["data"],
        "--seq-len",
        32,
        "--max-tokens",
        64,
        "--json",
    ]
    assert run_cli(*argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert 64 <= result["tokens"] < 64 + 32  # whole rows of 32, the default batch holds 8


def test_placement_for_another_model_is_rejected(pipeline, tmp_path, capsys, tiny_tokenizer):
    other = save_tiny_model(tmp_path / "m16", "olmoe", tiny_tokenizer, num_experts=16)
    code = run_cli("prune", other, "--placement", pipeline["placement"], "--out", tmp_path / "o")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "8 experts" in err and "16" in err


def test_bad_flag_values_are_one_line_too(capsys):
    for argv in (
        ["place", "p.safetensors", "--devices", "0", "--out", "x.json"],
        ["bench", "--synthetic", "--devices", "-2"],
        ["analyze", "m", "--data", "d", "--devices", "two"],
    ):
        with pytest.raises(SystemExit) as exc:
            run_cli(*argv)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and "error" in err, (argv, err)


def test_max_tokens_counts_real_tokens_not_padded_rows(tmp_path, tiny_tokenizer):
    from occult_ft.evaluation import data_batches

    rows = [{"instruction": f"Say {i}", "input": "", "output": "ok"} for i in range(40)]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows))
    batches = data_batches(tiny_tokenizer, str(path), seq_len=64, batch_size=4, max_tokens=100)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert 100 <= real < 100 + 4 * 64


def test_analyze_reports_a_pruned_checkpoints_own_routing(pipeline, capsys):
    out = pipeline["out"] / "pruned-for-analyze"
    assert (
        run_cli(
            "prune",
            pipeline["model"],
            "--placement",
            pipeline["placement"],
            "--max-devices-per-token",
            1,
            "--criterion",
            "score",
            "--out",
            out,
        )
        == 0
    )
    capsys.readouterr()
    assert (
        run_cli(
            "analyze",
            out,
            "--data",
            pipeline["data"],
            "--devices",
            4,
            "--json",
            "--seq-len",
            32,
            "--max-tokens",
            300,
        )
        == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert rep["comm_complexity"] == 1.0 and rep["extra"]["max_devices_per_token"] == 1
    assert (
        run_cli(
            "analyze", out, "--data", pipeline["data"], "--devices", 4, "--placement", pipeline["placement"]
        )
        == 2
    )
    assert "already placed" in capsys.readouterr().err
    assert run_cli("analyze", out, "--data", pipeline["data"], "--devices", 2) == 2
    assert "placed for 4 devices" in capsys.readouterr().err


def test_a_profile_of_another_model_is_rejected(pipeline, tmp_path, capsys, tiny_tokenizer, text_file):
    other = save_tiny_model(tmp_path / "m16", "olmoe", tiny_tokenizer, num_experts=16)
    prof = tmp_path / "p16.safetensors"
    assert (
        run_cli("profile", other, "--data", text_file, "--out", prof, "--max-tokens", 200, "--seq-len", 32)
        == 0
    )
    capsys.readouterr()
    code = run_cli(
        "prune",
        pipeline["model"],
        "--placement",
        pipeline["placement"],
        "--max-devices-per-token",
        2,
        "--criterion",
        "similarity",
        "--profile",
        prof,
        "--out",
        tmp_path / "o",
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "profile was made for 16 experts, the model has 8" in error_line(err)


def test_routing_commands_read_instruction_data_whatever_the_prompt_length(pipeline, tmp_path, capsys):
    rows = [
        {
            "instruction": "Describe the quick brown fox and the lazy dog in detail " * 3,
            "input": "",
            "output": "ok",
        }
        for _ in range(20)
    ]
    data = tmp_path / "alpaca.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    assert (
        run_cli("analyze", pipeline["model"], "--data", data, "--devices", 4, "--json", "--seq-len", 16) == 0
    )
    assert json.loads(capsys.readouterr().out)["layers"][0]["tokens"] > 0


def test_missing_tokenizer_and_unwritable_output_are_named(pipeline, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(pipeline["model"]).save_pretrained(tmp_path / "no-tokenizer")
    assert (
        run_cli("profile", tmp_path / "no-tokenizer", "--data", pipeline["data"], "--out", tmp_path / "p")
        == 2
    )
    assert "no tokenizer" in capsys.readouterr().err
    assert (
        run_cli("place", pipeline["profile"], "--devices", 4, "--out", tmp_path / "nowhere" / "p.json") == 2
    )
    err = capsys.readouterr().err
    assert "does not exist; create it first" in error_line(err)


# ---- writes that lose nothing (each reproduced by a hostile tester) --------------------------------------
def _tree(path):
    return {
        os.path.relpath(os.path.join(root, n), path): open(os.path.join(root, n), "rb").read()
        for root, _, names in os.walk(path)
        for n in names
    }


def test_prune_out_equal_to_or_inside_the_input_is_refused(pipeline, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(pipeline["model"], model)
    before = _tree(model)
    for out in (model, model / "pruned"):
        assert run_cli("prune", model, "--placement", pipeline["placement"], "--out", out) == 2
        assert "would overwrite the input" in capsys.readouterr().err
    assert _tree(model) == before


def test_prune_of_a_placed_checkpoint_is_refused(pipeline, tmp_path, capsys):
    placed = tmp_path / "placed"
    assert run_cli("prune", pipeline["model"], "--placement", pipeline["placement"], "--out", placed) == 0
    assert run_cli("prune", placed, "--placement", pipeline["placement"], "--out", tmp_path / "again") == 2
    err = capsys.readouterr().err
    assert "already a placed occult_ft checkpoint" in err and not (tmp_path / "again").exists()


def test_place_out_equal_to_its_profile_is_refused(pipeline, capsys):
    before = open(pipeline["profile"], "rb").read()
    assert run_cli("place", pipeline["profile"], "--devices", 4, "--out", pipeline["profile"]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    assert open(pipeline["profile"], "rb").read() == before


def test_profile_with_zero_routing_tokens_is_refused(pipeline, tmp_path, capsys):
    out = tmp_path / "p.safetensors"
    with pytest.raises(SystemExit) as exit_:
        run_cli(
            "profile", pipeline["model"], "--data", pipeline["data"], "--out", out, "--max-routing-tokens", 0
        )
    assert exit_.value.code == 2 and "0 must be at least 1" in capsys.readouterr().err and not out.exists()


def test_a_profile_whose_header_disagrees_with_its_tensors_is_refused(pipeline, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from occult_ft.profiling import Profile, ProfileError

    with safe_open(pipeline["profile"], framework="pt") as f:
        header = json.loads(f.metadata()["occult_ft"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in (("num_experts", 10**15), ("num_experts", 16), ("top_k", 3)):
        bad = tmp_path / f"{key}-{value}.safetensors"
        save_file(tensors, str(bad), metadata={"occult_ft": json.dumps({**header, key: value})})
        with pytest.raises(ProfileError, match="damaged or edited"):
            Profile.load(str(bad))


def test_convert_and_plan_commands_are_listed_and_answer_in_one_line(tmp_path, capsys, tiny_olmoe_dir):
    from occult_ft.cli import build_parser

    assert {"convert", "plan"} <= set(build_parser()._subparsers._group_actions[0].choices)
    assert main(["convert", tiny_olmoe_dir, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("occult-ft convert: error: model_type 'olmoe' is not DeepSeek-MoE")
        and err.count("\n") == 1
    )
    assert main(["plan", "--model_name_or_path", tiny_olmoe_dir, "--gpus", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["per_gpu_gb"] > 0


def test_convert_command_writes_a_checkpoint_that_loads(tmp_path, capsys):
    from test_convert import deepseek_config, save_deepseek

    save_deepseek(tmp_path / "ds", deepseek_config(num_hidden_layers=2))
    assert main(["convert", str(tmp_path / "ds"), "--out", str(tmp_path / "q")]) == 0
    assert "converted" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "q").config.model_type == "qwen2_moe"
    assert main(["convert", str(tmp_path / "ds"), "--out", str(tmp_path / "q")]) == 2  # exists, not empty
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "ds"), "--out", str(tmp_path / "q"), "--overwrite"]) == 0


# ---- train: shipped recipes, optional extras, progress -------------------------------------------
def test_train_finds_a_shipped_recipe_by_name_or_recipes_path_from_anywhere(tmp_path, monkeypatch, capsys):
    from occult_ft.commands.train import parse_config, shipped_recipes

    assert {"tiny", "olmoe-1b-7b", "mixtral-8x7b"} <= set(
        shipped_recipes()
    ) and "models" not in shipped_recipes()
    monkeypatch.chdir(tmp_path)  # no recipes/ here: both forms fall back to the shipped files
    by_name = parse_config(["tiny", "--max_steps", "3"])
    by_path = parse_config(["recipes/tiny.yaml", "--max_steps", "3"])
    assert by_name.model_name_or_path == by_path.model_name_or_path == "embedded"
    assert by_name.seq_len == by_path.seq_len == 128 and by_name.max_steps == by_path.max_steps == 3
    assert run_cli("train", "tinyy") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean 'tiny'?" in err and "shipped: " in err


def test_train_shows_progress_bars_unless_told_not_to():
    from occult_ft.commands.train import parse_config

    base = ["--model_name_or_path", "embedded", "--dataset", "embedded", "--use_cpu", "true"]
    assert parse_config(base).disable_tqdm is False
    assert parse_config(base + ["--disable_tqdm", "true"]).disable_tqdm is True


def test_a_missing_extra_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    # the model path does not exist: the error must come before anything tries to load it
    missing = tmp_path / "no-model"
    code = run_cli(
        "train",
        "--model_name_or_path",
        missing,
        "--dataset",
        "embedded",
        "--train_mode",
        "lora",
        "--output_dir",
        tmp_path / "out",
        "--use_cpu",
        "true",
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [
        "occult-ft train: error: train_mode=lora needs peft, which is not installed: pip install 'occult-ft[peft]'"
    ]


@pytest.mark.slow
def test_the_wheel_ships_the_recipes_and_the_card_template_without_warnings(tmp_path):
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(root, name), src / name)
    for name in ("occult_ft", "recipes"):
        shutil.copytree(os.path.join(root, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # setuptools' warnings (a license table, data folders missing from `packages`) are the user's noise
    assert "Warning" not in build.stdout + build.stderr, [
        line for line in (build.stdout + build.stderr).splitlines() if "Warning" in line
    ]
    import zipfile

    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        f"occult_ft/recipes/{n}" for n in os.listdir(os.path.join(root, "recipes")) if n.endswith(".yaml")
    }
    assert "occult_ft/recipes/tiny.yaml" in shipped and shipped <= names
    assert "occult_ft/data/tokenize.py" in names and "occult_ft/templates/model_card.md" in names


def test_node_budget_through_prune_analyze_and_the_checkpoint(tmp_path, tiny_olmoe_dir, text_file, capsys):
    """4 devices as 2 nodes x 2, at most 1 node per token: every token's experts sit on one node, the
    checkpoint keeps the node budget, and analyze reports node_comm_complexity 1."""
    prof, placement = tmp_path / "p.safetensors", tmp_path / "pl.json"
    assert (
        run_cli(
            "profile",
            tiny_olmoe_dir,
            "--data",
            text_file,
            "--out",
            prof,
            "--seq-len",
            32,
            "--max-tokens",
            1000,
        )
        == 0
    )
    assert run_cli("place", prof, "--devices", 4, "--nodes", 2, "--out", placement) == 0
    out = tmp_path / "pruned"
    assert (
        run_cli(
            "prune",
            tiny_olmoe_dir,
            "--placement",
            placement,
            "--max-nodes-per-token",
            1,
            "--criterion",
            "score",
            "--out",
            out,
        )
        == 0
    )
    assert "at most 1 of 2 nodes per token" in capsys.readouterr().out
    block = json.loads((out / "config.json").read_text())["occult"]
    assert block["max_nodes_per_token"] == 1 and block["num_nodes"] == 2
    assert (
        run_cli(
            "analyze",
            out,
            "--data",
            text_file,
            "--devices",
            4,
            "--nodes",
            2,
            "--json",
            "--max-tokens",
            500,
            "--seq-len",
            32,
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["node_comm_complexity"] == 1.0


def test_profile_reads_the_rows_spread_over_the_data(tmp_path, tiny_olmoe_dir):
    """A file stored source after source, cut at --max-tokens: the profile is the one of the rows in
    `spread_order` (both sources), not of the first rows in file order (the first source only)."""
    from transformers import AutoTokenizer

    from occult_ft.data import load_text_dataset, spread_rows
    from occult_ft.evaluation import data_batches
    from occult_ft.profiling import Profile, profile_model

    path = tmp_path / "two_sources.txt"
    prose = [f"It was the {i}th day of the long winter, and the road was white." for i in range(40)]
    code = [f"def f{i}(x):\n    return x * {i} + len(str(x))" for i in range(40)]
    path.write_text("\n\n".join(prose + code))
    out = tmp_path / "p.safetensors"
    args = ("--seq-len", 32, "--batch-size", 4, "--max-tokens", 300)
    assert run_cli("profile", tiny_olmoe_dir, "--data", path, "--out", out, *args) == 0
    got = Profile.load(str(out)).topk_ids()

    model = AutoModelForCausalLM.from_pretrained(tiny_olmoe_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_olmoe_dir)
    rows = load_text_dataset(str(path))

    def profile(data):
        batches = data_batches(tokenizer, data, 32, 4, 300, response_only=False)
        return profile_model(model, batches, max_tokens=300, progress=False).topk_ids()

    spread, in_order = profile(spread_rows(rows)), profile(rows)
    assert got.keys() == spread.keys()
    for layer, ids in got.items():
        assert torch.equal(ids, spread[layer])
    assert any(not torch.equal(spread[layer], in_order[layer]) for layer in spread)
