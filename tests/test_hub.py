"""Model cards and Hub pushes, offline: tiny real checkpoints, a fake Hub API that records what is sent."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from dist_utils import free_port
from transformers import AutoModelForCausalLM

from occult_ft import hub
from occult_ft.checkpoint import ADAPTER_OCCULT_FILE, save_pruned
from occult_ft.cli import main as cli_main
from occult_ft.models import tiny_config
from occult_ft.placement import Placement
from occult_ft.routing import PruningConfig

# 1x1 transparent PNG: the card only needs a file with the right name
PNG_BYTES = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000100e527de000000000049454e44ae426082"
)
GROUPS = [[0, 5], [1, 4], [2, 7], [3, 6]]  # device d holds these original experts (E=8, D=4)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def endpoint_up(monkeypatch):
    """HF_ENDPOINT pointing at a local HTTP server that answers (what `check_endpoint` asks for), offline
    mode off; `endpoint_up.requests` counts the requests it got."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests = []

    class Answer(BaseHTTPRequestHandler):
        def do_HEAD(self):
            requests.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)

    class Endpoint(str):
        pass

    endpoint = Endpoint(os.environ["HF_ENDPOINT"])
    endpoint.requests = requests  # type: ignore[attr-defined]
    yield endpoint
    server.shutdown()


@pytest.fixture
def endpoint_down(monkeypatch):
    """HF_ENDPOINT pointing at a local port nothing listens on (connection refused at once)."""
    port = free_port()  # outside the ephemeral range: no client socket of another test lands on it
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    return os.environ["HF_ENDPOINT"]


def tree(path) -> dict[str, bytes]:
    """Every file under `path` with its content: a push, a dry run or a failed push must leave it equal."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


class FakeHubApi:
    """Records create_repo / upload_folder and the files upload_folder would send (README included)."""

    def __init__(self):
        self.create_calls, self.upload_calls = [], []

    def create_repo(self, repo_id, *, private=None, exist_ok=False, token=None, **kwargs):
        self.create_calls.append(dict(repo_id=repo_id, private=private, exist_ok=exist_ok, token=token))
        return SimpleNamespace(url=f"https://huggingface.co/{repo_id}")

    def upload_folder(
        self, *, repo_id, folder_path, commit_message=None, ignore_patterns=None, token=None, **kwargs
    ):
        files = hub.upload_file_list(folder_path, ignore_patterns or [])
        with open(os.path.join(folder_path, "README.md")) as f:
            readme = f.read()
        self.upload_calls.append(
            dict(
                repo_id=repo_id,
                folder_path=folder_path,
                commit_message=commit_message,
                token=token,
                files=files,
                readme=readme,
            )
        )
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123")


def _save_olmoe(out_dir, pruning=None, placement=True, extra=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe"))
    place = None
    if placement:
        place = Placement(
            model="allenai/OLMoE-1B-7B-0924",
            model_type="olmoe",
            num_experts=8,
            num_devices=4,
            num_nodes=1,
            algorithm="search",
            groups={0: GROUPS, 1: GROUPS},
        )
    save_pruned(model, str(out_dir), pruning=pruning, placement=place, extra=extra)
    return str(out_dir)


@pytest.fixture(scope="module")
def pruned_dir(tmp_path_factory):
    """OLMoE-shaped (E=8, k=2), placed on D=4, budget M=2, similarity criterion, measured numbers."""
    pruning = PruningConfig(
        num_devices=4, max_devices_per_token=2, criterion="similarity", gate_weights="preserve_mass"
    )
    extra = {
        "base_model": "allenai/OLMoE-1B-7B-0924",
        "dataset": "tatsu-lab/alpaca",
        "comm_complexity_before": 1.8125,
        "comm_complexity_after": 1.4375,
        "eval": {"eval_loss": 2.75},
        "train_mode": "moe",
    }
    return _save_olmoe(tmp_path_factory.mktemp("pruned"), pruning=pruning, extra=extra)


@pytest.fixture(scope="module")
def placed_dir(tmp_path_factory):
    """Placement only (no budget): the same function as the base model."""
    return _save_olmoe(tmp_path_factory.mktemp("placed"), extra={"base_model": "allenai/OLMoE-1B-7B-0924"})


@pytest.fixture
def adapter_dir(tmp_path):
    """A LoRA adapter directory as OccultTrainer writes it (the weights file content is irrelevant)."""
    adapter = {
        "base_model_name_or_path": "allenai/OLMoE-1B-7B-0924",
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "modules_to_save": ["mlp.gate"],
    }
    block = {
        "version": 1,
        "placed": False,
        "num_devices": 4,
        "num_nodes": 1,
        "max_devices_per_token": 1,
        "criterion": "score",
        "gate_weights": "model",
        "placement": {"algorithm": "occult", "layers": {"0": GROUPS, "1": GROUPS}},
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    (tmp_path / ADAPTER_OCCULT_FILE).write_text(json.dumps(block))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return str(tmp_path)


# ---- cards ------------------------------------------------------------------------------------
def test_card_metadata_of_a_pruned_checkpoint(pruned_dir):
    card = hub.build_model_card(pruned_dir, repo_id="me/olmoe-occult")
    assert card.data.base_model == "allenai/OLMoE-1B-7B-0924"
    assert card.data.library_name == "transformers"
    assert card.data.license == "apache-2.0"  # known license of the base model
    assert card.data.datasets == ["tatsu-lab/alpaca"]
    assert {"moe", "occult", "expert-parallelism", "olmoe", "collaboration-pruning"} <= set(card.data.tags)


def test_card_body_records_placement_budget_and_criterion(pruned_dir):
    text = hub.build_model_card(pruned_dir, repo_id="me/olmoe-occult").text
    for row in (
        "| placement algorithm | search |",
        "| devices (D) | 4 |",
        "| nodes | 1 |",
        "| experts per device (E/D) | 2 |",
        "| max_devices_per_token (M) | 2 |",
        "| criterion | similarity |",
        "| gate weights | preserve_mass |",
        "| routed experts per layer (E) | 8 |",
        "| experts per token (k) | 2 |",
        "| train_mode | moe |",
    ):
        assert row in text, row
    assert "at most 2 of the 4 devices" in text


def test_card_reports_measured_and_reference_comm_complexity(pruned_dir):
    text = hub.build_model_card(pruned_dir).text
    assert "| before Occult (measured) | 1.812 |" in text  # 4 significant digits
    assert "| after placement / pruning (measured) | 1.438 |" in text
    # E=8, k=2, D=4: per-expert dispatch sends k=2 rows; random placement 4 * (1 - C(6,2)/C(8,2))
    # = 4 * 13/28 = 1.857; lower bound ceil(2*4/8) = 1; the budget caps C_T at min(M, k, D) = 2.
    assert "| per-expert dispatch (rows per token) | 2 |" in text
    assert "| random placement, uniform routing | 1.857 |" in text
    assert "| lower bound ceil(k*D/E) | 1 |" in text
    assert "| upper bound with the budget | 2 |" in text


def test_card_eval_results_merge_block_eval_and_argument(pruned_dir):
    text = hub.build_model_card(pruned_dir, eval_results={"eval_accuracy": 0.5}).text
    assert "## Evaluation" in text
    assert "| eval_loss | 2.75 |" in text and "| eval_accuracy | 0.5 |" in text


def test_card_reads_eval_results_json_when_none_given(tmp_path):
    path = _save_olmoe(tmp_path, placement=False)
    (tmp_path / "eval_results.json").write_text(json.dumps({"eval_loss": 3.25, "epoch": 1.0}))
    assert "| eval_loss | 3.25 |" in hub.build_model_card(path).text


def test_pruned_card_loads_with_occult_ft_and_warns_about_plain_transformers(pruned_dir):
    text = hub.build_model_card(pruned_dir, repo_id="me/olmoe-occult").text
    assert 'occult_ft.from_pretrained("me/olmoe-occult")' in text
    assert "routes with the original top-k" in text
    assert "Luo" in text and "2505.13345" in text and "ICML" in text


def test_placed_card_offers_plain_transformers(placed_dir):
    card = hub.build_model_card(placed_dir, repo_id="me/olmoe-placed")
    assert 'AutoModelForCausalLM.from_pretrained("me/olmoe-placed")' in card.text
    assert 'occult_ft.from_pretrained("me/olmoe-placed")' in card.text
    assert "| max_devices_per_token (M) | none (routing unchanged) |" in card.text
    assert "collaboration-pruning" not in card.data.tags


def test_native_group_routing_card_offers_plain_transformers(tmp_path):
    """DeepSeek-V2 with device_max: the budget is written as n_group / topk_group in config.json."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v2"))
    save_pruned(
        model,
        str(tmp_path),
        pruning=PruningConfig(num_devices=4, max_devices_per_token=2, criterion="device_max"),
    )
    summary = hub.describe_checkpoint(tmp_path)
    assert summary.native_routing and summary.pruned and not summary.needs_occult_ft
    text = hub.build_model_card(tmp_path, repo_id="me/dsv2").text
    assert 'AutoModelForCausalLM.from_pretrained("me/dsv2")' in text
    assert "n_group=4, topk_group=2" in text


def test_adapter_card(adapter_dir):
    card = hub.build_model_card(adapter_dir, repo_id="me/olmoe-lora")
    assert card.data.library_name == "peft"
    assert card.data.base_model == "allenai/OLMoE-1B-7B-0924"
    assert {"lora", "peft", "occult"} <= set(card.data.tags)
    text = card.text
    # occult_ft.from_pretrained downloads the repo itself (the adapter and the placement are local files)
    assert 'occult_ft.from_pretrained("me/olmoe-lora")' in text and "snapshot_download" not in text
    assert "| placement algorithm | occult |" in text and "| max_devices_per_token (M) | 1 |" in text
    assert "| r | 8 |" in text and "| lora_alpha | 16 |" in text
    assert "permutes them with the placement" in text


def test_local_base_model_path_is_not_hub_metadata(tmp_path):
    path = _save_olmoe(tmp_path / "ckpt", placement=False, extra={"base_model": str(tmp_path)})
    card = hub.build_model_card(path)
    assert card.data.base_model is None
    assert str(tmp_path) not in card.text  # an absolute path of the training machine means nothing here
    assert f"`{tmp_path.name}`" in card.text  # the folder's name does


def test_the_embedded_base_model_is_named_embedded(tmp_path):
    from occult_ft.embedded import embedded_model_path

    path = _save_olmoe(tmp_path / "ckpt", placement=False, extra={"base_model": embedded_model_path()})
    text = hub.build_model_card(path).text
    assert "`embedded`" in text and embedded_model_path() not in text


def test_figure_outside_the_folder_is_referenced_by_name(pruned_dir, tmp_path):
    figure = tmp_path / "comm.png"
    figure.write_bytes(PNG_BYTES)
    assert "![occult_ft figure](comm.png)" in hub.build_model_card(pruned_dir, figure=figure).text


@pytest.mark.parametrize(
    "name, content, match", [("plot.jpg", PNG_BYTES, "not a .png"), ("missing.png", None, "does not exist")]
)
def test_bad_figure_is_a_one_line_error(pruned_dir, tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=match):
        hub.build_model_card(pruned_dir, figure=tmp_path / name)


def test_missing_dir_and_non_checkpoint_dir_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as missing:
        hub.build_model_card(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a checkpoint") as empty:
        hub.build_model_card(tmp_path)
    assert "\n" not in str(missing.value) and "\n" not in str(empty.value)


# ---- pushing ----------------------------------------------------------------------------------
def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_push_creates_repo_and_uploads_folder_with_card(pruned_dir, tmp_path):
    path = _copy_checkpoint(pruned_dir, tmp_path / "ckpt")
    os.makedirs(os.path.join(path, "checkpoint-10"))
    open(os.path.join(path, "checkpoint-10", "optimizer.pt"), "wb").close()
    figure = tmp_path / "fig.png"
    figure.write_bytes(PNG_BYTES)
    api = FakeHubApi()
    url = hub.push_checkpoint(
        path, "me/olmoe-occult", private=True, token="hf_x", commit_message="first", figure=figure, api=api
    )
    assert url == "https://huggingface.co/me/olmoe-occult/commit/abc123"
    assert api.create_calls == [dict(repo_id="me/olmoe-occult", private=True, exist_ok=True, token="hf_x")]
    (upload,) = api.upload_calls
    assert (
        upload["repo_id"] == "me/olmoe-occult"
        and upload["commit_message"] == "first"
        and upload["token"] == "hf_x"
    )
    assert {"README.md", "config.json", "model.safetensors", "fig.png"} <= set(upload["files"])
    assert not any(f.startswith("checkpoint-") for f in upload["files"])
    readme = upload["readme"]
    assert readme.startswith("---\n") and "base_model: allenai/OLMoE-1B-7B-0924" in readme
    assert "| max_devices_per_token (M) | 2 |" in readme and "![occult_ft figure](fig.png)" in readme
    assert 'occult_ft.from_pretrained("me/olmoe-occult")' in readme


def test_push_adapter_dir(adapter_dir):
    api = FakeHubApi()
    hub.push_checkpoint(adapter_dir, "me/olmoe-lora", api=api)
    (upload,) = api.upload_calls
    assert {"README.md", "adapter_config.json", ADAPTER_OCCULT_FILE, "adapter_model.safetensors"} <= set(
        upload["files"]
    )
    assert "library_name: peft" in upload["readme"]
    assert api.create_calls[0]["private"] is False


def test_push_through_patched_hfapi_methods(placed_dir, tmp_path, monkeypatch, endpoint_up):
    """The default path builds a real HfApi; only its two network methods are replaced."""
    from huggingface_hub import HfApi

    fake = FakeHubApi()
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: fake.create_repo(repo_id, **kw))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: fake.upload_folder(**kw))
    path = _copy_checkpoint(placed_dir, tmp_path / "ckpt")
    url = hub.push_checkpoint(path, "me/olmoe-placed")
    assert url.endswith("/commit/abc123")
    assert fake.create_calls[0]["exist_ok"] is True and "README.md" in fake.upload_calls[0]["files"]


@pytest.mark.parametrize("repo_id", ["", "a b/c", "too/many/parts", "-bad/name"])
def test_bad_repo_id_fails_before_anything_is_written(placed_dir, tmp_path, repo_id):
    path = _copy_checkpoint(placed_dir, tmp_path / "ckpt")
    api = FakeHubApi()
    before = tree(path)
    with pytest.raises(ValueError, match="repo id") as err:
        hub.push_checkpoint(path, repo_id, api=api)
    assert "\n" not in str(err.value)
    assert not api.create_calls and tree(path) == before


def test_push_of_a_non_checkpoint_uploads_nothing(tmp_path):
    api = FakeHubApi()
    with pytest.raises(ValueError, match="not a checkpoint"):
        hub.push_checkpoint(tmp_path, "me/x", api=api)
    assert not api.create_calls and not api.upload_calls


def test_push_after_training_reads_trainer_args_and_last_eval(placed_dir, tmp_path):
    path = _copy_checkpoint(placed_dir, tmp_path / "run")
    args = SimpleNamespace(output_dir=path, hub_model_id="me/run", hub_private_repo=True, hub_token="hf_t")
    state = SimpleNamespace(log_history=[{"eval_loss": 4.0}, {"loss": 3.0}, {"eval_loss": 2.5, "epoch": 1.0}])
    trainer = SimpleNamespace(args=args, state=state, is_world_process_zero=lambda: True)
    api = FakeHubApi()
    hub.push_after_training(trainer, api=api)
    assert api.create_calls == [dict(repo_id="me/run", private=True, exist_ok=True, token="hf_t")]
    (upload,) = api.upload_calls
    assert upload["commit_message"] == "End of training"
    assert "| eval_loss | 2.5 |" in upload["readme"]  # the last evaluation, not the first


def test_push_after_training_only_on_the_main_process(placed_dir):
    args = SimpleNamespace(
        output_dir=placed_dir, hub_model_id="me/run", hub_private_repo=None, hub_token=None
    )
    trainer = SimpleNamespace(args=args, state=None, is_world_process_zero=lambda: False)
    api = FakeHubApi()
    assert hub.push_after_training(trainer, api=api) is None
    assert not api.create_calls


def test_push_after_training_from_a_directory_defaults_repo_to_its_name(placed_dir, tmp_path):
    path = _copy_checkpoint(placed_dir, tmp_path / "olmoe-run")
    api = FakeHubApi()
    hub.push_after_training(path, api=api)
    assert api.create_calls[0]["repo_id"] == "olmoe-run" and api.create_calls[0]["private"] is False


# ---- the command --------------------------------------------------------------------------------
def test_cli_dry_run_lists_files_and_prints_the_card_writing_nothing(placed_dir, tmp_path, capsys):
    path = _copy_checkpoint(placed_dir, tmp_path / "ckpt")
    before = tree(path)
    assert cli_main(["push", path, "--repo-id", "me/olmoe-placed", "--dry-run", "--no-figure"]) == 0
    out = capsys.readouterr().out
    assert "would upload" in out and "  README.md" in out and "  config.json" in out
    assert 'occult_ft.from_pretrained("me/olmoe-placed")' in out  # the card itself
    assert tree(path) == before


def test_cli_push_uses_the_hub_api(placed_dir, tmp_path, monkeypatch, capsys, endpoint_up):
    from huggingface_hub import HfApi

    fake = FakeHubApi()
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: fake.create_repo(repo_id, **kw))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: fake.upload_folder(**kw))
    path = _copy_checkpoint(placed_dir, tmp_path / "ckpt")
    rc = cli_main(
        ["push", path, "--repo-id", "me/p", "--private", "--token", "hf_c", "--message", "m1", "--no-figure"]
    )
    assert rc == 0 and "commit/abc123" in capsys.readouterr().out
    assert fake.create_calls[0]["private"] is True and fake.create_calls[0]["token"] == "hf_c"
    assert fake.upload_calls[0]["commit_message"] == "m1"


def test_cli_push_embeds_the_measured_comm_complexity_figure(tiny_olmoe_dir, tmp_path, capsys):
    out = tmp_path / "pruned"
    assert (
        cli_main(
            [
                "prune",
                tiny_olmoe_dir,
                "--placement",
                "sequential",
                "--devices",
                "4",
                "--max-devices-per-token",
                "1",
                "--criterion",
                "score",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    before = tree(out)
    assert cli_main(["push", str(out), "--repo-id", "me/p", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert f"  {hub.FIGURE_NAME}" in printed and f"![occult_ft figure]({hub.FIGURE_NAME})" in printed
    assert tree(out) == before  # the figure and the card went into the staged copy only
    staged = {}
    real_upload = FakeHubApi.upload_folder

    def upload(self, **kw):
        staged.update(tree(kw["folder_path"]))
        return real_upload(self, **kw)

    api = FakeHubApi()
    api.upload_folder = upload.__get__(api)
    hub.push_checkpoint(str(out), "me/p", figure=hub.card_figure(str(out), tmp_path), api=api)
    assert len(staged[hub.FIGURE_NAME]) > 1000 and tree(out) == before


@pytest.mark.parametrize(
    "argv_tail, match",
    [
        (["/no/such/dir", "--repo-id", "me/x"], "does not exist"),
        (["{tmp}", "--repo-id", "a b"], "not a valid Hub repo id"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, argv_tail, match):
    argv = ["push"] + [a.replace("{tmp}", str(tmp_path)) for a in argv_tail]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("occult-ft push: error:") and match in err and "\n" not in err


def test_tokenizer_snippet_only_when_tokenizer_files_are_there(placed_dir, tmp_path):
    assert "AutoTokenizer" not in hub.build_model_card(placed_dir).text
    path = _copy_checkpoint(placed_dir, tmp_path / "ckpt")
    open(os.path.join(path, "tokenizer_config.json"), "w").write("{}")
    assert 'AutoTokenizer.from_pretrained("me/t")' in hub.build_model_card(path, repo_id="me/t").text


def test_a_users_readme_survives_push_failed_or_not(pruned_dir, tmp_path):
    path = _copy_checkpoint(pruned_dir, tmp_path / "ckpt")
    readme = os.path.join(path, "README.md")
    with open(readme, "w") as f:
        f.write("my own notes")

    class Unreachable(FakeHubApi):
        def create_repo(self, *args, **kwargs):
            raise OSError("cannot reach the Hub")

    with pytest.raises(hub.HubPushError, match="creating the repo me/x at .* failed: cannot reach the Hub"):
        hub.push_checkpoint(path, "me/x", api=Unreachable())
    assert open(readme).read() == "my own notes"
    api = FakeHubApi()
    hub.push_checkpoint(path, "me/x", api=api)
    assert open(readme).read() == "my own notes"  # the card goes to the Hub, not into the folder
    assert api.upload_calls[0]["readme"].startswith("---\n")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the staging folder is gone


def test_a_push_to_an_unreachable_endpoint_fails_first_naming_it_and_writes_nothing(
    pruned_dir, tmp_path, capsys, monkeypatch, endpoint_down
):
    """The endpoint is checked before the figure is measured (which takes a model load and a routing
    pass): the error names it and the step, and the folder is unchanged."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = _copy_checkpoint(pruned_dir, tmp_path / "ckpt")
    before = tree(path)
    assert cli_main(["push", path, "--repo-id", "me/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("occult-ft push: error: reaching the Hub:") and endpoint_down in err, err
    assert "\n" not in err and "measuring" not in err  # one line, and no figure was measured
    assert tree(path) == before
    with pytest.raises(hub.HubPushError, match=f"the Hub at {endpoint_down} cannot be reached"):
        hub.push_checkpoint(path, "me/x")
    assert tree(path) == before


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_a_push_in_offline_mode_says_so_and_how_to_go_online_before_anything(
    pruned_dir, tmp_path, capsys, monkeypatch, endpoint_up, variable
):
    """`push` with HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) says that offline mode is on and how to
    turn it off, before the endpoint is asked, the figure measured or anything written; the Python entry
    points and a training run with push_to_hub say the same (the run before it trains)."""
    from occult_ft.trainer import OccultConfig

    monkeypatch.setenv(variable, "1")
    path = _copy_checkpoint(pruned_dir, tmp_path / "ckpt")
    before = tree(path)
    assert cli_main(["push", path, "--repo-id", "me/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("occult-ft push: error: pushing to the Hub: offline mode is on") and "\n" not in err
    ), err
    assert f"({variable}=1)" in err and f"unset {variable} (or set {variable}=0)" in err, err
    assert endpoint_up.requests == [] and tree(path) == before  # nothing asked, measured or written
    for call in (
        lambda: hub.push_checkpoint(path, "me/x"),
        lambda: hub.push_after_training(path, "me/x"),
    ):
        with pytest.raises(
            hub.HubPushError,
            match=f"offline mode is on \\({variable}=1\\), so the Hub is not contacted; unset {variable}",
        ):
            call()
    with pytest.raises(ValueError, match=f"push_to_hub=True: offline mode is on \\({variable}=1\\)"):
        OccultConfig(output_dir=str(tmp_path / "run"), push_to_hub=True, hub_model_id="me/x", use_cpu=True)
    assert endpoint_up.requests == [] and tree(path) == before
    # a dry run contacts nothing, so offline mode is no obstacle to it
    assert cli_main(["push", path, "--repo-id", "me/x", "--dry-run", "--no-figure"]) == 0
    monkeypatch.setenv(variable, "0")
    if variable == "TRANSFORMERS_OFFLINE":  # HF_HUB_OFFLINE, when set, decides (as in huggingface_hub)
        monkeypatch.setenv(variable, "1")
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert hub.check_endpoint() == endpoint_up and len(endpoint_up.requests) == 1  # online: it asks


def test_an_upload_that_fails_names_the_step_and_the_endpoint(pruned_dir, tmp_path):
    class Refused(FakeHubApi):
        endpoint = "https://hub.example"

        def upload_folder(self, **kwargs):
            raise ConnectionError("[Errno 111] Connection refused")

    path = _copy_checkpoint(pruned_dir, tmp_path / "ckpt")
    before = tree(path)
    with pytest.raises(hub.HubPushError) as err:
        hub.push_checkpoint(path, "me/x", api=Refused())
    message = str(err.value)
    assert message.startswith(f"uploading {path} to me/x at https://hub.example failed: [Errno 111]")
    assert "\n" not in message and tree(path) == before


def test_an_adapter_pushed_names_a_local_base_by_its_folder_name(adapter_dir, tmp_path):
    base = tmp_path / "models" / "my-olmoe"
    base.mkdir(parents=True)
    config = json.loads(open(os.path.join(adapter_dir, "adapter_config.json")).read())
    config["base_model_name_or_path"] = str(base)
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    staged = {}

    class Recording(FakeHubApi):
        def upload_folder(self, **kw):
            staged.update(tree(kw["folder_path"]))
            return super().upload_folder(**kw)

    hub.push_checkpoint(adapter_dir, "me/lora", api=Recording())
    pushed = json.loads(staged["adapter_config.json"])
    assert pushed["base_model_name_or_path"] == "my-olmoe"
    assert str(tmp_path) not in staged["README.md"].decode()
    assert json.loads(open(os.path.join(adapter_dir, "adapter_config.json")).read()) == config
