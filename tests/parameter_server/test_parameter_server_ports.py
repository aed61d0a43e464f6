"""server_port: the servers the strategy starts bind a fixed port range (what a firewall opens), checked and refused."""

import json
import socket

import pytest
from _helpers import TinyRegression, fit
from _ranks import held_port
from lightning.pytorch import Callback, Trainer

from lightning_pdist import ParameterServerStrategy


class ReportServers(Callback):
    """Rank 0 writes the servers' addresses and whether each accepts a connection, during training."""

    def __init__(self, path):
        self.path = str(path)

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        addresses = list(trainer.strategy.server_addresses)
        listening = []
        for address in addresses:
            host, _, port = address.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=5):
                listening.append(address)
        with open(self.path, "w") as f:
            json.dump({"addresses": addresses, "listening": listening, "pids": trainer.strategy.server_pids}, f)


def test_servers_listen_on_the_port_range(tmp_path):
    """server_port=p with 2 servers on one node: server 0 listens on p, server 1 on p + 1, and training runs."""
    report = tmp_path / "servers.json"
    with held_port(2) as first:  # no other process can bind the two ports meanwhile; the servers can (SO_REUSEADDR)
        fit(ParameterServerStrategy(start_method="fork", num_servers=2, server_port=first), TinyRegression(),
            max_steps=3, callbacks=[ReportServers(report)])  # fmt: skip
    seen = json.loads(report.read_text())
    expected = [f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]
    assert seen["addresses"] == expected and seen["listening"] == expected and len(seen["pids"]) == 2


def test_a_taken_port_stops_every_worker_naming_it():
    """A port of the range already in use: the run fails on every worker naming the node, server, port and setting."""
    with held_port(2) as first, socket.create_server(("127.0.0.1", first + 1)):
        with pytest.raises(Exception, match=rf"ParameterServerStrategy\(server_port={first}\): node 0 cannot start "
                                            rf"parameter server 1 on 127.0.0.1:{first + 1} \(OSError: .*in use.*\); "
                                            r"a node's k-th server binds server_port \+ k: choose free ports"):  # fmt: skip
            fit(ParameterServerStrategy(start_method="fork", num_servers=2, server_port=first), TinyRegression(),
                max_steps=2)  # fmt: skip


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [(0, ValueError, r"server_port=0\): server_port must be in 1..65535"),
     (65536, ValueError, r"server_port=65536\): server_port must be in 1..65535"),
     ("29600", TypeError, r"server_port='29600'\): server_port must be an int"),
     (True, TypeError, r"server_port=True\): server_port must be an int"),
     (29600.0, TypeError, r"server_port=29600.0\): server_port must be an int")],
)
def test_bad_server_port_is_refused_at_construction(value, error, message):
    """server_port must be an int in 1..65535: refused when the strategy is built, naming the argument."""
    with pytest.raises(error, match=rf"^ParameterServerStrategy\({message}"):
        ParameterServerStrategy(server_port=value)


def test_server_port_is_refused_with_hand_started_servers():
    """Servers started elsewhere have their ports in server_addresses: server_port with them is refused."""
    with pytest.raises(ValueError, match=r"server_port=29600\): server_port sets the ports of the servers the strategy "
                                         r"starts; servers started elsewhere \(server_addresses\)"):  # fmt: skip
        ParameterServerStrategy(server_port=29600, server_addresses=["10.0.0.5:7000"])


def test_a_range_past_the_last_port_is_refused_when_the_trainer_is_built():
    """server_port=65535 with 2 servers on one node would need port 65536; two nodes need one port each."""
    with pytest.raises(ValueError, match=r"server_port=65535\): 2 servers on a node bind ports 65535..65536; the last "
                                         r"must be <= 65535"):  # fmt: skip
        Trainer(accelerator="cpu", devices=1, strategy=ParameterServerStrategy(num_servers=2, server_port=65535),
                logger=False)  # fmt: skip
    Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=ParameterServerStrategy(num_servers=2, server_port=65535),
            logger=False)  # fmt: skip
