"""Starting a benchmark's processes, on loopback or emulated links, and accounting for the CPU they share.

:class:`Launcher` is the one way a suite runs its worker module: one launch per run through
:func:`lightning_pdist.bench.netns.launch_ranks` (on :data:`~lightning_pdist.bench.netns.LOOPBACK` or an
:class:`~lightning_pdist.bench.netns.EmulatedNetwork`), each in its own scratch folder and on a fresh port, timed
with the CPU other work used meanwhile (the machine has 2 shared cores), the kernel's byte counters read around
it on emulated links, and a failure turned into a row's reason where the suite asks for it.
:func:`emulated_network` builds one emulated network for a suite and records it (or why it was skipped) in the
document; :func:`worker_main` is every worker module's command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.netns import LOOPBACK, EmulatedNetwork, LaunchError, Loopback, launch_ranks, measure_link_rate
from lightning_pdist.bench.report import check_spec_keys

__all__ = ["Launched", "Launcher", "WorkerSpec", "busy_cpu_s", "emulated_network", "free_port", "own_cpu_s", "read_results",
           "worker_env", "worker_main"]  # fmt: skip

LINK_PROBE_BYTES = 4 << 20


@dataclass
class Launched:
    """One launch: the processes' result files (in rank order), times, kernel byte counters, or why it failed."""

    results: list[dict[str, Any]]
    wall_s: float
    ours_cpu_s: float
    other_cpu_s: float | None
    kernel: list[tuple[int, int]] | None = None  # (rx, tx) bytes of hosts 0.. during the launch, emulated links only
    error: str | None = None

    @property
    def other_load_cores(self) -> float | None:
        """Cores other work kept busy on average during the launch (how far to trust its timings)."""
        return None if self.other_cpu_s is None else round(self.other_cpu_s / self.wall_s, 2)


class Launcher:
    """Runs one suite's launches, one after another, each with ``python -m <module> --spec JSON --out-dir DIR``.

    Args:
        suite: named in errors.
        scratch: parent of every launch's output folder (``run<i>``).
        timeout: seconds per launch.
        port: the emulated runs' first rendezvous port; every launch takes a fresh one, since the last run's
            sockets may linger in TIME_WAIT (loopback runs take a free port of this machine).
    """

    def __init__(self, suite: str, scratch: Path, timeout: float, port: int = 29500) -> None:
        self.suite, self.scratch, self.timeout, self.port = suite, Path(scratch), timeout, port
        self.env = worker_env()
        self.count = 0

    @classmethod
    @contextmanager
    def temporary(cls, suite: str, timeout: float, **kwargs: Any) -> Iterator[Launcher]:
        """A launcher whose scratch folder (under the system's temporary folder) is removed when the block ends."""
        scratch = Path(tempfile.mkdtemp(prefix=f"pdist-bench-{suite}-"))
        try:
            yield cls(suite, scratch, timeout, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def run(
        self,
        module: str,
        spec: dict[str, Any],
        world_size: int,
        net: EmulatedNetwork | Loopback = LOOPBACK,
        *,
        files: Sequence[tuple[str, int]] | None = None,
        extra_argv: Sequence[str] = (),
        env: dict[str, str] | None = None,
        kernel_hosts: int = 0,
        errors: int = 0,
    ) -> Launched:
        """Launch ``world_size`` processes of ``module`` on ``net``; read the files they wrote.

        ``files``: ``(prefix, count)`` of the result files (default ``("rank", world_size)``), read in order.
        ``kernel_hosts``: read the rx/tx counters of that many hosts around the launch (emulated links only).
        ``errors``: when > 0, a failed launch (or a missing result file) gives ``Launched.error``, its first and
        last lines cut to that many characters, instead of raising.
        """
        self.count += 1
        self.port += 1
        out = self.scratch / f"run{self.count}"
        argv = [sys.executable, "-m", module, "--spec", json.dumps(spec), "--out-dir", str(out), *extra_argv]
        emulated = isinstance(net, EmulatedNetwork)
        counters = lambda: [(net.rx_bytes(i), net.tx_bytes(i)) for i in range(kernel_hosts if emulated else 0)]  # noqa: E731
        before = counters()
        busy0, ours0, t0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
        results, error = [], None
        try:
            port = self.port if emulated else free_port()
            launch_ranks(net, argv, world_size, port, env={**self.env, **(env or {})}, timeout=self.timeout)
            results = [r for prefix, count in files or [("rank", world_size)]
                       for r in read_results(out, prefix, count, self.suite)]  # fmt: skip
        except (LaunchError, RuntimeError) as err:  # the launcher already stopped the other ranks
            if not errors:
                raise
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            error = " | ".join(dict.fromkeys([lines[0], lines[-1]]))[:errors]
        wall, ours, busy1 = time.perf_counter() - t0, own_cpu_s() - ours0, busy_cpu_s()
        # Read after the ranks exited: tbf queues may still hold bytes while they run.
        kernel = [(rx - b[0], tx - b[1]) for (rx, tx), b in zip(counters(), before)] if before else None
        # Other sessions share this machine's cores; their CPU time during the run says how far to trust wall times.
        other = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - ours)
        return Launched(results, wall, ours, other, kernel, error)


@contextmanager
def emulated_network(suite: str, doc: dict[str, Any], key: str, num_hosts: int, rate: str,
                     log: Callable[[str], None]) -> Iterator[EmulatedNetwork | None]:  # fmt: skip
    """An emulated network of ``num_hosts`` at ``rate``, recorded as ``doc["networks"][key]`` with its measured goodput;
    ``None`` (recorded as skipped, with the reason) where this machine cannot build one."""
    ok, reason = EmulatedNetwork.available()
    if not ok:
        doc["networks"][key] = {"skipped": reason}
        log(f"{suite}: emulated links are not available here, skipping {key}: {reason}")
        yield None
        return
    with EmulatedNetwork(num_hosts=num_hosts, rate=rate) as net:
        goodput = measure_link_rate(net, 0, 1, LINK_PROBE_BYTES)
        doc["networks"][key] = {"detail": net.describe(), "rate": rate, "burst_bytes": net.burst_bytes,
                                "measured_tcp_goodput_bytes_per_s": round(goodput)}  # fmt: skip
        log(f"{suite}: {net.describe()}; TCP goodput host 0 -> 1: {goodput * 8 / 1e6:.1f} Mbit/s")
        yield net


class WorkerSpec:
    """Base of a worker's spec: a frozen dataclass whose fields are the keys of the JSON object the worker receives.

    :meth:`check` validates such an object (every key, no other, each value by the subclass's ``__post_init__``)
    and returns it: the workers read the plain dict, as it travels on the command line.
    """

    WHO: ClassVar[str]

    @classmethod
    def check(cls, spec: dict[str, Any]) -> dict[str, Any]:
        """``spec`` if it is a valid spec; ``ValueError`` naming the missing or unknown keys, or the bad value."""
        check_spec_keys(spec, [f.name for f in fields(cls)], cls.WHO)  # type: ignore[arg-type]
        cls(**spec)
        return spec

    def bad(self, key: str, rule: str) -> ValueError:
        return ValueError(f"{self.WHO} spec({key}={getattr(self, key)!r}): {rule}")

    def ints(self, *keys: str, low: int = 1, why: str = "") -> None:
        """Each of ``keys`` is an int (not a bool) >= ``low``."""
        for key in keys:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise self.bad(key, f"{key} must be an int >= {low}{why}")

    def sgd(self) -> None:
        """``lr`` > 0 and ``momentum`` in [0, 1) (the SGD of the digits workers)."""
        if not self.lr > 0:  # type: ignore[attr-defined]
            raise self.bad("lr", "lr must be > 0")
        if not 0 <= self.momentum < 1:  # type: ignore[attr-defined]
            raise self.bad("momentum", "momentum must be in [0, 1)")

    def one_of(self, key: str, allowed: Sequence[Any]) -> None:
        if getattr(self, key) not in allowed:
            raise self.bad(key, f"{key} must be one of {tuple(allowed)}")


def worker_main(module: str, doc: str | None, check: Callable[[dict[str, Any]], Any], run: Callable[..., Any],
                argv: Sequence[str] | None = None, hosts: bool = False, prefix: str = "rank") -> int:  # fmt: skip
    """The command line of a worker module: ``--spec JSON --out-dir DIR`` (and ``--hosts IP,IP,...``).

    ``check`` validates the spec (``ValueError`` names the bad key); ``run(spec, out_dir)`` (``run(spec, hosts,
    out_dir)`` with ``hosts``) is one process of the launch, and what it returns (unless ``None``) is written to
    ``DIR/<prefix><RANK>.json``.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or module).splitlines()[0])
    parser.add_argument("--spec", required=True, help="the run spec as a JSON object")
    parser.add_argument("--out-dir", required=True, type=Path, help="where this process writes its result")
    if hosts:
        parser.add_argument("--hosts", required=True, help="comma-separated addresses of hosts 0, 1, ...")
    args = parser.parse_args(argv)
    try:
        spec = json.loads(args.spec)
    except json.JSONDecodeError as err:
        parser.error(f"--spec {args.spec!r}: must be a JSON object ({err})")
    if not isinstance(spec, dict):
        parser.error(f"--spec {args.spec!r}: must be a JSON object")
    spec = check(spec)
    result = run(spec, args.hosts.split(","), args.out_dir) if hosts else run(spec, args.out_dir)
    if result is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{prefix}{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
    return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """``PYTHONPATH`` with this checkout first (the ranks import it even when it is not installed), and
    ``PDIST_NO_LIGHTNING=1``: a rank imports Lightning only if its row trains with it (~6 s of CPU saved per rank)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}", "PDIST_NO_LIGHTNING": "1"}


def busy_cpu_s() -> float | None:
    """CPU seconds this machine has spent busy (all cores, from ``/proc/stat``); ``None`` where unreadable."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the ranks, once they exited)."""
    import resource

    usages = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usages)


def read_results(out_dir: Path, prefix: str, count: int, suite: str) -> list[dict[str, Any]]:
    """The ``<prefix><i>.json`` files processes ``0 .. count-1`` of one run wrote, in order.

    Raises:
        RuntimeError: one is missing (its process exited cleanly without writing it); the message names ``suite``.
    """
    results = []
    for i in range(count):
        path = out_dir / f"{prefix}{i}.json"
        if not path.exists():
            raise RuntimeError(f"{suite}: {prefix} {i} exited cleanly but wrote no {path}")
        results.append(json.loads(path.read_text()))
    return results
