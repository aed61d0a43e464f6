"""``python -m lightning_pdist.bench <suite> [options]``: run a suite of :data:`lightning_pdist.bench.SUITES`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from lightning_pdist.bench import SUITES
from lightning_pdist.extras import require_extra


def load_suite(name: str) -> ModuleType:
    """Import the module of suite ``name``; ``ValueError`` if there is no such suite."""
    if name not in SUITES:
        raise ValueError(f"lightning_pdist.bench(suite={name!r}): suite must be one of {sorted(SUITES)}")
    return importlib.import_module(SUITES[name])


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: one sub-command per suite, each with the suite's own options."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pdist.bench",
        description="Run a lightning_pdist benchmark suite; each writes DIR/<suite>.json and DIR/<suite>.png.",
    )
    subparsers = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name in SUITES:
        module = load_suite(name)
        summary = (module.__doc__ or name).strip().splitlines()[0]
        sub = subparsers.add_parser(name, help=summary, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        module.configure_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    require_extra("bench", f"python -m lightning_pdist.bench {args.suite} (digits data, plots)")
    return load_suite(args.suite).run(args, argv[argv.index(args.suite) + 1 :])


if __name__ == "__main__":
    raise SystemExit(main())
