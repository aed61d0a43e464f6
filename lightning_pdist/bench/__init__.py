"""Benchmarks: ``python -m lightning_pdist.bench <suite> --out DIR``, each suite writing JSON and a plot.

:data:`SUITES` maps a suite's name to the module that implements it. A suite module has a docstring (its first
line is the description ``--help`` lists), a frozen ``SuiteConfig`` dataclass whose fields are its options (each
field's docstring is its help; ``__post_init__`` checks the rules through :class:`~lightning_pdist.bench.cli.SuiteRules`
and names the option, the value and the rule), ``CLI`` (:class:`~lightning_pdist.bench.cli.SuiteCli`: the
``--quick`` and full plans) and ``run(config, out, argv) -> int`` (most suites: ``documented_run`` of their
``run_suite`` and ``docs_section``, :mod:`~lightning_pdist.bench.report`); ``argv`` is what the user typed after
the suite's name, recorded in the JSON as the command. Keep a suite module's heavy imports (torch, Lightning) inside
its functions: ``--help`` imports every suite module.

The harness is shared: :mod:`~lightning_pdist.bench.launch` (:class:`~lightning_pdist.bench.launch.SuiteRun`, the
skeleton of every ``run_suite``; one :class:`~lightning_pdist.bench.launch.Launcher` for loopback and emulated links,
whose ``run_each`` runs several specs in one launch, :func:`~lightning_pdist.bench.launch.emulated_network`, ``WorkerSpec`` (``SGDSpec``: the SGD workers' shared fields) and
``worker_main`` and ``bench_trainer`` for the worker modules), :mod:`~lightning_pdist.bench.netns` (emulated networks
and the one launcher, ``launch_ranks``), :mod:`~lightning_pdist.bench.cli` (the command line) and
:mod:`~lightning_pdist.bench.report` (JSON, tables, docs sections, figures, ``--keep-from``). The harness is a guest: it may import any
family, and nothing in the library imports it.
"""

SUITES: dict[str, str] = {
    "averaging": "lightning_pdist.bench.averaging",
    "sign": "lightning_pdist.bench.sign",
    "ps_sharding": "lightning_pdist.bench.ps_sharding",
    "pipeline": "lightning_pdist.bench.pipeline",
    "tensor_parallel": "lightning_pdist.bench.tensor_parallel",
    "bytes": "lightning_pdist.bench.bytes",
    "compression": "lightning_pdist.bench.compression",
    "diloco": "lightning_pdist.bench.diloco",
    "asynchronous": "lightning_pdist.bench.asynchronous",
    "parameter_server": "lightning_pdist.bench.parameter_server",
    "rl": "lightning_pdist.bench.rl",
}

__all__ = ["SUITES"]
