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

__all__ = ["check_gloo_interface", "interfaces"]


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
