"""Summarise the per-step probe the pipeline worker writes under ``PDIST_PROBE=DIR`` (a diagnosis aid, no results file).

``PDIST_PROBE=DIR python -m lightning_pdist.bench pipeline --quick --out OUT --parts throughput --network loopback
--stages 4 --engines ours_1f1b torch_1f1b --steps 20 --rounds 5`` then ``python -m lightning_pdist.bench.pipeline_probe
DIR`` prints, per engine and rank over every timed step of every round: the median step and receive wait; the mean
per step of the process's CPU seconds (``getrusage``: user + sys, every thread), the main thread's, the rest (gloo's
threads), voluntary / involuntary context switches, the thread count, minor page faults; the main thread's CPU inside the transport's
calls (ours: ``P2P.send/recv/release/post``; torch: ``_batch_p2p``/``_wait_batch_p2p``, which post and wait its
``isend``/``irecv``) and outside them; and per call of each probed function its count per step, main-thread CPU and
wall microseconds (ours also ``P2P._frame``/``_parse`` and the ``torch.distributed`` calls inside, nested: not in the
per-step sum).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path


def summary(directory: Path) -> str:
    runs: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for path in sorted(directory.glob("probe_*.json")):
        _, schedule, engine, rank, *_ = path.stem.split("_")
        runs[(f"{engine} {schedule}", int(rank))].append(json.loads(path.read_text()))
    out = ["engine rank rounds | median step ms | median wait ms | CPU ms/step: process, main thread, other threads | "
           "vcsw/step ivcsw/step threads minor-faults/step | main-thread CPU ms/step in transport calls, outside them"]  # fmt: skip
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * 5)
    for (engine, rank), files in sorted(runs.items()):
        rows = [r for f in files for r in f["rows"]]
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))]
        med = [statistics.median(r[i] for r in rows) for i in (0, 1)]
        out.append(f"{engine} {rank} {len(files)} | {med[0] * 1e3:.2f} | {med[1] * 1e3:.2f} | {mean[2] * 1e3:.2f}, "
                   f"{mean[3] * 1e3:.2f}, {(mean[2] - mean[3]) * 1e3:.2f} | {mean[4]:.1f} {mean[5]:.1f} {rows[-1][6]} {mean[9] if len(mean) > 9 else float('nan'):.1f} | "
                   f"{mean[7] * 1e3:.2f}, {(mean[3] - mean[7]) * 1e3:.2f}")  # fmt: skip
        s = sums[engine]
        for i, v in enumerate((mean[2], mean[3], mean[7], mean[4], mean[5])):
            s[i] += v
    for engine, (cpu, main, comm, vcsw, ivcsw) in sums.items():
        out.append(f"sum over ranks, {engine}: CPU {cpu * 1e3:.2f} ms/step (main thread {main * 1e3:.2f}: in transport "
                   f"calls {comm * 1e3:.2f}, outside {(main - comm) * 1e3:.2f}; other threads {(cpu - main) * 1e3:.2f}), "
                   f"vcsw {vcsw:.1f}, ivcsw {ivcsw:.1f}")  # fmt: skip
    out.append("engine rank function | calls/step | main-thread CPU us/call | wall us/call")
    for (engine, rank), files in sorted(runs.items()):
        steps, calls = 0, collections.defaultdict(lambda: [0, 0.0, 0.0])
        for f in files:
            steps += len(f["rows"])
            for name, (n, cpu, wall) in f.get("by_name", {}).items():
                c = calls[name]
                c[0], c[1], c[2] = c[0] + n, c[1] + cpu, c[2] + wall
        for name, (n, cpu, wall) in sorted(calls.items()):
            out.append(f"{engine} {rank} {name} | {n / steps:.1f} | {cpu / n * 1e6:.1f} | {wall / n * 1e6:.1f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pdist.bench.pipeline_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("directory", type=Path, help="the PDIST_PROBE directory the pipeline bench's workers wrote")
    args = parser.parse_args(argv)
    if not any(args.directory.glob("probe_*.json")):
        parser.error(f"directory={str(args.directory)!r}: no probe_*.json in it (run the bench with PDIST_PROBE set)")
    print(summary(args.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
