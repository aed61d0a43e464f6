"""A gloo job across nodes with a loopback host name and no GLOO_SOCKET_IFNAME is stopped before it can hang."""

import socket

import pytest

from lightning_pdist import BMUFStrategy
from lightning_pdist.core import multinode
from lightning_pdist.core.multinode import check_gloo_interface


@pytest.fixture
def loopback_host(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(multinode, "interfaces", lambda: ["eth0 10.0.0.5/24"])


def test_refused_with_what_to_set(loopback_host):
    """The message names the host, its loopback address, the variable to set and this host's interfaces."""
    with pytest.raises(RuntimeError, match=r"BMUFStrategy: the job spans num_nodes=2 nodes over gloo, "
                                           r"GLOO_SOCKET_IFNAME is not set and this host's name 'node-a' resolves to "
                                           r"the loopback address 127.0.1.1.*\(this host has: eth0 10.0.0.5/24\)"):
        check_gloo_interface("BMUFStrategy", 2, "gloo")


@pytest.mark.parametrize(("nodes", "backend", "env"), [(1, "gloo", None), (2, "nccl", None), (2, "gloo", "eth0")])
def test_not_refused_when_it_cannot_hang(loopback_host, monkeypatch, nodes, backend, env):
    """One node, NCCL, or GLOO_SOCKET_IFNAME set: nothing to refuse."""
    if env:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", env)
    check_gloo_interface("BMUFStrategy", nodes, backend)


def test_a_routable_host_name_is_fine(monkeypatch):
    """A host name that resolves to a cluster address needs no interface setting."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.5")
    check_gloo_interface("BMUFStrategy", 2, "gloo")


def test_strategy_checks_before_the_process_group(loopback_host):
    """setup_environment refuses before initializing the process group (which would hang)."""
    strategy = BMUFStrategy()
    strategy.num_nodes = 2
    strategy.parallel_devices = [__import__("torch").device("cpu")]
    with pytest.raises(RuntimeError, match=r"GLOO_SOCKET_IFNAME is not set"):
        strategy.setup_environment()
