"""The emulated cluster (`occult_ft.bench.cluster`): rates, one-line refusals, what it builds, and that
nothing is left behind on success, on an exception, on a failed set-up, on Ctrl-C and on SIGTERM.

Building needs root with `ip` and `tc` (iproute2); those tests skip elsewhere. The refusals are
simulated (a PATH without `tc`, a `tc` that does not know tbf, a non-root uid).
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap

import pytest
from helpers import safety_timeout

from occult_ft.bench.cluster import (
    ClusterUnavailable,
    EmulatedCluster,
    check_cluster_support,
    cluster_namespaces,
    parse_rate,
    rate_bits,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _can_build() -> str | None:
    try:
        check_cluster_support()
    except ClusterUnavailable as exc:
        return str(exc)
    return None


needs_cluster = pytest.mark.skipif(_can_build() is not None, reason=str(_can_build()))


def _links() -> list[str]:
    """Device names of the caller's network namespace."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


@pytest.mark.parametrize(
    "text, tc, bits",
    [
        ("1gbit", "1gbit", 1e9),
        ("2.5gbit", "2500mbit", 2.5e9),
        ("300Mbit", "300mbit", 3e8),
        ("500kbit", "500kbit", 5e5),
        ("1500000", "1500kbit", 1.5e6),
    ],
)
def test_rates_read_as_tc_writes_them(text, tc, bits):
    assert parse_rate(text) == tc and rate_bits(text) == bits


@pytest.mark.parametrize(
    "text, message",
    [
        ("fast", "link rate 'fast' is not a rate; write e.g. 1gbit"),
        ("0gbit", "link rate '0gbit' is not a rate"),
        ("100mbps", "give bits per second"),
        ("10kbit", "below 100kbit"),
    ],
)
def test_bad_rates_are_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rate(text)


def test_refused_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="needs root") as info:
        EmulatedCluster(2, 1, "1gbit").__enter__()
    assert "\n" not in str(info.value)


def test_refused_without_tc_naming_it(monkeypatch, tmp_path):
    if shutil.which("ip") is None:
        pytest.skip("no `ip` here")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    (tmp_path / "ip").symlink_to(shutil.which("ip"))
    monkeypatch.setenv("PATH", str(tmp_path))  # `ip` only
    with pytest.raises(ClusterUnavailable, match=r"needs `tc` on PATH; install iproute2") as info:
        check_cluster_support()
    assert "`ip`" not in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ClusterUnavailable, match=r"needs `ip` and `tc` on PATH"):
        check_cluster_support()


@needs_cluster
def test_refused_without_tbf_and_nothing_left(monkeypatch, tmp_path):
    fake = tmp_path / "tc"  # a tc whose kernel has no tbf: what tc prints then
    fake.write_text("#!/bin/sh\necho 'Error: Specified qdisc kind is unknown.' >&2\nexit 2\n")
    fake.chmod(0o755)
    (tmp_path / "ip").symlink_to(shutil.which("ip"))
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cluster = EmulatedCluster(2, 1, "1gbit")
    with pytest.raises(ClusterUnavailable, match=r"needs the tbf qdisc \(kernel module sch_tbf\)") as info:
        with cluster:
            pass
    assert "\n" not in str(info.value)
    assert cluster_namespaces(cluster.prefix) == []


@needs_cluster
def test_two_nodes_are_namespaces_with_shaped_veths_and_go_away():
    before = _links()
    cluster = EmulatedCluster(2, 2, "300mbit")
    with cluster:
        names = cluster_namespaces(cluster.prefix)
        assert sorted(names) == sorted(
            [cluster.bridge_namespace, cluster.node_namespace(0), cluster.node_namespace(1)]
        )
        for r in range(2):  # shaped both ways: the node's veth and its port on the bridge
            node = subprocess.run(
                ["ip", "netns", "exec", cluster.node_namespace(r), "tc", "qdisc", "show", "dev", "eth0"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            port = subprocess.run(
                ["ip", "netns", "exec", cluster.bridge_namespace, "tc", "qdisc", "show", "dev", f"p{r}"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert "tbf" in node and "rate 300Mbit" in node and "tbf" in port and "rate 300Mbit" in port
            addr = subprocess.run(
                ["ip", "-n", cluster.node_namespace(r), "-o", "addr", "show", "dev", "eth0"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert f"10.213.0.{r + 1}/24" in addr
        # the nodes reach each other, and nothing else: no route leaves 10.213.0.0/24
        routes = subprocess.run(
            ["ip", "-n", cluster.node_namespace(0), "route"], capture_output=True, text=True, check=True
        ).stdout
        assert "default" not in routes and routes.split()[0] == "10.213.0.0/24"
        ping = subprocess.run(
            ["ip", "netns", "exec", cluster.node_namespace(0), sys.executable, "-c",
             "import socket; s = socket.socket(); s.settimeout(5); "
             "print(s.connect_ex(('10.213.0.2', 9)))"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert ping.stdout.strip() == "111"  # ECONNREFUSED: node 1 answered (nobody listens on port 9)
        assert _links() == before  # nothing in the caller's namespace
    assert cluster_namespaces(cluster.prefix) == [] and cluster.namespaces == []
    assert _links() == before


@needs_cluster
def test_one_node_shapes_its_loopback():
    cluster = EmulatedCluster(1, 4, "1gbit")
    with cluster:
        assert cluster_namespaces(cluster.prefix) == [cluster.node_namespace(0)]
        shown = subprocess.run(
            ["ip", "netns", "exec", cluster.node_namespace(0), "tc", "qdisc", "show", "dev", "lo"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in shown and "rate 1Gbit" in shown
        assert (cluster.link_device, cluster.node_address(0), cluster.world_size) == ("lo", "127.0.0.1", 4)
    assert cluster_namespaces(cluster.prefix) == []


@needs_cluster
def test_an_exception_inside_tears_down_and_kills_its_processes():
    cluster = EmulatedCluster(2, 1, "1gbit")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            child = cluster.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("boom")
    assert child.poll() is not None  # killed, not orphaned in a deleted namespace
    assert cluster_namespaces(cluster.prefix) == []


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from occult_ft.bench.cluster import EmulatedCluster
    with EmulatedCluster(2, 1, "1gbit") as cluster:
        child = cluster.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
        print(cluster.prefix, child.pid, flush=True)
        time.sleep(600)
    """
)


@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_tears_down(sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert len(line) == 2, proc.stderr.read() if proc.stderr else ""
        prefix, child = line[0], int(line[1])
        assert len(cluster_namespaces(prefix)) == 3
        proc.send_signal(sig)
        proc.wait(timeout=safety_timeout(10))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert cluster_namespaces(prefix) == []
    assert not os.path.exists(f"/proc/{child}") or "zombie" in open(f"/proc/{child}/status").read().lower()


def test_bench_train_refuses_in_one_line_without_tc(monkeypatch, tmp_path, capsys):
    from occult_ft.cli import main

    if shutil.which("ip") is None:
        pytest.skip("no `ip` here")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    (tmp_path / "ip").symlink_to(shutil.which("ip"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["bench", "--train", "--devices", "2", "--nodes", "2", "--link-rate", "1gbit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("occult-ft bench: error: the emulated cluster (--link-rate) needs `tc` on PATH")
    assert main(["bench", "--train", "--devices", "2", "--link-rate", "fast"]) == 2
    assert "link rate 'fast' is not a rate" in capsys.readouterr().err


@needs_cluster
@pytest.mark.slow
@pytest.mark.extended  # 8 minutes on 2 cores; make test-all runs it
def test_bench_train_runs_in_a_two_node_cluster_and_leaves_nothing(capsys):
    import json

    from occult_ft.cli import main

    before = _links()
    argv = ["bench", "--train", "--devices", "2", "--nodes", "2", "--link-rate", "200mbit", "--cpu"]
    argv += ["--experts", "8", "--top-k", "2", "--hidden", "32", "--num-layers", "2", "--seq-len", "16"]
    argv += ["--tokens", "64", "--grad-accum", "2", "--iters", "2", "--warmup", "1", "--json"]
    argv += ["--backends", "occult_ep,deepspeed_moe", "--cluster", "4x8-ib"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["network"].startswith(
        "emulated cluster: 2 nodes x 1 processes, node links shaped to 200mbit"
    )
    rows = {r["contender"]: r for r in report["contenders"]}
    assert all(r["measured"] for r in rows.values()), rows
    for row in rows.values():
        split = row["split_ms"]
        # the split is the whole step (mean over ranks; the step time is the slowest rank's)
        assert sum(split.values()) == pytest.approx(1000 * statistics.fmean(row["step_s_runs"]), rel=0.5)
        assert split["exposed_exchange"] + split["waiting"] > 0 and split["dense_allreduce"] > 0
    # the same model, data and gate convention over a shaped network: the same losses
    a, b = rows["occult_ep"]["losses"], rows["deepspeed_moe"]["losses"]
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert cluster_namespaces() == [] or all(
        not n.startswith(f"oft{os.getpid()}") for n in cluster_namespaces()
    )
    assert _links() == before
