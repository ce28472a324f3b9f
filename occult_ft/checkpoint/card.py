"""The model card (README.md) of an occult_ft checkpoint directory, built from what the directory records.

The card is the Jinja2 template `occult_ft/templates/model_card.md` (as TRL renders its cards), filled by
`build_model_card` in named steps:

    _card_data    metadata: base_model, library_name (transformers | peft), tags (moe, occult,
                  expert-parallelism, the model type, lora), license and datasets when they are known
    _card_text    the opening sentence: the base model and what was done to it
    _card_tables  placement (algorithm, devices D, nodes), the budget max_devices_per_token M, criterion,
                  gate weights; comm_complexity before / after beside the reference points (k rows per
                  token for per-expert dispatch, the lower bound ceil(k*D/E), random placement); the
                  run's settings; evaluation results
    _loading      how to load it: a pruned full checkpoint needs `occult_ft.from_pretrained` (stock
                  transformers loads the same weights with the original top-k routing); an unpruned one,
                  or one whose budget sits in its config (`n_group` / `topk_group`), routes identically
                  in stock transformers; a full checkpoint of a type occult_ft's vLLM plugin serves gets
                  the vLLM lines (`vllm serve`, `LLM(...)`). tests/test_card_load_lines.py runs every
                  load line a card shows (the vLLM one in vLLM's environment).

The base model is named by `base_model_reference`: its Hub id when there is one (a snapshot of the Hub
cache included), `embedded` for the shipped model, else its path; a card for the Hub names a local base
by its folder name and says how to point at a copy (`set_adapter_base`). Uploading is `occult_ft.hub`'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

from ..embedded import embedded_model_path
from ..fileio import atomic_save, atomic_write_text, model_card_writer, read_json_object
from ..metrics import comm_complexity_lower_bound, random_placement_comm_complexity
from ..models.family import VLLM_SERVED, auto_model_class
from ..routing import PruningConfig
from .format import CheckpointSummary, OccultBlock, describe_checkpoint

__all__ = [
    "OCCULT_CITATION",
    "CARD_TAGS",
    "CARD_TEMPLATE",
    "KNOWN_LICENSES",
    "RUN_SETTINGS",
    "base_model_reference",
    "build_model_card",
    "write_model_card",
    "figure_name",
    "is_occult_card",
    "last_eval_metrics",
    "recorded_run_settings",
    "run_settings",
    "set_adapter_base",
]

OCCULT_CITATION = """@inproceedings{luo2025occult,
  title         = {Occult: Optimizing Collaborative Communication across Experts for Accelerated Parallel MoE Training and Inference},
  author        = {Luo, Shuqing and Li, Pingzhi and Peng, Jie and Wang, Hanrui and Zhao, Yang and Cao, Yu and Cheng, Yu and Chen, Tianlong},
  booktitle     = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year          = {2025},
  eprint        = {2505.13345},
  archivePrefix = {arXiv}
}"""

CARD_TAGS = ("moe", "occult", "expert-parallelism")
CARD_TEMPLATE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates", "model_card.md"
)

# Base models whose Hub license is a plain SPDX-style id; a derived checkpoint carries it on.
KNOWN_LICENSES = {
    "mistralai/Mixtral-8x7B-v0.1": "apache-2.0",
    "allenai/OLMoE-1B-7B-0924": "apache-2.0",
    "Qwen/Qwen3-30B-A3B": "apache-2.0",
}

#: the settings of a training run recorded in its `occult` block (`run_settings`), so that `occult-ft eval`
#: of the run's output evaluates as the trainer did and the card shows what the run was
RUN_SETTINGS = (
    "dataset",
    "dataset_split",
    "eval_dataset",
    "eval_dataset_split",
    "seq_len",
    "packing",
    "response_only",
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# a snapshot in the Hub cache: .../models--owner--name/snapshots/<revision>
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
# recorded settings rendered in their own sections; the other extras go to "Other recorded settings"
_EXTRA_SHOWN = {"comm_complexity_before", "comm_complexity_after", "eval", "license"}


# ---- naming the base model ------------------------------------------------------------------------
def _is_embedded(name: str) -> bool:
    if name == "embedded":
        return True
    try:
        return os.path.isdir(name) and os.path.samefile(name, embedded_model_path())
    except OSError:
        return False


def base_model_reference(name: Any) -> str | None:
    """How a checkpoint names its base model so that the name means the same elsewhere.

    Returns:
        `embedded` for the model shipped with occult_ft; `owner/name` for a Hub id or a snapshot of the
        Hub cache (`.../models--owner--name/snapshots/REV`); any other local path as it is (it names a
        model of this machine: a card for the Hub then says how to point at a copy); None for none.
    """
    if not isinstance(name, str) or not name:
        return None
    if _is_embedded(name):
        return "embedded"
    found = _CACHE_SNAPSHOT.search(os.fspath(name).replace(os.sep, "/"))
    if found:
        return f"{found.group(1)}/{found.group(2)}"
    return name


def _hub_id(name: Any) -> str | None:
    """`name` when it looks like a Hub model id `owner/name` (not an existing local path), else None."""
    if isinstance(name, str) and _HUB_ID.match(name) and not os.path.exists(name):
        return name
    return None


def _base(name: Any) -> dict:
    """The base model as the card's loading section needs it: kind hub / embedded / local / unknown,
    its name, and the string a load line passes."""
    ref = base_model_reference(name)
    if ref is None:
        return {"kind": "unknown", "name": "BASE_MODEL", "path": "BASE_MODEL"}
    if ref == "embedded":
        return {"kind": "embedded", "name": "embedded", "path": "embedded"}
    if _hub_id(ref):
        return {"kind": "hub", "name": ref, "path": ref}
    local = os.path.basename(os.path.normpath(ref))
    return {"kind": "local", "name": local, "path": f"path/to/{local}"}


def set_adapter_base(adapter_dir: str | os.PathLike, base_model: str) -> None:
    """Make a LoRA adapter directory name `base_model` as its base (`base_model_name_or_path` of
    adapter_config.json, read by PEFT and `occult_ft.from_pretrained`), through `base_model_reference`:
    the trainer's save calls it so that a base read from `embedded` or from the Hub cache is named as
    such, and a user calls it to point a downloaded adapter at a local copy of its base."""
    reference = base_model_reference(base_model)
    if reference is None:
        raise ValueError(
            f"base model {base_model!r} is empty; pass a Hub id, 'embedded' or a model directory"
        )
    path = os.path.join(os.fspath(adapter_dir), "adapter_config.json")
    config = read_json_object(path)
    config["base_model_name_or_path"] = reference
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def run_settings(config: Any) -> dict[str, Any]:
    """The `RUN_SETTINGS` of a training config (an `OccultConfig`), for the run's `occult` block."""
    return {k: getattr(config, k) for k in RUN_SETTINGS if getattr(config, k, None) is not None}


def recorded_run_settings(summary: CheckpointSummary) -> dict[str, Any]:
    """The `RUN_SETTINGS` a checkpoint's block records ({} for a checkpoint that is not a run's output)."""
    extra = summary.block.extra if summary.block is not None else {}
    return {k: extra[k] for k in RUN_SETTINGS if extra.get(k) is not None}


# ---- card body ---------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "none"
    return str(value)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Nested metric dicts -> `a.b.c` keys; lists of numbers are kept as one value."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _table(rows: list[tuple[str, Any]], first: str = "setting", second: str = "value") -> str:
    lines = [f"| {first} | {second} |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    return "\n".join(lines)


def _read_eval_results(path: str) -> dict[str, Any]:
    """Metrics a Trainer saved beside the model (`eval_results.json`, else the eval part of `all_results.json`)."""
    file = os.path.join(path, "eval_results.json")
    if os.path.isfile(file):
        return read_json_object(file)
    file = os.path.join(path, "all_results.json")
    if os.path.isfile(file):
        return {k: v for k, v in read_json_object(file).items() if k.startswith("eval_")}
    return {}


def _placement(s: CheckpointSummary) -> tuple[list[tuple[str, Any]], list[str]]:
    """Rows of the placement-and-budget table and the paragraphs under it."""
    return _placement_rows(s), _placement_notes(s)


def _placement_rows(s: CheckpointSummary) -> list[tuple[str, Any]]:
    """The placement-and-budget table: model, experts, placement, devices and nodes, the budget."""
    b = s.block or OccultBlock()
    d = b.num_devices
    rows: list[tuple[str, Any]] = [("base model", s.base_model or "not recorded")]
    optional = (
        ("model type", s.model_type, bool(s.model_type)),
        ("routed experts per layer (E)", s.num_experts, s.num_experts is not None),
        ("experts per token (k)", s.top_k, s.top_k is not None),
    )
    rows += [(label, value) for label, value, shown in optional if shown]
    algorithm = b.placement.algorithm if b.placement is not None else None
    rows.append(("placement algorithm", algorithm or "none (original expert order)"))
    rows.append(("devices (D)", d if d is not None else "not recorded"))
    rows.append(("nodes", b.num_nodes))
    if d and s.num_experts and s.num_experts % int(d) == 0:
        rows.append(("experts per device (E/D)", s.num_experts // int(d)))
    rows += _budget_rows(b.pruning)
    if algorithm and s.kind == "full":
        rows.append(("experts stored in placed order", b.placed))
    if s.native_routing:
        rows.append(
            (
                "budget in the model config",
                f"n_group={s.config.get('n_group')}, topk_group={s.config.get('topk_group')}",
            )
        )
    return rows


def _budget_rows(p: PruningConfig | None) -> list[tuple[str, Any]]:
    """The pruning budget's rows: M (and the node budget when set), criterion, gate weights."""
    m = p.max_devices_per_token if p is not None else None
    rows: list[tuple[str, Any]] = [
        ("max_devices_per_token (M)", m if m is not None else "none (routing unchanged)")
    ]
    if p is not None and p.max_nodes_per_token is not None:
        rows.append(("max_nodes_per_token", p.max_nodes_per_token))
    rows.append(("criterion", p.criterion if p is not None else "n/a"))
    rows.append(("gate weights", p.gate_weights if p is not None else "n/a"))
    return rows


def _placement_notes(s: CheckpointSummary) -> list[str]:
    """The paragraphs under the table: how the experts are stored, what the pruning restricts."""
    b = s.block or OccultBlock()
    d, p = b.num_devices, b.pruning
    algorithm = b.placement.algorithm if b.placement is not None else None
    notes = []
    if algorithm and b.placed:
        notes.append(
            "The experts of every MoE layer are stored permuted so that device d of D holds the contiguous "
            "block [d*E/D, (d+1)*E/D), the layout every expert-parallel runtime uses. `placement.layers` in the "
            "`occult` block of config.json records which original experts each device holds."
        )
    elif algorithm:
        notes.append(
            "The base model's experts are not stored permuted here: `occult_ft.from_pretrained` permutes "
            "them with the placement recorded in `occult_config.json` before attaching the adapter."
        )
    if s.pruned:
        assert p is not None  # s.pruned: a budget restricts the routing
        m, mn = p.max_devices_per_token, p.max_nodes_per_token
        limits = []
        if m is not None and m < (d or m + 1):
            limits.append(f"at most {m} of the {d} devices")
        if mn is not None and mn < b.num_nodes:
            limits.append(f"at most {mn} of the {b.num_nodes} nodes")
        notes.append(
            f"Collaboration pruning: each token's top-k is restricted to experts on {' and '.join(limits)} "
            f"(criterion `{p.criterion}`), and the model was fine-tuned that way."
        )
    return notes


def _comm_rows(s: CheckpointSummary) -> list[tuple[str, Any]]:
    b = s.block or OccultBlock()
    rows: list[tuple[str, Any]] = []
    for key, label in (
        ("comm_complexity_before", "before Occult (measured)"),
        ("comm_complexity_after", "after placement / pruning (measured)"),
    ):
        if key in b.extra:
            flat: dict[str, Any] = {}
            _flatten("", b.extra[key], flat)
            rows += [(f"{label}{' ' + k if k else ''}", v) for k, v in flat.items()]
    d = b.num_devices
    e, k = s.num_experts, s.top_k
    if d and e and k and e % int(d) == 0:
        d = int(d)
        rows.append(("per-expert dispatch (rows per token)", k))
        rows.append(("random placement, uniform routing", random_placement_comm_complexity(e, k, d)))
        rows.append(("lower bound ceil(k*D/E)", comm_complexity_lower_bound(e, k, d)))
        if s.pruned and b.pruning is not None:
            rows.append(("upper bound with the budget", min(b.pruning.device_budget, k, d)))
    return rows


def _eval_rows(s: CheckpointSummary, eval_results: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    flat: dict[str, Any] = {}
    recorded = s.block.extra.get("eval") if s.block is not None else None
    if isinstance(recorded, Mapping):
        _flatten("", recorded, flat)
    if eval_results is None:
        eval_results = _read_eval_results(s.path)
    _flatten("", dict(eval_results), flat)
    return sorted(flat.items())


def figure_name(checkpoint_dir: str, figure: str | os.PathLike) -> str:
    """Repo-relative name of `figure`: its path inside the checkpoint, or its file name once copied there."""
    figure = os.fspath(figure)
    if not figure.lower().endswith(".png"):
        raise ValueError(f"figure {figure!r} is not a .png file; save the plot as PNG")
    if not os.path.isfile(figure) and not os.path.isfile(os.path.join(checkpoint_dir, figure)):
        raise ValueError(f"figure {figure!r} does not exist; pass the path of a PNG file")
    full = os.path.abspath(figure if os.path.isfile(figure) else os.path.join(checkpoint_dir, figure))
    rel = os.path.relpath(full, os.path.abspath(checkpoint_dir))
    return rel.replace(os.sep, "/") if not rel.startswith("..") else os.path.basename(full)


def _render(context: dict) -> str:
    import jinja2

    with open(CARD_TEMPLATE, encoding="utf-8") as f:
        template = jinja2.Environment(
            trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False
        ).from_string(f.read())
    text = template.render(table=_table, **context)
    return re.sub(r"\n{3,}", "\n\n", text)


def build_model_card(
    checkpoint_dir: str | os.PathLike,
    repo_id: str | None = None,
    eval_results: Mapping[str, Any] | None = None,
    figure: str | os.PathLike | None = None,
    *,
    base_model: str | None = None,
    license: str | None = None,
):
    """Build the Hub model card of an occult_ft checkpoint directory (the template `CARD_TEMPLATE`).

    Args:
        checkpoint_dir: a full checkpoint (config.json, optionally with the `occult` block) or a LoRA
            adapter directory (adapter_config.json, optionally occult_config.json).
        repo_id: the Hub repo the card is for (its load lines name it); default: none, the card of a
            local folder, whose load lines name the folder.
        eval_results: metric name -> value; default: `eval_results.json` (or the eval_* entries of
            `all_results.json`) in the directory. The block's `eval` dict is shown as well.
        figure: a PNG shown in the card. A path inside the directory is referenced as is; any other path
            by its file name (`push_checkpoint` copies it into what it uploads).
        base_model: override the recorded base model (the block's `base_model`, the adapter's
            `base_model_name_or_path`, or config.json's `_name_or_path`).
        license: license id for the metadata; default: the block's `license`, else `KNOWN_LICENSES`.

    Returns:
        `huggingface_hub.ModelCard` (`.save(path)` writes it; `.data` holds the metadata).

    Raises:
        ValueError: missing directory, a directory that is not a checkpoint, invalid JSON, a figure that
            is missing or not a PNG.
    """
    from huggingface_hub import ModelCard

    s = describe_checkpoint(checkpoint_dir)
    if base_model:
        s.base_model = base_model
    base = _base(s.base_model)
    # from here on the summary names the base as the card does (a local path by its folder name)
    s.base_model = base["name"] if base["kind"] != "unknown" else None
    repo = repo_id or os.path.basename(os.path.abspath(s.path))
    context = {
        "card_data": _card_data(s, base, license).to_yaml(),
        "title": repo.split("/")[-1],
        "repo": repo,
        "on_hub": repo_id is not None,
        "base": base,
        **_card_text(s, base),
        **_card_tables(s, eval_results),
        "figure": figure_name(s.path, figure) if figure is not None else None,
        **_loading(s),
        "citation": OCCULT_CITATION,
    }
    return ModelCard(_render(context))


def _card_data(s: CheckpointSummary, base: dict, license: str | None):
    """The card's YAML metadata (`huggingface_hub.ModelCardData`): base model, library, license, tags,
    datasets; `base` is `_base`'s description of the base model."""
    from huggingface_hub import ModelCardData

    hub_base = base["name"] if base["kind"] == "hub" else None
    recorded = s.block.extra if s.block is not None else {}
    tags = list(CARD_TAGS)
    if s.model_type:
        tags.append(s.model_type)
    if s.kind == "adapter":
        tags += ["lora", "peft"]
    if s.pruned:
        tags.append("collaboration-pruning")
    dataset = _hub_id(recorded.get("dataset"))  # only a Hub dataset id links to a dataset page
    return ModelCardData(
        base_model=hub_base,
        library_name="peft" if s.kind == "adapter" else "transformers",
        license=license or recorded.get("license") or KNOWN_LICENSES.get(hub_base or ""),
        tags=tags,
        datasets=[dataset] if dataset else None,
        pipeline_tag="text-generation",
    )


def _card_text(s: CheckpointSummary, base: dict) -> dict[str, str]:
    """The card's opening sentence: what the directory is, its base model, and what was done to it."""
    if base["kind"] == "hub":
        base_text = f"[`{base['name']}`](https://huggingface.co/{base['name']})"
    elif base["kind"] == "embedded":
        base_text = "occult_ft's embedded OLMoE (`embedded`, shipped with the package)"
    else:
        base_text = f"`{s.base_model or 'an MoE model'}`"
    placed = s.block is not None and s.block.placement is not None
    if s.pruned and placed:
        action = "with collaboration-aware expert placement and collaboration pruning, then fine-tuned"
    elif s.pruned:
        action = "with collaboration pruning, then fine-tuned"
    elif placed:
        action = "with collaboration-aware expert placement (the same function as the base model, permuted experts)"
    else:
        action = "fine-tuned"
    return {
        "what": "LoRA adapter" if s.kind == "adapter" else "checkpoint",
        "base_text": base_text,
        "action": action,
    }


def _card_tables(s: CheckpointSummary, eval_results: Mapping[str, Any] | None) -> dict[str, Any]:
    """The rows of the card's tables: placement and budget (with the notes under it), the adapter's
    settings, the other recorded settings, comm_complexity and evaluation."""
    placement_rows, placement_notes = _placement(s)
    adapter_rows = []
    if s.kind == "adapter" and s.adapter:
        keys = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters")
        adapter_rows = [(k, s.adapter[k]) for k in (*keys, "modules_to_save") if s.adapter.get(k) is not None]
    recorded = s.block.extra if s.block is not None else {}
    # nested values (the comm_complexity dicts, eval) have tables of their own or are not shown
    other_rows = [
        (k, v)
        for k, v in sorted(recorded.items())
        if k not in _EXTRA_SHOWN and not isinstance(v, (dict, list))
    ]
    return {
        "placement_rows": placement_rows,
        "placement_notes": placement_notes,
        "adapter_rows": adapter_rows,
        "other_rows": other_rows,
        "comm_rows": _comm_rows(s),
        "eval_rows": _eval_rows(s, eval_results),
    }


def _loading(s: CheckpointSummary) -> dict[str, Any]:
    """What the card's "How to load" section chooses between (see the module docstring)."""
    return {
        "kind": s.kind,
        "has_tokenizer": s.has_tokenizer,
        "pruned": s.pruned,
        "needs_occult_ft": s.needs_occult_ft,
        "remote_code": s.remote_code,
        "native_routing": s.native_routing,
        "expert_order_original": s.block is not None and s.block.expert_order == "original",
        # the transformers class that loads this model type (a multimodal MoE is not a causal LM)
        "auto_class": auto_model_class(s.model_type).__name__ if s.model_type else "AutoModelForCausalLM",
        # occult_ft's vLLM plugin serves full checkpoints of these types (docs/serving.md)
        "vllm": s.kind == "full" and s.model_type in VLLM_SERVED,
    }


def write_model_card(
    checkpoint_dir: str | os.PathLike,
    repo_id: str | None = None,
    eval_results: Mapping[str, Any] | None = None,
    figure: str | os.PathLike | None = None,
) -> str:
    """Write `build_model_card(...)` as README.md into the directory (copying `figure` there); returns its path."""
    path = os.fspath(checkpoint_dir)
    card = build_model_card(path, repo_id=repo_id, eval_results=eval_results, figure=figure)
    if figure is not None:
        target = os.path.join(path, figure_name(path, figure))
        if not os.path.isfile(target):
            atomic_save(target, lambda tmp: shutil.copyfile(os.fspath(figure), tmp))
    readme = os.path.join(path, "README.md")
    atomic_write_text(readme, str(card))
    return readme


def last_eval_metrics(log_history: list[dict]) -> dict[str, Any]:
    """The most recent log entry holding eval_* metrics (Trainer.state.log_history)."""
    for entry in reversed(log_history or []):
        metrics = {k: v for k, v in entry.items() if k.startswith("eval_")}
        if metrics:
            return metrics
    return {}


def is_occult_card(path: str | os.PathLike) -> bool:
    """Whether the README.md at `path` is a model card occult_ft wrote (its metadata carries the
    `occult` tag): such a file may be replaced, a user's README may not (`fileio.model_card_writer`)."""
    return model_card_writer(path) == "occult_ft"
