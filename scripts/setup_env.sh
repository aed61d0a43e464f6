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
# deepspeed and fairscale are the benchmarks' peers: the tests that compare against them run in CI, never skip.
# Both install as pure-Python builds (DeepSpeed compiles no op at install or import; ~40 s for both on 2 cores).
start=$SECONDS
log=$(mktemp)
if ! .venv/bin/python -m pip install --quiet "${constraint[@]}" -e ".[wandb,dev,deepspeed,fairscale,ft,rl]" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "setup: pip install failed" >&2; exit 1
fi
grep -v "^WARNING: Location" "$log" || true; rm -f "$log"
echo "setup: pip install took $((SECONDS - start)) s"
.venv/bin/python -c "import torch, lightning, lightning_pdist; print(f'lightning_pdist {lightning_pdist.__version__}: torch {torch.__version__}, lightning {lightning.__version__}')"
.venv/bin/python -c "import deepspeed, fairscale, wandb; print(f'peers: deepspeed {deepspeed.__version__}, fairscale {fairscale.__version__}, wandb {wandb.__version__}')" 2>&1 | grep -v "real_accelerator"
