"""config.json of the recipes' models (no weights), and how `occult-ft plan` finds a model's config.

Files are named after the Hub id with `/` -> `--` (`mistralai--Mixtral-8x7B-v0.1.json`) and hold the
model's config.json as published (for GLM-4.7, DeepSeek-V3.2, MiniMax-M2, Qwen3-Next-80B-A3B and
Kimi-K2-Base its architecture and routing fields, as their recipes' headers say), so plans of the
recipes work offline. Their parameter counts match the published totals (tests/test_plan.py).
"""

from __future__ import annotations

import json
import os

from ..checkpoint.convert import DEEPSEEK_MODEL_TYPE, convert_config
from ..checkpoint.load import resolve_model_path
from ..fileio import read_json_object
from ..models.family import architecture_model_type

__all__ = ["as_config", "load_model_config", "shipped_config_path"]

_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def as_config(cfg, source: str = "config.json"):
    """A `PretrainedConfig` from a config or a config.json dict; DeepSeek-MoE as its qwen2_moe conversion, a
    config whose model_type transformers does not know as the architecture it is published as (Kimi-K2;
    `models.family.PUBLISHED_AS`); any other unknown model_type is a one-line `UnsupportedModelError`."""
    if not isinstance(cfg, dict):
        return cfg
    from transformers import AutoConfig

    d = dict(cfg)
    if d.get("model_type") == DEEPSEEK_MODEL_TYPE:
        d = convert_config(d)
    known = architecture_model_type(d, source)
    if known is not None:  # Kimi-K2: its own kimi_k2 is the DeepseekV3 architecture
        d["model_type"] = known
    kind = d.pop("model_type")
    for key in ("auto_map", "transformers_version", "architectures"):
        d.pop(key, None)
    return AutoConfig.for_model(kind, **d)


def shipped_config_path(model_id: str) -> str | None:
    """The config.json shipped in occult_ft/configs for a Hub id (`org/name`), or None."""
    path = os.path.join(_CONFIG_DIR, model_id.replace("/", "--") + ".json")
    return path if "/" in model_id and os.path.isfile(path) else None


def _config_file(path: str) -> str:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config {path!r} does not exist; pass a config.json file or a model directory")
    return path


def _read_config(path: str):
    """The config of a config.json file or a model directory (its file named in every error)."""
    file = _config_file(path)
    return as_config(read_json_object(file), file)  # one line naming the file when it is not a JSON object


def load_model_config(model: str | None, config: str | None = None):
    """The model's config: `config` (a config.json or directory) if given, else a local model directory,
    a config shipped for the Hub id, or the Hub (AutoConfig). DeepSeek-MoE gives its qwen2_moe conversion."""
    if config:
        return _read_config(config)
    if not model:
        raise ValueError("no model: set model_name_or_path in the recipe or pass --config PATH")

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _read_config(path)
    shipped = shipped_config_path(model)
    if shipped:
        return _read_config(shipped)
    try:
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(model, "config.json"), encoding="utf-8") as f:
            return as_config(json.load(f))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, no access: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"cannot read the config of {model!r} ({first}); pass --config PATH/config.json"
        ) from None
