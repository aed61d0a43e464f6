#!/usr/bin/env bash
# Install into ./.venv and run the whole test suite.
# Two pytest workers (pytest-xdist), one test file each at a time (--dist loadfile: a file's module fixtures, e.g.
# the recipes' shared launch and the conformance matrix's columns, run once). A serial run leaves about one of this
# machine's two cores idle: most tests wait on their ranks' gloo messages, sockets and deadlines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
