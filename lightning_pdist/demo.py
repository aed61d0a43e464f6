"""The main job: DDP vs local SGD vs BMUF vs EASGD on the digits, 2 CPU processes on loopback.

``python -m lightning_pdist.demo [--out DIR]`` trains ``SmallCNN(width=64)`` on scikit-learn's
bundled handwritten digits with each strategy for the same 6,144 samples (96 steps of 32 per
rank, 2 ranks, gloo on 127.0.0.1, seed 0), prints a results table (strategy, period, validation
accuracy, bytes each rank sent, training time) and writes ``DIR/averaging.json`` and
``DIR/averaging.png``. It is the ``averaging`` benchmark suite
(:mod:`lightning_pdist.bench.averaging`) on loopback only; for emulated network links run
``python -m lightning_pdist.bench averaging --quick --out DIR`` as root.

On loopback, bandwidth is nearly free, so the training times differ little; the bytes column
is what the algorithms save, and what an actual network would charge for.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_pdist.bench.averaging import SuiteConfig, run_suite
from lightning_pdist.bench.report import markdown_table
from lightning_pdist.extras import require_extra

STRATEGIES = ("pdist_ddp", "local_sgd", "bmuf", "easgd")
PERIOD = 8
DEMO_COLUMNS = (
    ("strategy", "strategy", None),
    ("period", "period", None),
    ("val_acc", "val_acc", ".4f"),
    ("comm bytes/rank", "comm_bytes_per_rank", lambda b: f"{b:,}"),
    ("vs DDP", "bytes_vs_ddp", None),
    ("wall s", "wall_s", ".2f"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pdist.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("pdist-demo"), help="output directory (default %(default)s)")
    args = parser.parse_args(argv)
    require_extra("demo", "python -m lightning_pdist.demo (digits data, plot)")
    config = SuiteConfig(networks=("loopback",), world_sizes=(2,), periods=(PERIOD,), strategies=STRATEGIES,
                         overhead="no")  # the pdist_ddp-vs-ddp row is the benchmark's, not the demo's  # fmt: skip
    command = f"python -m lightning_pdist.demo --out {args.out}"
    print(
        f"lightning_pdist demo: {', '.join(STRATEGIES)} (period {PERIOD}), 2 CPU processes on loopback, "
        f"{config.samples} digits each run; about a minute.",
        flush=True,
    )
    doc = run_suite(config, args.out, command, log=lambda line: print(line, flush=True))
    rows = doc["rows"]
    ddp = next((r["comm_bytes_per_rank"] for r in rows if r["strategy"] == "pdist_ddp"), None)
    for row in rows:
        sent = row["comm_bytes_per_rank"]
        row["bytes_vs_ddp"] = f"1/{ddp / sent:.0f}" if ddp and sent else None
    print()
    print(markdown_table(rows, DEMO_COLUMNS))
    print(
        f"\nval_acc: accuracy of the final {rows[0]['model']} (DDP's model, the replica average, BMUF's global "
        f"model, EASGD's center) on the {rows[0]['val_samples']} held-out digits; comm bytes/rank: bytes each rank "
        "sent for training, as the strategy logs them (pdist/comm_bytes_total); wall s: the training loop on the "
        "slowest rank."
    )
    print(f"wrote {args.out / 'averaging.json'} and {args.out / 'averaging.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
