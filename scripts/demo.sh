#!/usr/bin/env bash
# The main job: DDP vs local SGD vs BMUF vs EASGD on the digits data with 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m lightning_pdist.demo --out results/demo "$@"
