"""One contender of the train-step benchmark, inside one of its D processes (launched by torchrun).

`python -m torch.distributed.run --nproc_per_node D -m occult_ft.bench.step_worker SPEC.json`: every
process loads the same saved model (`spec["model_dir"]`), feeds the same rows as every other contender
(`step_rows`), trains `warmup + steps` steps (`grad_accum` micro-batches each) the way the contender's
users would, and records per step its wall time, the global mean loss and the phase clock (`PhaseClock`);
at the end its peak memory and the host synchronisations of one forward. Rank 0 writes everything, for
all ranks, to `spec["result"]`.

Contenders (`KINDS`):
    data_parallel   transformers `Trainer`, the whole model on every rank (DDP), stock experts kernel
    occult_ep       `OccultTrainer`, expert_parallel_size D ("occult_ep" kernel), exchange/budget/chunks
                    from the contender's settings (flat, per_expert, two_stage; budgets 1, 2)
    hf_native_ep    transformers `Trainer` on a model loaded with `DistributedConfig(fsdp_size=D, ep_size=D,
                    ep_implementation="all_to_all")` (FSDP2 + transformers' own expert parallelism)
    deepspeed_moe   every MoE block replaced by `deepspeed.moe.layer.MoE(ep_size=D, k=K, drop_tokens=False)`
                    holding the same expert and router weights, trained by the DeepSpeed engine (ZeRO 0)

Shape legend: D processes (= expert-parallel size), B sequences per rank and step, S sequence length.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..dispatch.comm import close_process_group, exit_rank
from ..layout import ExpertLayout
from ..models import unwrap_model
from ..trainer import OccultConfig, OccultTrainer
from .syncs import HostSyncCounter
from .worker_results import gather_to_rank0

__all__ = ["KINDS", "PhaseClock", "main"]

KINDS = ("data_parallel", "occult_ep", "hf_native_ep", "deepspeed_moe")
_COLLECTIVES = (
    "all_to_all_single",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "broadcast",
    "barrier",
)
_EXCHANGE = ("all_to_all_single", "all_to_all_single_autograd")
_GRADIENT_REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")  # FSDP2: _single


def _group_of(name: str, args: tuple, kwargs: dict):
    """The process group a collective call names (None: the default group)."""
    group = kwargs.get("group")
    if group is None and name == "all_to_all_single_autograd" and len(args) > 3:
        group = args[3]
    elif group is None and name == "all_to_all_single" and len(args) > 4:
        group = args[4]
    return group if isinstance(group, dist.ProcessGroup) else None


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


# The phase clock times, per step and rank: the model's forward, each attention, router and MoE block
# forward (forward hooks), every collective Python calls (all-to-all and friends, forward and backward
# told apart by whether the loss's backward call is running; with `barrier` a barrier before each one,
# timed as waiting), and the optimizer step (global optimizer hooks). On CUDA it synchronises around what
# it times. Each exchange collective is also recorded as an event (its group, its sequence number in that
# group, when this rank issued it, when this rank was blocked in it or in its `wait()`): the driver tells
# waiting for other ranks from transfer with them (`occult_ft.bench.step_report.waiting_by_rank`; one machine,
# one monotonic clock). Gradient reductions issued inside backward (DDP's buckets, through its Python
# all-reduce hook; DeepSpeed's all-reduce; FSDP's reduce-scatter) are the `dense_allreduce` phase: the
# blocking calls, and for asynchronous ones the time from the last one's issue to the end of backward
# (what backward waits for them); so is every collective on a group in `dense_groups` (occult_ft's input
# embedding reduction, `EmbeddingGradientReducer`: its issue and its waits, outside backward too).
class PhaseClock:
    """Per-step phase times of one rank (see the comment above); `snapshot()` returns and resets them.

    Keys (seconds): forward, attention, router, moe_block, exchange_fwd, exchange_fwd_wait, exchange_bwd,
    exchange_bwd_wait, dense_allreduce, other_collectives, optimizer. `exchange_*_wait` is the barrier
    before each exchange collective (only with `barrier=True`); `exchange_*` is the collective itself
    after it. `events()` returns and resets the step's exchange events: [group, seq, issued,
    [[blocked_from, blocked_to], ...]].
    """

    def __init__(self, model: nn.Module, barrier: bool = False, cuda: bool = False):
        self.barrier, self.cuda = barrier, cuda
        self.times: dict[str, float] = defaultdict(float)
        self._events: list[list] = []
        self._seq: dict[str, int] = defaultdict(int)
        self.in_backward = False
        self._last_async_dense: float | None = None
        #: process groups whose every collective is a gradient reduction (`dense_allreduce`), wherever issued
        self.dense_groups: list[dist.ProcessGroup] = []
        self._saved: list[tuple[object, str, object]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._inside = 0
        self._open: dict[int, float] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "self_attn":
                self._time_module(module, "attention")
            elif leaf in ("gate", "router") and ".mlp" in name:
                self._time_module(module, "router")
            elif leaf == "mlp":
                self._time_module(module, "moe_block")
        self._time_module(model, "forward")
        self._patch_collectives()
        self._optimizer_hooks = (
            register_optimizer_step_pre_hook(self._opt_pre),
            register_optimizer_step_post_hook(self._opt_post),
        )

    # ---- modules and the optimizer ----
    def _time_module(self, module: nn.Module, key: str) -> None:
        def pre(mod, args, kwargs=None):
            self._open[id(mod)] = _now(self.cuda)

        def post(mod, args, output):
            start = self._open.pop(id(mod), None)
            if start is not None:
                self.times[key] += _now(self.cuda) - start

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _opt_pre(self, optimizer, args, kwargs):
        self._open[id(optimizer)] = _now(self.cuda)

    def _opt_post(self, optimizer, args, kwargs):
        start = self._open.pop(id(optimizer), None)
        if start is not None:
            self.times["optimizer"] += _now(self.cuda) - start

    # ---- collectives ----
    def _patch_collectives(self) -> None:
        owners = [dist]
        try:
            import transformers.distributed.expert_parallel as hf_ep

            owners.append(hf_ep)
        except ImportError:
            pass
        for owner in owners:
            for name in (*_COLLECTIVES, "all_to_all_single_autograd"):
                fn = getattr(owner, name, None)
                if fn is not None and callable(fn):
                    self._saved.append((owner, name, fn))
                    setattr(owner, name, self._timed(fn, name))

    def _timed(self, fn, name: str):
        clock = self

        def wrapper(*args, **kwargs):
            if clock._inside:
                return fn(*args, **kwargs)
            clock._inside += 1
            try:
                exchange = name in _EXCHANGE
                # inside the loss's backward call (not grad mode: an autograd Function's forward runs
                # without grad, and the chunked and two-stage exchanges issue there)
                phase = "bwd" if clock.in_backward else "fwd"
                group = _group_of(name, args, kwargs)
                if exchange and clock.barrier and not kwargs.get("async_op"):
                    start = _now(clock.cuda)
                    dist.barrier(group=group)
                    clock.times[f"exchange_{phase}_wait"] += _now(clock.cuda) - start
                if exchange:
                    key = f"exchange_{phase}"
                elif group is not None and any(group is g for g in clock.dense_groups):
                    key = "dense_allreduce"
                elif clock.in_backward and name in _GRADIENT_REDUCTIONS:
                    key = "dense_allreduce"
                else:
                    key = "other_collectives"
                start = _now(clock.cuda)
                out = fn(*args, **kwargs)
                if name == "all_to_all_single_autograd":
                    out = torch.ops._c10d_functional.wait_tensor(out)
                end = _now(clock.cuda)
                clock.times[key] += end - start  # async: launching the call; the rest is timed at wait()
                event = clock._event(group, start, end) if exchange and not clock.barrier else None
                if kwargs.get("async_op") and out is not None:
                    if key == "dense_allreduce":
                        clock._last_async_dense = end
                    return _TimedWork(out, clock, key, event)
                return out
            finally:
                clock._inside -= 1

        return wrapper

    def _event(self, group, issued: float, blocked_to: float) -> list:
        """Record an exchange collective issued at `issued` (blocked until `blocked_to`)."""
        ranks = dist.get_process_group_ranks(group) if isinstance(group, dist.ProcessGroup) else None
        gkey = ",".join(map(str, ranks)) if ranks is not None else "world"
        event = [gkey, self._seq[gkey], issued, [[issued, blocked_to]]]
        self._seq[gkey] += 1
        self._events.append(event)
        return event

    def timed_backward(self, backward):
        """`backward` (a loss's backward call) with gradient reductions inside it counted as
        dense_allreduce, asynchronous ones up to the end of backward."""
        clock = self

        def wrapper(*args, **kwargs):
            clock.in_backward, clock._last_async_dense = True, None
            try:
                return backward(*args, **kwargs)
            finally:
                end = _now(clock.cuda)
                if clock._last_async_dense is not None:  # backward ended by waiting for the buckets
                    clock.times["dense_allreduce"] += max(0.0, end - clock._last_async_dense)
                clock.in_backward, clock._last_async_dense = False, None

        return wrapper

    def snapshot(self) -> dict[str, float]:
        out = dict(self.times)
        self.times.clear()
        self._open.clear()
        return out

    def events(self) -> list[list]:
        out = self._events
        self._events = []
        self._seq.clear()
        return out

    def close(self) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
        for handle in self._handles:
            handle.remove()
        for handle in self._optimizer_hooks:
            handle.remove()


class _TimedWork:
    """An async collective's work handle: its issue and its `wait()` count, the overlapped time between
    them does not (what a pipelined exchange costs on the critical path)."""

    def __init__(self, work, clock: PhaseClock, key: str, event: list | None = None):
        self._work, self._clock, self._key, self._event = work, clock, key, event

    def wait(self, *args, **kwargs):
        begin = _now(self._clock.cuda)
        out = self._work.wait(*args, **kwargs)
        end = _now(self._clock.cuda)
        self._clock.times[self._key] += end - begin
        if self._event is not None:
            self._event[3].append([begin, end])
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


# ---- data -------------------------------------------------------------------------------------------
ROUTING_FIELDS = ("load_imbalance", "comm_complexity")
"""What `OccultTrainer` logs per step that the report keeps (mean over a layer's micro-batches and layers)."""


def step_rows(spec: dict, micro: int, rank: int, world: int) -> torch.Tensor:
    """(B, S) token ids rank `rank` trains on in micro-batch `micro` (counted over all steps; the
    sequential distributed order)."""
    data = torch.load(spec["data"], weights_only=True)
    b = spec["batch_per_rank"]
    # micro-batch m, rank r: rows (m * B + j) * D + r, j < B: what Trainer's sequential distributed sampler
    # gives, so every contender trains on the same rows
    index = [(micro * b + j) * world + rank for j in range(b)]
    return data[index]


def _dataset(spec: dict):
    from datasets import Dataset

    data = torch.load(spec["data"], weights_only=True)
    rows = data.tolist()
    return Dataset.from_dict(
        {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows], "labels": rows}
    )


def _training_arguments(spec: dict, out: str, cls=None, **extra):
    from transformers import TrainingArguments

    cls = cls or TrainingArguments
    cuda = spec["device"] == "cuda"
    return cls(
        output_dir=out,
        per_device_train_batch_size=spec["batch_per_rank"],
        gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        max_grad_norm=1.0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not cuda,
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        bf16=spec["dtype"] == "bfloat16" and cuda,
        **extra,
    )


class _StepTimer:
    """TrainerCallback collecting step times and phase snapshots (imported lazily with transformers);
    at the start of training it gives DDP the Python form of its default all-reduce hook (the same
    reduction, visible to the clock)."""

    @staticmethod
    def make(trainer, clock: PhaseClock, cuda: bool, records: list):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel
        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if isinstance(trainer.model_wrapped, DistributedDataParallel):
                    trainer.model_wrapped.register_comm_hook(None, allreduce_hook)

            def on_step_begin(self, args, state, control, **kwargs):
                clock.snapshot()
                clock.events()
                self.start = _now(cuda)

            def on_step_end(self, args, state, control, **kwargs):
                seconds = _now(cuda) - self.start
                records.append({"seconds": seconds, "phases": clock.snapshot(), "events": clock.events()})

        return StepTimer()


def _train_with_trainer(trainer, clock, spec, records) -> list[float]:
    trainer.add_callback(_StepTimer.make(trainer, clock, spec["device"] == "cuda", records))
    trainer.accelerator.backward = clock.timed_backward(trainer.accelerator.backward)
    trainer.train()
    for entry in trainer.state.log_history:  # the routing the trainer logged, onto its step's record
        step = entry.get("step", 0)
        if 0 < step <= len(records):
            routing = {k: entry[k] for k in ROUTING_FIELDS if k in entry}
            if routing:
                records[step - 1]["routing"] = routing
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


# ---- contenders -------------------------------------------------------------------------------------
def run_data_parallel(spec: dict, rank: int, world: int, records: list) -> tuple[nn.Module, list[float]]:
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    clock = PhaseClock(model, spec["barrier"], spec["device"] == "cuda")
    trainer = Trainer(model=model, args=_training_arguments(spec, spec["out"]), train_dataset=_dataset(spec))
    losses = _train_with_trainer(trainer, clock, spec, records)
    clock.close()
    return model, losses


def run_occult_ep(spec: dict, rank: int, world: int, records: list) -> tuple[nn.Module, list[float]]:
    c = spec["contender"]
    args = _training_arguments(
        spec,
        spec["out"],
        cls=OccultConfig,
        seq_len=spec["seq_len"],
        devices=world,
        nodes=spec["nodes"],
        expert_parallel_size=world,
        placement="sequential",
        max_devices_per_token=c.get("max_devices_per_token"),
        criterion="score",
        balance_loss_coef=0.0,
        train_mode="full",
        model_dtype="float32",
        exchange=c.get("exchange", "flat"),
        exchange_chunks=c.get("chunks"),  # None: the library default
        exchange_overlap_local=c.get("overlap", False),
        exchange_overlap_shared=c.get("overlap_shared", False),
        exchange_capacity=c.get("capacity"),
        embedding_gradient_overlap=c.get("embedding_gradient_overlap", True),
        device_bias_rate=c.get("device_bias_rate", 0.0),
        device_bias_init="first_batch" if c.get("device_bias_rate") else "zeros",
        profile_tokens=spec["seq_len"],
    )
    trainer = OccultTrainer(spec["model_dir"], args=args, train_dataset=_dataset(spec))
    assert trainer.model is not None
    clock = PhaseClock(unwrap_model(trainer.model), spec["barrier"], spec["device"] == "cuda")
    if trainer.embedding_reducer is not None:  # its collectives are the dense-gradient reduction
        clock.dense_groups.append(trainer.embedding_reducer.group)
    losses = _train_with_trainer(trainer, clock, spec, records)
    clock.close()
    return trainer.model, losses


def run_hf_native_ep(spec: dict, rank: int, world: int, records: list) -> tuple[nn.Module, list[float]]:
    from transformers import AutoModelForCausalLM, Trainer
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], distributed_config=config, dtype=torch.float32
    )
    clock = PhaseClock(model, spec["barrier"], spec["device"] == "cuda")
    trainer = Trainer(model=model, args=_training_arguments(spec, spec["out"]), train_dataset=_dataset(spec))
    losses = _train_with_trainer(trainer, clock, spec, records)
    clock.close()
    return model, losses


class _SwiGLUExpert(nn.Module):
    """One OLMoE expert as an nn.Module for DeepSpeed's `MoE`: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class _DeepSpeedBlock(nn.Module):
    """An OLMoE MoE block as DeepSpeed's classic MoE layer, with the block's router and expert weights."""

    def __init__(self, block: nn.Module, config, world: int, rank: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        e, k, h = config.num_experts, config.num_experts_per_tok, config.hidden_size
        inner = config.intermediate_size
        # drop-less, no random token selection, no sampled 2nd expert (top-2): the model's own routing
        self.moe = MoE(
            h, _SwiGLUExpert(h, inner), e, ep_size=world, k=k, drop_tokens=False, use_rts=False,
            top2_2nd_expert_sampling=False,
        )  # fmt: skip
        per = ExpertLayout(e, world).experts_per_device
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(block.gate.weight)  # type: ignore[union-attr]
            for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                expert.gate_up.weight.copy_(block.experts.gate_up_proj[rank * per + i])  # type: ignore[index, union-attr]
                expert.down.weight.copy_(block.experts.down_proj[rank * per + i])  # type: ignore[index, union-attr]
        self.gate = self.moe.deepspeed_moe.gate  # timed as the router

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        out, _, _ = self.moe(hidden_states.reshape(b * s, h))
        return out.reshape(b, s, h)


def run_deepspeed_moe(spec: dict, rank: int, world: int, records: list) -> tuple[nn.Module, list[float]]:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="nccl" if spec["device"] == "cuda" else "gloo")
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    for layer in model.model.layers:
        layer.mlp = _DeepSpeedBlock(layer.mlp, model.config, world, rank)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "all"}
    )
    optimizer = torch.optim.AdamW(groups, lr=spec["learning_rate"])
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch_per_rank"],
        "gradient_accumulation_steps": spec["grad_accum"],
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    cuda = spec["device"] == "cuda"
    clock = PhaseClock(model, spec["barrier"], cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    losses = []
    backward = clock.timed_backward(engine.backward)
    accum = spec["grad_accum"]
    for step in range(spec["warmup"] + spec["steps"]):
        batches = [step_rows(spec, step * accum + k, rank, world).to(device) for k in range(accum)]
        clock.snapshot()
        clock.events()
        start = _now(cuda)
        total = torch.zeros(())
        for ids in batches:  # the engine steps the optimizer on the last micro-batch only
            loss = engine(input_ids=ids, labels=ids).loss
            backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        seconds = _now(cuda) - start
        records.append({"seconds": seconds, "phases": clock.snapshot(), "events": clock.events()})
        dist.all_reduce(total)
        losses.append(float(total) / (world * accum))
    clock.close()
    return engine.module, losses


RUNNERS = {
    "data_parallel": run_data_parallel,
    "occult_ep": run_occult_ep,
    "hf_native_ep": run_hf_native_ep,
    "deepspeed_moe": run_deepspeed_moe,
}


def _syncs_per_layer(model: nn.Module, spec: dict, rank: int, world: int) -> float:
    """Host synchronisations inside the MoE blocks (router, exchange, experts) of one training forward,
    per MoE layer."""
    device = next(model.parameters()).device
    ids = step_rows(spec, 0, rank, world).to(device)
    counter = HostSyncCounter(keep_sites=False)
    counter.enabled = False
    handles = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp":
            handles.append(module.register_forward_pre_hook(lambda *a: setattr(counter, "enabled", True)))
            handles.append(module.register_forward_hook(lambda *a: setattr(counter, "enabled", False)))
    try:
        with counter:
            model(input_ids=ids, labels=ids)
    finally:
        for handle in handles:
            handle.remove()
    return counter.count / spec["num_layers"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    spec["out"] = os.path.join(spec["out"], f"rank{rank}")
    import transformers  # noqa: F401 - its import is part of the baseline, not of the contender

    base_rss = _peak_rss_mb()
    records: list[dict] = []
    model, losses = RUNNERS[spec["contender"]["kind"]](spec, rank, world, records)
    syncs = _syncs_per_layer(unwrap_model(model), spec, rank, world) if spec["count_syncs"] else None
    if spec["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:  # what training added to the process's peak RSS (torch, transformers and Python excluded)
        peak = _peak_rss_mb() - base_rss
    mine = {"records": records, "losses": losses, "peak_mb": peak, "base_rss_mb": base_rss, "syncs": syncs}
    gather_to_rank0(mine, spec["result"], world)
    close_process_group()  # the gather ended on a barrier


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank(0)
