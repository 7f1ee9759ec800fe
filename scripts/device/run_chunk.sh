#!/bin/bash
# One chunk (< 10 minutes) of a registered study: start it, or resume it from the run directory
# carried back in. Ctrl-C (SIGINT from `timeout`) stops the run cleanly: engines stopped, data kept,
# the interrupted pass re-run on resume. The run directory goes back as one tarball under $OUT.
#
# Usage: bash scripts/device/run_chunk.sh NAME [SECONDS]
#   NAME     a registration preregistrations/NAME.json (committed, so it travels with the tree)
#   SECONDS  wall-clock budget of this chunk (default 480; keep the whole call under 600)
# On this machine, after the call: tar xzf <files_at>/NAME.run.tgz -C runs/ ; the next call carries
# "runs/NAME" and the same command resumes it. Exit: bistat run's code (0 done, 1 stopped early:
# resume, 12 untested).
set -uo pipefail
. "$(dirname "$0")/env.sh"
NAME=$1; BUDGET=${2:-480}
REG="$REPO/preregistrations/$NAME.json"; RUN="$REPO/runs/$NAME"
[ -f "$REG" ] || { echo "run_chunk: $REG not found; register first (bistat register experiments/$NAME.toml)"; exit 1; }
mkdir -p "$REPO/runs"
if [ -f "$RUN/run.json" ]; then
  echo "[chunk] resuming $RUN"
  timeout -s INT -k 60 "$BUDGET" bash -c '. scripts/device/env.sh; bistat run --resume "$1" --no-progress' _ "$RUN"
else
  echo "[chunk] starting $RUN"
  timeout -s INT -k 60 "$BUDGET" bash -c '. scripts/device/env.sh; bistat run "$1" --run-dir "$2" --no-progress' _ "preregistrations/$NAME.json" "$RUN"
fi
rc=$?
gpu_clean
tar czf "$OUT/$NAME.run.tgz" -C "$REPO/runs" "$NAME"
echo "[chunk] $NAME rc=$rc; $(grep -c '"event": *"end"' "$RUN/schedule.jsonl" 2>/dev/null || echo 0) passes ended so far; $(du -sh "$OUT/$NAME.run.tgz" | cut -f1) back in $NAME.run.tgz"
exit $rc
