"""The model card (README.md) of an occult_ft checkpoint directory, built from what the directory records.

    metadata   base_model, library_name (transformers | peft), tags (moe, occult, expert-parallelism,
               the model type, lora), license and datasets when they are known
    body       base model; placement (algorithm, devices D, nodes); the budget max_devices_per_token M;
               criterion; gate weights; comm_complexity before / after with the reference points
               (k rows per token for per-expert dispatch, the lower bound ceil(k*D/E), random placement);
               evaluation results; how to load it; an optional figure; the Occult citation

How to load: a pruned full checkpoint needs `occult_ft.from_pretrained`, which reactivates the pruned
routing; plain `AutoModelForCausalLM.from_pretrained` gives the same weights with the original top-k
routing. An unpruned checkpoint (placement only: the same function as the base model), or one whose
budget is written in the model's own config (`n_group` / `topk_group`, DeepSeek-V2/V3), routes
identically in stock transformers. Uploading the card with the checkpoint is `occult_ft.hub`'s job.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

from ..embedded import embedded_model_path
from ..fileio import atomic_write_text, read_json_object
from ..metrics import comm_complexity_lower_bound, random_placement_comm_complexity
from ..models.family import auto_model_class
from .format import CheckpointSummary, OccultBlock, describe_checkpoint

__all__ = [
    "OCCULT_CITATION",
    "CARD_TAGS",
    "KNOWN_LICENSES",
    "build_model_card",
    "write_model_card",
    "figure_name",
    "is_occult_card",
    "last_eval_metrics",
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

# Trainer leftovers that do not belong in a published model repo (fnmatch patterns; `*` crosses `/`).
# Base models whose Hub license is a plain SPDX-style id; a derived checkpoint carries it on.
KNOWN_LICENSES = {
    "mistralai/Mixtral-8x7B-v0.1": "apache-2.0",
    "allenai/OLMoE-1B-7B-0924": "apache-2.0",
    "Qwen/Qwen3-30B-A3B": "apache-2.0",
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# recorded settings rendered in their own sections; the other extras go to "Other recorded settings"
_EXTRA_SHOWN = {"comm_complexity_before", "comm_complexity_after", "eval", "license", "dataset"}


def _local_name(name: Any) -> str | None:
    """How a card names a local base model: `embedded` for the shipped model, else the folder's name (an
    absolute path of the machine that trained it means nothing to a reader of the card)."""
    if not isinstance(name, str) or not name:
        return None
    if not os.path.isabs(name):
        return name

    try:
        if os.path.realpath(name) == os.path.realpath(embedded_model_path()):
            return "embedded"
    except FileNotFoundError:
        pass
    return os.path.basename(os.path.normpath(name))


def _hub_id(name: Any) -> str | None:
    """`name` when it looks like a Hub model id `owner/name` (not an existing local path), else None."""
    if isinstance(name, str) and _HUB_ID.match(name) and not os.path.exists(name):
        return name
    return None


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


def _table(rows: list[tuple[str, Any]], header: tuple[str, str] = ("setting", "value")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
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


def _placement_section(s: CheckpointSummary) -> str:
    b = s.block or OccultBlock()
    d, p = b.num_devices, b.pruning
    m = p.max_devices_per_token if p is not None else None
    mn = p.max_nodes_per_token if p is not None else None
    rows: list[tuple[str, Any]] = [("base model", s.base_model or "not recorded")]
    if s.model_type:
        rows.append(("model type", s.model_type))
    if s.num_experts is not None:
        rows.append(("routed experts per layer (E)", s.num_experts))
    if s.top_k is not None:
        rows.append(("experts per token (k)", s.top_k))
    algorithm = b.placement.algorithm if b.placement is not None else None
    rows.append(("placement algorithm", algorithm or "none (original expert order)"))
    rows.append(("devices (D)", d if d is not None else "not recorded"))
    rows.append(("nodes", b.num_nodes))
    if d and s.num_experts and s.num_experts % int(d) == 0:
        rows.append(("experts per device (E/D)", s.num_experts // int(d)))
    rows.append(("max_devices_per_token (M)", m if m is not None else "none (routing unchanged)"))
    if mn is not None:
        rows.append(("max_nodes_per_token", mn))
    rows.append(("criterion", p.criterion if p is not None else "n/a"))
    rows.append(("gate weights", p.gate_weights if p is not None else "n/a"))
    if algorithm and s.kind == "full":
        rows.append(("experts stored in placed order", b.placed))
    if s.native_routing:
        rows.append(
            (
                "budget in the model config",
                f"n_group={s.config.get('n_group')}, topk_group={s.config.get('topk_group')}",
            )
        )
    text = "## Expert placement and routing budget\n\n" + _table(rows)
    if algorithm and b.placed:
        text += (
            "\n\nThe experts of every MoE layer are stored permuted so that device d of D holds the contiguous "
            "block [d*E/D, (d+1)*E/D), the layout every expert-parallel runtime uses. `placement.layers` in the "
            "`occult` block of config.json records which original experts each device holds."
        )
    elif algorithm:
        text += (
            "\n\nThe base model's experts are not stored permuted here: `occult_ft.from_pretrained` permutes "
            "them with the placement recorded in `occult_config.json` before attaching the adapter."
        )
    if s.pruned:
        limits = []
        if m is not None and m < (d or m + 1):
            limits.append(f"at most {m} of the {d} devices")
        if mn is not None and mn < b.num_nodes:
            limits.append(f"at most {mn} of the {b.num_nodes} nodes")
        text += (
            f"\n\nCollaboration pruning: each token's top-k is restricted to experts on {' and '.join(limits)} "
            f"(criterion `{p.criterion}`), and the model was fine-tuned that way."
        )
    return text


def _comm_section(s: CheckpointSummary) -> str | None:
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
        if s.pruned:
            budget = b.pruning.device_budget
            rows.append(("upper bound with the budget", min(budget, k, d)))
    if not rows:
        return None
    return (
        "## Communication\n\n`comm_complexity` (the paper's C_T) is the mean number of distinct devices hosting "
        "a token's top-k experts: the rows per token a de-duplicated all-to-all sends (and returns), against "
        "k rows for per-expert dispatch.\n\n" + _table(rows, ("comm_complexity", "rows per token"))
    )


def _eval_section(s: CheckpointSummary, eval_results: Mapping[str, Any] | None) -> str | None:
    flat: dict[str, Any] = {}
    recorded = s.block.extra.get("eval") if s.block is not None else None
    if isinstance(recorded, Mapping):
        _flatten("", recorded, flat)
    if eval_results is None:
        eval_results = _read_eval_results(s.path)
    _flatten("", dict(eval_results), flat)
    if not flat:
        return None
    return "## Evaluation\n\n" + _table(sorted(flat.items()), ("metric", "value"))


def _usage_section(s: CheckpointSummary, repo: str) -> str:
    load_local = s.kind == "adapter" or s.has_similarity
    auto = auto_model_class(s.model_type).__name__ if s.model_type else "AutoModelForCausalLM"
    lines = ["## How to load it", "", "```python", "import occult_ft"]
    if load_local:
        # occult_ft reads the adapter / similarity files from a local folder: download the repo first
        lines += [
            "from huggingface_hub import snapshot_download",
            "",
            f'model = occult_ft.from_pretrained(snapshot_download("{repo}"))',
        ]
    else:
        lines += ["", f'model = occult_ft.from_pretrained("{repo}")']
    if s.has_tokenizer:
        lines += [
            "",
            "from transformers import AutoTokenizer",
            "",
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        ]
    lines += ["```", ""]
    if s.kind == "adapter":
        lines.append(
            f"This is a LoRA adapter for `{s.base_model or 'its base model'}`: `occult_ft.from_pretrained` loads "
            "the base model, applies the recorded placement and routing budget, then attaches the adapter."
        )
        if s.block is not None and s.block.expert_order == "original":
            base = _hub_id(s.base_model) or s.base_model or "BASE_MODEL"
            pruned = s.pruned
            lines += [
                "",
                "The adapter is stored in the base model's own expert order, so stock PEFT on the stock base "
                + (
                    "computes the fine-tuned model without the collaboration pruning it was trained with "
                    "(each token may then reach more devices than the budget; quality stays close):"
                    if pruned
                    else "computes exactly the fine-tuned model:"
                ),
                "",
                "```python",
                "from peft import PeftModel",
                f"from transformers import {auto}",
                "",
                f'model = PeftModel.from_pretrained({auto}.from_pretrained("{base}"), "{repo}")',
                "```",
            ]
    elif s.needs_occult_ft and s.remote_code:
        lines += [
            "`occult_ft.from_pretrained` restores the pruned routing the model was fine-tuned with. Without "
            "occult_ft, stock transformers does too when it may run the checkpoint's `occult_pruned_routing.py` "
            "(torch, transformers and safetensors only):",
            "",
            "```python",
            f"from transformers import {auto}",
            "",
            f'model = {auto}.from_pretrained("{repo}", trust_remote_code=True)',
            "```",
            "",
            "Without `trust_remote_code=True` it loads the same weights but routes with the original top-k, "
            "which is not what was trained.",
        ]
    elif s.needs_occult_ft:
        lines.append(
            "`occult_ft.from_pretrained` restores the pruned routing the model was fine-tuned with. Plain "
            f"`{auto}.from_pretrained` loads the same weights but routes with the original top-k, "
            "which is not what was trained."
        )
    else:
        reason = (
            "the routing budget is written in the model's own config (`n_group` / `topk_group`)"
            if s.native_routing
            else "the routing is the model's own"
        )
        lines += [
            f"Stock transformers runs it as well, since {reason}:",
            "",
            "```python",
            f"from transformers import {auto}",
            "",
            f'model = {auto}.from_pretrained("{repo}")',
            "```",
        ]
    return "\n".join(lines)


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


def build_model_card(
    checkpoint_dir: str | os.PathLike,
    repo_id: str | None = None,
    eval_results: Mapping[str, Any] | None = None,
    figure: str | os.PathLike | None = None,
    *,
    base_model: str | None = None,
    license: str | None = None,
):
    """Build the Hub model card of an occult_ft checkpoint directory.

    Args:
        checkpoint_dir: a full checkpoint (config.json, optionally with the `occult` block) or a LoRA
            adapter directory (adapter_config.json, optionally occult_config.json).
        repo_id: the Hub repo the card is for (used in the loading snippets); default: the folder name.
        eval_results: metric name -> value; default: `eval_results.json` (or the eval_* entries of
            `all_results.json`) in the directory. The block's `eval` dict is shown as well.
        figure: a PNG shown in the card. A path inside the directory is referenced as is; any other path
            by its file name (`push_checkpoint` copies it into the directory).
        base_model: override the recorded base model (the block's `base_model`, the adapter's
            `base_model_name_or_path`, or config.json's `_name_or_path`).
        license: license id for the metadata; default: the block's `license`, else `KNOWN_LICENSES`.

    Returns:
        `huggingface_hub.ModelCard` (`.save(path)` writes it; `.data` holds the metadata).

    Raises:
        ValueError: missing directory, a directory that is not a checkpoint, invalid JSON, a figure that
            is missing or not a PNG.
    """
    from huggingface_hub import ModelCard, ModelCardData

    s = describe_checkpoint(checkpoint_dir)
    if base_model:
        s.base_model = base_model
    repo = repo_id or os.path.basename(os.path.abspath(s.path))
    hub_base = _hub_id(s.base_model)
    s.base_model = hub_base or _local_name(s.base_model)
    recorded = s.block.extra if s.block is not None else {}
    license = license or recorded.get("license") or KNOWN_LICENSES.get(hub_base or "")
    tags = list(CARD_TAGS)
    if s.model_type:
        tags.append(s.model_type)
    if s.kind == "adapter":
        tags += ["lora", "peft"]
    if s.pruned:
        tags.append("collaboration-pruning")
    dataset = _hub_id(recorded.get("dataset"))
    data = ModelCardData(
        base_model=hub_base,
        library_name="peft" if s.kind == "adapter" else "transformers",
        license=license,
        tags=tags,
        datasets=[dataset] if dataset else None,
        pipeline_tag="text-generation",
    )

    what = "LoRA adapter" if s.kind == "adapter" else "checkpoint"
    base_text = (
        f"[`{hub_base}`](https://huggingface.co/{hub_base})"
        if hub_base
        else f"`{s.base_model or 'an MoE model'}`"
    )
    placed = s.block is not None and s.block.placement is not None
    if s.pruned and placed:
        action = "with collaboration-aware expert placement and collaboration pruning, then fine-tuned"
    elif s.pruned:
        action = "with collaboration pruning, then fine-tuned"
    elif placed:
        action = "with collaboration-aware expert placement (the same function as the base model, permuted experts)"
    else:
        action = "fine-tuned"
    sections = [
        f"# {repo.split('/')[-1]}",
        f"A {what} of {base_text} {action} with occult_ft, an implementation of Occult (Luo et al., ICML 2025, "
        "[arXiv:2505.13345](https://arxiv.org/abs/2505.13345)). Occult cuts the all-to-all traffic of expert "
        "parallelism: a token is sent once per device rather than once per expert, experts that are often "
        "selected together share a device, and optionally each token may reach only a budget of devices.",
        _placement_section(s),
    ]
    if s.kind == "adapter" and s.adapter:
        a = s.adapter
        rows = [
            (k, a[k])
            for k in (
                "peft_type",
                "r",
                "lora_alpha",
                "lora_dropout",
                "target_modules",
                "target_parameters",
                "modules_to_save",
            )
            if a.get(k) is not None
        ]
        sections.append("## Adapter\n\n" + _table(rows))
    other = [
        (k, v)
        for k, v in sorted(recorded.items())
        if k not in _EXTRA_SHOWN and not isinstance(v, (dict, list))
    ]
    if other:
        sections.append("## Other recorded settings\n\n" + _table(other))
    for section in (_comm_section(s), _eval_section(s, eval_results)):
        if section:
            sections.append(section)
    if figure is not None:
        name = figure_name(s.path, figure)
        sections.append(f"## Figure\n\n![occult_ft figure]({name})")
    sections.append(_usage_section(s, repo))
    sections.append("## Citation\n\n```bibtex\n" + OCCULT_CITATION + "\n```")
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    return ModelCard(content)


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
            shutil.copyfile(os.fspath(figure), target)
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
    `occult` tag): such a file may be replaced, a user's README may not."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False
    if not head.startswith("---"):
        return False
    meta = head.split("---", 2)[1] if head.count("---") >= 2 else ""
    return any(line.strip() == f"- {CARD_TAGS[1]}" for line in meta.splitlines())
