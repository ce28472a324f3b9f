"""Expert parallelism under a DeepSpeed engine (ZeRO stages 0, 1 and 2): which pieces we use, and why.

occult_ft shards the experts itself (`occult_ft.dispatch.shard_experts`, the de-duplicated "occult_ep"
all-to-all); DeepSpeed only has to (1) provide the process groups, (2) reduce the gradients of expert
shards over the right ranks and (3) partition their optimizer state over the right ranks. It has all
three for its own MoE layers; this module plugs our shards into that machinery. What is used from
DeepSpeed 0.19.8, the gap worked around and what is not used (and why): docs/expert-parallel.md,
"DeepSpeed: what is used and why".

    deepspeed_expert_groups / expert_group_name   the EP and EDP groups (`ep_size_{D}`)
    mark_expert_parameters                        `allreduce = False`, `group_name`: reduced over EDP
    attach_moe_marker                             the parameter-free `MoE` that turns the engine's MoE path on
    split_moe_param_groups                        optimizer groups marked `moe`, partitioned over EDP
    read_deepspeed_config / check_deepspeed_config   the config checks (no AutoEP, no ZeRO-3, clipping)

Legend: D expert-parallel size, W data-parallel world size, EP / EDP expert(-data)-parallel groups.
`deepspeed` is imported only inside these functions.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import nn

from ..fileio import read_json_object

__all__ = [
    "MARKER_ATTRIBUTE",
    "expert_group_name",
    "deepspeed_expert_groups",
    "mark_expert_parameters",
    "attach_moe_marker",
    "split_moe_param_groups",
    "read_deepspeed_config",
    "check_deepspeed_config",
]

MARKER_ATTRIBUTE = "occult_deepspeed_moe"


def expert_group_name(expert_parallel_size: int) -> str:
    """DeepSpeed's name for the EP/EDP groups of size D: `ep_size_{D}`."""
    return f"ep_size_{int(expert_parallel_size)}"


def deepspeed_expert_groups(expert_parallel_size: int):
    """DeepSpeed's EP and EDP groups of size D for this rank, created on first use (collective).

    Every rank must call it (DeepSpeed creates every group on every rank, in the same order). It also
    initialises `deepspeed.comm` over the existing torch.distributed group when nobody has yet.

    Returns:
        (ep_group, ep_ranks, edp_group, edp_ranks): torch process groups and their global ranks.
    """
    import deepspeed
    from deepspeed.utils import groups

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    name = expert_group_name(expert_parallel_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(int(expert_parallel_size))
    return (
        groups._get_expert_parallel_group(name),
        [int(r) for r in groups._get_expert_parallel_group_ranks(name)],
        groups._get_expert_data_parallel_group(name),
        [int(r) for r in groups._get_expert_data_parallel_group_ranks(name)],
    )


def mark_expert_parameters(params: Iterable[nn.Parameter], expert_parallel_size: int) -> None:
    """Mark expert shards as DeepSpeed expert parameters (`deepspeed.moe.utils.is_moe_param`): the engine
    then reduces their gradients over the EDP group of `ep_size_{D}` only."""
    name = expert_group_name(expert_parallel_size)
    for p in params:
        p.allreduce = False  # type: ignore[attr-defined]
        p.group_name = name  # type: ignore[attr-defined]


@lru_cache(maxsize=1)
def _marker_class():
    from deepspeed.moe.layer import MoE

    class OccultDeepSpeedMoEMarker(MoE):
        """A parameter-free `MoE` that tells the DeepSpeed engine the model holds expert parameters.

        It never runs: the experts are sharded in place inside the HF MoE blocks and dispatched by
        the "occult_ep" kernel. `MoE.__init__` (which builds a gate and experts) is skipped on purpose.
        """

        def __init__(self, expert_parallel_size: int, num_experts: int):
            nn.Module.__init__(self)
            self.ep_size = int(expert_parallel_size)
            self.expert_group_name = expert_group_name(expert_parallel_size)
            self.num_experts = int(num_experts)
            self.num_local_experts = 0  # DeepSpeed writes/reads no per-expert files for it
            self.enable_expert_tensor_parallelism = False

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            if use_data_before_expert_parallel_:
                raise ValueError(
                    "use_data_before_expert_parallel_=true reorders DeepSpeed's expert groups; occult_ft shards "
                    "experts over consecutive ranks, remove that setting from the DeepSpeed config"
                )
            deepspeed_expert_groups(self.ep_size)

        def forward(self, *args, **kwargs):
            raise RuntimeError(
                "occult_deepspeed_moe is a marker for the DeepSpeed engine and has no forward; the experts "
                "run inside the model's MoE blocks"
            )

        def extra_repr(self) -> str:
            return f"ep_size={self.ep_size}, num_experts={self.num_experts}"

    return OccultDeepSpeedMoEMarker


def attach_moe_marker(model: nn.Module, expert_parallel_size: int, num_experts: int) -> nn.Module:
    """Add the parameter-free DeepSpeed `MoE` marker as `model.occult_deepspeed_moe` (idempotent).

    Call it before `deepspeed.initialize` (i.e. before `Trainer.train`): the engine looks for `MoE`
    modules once, when it is built. Returns the marker.
    """
    marker = getattr(model, MARKER_ATTRIBUTE, None)
    if marker is None:
        marker = _marker_class()(expert_parallel_size, num_experts)
        model.add_module(MARKER_ATTRIBUTE, marker)
    return marker


def split_moe_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Put the marked expert parameters of `optimizer` into DeepSpeed MoE param groups, in place.

    Uses `deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`: each group with
    expert parameters gets a twin (same hyper-parameters, `moe=True`, `name=ep_size_{D}`) holding them.
    Groups left empty are dropped. Call before the first optimizer step (the state is empty then).
    Idempotent: an optimizer that already has MoE groups is returned unchanged, and so is a placeholder
    without `param_groups` (accelerate's `DummyOptim` for a config with an `"optimizer"` section: the
    engine then builds the optimizer and splits its groups itself).
    """
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    groups = getattr(optimizer, "param_groups", None)
    if groups is None:  # accelerate's DummyOptim: the engine builds the optimizer and splits it itself
        return optimizer
    if any(g.get("moe", False) for g in groups):
        return optimizer
    if not any(is_moe_param(p) for g in groups for p in g["params"]):
        return optimizer
    if any(optimizer.state.get(p) for g in groups for p in g["params"]):
        raise RuntimeError("split_moe_param_groups must run before the first optimizer step")
    for index, group in enumerate(groups):
        group.setdefault("name", f"occult_group_{index}")
    split = split_params_into_different_moe_groups_for_optimizer(list(groups))
    optimizer.param_groups = [g for g in split if g["params"]]
    return optimizer


def read_deepspeed_config(config) -> dict:
    """The DeepSpeed config as a dict, from a dict or a JSON file path (None -> {})."""
    if config is None or config == "":
        return {}
    if isinstance(config, dict):
        return config
    path = str(config)
    if not os.path.isfile(path):
        raise ValueError(
            f"deepspeed={path!r} is not a file; pass the path of a DeepSpeed JSON config or a dict"
        )
    return read_json_object(path)  # one line naming the file when it is not a JSON object


def check_deepspeed_config(config, expert_parallel_size: int, max_grad_norm: float | None = None) -> None:
    """Refuse DeepSpeed settings that cannot work with occult_ft's expert parallelism (one-line errors).

    Args:
        config: the DeepSpeed config (dict or JSON path).
        expert_parallel_size: D; for D = 1 only ZeRO stage 3 is refused.
        max_grad_norm: the Trainer's value, which a `"gradient_clipping": "auto"` takes.

    Raises:
        ValueError: for ZeRO stage 3 (any D), or an AutoEP `"expert_parallel"` section (D > 1).

    Warns:
        UserWarning: for ZeRO stage 0 with gradient clipping on: DeepSpeed's stage-0 clipping
            (`deepspeed.runtime.utils.clip_grad_norm_`) averages the per-rank norms instead of taking the
            norm of the whole model, so clipped steps differ (slightly) from a single-process run.
    """
    ds = read_deepspeed_config(config)
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    stage = int(stage) if str(stage).isdigit() else 0  # DeepSpeed itself rejects anything else
    if stage >= 3 and expert_parallel_size <= 1:
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage} partitions every weight while the model loads, and placement (a "
            "permutation of the expert tensors) and the pruned routers need them whole; use ZeRO-1 or ZeRO-2 "
            "(recipes/ds_zero2.json) or LoRA"
        )
    if expert_parallel_size <= 1:
        return
    if stage >= 3:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} works with DeepSpeed ZeRO stages 0-2, not stage {stage} "
            "(DeepSpeed refuses stage 3 for non-AutoEP MoE parameters); set zero_optimization.stage to 1 or 2"
        )
    auto_ep = ds.get("expert_parallel")
    if auto_ep and (not isinstance(auto_ep, dict) or auto_ep.get("enabled", True)):
        raise ValueError(
            f'the DeepSpeed config enables AutoEP ("expert_parallel") and expert_parallel_size={expert_parallel_size} '
            'also shards the experts; remove the "expert_parallel" section (occult_ft does the expert parallelism)'
        )
    clipping = ds.get("gradient_clipping", 0.0)
    if clipping == "auto":
        clipping = max_grad_norm or 0.0
    if stage == 0 and float(clipping or 0.0) > 0:
        warnings.warn(
            f"expert_parallel_size={expert_parallel_size} with ZeRO stage 0 and gradient clipping {clipping}: DeepSpeed "
            "clips by the mean of the per-rank norms, not the norm of the whole model; use ZeRO stage 1 or 2 for "
            "exact clipping",
            stacklevel=2,
        )
