#!/usr/bin/env bash
# Install into ./.venv and run the whole test suite.
# Two pytest workers (pytest-xdist), one work unit each at a time (--dist loadscope: a test file is one unit, so its
# module fixtures, e.g. the recipes' shared launch, run once; each conformance column is a class, one unit; see
# tests/conftest.py). A serial run leaves about one of this
# machine's two cores idle: most tests wait on their ranks' gloo messages, sockets and deadlines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Compiled bytecode is kept between processes (this machine's environment sets PYTHONDONTWRITEBYTECODE=1): the suite
# starts a few hundred Python processes, each of which would otherwise compile the package again, and each pytest
# worker would rewrite every test module's asserts again.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -n 2 --dist loadscope "$@"
