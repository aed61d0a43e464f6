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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"server_host": "127.0.0.1"}, r"ParameterServerStrategy\(server_host='127.0.0.1'\): the job spans num_nodes=2 "
                                    r"nodes and the workers on the other nodes cannot reach a loopback address"),
     ({"server_host": "localhost"}, r"server_host='localhost'\): the job spans num_nodes=2"),
     ({"server_addresses": ["10.0.0.5:7000", "127.0.0.1:7001"]},
      r"server_addresses=.*'127.0.0.1:7001' is a loopback address that the other nodes cannot reach")],
)
def test_parameter_server_refuses_loopback_across_nodes_when_the_trainer_is_built(kwargs, message):
    """A loopback server address in a job that spans nodes is refused before any process or server starts."""
    from lightning.pytorch import Trainer

    from lightning_pdist import ParameterServerStrategy

    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=ParameterServerStrategy(**kwargs), logger=False)
    Trainer(accelerator="cpu", devices=1, num_nodes=1, strategy=ParameterServerStrategy(**kwargs), logger=False)


def test_server_network_is_derived_from_the_route_to_the_main_address(monkeypatch):
    """Across nodes the servers bind to this node's address towards MASTER_ADDR and admit that interface's network."""
    monkeypatch.setattr(multinode, "local_address_towards", lambda address: "10.0.3.7")
    monkeypatch.setattr(multinode, "interfaces", lambda: ["eth1 192.168.1.2/24", "eth0 10.0.3.7/16"])
    assert multinode.server_network(2, "10.0.0.1") == ("10.0.3.7", "127.0.0.0/8,10.0.0.0/16")
    assert multinode.server_network(1, "10.0.0.1") == ("127.0.0.1", "127.0.0.0/8")
    monkeypatch.setattr(multinode, "interfaces", lambda: [])
    assert multinode.server_network(2, "10.0.0.1") == ("10.0.3.7", "127.0.0.0/8,10.0.3.7/32")


def test_servers_are_dealt_round_robin_over_the_nodes():
    """Server i runs on node i mod num_nodes; one node holds them all."""
    assert multinode.server_nodes(5, 2) == [0, 1, 0, 1, 0]
    assert multinode.server_nodes(2, 3) == [0, 1]
    assert multinode.server_nodes(3, 1) == [0, 0, 0]


def test_the_nodes_networks_are_joined_once_each():
    """allowed_networks of several starting nodes: every range once, in first-seen order."""
    assert multinode.join_networks("127.0.0.0/8,10.0.0.0/24", "127.0.0.0/8,10.0.1.0/24", "127.0.0.0/8,10.0.0.0/24") \
        == "127.0.0.0/8,10.0.0.0/24,10.0.1.0/24"


def test_parameter_servers_spread_over_the_nodes_unless_server_host_names_one_node():
    """Unset or wildcard server_host: server i on node i mod 2; an address of one node puts every server on node 0
    and warns that its link carries all their traffic."""
    from lightning.pytorch import Trainer

    from lightning_pdist import ParameterServerStrategy

    for host in (None, "0.0.0.0"):
        trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False,
                          strategy=ParameterServerStrategy(num_servers=3, server_host=host))  # fmt: skip
        assert trainer.strategy._server_nodes(3) == [0, 1, 0]
    with pytest.warns(UserWarning, match=r"ParameterServerStrategy\(server_host='10.0.0.5'\): an address of one node, "
                                         r"so all 3 servers run on global rank 0's node"):  # fmt: skip
        trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False,
                          strategy=ParameterServerStrategy(num_servers=3, server_host="10.0.0.5"))  # fmt: skip
    assert trainer.strategy._server_nodes(3) == [0, 0, 0]
