#!/bin/bash
# `bistat probe` on every treatment arm of a registered study (needle alone vs among 32-128
# fillers, bitwise; the control arm is the negative control). Report JSON under $OUT.
# Usage: bash scripts/device/probe.sh NAME [SECONDS]
set -uo pipefail
. "$(dirname "$0")/env.sh"
NAME=$1; BUDGET=${2:-540}
timeout -s INT -k 60 "$BUDGET" bash -c '. scripts/device/env.sh; bistat probe "$1" --trials 3 --min-fillers 32 --max-fillers 128 --output "$2"' \
  _ "$REPO/preregistrations/$NAME.json" "$OUT/$NAME.probe.json"
rc=$?; gpu_clean; echo "[probe] $NAME rc=$rc"; exit $rc
