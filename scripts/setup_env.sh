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
# Both install as pure-Python builds (DeepSpeed compiles no op at install or import).
# The install itself is uv's (`uv pip install`, ~15 s from a cold cache on 2 cores where pip took ~140 s of the
# suite's 15-minute budget); uv reads no pip.conf, so scripts/pip_settings_for_uv.py hands it pip's settings
# (wheel folders, extra indexes, global constraints), and `unsafe-best-match` keeps pip's rule of taking the best
# version across all indexes: both resolve to the same versions here.
start=$SECONDS
log=$(mktemp)
if ! .venv/bin/python -m pip install --quiet uv >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "setup: pip install uv failed" >&2; exit 1
fi
mapfile -t pip_settings < <(.venv/bin/python scripts/pip_settings_for_uv.py)
if ! .venv/bin/uv pip install --quiet --python .venv/bin/python --index-strategy unsafe-best-match \
    "${pip_settings[@]}" "${constraint[@]}" -e ".[wandb,dev,deepspeed,fairscale,ft,rl]" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "setup: uv pip install failed" >&2; exit 1
fi
rm -f "$log"
echo "setup: install took $((SECONDS - start)) s"
# The checks below import what the suite imports, and write its bytecode into .venv (once; uv compiles none at
# install, and this machine's environment sets PYTHONDONTWRITEBYTECODE=1, under which every process would compile
# torch and lightning again).
export -n PYTHONDONTWRITEBYTECODE
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -c "import torch, lightning, lightning_pdist; print(f'lightning_pdist {lightning_pdist.__version__}: torch {torch.__version__}, lightning {lightning.__version__}')"
.venv/bin/python -c "import deepspeed, fairscale, wandb; print(f'peers: deepspeed {deepspeed.__version__}, fairscale {fairscale.__version__}, wandb {wandb.__version__}')" 2>&1 | grep -v "real_accelerator"
# A speed probe, so that runs on hosts of different speed (or load) can be compared: what every fresh process of the
# suite pays before its first line of work (the suite starts ~160, ~80 of which import Lightning).
.venv/bin/python -c "
import os, resource, time
start = time.perf_counter()
import lightning_pdist
cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
print(f'setup: speed probe: importing lightning_pdist (torch, Lightning) took {time.perf_counter() - start:.1f} s, '
      f'{cpu:.1f} s of CPU; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs')"
