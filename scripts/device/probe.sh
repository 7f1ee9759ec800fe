#!/bin/bash
# `bistat probe` on every treatment arm of a registered study (needle alone vs among 32-128
# fillers, bitwise; the control arm is the negative control). The report goes into the study's
# run directory as probe.json (its finding's "Activation" section reads it; pack.sh brings it
# back with the run) and a copy under $OUT.
# Usage: bash scripts/device/probe.sh NAME [SECONDS]
set -uo pipefail
. "$(dirname "$0")/env.sh"
NAME=$1; BUDGET=${2:-540}
mkdir -p "$REPO/runs/$NAME"; REPORT="$REPO/runs/$NAME/probe.json"
timeout -s INT -k 60 "$BUDGET" bash -c '. scripts/device/env.sh; bistat probe "$1" --trials 3 --min-fillers 32 --max-fillers 128 --output "$2"' \
  _ "preregistrations/$NAME.json" "$REPORT"
rc=$?; gpu_clean; [ -f "$REPORT" ] && cp "$REPORT" "$OUT/$NAME.probe.json"; echo "[probe] $NAME rc=$rc"; exit $rc
