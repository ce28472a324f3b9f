"""An emulated cluster on one machine: N nodes x G processes joined by rate-limited links, real TCP.

`EmulatedCluster(nodes, procs_per_node, link_rate)` is a context manager (root, `ip`, `tc` and the tbf
qdisc needed; `check_cluster_support` refuses in one line naming what is missing) that builds

    nodes > 1:  one network namespace per node ("{prefix}-n{r}"), each with a veth "eth0" at
                10.213.0.{r + 1}/24 whose peer "p{r}" sits on a bridge "br0" in a namespace of its own
                ("{prefix}-br"); both ends shaped with `tc qdisc add dev DEV root tbf rate RATE burst
                256kb latency 100ms` (node -> bridge and bridge -> node). Processes inside a node reach
                each other through the namespace's loopback, unshaped (the NVLink of the emulation:
                traffic to a node's own address never leaves it).
    nodes == 1: one namespace whose loopback is shaped (every process-to-process byte crosses it).

Nothing is created in the caller's namespace and no route leads out, so all traffic (private addresses)
stays inside; names start with "oft{pid}{n}-", so concurrent runs do not collide. `__exit__` kills the
process groups the cluster launched, deletes its namespaces (devices and qdiscs go with them) and
restores the signal handlers (SIGTERM and SIGHUP become `SystemExit` while the cluster is up, so a
terminated run unwinds through `__exit__` as Ctrl-C does).

`cluster.torchrun(module_args, env, log_dir, timeout_s)` runs one torchrun agent per node (`ip netns
exec NS python -m torch.distributed.run --nnodes N --node_rank R --nproc_per_node G --rdzv_backend c10d
--rdzv_endpoint ADDR:PORT --local-addr ADDR ...`), with gloo bound to the node's link
(`GLOO_SOCKET_IFNAME`), and waits for all of them. What the shaped links hold when measured: docs/cluster.md.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ..checks import check_positive_int

__all__ = [
    "ClusterUnavailable",
    "EmulatedCluster",
    "check_cluster_support",
    "parse_rate",
    "cluster_namespaces",
]

SUBNET = "10.213.0"
"""Private /24 of the node addresses; it exists only inside the namespaces a cluster creates."""
RDZV_PORT = 29400
_counter = itertools.count()
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?$", re.IGNORECASE)


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot run here; the message is one line naming what is missing."""


def parse_rate(text: str) -> str:
    """A link rate as tc writes it: '1gbit', '300mbit', '2.5gbit', '500kbit' (bits per second; a bare
    number is bit/s). Returns the canonical tc string; raises ValueError naming the value."""
    match = _RATE.match(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"link rate {text!r} is not a rate; write e.g. 1gbit, 300mbit or 2.5gbit")
    number, prefix, unit = match.groups()
    if unit and unit.lower() == "bps":
        raise ValueError(f"link rate {text!r}: give bits per second (e.g. 1gbit), not bytes (bps)")
    value = float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[prefix.lower()]
    if value < 1e5:
        raise ValueError(f"link rate {text!r} is below 100kbit; a training step would take hours")
    for scale, name in ((1e9, "gbit"), (1e6, "mbit"), (1e3, "kbit")):
        if value >= scale and float(value / scale).is_integer():
            return f"{int(value / scale)}{name}"
    return f"{int(round(value))}bit"


def rate_bits(rate: str) -> float:
    """Bits per second of a `parse_rate` string."""
    match = _RATE.match(parse_rate(rate))
    assert match is not None
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        why = " ".join((proc.stderr or proc.stdout).split())[:300] or f"exit status {proc.returncode}"
        raise ClusterUnavailable(f"emulated cluster: `{' '.join(cmd)}` failed: {why}")
    return proc


def check_cluster_support() -> None:
    """Raise `ClusterUnavailable` (one line) unless this process can build a cluster: root, `ip` and
    `tc` on PATH (package iproute2). The tbf qdisc and namespaces themselves are checked when the
    cluster is built (a kernel without them fails there, named)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise ClusterUnavailable(
            "the emulated cluster (--link-rate) needs root: network namespaces and tc qdiscs are "
            "privileged; run as root or drop --link-rate"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(
            f"the emulated cluster (--link-rate) needs {' and '.join(f'`{t}`' for t in missing)} on PATH; "
            "install iproute2 (apt-get install iproute2) or drop --link-rate"
        )


def cluster_namespaces(prefix: str | None = None) -> list[str]:
    """Network namespaces on this machine made by emulated clusters ("oft<pid><n>-..."), or only those
    of one cluster's `prefix`."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    want = re.compile(rf"^{re.escape(prefix)}-" if prefix else r"^oft\d+-")
    return [n for n in names if want.match(n)]


class EmulatedCluster:
    """N nodes x G processes with links of `link_rate` (see the module docstring).

    Args:
        nodes: N >= 1. procs_per_node: G >= 1 (processes a torchrun agent starts per node).
        link_rate: tc rate of every node's link (both directions), e.g. "1gbit" (`parse_rate`).
        burst / latency: tbf parameters (tc syntax).
    """

    def __init__(
        self,
        nodes: int,
        procs_per_node: int,
        link_rate: str,
        burst: str = "256kb",
        latency: str = "100ms",
    ):
        check_positive_int("nodes", nodes)
        if nodes > 250:
            raise ValueError(f"nodes={nodes} exceeds the 250 addresses of the cluster's /24; use fewer nodes")
        check_positive_int("procs_per_node", procs_per_node)
        self.nodes, self.procs_per_node = nodes, procs_per_node
        self.link_rate = parse_rate(link_rate)
        self.burst, self.latency = burst, latency
        self.prefix = f"oft{os.getpid()}{next(_counter)}"
        self.namespaces: list[str] = []  # created, in order (removed in reverse)
        self._children: list[subprocess.Popen] = []
        self._saved_handlers: dict[int, object] = {}
        self._lock = threading.Lock()
        self._launches = 0

    # ---- names -----------------------------------------------------------------------------------
    def node_namespace(self, r: int) -> str:
        return f"{self.prefix}-n{r}"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}-br"

    def node_address(self, r: int) -> str:
        return f"{SUBNET}.{r + 1}" if self.nodes > 1 else "127.0.0.1"

    @property
    def link_device(self) -> str:
        """The device gloo binds to in every node: the veth, or the loopback of a single node."""
        return "eth0" if self.nodes > 1 else "lo"

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def describe(self) -> str:
        where = (
            f"{self.nodes} nodes x {self.procs_per_node} processes, node links"
            if self.nodes > 1
            else f"1 node x {self.procs_per_node} processes, the node's loopback"
        )
        return f"emulated cluster: {where} shaped to {self.link_rate} (tbf, both directions)"

    # ---- set-up and teardown ---------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        check_cluster_support()
        self._catch_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, namespace: str, device: str) -> None:
        cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf"]
        cmd += ["rate", self.link_rate, "burst", self.burst, "latency", self.latency]
        proc = _run(cmd, check=False)
        if proc.returncode != 0:
            why = " ".join((proc.stderr or proc.stdout).split())[:200]
            if "unknown" in why.lower() or "no such file" in why.lower():
                raise ClusterUnavailable(
                    f"the emulated cluster needs the tbf qdisc (kernel module sch_tbf), which tc refuses "
                    f"here ({why}); load it with `modprobe sch_tbf` or drop --link-rate"
                )
            raise ClusterUnavailable(f"emulated cluster: shaping {device} in {namespace} failed: {why}")

    def _build(self) -> None:
        if self.nodes == 1:
            ns = self.node_namespace(0)
            self._add_namespace(ns)
            self._shape(ns, "lo")
            return
        bridge = self.bridge_namespace
        self._add_namespace(bridge)
        _run(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", bridge, "link", "set", "br0", "up"])
        for r in range(self.nodes):
            ns = self.node_namespace(r)
            self._add_namespace(ns)
            # created inside the node's namespace, its peer moved straight into the bridge's: no device
            # ever appears in the caller's namespace
            _run(
                [
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{r}",
                    "netns",
                    bridge,
                ]
            )
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_address(r)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", bridge, "link", "set", f"p{r}", "master", "br0"])
            _run(["ip", "-n", bridge, "link", "set", f"p{r}", "up"])
            self._shape(ns, "eth0")
            self._shape(bridge, f"p{r}")

    def close(self) -> None:
        """Kill the launched processes, delete every namespace (devices and qdiscs with them), restore
        the signal handlers. Safe to call more than once."""
        with self._lock:
            for child in self._children:
                _kill_group(child)
            self._children.clear()
            for ns in reversed(self.namespaces):
                _run(["ip", "netns", "del", ns], check=False)
            self.namespaces.clear()
            self._restore_signals()

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.signal(sig, stop)

    def _restore_signals(self) -> None:
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved_handlers.clear()

    # ---- processes -------------------------------------------------------------------------------
    def popen(self, node: int, cmd: Sequence[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start `cmd` inside node `node`'s namespace in a process group of its own (killed by
        `close`)."""
        if not self.namespaces:
            raise RuntimeError("the emulated cluster is not set up; use it as `with EmulatedCluster(...)`")
        full = ["ip", "netns", "exec", self.node_namespace(node), *cmd]
        proc = subprocess.Popen(full, env=env, start_new_session=True, **kwargs)
        self._children.append(proc)
        return proc

    def torchrun(
        self, module_args: Sequence[str], env: dict, log_dir: str, timeout_s: float
    ) -> tuple[int, str]:
        """Run `python -m torch.distributed.run ... -m MODULE ARGS` with one agent per node; returns
        (the first non-zero exit status or 0, the log of node 0's agent). On timeout every agent is
        killed and `subprocess.TimeoutExpired` raised."""
        self._launches += 1
        port = RDZV_PORT + self._launches % 500  # a fresh port per launch: no TIME_WAIT clash
        master = self.node_address(0)
        env = {**env, "GLOO_SOCKET_IFNAME": self.link_device, "MASTER_ADDR": master}
        env.pop("MASTER_PORT", None)
        procs, logs = [], []
        for r in range(self.nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes)]
            cmd += ["--node_rank", str(r), "--nproc_per_node", str(self.procs_per_node)]
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master}:{port}"]
            cmd += ["--rdzv_id", f"{self.prefix}-{self._launches}", "--local-addr", self.node_address(r)]
            # node 0 hosts the rendezvous store: torch recognises its own host by hostname, which names
            # the machine, not the namespace's address
            cmd += [
                "--rdzv_conf",
                f"is_host={'true' if r == 0 else 'false'}",
                "--max_restarts",
                "0",
                *module_args,
            ]
            log = os.path.join(log_dir, f"node{r}.log")
            logs.append(log)
            with open(log, "w") as f:
                procs.append(self.popen(r, cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        status = 0
        try:
            pending = list(procs)
            while pending:
                for p in list(pending):
                    rc = p.poll()
                    if rc is None:
                        continue
                    pending.remove(p)
                    if rc != 0 and status == 0:
                        status = rc
                        for other in pending:  # one node failed: the others would wait for it forever
                            _kill_group(other)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill_group(p)
                if p in self._children:
                    self._children.remove(p)
        return status, logs[0]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the process group `proc` leads (started with start_new_session)."""
    if proc.poll() is not None:  # reaped: its pid (and group id) may belong to someone else now
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
