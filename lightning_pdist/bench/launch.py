"""Starting a benchmark's processes, on loopback or emulated links, and accounting for the CPU they share.

:class:`Launcher` is the one way a suite runs its worker module: one launch per run through
:func:`lightning_pdist.bench.netns.launch_ranks` (on :data:`~lightning_pdist.bench.netns.LOOPBACK` or an
:class:`~lightning_pdist.bench.netns.EmulatedNetwork`), each in its own scratch folder and on a fresh port, timed
with the CPU other work used meanwhile (the machine has 2 shared cores), the kernel's byte counters read around
it on emulated links, and a failure turned into a row's reason where the suite asks for it.
:func:`emulated_network` builds one emulated network for a suite and records it (or why it was skipped) in the
document; :func:`worker_main` is every worker module's command line and :func:`bench_trainer` the Trainer its ranks fit
with.
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
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.netns import LOOPBACK, EmulatedNetwork, LaunchError, Loopback, launch_ranks, measure_link_rate
from lightning_pdist.bench.report import check_spec_keys, finish_suite, new_document, output_dir

__all__ = ["Launched", "Launcher", "SGDSpec", "SuiteRun", "WorkerSpec", "as_one_node", "bench_trainer", "busy_cpu_s", "close_group", "emulated_network", "free_port", "free_ports", "own_cpu_s", "read_results",
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
        (got,) = self._launch(module, [spec], world_size, net, files, extra_argv, env, kernel_hosts, errors, batch=False)
        return got

    def run_each(self, module: str, specs: Sequence[dict[str, Any]], world_size: int, net: EmulatedNetwork | Loopback = LOOPBACK,
                 *, env: dict[str, str] | None = None, errors: int = 0) -> list[Launched]:  # fmt: skip
        """Like :meth:`run` for each of ``specs`` in turn, but in one launch: the same ``world_size`` processes run
        every spec (each on its own rendezvous port), so each process imports torch (and Lightning) once.

        Every :class:`Launched` carries the launch's wall and CPU times; where the launch failed, the specs whose
        results are missing carry its error (``errors`` > 0) and those already done their results.
        """
        return self._launch(module, list(specs), world_size, net, None, (), env, 0, errors, batch=True) if specs else []

    def _launch(self, module: str, specs: list[dict[str, Any]], world_size: int, net: EmulatedNetwork | Loopback,
                files: Sequence[tuple[str, int]] | None, extra_argv: Sequence[str], env: dict[str, str] | None,
                kernel_hosts: int, errors: int, batch: bool) -> list[Launched]:  # fmt: skip
        self.count += 1
        out = self.scratch / f"run{self.count}"
        emulated = isinstance(net, EmulatedNetwork)
        ports = list(range(self.port + 1, self.port + 1 + len(specs))) if emulated else free_ports(len(specs))
        self.port += len(specs)
        spec_arg = json.dumps(specs if batch else specs[0])
        ports_arg = ["--ports", ",".join(map(str, ports))] if batch else []
        argv = [sys.executable, "-m", module, "--spec", spec_arg, "--out-dir", str(out), *ports_arg, *extra_argv]
        counters = lambda: [(net.rx_bytes(i), net.tx_bytes(i)) for i in range(kernel_hosts if emulated else 0)]  # noqa: E731
        before = counters()
        busy0, ours0, t0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
        error = None
        try:
            launch_ranks(net, argv, world_size, ports[0], env={**self.env, **(env or {})}, timeout=self.timeout)
        except (LaunchError, RuntimeError) as err:  # the launcher already stopped the other ranks
            if not errors:
                raise
            error = _cut(err, errors)
        wall, ours, busy1 = time.perf_counter() - t0, own_cpu_s() - ours0, busy_cpu_s()
        # Read after the ranks exited: tbf queues may still hold bytes while they run.
        kernel = [(rx - b[0], tx - b[1]) for (rx, tx), b in zip(counters(), before)] if before else None
        # Other sessions share this machine's cores; their CPU time during the run says how far to trust wall times.
        other = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - ours)
        launched = []
        for i in range(len(specs)):
            results, failed = [], None if batch else error  # a spec of a batch that wrote its results is done
            try:
                results = [r for prefix, count in files or [("rank", world_size)]
                           for r in read_results(out / str(i) if batch else out, prefix, count, self.suite)]  # fmt: skip
            except RuntimeError as err:
                if not errors:
                    raise
                failed = error or _cut(err, errors)
            launched.append(Launched(results if failed is None else [], wall, ours, other, kernel, failed))
        return launched


def _cut(err: Exception, limit: int) -> str:
    """The first and last non-empty lines of ``err``, cut to ``limit`` characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " | ".join(dict.fromkeys([lines[0], lines[-1]]))[:limit]


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


class SuiteRun:
    """One run of a suite, the skeleton every ``run_suite`` shares: ``out`` (the folder, created), ``doc`` (the JSON
    document, :func:`~lightning_pdist.bench.report.new_document`), a :class:`Launcher` on a scratch folder, and the
    networks it builds; leaving the ``with`` block closes the networks and removes the scratch folder, and
    :meth:`finish` stamps the wall time and writes the JSON and the plot.
    """

    def __init__(self, suite: str, config: Any, out: Path, command: str, log: Callable[[str], None] = print,
                 port: int = 29500, timeout: float | None = None) -> None:  # fmt: skip
        self.suite, self.log, self.started = suite, log, time.perf_counter()
        self.out, self.doc = output_dir(suite, out), new_document(suite, command, asdict(config))
        self.scratch = Path(tempfile.mkdtemp(prefix=f"pdist-bench-{suite}-"))
        self.launcher = Launcher(suite, self.scratch, config.timeout if timeout is None else timeout, port=port)
        self.stack = ExitStack()
        self.stack.callback(shutil.rmtree, self.scratch, ignore_errors=True)

    def __enter__(self) -> SuiteRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stack.close()

    def loopback(self, detail: str | None = None) -> Loopback:
        """:data:`LOOPBACK`, recorded as ``doc["networks"]["loopback"]`` (``detail``: default ``"loopback: ..."``)."""
        self.doc["networks"]["loopback"] = {"detail": detail or "loopback: " + LOOPBACK.describe()}
        return LOOPBACK

    def emulated(self, key: str, num_hosts: int, rate: str) -> EmulatedNetwork | None:
        """:func:`emulated_network` ``key``, up until the run ends; ``None`` where it cannot be built here."""
        return self.stack.enter_context(emulated_network(self.suite, self.doc, key, num_hosts, rate, self.log))

    def networks(self, names: Sequence[str], rates: Sequence[str], num_hosts: int, key: str = "emulated {rate}",
                 loopback: str | None = None) -> Iterator[tuple[str, EmulatedNetwork | Loopback, str | None]]:  # fmt: skip
        """``(name, net, rate)``: loopback if ``names`` holds it, then (if it holds ``"emulated"``) one emulated
        network per rate, named ``key``, each built when reached and closed before the next (skipped where it cannot
        be built here)."""
        if "loopback" in names:
            yield "loopback", self.loopback(loopback), None
        for rate in rates if "emulated" in names else ():
            name = key.format(rate=rate)
            with emulated_network(self.suite, self.doc, name, num_hosts, rate, self.log) as net:
                if net is not None:
                    yield name, net, rate

    def finish(self, plot: Callable[[dict, Path], Any]) -> dict[str, Any]:
        """:func:`~lightning_pdist.bench.report.finish_suite`: the wall time, ``<suite>.json`` and ``<suite>.png``."""
        return finish_suite(self.doc, self.out, self.suite, self.started, plot)


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

    def one_of(self, key: str, allowed: Sequence[Any]) -> None:
        if getattr(self, key) not in allowed:
            raise self.bad(key, f"{key} must be one of {tuple(allowed)}")


@dataclass(frozen=True)
class SGDSpec(WorkerSpec):
    """The fields of a worker that trains a ``width``-wide model from ``seed`` on ``world_size`` ranks, ``steps``
    steps of SGD on ``batch_size`` samples per rank at ``lr`` with ``momentum``; a subclass's fields follow them.

    Its ``__post_init__`` checks them (the subclass calls it after its own first checks): ints >= 1, ``seed``
    >= 0, ``lr`` > 0 and ``momentum`` in [0, 1).
    """

    world_size: int
    steps: int
    batch_size: int
    lr: float
    momentum: float
    width: int
    seed: int

    def __post_init__(self) -> None:
        self.ints("world_size", "steps", "batch_size", "width")
        self.ints("seed", low=0)
        if not self.lr > 0:
            raise self.bad("lr", "lr must be > 0")
        if not 0 <= self.momentum < 1:
            raise self.bad("momentum", "momentum must be in [0, 1)")


def worker_main(module: str, doc: str | None, check: Callable[[dict[str, Any]], Any], run: Callable[..., Any],
                argv: Sequence[str] | None = None, hosts: bool = False, prefix: str = "rank") -> int:  # fmt: skip
    """The command line of a worker module: ``--spec JSON --out-dir DIR`` (and ``--hosts IP,IP,...``).

    ``check`` validates the spec (``ValueError`` names the bad key); ``run(spec, out_dir)`` (``run(spec, hosts,
    out_dir)`` with ``hosts``) is one process of the launch, with one torch thread (the ranks share the machine's
    cores), and what it returns (unless ``None``) is written to ``DIR/<prefix><RANK>.json``. With ``--ports P0,P1,...`` (:meth:`Launcher.run_each`) ``--spec`` is a list of
    specs, run in turn: spec ``i`` with ``MASTER_PORT=Pi`` and this process's environment as it started (a fit
    may drop variables), its result in ``DIR/<i>/``.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or module).splitlines()[0])
    parser.add_argument("--spec", required=True, help="the run spec as a JSON object (with --ports, a list of them)")
    parser.add_argument("--out-dir", required=True, type=Path, help="where this process writes its result")
    parser.add_argument("--ports", help="comma-separated rendezvous ports, one per spec of a --spec list")
    if hosts:
        parser.add_argument("--hosts", required=True, help="comma-separated addresses of hosts 0, 1, ...")
    args = parser.parse_args(argv)
    try:
        specs = json.loads(args.spec)
    except json.JSONDecodeError as err:
        parser.error(f"--spec {args.spec!r}: must be a JSON object ({err})")
    ports = None if args.ports is None else args.ports.split(",")
    if ports is None and not isinstance(specs, dict):
        parser.error(f"--spec {args.spec!r}: must be a JSON object")
    if ports is not None and not (isinstance(specs, list) and len(specs) == len(ports) and all(isinstance(s, dict) for s in specs)):
        parser.error(f"--spec {args.spec!r}: with --ports {args.ports!r} must be a list of JSON objects, one per port")
    if argv is None:  # a launched rank (not a test calling this in its own process)
        import torch

        torch.set_num_threads(1)
    env = dict(os.environ)
    for i, spec in enumerate([specs] if ports is None else specs):
        out_dir = args.out_dir if ports is None else args.out_dir / str(i)
        if ports is not None:
            os.environ.clear()
            os.environ.update(env, MASTER_PORT=ports[i])
        spec = check(spec)
        result = run(spec, args.hosts.split(","), out_dir) if hosts else run(spec, out_dir)
        if ports is not None:
            close_group()
        if result is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{prefix}{env.get('RANK', '0')}.json").write_text(json.dumps(result))
    if argv is None:  # a launched rank, its results written: skip interpreter teardown, where threads a library left
        sys.stdout.flush()  # (gloo's, DTensor's) can still abort the finished process with SIGABRT ("terminate called
        sys.stderr.flush()  # without an active exception": seen once on a tensor_parallel rank after its group closed)
        os._exit(0)
    return 0


def bench_trainer(**kwargs: Any) -> Any:
    """A Lightning ``Trainer`` on the CPU with nothing of Lightning's own around the training loop: no validation, no
    sanity check, no logger, checkpoints, progress bar or model summary; ``kwargs`` add to or override these."""
    from lightning.pytorch import Trainer

    return Trainer(**{"accelerator": "cpu", "limit_val_batches": 0, "num_sanity_val_steps": 0, "logger": False,
                      "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False, **kwargs})


def as_one_node(ranks: int | None) -> None:
    """How Lightning sees the launched ranks (each launched as a node of its own): as ``ranks`` local ranks of one node
    (``LOCAL_RANK`` = ``RANK``), or, with ``None``, as one process on its own (no rank variables at all)."""
    if ranks is None:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    else:
        os.environ.update(LOCAL_RANK=os.environ["RANK"], NODE_RANK="0", LOCAL_WORLD_SIZE=str(ranks))


def close_group() -> None:
    """Tear down a process group a run left up (Lightning's ``fit`` does), every rank done first: the next spec of
    the launch starts its own, and gloo's threads left to interpreter shutdown can abort a finished process
    (SIGABRT, "terminate called without an active exception", after its work is done)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (held together while they are picked)."""
    import socket
    from contextlib import ExitStack

    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


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
