#!/usr/bin/env bash
# What an installed user gets: build the wheel, install it into a new, empty venv (no checkout on the path), and
# from an empty folder list the shipped recipes and run one by name. First without extras (the library alone:
# imports, lists recipes, and the digits name the extra they need), then with the demo extra (scikit-learn).
# Usage: bash scripts/check_wheel.sh [WORKDIR]   (default: a new temporary folder; about 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=${1:-$(mktemp -d)}
mkdir -p "$work/run"
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraint=(-c "$PWD/constraints/cpu.txt")  # the CPU build of torch, as scripts/setup_env.sh
fi
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --quiet)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # this machine's pip config warns per missing index folder
quiet "${pip[@]}" wheel . --no-deps -w "$work/wheel"
wheel=$(ls "$work"/wheel/lightning_pdist-*.whl)
echo "== $wheel: $(unzip -l "$wheel" | grep -c 'lightning_pdist/recipes/.*\.yaml') recipes"

echo "== pip install $(basename "$wheel")  (no extras)"
quiet "${pip[@]}" install "${constraint[@]}" "$wheel"
cd "$work/run"
"$work/venv/bin/python" -c "import lightning_pdist, sys; assert 'sklearn' not in sys.modules and 'matplotlib' not in sys.modules; print('import lightning_pdist: OK, from', lightning_pdist.__file__)"
echo "== pdist recipes"
"$work/venv/bin/pdist" recipes
echo "== pdist fit --config bmuf  (no extras: the digits name their extra)"
if "$work/venv/bin/pdist" fit --config bmuf --trainer.max_steps=3 --trainer.logger=false >out.txt 2>&1; then
  echo "expected an ImportError without scikit-learn"; exit 1
fi
grep -o "DigitsDataModule.*lightning_pdist\[demo\]'" out.txt | head -1

echo "== pip install '$(basename "$wheel")[demo]'"
quiet "${pip[@]}" install "${constraint[@]}" "$wheel[demo]"
echo "== pdist fit --config bmuf --trainer.max_steps=3 --trainer.logger=false  (in $PWD)"
"$work/venv/bin/pdist" fit --config bmuf --trainer.max_steps=3 --trainer.logger=false >out.txt 2>&1 || { tail -40 out.txt; exit 1; }
tr '\r' '\n' <out.txt | grep -E "^pdist: |Trainer.fit. stopped"
ls -d runs/bmuf/checkpoints/*.ckpt
echo "== OK: $work"
