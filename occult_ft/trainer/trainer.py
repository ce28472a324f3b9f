"""`OccultTrainer`: a `transformers.Trainer` that fine-tunes an MoE under a device budget per token.

On construction the model is placed, pruned and set up for its `train_mode` (see
`occult_ft.trainer.prepare`). During training:

- `compute_loss` = the model's language-modelling loss (its own auxiliary loss is off: it ignores
  pruning) + `balance_loss_coef` * the pruning-aware balance loss of `occult_ft.trainer.losses`, scaled
  so that gradient accumulation and data parallelism leave it a plain mean over micro-batches;
  with `distill_coef` > 0 and a budget, + `distill_coef` * KL(unpruned teacher || pruned student)
  (`occult_ft.trainer.distill`), logged as `distill_kl`;
- every forward feeds a `RoutingMeter`; each log line carries `comm_complexity`, `intra_share`,
  `removed_mass`, `load_imbalance`, `max_token_devices`, `balance_loss` and `padding_share` averaged
  since the last line;
  evaluation reports the same routing metrics (prefixed `eval_`) plus `eval_perplexity`;
- checkpoints are pruned checkpoints: a full run writes a standard HF checkpoint whose `config.json`
  carries the `occult` block (placement provenance, budget, criterion) plus
  `occult_similarity.safetensors`; a LoRA run writes the adapter directory plus `occult_config.json`.
  `occult_ft.from_pretrained(dir)` loads either with the pruned routing active;
- resuming takes the placement and similarity tables from the checkpoint, so a resumed run ends where
  the uninterrupted one does;
- with `expert_parallel_size` D > 1 (launched on W processes, W % D == 0) the experts are sharded over
  groups of D processes after placement and pruning (`occult_ft.trainer.expert_parallel`), with or
  without DeepSpeed (ZeRO 0-2); checkpoints gather the shards back into the standard HF layout.
"""

from __future__ import annotations

import inspect
import math
import os

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from ..apply import permute_state_dict, placed_similarity
from ..checkpoint import (
    attach_occult_save,
    occult_block,
    occult_config_fields,
    placement_from_block,
    read_block,
    read_similarity,
    write_adapter_block,
    write_similarity,
)
from ..data.batching import real_token_mask
from ..models.registry import unwrap_model
from ..routing import apply_pruning, pruned_routers
from .config import OccultConfig, check_before_loading
from .distill import distillation_kl, teacher_logits
from .expert_parallel import (
    ExpertParallelGroups,
    clip_expert_parallel_grad_norm,
    gathered_state_dict,
    load_expert_lora_shards,
    load_expert_optimizer_state,
    load_expert_shards,
    load_sharded_adapter,
    reduce_expert_gradients,
    save_expert_optimizer_state,
    setup_expert_parallel,
    shard_state_dict,
)
from .losses import balance_loss, balance_loss_factor
from .meter import RoutingMeter
from .prepare import OccultSetup, prepare_model, resolve_checkpoint
from .sharded_load import can_load_sharded, load_sharded_training_model

logger = logging.get_logger(__name__)

__all__ = ["OccultTrainer", "tokenize_for_training", "load_training_model", "check_seq_len"]


def tokenize_for_training(dataset, tokenizer, args: OccultConfig):
    """Tokenize raw rows (any layout of `occult_ft.data.load_text_dataset`: text, instruction, prompt /
    completion, messages; a `Dataset` or a streamed `IterableDataset`) as `args` says (`seq_len`,
    `packing`, `response_only`); tokenized data (an `input_ids` column) and non-`datasets` objects are
    returned unchanged."""
    from datasets import Dataset, IterableDataset

    if not isinstance(dataset, (Dataset, IterableDataset)):
        return dataset
    from ..data import dataset_columns, dataset_layout, tokenize_dataset

    if dataset_layout(dataset_columns(dataset)) == "tokenized":
        return dataset
    if tokenizer is None:
        raise ValueError(
            "the dataset holds raw text; pass processing_class=<tokenizer> so it can be tokenized"
        )
    with args.main_process_first(desc="tokenizing"):
        return tokenize_dataset(
            dataset, tokenizer, args.seq_len, packing=args.packing, response_only=args.response_only
        )


def check_seq_len(model, seq_len: int) -> None:
    """Refuse a `seq_len` above the model's `max_position_embeddings` (its losses would be silently wrong)."""
    config = getattr(unwrap_model(model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's max_position_embeddings={limit}; set seq_len <= {limit}"
        )


def load_training_model(path: str, args: OccultConfig):
    """(model, tokenizer) for `path`: a model dir or Hub id, `embedded`, a pruned checkpoint (pruning
    active) or an occult_ft LoRA adapter directory (loaded trainable)."""
    from transformers import AutoTokenizer

    from ..checkpoint import from_pretrained

    if path == "embedded":
        from ..embedded import embedded_model_path

        path = embedded_model_path()
    check_before_loading(args)
    dtype = None if args.model_dtype == "auto" else getattr(torch, args.model_dtype)
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    if is_adapter and args.train_mode != "lora":
        raise ValueError(
            f"model_name_or_path={path!r} is a LoRA adapter; set train_mode='lora' to continue training it"
        )
    model = (
        from_pretrained(path, dtype=dtype, is_trainable=True)
        if is_adapter
        else from_pretrained(path, dtype=dtype)
    )
    tokenizer = None
    sources = [path] + ([unwrap_model(model).config._name_or_path] if is_adapter else [])
    for source in sources:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            break
        except (OSError, ValueError, KeyError):
            continue
    return model, tokenizer


def _may_move_to(args: OccultConfig, model: nn.Module) -> bool:
    """Whether the model may go to `args.device` before Trainer does (to profile there)."""
    if args.deepspeed or args.fsdp or getattr(model, "hf_device_map", None) or args.use_cpu:
        return False
    if not torch.cuda.is_available():
        return False
    return next(model.parameters()).device.type == "cpu"


class OccultTrainer(Trainer):
    """Trainer for Occult fine-tuning: placement, collaboration pruning and pruning-aware balancing.

    Args:
        model: a supported transformers MoE model, a pruned occult_ft checkpoint, an occult_ft LoRA
            model, or a path / Hub id (loaded with its tokenizer).
        args: the run's `OccultConfig` (default: `OccultConfig()`).
        data_collator: default `occult_ft.data.make_collator` (padded or packed batches; packed ones as one
            flat row for flash-attention kernels).
        train_dataset / eval_dataset: tokenized rows (`input_ids`, `labels`, `attention_mask` or
            `position_ids`) or raw rows of any layout of `occult_ft.data.load_text_dataset` (text,
            instruction, prompt / completion, messages; `Dataset` or `IterableDataset`), tokenized here
            with `args.seq_len`, `args.packing`, `args.response_only`.
        processing_class: the tokenizer.
        placement: a `Placement` that overrides `args.placement`.
        kwargs: passed to `transformers.Trainer`.

    Attributes:
        occult: the `OccultSetup` (pruning config, placement, similarity tables, expert -> device maps).
    """

    def __init__(
        self,
        model: nn.Module | str | None = None,
        args: OccultConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        placement=None,
        **kwargs,
    ):
        if args is None:
            args = OccultConfig()
        if not isinstance(args, OccultConfig):
            raise TypeError(
                f"args must be an OccultConfig, got {type(args).__name__}; build one with OccultConfig(...)"
            )
        if model is None:
            raise ValueError("OccultTrainer needs a model (a transformers MoE model or a model path)")
        check_before_loading(args)
        if isinstance(model, str):
            flat = getattr(args, "exchange", "flat") == "flat"
            if args.expert_parallel_size > 1 and flat and can_load_sharded(model):
                # each rank reads only its own expert block from the safetensors files
                model, tokenizer = load_sharded_training_model(model, args, placement)
            else:
                model, tokenizer = load_training_model(model, args)
            processing_class = processing_class if processing_class is not None else tokenizer
        train_dataset = tokenize_for_training(train_dataset, processing_class, args)
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                k: tokenize_for_training(v, processing_class, args) for k, v in eval_dataset.items()
            }
        else:
            eval_dataset = tokenize_for_training(eval_dataset, processing_class, args)
        check_seq_len(model, args.seq_len)
        if data_collator is None:
            from ..data import flat_packing, make_collator, pad_token_id

            data_collator = make_collator(
                pad_token_id=pad_token_id(processing_class, unwrap_model(model)), flatten=flat_packing(model)
            )
        if _may_move_to(args, model):
            model = model.to(args.device)
        checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        model, setup = prepare_model(model, args, train_dataset, data_collator, placement, checkpoint)
        self.occult: OccultSetup = setup
        self.expert_parallel: ExpertParallelGroups | None = None
        if args.expert_parallel_size > 1:
            self.expert_parallel = setup_expert_parallel(model, args)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self._meters = {"train": RoutingMeter(args.devices), "eval": RoutingMeter(args.devices)}
        self._routers = pruned_routers(self.model)
        self._distill_kl_sum, self._distill_kl_count = torch.zeros((), dtype=torch.float64), 0
        forward = inspect.signature(unwrap_model(self.model).forward).parameters
        self._router_logits_flag = "output_router_logits" in forward

    # ---- loss ---------------------------------------------------------------------------------
    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool(
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None)
            or self.compute_loss_func is not None
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """LM loss + `balance_loss_coef` * pruning-aware balance loss (training only); feeds the routing meter."""
        if self._router_logits_flag:
            inputs = {**inputs, "output_router_logits": False}
        mask = real_token_mask(inputs)
        labels = inputs.get("labels")  # Trainer may pop it (label smoothing, compute_loss_func)
        if "token_mask" in inputs:  # a packed batch (occult_ft.data.batching): the model does not take it
            inputs = {k: v for k, v in inputs.items() if k != "token_mask"}
        if "position_ids" in inputs and "attention_mask" not in inputs:
            inputs = {**inputs, "use_cache": False}  # a cache would turn the packed-sequence mask off
        mask_T = mask.reshape(-1).bool() if mask is not None else None
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        records = self._records()
        training = model.training
        meter = self._meters["train" if training else "eval"]
        meter.update(records, self.occult.expert_device, mask_T)
        if mask is not None:
            meter.add_padding(mask)
        if training and self.args.balance_loss_coef > 0:
            aux = balance_loss(records, mask_T)
            if aux is not None:
                meter.add_balance_loss(aux)
                accumulation = (
                    getattr(self, "current_gradient_accumulation_steps", None)
                    or self.args.gradient_accumulation_steps
                )
                factor = balance_loss_factor(self._loss_is_scaled_for_ga(num_items_in_batch), accumulation)
                loss = loss + (self.args.balance_loss_coef * factor) * aux.to(loss.device, loss.dtype)
        if training and self.args.distill_coef > 0 and self.occult.pruning.active:
            kl = self._distillation_loss(model, inputs, labels, outputs)
            if kl is not None:
                self._distill_kl_sum += kl.detach().double().cpu()
                self._distill_kl_count += 1
                factor = self._mean_loss_factor(num_items_in_batch)
                loss = loss + (self.args.distill_coef * factor) * kl.to(loss.device, loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def _mean_loss_factor(self, num_items_in_batch) -> float:
        """Factor for a per-micro-batch mean added to the model loss (see `balance_loss_factor`)."""
        accumulation = (
            getattr(self, "current_gradient_accumulation_steps", None)
            or self.args.gradient_accumulation_steps
        )
        return balance_loss_factor(self._loss_is_scaled_for_ga(num_items_in_batch), accumulation)

    def _distillation_loss(self, model, inputs, labels, outputs) -> torch.Tensor | None:
        """KL(unpruned teacher || pruned student) on the labelled positions (`trainer.distill`)."""
        logits = getattr(outputs, "logits", None) if not isinstance(outputs, dict) else outputs.get("logits")
        if labels is None or logits is None:
            return None
        teacher = teacher_logits(model, inputs)
        return distillation_kl(logits, teacher, labels, self.args.distill_temperature)

    def _records(self) -> dict:
        """layer index -> the last `RouterRecord` of each router (read from the routers found at init, so
        that any wrapper around the model, DDP or a DeepSpeed engine, is irrelevant)."""
        records = {}
        for layer, router in self._routers:
            record = getattr(router, "occult_record", None)
            if record is not None:
                records[layer.index] = record
        return records

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._reduces_expert_gradients() and self.accelerator.sync_gradients:
            reduce_expert_gradients(self.model, self.expert_parallel)
        # the records keep the last routing for inspection, but not the probabilities' graph
        for _, router in self._routers:
            record = getattr(router, "occult_record", None)
            if record is not None:
                record.probs = None
        return loss

    # ---- expert parallelism without DeepSpeed: shard gradients and the norm are ours --------------
    def _reduces_expert_gradients(self) -> bool:
        return self.expert_parallel is not None and not self.is_deepspeed_enabled

    def _clip_grad_norm(self, model):
        if self._reduces_expert_gradients():
            return clip_expert_parallel_grad_norm(self.model, self.expert_parallel, self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._reduces_expert_gradients():
            grad_norm = clip_expert_parallel_grad_norm(self.model, self.expert_parallel, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_optimizer(self, *args, **kwargs):
        """`Trainer.create_optimizer`; under DeepSpeed with expert parallelism the expert shards go into
        DeepSpeed's MoE param groups (`occult_ft.integrations.deepspeed.split_moe_param_groups`)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.expert_parallel is not None and self.is_deepspeed_enabled:
            from ..integrations.deepspeed import split_moe_param_groups

            split_moe_param_groups(optimizer)
        return optimizer

    # ---- logging ------------------------------------------------------------------------------
    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.accelerator.num_processes <= 1 or not torch.distributed.is_initialized():
            return tensor
        tensor = tensor.to(self.args.device)
        torch.distributed.all_reduce(
            tensor, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        )
        return tensor.cpu()

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            logs.update(self._meters["train"].summary(self._reduce))
            if self.args.distill_coef > 0 and self.occult.pruning.active:
                sums = torch.tensor(
                    [float(self._distill_kl_sum), float(self._distill_kl_count)], dtype=torch.float64
                )
                pair = self._reduce(sums, "sum").cpu()
                if pair[1] > 0:
                    logs["distill_kl"] = float(pair[0] / pair[1])
                self._distill_kl_sum, self._distill_kl_count = torch.zeros((), dtype=torch.float64), 0
        super().log(logs, *args, **kwargs)

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        self._meters["eval"].reset()
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        for key, value in self._meters["eval"].summary(self._reduce).items():
            if key != "balance_loss":
                output.metrics[f"{metric_key_prefix}_{key}"] = value
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:
            output.metrics[f"{metric_key_prefix}_perplexity"] = math.exp(min(loss, 50.0))
        return output

    # ---- saving -------------------------------------------------------------------------------
    def occult_block(self, placed: bool) -> dict:
        """The `occult` block written with every checkpoint of this run."""
        return occult_block(
            self.occult.pruning,
            self.occult.placement,
            placed=placed,
            num_nodes=self.args.nodes,
            base_model=self.occult.base_model,
            train_mode=self.args.train_mode,
            balance_loss_coef=self.args.balance_loss_coef,
            **self._measured_comm_complexity(),
        )

    def _measured_comm_complexity(self) -> dict:
        """comm_complexity before (sequential placement, on the profile) and after (the latest logged
        value of this run's routing, eval preferred), for the model card."""
        out = {}
        metrics = getattr(self.occult.placement, "metrics", None) or {}
        if "comm_complexity_sequential" in metrics:
            out["comm_complexity_before"] = metrics["comm_complexity_sequential"]
        for key in ("eval_comm_complexity", "comm_complexity"):
            found = [entry[key] for entry in self.state.log_history if key in entry]
            if found:
                out["comm_complexity_after"] = found[-1]
                break
        return out

    def create_model_card(self, *args, **kwargs) -> None:
        """The Occult model card (placement, budget, measured comm_complexity and its figure, eval
        results, how to load) instead of Trainer's generic one; `push_to_hub` uploads it."""
        if not self.is_world_process_zero():
            return
        from ..hub import last_eval_metrics, make_comm_complexity_figure, write_model_card

        output_dir = self.args.output_dir
        figure = None
        data = self.args.eval_dataset or self.args.dataset or "embedded"
        try:
            figure = make_comm_complexity_figure(output_dir, data=data)
        except Exception as exc:  # noqa: BLE001 - a figure must not cost the user the push of a finished run
            logger.warning(
                f"model card without its comm_complexity figure: measuring it on {data!r} failed ({exc})"
            )
        write_model_card(
            output_dir,
            repo_id=self.hub_model_id,
            eval_results=last_eval_metrics(self.state.log_history) or None,
            figure=figure,
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; a save the user asks for (not an intermediate checkpoint) also writes the
        Occult model card (README.md: placement, budget, measured comm_complexity, how to load) beside
        the model. The card's figure is only drawn on push, where the measurement is worth its cost."""
        self._occult_final_save = not _internal_call
        try:
            super().save_model(output_dir, _internal_call=_internal_call)
        finally:
            self._occult_final_save = False
        if _internal_call or not self.is_world_process_zero():
            return
        from ..hub import last_eval_metrics, write_model_card

        try:
            write_model_card(
                output_dir if output_dir is not None else self.args.output_dir,
                repo_id=getattr(self, "hub_model_id", None) or self.args.hub_model_id,
                eval_results=last_eval_metrics(self.state.log_history) or None,
            )
        except (OSError, ValueError) as exc:  # the weights are saved; a card must not fail the run
            logger.warning(f"saved the model without its model card: {exc}")

    def _is_lora(self) -> bool:
        from ..integrations.peft import is_peft_model

        return is_peft_model(self.model)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.expert_parallel is not None:
            # every rank takes part in the gather; rank 0 then writes the standard HF layout
            state_dict = gathered_state_dict(self.model, state_dict)
            if not self.args.should_save:
                return
        similarity = self.occult.similarity
        if self._is_lora():
            block = self.occult_block(placed=self.occult.base_placed)
            if getattr(self, "_occult_final_save", False) and self._adapter_unplaceable():
                # the adapter a user takes away: in the base model's own expert order, so stock PEFT on
                # the stock base computes the trained model (without the pruning); checkpoint-N folders
                # keep the live (placed) order for exact resumption
                placement = self.occult.placement
                state_dict = state_dict if state_dict is not None else self.model.state_dict()
                adapter = {k: v for k, v in state_dict.items() if "lora_" in k or ".modules_to_save." in k}
                state_dict = {
                    **state_dict,
                    **permute_state_dict(self.model, adapter, placement, inverse=True),
                }
                similarity = placed_similarity(similarity, placement, inverse=True)
                block["expert_order"] = "original"
            super()._save(output_dir, state_dict=state_dict)
            if self.args.should_save:
                write_adapter_block(output_dir, block)
        else:
            base = unwrap_model(self.model)
            block = self.occult_block(placed=True)
            if "save_pretrained" in vars(base):
                # loaded by occult_ft.from_pretrained: its own save hook must write this run's block,
                # not the one it was loaded with (a changed budget would otherwise be saved as the old one)
                attach_occult_save(base, block)
            with occult_config_fields(base.config, block, self.occult.pruning, output_dir):
                super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            write_similarity(output_dir, similarity)

    def _adapter_unplaceable(self) -> bool:
        """A LoRA adapter can be saved in the original expert order: the base on disk is not placed and
        the placement is known."""
        return not self.occult.base_placed and self.occult.placement is not None

    # ---- resuming -----------------------------------------------------------------------------
    def _adopt_checkpoint(self, checkpoint: str) -> None:
        """Make the placement and similarity tables those of `checkpoint` (its weights follow them)."""
        block, similarity = read_block(checkpoint), read_similarity(checkpoint)
        theirs = placement_from_block(block, self.model)
        ours = self.occult.placement
        if theirs is not None and (ours is None or theirs.groups != ours.groups):
            if self._is_lora():
                raise ValueError(
                    f"checkpoint {checkpoint!r} placed the experts differently from this trainer; LoRA adapters "
                    "need the base placed like the checkpoint: set resume_from_checkpoint in the OccultConfig "
                    "before building the OccultTrainer"
                )
            self.occult.placement = theirs
        if similarity is not None:
            apply_pruning(self.model, self.occult.pruning, similarity=similarity)
            self.occult.similarity = similarity

    def _load_full_checkpoint(self, path: str | None) -> bool:
        """Load a full (non-LoRA) checkpoint's weights into the model through `from_pretrained`.

        `save_pretrained` writes MoE experts in the per-expert Hub layout while the live model holds fused
        tensors, so Trainer's raw `load_state_dict` would skip the experts; `from_pretrained` converts.
        Returns False where Trainer's own loading applies (LoRA, DeepSpeed, FSDP, no config.json).
        """
        if not path or self._is_lora() or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        if not os.path.isfile(os.path.join(path, "config.json")):
            return False
        base = unwrap_model(self.model)
        loaded = type(base).from_pretrained(path, dtype=next(base.parameters()).dtype)
        state = loaded.state_dict()
        if self.expert_parallel is not None:
            state = shard_state_dict(base, state)
        result = base.load_state_dict(state, strict=False)
        del loaded
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"checkpoint {path!r} does not fit this model (missing {result.missing_keys[:4]}, unexpected "
                f"{result.unexpected_keys[:4]}); resume with the model it was trained from"
            )
        return True

    def _load_sharded_adapter(self, path: str | None) -> bool:
        """Load a LoRA checkpoint into an expert-parallel model without DeepSpeed (the adapter holds all E
        experts' factors, each rank takes its own); False where Trainer's own loading applies."""
        if not path or self.expert_parallel is None or not self._is_lora() or self.is_deepspeed_enabled:
            return False
        load_sharded_adapter(self.model, path)
        return True

    def _restore_expert_shards(self, path: str) -> None:
        """After the DeepSpeed engine restored rank 0's shards everywhere: each rank takes its own."""
        if self._is_lora():
            load_expert_lora_shards(self.model, path)
        else:
            load_expert_shards(self.model, path)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if model is None or model is self.model:
            if self._load_full_checkpoint(resume_from_checkpoint):
                return
            if self._load_sharded_adapter(resume_from_checkpoint):
                return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._reduces_expert_gradients():
            save_expert_optimizer_state(self.optimizer, self.expert_parallel, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.expert_parallel is None:
            return
        if self.is_deepspeed_enabled:
            self._restore_expert_shards(checkpoint)
        else:
            load_expert_optimizer_state(self.optimizer, self.expert_parallel, checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self._load_full_checkpoint(best) or self._load_sharded_adapter(best):
            return
        super()._load_best_model()
        if self.expert_parallel is not None and self.is_deepspeed_enabled:
            self._restore_expert_shards(best)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval=None,
        **kwargs,
    ):
        """`Trainer.train`; a resumed checkpoint's placement and similarity tables are adopted first."""
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint not in (None, False) and checkpoint is None:
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: no checkpoint-N directory in {self.args.output_dir!r}"
            )
        if checkpoint is not None:
            self._adopt_checkpoint(checkpoint)
        return super().train(
            resume_from_checkpoint=checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )
