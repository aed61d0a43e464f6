"""``python -m lightning_pdist.bench <suite> [options]``: run a suite of :data:`lightning_pdist.bench.SUITES`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_pdist.bench import SUITES
from lightning_pdist.extras import require_extra


def load_suite(name: str) -> ModuleType:
    """Import the module of suite ``name``; ``ValueError`` if there is no such suite."""
    if name not in SUITES:
        raise ValueError(f"lightning_pdist.bench(suite={name!r}): suite must be one of {sorted(SUITES)}")
    return importlib.import_module(SUITES[name])


def build_parser() -> Any:
    """The top-level parser: one sub-command per suite, its options generated from the suite's ``CLI``."""
    from lightning_pdist.bench.cli import suite_parser

    parser = suite_parser("python -m lightning_pdist.bench",
                          "Run a lightning_pdist benchmark suite; each writes DIR/<suite>.json and DIR/<suite>.png.")  # fmt: skip
    subcommands = parser.add_subcommands(dest="suite", required=True)
    for name in SUITES:
        module = load_suite(name)
        sub = suite_parser(f"python -m lightning_pdist.bench {name}", module.__doc__)
        module.CLI.add_arguments(sub)
        subcommands.add_subcommand(name, sub, help=(module.__doc__ or name).strip().splitlines()[0])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    name = args.suite
    require_extra("bench", f"python -m lightning_pdist.bench {name} (digits data, plots)")
    module = load_suite(name)
    try:
        config = module.CLI.config_of(args[name])
    except ValueError as err:
        print(f"python -m lightning_pdist.bench {name}: error: {err}", file=sys.stderr)
        return 2
    return module.run(config, Path(args[name].out), argv[argv.index(name) + 1 :])


if __name__ == "__main__":
    raise SystemExit(main())
