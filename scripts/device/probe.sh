#!/bin/bash
# `bistat probe` on every treatment arm of a registered study (its default kv-sweep design: the
# needle prompt and needles of about 112-600 prompt tokens alone vs among 32-128 fillers that keep
# arriving while they decode, bitwise, a verdict per needle; the control arm is the negative
# control; ≈ 2 min per arm with SmolLM2, engine start included). The report goes into the study's
# run directory as probe.json (its finding's "Activation" section reads it; pack.sh brings it
# back with the run) and a copy under $OUT.
# Usage: bash scripts/device/probe.sh NAME [SECONDS]
set -uo pipefail
. "$(dirname "$0")/env.sh"
NAME=$1; BUDGET=${2:-540}
# The needle: the prompt the study's own run saw diverge first (`--needle-from`), when the run is
# there and something diverged in it; otherwise prompt 0 (`bistat probe` refuses --needle-from
# within seconds, before any engine starts, and the probe runs again without it).
mkdir -p "$REPO/runs/$NAME"; REPORT="$REPO/runs/$NAME/probe.json"; START=$(date +%s)
probe() {
  timeout -s INT -k 60 "$1" bash -c '. scripts/device/env.sh; bistat probe "$1" --trials 3 --min-fillers 32 --max-fillers 128 --output "$2" "${@:3}"' \
    _ "preregistrations/$NAME.json" "$REPORT" "${@:2}"
}
if [ -f "$REPO/runs/$NAME/run.json" ]; then probe "$BUDGET" --needle-from "$REPO/runs/$NAME"; rc=$?
else rc=1; fi
LEFT=$(( BUDGET - ($(date +%s) - START) ))
if [ "$rc" = 1 ] && [ ! -f "$REPORT" ] && [ $(( BUDGET - LEFT )) -lt 60 ]; then  # a refusal, not a failed probe
  probe "$LEFT"; rc=$?
fi
gpu_clean; [ -f "$REPORT" ] && cp "$REPORT" "$OUT/$NAME.probe.json"; echo "[probe] $NAME rc=$rc"; exit $rc
