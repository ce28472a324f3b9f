"""`occult_ft.fileio`: outputs that lose nothing (the output-path check, the directory swap killed at
every step), artifact permissions that follow the umask, and the one `could not read FILE` wrapper."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import occult_ft.fileio as fileio
from occult_ft.fileio import (
    WRITTEN,
    OutputPathError,
    ReadError,
    atomic_directory,
    atomic_save,
    atomic_write_text,
    check_output_path,
    foreign_entries,
    is_artifact,
    load_safetensors,
    model_card_writer,
    read_json_object,
    read_text,
    recover_directory,
    torch_load,
)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _tree(path) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full).read()
    return out


def _write_artifact(path, version: str) -> None:
    """A tiny occult_ft-looking checkpoint holding `version` in every file."""
    with atomic_directory(path) as tmp:
        for name in ("config.json", "model.safetensors", "occult_similarity.safetensors"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(json.dumps({"occult": version}) if name == "config.json" else version)


# ---- permissions: what a plain open() / mkdir gives ------------------------------------------------
def test_artifacts_get_the_permissions_of_a_plain_open_and_mkdir(tmp_path):
    mask = _umask()
    atomic_write_text(tmp_path / "placement.json", "{}")
    atomic_save(tmp_path / "profile.safetensors", lambda tmp: open(tmp, "w").write("x"))
    _write_artifact(tmp_path / "ckpt", "v1")
    open(tmp_path / "plain.txt", "w").close()
    os.mkdir(tmp_path / "plain")
    assert _mode(tmp_path / "placement.json") == _mode(tmp_path / "plain.txt") == 0o666 & ~mask
    assert _mode(tmp_path / "profile.safetensors") == 0o666 & ~mask
    assert _mode(tmp_path / "ckpt") == _mode(tmp_path / "plain") == 0o777 & ~mask
    assert _mode(tmp_path / "ckpt" / "config.json") == 0o666 & ~mask


def test_a_rewritten_file_and_directory_keep_the_mode_their_owner_gave_them(tmp_path):
    path = tmp_path / "placement.json"
    atomic_write_text(path, "old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert _mode(path) == 0o640 and path.read_text() == "new"
    _write_artifact(tmp_path / "ckpt", "v1")
    os.chmod(tmp_path / "ckpt", 0o750)
    _write_artifact(tmp_path / "ckpt", "v2")
    assert _mode(tmp_path / "ckpt") == 0o750


def test_save_pruned_writes_world_readable_weights_card_and_similarity(tmp_path, tiny_olmoe_dir):
    from transformers import AutoModelForCausalLM

    from occult_ft import apply_occult, resolve_placement, save_pruned
    from occult_ft.routing import PruningConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_olmoe_dir)
    tables = {layer: torch.eye(8) for layer in range(2)}
    apply_occult(model, resolve_placement("sequential", model, 4), PruningConfig(4, 2, "similarity"), tables)
    out = tmp_path / "pruned"
    save_pruned(model, str(out))
    mask = _umask()
    assert {"model.safetensors", "occult_similarity.tables", "README.md"} <= set(os.listdir(out))
    assert _mode(out) == 0o777 & ~mask
    for name in os.listdir(out):
        assert _mode(out / name) == 0o666 & ~mask, name
    assert is_artifact(out)
    model.save_pretrained(tmp_path / "own")  # the model's own save (attach_occult_save), not a swap
    for name in os.listdir(tmp_path / "own"):
        assert _mode(tmp_path / "own" / name) == 0o666 & ~mask, name


# ---- where outputs may go ---------------------------------------------------------------------------
def test_a_directory_of_user_files_is_never_replaced(tmp_path):
    user = tmp_path / "project"
    (user / "src").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (user / "src" / "main.py").write_text("print(1)")
    before = _tree(user)
    with pytest.raises(OutputPathError, match=r"holds files occult_ft did not write \(notes.txt, src/\)"):
        with atomic_directory(user):
            raise AssertionError("the body must not run")
    assert _tree(user) == before
    assert sorted(os.listdir(tmp_path)) == ["project"]


def test_a_model_directory_of_someone_else_is_not_replaced(tmp_path):
    theirs = tmp_path / "their-model"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"model_type": "olmoe"}')
    (theirs / "model.safetensors").write_text("weights")
    assert foreign_entries(theirs) == [] and not is_artifact(theirs)
    with pytest.raises(OutputPathError, match="model directory occult_ft did not write"):
        check_output_path(theirs, directory=True)


def test_a_user_readme_inside_a_checkpoint_makes_it_foreign(tmp_path):
    _write_artifact(tmp_path / "ckpt", "v1")
    assert is_artifact(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "README.md").write_text("# my notes on this run\n")
    assert foreign_entries(tmp_path / "ckpt") == ["README.md"]
    with pytest.raises(OutputPathError, match=r"\(README.md\)"):
        _write_artifact(tmp_path / "ckpt", "v2")
    (tmp_path / "ckpt" / "README.md").write_text("---\ntags:\n- moe\n- occult\n---\n# card\n")
    _write_artifact(tmp_path / "ckpt", "v2")  # an occult_ft card may be replaced


def test_a_training_output_and_its_checkpoints_are_recognised(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-10").mkdir(parents=True)
    for name in ("trainer_state.json", "optimizer.pt", "rng_state.pth", "config.json"):
        (out / "checkpoint-10" / name).write_text("{}")
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1").write_text("log")
    assert is_artifact(out)
    check_output_path(out, directory=True)
    (out / "checkpoint-10" / "my_eval.ipynb").write_text("{}")
    assert foreign_entries(out) == ["checkpoint-10/my_eval.ipynb"]
    with pytest.raises(OutputPathError, match="checkpoint-10/my_eval.ipynb"):
        check_output_path(out, directory=True, what="output_dir")


@pytest.mark.parametrize("out", ["", "   ", None])
def test_an_empty_output_path_is_refused(out):
    with pytest.raises(OutputPathError, match="is empty; pass the directory"):
        check_output_path(out, what="--out", directory=True)
    with pytest.raises(OutputPathError, match="is empty; pass the file"):
        check_output_path(out, what="--out")


def test_the_working_directory_is_never_replaced_even_when_empty(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for out in (".", str(work), str(tmp_path)):
        with pytest.raises(OutputPathError, match="is the working directory or holds it"):
            check_output_path(out, what="--out", directory=True)
    check_output_path("sub", what="--out", directory=True)  # a new folder inside it is fine


def test_file_and_directory_outputs_of_the_wrong_kind_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="is a directory; pass a file path"):
        check_output_path(tmp_path / "d", what="--out")
    with pytest.raises(OutputPathError, match="is a file; pass a directory path"):
        check_output_path(tmp_path / "f", what="--out", directory=True)
    check_output_path(tmp_path / "d", what="--out", directory=True)  # empty: fine
    check_output_path(tmp_path / "new", what="--out", directory=True)


# ---- who owns what: one table for every writer of a run ------------------------------------------------
PEFT_CARD = "---\nbase_model: base\nlibrary_name: peft\ntags:\n- lora\n---\n\n# Model Card for Model ID\n"
OCCULT_CARD = "---\nlibrary_name: peft\ntags:\n- moe\n- occult\n---\n\n# Occult adapter\n"
_CHECKPOINT = {  # what every checkpoint-N of a run can hold, whoever wrote it
    "config.json": "{}", "generation_config.json": "{}", "model-00001-of-00002.safetensors": "",
    "model-00002-of-00002.safetensors": "", "model.safetensors.index.json": "{}",
    "pytorch_model.bin": "", "pytorch_model.bin.index.json": "{}",
    "tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
    "added_tokens.json": "{}", "vocab.json": "{}", "merges.txt": "", "tokenizer.model": "", "vocab.txt": "",
    "cl100k.tiktoken": "", "chat_template.jinja": "", "chat_template.json": "{}",
    "additional_chat_templates/tool.jinja": "", "processor_config.json": "{}",
    "preprocessor_config.json": "{}", "modeling_deepseek.py": "", "configuration_deepseek.py": "",
    "tokenization_deepseek.py": "",
    "adapter_config.json": "{}", "adapter_model.safetensors": "", "adapter_model.bin": "", "README.md": PEFT_CARD,
    "occult_config.json": "{}", "occult_similarity.tables": "", "occult_similarity.safetensors": "", "occult_pruned_routing.py": "",
    "optimizer_expert_shard_1_of_2.pt": "",
    "training_args.bin": "", "trainer_state.json": "{}", "optimizer.pt": "", "optimizer.bin": "",
    "optimizer_1.bin": "", "scheduler.pt": "", "scaler.pt": "", "rng_state_0.pth": "", "rng_state_1.pth": "",
    "pytorch_model_fsdp_0/__0_0.distcp": "", "optimizer_0/__0_0.distcp": "", "pytorch_model_fsdp.bin": "",
    "global_step4/mp_rank_00_model_states.pt": "", "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": "",
    "latest": "global_step4", "zero_to_fp32.py": "", "zero_to_torch.py": "",
}  # fmt: skip
#: a run's output_dir as all its writers leave it (a LoRA run under DeepSpeed on 2 processes, logged to
#: TensorBoard, with a full model beside to cover both kinds of result)
RUN_LAYOUT = {
    **_CHECKPOINT,
    **{f"checkpoint-4/{k}": v for k, v in _CHECKPOINT.items()},
    "checkpoint-2/adapter_config.json": "{}",
    "checkpoint-2/README.md": PEFT_CARD,
    "checkpoint-2/trainer_state.json": "{}",
    "README.md": OCCULT_CARD,
    "rng_state.pth": "",
    "comm_complexity.png": "",
    "all_results.json": "{}",
    "train_results.json": "{}",
    "eval_results.json": "{}",
    "runs/Dec02_07-00-00_host/events.out.tfevents.1.host": "",
}


def _lay_out(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_every_entry_a_run_writes_is_the_runs(tmp_path):
    """One entry per row of `WRITTEN` at least (checked), in a checkpoint folder and at the top."""
    _lay_out(tmp_path / "run", RUN_LAYOUT)
    names = {part for rel in RUN_LAYOUT for part in rel.split("/")[:-1] + [rel.split("/")[-1]]}
    unused = [row.pattern for row in WRITTEN if not any(re.fullmatch(row.pattern, n) for n in names)]
    assert unused == [], f"rows of WRITTEN without an example here: {unused}"
    assert foreign_entries(tmp_path / "run") == [] and is_artifact(tmp_path / "run")
    check_output_path(tmp_path / "run", what="output_dir", directory=True, replace=False)
    check_output_path(tmp_path / "run", what="--out", directory=True)  # replaced whole: fine too


#: (files laid into a run's output_dir, what is foreign, whether a run writing into it is refused)
USER_FILES = {
    "a README of the user's at the top": ({"README.md": "# my notes\n"}, ["README.md"], True),
    "a README with front matter that no writer wrote": (
        {"README.md": "---\ntitle: mine\n---\n# notes\n"}, ["README.md"], True),
    "PEFT's card without an adapter beside it": ({"README.md": PEFT_CARD}, ["README.md"], True),
    "a README of the user's in a checkpoint": (
        {"checkpoint-1/README.md": "# what I saw\n"}, ["checkpoint-1/README.md"], True),
    "notes in a checkpoint": ({"checkpoint-1/notes.txt": "x"}, ["checkpoint-1/notes.txt"], True),
    "logs inside a checkpoint": ({"checkpoint-1/runs/x": ""}, ["checkpoint-1/runs/"], True),
    "a checkpoint inside a checkpoint": ({"checkpoint-1/checkpoint-2/x": ""}, ["checkpoint-1/checkpoint-2/"], True),
    "a folder at a file's name": ({"config.json/x": ""}, ["config.json/"], True),
    "a file at DeepSpeed's folder name": ({"checkpoint-1/global_step3": ""}, ["checkpoint-1/global_step3"], True),
    "a folder named like a checkpoint": ({"checkpoint-final/x": ""}, ["checkpoint-final/"], False),
    "an unrelated folder": ({"notes/plan.md": "", "ds_config.json": "{}"}, ["ds_config.json", "notes/"], False),
}  # fmt: skip


@pytest.mark.parametrize("case", USER_FILES)
def test_a_users_file_is_still_the_users(tmp_path, case):
    files, foreign, refused = USER_FILES[case]
    run = tmp_path / "run"
    _lay_out(run, {"trainer_state.json": "{}", "checkpoint-1/trainer_state.json": "{}", **files})
    assert foreign_entries(run) == foreign
    before = _tree(run)
    with pytest.raises(OutputPathError, match="holds files occult_ft did not write"):
        check_output_path(run, what="--out", directory=True)  # replacing it would lose them
    if refused:  # the run would write over them
        with pytest.raises(OutputPathError, match=r"holds files of yours that training would overwrite"):
            check_output_path(run, what="output_dir", directory=True, replace=False)
    else:  # training leaves them alone
        check_output_path(run, what="output_dir", directory=True, replace=False)
    assert _tree(run) == before


def test_the_cards_peft_writes_are_recognised_as_peft_s(tmp_path):
    """The real PEFT card, written fresh and written over an occult_ft card (a LoRA run's final save
    writes PEFT's card first, then occult_ft's)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(target_modules=["0"], r=2))
    model.save_pretrained(tmp_path / "fresh")
    assert model_card_writer(tmp_path / "fresh" / "README.md") == "PEFT"
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "README.md").write_text(OCCULT_CARD)
    model.save_pretrained(tmp_path / "final")
    assert model_card_writer(tmp_path / "final" / "README.md") in ("PEFT", "occult_ft")
    for folder in ("fresh", "final"):
        (tmp_path / folder / "occult_config.json").write_text("{}")
        assert foreign_entries(tmp_path / folder) == [] and is_artifact(tmp_path / folder)
    (tmp_path / "fresh" / "adapter_config.json").unlink()  # a PEFT card alone is not PEFT's doing
    assert foreign_entries(tmp_path / "fresh") == ["README.md"]
    assert model_card_writer(tmp_path / "fresh" / "adapter_model.safetensors") is None


# ---- the directory swap, killed at every step -------------------------------------------------------
_KILLER = textwrap.dedent(
    """
    import ctypes, errno, json, os, shutil, signal, sys
    import occult_ft.fileio as fileio

    target, step, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    calls = {"n": 0}

    def tick():
        calls["n"] += 1
        if calls["n"] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    real_replace, real_remove, real_exchange = os.replace, os.remove, fileio._exchange_directories

    def replace(a, b):
        real_replace(a, b)
        tick()

    def remove(path, *args, **kwargs):  # shutil.rmtree removes file by file: die after the first
        real_remove(path, *args, **kwargs)
        tick()

    def exchange(a, b):
        done = real_exchange(a, b)
        if done:
            tick()
        return done

    if path == "journal":  # a filesystem that refuses RENAME_EXCHANGE: renameat2 answers EINVAL
        def refused(a, b, flags):
            ctypes.set_errno(errno.EINVAL)
            return -1

        fileio._renameat2 = lambda: refused
    os.replace = replace
    os.remove = os.unlink = remove
    fileio._exchange_directories = exchange
    with fileio.atomic_directory(target) as tmp:
        tick()  # step 1: the new copy is half written
        for name in ("config.json", "model.safetensors", "occult_similarity.safetensors"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(json.dumps({"occult": "new"}) if name == "config.json" else "new")
    print("finished", calls["n"])
    """
)


def _version(path) -> str:
    tree = _tree(path)
    assert sorted(tree) == ["config.json", "model.safetensors", "occult_similarity.safetensors"], tree
    values = {json.loads(v)["occult"] if k == "config.json" else v for k, v in tree.items()}
    assert len(values) == 1, f"a mix of two artifacts: {tree}"
    return values.pop()


def _can_exchange(tmp_path) -> bool:
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    (tmp_path / "probe-a" / "a").write_text("")
    done = fileio._exchange_directories(str(tmp_path / "probe-a"), str(tmp_path / "probe-b"))
    assert done == (tmp_path / "probe-b" / "a").exists()  # exchanged, or nothing moved
    shutil.rmtree(tmp_path / "probe-a")
    shutil.rmtree(tmp_path / "probe-b")
    return done


#: steps of each swap at which the writer is killed: exchange 1 half-written copy, 2 exchanged (the old
#: copy at .tmp-*), 3 retired (.old), 4-6 .old half removed, 7-8 past the end; journal 1 half-written
#: copy, 2 .new complete, 3 old retired (the target missing), 4 new in place, 5-7 .old half removed, 8 past
#: the end
SWAPS = [("exchange", step) for step in range(1, 9)] + [("journal", step) for step in range(1, 9)]


@pytest.mark.parametrize("path, step", SWAPS)
def test_a_swap_killed_at_any_step_leaves_the_old_or_the_new_artifact(tmp_path, path, step):
    if path == "exchange" and not _can_exchange(tmp_path):
        pytest.skip("this filesystem or kernel cannot exchange directories (renameat2 RENAME_EXCHANGE)")
    target = tmp_path / "ckpt"
    _write_artifact(target, "old")
    done = subprocess.run(
        [sys.executable, "-c", _KILLER, str(target), str(step), path], capture_output=True, text=True
    )
    killed = done.returncode == -signal.SIGKILL
    assert killed or (done.returncode == 0 and "finished" in done.stdout), done.stderr
    expected = "old" if step <= 1 else "new"
    if path == "exchange":  # no recovery needed: the target is whole at every instant, for any reader
        assert _version(target) == expected
        if step == 2:  # killed right after the exchange: the old copy sits in the unfinished write
            (old,) = [n for n in os.listdir(tmp_path) if n != "ckpt"]
            assert ".tmp-" in old and _version(tmp_path / old) == "old"
    elif step == 3:  # the journal's missing moment, which the next reader or write finishes
        assert not target.exists() and (tmp_path / ".ckpt.new").is_dir()
    recover_directory(target)  # what a reader (occult_ft.from_pretrained, the next write) does first
    assert _version(target) == expected
    left = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(".tmp-" in n for n in left), left  # only an unfinished write, which the next one removes
    _write_artifact(target, "next")
    assert _version(target) == "next" and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("libc_wrapper", [True, False], ids=["libc", "syscall"])
def test_renameat2_exchanges_through_libc_or_the_system_call(tmp_path, libc_wrapper):
    call = fileio._renameat2(libc_wrapper)
    if call is None or not _can_exchange(tmp_path):
        pytest.skip("no renameat2 RENAME_EXCHANGE here")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"in-{name}").write_text(name)
    a, b = os.fsencode(tmp_path / "a"), os.fsencode(tmp_path / "b")
    assert call(a, b, 2) == 0  # RENAME_EXCHANGE
    assert os.listdir(tmp_path / "a") == ["in-b"] and os.listdir(tmp_path / "b") == ["in-a"]
    assert call(a, b, 1 | 2) == -1 and ctypes.get_errno() == errno.EINVAL  # NOREPLACE with EXCHANGE
    assert fileio._exchange_directories(str(tmp_path / "a"), str(tmp_path / "missing")) is False
    assert os.listdir(tmp_path / "a") == ["in-b"]  # nothing moved: the journal takes over


_KILLED_AFTER_THE_EXCHANGE = textwrap.dedent(
    """
    import os, signal, sys
    import occult_ft.fileio as fileio
    from occult_ft.cli import main

    real_exchange = fileio._exchange_directories

    def exchange(a, b):
        done = real_exchange(a, b)
        if done:  # the instant the previous swap had no target at all
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    fileio._exchange_directories = exchange
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_prune_out_killed_in_its_swap_leaves_a_model_stock_transformers_loads(tmp_path, tiny_olmoe_dir):
    """`prune --out DIR` over an earlier output, killed right after the exchange: with no occult_ft reader
    run since, DIR is the new pruned checkpoint for stock transformers."""
    from transformers import AutoModelForCausalLM

    from occult_ft.cli import main

    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem or kernel cannot exchange directories (renameat2 RENAME_EXCHANGE)")
    out = tmp_path / "pruned"
    argv = ["prune", tiny_olmoe_dir, "--placement", "sequential", "--devices", "4", "--out", str(out)]
    assert main(argv) == 0
    again = [*argv, "--max-devices-per-token", "1", "--criterion", "score"]
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_THE_EXCHANGE, *again], capture_output=True, text=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["occult"]["max_devices_per_token"] == 1
    model = AutoModelForCausalLM.from_pretrained(out)  # stock transformers, no recovery first
    assert model.config.model_type == "olmoe"
    (left,) = [n for n in os.listdir(tmp_path) if n != "pruned"]
    assert left.startswith(".pruned.tmp-")  # the previous output, removed by the next write
    assert main(again) == 0 and sorted(os.listdir(tmp_path)) == ["pruned"]


def test_a_swap_interrupted_by_an_earlier_release_gets_its_old_artifact_back(tmp_path):
    """The layout the previous swap left after kill -9 between its two renames: the target missing,
    the old copy in `.NAME.old-*`, the new one (never marked complete) in `.NAME.tmp-*`."""
    _write_artifact(tmp_path / "ckpt", "old")
    os.replace(tmp_path / "ckpt", tmp_path / ".ckpt.old-x1y2")
    (tmp_path / ".ckpt.tmp-a3b4").mkdir()
    (tmp_path / ".ckpt.tmp-a3b4" / "config.json").write_text('{"occult": "new"}')
    recover_directory(tmp_path / "ckpt")
    assert _version(tmp_path / "ckpt") == "old"
    _write_artifact(tmp_path / "ckpt", "new")
    assert _version(tmp_path / "ckpt") == "new" and os.listdir(tmp_path) == ["ckpt"]


def test_the_model_loader_finishes_an_interrupted_swap(tmp_path, tiny_olmoe_dir):
    import shutil

    from occult_ft import load_model_and_tokenizer

    shutil.copytree(tiny_olmoe_dir, tmp_path / ".m.new")  # complete; killed before it was renamed in
    model, _ = load_model_and_tokenizer(str(tmp_path / "m"))
    assert model.config.model_type == "olmoe" and sorted(os.listdir(tmp_path)) == ["m"]


# ---- reading: one line naming the file -----------------------------------------------------------------
def test_unreadable_files_are_one_line_naming_the_file(tmp_path):
    latin = tmp_path / "notes.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(
        ReadError,
        match=r"could not read .*notes.txt: it is not UTF-8 text \(byte 0xe9 at offset 3\); convert",
    ):
        read_text(latin)
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ReadError, match=r"bad.json: it is not valid JSON"):
        read_json_object(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ReadError, match=r"list.json: it holds a JSON list, not an object"):
        read_json_object(tmp_path / "list.json")
    with pytest.raises(ReadError, match=r"missing.json: it does not exist"):
        read_json_object(tmp_path / "missing.json")


def test_garbage_and_truncated_safetensors_name_the_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4096.0)}, tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "half.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.safetensors").write_bytes(os.urandom(256))
    assert torch.equal(load_safetensors(tmp_path / "full.safetensors")["w"], torch.arange(4096.0))
    for name in ("half", "garbage"):
        with pytest.raises(
            ReadError, match=rf"could not read .*{name}.safetensors: it is not a complete safetensors"
        ):
            load_safetensors(tmp_path / f"{name}.safetensors")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_holds_code_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"state": _Payload()}, tmp_path / "optimizer.pt")
    with pytest.raises(
        ReadError, match=r"optimizer.pt: it holds Python objects that are not tensors \(.*system"
    ):
        torch_load(tmp_path / "optimizer.pt")
    assert not (tmp_path / "PWNED").exists()
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(torch_load(tmp_path / "ok.pt")["w"], torch.ones(2))
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ReadError, match=r"cut.pt: it is not a complete torch file"):
        torch_load(tmp_path / "cut.pt")


def test_a_directory_written_into_keeps_the_users_other_files_but_not_colliding_ones(tmp_path):
    out = tmp_path / "run"
    (out / "runs" / "Dec01").mkdir(parents=True)  # TensorBoard logs of this run so far
    (out / "ds_config.json").write_text("{}")  # the user's: training writes no such name
    check_output_path(out, out / "ds_config.json", what="output_dir", directory=True, replace=False)
    with pytest.raises(OutputPathError, match="is not empty|holds files occult_ft did not write"):
        check_output_path(out, what="--out", directory=True)  # replacing it whole would lose it
    (out / "README.md").write_text("# mine\n")
    with pytest.raises(
        OutputPathError, match=r"holds files of yours that training would overwrite \(README.md\)"
    ):
        check_output_path(out, what="output_dir", directory=True, replace=False)
    (out / "README.md").unlink()
    (out / "config.json").write_text('{"model_type": "olmoe"}')  # someone else's model
    with pytest.raises(OutputPathError, match=r"holds a model occult_ft did not write \(config.json\)"):
        check_output_path(out, what="output_dir", directory=True, replace=False)
    (out / "trainer_state.json").write_text("{}")  # ... unless it is an earlier run's output
    check_output_path(out, what="output_dir", directory=True, replace=False)


def test_a_results_folder_holds_only_what_its_command_writes(tmp_path):
    """`occult-ft demo` / `study` write a fixed set of entries: a folder holding anything else is the
    user's and is refused before anything is written; a previous run's folder (and the temporary
    siblings its files went through) is written again."""
    from occult_ft.fileio import check_results_dir
    from occult_ft.studies.finetune import RESULTS_ENTRIES

    check_results_dir(tmp_path / "missing", RESULTS_ENTRIES)
    check_results_dir(tmp_path, RESULTS_ENTRIES)  # empty
    previous = tmp_path / "previous"
    for name in ("profile.safetensors", "placement-search.json", "demo_results.json", "months-train.jsonl"):
        (previous / name).parent.mkdir(exist_ok=True)
        (previous / name).write_text("x")
    for folder in ("model", "ft-2-score", "runs", ".model.old", ".profile.safetensors.tmp-ab12"):
        (previous / folder).mkdir()
    (previous / "study_months_results.json").write_text("{}")
    check_results_dir(previous, RESULTS_ENTRIES)

    user = tmp_path / "mine"
    user.mkdir()
    (user / "profile.safetensors").write_text("my profile")
    (user / "notes.txt").write_text("mine")
    (user / "src").mkdir()
    with pytest.raises(
        OutputPathError, match=r"output_dir '.*mine' holds files occult_ft did not write \(notes.txt, src/\)"
    ):
        check_results_dir(user, RESULTS_ENTRIES)
    assert (user / "profile.safetensors").read_text() == "my profile"
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(OutputPathError, match="is a file; pass a directory path"):
        check_results_dir(tmp_path / "a-file", RESULTS_ENTRIES)
    with pytest.raises(OutputPathError, match="output_dir is empty"):
        check_results_dir("", RESULTS_ENTRIES)


@pytest.mark.parametrize("command", [["demo"], ["study"], ["study", "--task", "months"]])
def test_the_demo_and_the_studies_refuse_a_folder_of_the_users_before_writing(tmp_path, command, capsys):
    from occult_ft.cli import main

    (tmp_path / "thesis.tex").write_text("mine")
    assert main([*command, "--output-dir", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds files occult_ft did not write (thesis.tex)" in err and str(tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]
