"""Benchmarks: ``python -m lightning_pdist.bench <suite> --out DIR``, each suite writing JSON and a plot.

:data:`SUITES` maps a suite's name to the module that implements it. A suite module has a
docstring (its first line is the description ``--help`` lists), ``configure_parser(parser)``
adding its options to an ``argparse`` parser, and ``run(args, argv) -> int``. ``argv`` is what the
user typed after the suite's name, recorded in the JSON as the command; ``run`` validates what
``argparse`` cannot (ranges, combinations) and answers a bad value with a message naming the
option, the value and the rule, and exit status 2. Keep a suite module's heavy imports (torch,
Lightning) inside its functions: ``--help`` imports every suite module.

:mod:`~lightning_pdist.bench.netns` (emulated networks), :mod:`~lightning_pdist.bench.worker`
(one rank of a training run) and :mod:`~lightning_pdist.bench.report` (JSON, tables) are shared.
"""

SUITES: dict[str, str] = {
    "averaging": "lightning_pdist.bench.averaging",
    "sign": "lightning_pdist.bench.sign",
    "ps_sharding": "lightning_pdist.bench.ps_sharding",
    "pipeline": "lightning_pdist.bench.pipeline",
    "tensor_parallel": "lightning_pdist.bench.tensor_parallel",
    "bytes": "lightning_pdist.bench.bytes",
}

__all__ = ["SUITES"]
