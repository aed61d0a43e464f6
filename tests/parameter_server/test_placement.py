"""Where the parameter servers run across nodes: refused loopback addresses, derived networks, round-robin nodes."""

import pytest

from lightning_pdist.parameter_server import placement


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
    monkeypatch.setattr(placement, "local_address_towards", lambda address: "10.0.3.7")
    monkeypatch.setattr(placement, "interfaces", lambda: ["eth1 192.168.1.2/24", "eth0 10.0.3.7/16"])
    assert placement.server_network(2, "10.0.0.1") == ("10.0.3.7", "127.0.0.0/8,10.0.0.0/16")
    assert placement.server_network(1, "10.0.0.1") == ("127.0.0.1", "127.0.0.0/8")
    monkeypatch.setattr(placement, "interfaces", lambda: [])
    assert placement.server_network(2, "10.0.0.1") == ("10.0.3.7", "127.0.0.0/8,10.0.3.7/32")


def test_servers_are_dealt_round_robin_over_the_nodes():
    """Server i runs on node i mod num_nodes; one node holds them all."""
    assert placement.server_nodes(5, 2) == [0, 1, 0, 1, 0]
    assert placement.server_nodes(2, 3) == [0, 1]
    assert placement.server_nodes(3, 1) == [0, 0, 0]


def test_the_nodes_networks_are_joined_once_each():
    """allowed_networks of several starting nodes: every range once, in first-seen order."""
    assert placement.join_networks("127.0.0.0/8,10.0.0.0/24", "127.0.0.0/8,10.0.1.0/24", "127.0.0.0/8,10.0.0.0/24") \
        == "127.0.0.0/8,10.0.0.0/24,10.0.1.0/24"


def test_parameter_servers_spread_over_the_nodes_unless_server_host_names_one_node():
    """Unset or wildcard server_host: server i on node i mod 2; an address of one node puts every server on node 0
    and warns that its link carries all their traffic."""
    from lightning.pytorch import Trainer

    from lightning_pdist import ParameterServerStrategy

    for host in (None, "0.0.0.0"):
        trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False,
                          strategy=ParameterServerStrategy(num_servers=3, server_host=host))  # fmt: skip
        assert placement.placed_nodes(trainer.strategy.config, 3, trainer.strategy.num_nodes) == [0, 1, 0]
    with pytest.warns(UserWarning, match=r"ParameterServerStrategy\(server_host='10.0.0.5'\): an address of one node, "
                                         r"so all 3 servers run on global rank 0's node"):  # fmt: skip
        trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False,
                          strategy=ParameterServerStrategy(num_servers=3, server_host="10.0.0.5"))  # fmt: skip
    assert placement.placed_nodes(trainer.strategy.config, 3, trainer.strategy.num_nodes) == [0, 0, 0]
