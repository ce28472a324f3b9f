"""`OccultConfig`: every setting of an Occult fine-tuning run, as `TrainingArguments` fields.

Following TRL's pattern, the config subclasses `transformers.TrainingArguments` and gives every field a
help string, so `HfArgumentParser` turns it into command-line flags and YAML recipes for free
(`occult-ft train recipe.yaml --learning_rate 1e-4`). The Occult-specific fields say which model and
data to use, how experts are placed on the `devices` expert-parallel devices, how many of those devices
a token may reach (`max_devices_per_token`, the paper's pruning budget) and which parameters train.

The Occult fields live in `OccultArguments`, shared with `occult_ft.trl.OccultSFTConfig` (the same
fields on TRL's `SFTConfig`); `OccultConfig` adds occult_ft's own tokenisation fields (`seq_len`,
`packing`, `response_only`, `text_field`).

`__post_init__` checks every Occult field and raises a one-line `ValueError` that names the field, the
bad value and the fix; unknown choices come with the closest valid spelling.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import TrainingArguments

from ..checks import check_positive_int, choice_error, did_you_mean, is_int
from ..configs import load_model_config
from ..dispatch import EXCHANGES, check_exchange_settings, default_exchange_chunks
from ..fileio import check_output_path
from ..hub_access import offline_refusal
from ..integrations.deepspeed import check_deepspeed_config
from ..models.registry import config_num_experts, config_top_k, get_arch
from ..placement import PLACEMENT_ALGORITHMS
from ..routing import CRITERIA, GATE_WEIGHT_POLICIES, PruningConfig, check_pruning_settings

__all__ = [
    "OccultArguments",
    "OccultConfig",
    "TRAIN_MODES",
    "PLACEMENT_MODES",
    "MODEL_DTYPES",
    "check_before_loading",
    "check_output_dir",
    "DEVICE_BIAS_RATE",
]

TRAIN_MODES = ("full", "moe", "lora")
PLACEMENT_MODES = ("auto", "sequential")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_BIAS_RATE = 0.0
DEVICE_BIAS_INITS = ("zeros", "first_batch")
"""Default `device_bias_rate`: off until measured on more than one model. On the tiny recipe (budget 2,
solver placement with a 1.25 load bound) 0.0007 brings the worst layer's device load imbalance to 1.08
at comm_complexity 1.95 and +0.18% held-out loss (docs/device-balance.md)."""


if TYPE_CHECKING:  # mypy reads the shared fields' host attributes (use_cpu, max_steps, ...)
    _ArgumentsBase = TrainingArguments
else:
    _ArgumentsBase = object


@dataclass
class OccultArguments(_ArgumentsBase):
    """The Occult fields every Occult trainer's config shares, with one validation.

    `OccultConfig` (`OccultArguments` + `transformers.TrainingArguments`) and
    `occult_ft.trl.OccultSFTConfig` (`OccultArguments` + `trl.SFTConfig`) both take these fields, so a
    field has one name, one help string and one check whichever trainer reads it. `__post_init__`
    resolves and checks them, then runs the host config's own `__post_init__`; a host adds its own
    fields' checks in `_check_trainer_fields` and says how many tokens a training row holds in
    `tokens_per_row`. Typed as a `TrainingArguments` for mypy; at run time a plain dataclass, so that
    it adds fields without redeclaring the host's (a `TrainingArguments` base here would reset TRL's
    defaults).
    """

    # ---- model and data -------------------------------------------------------------------------
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Base MoE model: a local directory, a Hub id, 'embedded' (the shipped OLMoE), a pruned "
            "checkpoint or a LoRA adapter directory written by occult-ft train."
        },
    )
    model_dtype: str = field(
        default="auto",
        metadata={
            "help": f"dtype to load the weights in: one of {', '.join(MODEL_DTYPES)} (auto = the checkpoint's)."
        },
    )
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Training data: a .txt / .jsonl / .json file (text or Alpaca instruction rows), a saved "
            "dataset directory, a Hub dataset id, or 'embedded'."
        },
    )
    dataset_split: str | None = field(
        default=None,
        metadata={"help": "Split of `dataset` (default train; for 'embedded': train or instructions)."},
    )
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Optional held-out data (same forms as `dataset`), evaluated after training."},
    )
    eval_dataset_split: str | None = field(
        default=None, metadata={"help": "Split of `eval_dataset` (for 'embedded' the default is eval)."}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read `dataset` as a stream (datasets.IterableDataset: Hub ids and .jsonl files are read "
            "as used); needs max_steps."
        },
    )
    skip_invalid_rows: bool = field(
        default=False,
        metadata={
            "help": "Skip data rows that do not fit the layout the file is read with (a missing or non-text "
            "field), printing how many; default: such a row is an error naming the file, the row and the field."
        },
    )

    # ---- placement and pruning ------------------------------------------------------------------
    devices: int | None = field(
        default=None,
        metadata={
            "help": "Devices D the experts are placed on and the budget counts (must divide the experts): the "
            "layout you deploy on; default: expert_parallel_size when that is above 1, else 4. It may be a "
            "multiple of expert_parallel_size (train on 4 processes for 8 devices): each process then holds "
            "the experts of D / expert_parallel_size consecutive devices."
        },
    )
    nodes: int = field(
        default=1, metadata={"help": "Nodes N the devices span (hierarchical placement); divides devices."}
    )
    exchange: str = field(
        default="flat",
        metadata={
            "help": "Expert-parallel token exchange: 'flat' (one de-duplicated all-to-all, a token sent once "
            "per device), 'two_stage' (a token crosses nodes once per node, then fans out inside the "
            "node; needs nodes > 1) or 'per_expert' (one row per (token, expert), as transformers' native "
            "EP and DeepSpeed send: to measure what de-duplication buys). Same results.",
            "choices": list(EXCHANGES),
        },
    )
    exchange_chunks: int | None = field(
        default=None,
        metadata={
            "help": "Chunks each MoE layer's tokens are pipelined in (flat and per_expert exchanges): while "
            "one chunk runs its experts the next is dispatched and the previous combined, forward and "
            "backward (same results). 1 turns it off. Unset: 2 with the flat exchange across nodes "
            "(nodes > 1) without a budget; 1 inside one node, under max_devices_per_token or "
            "max_nodes_per_token, with the other exchanges and with exchange_capacity (measured: "
            "docs/cluster.md)."
        },
    )
    exchange_overlap_local: bool = field(
        default=False,
        metadata={
            "help": "Compute each MoE layer's own rows (tokens for this rank's experts, no network) while "
            "the other rows' exchanges travel, also with exchange_chunks 1 (flat and per_expert exact "
            "exchanges; same results). exchange_chunks > 1 always does."
        },
    )
    exchange_overlap_shared: bool = field(
        default=False,
        metadata={
            "help": "Run each MoE block's shared experts (DeepSeek-V2/V3, GLM-4-MoE: the MLP every token "
            "goes through) while the layer's combine travels, and their backward while the dispatch's "
            "transposes travel (flat and per_expert exact exchanges; same results; the layer then runs its "
            "pipeline, own rows included). Blocks that call "
            "the shared MLP before the experts (Qwen-MoE) run it as before; models without one are "
            "unchanged."
        },
    )
    exchange_capacity: int | str | None = field(
        default=None,
        metadata={
            "help": "Capacity-bounded receive buffers for the flat exchange (no host synchronisation per "
            "layer; every rank sends D x C rows, padded): C rows per device, at least the most tokens a "
            "rank routes in one forward (max(per_device_train_batch_size, per_device_eval_batch_size) x "
            "seq_len (max_length with --trainer trl), the bound no routing can overflow; checked whatever "
            "the layout), or 'auto' = that bound. Unset: exact buffers (one host sync per layer)."
        },
    )
    placement: str = field(
        default="auto",
        metadata={
            "help": "Expert placement: 'auto' (profile the training data, then place), 'sequential' (keep "
            "the model's order) or a placement JSON from `occult-ft place`. Ignored for a model that "
            "is already placed (a pruned checkpoint) and when resuming (the checkpoint's is used)."
        },
    )
    placement_algorithm: str = field(
        default="search", metadata={"help": "Algorithm of placement=auto (see occult_ft.placement)."}
    )
    max_load_imbalance: float | None = field(
        default=None,
        metadata={
            "help": "Load bound of placement=auto: keep max/mean rows per device within this (>= 1; with a "
            "budget, of the pruned routing); unset = max(1.25, occult's imbalance)."
        },
    )
    profile_tokens: int = field(
        default=65536,
        metadata={
            "help": "Training tokens profiled for placement=auto and for the similarity criterion's tables."
        },
    )
    max_devices_per_token: int | None = field(
        default=None,
        metadata={
            "help": "Pruning budget M: each token reaches at most this many devices (1..devices); unset = "
            "no pruning, routing metrics are still logged."
        },
    )
    max_nodes_per_token: int | None = field(
        default=None,
        metadata={
            "help": "Node budget: each token reaches experts on at most this many of the `nodes` nodes "
            "(DeepSeek-V3's node-limited routing), alone or with max_devices_per_token; unset = none."
        },
    )
    criterion: str = field(
        default="similarity",
        metadata={"help": f"How over-budget tokens are re-routed: one of {', '.join(CRITERIA)}."},
    )
    gate_weights: str = field(
        default="model",
        metadata={"help": f"Gate weights of re-routed tokens: one of {', '.join(GATE_WEIGHT_POLICIES)}."},
    )
    balance_loss_coef: float = field(
        default=0.01,
        metadata={
            "help": "Weight of the pruning-aware load-balancing loss (E * sum_e f_e P_e over the routing "
            "actually used, on the scale of transformers' load_balancing_loss_func: K at uniform routing, "
            "so a model's router_aux_loss_coef carries over; 0.01 is OLMoE's, Mixtral/Qwen use 0.001); "
            "0 disables it. The model's own aux loss is always off."
        },
    )

    device_bias_rate: float = field(
        default=DEVICE_BIAS_RATE,
        metadata={
            "help": "Step u of device balancing without an auxiliary loss (DeepSeek-V3's selection bias, "
            "per device): after every optimizer step each pruned router's bias of device d moves by "
            "u * sign(mean load - load of d), on the scale of the router's selection scores "
            "(probabilities for softmax routers); the bias ranks the devices a token keeps (never more "
            "than its own top-k reaches), never the experts inside them or the gate weights, and is saved "
            "in the checkpoint. Applies under a budget "
            "(max_devices_per_token / max_nodes_per_token); 0 turns it off."
        },
    )
    device_bias_init: str = field(
        default="zeros",
        metadata={
            "help": "Where the device bias starts (with device_bias_rate > 0, under a budget): `zeros` "
            "(DeepSeek-V3's start; the rate then balances over tens of steps) or `first_batch` (fitted before "
            "the first step on the first micro-batch's routing: the same rule iterated with a shrinking step, "
            "one extra forward; a resumed run keeps its saved bias)."
        },
    )
    distill_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of distillation from the unpruned model during pruned fine-tuning: KL(teacher || "
            "student) on the logits of labelled positions, the teacher being the same weights with the "
            "budget lifted (one extra forward without gradient per step); 0 (default) turns it off."
        },
    )
    distill_temperature: float = field(
        default=1.0,
        metadata={"help": "Softmax temperature of the distillation KL (scaled back by its square); > 0."},
    )

    # ---- what trains ----------------------------------------------------------------------------
    train_mode: str = field(
        default="moe",
        metadata={
            "help": "full: every parameter; moe: MoE blocks only (routers + experts, as in the paper); "
            "lora: LoRA on experts and attention, routers fully trainable."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (train_mode=lora)."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scaling alpha / r)."})
    lora_dropout: float = field(
        default=0.0,
        metadata={
            "help": "LoRA dropout probability; must stay 0 while PEFT's LoRA on expert tensors "
            "(target_parameters) has no dropout."
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Processes that split the experts of a layer among them (1 = plain data parallel). "
            "When > 1 it must divide devices and the world size."
        },
    )
    embedding_gradient_overlap: bool = field(
        default=True,
        metadata={
            "help": "Under expert_parallel_size > 1 (without DeepSpeed) reduce the input embedding's gradient "
            "apart from DDP: the earlier micro-batches' sum during the last micro-batch, the last one's "
            "as gathered token rows where they are fewer bytes than the table (same results; a tied, "
            "frozen or customised embedding stays with DDP). False leaves it to DDP, reduced after backward."
        },
    )

    def __post_init__(self):
        launched = all(
            key in os.environ for key in ("MASTER_ADDR", "LOCAL_RANK")
        )  # torchrun / accelerate / deepspeed
        if (
            not self.use_cpu
            and launched
            and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and not _accelerator_available()
        ):
            # several CPU processes (torchrun / accelerate / deepspeed): without use_cpu, TrainingArguments
            # sees no distributed setup on CPU and every process would train alone
            self.use_cpu = True
        _check_field_types(self)
        self._resolve_trainer_defaults()
        self._check_occult_fields()
        _check_run_length_and_output(self)
        super().__post_init__()  # the host config's (TrainingArguments, SFTConfig)
        self._force_non_reentrant_checkpointing()

    # ---- what a host config adds --------------------------------------------------------------------
    def _resolve_trainer_defaults(self) -> None:
        """Defaults of the host's fields resolved before the checks (OccultConfig: bf16 = auto)."""

    def _check_trainer_fields(self) -> None:
        """The host's own fields' checks (OccultConfig: seq_len), run with the Occult fields' checks."""

    #: the host's field that sets `tokens_per_row` (named in errors)
    row_length_field: typing.ClassVar[str] = "seq_len"

    def tokens_per_row(self) -> int | None:
        """Tokens of one training row (OccultConfig: seq_len; OccultSFTConfig: max_length), None when unbounded."""
        raise NotImplementedError

    def __deepcopy__(self, memo) -> OccultArguments:
        """An in-memory copy keeps everything, secrets included (pickling drops them: `__getstate__`)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return copied

    def __copy__(self) -> OccultArguments:
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __getstate__(self) -> dict:
        """Pickled (Trainer's `training_args.bin` in every checkpoint) without its secrets: every
        `*_token` field (`hub_token`) is stored as None, so no artifact carries the token."""
        state = dict(self.__dict__)
        for name, value in state.items():
            if name.endswith("_token") and isinstance(value, str):
                state[name] = None
        return state

    # ---- validation ---------------------------------------------------------------------------
    def _check_occult_fields(self) -> None:
        if self.devices is None:
            ep = self.expert_parallel_size
            self.devices = ep if is_int(ep) and ep > 1 else 4
        # devices, nodes, the budget, criterion and gate weights: the pruning router's own checks
        check_pruning_settings(
            self.devices,
            self.max_devices_per_token,
            self.criterion,
            self.gate_weights,
            self.nodes,
            self.max_nodes_per_token,
        )
        self._check_trainer_fields()
        for name in ("profile_tokens", "lora_r", "expert_parallel_size"):
            check_positive_int(name, getattr(self, name))
        if self.streaming and self.max_steps <= 0:
            raise ValueError(
                "streaming=True reads the data as it goes, so the run length is unknown; set max_steps"
            )
        self._check_exchange()
        if self.train_mode not in TRAIN_MODES:
            raise choice_error("train_mode", self.train_mode, TRAIN_MODES)
        refusal = offline_refusal("push_to_hub=True") if self.push_to_hub else None
        if refusal is not None:  # refused before training, not by the push after it
            raise ValueError(f"{refusal}; or leave push_to_hub off and `occult-ft push` the result later")
        if self.model_dtype not in MODEL_DTYPES:
            raise choice_error("model_dtype", self.model_dtype, MODEL_DTYPES)
        self._check_loss_coefficients()
        self._check_lora()
        self._check_placement()
        if self.expert_parallel_size > 1:
            self._check_expert_parallel_size(self.devices)

    def _check_exchange(self) -> None:
        """exchange and its nodes; exchange_capacity (a digit string read as rows) against the rows a
        rank can route in one forward."""
        if self.exchange not in EXCHANGES:
            raise choice_error("exchange", self.exchange, EXCHANGES)
        if self.exchange == "two_stage" and self.nodes < 2:
            raise ValueError(
                f"exchange='two_stage' needs nodes > 1 (got nodes={self.nodes}); set --nodes N or use exchange='flat'"
            )
        capacity = self.exchange_capacity
        if isinstance(capacity, str) and capacity.strip().isdigit():
            self.exchange_capacity = capacity = int(capacity)
        if capacity is not None and capacity != "auto" and not is_int(capacity):
            raise ValueError(
                f"exchange_capacity={capacity!r} must be a number of rows per device or 'auto'; leave it unset "
                "for exact receive buffers"
            )
        if self.exchange_chunks is None:
            self.exchange_chunks = default_exchange_chunks(
                self.exchange,
                self.nodes,
                capacity,
                budget=self.max_devices_per_token is not None or self.max_nodes_per_token is not None,
            )
        check_exchange_settings(
            self.exchange,
            self.nodes,
            self.exchange_chunks,
            1 if isinstance(capacity, str) else capacity,
            self.exchange_overlap_local,
            self.exchange_overlap_shared,
        )
        if isinstance(capacity, int):
            # whatever the layout: a recipe checked on one process must not fail at the first step of a launch
            row, bound = self.row_length_field, self.tokens_per_forward()
            if bound is None:
                raise ValueError(
                    f"exchange_capacity={capacity} bounds the rows a device receives, but {row}=None leaves "
                    f"the rows a rank routes unbounded; set {row}, or leave exchange_capacity unset"
                )
            if capacity < bound:
                raise ValueError(
                    f"exchange_capacity={capacity} rows per device is below the {bound} tokens a rank can route "
                    f"in one forward (max(per_device_train_batch_size={self.per_device_train_batch_size}, "
                    f"per_device_eval_batch_size={self.per_device_eval_batch_size}) x {row}="
                    f"{self.tokens_per_row()}), so rows could be lost; set it to at least {bound}, 'auto', or "
                    "leave it unset"
                )

    def _check_loss_coefficients(self) -> None:
        """balance_loss_coef, device_bias_rate / device_bias_init, distill_coef, distill_temperature."""
        if not self.balance_loss_coef >= 0:
            raise ValueError(
                f"balance_loss_coef={self.balance_loss_coef!r} must be >= 0 (0 turns the balance loss off)"
            )
        rate = self.device_bias_rate
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0 <= rate < math.inf):
            raise ValueError(
                f"device_bias_rate={self.device_bias_rate!r} must be a finite number >= 0 (0 turns device "
                f"balancing off; the default is {DEVICE_BIAS_RATE})"
            )
        if self.device_bias_init not in DEVICE_BIAS_INITS:
            raise choice_error("device_bias_init", self.device_bias_init, DEVICE_BIAS_INITS)
        if not self.distill_coef >= 0:
            raise ValueError(
                f"distill_coef={self.distill_coef!r} must be >= 0 (0 turns distillation off; try 0.5-1)"
            )
        if not self.distill_temperature > 0:
            raise ValueError(
                f"distill_temperature={self.distill_temperature!r} must be > 0 (1.0 = the plain distributions)"
            )

    def _check_lora(self) -> None:
        """lora_alpha, lora_dropout (0 for LoRA on the fused expert tensors)."""
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be > 0, e.g. 2 * lora_r")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.train_mode == "lora" and self.lora_dropout != 0:
            raise ValueError(
                f"lora_dropout={self.lora_dropout!r}: PEFT's LoRA on the fused expert tensors (target_parameters) "
                "does not support dropout; set lora_dropout=0"
            )

    def _check_placement(self) -> None:
        """placement (a mode or a file), max_load_imbalance, placement_algorithm."""
        if self.placement not in PLACEMENT_MODES and not os.path.isfile(self.placement):
            raise ValueError(
                f"placement={self.placement!r} is neither {' nor '.join(PLACEMENT_MODES)} nor an existing placement "
                f"file{did_you_mean(self.placement, PLACEMENT_MODES)}; create one with `occult-ft place`"
            )
        mli = self.max_load_imbalance
        if mli is not None and (
            isinstance(mli, bool) or not isinstance(mli, (int, float)) or not 1 <= mli < float("inf")
        ):
            raise ValueError(
                f"max_load_imbalance={mli!r} must be a number >= 1 (max/mean rows per device), or unset for "
                "max(1.25, occult's imbalance)"
            )
        if self.placement_algorithm not in PLACEMENT_ALGORITHMS:
            raise choice_error("placement_algorithm", self.placement_algorithm, sorted(PLACEMENT_ALGORITHMS))

    def _check_expert_parallel_size(self, devices: int) -> None:
        """expert_parallel_size > 1 against `devices`, nodes and the launched world size."""
        ep = self.expert_parallel_size
        if devices % ep:
            raise ValueError(
                f"devices={self.devices} is not a multiple of expert_parallel_size={ep} (each process holds the "
                f"experts of devices/{ep} consecutive devices); set devices to a multiple of {ep} or leave it unset"
            )
        if self.exchange == "two_stage" and ep % self.nodes:
            raise ValueError(
                f"exchange='two_stage' needs nodes={self.nodes} to divide expert_parallel_size={ep}; "
                "set nodes to a divisor of the expert-parallel size"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % ep:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide the world size {world}; launch a multiple of {ep} "
                f"processes or set --expert_parallel_size to a divisor of {world}"
            )

    def tokens_per_forward(self) -> int | None:
        """The most tokens a rank routes in one forward, max(per_device_train_batch_size,
        per_device_eval_batch_size) x `tokens_per_row()` (seq_len; TRL's max_length): the bound a capacity
        must reach (`exchange_capacity` 'auto'); None when rows are unbounded (max_length=None)."""
        tokens = self.tokens_per_row()
        if tokens is None:
            return None
        return max(self.per_device_train_batch_size, self.per_device_eval_batch_size) * tokens

    def exchange_capacity_rows(self) -> int | None:
        """Rows per device of the capacity-bounded exchange (`exchange_capacity`), None for exact buffers."""
        if self.exchange_capacity == "auto":
            bound = self.tokens_per_forward()
            assert bound is not None  # refused up front without a row length (OccultSFTConfig)
            return bound
        return typing.cast(
            "int | None", self.exchange_capacity
        )  # __post_init__ leaves an int, None or "auto"

    def _force_non_reentrant_checkpointing(self) -> None:
        """The balance loss needs router probabilities attached to the graph inside checkpointed layers:
        reentrant checkpointing runs the forward without a graph, so it is refused when the loss is on."""
        enabled = bool(getattr(self, "activation_checkpointing", None) or self.gradient_checkpointing)
        if not enabled:
            return
        names = [
            n
            for n in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
            if hasattr(self, n)
        ]
        kwargs = next((getattr(self, n) for n in names if getattr(self, n)), None) or {}
        if kwargs.get("use_reentrant", False) and self.balance_loss_coef > 0:
            raise ValueError(
                "gradient_checkpointing_kwargs={'use_reentrant': True} gives the balance loss no gradient; "
                "drop use_reentrant (occult_ft uses non-reentrant checkpointing) or set balance_loss_coef=0"
            )
        kwargs = {**kwargs, "use_reentrant": kwargs.get("use_reentrant", False)}
        for name in names:
            setattr(self, name, kwargs)


@dataclass
class OccultConfig(OccultArguments, TrainingArguments):
    r"""Configuration of an Occult fine-tuning run (`OccultTrainer` and `occult-ft train`).

    Besides every `transformers.TrainingArguments` field, it holds:

    Model and data:
        model_name_or_path: base model (local directory, Hub id, `embedded`, a pruned checkpoint or a
            LoRA adapter directory written by `OccultTrainer`).
        model_dtype: dtype the weights are loaded in.
        dataset / dataset_split / text_field / streaming / skip_invalid_rows: training data, read by
            `occult_ft.data.load_text_dataset` (rows that do not fit its layout are an error, or skipped
            with a count printed).
        eval_dataset / eval_dataset_split: optional held-out data.
        seq_len / packing / response_only: tokenisation (`occult_ft.data.tokenize_dataset`).

    Placement and pruning:
        devices / nodes: the expert-parallel layout D (and N nodes) that placement and the budget refer to.
        placement: `auto` (profile the training data, then `compute_placement`), `sequential` (keep the
            model's expert order) or the path of a placement JSON from `occult-ft place`.
        placement_algorithm: algorithm of `auto` placement; max_load_imbalance: its load bound.
        profile_tokens: tokens of training data profiled for `auto` placement and similarity tables.
        max_devices_per_token: the pruning budget M (None = no pruning, routing is only measured).
        criterion / gate_weights: how tokens over budget are re-routed and weighted (`occult_ft.routing`).
        balance_loss_coef: weight of the pruning-aware load-balancing loss (on the scale of the model's
            own `router_aux_loss_coef`, see `occult_ft.trainer.losses`).
        device_bias_rate: step u of the per-device selection bias moved after every optimizer step
            (auxiliary-loss-free device balancing, `occult_ft.routing.rules.update_device_bias`);
            device_bias_init: its start, `zeros` or `first_batch` (`occult_ft.routing.fit_router_device_bias`).
        distill_coef / distill_temperature: distillation from the unpruned model (`trainer.distill`).

    Training:
        train_mode: `full`, `moe` (MoE blocks only: routers, experts, shared experts) or `lora`.
        lora_r / lora_alpha / lora_dropout: LoRA settings (`train_mode="lora"`).
        expert_parallel_size: processes that share one copy of the experts (1 = data parallel only);
            it divides `devices` (one knob each: D is the layout placed and budgeted for, the EP size how
            many processes hold it now).
    """

    # ---- sensible defaults for the inherited fields -------------------------------------------------
    output_dir: str | None = field(
        default="occult-output",
        metadata={"help": "Directory for checkpoints and the final pruned model (default: occult-output)."},
    )
    learning_rate: float = field(
        default=2e-5,
        metadata={
            "help": "Initial learning rate (AdamW). 2e-5 suits full/moe fine-tuning; LoRA usually wants ~2e-4."
        },
    )
    logging_steps: float = field(
        default=10,
        metadata={
            "help": "Log loss and routing metrics every this many optimizer steps (a float < 1 is a share of all steps)."
        },
    )
    bf16: bool | None = field(  # type: ignore[assignment]  # None: auto, resolved in __post_init__
        default=None,
        metadata={
            "help": "bf16 mixed precision; default (unset): on when the GPU supports bf16, off on CPU."
        },
    )

    # ---- tokenisation (occult_ft.data) ------------------------------------------------------
    text_field: str | None = field(
        default=None, metadata={"help": "Field holding the text when it is neither 'text' nor 'content'."}
    )
    seq_len: int = field(default=512, metadata={"help": "Tokens per training example."})
    packing: bool = field(
        default=True,
        metadata={
            "help": "Pack examples into rows of seq_len tokens: plain text into full blocks; instruction, "
            "prompt/completion and messages rows several per row, kept apart in attention."
        },
    )
    response_only: bool = field(
        default=True, metadata={"help": "Instruction rows: compute the loss on the response tokens only."}
    )

    def _resolve_trainer_defaults(self) -> None:
        if self.bf16 is None:
            self.bf16 = _bf16_available() and not self.fp16 and not self.use_cpu

    def _check_trainer_fields(self) -> None:
        check_positive_int("seq_len", self.seq_len)
        if self.seq_len < 2:
            raise ValueError(
                f"seq_len={self.seq_len} is too short; use at least 2 tokens (typically 128-4096)"
            )

    def tokens_per_row(self) -> int | None:
        return self.seq_len


def _plain_kinds(annotation) -> tuple[type, bool] | None:
    """(allowed types, None allowed) of a field annotated with bool / int / float / str, optionally
    `| None`; None for richer annotations (lists, dicts, enums), which are left to TrainingArguments."""
    optional = False
    members = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = list(typing.get_args(annotation))
        optional = type(None) in members
        members = [m for m in members if m is not type(None)]
    if len(members) != 1 or members[0] not in (bool, int, float, str):
        return None
    return members[0], optional


def _check_field_types(config: OccultArguments) -> None:
    """Every field annotated bool / int / float / str (or `| None`) holds a value of that type, so a
    recipe's `learning_rate: [1, 2]` or `OccultConfig(lora_alpha='32')` is one line naming the field,
    not a TypeError from a comparison deep inside (a float field takes an int: `lora_alpha=32`)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        kinds = _plain_kinds(hints.get(f.name))
        if kinds is None or not f.init:
            continue
        kind, optional = kinds
        value = getattr(config, f.name)
        if value is None and optional:
            continue
        is_bool = isinstance(value, bool)
        ok = {
            bool: is_bool,
            int: isinstance(value, int) and not is_bool,
            float: isinstance(value, (int, float)) and not is_bool,
            str: isinstance(value, str),
        }[kind]
        if ok:
            continue
        name = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[kind]
        hint = ""
        if isinstance(value, str) and kind in (int, float):
            try:
                hint = f", e.g. {f.name}={kind(value)!r} (not the string {value!r})"
            except ValueError:
                pass
        raise ValueError(
            f"{f.name}={value!r} must be {name}{' or None' if optional else ''}{hint}; "
            f"got a {type(value).__name__}"
        )


def _check_run_length_and_output(config: OccultArguments) -> None:
    """A run that would take no optimizer step, and an empty output_dir, are refused up front."""
    if config.max_steps <= 0 and not (math.isfinite(config.num_train_epochs) and config.num_train_epochs > 0):
        raise ValueError(
            f"num_train_epochs={config.num_train_epochs!r} gives no training step; set num_train_epochs > 0 "
            "(e.g. 1) or max_steps > 0"
        )
    if isinstance(config.output_dir, str) and not config.output_dir.strip():
        raise ValueError(
            f"output_dir={config.output_dir!r} is empty; pass the directory for checkpoints and the final model, "
            "e.g. --output_dir my-run"
        )


def check_output_dir(args: OccultArguments) -> None:
    """The run's `output_dir` must not hold files of the user's that training would overwrite (their
    README.md, a model occult_ft did not write): refused, naming them (`occult_ft.fileio`)."""
    if not hasattr(args, "output_dir"):  # a partial config (tests, other callers): nothing to check
        return
    names = ("model_name_or_path", "dataset", "eval_dataset", "deepspeed")
    inputs = tuple(getattr(args, n, None) for n in names)
    inputs = tuple(p for p in inputs if isinstance(p, str) and p not in ("", "embedded"))
    check_output_path(args.output_dir, *inputs, what="output_dir", directory=True, replace=False)


def check_before_loading(args: OccultArguments) -> None:
    """Refuse, before any model is loaded, the combinations the config alone shows cannot work.

    `__post_init__` already checks each field; this adds the checks that read other files: with a
    DeepSpeed config, ZeRO stage 3 (any layout) and, with `expert_parallel_size` > 1, an AutoEP section
    are one-line ValueErrors (`occult_ft.integrations.deepspeed.check_deepspeed_config`; its stage-0 clipping warning
    is left to the expert-parallel setup, which repeats the check). LoRA with expert parallelism is
    supported (the expert LoRA factors shard with the experts), so it is not refused. The budget and the
    layout are checked against the model's config (its expert count and top-k) when it can be read, and
    the output directory must not hold the user's own files (`check_output_dir`).
    """
    check_output_dir(args)
    if args.deepspeed:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_deepspeed_config(args.deepspeed, args.expert_parallel_size, args.max_grad_norm)
    _check_layout_against_the_model_config(args)


def _check_layout_against_the_model_config(args: OccultArguments) -> None:
    """The budget and the expert-parallel layout against the model's expert count and top-k, read from
    its config alone (a local directory, a config shipped for a recipe's model, or the Hub's config.json).
    Skipped when no config can be read here (e.g. offline): the model's own load then checks."""
    name = getattr(args, "model_name_or_path", None)
    if not isinstance(name, str) or not name:
        return

    try:
        config = load_model_config(name)
    except (ValueError, OSError):
        return
    get_arch(config)  # an unsupported or refused model type: one line, before any weight loads
    num_experts, top_k = config_num_experts(config), config_top_k(config)
    if not num_experts or not top_k:
        return
    PruningConfig(
        args.devices, args.max_devices_per_token, args.criterion, args.gate_weights, args.nodes,  # type: ignore[arg-type]  # PruningConfig checks devices
        args.max_nodes_per_token,
    ).check(num_experts, int(top_k))  # fmt: skip
    ep = args.expert_parallel_size
    if ep > 1 and num_experts % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide the {num_experts} experts of {name}; use a divisor"
        )


def _accelerator_available() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _bf16_available() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
