"""Checks for jobs that span nodes, made before the first collective, where a wrong setting would otherwise hang.

gloo binds each rank to the address its host name resolves to unless ``GLOO_SOCKET_IFNAME`` names an interface.
On most installs the host name resolves to a loopback address (``127.0.1.1`` in ``/etc/hosts``): one node then
tells the others to connect to ``127.0.0.1`` and the job fails on one node ("Gloo connectFullMesh failed ...
remote=[127.0.0.1]") while the rest wait for the collective timeout (30 minutes by default). docs/multinode.md.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

__all__ = ["check_gloo_interface", "interfaces", "is_loopback", "is_wildcard", "join_networks", "local_address_towards",
           "server_network", "server_nodes"]


def interfaces() -> list[str]:
    """``name address/prefix`` of this host's IPv4 interfaces other than loopback (``ip -o -4 addr``), for hints."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] != "lo":
            found.append(f"{parts[1]} {parts[3]}")
    return found


def check_gloo_interface(owner: str, num_nodes: int, backend: str) -> None:
    """``RuntimeError`` when a gloo job spans nodes, ``GLOO_SOCKET_IFNAME`` is unset and the host name is loopback."""
    if num_nodes <= 1 or backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return  # gloo will report its own error; nothing certain to add
    if not ipaddress.ip_address(address).is_loopback:
        return
    found = interfaces()
    hint = f" (this host has: {'; '.join(found)})" if found else " (`ip -brief addr` lists them)"
    raise RuntimeError(
        f"{owner}: the job spans num_nodes={num_nodes} nodes over gloo, GLOO_SOCKET_IFNAME is not set and this host's "
        f"name {host!r} resolves to the loopback address {address}, which the other nodes cannot reach: gloo would fail "
        "to connect on one node and leave the others waiting for the collective timeout. Set GLOO_SOCKET_IFNAME to "
        f"the interface of the network the nodes share on every node{hint}, e.g. GLOO_SOCKET_IFNAME=eth0; see "
        "docs/multinode.md"
    )


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
