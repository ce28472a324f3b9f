"""What an Occult run writes into and reads from its checkpoints, as hooks of `OccultTrainer`.

`transformers.Trainer` saves and resumes through a handful of methods; `OccultTrainer` overrides each
with one line that calls the function of the same role here, so the checkpoint logic lives in one file:

    save_checkpoint(trainer, dir, state)   `Trainer._save`: a pruned checkpoint (the `occult` block,
                                           similarity tables, remote code) or a LoRA adapter with its
                                           `occult_config.json`; expert shards gathered first
    adopt_checkpoint(trainer, dir)         before `Trainer.train` resumes: the checkpoint's placement
                                           and similarity tables become the run's
    load_checkpoint_weights(trainer, dir)  `Trainer._load_from_checkpoint` / `_load_best_model`: full
                                           checkpoints through `from_pretrained` (per-expert Hub layout
                                           -> fused tensors), sharded adapters cut to this rank's experts
    save_optimizer_shards / load_optimizer_shards
                                           `Trainer._save/_load_optimizer_and_scheduler`: the optimizer
                                           state of every expert-parallel position
    restore_expert_shards(trainer, dir)    after DeepSpeed restored rank 0's shards everywhere

The Trainer methods they stand in for are private API; `tests/test_trainer_contract.py` fails when a
transformers release renames one or changes its arguments.
"""

from __future__ import annotations

import os

from transformers import Trainer

from ..apply import permute_state_dict, placed_similarity
from ..checkpoint import (
    OccultBlock,
    block_placement,
    occult_config_fields,
    read_block,
    read_similarity,
    write_adapter_block,
    write_similarity,
)
from ..checkpoint.card import base_model_reference, run_settings, set_adapter_base
from ..fileio import read_json_object, umask_modes
from ..integrations.peft import is_peft_model
from ..models.registry import config_num_experts, get_arch, unwrap_model
from ..routing import apply_pruning, router_device_bias
from .expert_parallel import (
    gathered_state_dict,
    load_expert_lora_shards,
    load_expert_optimizer_state,
    load_expert_shards,
    load_sharded_adapter,
    save_expert_optimizer_state,
    shard_state_dict,
)
from .guards import check_finite_weights

__all__ = [
    "run_block",
    "save_checkpoint",
    "adopt_checkpoint",
    "check_checkpoint_model",
    "load_checkpoint_weights",
    "restore_expert_shards",
    "save_optimizer_shards",
    "load_optimizer_shards",
]


# ---- saving -------------------------------------------------------------------------------------
def run_block(trainer, placed: bool) -> OccultBlock:
    """The `occult` block written with every checkpoint of `trainer`'s run."""
    return OccultBlock.build(
        trainer.occult.pruning,
        trainer.occult.placement,
        placed=placed,
        num_devices=trainer.args.devices,
        num_nodes=trainer.args.nodes,
        base_model=base_model_reference(trainer.occult.base_model),
        model_type=get_arch(unwrap_model(trainer.model)).model_type,
        train_mode=trainer.args.train_mode,
        balance_loss_coef=trainer.args.balance_loss_coef,
        device_bias=router_device_bias(trainer.model),
        **run_settings(trainer.args),
        **_measured_comm_complexity(trainer),
    )


def _measured_comm_complexity(trainer) -> dict:
    """comm_complexity before (sequential placement, on the profile) and after (the latest logged value
    of the run's routing, eval preferred), for the model card."""
    out = {}
    metrics = getattr(trainer.occult.placement, "metrics", None) or {}
    if "comm_complexity_sequential" in metrics:
        out["comm_complexity_before"] = metrics["comm_complexity_sequential"]
    for key in ("eval_comm_complexity", "comm_complexity"):
        found = [entry[key] for entry in trainer.state.log_history if key in entry]
        if found:
            out["comm_complexity_after"] = found[-1]
            break
    return out


def _adapter_unplaceable(trainer) -> bool:
    """A LoRA adapter can be saved in the original expert order: the base on disk is not placed and the
    placement is known."""
    return not trainer.occult.base_placed and trainer.occult.placement is not None


def save_checkpoint(trainer, output_dir: str | None = None, state_dict=None, final: bool = False) -> None:
    """`Trainer._save` of an Occult run (collective under expert parallelism: every rank calls it).

    Args:
        output_dir: default `trainer.args.output_dir`.
        state_dict: as Trainer passes it (default: the model's).
        final: the save a user takes away (`save_model`), not a `checkpoint-N`: a LoRA adapter is then
            written in the base model's own expert order where the base on disk is not placed.
    """
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    if trainer.expert_parallel is not None:
        # every rank takes part in the gather; rank 0 then writes the standard HF layout
        state_dict = gathered_state_dict(trainer.model, state_dict)
        if not trainer.args.should_save:
            return
    if trainer.args.should_save:  # a diverged run is never saved as a result
        check_finite_weights(state_dict if state_dict is not None else trainer.model.state_dict(), output_dir)
    similarity = trainer.occult.similarity
    if is_peft_model(trainer.model):
        block = run_block(trainer, placed=trainer.occult.base_placed)
        if final and _adapter_unplaceable(trainer):
            # the adapter a user takes away: in the base model's own expert order, so stock PEFT on the
            # stock base computes the trained model (without the pruning); checkpoint-N folders keep the
            # live (placed) order for exact resumption
            placement = trainer.occult.placement
            state_dict = state_dict if state_dict is not None else trainer.model.state_dict()
            adapter = {k: v for k, v in state_dict.items() if "lora_" in k or ".modules_to_save." in k}
            state_dict = {**state_dict, **permute_state_dict(trainer.model, adapter, placement, inverse=True)}
            similarity = placed_similarity(similarity, placement, inverse=True)
            block = block.with_changes(expert_order="original")
        Trainer._save(trainer, output_dir, state_dict=state_dict)
        if trainer.args.should_save:
            write_adapter_block(output_dir, block)
            if trainer.occult.base_model:  # named by Hub id, or `embedded`, when it is one
                set_adapter_base(output_dir, trainer.occult.base_model)
    else:
        # the model's own save hook (`apply_occult`) reads the block from its config: this run's block,
        # not the one it was loaded with (a changed budget is saved as such)
        base = unwrap_model(trainer.model)
        with occult_config_fields(base.config, run_block(trainer, placed=True), output_dir):
            Trainer._save(trainer, output_dir, state_dict=state_dict)
    if trainer.args.should_save:
        write_similarity(output_dir, similarity)
        umask_modes(output_dir)  # safetensors writes the weights 0600


# ---- resuming -------------------------------------------------------------------------------------
_SHAPE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def check_checkpoint_model(model, checkpoint: str) -> None:
    """Refuse, in one line naming the checkpoint, resuming `model` from a checkpoint of another model:
    its config.json (a full checkpoint) or its block (a LoRA adapter) must describe `model`."""
    base = unwrap_model(model)
    ours = base.config.to_dict()  # type: ignore[operator, union-attr]
    ours["num_experts"] = config_num_experts(ours)
    path = os.path.join(checkpoint, "config.json")
    if os.path.isfile(path):
        theirs = read_json_object(path)
        theirs["num_experts"] = config_num_experts(theirs)
        fields: tuple[str, ...] = (*_SHAPE_FIELDS, "num_experts")
    else:
        block = read_block(checkpoint)
        theirs, fields = {"model_type": block.model_type if block else None}, ("model_type",)
    for name in fields:
        if theirs.get(name) is not None and theirs.get(name) != ours.get(name):
            raise ValueError(
                f"checkpoint {checkpoint!r} is not of this run's model: its {name} is {theirs[name]!r}, the "
                f"model's ({ours.get('_name_or_path') or ours['model_type']}) is {ours.get(name)!r}; resume "
                "from a checkpoint of this model, or train the model the checkpoint was written for"
            )


def adopt_checkpoint(trainer, checkpoint: str) -> None:
    """Make the placement and similarity tables those of `checkpoint` (its weights follow them), after
    checking that it is a checkpoint of the run's model (`check_checkpoint_model`)."""
    check_checkpoint_model(trainer.model, checkpoint)
    block, similarity = read_block(checkpoint), read_similarity(checkpoint)
    theirs = block_placement(block, get_arch(unwrap_model(trainer.model)).model_type)
    ours = trainer.occult.placement
    if theirs is not None and (ours is None or theirs.groups != ours.groups):
        if is_peft_model(trainer.model):
            raise ValueError(
                f"checkpoint {checkpoint!r} placed the experts differently from this trainer; LoRA adapters "
                "need the base placed like the checkpoint: set resume_from_checkpoint in the OccultConfig "
                "before building the OccultTrainer"
            )
        trainer.occult.placement = theirs
    if similarity is not None:
        trainer.occult.similarity = similarity
    same_layout = block is not None and block.num_devices == trainer.args.devices
    bias = block.device_bias_tensors() if same_layout and block is not None else None
    if similarity is not None or bias is not None:  # the bias learnt so far continues
        apply_pruning(
            trainer.model, trainer.occult.pruning, similarity=trainer.occult.similarity, device_bias=bias
        )


def _load_full_checkpoint(trainer, path: str) -> bool:
    """A full (non-LoRA) checkpoint's weights through `from_pretrained`: `save_pretrained` writes MoE
    experts in the per-expert Hub layout while the live model holds fused tensors, so Trainer's raw
    `load_state_dict` would skip the experts. False where Trainer's own loading applies (LoRA,
    DeepSpeed, FSDP, no config.json)."""
    if is_peft_model(trainer.model) or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return False
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    base = unwrap_model(trainer.model)
    loaded = type(base).from_pretrained(path, dtype=next(base.parameters()).dtype)  # type: ignore[attr-defined]
    state = loaded.state_dict()
    if trainer.expert_parallel is not None:
        state = shard_state_dict(base, state)
    result = base.load_state_dict(state, strict=False)
    del loaded
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {path!r} does not fit this model (missing {result.missing_keys[:4]}, unexpected "
            f"{result.unexpected_keys[:4]}); resume with the model it was trained from"
        )
    return True


def load_checkpoint_weights(trainer, path: str | None) -> bool:
    """Load `path`'s weights into `trainer.model` where Trainer's own loading would get them wrong (full
    checkpoints; LoRA adapters of an expert-parallel run without DeepSpeed, whose files hold all E
    experts' factors); returns False where Trainer's own loading applies."""
    if not path:
        return False
    if _load_full_checkpoint(trainer, path):
        return True
    if (
        trainer.expert_parallel is not None
        and is_peft_model(trainer.model)
        and not trainer.is_deepspeed_enabled
    ):
        load_sharded_adapter(trainer.model, path)
        return True
    return False


def restore_expert_shards(trainer, path: str) -> None:
    """After the DeepSpeed engine restored rank 0's shards everywhere: each rank takes its own."""
    if is_peft_model(trainer.model):
        load_expert_lora_shards(trainer.model, path)
    else:
        load_expert_shards(trainer.model, path)


def save_optimizer_shards(trainer, output_dir: str) -> None:
    """After `Trainer._save_optimizer_and_scheduler`: the optimizer state of every expert-parallel
    position (Trainer writes rank 0's only), when the shards' gradients are ours to reduce."""
    if trainer.expert_parallel is not None and not trainer.is_deepspeed_enabled:
        save_expert_optimizer_state(trainer.optimizer, trainer.expert_parallel, output_dir)


def load_optimizer_shards(trainer, checkpoint: str | None) -> None:
    """After `Trainer._load_optimizer_and_scheduler`: this rank's expert shards of the optimizer state
    (or, under DeepSpeed, of the weights)."""
    if checkpoint is None or trainer.expert_parallel is None:
        return
    if trainer.is_deepspeed_enabled:
        restore_expert_shards(trainer, checkpoint)
    else:
        load_expert_optimizer_state(trainer.optimizer, trainer.expert_parallel, checkpoint)
