"""Tests for the emulated-cluster network harness (namespaces + bridge + tbf links)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_pdist.bench.netns import (
    EmulatedNetwork,
    LaunchError,
    default_burst_bytes,
    launch_ranks,
    measure_link_rate,
    parse_burst,
    parse_rate,
)
from lightning_pdist.core.accounting import all_reduce_bytes

_OK, _REASON = EmulatedNetwork.available()
needs_netns = pytest.mark.skipif(not _OK, reason=_REASON)

REPO = Path(__file__).resolve().parents[2]

ALL_REDUCE_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist

numel = int(sys.argv[1])
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
t = torch.full((numel,), float(rank + 1))
dist.all_reduce(t)
print(json.dumps({"rank": rank, "ok": bool(torch.all(t == world_size * (world_size + 1) / 2))}))
dist.destroy_process_group()
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ours(prefix: str) -> set[str]:
    return {name for name in _namespaces() if name.startswith(f"{prefix}-")}


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for its reaper counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _tbf_rate(ns: str, dev: str) -> int:
    argv = ["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    (qdisc,) = [q for q in json.loads(out.stdout) if q.get("root")]
    assert qdisc["kind"] == "tbf"
    return qdisc["options"]["rate"]  # bytes per second


@pytest.fixture
def unique_prefix():
    return f"pdt{os.getpid()}x{os.urandom(2).hex()}"


# -- values, no namespaces needed -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"), [("100mbit", 100_000_000), ("1gbit", 10**9), ("1.5Gbit", 1_500_000_000), ("64kbit", 64_000)]
)
def test_parse_rate_uses_tc_si_units(text, bits):
    """Rates parse to bits per second with tc's SI multipliers, case-insensitively."""
    assert parse_rate(text) == bits


def test_default_burst_reproduces_verified_values():
    """The default burst rule gives the values verified on veth: 64 KiB at 100mbit, 256 KiB at 1gbit."""
    assert default_burst_bytes(parse_rate("100mbit")) == 64 * 1024
    assert default_burst_bytes(parse_rate("1gbit")) == 256 * 1024
    assert default_burst_bytes(parse_rate("1kbit")) == 64 * 1024
    assert default_burst_bytes(parse_rate("10gbit")) == 4 * 1024 * 1024


def test_parse_burst_uses_tc_binary_units():
    """Burst sizes parse with tc's 1024-based suffixes; a bare number is bytes."""
    assert parse_burst("64kb") == parse_burst("64k") == parse_burst("65536") == 65536
    assert parse_burst("1mb") == 1 << 20


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_hosts": 0}, ValueError, r"num_hosts=0\): num_hosts must be >= 1"),
        ({"num_hosts": 2.0}, TypeError, r"num_hosts=2.0\): num_hosts must be an int"),
        ({"num_hosts": True}, TypeError, r"num_hosts=True\): num_hosts must be an int"),
        ({"num_hosts": 2, "rate": "fast"}, ValueError, r"rate='fast'\): rate must look like '100mbit' or '1gbit'"),
        ({"num_hosts": 2, "rate": "100mbps"}, ValueError, r"rate='100mbps'\): rate must look like"),
        ({"num_hosts": 2, "rate": "0mbit"}, ValueError, r"rate='0mbit'\): rate must look like"),
        ({"num_hosts": 2, "rate": 100}, TypeError, r"rate=100\): rate must be a str"),
        ({"num_hosts": 2, "burst": "1kb"}, ValueError, r"burst='1kb'\): burst must be at least 2048 bytes"),
        ({"num_hosts": 2, "burst": "lots"}, ValueError, r"burst='lots'\): burst must look like '64kb'"),
        ({"num_hosts": 2, "subnet": "10.78.0.1/24"}, ValueError, r"subnet='10.78.0.1/24'\): subnet must be an IPv4"),
        ({"num_hosts": 4, "subnet": "10.78.0.0/30"}, ValueError, r"num_hosts=4\): the subnet must hold num_hosts"),
        ({"num_hosts": 300}, ValueError, r"num_hosts=300\): the subnet must hold num_hosts"),
        ({"num_hosts": 2, "prefix": "bad name!"}, ValueError, r"prefix='bad name!'\): prefix must be 1-40"),
    ],
)
def test_constructor_rejects_bad_input(kwargs, exc, match):
    """Each bad constructor argument raises before anything is built, naming the argument, value and rule."""
    with pytest.raises(exc, match=match):
        EmulatedNetwork(**kwargs)


def test_module_does_not_import_torch():
    """netns.py is stdlib-only: loading the file alone in a fresh interpreter imports neither torch nor lightning."""
    # Loaded by path: the package's own __init__ imports lightning to register strategies.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('netns', {str(REPO / 'lightning_pdist/bench/netns.py')!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'lightning', 'lightning_pdist')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- real namespaces ---------------------------------------------------------------------------


@needs_netns
def test_topology_shapes_both_directions_of_every_link(unique_prefix):
    """Every host gets its own namespace, address and veth, with a tbf at the stated rate on both ends of its link."""
    with EmulatedNetwork(3, rate="100mbit", prefix=unique_prefix) as net:
        assert _ours(unique_prefix) == {net.switch_namespace} | {net.namespace(i) for i in range(3)}
        assert net.rate_bits_per_s == 100_000_000
        assert net.describe() == "emulated links: 3 hosts on a bridge, tbf 100mbit each way"
        assert len({net.host_ip(i) for i in range(3)}) == 3
        for i in range(3):
            assert net.exec_prefix(i) == ["ip", "netns", "exec", net.namespace(i)]
            assert _tbf_rate(net.namespace(i), net.ifname(i)) == 12_500_000  # host egress
            assert _tbf_rate(net.switch_namespace, f"vs{i}") == 12_500_000  # host ingress


@needs_netns
def test_measure_link_rate_matches_tbf_rate(unique_prefix):
    """A 4 MB TCP transfer between 2 hosts at 100mbit runs at 70-105% of 12.5 MB/s, and the kernel counts it."""
    nbytes = 4 << 20
    with EmulatedNetwork(2, rate="100mbit", prefix=unique_prefix) as net:
        # fresh namespaces and shapers: nothing retransmitted or dropped yet (the counters are each host's own)
        assert [net.tcp_retransmits(i) for i in range(2)] == [0, 0] and [net.shaper_drops(i) for i in range(2)] == [0, 0]
        tx0, rx1 = net.tx_bytes(0), net.rx_bytes(1)
        rate = measure_link_rate(net, 0, 1, nbytes)
        sent, received = net.tx_bytes(0) - tx0, net.rx_bytes(1) - rx1
        retransmitted, dropped = net.tcp_retransmits(0), net.shaper_drops(0) + net.shaper_drops(1)
        segments_out = int(dict(zip(*[line.split() for line in subprocess.run(
            ["ip", "netns", "exec", net.namespace(0), "cat", "/proc/net/snmp"], capture_output=True, text=True,
            check=True).stdout.splitlines() if line.startswith("Tcp:")]))["OutSegs"])  # fmt: skip
    assert isinstance(retransmitted, int) and isinstance(dropped, int)
    assert 0 <= retransmitted < segments_out and segments_out >= nbytes // 65536  # host 0's own counter, not a total
    assert 0.70 * 12.5e6 <= rate <= 1.05 * 12.5e6
    # Payload plus Ethernet/IP/TCP headers: at most ~5% on 1500-byte frames, less with offloaded segments.
    assert nbytes <= sent <= 1.05 * nbytes
    assert nbytes <= received <= 1.05 * nbytes


@needs_netns
def test_gloo_all_reduce_tx_bytes_match_ring_model(tmp_path, unique_prefix):
    """A 2 MB gloo all-reduce on 2 hosts puts the ring model's 2(N-1)/N*n bytes on each veth, plus only headers."""
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    numel = 512 * 1024  # 2 MB of float32
    world_size = 2
    with EmulatedNetwork(world_size, rate="1gbit", prefix=unique_prefix) as net:
        before = [net.tx_bytes(i) for i in range(world_size)]
        argv = [sys.executable, str(script), str(numel)]
        results = launch_ranks(net, argv, world_size, master_port=29500, timeout=120)
        sent = [net.tx_bytes(i) - before[i] for i in range(world_size)]
    assert [json.loads(r.stdout.strip().splitlines()[-1]) for r in results] == [
        {"rank": r, "ok": True} for r in range(world_size)
    ]
    model = all_reduce_bytes(numel * 4, world_size)
    for rank in range(world_size):
        # Measured: +0.4% (8 KB of store/handshake traffic and GSO-segment headers). The bound allows
        # per-frame headers without segmentation offload (66 B per 1448 B of payload, 4.6%).
        assert model <= sent[rank] <= 1.06 * model, (rank, sent[rank], model)


@needs_netns
def test_launch_ranks_sets_rank_environment_and_namespace(unique_prefix):
    """Rank i runs inside host i and sees RANK, WORLD_SIZE, MASTER_ADDR/PORT and the interface names of its own link."""
    code = textwrap.dedent(
        """
        import json, os
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "OMP_NUM_THREADS", "EXTRA"]
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "ifaces": sorted(os.listdir("/sys/class/net"))}))
        """
    )
    with EmulatedNetwork(3, prefix=unique_prefix) as net:
        results = launch_ranks(net, [sys.executable, "-c", code], 2, master_port=29511, env={"EXTRA": "x"})
        for rank, res in enumerate(results):
            assert res.returncode == 0
            seen = json.loads(res.stdout)
            assert seen["ifaces"] == ["lo", net.ifname(rank)]
            assert seen["env"] == {
                "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "NODE_RANK": str(rank),
                "MASTER_ADDR": net.host_ip(0), "MASTER_PORT": "29511",
                "GLOO_SOCKET_IFNAME": net.ifname(rank), "TP_SOCKET_IFNAME": net.ifname(rank),
                "OMP_NUM_THREADS": "1", "EXTRA": "x",
            }  # fmt: skip


@needs_netns
def test_launch_ranks_failure_names_rank_and_stops_the_others(tmp_path, unique_prefix):
    """When a rank exits non-zero, the others and their children are killed; the error names the rank and its stderr."""
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        if os.environ["RANK"] == "1":
            while not os.path.exists(r"{tmp_path}/pids"):  # fail only once rank 0 has a child to orphan
                time.sleep(0.01)
            sys.exit("rank one broke: boom")
        child = subprocess.Popen(["sleep", "60"])
        with open(r"{tmp_path}/pids.tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.rename(r"{tmp_path}/pids.tmp", r"{tmp_path}/pids")
        time.sleep(60)
        """
    )
    with EmulatedNetwork(2, prefix=unique_prefix) as net:
        match = r"(?s)rank 1 \(on .*-h1\) exited with code 1.*rank one broke: boom"
        with pytest.raises(LaunchError, match=match) as info:
            launch_ranks(net, [sys.executable, "-c", code], 2, 29512, timeout=60)
    assert isinstance(info.value, RuntimeError) and info.value.rank == 1
    assert info.value.results[0].returncode < 0  # killed by a signal, not left running
    # rank 0's child was SIGKILLed with its group; a signal is delivered asynchronously (on a loaded machine the
    # orphan can take a moment to exit), so "gone" is awaited, never assumed: 10 s, against its 60 s sleep
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), [pid for pid in pids if _alive(pid)]


@needs_netns
def test_launch_ranks_timeout_kills_every_rank(tmp_path, unique_prefix):
    """Past the timeout every rank and its children are killed and LaunchError says which ranks were still running."""
    code = textwrap.dedent(
        f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        open(r"{tmp_path}/pids" + os.environ["RANK"], "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
        """
    )
    with EmulatedNetwork(2, prefix=unique_prefix) as net:
        with pytest.raises(LaunchError, match=r"timeout=1.5\): ranks \[0, 1\] were still running"):
            launch_ranks(net, [sys.executable, "-c", code], 2, 29513, timeout=1.5)
    pids = [int(p) for rank in range(2) for p in (tmp_path / f"pids{rank}").read_text().split()]
    assert len(pids) == 4 and not any(_alive(pid) for pid in pids)


@needs_netns
@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda net: net.host_ip(2), ValueError, r"host_ip\(i=2\): i must be in \[0, 2\)"),
        (lambda net: net.tx_bytes(-1), ValueError, r"tx_bytes\(i=-1\): i must be in \[0, 2\)"),
        (lambda net: net.tcp_retransmits(2), ValueError, r"tcp_retransmits\(i=2\): i must be in \[0, 2\)"),
        (lambda net: net.shaper_drops(-1), ValueError, r"shaper_drops\(i=-1\): i must be in \[0, 2\)"),
        (lambda net: launch_ranks(net, ["true"], 3, 29500), ValueError, r"world_size=3\): world_size must be in \[1, 2"),
        (lambda net: launch_ranks(net, "true", 2, 29500), TypeError, r"argv='true'\): argv must be a non-empty list"),
        (lambda net: launch_ranks(net, ["true"], 2, 0), ValueError, r"master_port=0\): master_port must be in"),
        (lambda net: launch_ranks(net, ["true"], 2, 29500, env={"RANK": "3"}), ValueError, r"env may not set RANK"),
        (lambda net: launch_ranks(net, ["true"], 2, 29500, timeout=0), ValueError, r"timeout=0\): timeout must be > 0"),
        (lambda net: measure_link_rate(net, 1, 1, 1 << 20), ValueError, r"i=1, j=1\): i and j must be different"),
        (lambda net: measure_link_rate(net, 0, 1, 100), ValueError, r"nbytes=100\): nbytes must be an int >= 65536"),
    ],
)
def test_calls_on_a_network_reject_bad_input(call, exc, match, unique_prefix):
    """Host indices, launch arguments and probe arguments are checked, naming the argument, value and rule."""
    with EmulatedNetwork(2, prefix=unique_prefix) as net:
        with pytest.raises(exc, match=match):
            call(net)


@needs_netns
def test_close_is_idempotent_and_blocks_further_use(unique_prefix):
    """close() deletes every namespace, can run twice, and later use of the network raises RuntimeError."""
    net = EmulatedNetwork(2, prefix=unique_prefix)
    assert len(_ours(unique_prefix)) == 3
    net.close()
    net.close()
    assert _ours(unique_prefix) == set()
    with pytest.raises(RuntimeError, match=r"tx_bytes\(0\): the network is closed"):
        net.tx_bytes(0)
    with pytest.raises(RuntimeError, match="the network is closed"):
        launch_ranks(net, ["true"], 1, 29500)


@needs_netns
def test_namespaces_are_deleted_when_the_body_raises(unique_prefix):
    """Leaving the with-block through an exception still deletes every namespace and re-raises."""
    with pytest.raises(KeyError, match="body failed"):
        with EmulatedNetwork(2, prefix=unique_prefix):
            assert len(_ours(unique_prefix)) == 3
            raise KeyError("body failed")
    assert _ours(unique_prefix) == set()


@needs_netns
def test_existing_prefix_is_refused(unique_prefix):
    """A second network with a prefix in use raises RuntimeError instead of sharing the first one's namespaces."""
    with EmulatedNetwork(1, prefix=unique_prefix):
        match = rf"prefix='{unique_prefix}'\): namespaces with this prefix already exist"
        with pytest.raises(RuntimeError, match=match):
            EmulatedNetwork(1, prefix=unique_prefix)
        assert len(_ours(unique_prefix)) == 2


@needs_netns
def test_unclosed_network_is_deleted_at_exit_but_not_by_forked_children(unique_prefix):
    """A process that never calls close() still deletes its namespaces at exit; a forked child exiting does not."""
    code = textwrap.dedent(
        f"""
        import importlib.util, os, subprocess, sys
        spec = importlib.util.spec_from_file_location("netns", r"{REPO / 'lightning_pdist/bench/netns.py'}")
        netns = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(netns)  # by path: skips the package __init__ and its lightning import
        net = netns.EmulatedNetwork(1, prefix="{unique_prefix}")
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs atexit handlers in the child
        os.waitpid(pid, 0)
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        print(listing.count("{unique_prefix}-"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"  # both namespaces survived the child's exit
    assert _ours(unique_prefix) == set()
