"""How busy the emulated links were, moment by moment: each host's veth byte counters sampled every few ms.

A run's mean rate says how far a link fell short of its line rate, not why. :class:`LinkSampler` reads the byte
counters of chosen hosts' switch-side veths (``vs<i>`` in the switch namespace: ``tx`` is what the switch sent
down to host ``i``, ``rx`` what host ``i`` sent up) every ``interval`` seconds, from a small process inside the
switch namespace, stamped with ``CLOCK_MONOTONIC`` (the clock of :func:`time.perf_counter` in every process here,
namespaces included). :func:`link_activity` cuts the samples of a time window into bins and counts, per link and
direction::

    utilization = bytes in the window / (line rate · window)
    idle share  = bins that carried under ``idle_below`` of line rate / bins
    full share  = bins that carried at least ``full_above`` of line rate / bins

so a shortfall splits into time the link sat idle (waiting: back-off after loss, a barrier, compute) and time it
ran below rate. Standard library only, like :mod:`~lightning_pdist.bench.netns`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LinkSampler", "link_activity"]

_SAMPLER = r"""
import json, signal, sys, time
devs, interval, out = sys.argv[1].split(","), float(sys.argv[2]), sys.argv[3]
files = [(open(f"/sys/class/net/{d}/statistics/rx_bytes", "rb"), open(f"/sys/class/net/{d}/statistics/tx_bytes", "rb"))
         for d in devs]
rows, stop = [], []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def read(f):
    f.seek(0)
    return int(f.read())
print("ready", flush=True)
nxt = time.perf_counter()
while not stop:
    rows.append([time.perf_counter()] + [v for rx, tx in files for v in (read(rx), read(tx))])
    nxt += interval
    time.sleep(max(0.0, nxt - time.perf_counter()))
with open(out, "w") as f:
    json.dump({"devs": devs, "rows": rows}, f)
"""


class LinkSampler:
    """Samples hosts' switch-side veth counters every ``interval`` s while the ``with`` block runs.

    Args:
        net: an open :class:`~lightning_pdist.bench.netns.EmulatedNetwork`.
        hosts: the host indices whose links are sampled.
        interval: seconds between samples (at least 1 ms).

    After the block, :attr:`samples` holds ``[(t, [(rx, tx) per host])]`` (``rx``: bytes the host sent,
    ``tx``: bytes it received, as counted by the switch's end of its link).
    """

    def __init__(self, net: Any, hosts: Sequence[int], interval: float = 0.01) -> None:
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not interval >= 0.001:
            raise ValueError(f"LinkSampler(interval={interval!r}): interval must be a number of seconds >= 0.001")
        if not hosts:
            raise ValueError(f"LinkSampler(hosts={list(hosts)!r}): name at least one host")
        self.net, self.hosts, self.interval = net, [net._check_host("LinkSampler", i) for i in hosts], float(interval)
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LinkSampler:
        fd, self._path = tempfile.mkstemp(prefix="pdist-links-", suffix=".json")
        os.close(fd)
        argv = ["ip", "netns", "exec", self.net.switch_namespace, sys.executable, "-c", _SAMPLER,
                ",".join(f"vs{i}" for i in self.hosts), str(self.interval), self._path]  # fmt: skip
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)  # fmt: skip
        if self._proc.stdout.readline().strip() != "ready":
            self._proc.wait()
            raise RuntimeError(f"LinkSampler: the sampler did not start: {self._proc.stderr.read()[-500:]}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        proc, self._proc = self._proc, None
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
            data = json.loads(Path(self._path).read_text() or "{}")
            self.samples = [(r[0], [(r[1 + 2 * h], r[2 + 2 * h]) for h in range(len(self.hosts))]) for r in data.get("rows", [])]
        except (subprocess.TimeoutExpired, ValueError, OSError):
            self.samples = []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            Path(self._path).unlink(missing_ok=True)


def link_activity(samples: Sequence[tuple[float, Sequence[tuple[int, int]]]], t0: float, t1: float, rate_bits: int,
                  bin_s: float = 0.02, idle_below: float = 0.1, full_above: float = 0.8) -> list[dict[str, dict[str, float]]]:  # fmt: skip
    """Per host, per direction (``"up"``: what it sent, ``"down"``: what it received) in ``[t0, t1]``: utilization,
    idle share and full share (module docstring). Bins are ``bin_s`` long, from the samples nearest their edges;
    ``[]`` if fewer than two samples fall in the window."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return []
    line = rate_bits / 8  # bytes per second
    edges = [inside[0]]
    for s in inside[1:]:
        if s[0] - edges[-1][0] >= bin_s * 0.999:
            edges.append(s)
    out = []
    for h in range(len(inside[0][1])):
        host = {}
        for d, name in ((0, "up"), (1, "down")):
            span = inside[-1][0] - inside[0][0]
            total = inside[-1][1][h][d] - inside[0][1][h][d]
            rates = [(b[1][h][d] - a[1][h][d]) / (b[0] - a[0]) / line for a, b in zip(edges, edges[1:])]
            host[name] = {"utilization": round(total / span / line, 3),
                          "idle_share": round(sum(r < idle_below for r in rates) / len(rates), 3) if rates else None,
                          "full_share": round(sum(r >= full_above for r in rates) / len(rates), 3) if rates else None}  # fmt: skip
        out.append(host)
    return out
