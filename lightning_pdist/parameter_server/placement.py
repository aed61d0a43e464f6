"""Where the parameter servers run, and how each node's starter brings its own up (``docs/multinode.md``).

Server ``i`` runs on node ``i mod num_nodes`` unless ``server_host`` is an address of one node (then all on node 0).
Left unset, ``server_host`` becomes each node's address on the route to ``MASTER_ADDR`` and ``allowed_networks``
the networks of those interfaces plus loopback. A loopback server address in a job that spans nodes is refused
when the Trainer is built (:func:`check_placement`), before any process or server starts.
"""

from __future__ import annotations

import ipaddress
import socket

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_pdist.core.multinode import interfaces
from lightning_pdist.core.ps_auth import new_secret
from lightning_pdist.parameter_server.config import ParameterServerConfig
from lightning_pdist.parameter_server.process import ServerProcess, start_server
from lightning_pdist.core.control_group import ControlGroup

__all__ = [
    "check_placement",
    "is_loopback",
    "is_wildcard",
    "join_networks",
    "local_address_towards",
    "placed_nodes",
    "server_network",
    "server_nodes",
    "start_servers",
    "stop_servers",
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return host in ("localhost",)


def is_wildcard(host: str) -> bool:
    """Whether ``host`` binds every interface (``0.0.0.0``, ``::``): workers connect to the node's own address."""
    return host in ("0.0.0.0", "::", "")


def local_address_towards(address: str) -> str:
    """This host's address on the route to ``address`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(address), 9))
        return sock.getsockname()[0]


def server_network(num_nodes: int, main_address: str) -> tuple[str, str]:
    """``(server_host, allowed_networks)`` for servers started on the main node when the user gave neither.

    One node: ``127.0.0.1`` and ``127.0.0.0/8``. Several nodes: this node's address on the route to
    ``main_address`` (the job's ``MASTER_ADDR``), and the network of that interface plus loopback: the job's
    workers connect from that network; a worker routed in from elsewhere needs ``allowed_networks`` set.
    """
    if num_nodes <= 1:
        return "127.0.0.1", "127.0.0.0/8"
    host = local_address_towards(main_address)
    networks = ["127.0.0.0/8"]
    for entry in interfaces():
        cidr = entry.split()[1]
        if cidr.split("/")[0] == host:
            networks.append(str(ipaddress.ip_interface(cidr).network))
    if len(networks) == 1:
        networks.append(f"{host}/32")
    return host, ",".join(networks)


def server_nodes(num_servers: int, num_nodes: int) -> list[int]:
    """The node of each server the strategy starts: server ``i`` on node ``i mod num_nodes``.

    Round-robin, so that every node's link carries about ``1 / num_nodes`` of the server traffic once
    ``num_servers >= num_nodes`` (each server holds about ``1 / num_servers`` of the parameters).
    """
    return [index % num_nodes for index in range(num_servers)]


def join_networks(*networks: str) -> str:
    """Comma-separated address ranges, each once, in first-seen order (``allowed_networks`` of several nodes)."""
    seen: dict[str, None] = {}
    for entry in networks:
        for item in entry.split(","):
            if item.strip():
                seen.setdefault(item.strip(), None)
    return ",".join(seen)


def placed_nodes(config: ParameterServerConfig, num_servers: int, num_nodes: int) -> list[int]:
    """The node each started server runs on; an address as ``server_host`` is one node's: all on node 0."""
    host = config.server_host
    return server_nodes(num_servers, 1 if host is not None and not is_wildcard(host) else num_nodes)


def check_placement(owner: str, config: ParameterServerConfig, num_nodes: int, num_servers: int) -> None:
    """Across nodes: refuse a loopback server address; warn when ``server_host`` puts every server on one node."""
    if num_nodes <= 1:
        return
    loopback = [a for a in config.server_addresses or () if is_loopback(a.rpartition(":")[0])]
    if loopback:
        raise ValueError(f"{owner}(server_addresses={list(config.server_addresses)!r}): the job spans "
                         f"num_nodes={num_nodes} nodes and {loopback[0]!r} is a loopback address that the "
                         "other nodes cannot reach; give each server's address on the cluster network")  # fmt: skip
    host = config.server_host
    if config.server_addresses is None and host is not None and is_loopback(host):
        raise ValueError(f"{owner}(server_host={host!r}): the job spans num_nodes={num_nodes} nodes and the "
                         "workers on the other nodes cannot reach a loopback address; leave server_host unset "
                         "(rank 0's address on the route to MASTER_ADDR), or set it to that node's cluster address, "
                         "or '0.0.0.0' with allowed_networks covering the nodes (docs/multinode.md)")  # fmt: skip
    if config.server_addresses is None and host is not None and not is_wildcard(host) and num_servers > 1:
        rank_zero_warn(f"{owner}(server_host={host!r}): an address of one node, so all {num_servers} servers run on "
                       "global rank 0's node and its link carries all their traffic; leave server_host unset (or "
                       "'0.0.0.0') to run server i on node i mod num_nodes")  # fmt: skip


def stop_servers(servers: list[ServerProcess]) -> None:
    """Close every lifeline first (they all start exiting), then reap each (SIGKILL after 10 s)."""
    for server in servers:
        server.close_lifeline()
    for server in servers:
        server.stop(timeout=10.0)


def start_servers(
    owner: str,
    config: ParameterServerConfig,
    workers: ControlGroup,
    main_address: str,
    nodes: list[int],
    node_rank: int,
    num_nodes: int,
    local_rank: int,
) -> tuple[list[ServerProcess], list[str], bytes]:
    """Each node's local rank 0 starts the servers placed on its node; every worker gets all their addresses.

    Collective over ``workers`` (every worker calls it); ``nodes`` is :func:`placed_nodes`. Two rounds on the
    workers' group (never the store or a file): rank 0's fresh secret and each starter's derived address and
    network go to every worker; the starters fork their servers (a node's ``k``-th on ``server_port + k``);
    their addresses, or what stopped them, go to every worker in server order. A server that cannot start on any
    node stops every starter's servers and raises on every worker.

    Returns:
        ``(the servers this process started, every server's address in server order, the shared secret)``.
    """
    mine = [i for i, node in enumerate(nodes) if node == node_rank] if local_rank == 0 else []
    derived = server_network(num_nodes, main_address) if mine else None
    offers = workers.all_gather_object((new_secret() if workers.rank == 0 else None, derived))
    secret = offers[0][0]
    # every server admits the networks of all starting nodes: a worker may reach it from any of them
    networks = config.allowed_networks or join_networks(*(d[1] for _, d in offers if d is not None))
    servers: list[ServerProcess] = []
    found: dict[int, str] = {}
    error = None
    port = config.server_port
    try:
        if mine:
            host = config.server_host or derived[0]
            # workers reach a wildcard-bound server at MASTER_ADDR on node 0, elsewhere at the node's own address
            published = (main_address if node_rank == 0 else derived[0]) if is_wildcard(host) else None
        for k, index in enumerate(mine):
            try:
                server = start_server(index, host=host, port=port + k if port is not None else 0,
                                      allowed_networks=networks, io_timeout=config.server_timeout, secret=secret)  # fmt: skip
            except Exception as err:  # noqa: BLE001  (reported to every worker below, then raised on each)
                where = f"{host}:{port + k}" if port is not None else host
                error = f"node {node_rank} cannot start parameter server {index} on {where} ({type(err).__name__}: {err})"
                break
            servers.append(server)
            found[index] = f"{published or server.host}:{server.port}"
        reports = workers.all_gather_object((found, error))
    except BaseException:
        stop_servers(servers)
        raise
    errors = [e for _, e in reports if e is not None]
    if errors:
        stop_servers(servers)
        setting, rule = "", ""
        if port is not None:
            setting, rule = f"(server_port={port})", "; a node's k-th server binds server_port + k: choose free ports"
        raise RuntimeError(f"{owner}{setting}: {'; '.join(errors)}{rule}")
    for addresses, _ in reports:
        found.update(addresses)
    assert sorted(found) == list(range(len(nodes))), (sorted(found), len(nodes))
    addresses = [found[i] for i in range(len(nodes))]
    if num_nodes > 1:
        rank_zero_info(f"{owner}: {len(nodes)} parameter servers: " + ", ".join(
            f"{i} at {a} (node {nodes[i]})" for i, a in enumerate(addresses)))  # fmt: skip
    return servers, addresses, secret
