"""Emulated cluster network: host namespaces on one Linux bridge, every link rate-limited by ``tc tbf``.

The benchmarks use this to run each rank on its own emulated host, so that bandwidth-bound
claims (sign compression, parameter-server sharding) are measured on links of a stated rate
instead of on the unshaped loopback::

                      switch namespace  <prefix>-sw
                 ┌──────────── br0 (Linux bridge) ────────────┐
                vs0                    vs1         ...       vs{N-1}    tbf: host ingress
                 │ veth                 │ veth                 │
                vh0                    vh1         ...       vh{N-1}    tbf: host egress
           <prefix>-h0            <prefix>-h1            <prefix>-h{N-1}
           10.78.k.1              10.78.k.2              10.78.k.N

Each link is shaped in both directions by a ``tbf`` qdisc on each end of its veth pair (the host
side limits what the host sends, the switch side what it receives), as verified in
``machine-and-network.md`` §3. The kernel has no ``netem`` here, so there is no latency, jitter or
loss emulation: only rate.

IPv6 is disabled in every namespace so that the only traffic on a link is what its host sends
(no router solicitations or MLD reports), which keeps the kernel byte counters comparable with the
byte model in :mod:`lightning_pdist.core.accounting`.

Everything needs root (``CAP_NET_ADMIN``) and the ``ip`` and ``tc`` tools of iproute2;
:meth:`EmulatedNetwork.available` says whether this machine can do it. This module uses only the
standard library, so it can be imported without torch.

Example::

    ok, reason = EmulatedNetwork.available()
    if not ok:
        raise SystemExit(f"benchmark needs emulated links: {reason}")
    with EmulatedNetwork(num_hosts=4, rate="100mbit") as net:
        results = launch_ranks(net, [sys.executable, "bench_rank.py"], world_size=4, master_port=29500)
        print(net.describe(), measure_link_rate(net, 0, 1, 4 << 20) / 1e6, "MB/s")
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

__all__ = [
    "EmulatedNetwork",
    "LOOPBACK",
    "LaunchError",
    "Loopback",
    "default_burst_bytes",
    "launch_ranks",
    "measure_link_rate",
    "parse_burst",
    "parse_rate",
]

# tbf queue limit, expressed as the longest time a packet may wait (tc's `latency`); the value
# verified in machine-and-network.md §3.
TBF_LATENCY = "50ms"
# Smallest burst accepted: one 1500-byte frame plus headers, with margin. A tbf bucket smaller than
# a frame can never send that frame, and the link stalls.
MIN_BURST_BYTES = 2048
_BURST_FLOOR = 64 * 1024
_BURST_SECONDS = 0.002

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_BURST_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_BURST_RE = re.compile(r"^(\d+)(b|k|kb|m|mb)?$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")

_SEQ = itertools.count()
_LIVE: dict[str, int] = {}  # namespace name -> pid of the process that created it


def parse_rate(rate: str) -> int:
    """Parse a tc rate such as ``"100mbit"`` or ``"1gbit"`` into bits per second (SI units, as tc).

    Raises:
        TypeError: ``rate`` is not a string.
        ValueError: ``rate`` is not a positive number followed by bit, kbit, mbit, gbit or tbit.
    """
    if not isinstance(rate, str):
        raise TypeError(f"EmulatedNetwork(rate={rate!r}): rate must be a str such as '100mbit'")
    match = _RATE_RE.match(rate.strip().lower())
    bits = int(float(match.group(1)) * _RATE_UNITS[match.group(2)]) if match else 0
    if bits <= 0:
        raise ValueError(
            f"EmulatedNetwork(rate={rate!r}): rate must look like '100mbit' or '1gbit' "
            "(a positive number and one of bit, kbit, mbit, gbit, tbit)"
        )
    return bits


def parse_burst(burst: str) -> int:
    """Parse a tc size such as ``"64kb"`` or ``"262144"`` into bytes (``kb`` = 1024 bytes, as tc).

    Raises:
        TypeError: ``burst`` is not a string.
        ValueError: the format is not a whole number with an optional b, k, kb, m or mb suffix, or
            the size is below :data:`MIN_BURST_BYTES` (one frame), which would stall the link.
    """
    if not isinstance(burst, str):
        raise TypeError(f"EmulatedNetwork(burst={burst!r}): burst must be a str such as '64kb' or None")
    match = _BURST_RE.match(burst.strip().lower())
    if not match:
        raise ValueError(
            f"EmulatedNetwork(burst={burst!r}): burst must look like '64kb', '1mb' or a byte count '65536'"
        )
    nbytes = int(match.group(1)) * _BURST_UNITS[match.group(2) or ""]
    if nbytes < MIN_BURST_BYTES:
        raise ValueError(
            f"EmulatedNetwork(burst={burst!r}): burst must be at least {MIN_BURST_BYTES} bytes "
            "(one full frame), e.g. '64kb'"
        )
    return nbytes


def default_burst_bytes(rate_bits_per_s: int) -> int:
    """The tbf bucket size used when none is given: 2 ms of line rate, rounded up to a power of two, at least 64 KiB.

    The rule reproduces the two values verified on veth links here (64 KiB at 100mbit, 256 KiB at
    1gbit). A bucket much smaller than one timer tick of line rate cannot sustain the rate; one much
    larger lets long bursts through at unlimited speed and blurs short measurements.
    """
    two_ms = -(-rate_bits_per_s * _BURST_SECONDS // 8)
    return max(_BURST_FLOOR, 1 << max(0, int(two_ms) - 1).bit_length())


def _run(argv: list[str]) -> str:
    """Run an iproute2 command; return stdout or raise RuntimeError carrying its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed with exit code {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def _existing_namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"])
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _delete_namespace(name: str) -> str | None:
    """Delete one namespace (its veths, bridge and qdiscs go with it); return an error or None."""
    proc = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    _LIVE.pop(name, None)
    if proc.returncode != 0 and name in _existing_namespaces():
        return f"ip netns del {name}: {proc.stderr.strip()}"
    return None


@atexit.register
def _delete_leftovers() -> None:
    # Only the creating process cleans up: a forked child that exits through atexit must not
    # delete the namespaces its parent is still using.
    for name, pid in list(_LIVE.items()):
        if pid == os.getpid():
            _delete_namespace(name)


class EmulatedNetwork:
    """A star topology of ``num_hosts`` network namespaces on one bridge, each link shaped by tbf both ways.

    The network is built by the constructor and deleted by :meth:`close` (also on leaving a
    ``with`` block, and at interpreter exit as a last resort). Namespaces are named
    ``<prefix>-sw`` (the switch) and ``<prefix>-h<i>`` (the hosts); the host end of host ``i``'s
    link is the interface ``vh<i>`` inside its namespace.

    Args:
        num_hosts: Number of emulated hosts, at least 1.
        rate: Line rate of every link in each direction, in tc syntax: ``"100mbit"``, ``"1gbit"``.
        burst: tbf bucket size in tc syntax (``"64kb"``); ``None`` picks
            :func:`default_burst_bytes` of the rate (64 KiB at 100mbit, 256 KiB at 1gbit).
        subnet: IPv4 network for the hosts; host ``i`` gets the ``i+1``-th address. ``None``
            picks ``10.78.<k>.0/24`` with ``k`` derived from the pid and a counter. Each network
            lives in its own namespaces, so even equal subnets of concurrent networks cannot
            collide; distinct ones only keep logs unambiguous.
        prefix: Prefix of the namespace names; ``None`` picks ``pd<pid>n<counter>``, which is
            unique per process and skips names already taken.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has a bad value (the message names it and states the rule).
        RuntimeError: a namespace with this prefix already exists, or an ``ip``/``tc`` command
            failed (everything created so far is deleted first).
    """

    def __init__(
        self,
        num_hosts: int,
        rate: str = "1gbit",
        burst: str | None = None,
        subnet: str | None = None,
        prefix: str | None = None,
    ) -> None:
        if not isinstance(num_hosts, int) or isinstance(num_hosts, bool):
            raise TypeError(f"EmulatedNetwork(num_hosts={num_hosts!r}): num_hosts must be an int")
        if num_hosts < 1:
            raise ValueError(f"EmulatedNetwork(num_hosts={num_hosts}): num_hosts must be >= 1")
        self.num_hosts = num_hosts
        self.rate = rate
        self.rate_bits_per_s = parse_rate(rate)
        self.burst_bytes = default_burst_bytes(self.rate_bits_per_s) if burst is None else parse_burst(burst)
        seq = next(_SEQ)
        if subnet is None:
            subnet = f"10.78.{(os.getpid() + seq) % 256}.0/24"
        self.subnet = self._check_subnet(subnet, num_hosts)
        if prefix is not None and (not isinstance(prefix, str) or not _PREFIX_RE.match(prefix)):
            raise ValueError(
                f"EmulatedNetwork(prefix={prefix!r}): prefix must be 1-40 characters of letters, digits, "
                "'_', '.' or '-', starting with a letter or digit"
            )
        self._closed = False
        self._namespaces: list[str] = []  # created so far, switch first
        existing = _existing_namespaces()
        if prefix is None:
            while any(name.startswith(f"pd{os.getpid()}n{seq}-") for name in existing):
                seq = next(_SEQ)
            prefix = f"pd{os.getpid()}n{seq}"
        elif any(name.startswith(f"{prefix}-") for name in existing):
            clash = sorted(name for name in existing if name.startswith(f"{prefix}-"))
            raise RuntimeError(
                f"EmulatedNetwork(prefix={prefix!r}): namespaces with this prefix already exist ({', '.join(clash)}); "
                "pick another prefix or delete them with `ip netns del <name>`"
            )
        self.prefix = prefix
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_subnet(subnet: str, num_hosts: int) -> ipaddress.IPv4Network:
        if not isinstance(subnet, str):
            raise TypeError(f"EmulatedNetwork(subnet={subnet!r}): subnet must be a str such as '10.78.0.0/24'")
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as err:
            raise ValueError(
                f"EmulatedNetwork(subnet={subnet!r}): subnet must be an IPv4 network such as '10.78.0.0/24' ({err})"
            ) from None
        if net.num_addresses - 2 < num_hosts:
            raise ValueError(
                f"EmulatedNetwork(subnet={subnet!r}, num_hosts={num_hosts}): the subnet must hold num_hosts "
                f"addresses besides its network and broadcast addresses; it holds {max(0, net.num_addresses - 2)}"
            )
        return net

    # -- building and tearing down -------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _LIVE[name] = os.getpid()
        # `default` first so the veths created afterwards never get an IPv6 link-local address.
        _run(["ip", "netns", "exec", name, "sh", "-c",
              "for f in default all; do p=/proc/sys/net/ipv6/conf/$f/disable_ipv6; "
              "[ -e $p ] && echo 1 > $p; done; true"])  # fmt: skip

    def _shape(self, ns: str, dev: str) -> None:
        rate, burst = f"{self.rate_bits_per_s}bit", str(self.burst_bytes)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
              "tbf", "rate", rate, "burst", burst, "latency", TBF_LATENCY])  # fmt: skip

    def _build(self) -> None:
        switch = self.switch_namespace
        self._add_namespace(switch)
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        plen = self.subnet.prefixlen
        for i in range(self.num_hosts):
            host, hdev, sdev = self.namespace(i), self.ifname(i), f"vs{i}"
            self._add_namespace(host)
            # Both ends are created directly inside their namespaces, so no name ever appears in
            # the root namespace and concurrent networks cannot collide on interface names.
            _run(["ip", "-n", host, "link", "add", hdev, "netns", host,
                  "type", "veth", "peer", "name", sdev, "netns", switch])  # fmt: skip
            _run(["ip", "-n", switch, "link", "set", sdev, "master", "br0", "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.host_ip(i)}/{plen}", "dev", hdev])
            _run(["ip", "-n", host, "link", "set", hdev, "up"])
            _run(["ip", "-n", host, "link", "set", "lo", "up"])
            self._shape(host, hdev)  # host egress
            self._shape(switch, sdev)  # host ingress: what the bridge sends down to the host

    def close(self) -> None:
        """Delete every namespace of this network (with its veths, bridge and qdiscs). Idempotent.

        Processes still running inside a host namespace keep it alive until they exit;
        :func:`launch_ranks` never leaves any behind.

        Raises:
            RuntimeError: a namespace could not be deleted (all others were still deleted).
        """
        errors = [err for name in reversed(self._namespaces) if (err := _delete_namespace(name))]
        self._namespaces.clear()
        self._closed = True
        if errors:
            raise RuntimeError("EmulatedNetwork.close(): " + "; ".join(errors))

    def __enter__(self) -> EmulatedNetwork:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"EmulatedNetwork(num_hosts={self.num_hosts}, rate={self.rate!r}, burst={self.burst_bytes}, "
            f"subnet='{self.subnet}', prefix={self.prefix!r}) [{state}]"
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    # -- where things are ----------------------------------------------------------------------

    def _check_host(self, method: str, i: int) -> int:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"EmulatedNetwork.{method}(i={i!r}): i must be an int")
        if not 0 <= i < self.num_hosts:
            raise ValueError(f"EmulatedNetwork.{method}(i={i}): i must be in [0, {self.num_hosts})")
        return i

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.prefix}-sw"

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        return f"{self.prefix}-h{self._check_host('namespace', i)}"

    def ifname(self, i: int) -> str:
        """Name of host ``i``'s side of its link, inside its namespace (for ``GLOO_SOCKET_IFNAME``)."""
        return f"vh{self._check_host('ifname', i)}"

    def host_ip(self, i: int) -> str:
        """IPv4 address of host ``i``: the ``i+1``-th address of the subnet."""
        return str(self.subnet.network_address + 1 + self._check_host("host_ip", i))

    def exec_prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command inside host ``i``: ``["ip", "netns", "exec", <ns>]``."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def describe(self) -> str:
        """One line naming the network for reports: ``emulated links: 4 hosts on a bridge, tbf 100mbit each way``."""
        hosts = "1 host" if self.num_hosts == 1 else f"{self.num_hosts} hosts"
        return f"emulated links: {hosts} on a bridge, tbf {self.rate} each way"

    # -- kernel counters -----------------------------------------------------------------------

    def _check_open(self, method: str, i: int) -> None:
        self._check_host(method, i)
        if self._closed:
            raise RuntimeError(f"EmulatedNetwork.{method}({i}): the network is closed")

    def _stats(self, method: str, i: int) -> dict:
        self._check_open(method, i)
        out = _run(["ip", "-n", self.namespace(i), "-j", "-s", "link", "show", "dev", self.ifname(i)])
        return json.loads(out)[0]["stats64"]

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has sent on its link, from the kernel's counter of its veth (headers included)."""
        return int(self._stats("tx_bytes", i)["tx"]["bytes"])

    def rx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has received on its link, from the kernel's counter of its veth (headers included)."""
        return int(self._stats("rx_bytes", i)["rx"]["bytes"])

    def tcp_retransmits(self, i: int) -> int:
        """TCP segments host ``i`` has retransmitted (``RetransSegs`` of its namespace's ``/proc/net/snmp``)."""
        self._check_open("tcp_retransmits", i)
        header, values = [line.split()[1:] for line in _run(["ip", "netns", "exec", self.namespace(i), "cat",
                                                               "/proc/net/snmp"]).splitlines() if line.startswith("Tcp:")]  # fmt: skip
        return int(values[header.index("RetransSegs")])

    def shaper_drops(self, i: int, side: str | None = None) -> int:
        """Packets the two shapers of host ``i``'s link dropped (its egress and the bridge's side toward it).

        ``side="egress"``: only the host's own shaper (what it sends); ``"ingress"``: only the bridge's shaper toward
        the host (what several senders converging on it overflowed: incast).
        """
        self._check_open("shaper_drops", i)
        if side not in (None, "egress", "ingress"):
            raise ValueError(f"EmulatedNetwork.shaper_drops(side={side!r}): side must be None, 'egress' or 'ingress'")
        ends = ((self.namespace(i), self.ifname(i)), (self.switch_namespace, f"vs{i}"))
        drops = 0
        for ns, dev in ends if side is None else ends[side == "ingress" :][:1]:
            drops += sum(int(q.get("drops", 0)) for q in json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])))
        return drops

    # -- capability probe ----------------------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether namespaces, veth pairs, a bridge and tbf can be created here.

        Builds and deletes a throwaway namespace. Benchmarks call this first and stop with the
        reason when it fails.

        Returns:
            ``(True, "")``, or ``(False, reason)`` with the step that failed and the tool's error.
        """
        if not sys.platform.startswith("linux"):
            return False, f"network namespaces need Linux (this is {sys.platform})"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` (iproute2) is not on PATH"
        name = f"pd{os.getpid()}probe{next(_SEQ)}"
        steps = [
            ["ip", "netns", "add", name],
            ["ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
            ["ip", "-n", name, "link", "add", "pbr", "type", "bridge"],
            ["ip", "-n", name, "link", "set", "pb", "master", "pbr"],
            ["tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "100mbit", "burst", "64kb",
             "latency", TBF_LATENCY],
        ]  # fmt: skip
        try:
            for argv in steps:
                try:
                    _run(argv)
                except (RuntimeError, OSError) as err:
                    return False, f"cannot build an emulated network here: {err}"
                if argv[:3] == ["ip", "netns", "add"]:
                    _LIVE[name] = os.getpid()
        finally:
            if name in _LIVE:
                _delete_namespace(name)
        return True, ""


# -- running ranks on the hosts ----------------------------------------------------------------

_RESERVED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
)  # fmt: skip
_KILL_GRACE_S = 3.0


class LaunchError(RuntimeError):
    """A rank of :func:`launch_ranks` failed or timed out; ``results`` holds every rank's outcome."""

    def __init__(self, message: str, rank: int, results: list[subprocess.CompletedProcess]):
        super().__init__(message)
        self.rank = rank
        self.results = results


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after a grace period, reap all."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    # Also the groups of ranks that exited: their own children (data loaders, launchers) must not outlive them.
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


class Loopback:
    """The hosts of a run on this machine: every rank a process on 127.0.0.1 (``lo``), unshaped.

    It answers what :func:`launch_ranks` asks of an :class:`EmulatedNetwork` (``host_ip``, ``ifname``,
    ``exec_prefix``, ``namespace``), so one launcher runs the same worker on either.
    """

    num_hosts = 1 << 16
    closed = False

    def host_ip(self, i: int) -> str:
        return "127.0.0.1"

    def ifname(self, i: int) -> str:
        return "lo"

    def exec_prefix(self, i: int) -> list[str]:
        return []

    def namespace(self, i: int) -> str:
        return "loopback"

    def describe(self) -> str:
        return "every rank a process on this machine, 127.0.0.1 (lo), unshaped"


LOOPBACK = Loopback()


def launch_ranks(
    net: EmulatedNetwork | Loopback,
    argv: Sequence[str],
    world_size: int,
    master_port: int,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` as ``world_size`` ranks, rank ``i`` inside host ``i`` of ``net``, and wait for all of them.

    ``net`` is an open :class:`EmulatedNetwork` or :data:`LOOPBACK` (every rank on 127.0.0.1). Each rank
    gets the environment of this process, then ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1`` (``env``
    may override these), then ``env``, then the per-rank variables that ``torch.distributed``'s ``env://``
    rendezvous and Lightning read:

    ``RANK=i``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``, ``NODE_RANK=i``,
    ``MASTER_ADDR`` (host 0's address), ``MASTER_PORT``, and ``GLOO_SOCKET_IFNAME`` /
    ``TP_SOCKET_IFNAME`` (host ``i``'s veth, or ``lo``, so gloo and TensorPipe bind to the shaped link).

    One process per host, each its own "node": a Lightning script runs as
    ``Trainer(num_nodes=world_size, devices=1)``. TensorPipe RPC is only shaped with
    ``_transports=["uv"], _channels=["basic"]``; its default shm/CMA channels bypass the links.
    Every namespace has its own port space, so ``master_port`` only has to differ from other jobs
    on the same network.

    Args:
        net: An open network with at least ``world_size`` hosts, or :data:`LOOPBACK`.
        argv: The command, e.g. ``[sys.executable, "rank.py", "--steps", "10"]``.
        world_size: Number of ranks.
        master_port: Port of the rendezvous store on host 0.
        env: Extra environment variables (``str`` to ``str``); may not set the per-rank ones.
        timeout: Seconds to wait for all ranks.

    Returns:
        One ``CompletedProcess`` per rank, in rank order, with ``stdout`` and ``stderr`` as text.

    Raises:
        LaunchError: (a ``RuntimeError``) a rank exited non-zero or the timeout passed. Every
            other rank is stopped first (SIGTERM to its process group, SIGKILL after
            3 s), so no process outlives the call; the message names the rank and ends with the
            tail of its stderr.
    """
    if not isinstance(net, (EmulatedNetwork, Loopback)):
        raise TypeError(f"launch_ranks(net={net!r}): net must be an EmulatedNetwork or LOOPBACK")
    if net.closed:
        raise RuntimeError("launch_ranks(net=...): the network is closed")
    if isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv) or not argv:
        raise TypeError(
            f"launch_ranks(argv={argv!r}): argv must be a non-empty list of str, e.g. [sys.executable, 'rank.py']"
        )
    if not isinstance(world_size, int) or not 1 <= world_size <= net.num_hosts:
        raise ValueError(
            f"launch_ranks(world_size={world_size!r}): world_size must be in [1, {net.num_hosts}] (the network's hosts)"
        )
    if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"launch_ranks(master_port={master_port!r}): master_port must be in [1, 65535]")
    if not timeout > 0:
        raise ValueError(f"launch_ranks(timeout={timeout!r}): timeout must be > 0 seconds")
    env = dict(env or {})
    if clash := sorted(set(env) & set(_RESERVED_ENV)):
        raise ValueError(
            f"launch_ranks(env={{{', '.join(f'{k!r}: ...' for k in clash)}}}): env may not set "
            f"{', '.join(clash)}; launch_ranks sets them per rank"
        )
    if bad := [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]:
        raise TypeError(f"launch_ranks(env=...): keys and values must be str; bad entries for {bad!r}")

    argv = list(argv)
    procs: list[subprocess.Popen] = []
    files: list[tuple] = []
    failed: int | None = None
    timed_out = False
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
            rank_env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank),
                MASTER_ADDR=net.host_ip(0), MASTER_PORT=str(master_port),
                GLOO_SOCKET_IFNAME=net.ifname(rank), TP_SOCKET_IFNAME=net.ifname(rank),
            )  # fmt: skip
            # Files, not pipes: a rank that writes a lot must never block on a full pipe while we wait on another.
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    net.exec_prefix(rank) + argv, env=rank_env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True,
                )  # fmt: skip
            )
        deadline = time.monotonic() + timeout
        while failed is None:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if all(c is not None for c in codes):
                break
            if failed is None and time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        _stop_all(procs)

    results = []
    for proc, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        results.append(
            subprocess.CompletedProcess(
                proc.args, proc.returncode,
                out.read().decode(errors="replace"), err.read().decode(errors="replace"),
            )  # fmt: skip
        )
        out.close()
        err.close()
    if failed is not None:
        others = ", ".join(f"rank {r}: {res.returncode}" for r, res in enumerate(results) if r != failed)
        raise LaunchError(
            f"launch_ranks: rank {failed} (on {net.namespace(failed)}) exited with code {results[failed].returncode}; "
            f"the others were stopped (exit codes {others or 'none'}; negative = killed by that signal). "
            f"Tail of rank {failed}'s stderr:\n{_tail(results[failed].stderr) or '(empty)'}",
            failed,
            results,
        )
    if timed_out:
        waiting = [r for r, p in enumerate(procs) if results[r].returncode != 0]
        first = waiting[0]
        raise LaunchError(
            f"launch_ranks(timeout={timeout}): ranks {waiting} were still running after {timeout} s and were "
            f"killed. Tail of rank {first}'s stderr:\n{_tail(results[first].stderr) or '(empty)'}",
            first,
            results,
        )
    return results


# -- link-rate probe ---------------------------------------------------------------------------

_RECEIVER = r"""
import socket, sys, time
host, nbytes = sys.argv[1], int(sys.argv[2])
srv = socket.socket()
srv.bind((host, 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
view = memoryview(bytearray(1 << 20))
first = conn.recv_into(view)
t0 = time.perf_counter()  # clock starts at the first byte: connection setup is not link rate
got = first
while got < nbytes:
    k = conn.recv_into(view)
    if k == 0:
        break
    got += k
t1 = time.perf_counter()
conn.sendall(b"ok")
print(got, first, t1 - t0, flush=True)
"""

_SENDER = r"""
import socket, sys
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = socket.create_connection((host, port), timeout=60)
chunk = memoryview(bytes(1 << 20))
left = nbytes
while left > 0:
    sock.sendall(chunk[: min(left, len(chunk))])
    left -= min(left, len(chunk))
sock.recv(2)
"""


def measure_link_rate(net: EmulatedNetwork, i: int, j: int, nbytes: int, timeout: float = 60.0) -> float:
    """TCP goodput from host ``i`` to host ``j``, in bytes per second.

    A Python receiver on host ``j`` and a sender on host ``i`` move ``nbytes`` over one TCP
    connection; the receiver times from its first byte to its last. The figure is payload
    throughput, so on a tbf link it sits a few percent under ``rate / 8`` (Ethernet, IP and TCP
    headers take ~4% of each 1500-byte frame). A few MB is enough: 4 MB takes 0.3 s at 100mbit.

    Raises:
        ValueError: ``i == j``, a host index is out of range, or ``nbytes`` is below 64 KiB
            (too little to see the rate through the tbf burst).
        RuntimeError: the network is closed, or the probe failed or exceeded ``timeout``.
    """
    net._check_host("measure_link_rate", i)
    net._check_host("measure_link_rate", j)
    if i == j:
        raise ValueError(f"measure_link_rate(i={i}, j={j}): i and j must be different hosts")
    if not isinstance(nbytes, int) or nbytes < 64 * 1024:
        raise ValueError(f"measure_link_rate(nbytes={nbytes!r}): nbytes must be an int >= 65536")
    if net.closed:
        raise RuntimeError("measure_link_rate(net=...): the network is closed")
    receiver = subprocess.Popen(
        net.exec_prefix(j) + [sys.executable, "-c", _RECEIVER, net.host_ip(j), str(nbytes)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    sender = None
    try:
        ready, _, _ = select.select([receiver.stdout], [], [], timeout)
        port_line = receiver.stdout.readline() if ready else ""
        if not port_line.strip():
            why = _tail(receiver.stderr.read()) if receiver.poll() is not None else f"no port after {timeout} s"
            raise RuntimeError(f"measure_link_rate: the receiver on host {j} did not start: {why}")
        sender = subprocess.run(
            net.exec_prefix(i) + [sys.executable, "-c", _SENDER, net.host_ip(j), port_line.strip(), str(nbytes)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if sender.returncode != 0:
            raise RuntimeError(f"measure_link_rate: the sender on host {i} failed: {_tail(sender.stderr)}")
        out, err = receiver.communicate(timeout=timeout)
        if receiver.returncode != 0:
            raise RuntimeError(f"measure_link_rate: the receiver on host {j} failed: {_tail(err)}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"measure_link_rate(timeout={timeout}): moving {nbytes} bytes from host {i} to {j} took longer"
        ) from None
    finally:
        if receiver.poll() is None:
            _signal_group(receiver, signal.SIGKILL)
        receiver.wait()
        if receiver.stdout:
            receiver.stdout.close()
        if receiver.stderr:
            receiver.stderr.close()
    got, first, seconds = out.split()
    if int(got) != nbytes:
        raise RuntimeError(f"measure_link_rate: host {j} received {got} of {nbytes} bytes")
    return (int(got) - int(first)) / float(seconds)
