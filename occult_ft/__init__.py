"""occult_ft: cheaper expert-parallel MoE training and serving (the Occult method, ICML 2025).

Three ways to cut the all-to-all of expert parallelism:
1. exact savings: a de-duplicated all-to-all sends a token once per device, not once per expert
   (`occult_ft.dispatch`);
2. placement: experts that are often co-selected share a device (`occult_ft.placement`);
3. collaboration pruning: each token reaches at most `max_devices_per_token` devices, and
   fine-tuning restores quality (`occult_ft.routing`, `occult_ft.trainer`).
"""

from .checkpoint import from_pretrained, save_pruned
from .metrics import comm_complexity, intra_share, routing_report
from .models import find_moe_layers, get_arch, supported_model_types
from .routing import CRITERIA, PruningConfig, apply_pruning

__version__ = "0.1.0"

_LAZY = {
    "OccultConfig": "occult_ft.trainer",
    "OccultTrainer": "occult_ft.trainer",
    "train": "occult_ft.trainer",
}


def __getattr__(name: str):
    """`OccultConfig`, `OccultTrainer` and `train` import transformers' Trainer: load them on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'occult_ft' has no attribute {name!r}")


__all__ = [
    "CRITERIA",
    "OccultConfig",
    "OccultTrainer",
    "train",
    "PruningConfig",
    "apply_pruning",
    "comm_complexity",
    "find_moe_layers",
    "from_pretrained",
    "get_arch",
    "intra_share",
    "routing_report",
    "save_pruned",
    "supported_model_types",
    "__version__",
]
