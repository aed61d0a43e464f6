"""Tier 3 (standalone): 2-node x 1-process jobs through ``torchrun --nnodes=2``, each node its own network namespace.

Two emulated hosts on a bridge (``lightning_pdist.bench.netns``, 1 Gbit/s links): each runs the torchrun command of
docs/multinode.md with its node rank, the master address of host 0 and ``GLOO_SOCKET_IFNAME`` set to its link. The
job must train and agree: both ranks report world size 2, and replicas that the strategy keeps equal are equal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _two_hosts import assert_trained_and_agree, job_args, read_results, run_on_hosts

from lightning_pdist.bench.netns import EmulatedNetwork

AVAILABLE, REASON = EmulatedNetwork.available()
pytestmark = [pytest.mark.standalone, pytest.mark.skipif(not AVAILABLE, reason=f"needs network namespaces: {REASON}")]


def torchrun_command(node_rank: int, master_addr: str, script: list[str]) -> list[str]:
    """The command docs/multinode.md gives for node ``node_rank`` (one process per node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", "--master-port=29500", *script]  # fmt: skip


def run_two_nodes(strategy: str, tmp_path: Path, kwargs: dict | None = None,
                  timeout: float = 180) -> tuple[list[str], list[str]]:
    """Run ``two_node_job.py`` (results in ``tmp_path/result.json[.<strategy>].rank<r>``); the hosts' addresses and
    each node's output."""
    out = tmp_path / "result.json"
    with EmulatedNetwork(num_hosts=2, rate="1gbit") as net:
        ips = [net.host_ip(node) for node in range(2)]
        commands = [torchrun_command(node, ips[0], job_args(strategy, out, kwargs)) for node in range(2)]
        envs = [dict(os.environ, GLOO_SOCKET_IFNAME=net.ifname(node), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
                for node in range(2)]  # fmt: skip
        logs = run_on_hosts(net, commands, envs, tmp_path, timeout)
    return ips, logs


#: trained in turn by one 2-node launch; the parameter server first, so that it meets no process group yet and its
#: workers take torchrun's store (the agent's, on MASTER_PORT) instead of a subgroup of the default group
STRATEGIES = ["parameter_server", "bmuf", "signsgd_mv"]


@pytest.fixture(scope="module")
def several(tmp_path_factory):
    """One torchrun launch on 2 nodes training every strategy of ``STRATEGIES`` in turn (a launch costs ~10 s of
    imports); {strategy: each node's result}."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    run_two_nodes(",".join(STRATEGIES), tmp_path, timeout=300)
    return {name: read_results(tmp_path / f"result.json.{name}") for name in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_node_job_trains_and_agrees(strategy, several):
    """BMUF, signSGD with majority vote and the parameter server on 2 nodes, nothing set but GLOO_SOCKET_IFNAME:
    Lightning takes the ranks from torchrun (TorchElasticEnvironment), world size 2 on both, one node each, finite
    metrics, equal weights at the end (the parameter server derives its address and allowed networks from the job;
    its workers use torchrun's store instead of binding a second one)."""
    results = several[strategy]
    assert [r["cluster_environment"] for r in results] == ["TorchElasticEnvironment"] * 2
    assert_trained_and_agree(results)


@pytest.mark.parametrize(("kwargs", "placement"), [({"num_servers": 2}, [(0, 29600), (1, 29600)]),
                                                  ({"num_servers": 3, "server_host": "0.0.0.0"},
                                                   [(0, 29600), (1, 29600), (0, 29601)])])  # fmt: skip
def test_parameter_servers_spread_over_the_nodes_on_fixed_ports(tmp_path, kwargs, placement):
    """server_port=29600 on 2 nodes: server i runs on node i mod 2, a node's k-th server on port 29600 + k (each node's
    local rank 0 started its own, with the job's secret; with server_host='0.0.0.0' too, published at each node's
    address); both workers hold these addresses, the job logs them, and training agrees."""
    ips, logs = run_two_nodes("parameter_server", tmp_path, {**kwargs, "server_port": 29600})
    results = read_results(tmp_path / "result.json")
    expected = [f"{ips[node]}:{port}" for node, port in placement]
    assert [r["server_addresses"] for r in results] == [expected, expected]
    listed = ", ".join(f"{i} at {a} (node {node})" for i, (a, (node, _)) in enumerate(zip(expected, placement)))
    assert f"{len(expected)} parameter servers: {listed}" in logs[0], logs[0][-4000:]
    assert_trained_and_agree(results)
