"""Spawn D processes and time every backend's exchange on the same tokens and routing, side by side.

`run_exchanges` writes the routings to a temporary file, starts D processes (torch.multiprocessing,
"spawn"; they meet through a file in that temporary directory, so there is no TCP port to race for) and
collects one JSON result from rank 0. Transport: NCCL with one GPU per process when at least D GPUs are
present, gloo with CUDA tensors when fewer GPUs are present (all processes share GPU 0), gloo on CPU
otherwise (or with `transport="cpu"`).

Per MoE layer, each process takes its contiguous T/D share of the tokens, draws random hidden rows
(the values do not change what is sent), builds every backend's `Exchange`
(`occult_ft.bench.exchanges`) and then measures, round-robin over the backends so that drifting load
hits all of them alike: `warmup` untimed runs, then `iters` timed runs, each after a barrier. A run is
the layer's forward dispatch + combine with identity experts. Recorded per run and process:

    path time        the whole run (packing, layouts, collectives, unpacking)
    collective time  the time inside collectives only (`CollectiveClock`): the exchange
    bytes            bytes handed to the collectives (payload and metadata, both directions)

A run is complete when its slowest process is done, so each iteration's time is the maximum over
processes; the reported figure is the median over iterations. Worker output (library logs) goes to a
log file per process; a failing worker's last line becomes the error.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..dispatch import node_groups
from ..fileio import atomic_write_text
from ..layout import ExpertLayout
from .exchanges import CollectiveClock, build_exchange, init_deepspeed_comm
from .launch import failure_reason

__all__ = ["DTYPES", "BenchSettings", "choose_transport", "run_exchanges"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class BenchSettings:
    """How the exchanges are measured.

    Args:
        devices: D processes (expert-parallel size), at least 2.
        iters: timed runs per backend and layer (median reported).
        warmup: untimed runs per backend and layer first.
        dtype: dtype of the exchanged rows (one of `DTYPES`).
        capacity_factor: DeepSpeed classic's capacity factor (its default 1.0).
        min_capacity: DeepSpeed classic's min_capacity (its default 4).
        seed: seed of the random hidden rows.
        transport: "auto" (GPUs when present) or "cpu" (gloo on CPU).
        timeout_s: collective timeout of the process group.
        nodes: N nodes the D processes are laid out as (D/N consecutive processes each); above 1 the
            two-stage exchange is measured too and rows are split into inside / across nodes.
    """

    devices: int
    iters: int = 5
    warmup: int = 2
    dtype: str = "bfloat16"
    capacity_factor: float = 1.0
    min_capacity: int = 4
    seed: int = 0
    transport: str = "auto"
    timeout_s: float = 600.0
    nodes: int = 1

    def __post_init__(self):
        if not isinstance(self.devices, int) or self.devices < 2:
            raise ValueError(
                f"devices={self.devices!r}: the exchange needs at least 2 processes, e.g. --devices 4"
            )
        ExpertLayout(self.devices, self.devices, self.nodes)  # N must divide D (no experts involved yet)
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"iters={self.iters} must be >= 1 and warmup={self.warmup} >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be positive (DeepSpeed's default is 1.0)"
            )
        if self.transport not in ("auto", "cpu"):
            raise ValueError(f"transport={self.transport!r}: use 'auto' or 'cpu'")

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=DTYPES[self.dtype]).element_size()


def choose_transport(devices: int, transport: str = "auto") -> tuple[str, str, str]:
    """(process-group backend, tensor device type, description) for `devices` processes."""
    if transport == "cpu" or not torch.cuda.is_available():
        return "gloo", "cpu", f"{devices} gloo processes on CPU"
    gpus = torch.cuda.device_count()
    if gpus >= devices:
        return "nccl", "cuda", f"{devices} NCCL processes, one GPU each"
    return "gloo", "cuda", f"{devices} gloo processes sharing GPU 0 (CUDA tensors; {gpus} GPU(s) < {devices})"


def _agree(ok: bool, device: torch.device, group) -> bool:
    """True only if every process reports ok (so all of them keep or drop a backend together)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _deepspeed_comm(names: list[str], backend: str, device: torch.device, group) -> str | None:
    """deepspeed.comm set up when a DeepSpeed backend is measured: None, or why not (on every process alike)."""
    if not any(n.startswith("deepspeed_classic") for n in names):
        return None
    ds_error = init_deepspeed_comm(backend)
    if not _agree(ds_error is None, device, group) and ds_error is None:
        ds_error = "deepspeed.comm failed to initialise on another process"
    return ds_error


def _hf_mesh(names: list[str], world: int, device: torch.device, group, unavailable: dict[str, str]):
    """transformers native EP's device mesh when hf_native_ep is measured; when it cannot run, None and
    the reason in `unavailable`."""
    if "hf_native_ep" not in names:
        return None
    error, mesh = None, None
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import AllToAllEP  # noqa: F401

        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("ep", "tp"))
    except Exception as exc:  # noqa: BLE001 - reported as "not measured, because ..."
        error = f"transformers native EP cannot run here: {_one_line(exc)}"
    if not _agree(error is None, device, group):
        unavailable["hf_native_ep"] = error or "transformers native EP failed on another process"
    return mesh


def _build_exchanges(
    layer: dict,
    hidden_TH: torch.Tensor,
    rank: int,
    world: int,
    spec: dict,
    device: torch.device,
    group,
    context: dict,
) -> dict:
    """Every available backend's exchange of one layer on this process, each tried once; a backend that
    fails on any process is dropped everywhere and its reason lands in `context["unavailable"]`."""
    names: list[str] = spec["backends"]
    settings, unavailable = spec["settings"], context["unavailable"]
    exchanges = {}
    for name in names:
        if name in unavailable:
            continue
        ids_TK, weights_TK = (t.tensor_split(world)[rank].to(device) for t in layer[name])
        error = None
        try:
            with torch.no_grad():
                exchanges[name] = build_exchange(
                    name,
                    hidden_TH,
                    ids_TK,
                    weights_TK,
                    spec["num_experts"],
                    group,
                    capacity_factor=settings["capacity_factor"],
                    min_capacity=settings["min_capacity"],
                    deepspeed_error=context["deepspeed_error"],
                    mesh=context["mesh"],
                    node_groups=context["node_groups"],
                    capacity=-(-int(layer[names[0]][0].shape[0]) // world),
                )
                exchanges[name].run()  # a trial run: failures surface here, on every process alike
        except Exception as exc:  # noqa: BLE001 - reported as "not measured, because ..."
            error = f"{name} could not be set up: {_one_line(exc)}"
        if not _agree(error is None, device, group):
            exchanges.pop(name, None)
            unavailable[name] = error or f"{name} failed to set up on another process"
    return exchanges


def _time_exchanges(
    exchanges: dict, settings: dict, clock: CollectiveClock, device: torch.device, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(times (B, iters, 2): whole path and inside collectives, seconds; bytes (B,) handed to the
    collectives) of the B exchanges, after the warm-up; each iteration starts one backend later."""
    active = list(exchanges)
    times = torch.zeros(len(active), settings["iters"], 2, dtype=torch.float64)
    nbytes = torch.zeros(len(active), dtype=torch.float64)
    with torch.no_grad(), clock:
        for _ in range(settings["warmup"]):
            for name in active:
                exchanges[name].run()
        for it in range(settings["iters"]):
            shift = it % max(1, len(active))
            for name in active[shift:] + active[:shift]:
                i = active.index(name)
                dist.barrier(group)
                clock.reset()
                start = time.perf_counter()
                exchanges[name].run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[i, it, 0] = time.perf_counter() - start
                times[i, it, 1] = clock.seconds
                nbytes[i] = clock.bytes
    return times, nbytes


def _measure(rank: int, world: int, spec: dict, device: torch.device, backend: str) -> dict:
    group = dist.group.WORLD
    dtype = DTYPES[spec["dtype"]]
    names: list[str] = spec["backends"]
    settings = spec["settings"]
    unavailable: dict[str, str] = {}
    context = {
        "unavailable": unavailable,
        "deepspeed_error": _deepspeed_comm(names, backend, device, group),
        "mesh": _hf_mesh(names, world, device, group, unavailable),
        "node_groups": node_groups(settings["nodes"], group) if settings.get("nodes", 1) > 1 else None,
    }
    layers_out = []
    clock = CollectiveClock()
    for li, layer in enumerate(spec["layers"]):
        gen = torch.Generator().manual_seed(settings["seed"] * 1_000_003 + li * 101 + rank)
        share = int(layer[names[0]][0].tensor_split(world)[rank].shape[0])  # this process's tokens
        hidden_TH = torch.randn(share, spec["hidden"], generator=gen).to(device, dtype)
        exchanges = _build_exchanges(layer, hidden_TH, rank, world, spec, device, group, context)
        active = list(exchanges)
        times, nbytes = _time_exchanges(exchanges, settings, clock, device, group)
        rows = torch.tensor([exchanges[n].send_rows_D for n in active], dtype=torch.float64).reshape(
            len(active), world
        )
        stage2 = torch.tensor(
            [exchanges[n].stage2_rows_D or [0] * world for n in active], dtype=torch.float64
        ).reshape(len(active), world)
        dropped = torch.tensor([exchanges[n].dropped_routes for n in active], dtype=torch.float64)
        local = torch.cat([times.flatten(), nbytes, rows.flatten(), dropped, stage2.flatten()]).to(device)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        if rank == 0:
            layers_out.append(_summarise(active, exchanges, gathered, settings["iters"], world))
    return {"unavailable": unavailable, "layers": layers_out}


def _summarise(
    active: list[str], exchanges: dict, gathered: list[torch.Tensor], iters: int, world: int
) -> dict:
    b = len(active)
    per_rank = torch.stack([g.cpu() for g in gathered])  # (world, n)
    n_times = b * iters * 2
    times_WBI2 = per_rank[:, :n_times].reshape(world, b, iters, 2)
    bytes_WB = per_rank[:, n_times : n_times + b]
    rows_WBD = per_rank[:, n_times + b : n_times + b + b * world].reshape(world, b, world)
    dropped_WB = per_rank[:, n_times + b + b * world : n_times + 2 * b + b * world]
    stage2_WBD = per_rank[:, n_times + 2 * b + b * world :].reshape(world, b, world)
    worst_BI2 = times_WBI2.max(dim=0).values * 1000.0  # a run ends when its slowest process is done
    out = {}
    for i, name in enumerate(active):
        path_ms = worst_BI2[i, :, 0].tolist()
        exchange_ms = worst_BI2[i, :, 1].tolist()
        out[name] = {
            "implementation": exchanges[name].implementation,
            "exchange_ms": statistics.median(exchange_ms),
            "path_ms": statistics.median(path_ms),
            "exchange_ms_runs": [round(x, 4) for x in exchange_ms],
            "path_ms_runs": [round(x, 4) for x in path_ms],
            "collective_bytes": int(bytes_WB[:, i].sum()),
            "rows_DD": rows_WBD[:, i, :].long().tolist(),
            "dropped_routes": int(dropped_WB[:, i].sum()),
        }
        if exchanges[name].stage2_rows_D:
            out[name]["stage2_rows_DD"] = stage2_WBD[:, i, :].long().tolist()
    return out


def _worker(rank: int, world: int, spec_path: str, out_dir: str) -> None:
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 - kept open for the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    spec = torch.load(spec_path, weights_only=True)
    backend, device_type = spec["transport"][0], spec["transport"][1]
    if device_type == "cuda":
        index = rank if backend == "nccl" else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    # DeepSpeed's init checks that these are set (else it tries MPI discovery); the group already exists
    # by then, so the port is never bound: the processes meet through a file, not a TCP port, which
    # another process on the machine could take between being found free and being bound (EADDRINUSE)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank if backend == "nccl" else 0),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.init_process_group(
        backend,
        init_method="file://" + os.path.join(out_dir, "rendezvous"),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec["settings"]["timeout_s"]),
    )
    try:
        result = _measure(rank, world, spec, device, backend)
        if rank == 0:
            atomic_write_text(os.path.join(out_dir, "result.json"), json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_exchanges(
    layers: list[dict], backends: list[str], num_experts: int, hidden: int, settings: BenchSettings
) -> dict:
    """Measure `backends` on D processes.

    Args:
        layers: per measured layer, backend name -> (topk_ids_TK, weights_TK) over all T tokens.
        backends: backend names, in report order.
        num_experts: E.
        hidden: H, width of the exchanged rows.
        settings: the measurement settings.

    Returns:
        {"transport": description, "unavailable": {backend: reason},
         "layers": [per layer: backend -> {"exchange_ms", "path_ms", "exchange_ms_runs", "path_ms_runs",
         "collective_bytes", "rows_DD" (D x D rows of one dispatch; first stage of a two-stage one),
         "stage2_rows_DD" (two-stage backends: its intra-node stage), "dropped_routes", "implementation"}]}
    """
    import torch.multiprocessing as mp

    transport = choose_transport(settings.devices, settings.transport)
    spec = {
        "transport": list(transport[:2]),
        "backends": list(backends),
        "num_experts": int(num_experts),
        "hidden": int(hidden),
        "dtype": settings.dtype,
        "settings": asdict(settings),
        "layers": [{name: tuple(layer[name]) for name in backends} for layer in layers],
    }
    saved_env = {
        k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")
    }
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        with tempfile.TemporaryDirectory(prefix="occult-bench-") as tmp:
            spec_path = os.path.join(tmp, "spec.pt")
            torch.save(spec, spec_path)
            try:
                mp.start_processes(
                    _worker,
                    args=(settings.devices, spec_path, tmp),
                    nprocs=settings.devices,
                    join=True,
                    start_method="spawn",
                )
            except mp.ProcessRaisedException as exc:
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                raise RuntimeError(f"benchmark process failed: {lines[-1] if lines else exc}") from None
            except mp.ProcessExitedException as exc:
                raise RuntimeError(f"benchmark process died: {failure_reason(tmp, str(exc))}") from None
            result_path = os.path.join(tmp, "result.json")
            if not os.path.isfile(result_path):
                raise RuntimeError(
                    f"benchmark processes wrote no result: {failure_reason(tmp, 'no error logged')}"
                )
            with open(result_path) as f:
                result = json.load(f)
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    result["transport"] = transport[2]
    return result
