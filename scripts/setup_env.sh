#!/usr/bin/env bash
# Create ./.venv and install lightning_pdist with everything its demo and tests use.
# On a machine without an NVIDIA GPU, pip is held to the CPU build of torch (constraints/cpu.txt);
# the package metadata itself only asks for torch>=2.4. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraint=(-c constraints/cpu.txt)
fi
.venv/bin/python -m pip install --quiet "${constraint[@]}" -e ".[wandb,dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, lightning, lightning_pdist; print(f'lightning_pdist {lightning_pdist.__version__}: torch {torch.__version__}, lightning {lightning.__version__}')"
