"""Every recipe is a valid OccultConfig for its model: fields, types, layout, budget, header."""

import dataclasses
import enum
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml
from helpers import safety_timeout
from transformers import HfArgumentParser

from occult_ft.hub import KNOWN_LICENSES
from occult_ft.models import supported_model_types
from occult_ft.routing import PruningConfig
from occult_ft.trainer.config import OccultConfig

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
MODELS = yaml.safe_load((RECIPES_DIR / "models.yaml").read_text())["models"]
RECIPES = sorted(p.name for p in RECIPES_DIR.glob("*.yaml") if p.name != "models.yaml")
EXPECTED = {
    "tiny.yaml",
    "mixtral-8x7b.yaml",
    "deepseek-v2-lite.yaml",
    "deepseek-moe-16b.yaml",
    "olmoe-1b-7b.yaml",
    "qwen1.5-moe-a2.7b.yaml",
    "qwen3-30b-a3b.yaml",
    "gpt-oss-120b.yaml",
    "qwen3-235b-a22b.yaml",
    "qwen3-next-80b-a3b.yaml",
    "minimax-m2.yaml",
    "glm-4.7.yaml",
    "deepseek-v3.2.yaml",
    "kimi-k2.yaml",
}
#: recipes over several nodes: (nodes, GPUs per node) of their launch lines
MULTI_NODE = {"glm-4.7.yaml": (4, 8), "deepseek-v3.2.yaml": (4, 8), "kimi-k2.yaml": (8, 8)}
FIELD_TYPES = typing.get_type_hints(OccultConfig)
# launch forms checked by hand (see recipes/README.md); the named groups are process counts (per node
# with the multi-node forms: torchrun's c10d rendezvous, the DeepSpeed launcher with a hostfile)
LAUNCH = re.compile(
    r"^#\s+(?:"
    r"accelerate launch (?:--multi_gpu )?--num_processes (?P<a>\d+) -m occult_ft\.cli"
    r"|torchrun (?:--nnodes (?P<tn>\d+) )?--nproc_per_node (?P<t>\d+)"
    r"(?: --rdzv_backend c10d --rdzv_endpoint \$MASTER_ADDR:\d+)? -m occult_ft\.cli"
    r"|deepspeed (?:--hostfile \S+ --num_nodes (?P<dn>\d+) )?--num_gpus (?P<d>\d+) --no_local_rank --module occult_ft\.cli"
    r"|occult-ft|python -m occult_ft"
    r") train recipes/(?P<file>\S+?)(?: --deepspeed recipes/(?P<ds>ds_zero[12]\.json))?$"
)


def processes(match) -> tuple[int, int] | None:
    """(nodes, processes per node) of a launch line, None for a single-process one."""
    per_node = match["a"] or match["t"] or match["d"]
    if per_node is None:
        return None
    return int(match["tn"] or match["dn"] or 1), int(per_node)


def load(name: str) -> dict:
    return yaml.safe_load((RECIPES_DIR / name).read_text())


def header(name: str) -> list[str]:
    """The comment lines before the first key."""
    lines = []
    for line in (RECIPES_DIR / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            break
        lines.append(line)
    return lines


def model_facts(recipe: dict) -> dict:
    return MODELS[recipe["model_name_or_path"]]


def _matches(value, hint) -> bool:
    """YAML value fits the field's annotation (ints pass for floats; bools never pass for numbers)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str) and value in {m.value for m in hint}
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def test_all_recipes_are_present():
    assert set(RECIPES) == EXPECTED


@pytest.mark.parametrize("name", RECIPES)
def test_every_key_is_an_occult_config_field(name):
    names = {f.name for f in dataclasses.fields(OccultConfig)}
    unknown = sorted(set(load(name)) - names)
    assert not unknown, f"{name}: {unknown} are not OccultConfig fields"
    # transformers' deprecated spelling warns on every run; the recipes use the current one
    assert "gradient_checkpointing" not in load(name), f"{name}: use activation_checkpointing"


@pytest.mark.parametrize("name", RECIPES)
def test_values_have_the_field_types(name):
    """HfArgumentParser passes YAML values through unconverted: `2e-4` (a YAML string) or a bare `no`
    (a YAML bool) would reach TrainingArguments as the wrong type."""
    wrong = {k: v for k, v in load(name).items() if not _matches(v, FIELD_TYPES[k])}
    assert not wrong, f"{name}: {wrong} do not match their field types"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_as_occult_config(name, monkeypatch):
    """The real parser and validation (`occult-ft train` reads recipes this way); WORLD_SIZE is the
    process count of the launch line, as the launcher would set it."""
    recipe = load(name)
    monkeypatch.setenv("WORLD_SIZE", str(recipe.get("expert_parallel_size", 1)))
    (config,) = HfArgumentParser(OccultConfig).parse_yaml_file(str(RECIPES_DIR / name))
    assert config.model_name_or_path == recipe["model_name_or_path"]
    assert config.devices == recipe["devices"]


@pytest.mark.parametrize("name", RECIPES)
def test_devices_divide_the_experts_and_the_budget_holds_top_k(name):
    recipe, facts = load(name), model_facts(load(name))
    e, k, d, m = facts["num_experts"], facts["top_k"], recipe["devices"], recipe.get("max_devices_per_token")
    assert e % d == 0, f"{name}: devices={d} does not divide {e} experts"
    if m is not None:
        assert 1 <= m <= d
        assert m * (e // d) >= k, f"{name}: {m} devices of {e // d} experts cannot hold top-{k}"
    # the library's own check says the same
    PruningConfig(
        num_devices=d, max_devices_per_token=m, criterion=recipe.get("criterion", "similarity")
    ).check(e, k)


@pytest.mark.parametrize("name", RECIPES)
def test_expert_parallel_size_divides_devices(name):
    recipe = load(name)
    assert recipe["devices"] % recipe.get("expert_parallel_size", 1) == 0


@pytest.mark.parametrize("name", RECIPES)
def test_header_has_launch_line_hardware_and_model_facts(name):
    lines = header(name)
    text = "\n".join(lines)
    launches = [m for m in map(LAUNCH.match, lines) if m]
    assert launches, f"{name}: no launch line in the header"
    assert all(m["file"] == name for m in launches), f"{name}: a launch line names another recipe"
    recipe = load(name)
    ep = recipe.get("expert_parallel_size", 1)
    for m in launches:
        layout = processes(m)
        if layout is not None:
            nodes, per_node = layout
            assert (nodes * per_node) % ep == 0, (
                f"{name}: {nodes} x {per_node} processes is not a multiple of expert_parallel_size={ep}"
            )
            assert (nodes, per_node) == MULTI_NODE.get(name, (1, per_node)), f"{name}: {m.group(0)}"
            if nodes > 1:  # the expert-parallel group spans the recipe's `nodes`
                assert ep // per_node == recipe["nodes"], f"{name}: {nodes} nodes but nodes={recipe['nodes']}"
    assert "# Hardware:" in text
    facts = model_facts(load(name))
    assert f"{facts['num_experts']} " in text and "experts per layer" in text
    assert f"top-{facts['top_k']}" in text


@pytest.mark.parametrize("name", sorted(MULTI_NODE))
def test_multi_node_recipes_launch_on_every_node_and_use_the_two_stage_exchange(name):
    recipe, lines = load(name), header(name)
    forms = {("torchrun" if "torchrun" in m.group(0) else "deepspeed") for m in map(LAUNCH.match, lines) if m}
    assert forms == {"torchrun", "deepspeed"}, f"{name}: needs a torchrun rendezvous and a hostfile line"
    assert recipe["exchange"] == "two_stage" and recipe["nodes"] > 1
    assert recipe["max_nodes_per_token"] < recipe["nodes"]


def test_no_header_uses_a_broken_launch_form():
    """deepspeed has no -m flag and needs --no_local_rank (it would put --local_rank=N before `train`)."""
    for name in RECIPES:
        for line in header(name):
            if "deepspeed" in line and "train recipes/" in line:
                assert "--no_local_rank" in line and "--module" in line, f"{name}: {line}"


@pytest.mark.parametrize("name", RECIPES)
def test_model_type_is_supported_or_the_header_says_it_is_not(name):
    facts = model_facts(load(name))
    if facts["transformers"] == "native":
        assert facts["model_type"] in supported_model_types()
    else:
        assert "NOT RUNNABLE WITH STOCK TRANSFORMERS" in "\n".join(header(name))
        assert "recipes/README.md" in "\n".join(header(name))


@pytest.mark.parametrize("name", sorted(set(RECIPES) - {"tiny.yaml"}))
def test_real_model_recipes_train_on_alpaca(name):
    assert load(name)["dataset"] == "tatsu-lab/alpaca"


def test_tiny_recipe_is_the_embedded_demo():
    recipe = load("tiny.yaml")
    assert recipe["model_name_or_path"] == "embedded" and recipe["dataset"] == "embedded"
    assert recipe["devices"] == 4 and recipe["max_devices_per_token"] == 2
    assert recipe["max_steps"] <= 100


def test_embedded_facts_match_the_shipped_model():
    from occult_ft.embedded import embedded_model_path

    path = embedded_model_path()  # shipped in the package
    config = json.loads((Path(path) / "config.json").read_text())
    facts = MODELS["embedded"]
    assert config["model_type"] == facts["model_type"]
    assert config["num_experts"] == facts["num_experts"] and config["num_experts_per_tok"] == facts["top_k"]


def test_model_table_licenses_agree_with_the_hub_card_table():
    for model_id, license in KNOWN_LICENSES.items():
        assert MODELS[model_id]["license"] == license


def test_readme_lists_every_recipe():
    readme = (RECIPES_DIR / "README.md").read_text()
    for name in RECIPES:
        assert f"`{name}`" in readme


def test_module_entry_point_of_the_launch_lines_runs_a_command():
    """`-m occult_ft.cli CMD ...` (what accelerate / torchrun / deepspeed run) reaches the subcommand."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "occult_ft.cli", "push", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=safety_timeout(120),
    )
    assert done.returncode == 0, done.stderr
    assert "usage: occult-ft push" in done.stdout


@pytest.mark.parametrize("name", sorted(set(RECIPES) - {"tiny.yaml"}))
def test_deepspeed_launch_lines_use_a_shipped_zero_config(name):
    """Every real recipe has a DeepSpeed launch line naming a shipped ZeRO-1/2 config whose "auto" values
    Trainer fills; the config parses and its stage is what the file name says."""
    found = [m for m in map(LAUNCH.match, header(name)) if m and m["ds"]]
    assert found, f"{name}: no `--deepspeed recipes/ds_zero*.json` launch line"
    for m in found:
        config = json.loads((RECIPES_DIR / m["ds"]).read_text())
        assert config["zero_optimization"]["stage"] == int(m["ds"][len("ds_zero")])
        assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_clipping"] == "auto"


def test_zero3_is_refused_before_any_weight_loads(tmp_path):
    from occult_ft.trainer.config import check_before_loading

    ds = tmp_path / "z3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    for ep in (1, 4):
        config = OccultConfig(output_dir=str(tmp_path), devices=4, use_cpu=True, report_to="none")
        config.deepspeed, config.expert_parallel_size = str(ds), ep
        with pytest.raises(ValueError, match="stage 3") as err:
            check_before_loading(config)
        assert "\n" not in str(err.value)
