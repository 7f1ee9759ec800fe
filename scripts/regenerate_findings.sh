#!/usr/bin/env bash
# Regenerate every committed finding from its recorded data with the real commands, then the
# index (findings/README.md) and the README's results at a glance. Run from the repository root
# with bistat installed (. .venv/bin/activate).
# Every analysis reads committed files alone (--no-run-ledger): a registration's run ledger
# (preregistrations/.NAME.runs) is this machine's, so a run recorded here again under a committed
# registration (scripts/main.sh runs quickstart-r2) never enters a committed finding.
# The tests check the results byte for byte (tests/test_h200_studies.py, tests/test_vllm_fixture.py,
# tests/test_quickstart_record.py, tests/test_report_golden.py, tests/test_findings_decided.py).
#
# A committed plot whose regenerated PNG differs only in how this machine's matplotlib / FreeType
# drew it keeps its committed bytes when KEEP_PLOTS=1 (the tests compare plots by shape only).
set -euo pipefail
cd "$(dirname "$0")/.."

# Committed runs alone: a file git does not track in a folder of runs read here (a run recorded or
# unpacked here) stops the script before anything is written. Stage what is to be committed first
# (git add), then regenerate.
untracked=$(git ls-files --others -- data tests/data examples)
if [ -n "$untracked" ]; then
  echo "regenerate_findings: files git does not track in the run folders; a committed finding" \
       "regenerates from committed files alone: move them out, or git add them first:" >&2
  echo "$untracked" | head -n 20 >&2
  exit 1
fi

# run directory -> the registrations analysed against (the first is the one it was recorded under;
# NAME-exploratory: the default rule applied after the data; NAME-hac: the rule that decides the
# study's cost with the interval that allows for serial correlation, after the data,
# scripts/hac_declarations.py)
analyze() {
  local run="$1" out="$2"; shift 2
  for reg in "$@"; do
    bistat analyze "$run" --registration "preregistrations/$reg.json" --out "$out" --no-run-ledger \
      > /dev/null
    echo "findings: $out/$reg.md"
  done
}

for run in h200-match-smollm2:"h200-match-smollm2 h200-match-smollm2-improved h200-match-smollm2-exploratory" \
           h200-cost-qwen3-8b-latency-b8:"h200-cost-qwen3-8b-latency-b8 h200-cost-qwen3-8b-latency-b8-exploratory h200-cost-qwen3-8b-latency-b8-hac" \
           h200-cost-qwen3-8b-throughput:"h200-cost-qwen3-8b-throughput h200-cost-qwen3-8b-throughput-goal h200-cost-qwen3-8b-throughput-exploratory h200-cost-qwen3-8b-throughput-hac" \
           h200-match-qwen3-8b-synth:"h200-match-qwen3-8b-synth h200-match-qwen3-8b-synth-improved h200-match-qwen3-8b-synth-exploratory h200-match-qwen3-8b-synth-hac" \
           h200-fa3-kv128-smollm2:"h200-fa3-kv128-smollm2 h200-fa3-kv128-smollm2-exploratory h200-fa3-kv128-smollm2-hac" \
           h200-match-smollm2-r2:"h200-match-smollm2-r2 h200-match-smollm2-r2-improved h200-match-smollm2-r2-exploratory h200-match-smollm2-r2-hac" \
           h200-cost-qwen3-8b-throughput-r2:"h200-cost-qwen3-8b-throughput-r2 h200-cost-qwen3-8b-throughput-r2-goal h200-cost-qwen3-8b-throughput-r2-exploratory h200-cost-qwen3-8b-throughput-r2-hac" \
           h200-cost-qwen3-8b-latency-b32:"h200-cost-qwen3-8b-latency-b32 h200-cost-qwen3-8b-latency-b32-exploratory h200-cost-qwen3-8b-latency-b32-hac" \
           h200-cost-qwen3-1_7b-latency-b8:"h200-cost-qwen3-1_7b-latency-b8 h200-cost-qwen3-1_7b-latency-b8-exploratory h200-cost-qwen3-1_7b-latency-b8-hac"; do
  # shellcheck disable=SC2086
  analyze "data/h200/${run%%:*}" findings/h200 ${run#*:}
done
analyze data/h200-tp/tp1-match findings/h200 tp1-match tp1-match-exploratory tp1-match-hac
# the newest vLLM
analyze data/h200-v033/h200-v033-match-smollm2 findings/h200 h200-v033-match-smollm2 h200-v033-match-smollm2-hac
# the tuned GEMM's end-to-end latency goal on vLLM 0.33.0 (tuned GEMM vs default, batch 8)
analyze data/h200-v033/h200-v033-i23-latency-qwen3-8b-b8 findings/h200 h200-v033-i23-latency-qwen3-8b-b8 h200-v033-i23-latency-qwen3-8b-b8-hac
analyze data/h200-v033/h200-v033-i23-latency-qwen3-17b-b8 findings/h200 h200-v033-i23-latency-qwen3-17b-b8 h200-v033-i23-latency-qwen3-17b-b8-hac
# the tuned GEMM's batch-8 latency goal on vLLM 0.34.0, with the tuned GEMM compiled as a third arm
analyze data/h200-v034/h200-v034-i23-latency-qwen3-8b-b8-compiled findings/h200 h200-v034-i23-latency-qwen3-8b-b8-compiled h200-v034-i23-latency-qwen3-8b-b8-compiled-hac
# the same three arms on vLLM 0.34.0 at batch 32 and on the Qwen3-1.7B shape at batch 8
analyze data/h200-v034/h200-v034-i23-latency-qwen3-8b-b32-compiled findings/h200 h200-v034-i23-latency-qwen3-8b-b32-compiled h200-v034-i23-latency-qwen3-8b-b32-compiled-hac
analyze data/h200-v034/h200-v034-i23-latency-qwen3-17b-b8-compiled findings/h200 h200-v034-i23-latency-qwen3-17b-b8-compiled h200-v034-i23-latency-qwen3-17b-b8-compiled-hac
# the tuned GEMM's workload-(i) goal on vLLM 0.34.0, one engine resident at a time: stopped after
# 11 of its 24 counted passes per arm (its NOTES.md), a pilot
analyze data/h200-v034/h200-v034-i23-throughput-qwen3-8b-serial-compiled findings/h200 h200-v034-i23-throughput-qwen3-8b-serial-compiled h200-v034-i23-throughput-qwen3-8b-serial-compiled-hac
# the same goal with both engines up together: stopped after 54 of its 66 counted passes per arm
# (its NOTES.md), a pilot
analyze data/h200-v034/h200-v034-i23-throughput-qwen3-8b-concurrent-compiled findings/h200 h200-v034-i23-throughput-qwen3-8b-concurrent-compiled h200-v034-i23-throughput-qwen3-8b-concurrent-compiled-hac
# its successor with the passes paired, all 66 passes (recorded elsewhere and imported: its NOTES.md)
analyze data/h200-v034/h200-v034-i23-throughput-qwen3-8b-paired findings/h200 h200-v034-i23-throughput-qwen3-8b-paired h200-v034-i23-throughput-qwen3-8b-paired-hac
# Study 1(a) on vLLM 0.34.0: the FA3 pin, TRITON_ATTN and bistat's whole plugin beside the shipped mode
analyze data/h200-v034/h200-v034-match-smollm2 findings/h200 h200-v034-match-smollm2 h200-v034-match-smollm2-hac
# S1, Study 1(a) on SGLang 0.5.23, on the H100 the device tool lent (the H100 twin)
analyze data/h100-sglang/h100-sglang-match-smollm2 findings/h100 h100-sglang-match-smollm2
# S2 (head size 128) and S3 (batch-8 latency) on SGLang 0.5.23, the H100 twins, on the H100 of the
# second session of 2026-12-07
analyze data/h100-sglang/h100-sglang-match-qwen3-8b-synth findings/h100 h100-sglang-match-qwen3-8b-synth
analyze data/h100-sglang/h100-sglang-latency-qwen3-8b-b8 findings/h100 h100-sglang-latency-qwen3-8b-b8
analyze data/h100-v034/h100-v034-match-smollm2 findings/h100 h100-v034-match-smollm2
# Study 1(a) on two releases, both runs under the default rule (r2's exploratory sibling)
bistat compare data/h200/h200-match-smollm2-r2 data/h200-v033/h200-v033-match-smollm2 \
  --earlier-registration preregistrations/h200-match-smollm2-r2-exploratory.json \
  --out findings/h200/compare-h200-match-smollm2-r2-v033.md > /dev/null
echo "findings: findings/h200/compare-h200-match-smollm2-r2-v033.md"
# Study 1(a) on two engines on one card type (H100 twins): SGLang 0.5.23 and vLLM 0.34.0, the arms
# that switch each engine's mode on FA3 and on Triton attention mapped to each other
bistat compare data/h100-sglang/h100-sglang-match-smollm2 data/h100-v034/h100-v034-match-smollm2 \
  --arm default=default --arm deterministic-fa3=batch-invariant \
  --arm deterministic-triton=bi-triton-attn \
  --out findings/h100/compare-h100-sglang-match-smollm2-v034.md > /dev/null
echo "findings: findings/h100/compare-h100-sglang-match-smollm2-v034.md"
analyze tests/data/vllm-h200/h200-fixture-smollm2 findings/h200 h200-fixture-smollm2 h200-fixture-smollm2-exploratory
analyze tests/data/vllm-h200/h200-fixture-triton-attn findings/h200 h200-fixture-triton-attn h200-fixture-triton-attn-exploratory
analyze examples/quickstart/quickstart-20261129T113548Z findings quickstart
for run in examples/quickstart/quickstart-r2-*; do
  [ -d "$run" ] && analyze "$run" findings quickstart-r2
done
bistat analyze examples/synthetic/run --registration examples/synthetic/synthetic-example.json \
  --out findings --no-run-ledger > /dev/null
echo "findings: findings/synthetic-example.md"

if [ "${KEEP_PLOTS:-0}" = 1 ]; then
  git diff --name-only -- 'findings/*.png' 'findings/h200/*.png' 'findings/h100/*.png' | xargs -r git checkout --
fi
bistat index findings --registrations preregistrations --reasons findings/not-run.toml --readme README.md
# the studies index (experiments/README.md): each study with its readings, twins, runs and findings
python scripts/studies_index.py
