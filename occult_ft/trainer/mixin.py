"""`OccultTrainerMixin`: the Occult behaviour of a `transformers.Trainer`, for any trainer built on it.

One implementation serves `OccultTrainer` (occult_ft's data handling) and `occult_ft.trl.OccultSFTTrainer`
(TRL's). The mixin sits directly above `transformers.Trainer` in a trainer's method order:

    class OccultTrainer(OccultTrainerMixin)                     # mixin -> Trainer
    class OccultSFTTrainer(SFTTrainer, OccultTrainerMixin)     # SFTTrainer -> mixin -> Trainer

so its `__init__` runs where `Trainer.__init__` would, with the data as the trainer above made it, and
places and prunes the model (`occult_ft.trainer.prepare`), applies LoRA and shards the experts
(`occult_ft.trainer.expert_parallel`) before `Trainer.__init__` sees the model. Its overrides:

    occult_loss / compute_loss      inner loss + `balance_loss_coef` * the pruning-aware balance loss
                                    (`losses.py`) + `distill_coef` * KL(unpruned || pruned), a plain mean
                                    under gradient accumulation and data parallelism
    training_step / _balance_devices   the per-device selection bias moved after each optimizer step
                                    (`device_bias_rate`; one all-reduce of (L, D) loads, no host read),
                                    fitted on the first micro-batch first (`device_bias_init`)
    log / evaluation_loop           routing metrics (`comm_complexity`, `removed_mass`, ...) per log line
    _clip_grad_norm / create_optimizer   expert-parallel norm and reduction; `CompensatedAdamW`
    training_step                   under expert parallelism the expert shards' all-reduce during the
                                    last micro-batch's backward (`ExpertGradientReducer`) and the input
                                    embedding's apart from DDP (`EmbeddingGradientReducer`)
    save_model / _save / _load_*    pruned checkpoints (`occult` block, similarity tables; `checkpointing`)
                                    and a resume that ends where the uninterrupted run ends

Legend: L MoE layers, D devices; user-facing behaviour: docs/fine-tuning.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from ..checkpoint import maybe_convert
from ..checkpoint.card import last_eval_metrics, write_model_card
from ..checkpoint.load import can_load_sharded
from ..data.batching import real_token_mask
from ..dispatch.comm import close_process_group_at_exit
from ..evaluation import make_comm_complexity_figure
from ..fileio import OutputPathError, check_output_path, reading_directory
from ..integrations.deepspeed import split_moe_param_groups
from ..models.registry import unwrap_model
from ..routing import fit_router_device_bias, pruned_routers, update_device_bias
from .checkpointing import (
    adopt_checkpoint,
    load_checkpoint_weights,
    load_optimizer_shards,
    restore_expert_shards,
    save_checkpoint,
    save_optimizer_shards,
)
from .config import OccultArguments
from .distill import distillation_kl, teacher_logits
from .embedding_grad import EmbeddingGradientReducer
from .expert_parallel import (
    ExpertGradientReducer,
    ExpertParallelGroups,
    clip_expert_parallel_grad_norm,
    replicated_bucket_cap_mb,
    setup_expert_parallel,
)
from .guards import check_step
from .loading import (
    check_seq_len,
    load_precision,
    load_training_model,
    may_move_to,
    round_keeping_residuals,
)
from .losses import balance_loss, balance_loss_factor
from .meter import RoutingMeter
from .optim import CompensatedAdamW, choose_optimizer
from .prepare import OccultSetup, prepare_model, resolve_checkpoint
from .sharded_load import load_sharded_training_model

logger = logging.get_logger(__name__)

__all__ = ["OccultTrainerMixin", "load_run_model"]


def load_run_model(
    path: str, args: OccultArguments, placement=None
) -> tuple[nn.Module, object, torch.dtype | None]:
    """(model, tokenizer, round_to) of a run from a path, Hub id or `embedded`: under expert parallelism
    (one-stage exchange) each rank reads only its own expert block from the safetensors files.

    A float32 checkpoint of a 16-bit run that `CompensatedAdamW` will train, not resumed
    (`loading.load_precision`), is loaded in float32 and `round_to` is `model_dtype`: the mixin prepares
    it in float32, then rounds it and seeds the optimizer's compensation with what the rounding lost
    (pass `round_to` on to `OccultTrainerMixin.__init__`). Otherwise `round_to` is None."""
    # DeepSeek-MoE -> its qwen2_moe conversion (the ranks of a launch convert once, under a file lock),
    # before anything reads the checkpoint: the sharded loader reads its files itself
    path = maybe_convert(path)
    resumed = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir) is not None
    precision = None if resumed else load_precision(path, args)
    round_to = getattr(torch, args.model_dtype) if precision is not None else None
    one_stage = getattr(args, "exchange", "flat") != "two_stage"  # two-stage shards with its node groups
    if args.expert_parallel_size > 1 and one_stage and can_load_sharded(path):
        model, tokenizer = load_sharded_training_model(path, args, placement, dtype=precision)
    else:
        model, tokenizer = load_training_model(path, args, dtype=precision)
    return model, tokenizer, round_to


class OccultTrainerMixin(Trainer):
    """The Occult behaviour of a Trainer (see the module docstring for where it sits and what it adds).

    Args (of `__init__`, as `Trainer.__init__` receives them from the trainer above):
        model: a loaded supported MoE model, pruned occult_ft checkpoint or occult_ft LoRA model.
        args: an `OccultArguments` config (`OccultConfig`, `OccultSFTConfig`).
        data_collator / train_dataset / eval_dataset: tokenized data and its collator, as the trainer
            above made them; `train_dataset` is profiled for `placement="auto"` and similarity tables.
        placement: a `Placement` that overrides `args.placement`.
        peft_config: a `peft.PeftConfig` applied after placement and pruning (instead of the LoRA config
            `train_mode="lora"` builds).
        round_to: the dtype a float32 model is rounded to after placement, pruning and sharding, what the
            rounding lost seeding `CompensatedAdamW`'s compensation (`load_run_model` says when).
        kwargs: passed on to `transformers.Trainer`.

    Attributes:
        occult: the `OccultSetup` (pruning config, placement, similarity tables, expert -> device maps).
        expert_parallel: the expert-parallel groups, None without expert parallelism.
    """

    args: OccultArguments  # checked in __init__

    def __init__(
        self,
        model: nn.Module,
        args: OccultArguments,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        *,
        placement=None,
        peft_config=None,
        round_to: torch.dtype | None = None,
        **kwargs,
    ):
        # a trainer above that does not pass these on to Trainer.__init__ (TRL's) sets them beforehand
        options = getattr(self, "occult_init_options", {})
        placement = placement if placement is not None else options.get("placement")
        peft_config = peft_config if peft_config is not None else options.get("peft_config")
        round_to = round_to if round_to is not None else options.get("round_to")
        if not isinstance(args, OccultArguments):
            raise TypeError(
                f"args must be an OccultConfig or OccultSFTConfig, got {type(args).__name__}; build one of them"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} places a loaded model; got {type(model).__name__}")
        check_seq_len(model, args.tokens_per_row(), args.row_length_field)
        close_process_group_at_exit()  # a user's script under torchrun ends with the group alive
        if round_to is None and may_move_to(args, model):  # a float32 model moves once rounded
            model = model.to(args.device)
        checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        model, setup = prepare_model(
            model, args, train_dataset, data_collator, placement, checkpoint, peft_config=peft_config
        )
        self.occult: OccultSetup = setup
        self.expert_parallel: ExpertParallelGroups | None = None
        self._expert_reducer: ExpertGradientReducer | None = None
        #: the input embedding's gradient reduction apart from DDP (`embedding_gradient_overlap`), if any
        self.embedding_reducer: EmbeddingGradientReducer | None = None
        if args.expert_parallel_size > 1:
            self.expert_parallel = setup_expert_parallel(model, args)
            marked = [
                m
                for m in model.modules()
                if isinstance(m, nn.Embedding) and getattr(m.weight, "occult_reduced_apart", False)
            ]
            if marked:
                self.embedding_reducer = EmbeddingGradientReducer(marked[0])
            if not args.deepspeed:  # the engine reduces its expert parameters itself
                self._expert_reducer = ExpertGradientReducer(model, self.expert_parallel)
                if args.ddp_bucket_cap_mb is None:
                    args.ddp_bucket_cap_mb = replicated_bucket_cap_mb(model)
        # what rounding the float32 start to model_dtype lost: CompensatedAdamW starts from it
        self._load_rounding = round_keeping_residuals(model, round_to) if round_to is not None else {}
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            **kwargs,
        )
        assert args.devices is not None and self.model is not None  # OccultArguments resolves devices
        self._meters = {
            "train": RoutingMeter(args.devices, keep_loads=args.device_bias_rate > 0),
            "eval": RoutingMeter(args.devices),
        }
        self._routers = pruned_routers(self.model)
        self._fit_bias_pending = (
            args.device_bias_rate > 0
            and args.device_bias_init == "first_batch"
            and self.occult.pruning.active
        )
        self._distill_kl_sum, self._distill_kl_count = torch.zeros((), dtype=torch.float64), 0
        self._losses_finite: torch.Tensor | None = None  # since the last optimizer step (trainer.guards)
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
        return self.occult_loss(super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def occult_loss(
        self, inner: Callable, model, inputs, return_outputs=False, num_items_in_batch=None
    ) -> torch.Tensor | tuple[torch.Tensor, object]:
        """The loss `inner(model, inputs, return_outputs=..., num_items_in_batch=...)` computes (Trainer's
        or a trainer's own, e.g. SFTTrainer's), plus the balance loss and distillation from the routing
        that forward recorded; the routing meter is fed on the way."""
        mask = real_token_mask(inputs)
        labels = inputs.get("labels")  # Trainer may pop it (label smoothing, compute_loss_func)
        inputs = self._model_inputs(inputs)
        mask_T = mask.reshape(-1).bool() if mask is not None else None
        distill = model.training and self.args.distill_coef > 0 and self.occult.pruning.active
        # the outputs only when needed: a trainer with a fused LM head spends a forward on the logits
        result = inner(
            model, inputs, return_outputs=return_outputs or distill, num_items_in_batch=num_items_in_batch
        )
        loss, outputs = result if return_outputs or distill else (result, None)
        records = self._records()
        training = model.training
        meter = self._meters["train" if training else "eval"]
        meter.update(records, self.occult.expert_device, mask_T)
        if mask is not None:
            meter.add_padding(mask)
        if training and self.args.balance_loss_coef > 0:
            # with a budget the loss also balances device load (the rows each device receives)
            budget = self.occult.pruning.active
            aux = balance_loss(
                records, mask_T, self.occult.expert_device if budget else None, self.args.devices
            )
            if aux is not None:
                meter.add_balance_loss(aux)
                accumulation = (
                    getattr(self, "current_gradient_accumulation_steps", None)
                    or self.args.gradient_accumulation_steps
                )
                factor = balance_loss_factor(self._loss_is_scaled_for_ga(num_items_in_batch), accumulation)
                loss = loss + (self.args.balance_loss_coef * factor) * aux.to(loss.device, loss.dtype)
        if distill:
            kl = self._distillation_loss(model, inputs, labels, outputs)
            if kl is not None:
                self._distill_kl_sum += kl.detach().double().cpu()
                self._distill_kl_count += 1
                factor = self._mean_loss_factor(num_items_in_batch)
                loss = loss + (self.args.distill_coef * factor) * kl.to(loss.device, loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def _model_inputs(self, inputs: dict) -> dict:
        """A batch as the model's forward takes it: no router logits, no packing mask, no cache for packed rows."""
        if self._router_logits_flag:
            inputs = {**inputs, "output_router_logits": False}
        if "token_mask" in inputs:  # a packed batch (occult_ft.data.batching): the model does not take it
            inputs = {k: v for k, v in inputs.items() if k != "token_mask"}
        if "position_ids" in inputs and "attention_mask" not in inputs:
            inputs = {**inputs, "use_cache": False}  # a cache would turn the packed-sequence mask off
        return inputs

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
        if self._fit_bias_pending:
            self._fit_bias_pending = False
            if self.state.global_step == 0:  # a resumed run keeps the bias it saved
                self._fit_device_bias(model, inputs)
        reducer = self._expert_reducer if self._own_expert_reduction() is not None else None
        last = self.accelerator.sync_gradients  # the optimizer step's last micro-batch
        if reducer is not None and last:
            reducer.arm()  # the expert gradients' all-reduce overlaps this micro-batch's backward
        if self.embedding_reducer is not None:
            self.embedding_reducer.before(last)  # before the last: the earlier ones' sum starts travelling
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = torch.isfinite(loss.detach()).all()  # read at the optimizer step (one sync per step)
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite
        if self.embedding_reducer is not None:
            self.embedding_reducer.after(last)
        if reducer is not None and last:
            reducer.finish()
        if last:
            self._balance_devices()
        # the records keep the last routing for inspection, but not the probabilities' graph
        for _, router in self._routers:
            record = getattr(router, "occult_record", None)
            if record is not None:
                record.probs = None
        return loss

    @torch.no_grad()
    def _fit_device_bias(self, model, inputs) -> None:
        """`device_bias_init="first_batch"`: before the first step, set the device bias that balances this
        micro-batch's routing (`fit_router_device_bias`: one forward, then the rule iterated on the kept
        router outputs), its loads summed over processes so that every rank sets the same bias."""
        inputs = self._prepare_inputs(inputs)
        mask = real_token_mask(inputs)
        batch = {k: v for k, v in self._model_inputs(inputs).items() if k != "labels"}
        base = unwrap_model(model)
        reduce = None
        if self.accelerator.num_processes > 1 and torch.distributed.is_initialized():

            def reduce(load_LD: torch.Tensor) -> torch.Tensor:
                load_LD = load_LD.to(self.args.device)  # the backend's device (NCCL: the GPU)
                torch.distributed.all_reduce(load_LD)
                return load_LD

        fit_router_device_bias(
            base,
            lambda: base(**batch),
            self.args.device_bias_rate,
            mask.reshape(-1).bool() if mask is not None else None,
            reduce,
        )

    @torch.no_grad()
    def _balance_devices(self) -> None:
        """After the last micro-batch of an optimizer step: bias_d += u * sign(mean load - load_d) in every
        pruned router holding a bias (`update_device_bias`), from the device loads the train meter
        measured in the step, summed over processes so that every rank keeps the same bias."""
        loads = self._meters["train"].take_loads()
        if self.args.device_bias_rate <= 0 or not self.occult.pruning.active:
            return
        held = [(layer.index, r._buffers.get("occult_device_bias")) for layer, r in self._routers]
        routers = [(i, bias) for i, bias in held if bias is not None]
        if not routers:
            return
        bias_LD = torch.stack([bias.float() for _, bias in routers])
        zeros_D = torch.zeros(bias_LD.shape[1], dtype=torch.float64, device=bias_LD.device)
        load_LD = torch.stack([loads.get(i, zeros_D).to(bias_LD.device) for i, _ in routers])
        if self.accelerator.num_processes > 1 and torch.distributed.is_initialized():
            load_LD = load_LD.to(self.args.device)  # the backend's device (NCCL: the GPU)
            torch.distributed.all_reduce(load_LD)
        new_LD = update_device_bias(bias_LD, load_LD, self.args.device_bias_rate)
        for row, (_, bias) in enumerate(routers):
            bias.copy_(new_LD[row])

    # ---- expert parallelism without DeepSpeed: shard gradients and the norm are ours --------------
    def _own_expert_reduction(self) -> tuple[nn.Module, ExpertParallelGroups] | None:
        """(model, EP groups) when occult_ft reduces the expert gradients and clips their norm itself
        (expert parallelism without DeepSpeed), else None."""
        if self.expert_parallel is None or self.is_deepspeed_enabled or self.model is None:
            return None
        return self.model, self.expert_parallel

    def _clip_grad_norm(self, model):
        own = self._own_expert_reduction()
        if own is not None:
            return clip_expert_parallel_grad_norm(*own, self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm, called at every optimizer step just before the update: a non-finite
        loss or norm stops the run there, naming the step (`occult_ft.trainer.guards`)."""
        own = self._own_expert_reduction()
        if grad_norm is None and own is not None:
            grad_norm = clip_expert_parallel_grad_norm(*own, float("inf"))
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        finite, self._losses_finite = self._losses_finite, None
        check_step(
            self.state.global_step + 1,
            True if finite is None else finite,
            grad_norm,
            self.args.learning_rate,
            check_gradient=getattr(self.accelerator, "scaler", None) is None,
        )
        return grad_norm

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: PreTrainedModel | None = None):
        """Trainer's optimizer, except that `torch.optim.AdamW` over 16-bit (bf16/fp16) trainable weights
        becomes `occult_ft.trainer.optim.CompensatedAdamW` (float32 moments, Kahan-compensated weights),
        so bf16 `full` / `moe` runs lose no update to rounding."""
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        return choose_optimizer(args, model, cls, kwargs)

    def create_optimizer(self, *args, **kwargs):
        """`Trainer.create_optimizer`; under DeepSpeed with expert parallelism the expert shards go into
        DeepSpeed's MoE param groups (`occult_ft.integrations.deepspeed.split_moe_param_groups`); a
        `CompensatedAdamW` starts from what rounding a float32 start lost (`round_to`)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.expert_parallel is not None and self.is_deepspeed_enabled:
            split_moe_param_groups(optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, CompensatedAdamW) and self._load_rounding:
            inner.seed_compensation(self._load_rounding)
        self._load_rounding = {}  # the optimizer holds them now (or never will)
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
        if "train_loss" in logs and self.state.global_step == getattr(self, "_initial_global_step", -1):
            logs = {k: v for k, v in logs.items() if k != "train_loss"}  # no step this call: no loss, not 0
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
        metrics = output.metrics if output.metrics is not None else {}  # typed Optional; Trainer fills it
        for key, value in self._meters["eval"].summary(self._reduce).items():
            if key != "balance_loss":
                metrics[f"{metric_key_prefix}_{key}"] = value
        loss = metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:
            metrics[f"{metric_key_prefix}_perplexity"] = math.exp(min(loss, 50.0))
        return output

    # ---- saving and resuming: the hooks of `occult_ft.trainer.checkpointing` --------------------
    def create_model_card(self, *args, **kwargs) -> None:
        """The Occult model card (placement, budget, measured comm_complexity and its figure, eval
        results, how to load) instead of Trainer's generic one; `push_to_hub` uploads it."""
        if not self.is_world_process_zero():
            return

        output_dir = self.args.output_dir
        assert output_dir is not None  # TrainingArguments sets a default
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
        if not _internal_call:  # a directory the user names: none of their files is overwritten
            self._check_save_dir(output_dir if output_dir is not None else self.args.output_dir)
        self._occult_final_save = not _internal_call
        try:
            super().save_model(output_dir, _internal_call=_internal_call)
        finally:
            self._occult_final_save = False
        if _internal_call or not self.is_world_process_zero():
            return

        try:
            write_model_card(
                output_dir if output_dir is not None else self.args.output_dir,  # type: ignore[arg-type]
                repo_id=getattr(self, "hub_model_id", None) or self.args.hub_model_id,
                eval_results=last_eval_metrics(self.state.log_history) or None,
            )
        except (OSError, ValueError) as exc:  # the weights are saved; a card must not fail the run
            logger.warning(f"saved the model without its model card: {exc}")

    def _check_save_dir(self, output_dir: str | None) -> None:
        """`check_output_path` of a directory `save_model` writes into, by the process that writes it:
        the others may get here while it still writes (or rotates away) the last checkpoint-N. Under
        expert parallelism every rank takes part in the save (the shards are gathered), so the first
        process decides for all and each raises the same refusal rather than wait in the gather."""
        if self.expert_parallel is None:  # only the writing process looks (a rank-0-only save stays fine)
            if self.args.should_save:
                check_output_path(output_dir, what="save_model's output_dir", directory=True, replace=False)
            return
        error = None
        if self.is_world_process_zero():
            try:
                check_output_path(output_dir, what="save_model's output_dir", directory=True, replace=False)
            except OutputPathError as exc:
                error = str(exc)
        holder = [error]
        torch.distributed.broadcast_object_list(holder, src=0)  # expert parallelism: a process group runs
        if holder[0] is not None:
            raise OutputPathError(holder[0])

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        save_checkpoint(self, output_dir, state_dict, final=getattr(self, "_occult_final_save", False))

    # every file of a checkpoint read on resume: one `could not read FILE: reason` line (fileio)
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        with reading_directory(resume_from_checkpoint):
            if (model is None or model is self.model) and load_checkpoint_weights(
                self, resume_from_checkpoint
            ):
                return
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        with reading_directory(checkpoint or "."):
            super()._load_rng_state(checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_shards(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with reading_directory(checkpoint or "."):
            super()._load_optimizer_and_scheduler(checkpoint)
            load_optimizer_shards(self, checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if load_checkpoint_weights(self, best):
            return
        super()._load_best_model()
        if self.expert_parallel is not None and self.is_deepspeed_enabled and best is not None:
            restore_expert_shards(self, best)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval=None,
        **kwargs,
    ):
        """`Trainer.train`; a resumed checkpoint's placement and similarity tables are adopted first."""
        self._check_one_batch()
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint not in (None, False) and checkpoint is None:
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: no checkpoint-N directory in {self.args.output_dir!r}"
            )
        if checkpoint is not None:
            adopt_checkpoint(self, checkpoint)
        result = super().train(
            resume_from_checkpoint=checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )
        if checkpoint is not None and self.state.global_step == getattr(self, "_initial_global_step", -1):
            # resumed from a checkpoint at max_steps: no step was taken, so there is no train loss to report
            metrics = {k: v for k, v in result.metrics.items() if k != "train_loss"}
            result = TrainOutput(result.global_step, float("nan"), metrics)
        return result

    def _check_one_batch(self) -> None:
        """Refuse data that gives no batch at all (Trainer's own error speaks of a missing length)."""
        data = self.train_dataset
        if not self.args.dataloader_drop_last or data is None or not hasattr(data, "__len__"):
            return
        batch = self.args.per_device_train_batch_size * self.args.world_size
        if len(data) < batch:
            raise ValueError(
                f"train_dataset has {len(data)} rows, fewer than one batch of {batch} "
                f"(per_device_train_batch_size x processes) with dataloader_drop_last; add data, lower "
                "per_device_train_batch_size or set dataloader_drop_last=False"
            )

    def _run_epoch(
        self,
        model,
        epoch,
        train_dataloader,
        steps_in_epoch,
        num_update_steps_per_epoch,
        trial,
        ignore_keys_for_eval,
        start_time,
        resume_from_checkpoint,
        epochs_trained,
        steps_trained_in_current_epoch,
    ):
        """`Trainer._run_epoch`, except for a run resumed from a checkpoint already at `max_steps`: Trainer
        would take one step past it (step 61 of 60, a `checkpoint-61`); here no step is taken."""
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(
            model,
            epoch,
            train_dataloader,
            steps_in_epoch,
            num_update_steps_per_epoch,
            trial,
            ignore_keys_for_eval,
            start_time,
            resume_from_checkpoint,
            epochs_trained,
            steps_trained_in_current_epoch,
        )
