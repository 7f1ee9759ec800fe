#!/bin/bash
# Device side: run (or resume) a registered study in the background and watch it, without
# stopping it. Engines start once per run instead of once per 10-minute call, if the lent machine
# keeps background processes between calls (it keeps files in the repo copy while warm; check with
# `bash scripts/device/run_bg.sh --check`). Calls must come back to back: an idle machine is given
# back after 30 s.
#   bash scripts/device/run_bg.sh NAME [SECONDS]   start, or keep watching; SECONDS (default 540)
#                                                  is the whole call's time in this script: it
#                                                  watches SECONDS - SNAP_RESERVE_S (default 20),
#                                                  then snapshots. Exit 0 when the run has
#                                                  finished (its status line is printed), 3 while
#                                                  it is still running
#   WATCH_UNTIL=TEXT bash scripts/device/run_bg.sh NAME [SECONDS]
#                                                  the same, but the watch also ends as soon as
#                                                  the run's log has a line containing TEXT (a
#                                                  fixed string: "pass 1/" comes back once the
#                                                  first pass is recorded)
#   bash scripts/device/run_bg.sh --check          1st call: leave a marker process; 2nd: report it
#   bash scripts/device/run_bg.sh --stop NAME [GRACE]
#                                                  stop the run cleanly when the session's time
#                                                  runs out: SIGINT to `bistat run` (it records
#                                                  the pass in flight as interrupted and stops its
#                                                  engines), up to GRACE s (default 60), then the
#                                                  whole process group; its data stay in runs/NAME
#                                                  for pack.sh. Never `pkill -f` a pattern instead:
#                                                  it matches the call's own command line (2026-12-03).
#   bash scripts/device/run_bg.sh --resend NAME FIRST [N]
#                                                  parts FIRST.. of snapshot N (default the last)
#                                                  into $OUT again, 4 a call
# Every watching call, and --stop, ends with a snapshot of what the run recorded since the last
# one (snap.py: appended bytes of the JSONL tables, changed files whole; gzip -1, one thread, nice
# 19, beside the engines) as $OUT/NAME.snap-SSS.tgz.PP, 15 MiB parts, 4 a call, and .sha256;
# here, `python3 scripts/device/unsnap.py DEST DIRS...` rebuilds DEST/NAME from every call's files.
# A machine lost or a budget spent mid-run then costs only the passes since the last call (on
# 2026-12-03, fourth session, a study 83 passes in came back with nothing). Incremental, because
# a whole-run snapshot fails when it matters: on 2026-12-03 (fifth session) 1000 requests a pass
# recorded ~1 MB a pass compressed; after 96 passes the snapshot was 104 MB, over the 16 MiB a
# returned file may have, and its one-thread xz ran the call into its 600 s limit.
set -uo pipefail
. "$(dirname "$0")/env.sh"
if [ "${1:-}" = "--check" ]; then
  if [ -f /tmp/bg-marker.pid ] && kill -0 "$(cat /tmp/bg-marker.pid)" 2>/dev/null; then
    echo "[bg] background processes survive between calls (marker pid $(cat /tmp/bg-marker.pid) alive)"; exit 0
  elif [ -f /tmp/bg-marker.pid ]; then
    echo "[bg] background processes do NOT survive between calls: use run_chunk.sh"; exit 1
  fi
  setsid nohup sleep 3000 >/dev/null 2>&1 < /dev/null & echo $! > /tmp/bg-marker.pid
  echo "[bg] marker started (pid $(cat /tmp/bg-marker.pid)); call --check again"; exit 0
fi
if [ "${1:-}" = "--resend" ]; then
  exec python3 -E "$(dirname "$0")/snap.py" resend "$REPO/runs" "${2:?usage: run_bg.sh --resend NAME FIRST [N]}" \
    "$OUT" "${3:?usage: run_bg.sh --resend NAME FIRST [N]}" ${4:+"$4"}
fi
STOP=0
if [ "${1:-}" = "--stop" ]; then STOP=1; shift; fi
NAME=${1:?usage: run_bg.sh [--stop] NAME [SECONDS]}
REG="$REPO/preregistrations/$NAME.json"; RUN="$REPO/runs/$NAME"
# PROBE=1: the kv-sweep probe of the study's treatment arms (with its negative control) instead of
# the study, in the background like a run: a probe of several SGLang or vLLM arms outlasts one call
# (each arm starts its engine). Its files have their own names; PROBE_ARGS go to `bistat probe`
# (e.g. "--arm X --no-control", with PROBE_PART=X writing probe-X.json, which merges with
# probe.json). Each call returns the report so far and the log instead of a snapshot.
TAG=${PROBE:+.probe${PROBE_PART:+-$PROBE_PART}}
LOG="$REPO/runs/$NAME$TAG.log"; PIDF="$REPO/runs/$NAME$TAG.pid"; STATUS="$REPO/runs/$NAME$TAG.status"
REPORT="$RUN/probe${PROBE_PART:+-$PROBE_PART}.json"
proc_alive() {   # the wrapper's process is there (an exited one nobody reaps is a zombie,
  local pid; pid=$(cat "$PIDF" 2>/dev/null) || return 1   # which kill -0 still finds)
  kill -0 "$pid" 2>/dev/null && ! grep -qE '^[0-9]+ \(.*\) Z' "/proc/$pid/stat" 2>/dev/null
}
alive() { [ ! -s "$STATUS" ] && proc_alive; }   # the wrapper writes STATUS last
snapshot() {   # what runs/NAME recorded since the last snapshot, into $OUT (snap.py)
  [ -n "${OUT:-}" ] && [ -d "$RUN" ] || return 0
  if [ -n "${PROBE:-}" ]; then   # a probe: its report so far and its log
    cp "$LOG" "$OUT/" 2>/dev/null; [ -f "$REPORT" ] && cp "$REPORT" "$OUT/$NAME.$(basename "$REPORT")"
    return 0
  fi
  nice -n 19 python3 -E "$(dirname "$0")/snap.py" make "$REPO/runs" "$NAME" "$OUT" \
    || echo "[bg] snapshot of $NAME failed (the next one carries its data); the run goes on"
}
if [ "$STOP" = 1 ]; then
  GRACE=${2:-60}
  alive || { echo "[bg] $NAME is not running"; exit 0; }
  group=$(cat "$PIDF")                  # the wrapper started by setsid: its pid leads the group
  runs=$(pgrep -P "$group" || true)     # `bistat run` under it (the wrapper then writes STATUS)
  echo "[bg] stopping $NAME: SIGINT to bistat run (pid ${runs:-none}), up to ${GRACE} s"
  [ -n "$runs" ] && kill -INT $runs 2>/dev/null
  t0=$SECONDS
  while alive && [ $((SECONDS - t0)) -lt "$GRACE" ]; do sleep 1; done
  if alive; then
    echo "[bg] $NAME did not stop within ${GRACE} s: SIGTERM, then SIGKILL, to its process group"
    kill -TERM -- "-$group" 2>/dev/null; sleep 5; kill -KILL -- "-$group" 2>/dev/null
  fi
  t1=$SECONDS   # its exit, and its reaping where something reaps it (at most 5 s)
  while kill -0 "$group" 2>/dev/null && [ $((SECONDS - t1)) -lt 5 ]; do sleep 0.2; done
  gpu_clean
  tail -n 3 "$LOG" 2>/dev/null
  snapshot
  echo "[bg] $NAME stopped after $((SECONDS - t0)) s: $(cat "$STATUS" 2>/dev/null || echo 'no status (killed)'); its data are in runs/$NAME (pack.sh $NAME)"
  exit 0
fi
BUDGET=${2:-540}; WATCH=$((BUDGET - ${SNAP_RESERVE_S:-20}))   # bash's SECONDS: since this script began
[ -f "$REG" ] || { echo "run_bg: $REG not found"; exit 1; }
mkdir -p "$REPO/runs"
if ! alive; then
  if grep -q '"status": 0' "$STATUS" 2>/dev/null; then   # it ended between calls: what it
    echo "[bg] $NAME already finished"; tail -n 3 "$LOG"   # recorded since the last snapshot
    snapshot; exit 0                                       # comes back all the same
  fi
  rm -f "$STATUS"
  # Never a twin: a run of this repo copy left running without its pid file (session 5: the repo
  # copy's runs/ was wiped between calls) would otherwise get a second one writing into the same
  # path; a run recording under another copy's runs/ is not this one's. (A GPU held by other
  # processes is refused by `bistat run` itself; --allow-busy-gpu overrides.)
  others=$(pgrep -af "bistat.cli import main.*(run|--resume)" | grep -v "^$$ " \
           | grep -F -- " $REPO/runs/" || true)
  if [ -n "$others" ] && [ "${FORCE:-0}" != 1 ]; then
    echo "run_bg: not starting $NAME: a bistat run is alive (FORCE=1 starts anyway):"
    echo "$others"
    exit 1
  fi
  if [ -n "${PROBE:-}" ]; then   # the needle from the study's own run when it is there
    what=(probe "preregistrations/$NAME.json" --trials 3 --min-fillers 32 --max-fillers 128
          --output "$REPORT" ${PROBE_ARGS:-})
    [ -f "$RUN/run.json" ] && what+=(--needle-from "$RUN"); mkdir -p "$RUN"
    echo "[bg] probing $NAME: bistat ${what[*]}"
  elif [ -f "$RUN/run.json" ]; then what=(run --resume "$RUN" --no-progress); echo "[bg] resuming $RUN"
  else what=(run "preregistrations/$NAME.json" --run-dir "$RUN" --no-progress); echo "[bg] starting $RUN"; fi
  setsid nohup bash -c '. scripts/device/env.sh; bistat "$@"; rc=$?; gpu_clean
    echo "{\"status\": $rc}" > "'"$STATUS"'"' _ "${what[@]}" >> "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDF"
fi
until_seen() { [ -n "${WATCH_UNTIL:-}" ] && grep -qF -- "$WATCH_UNTIL" "$LOG" 2>/dev/null; }
seen=0
while alive && [ "$SECONDS" -lt "$WATCH" ] && ! until_seen; do
  n=$(wc -l < "$LOG"); [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" "$LOG"; seen=$n; }
  left=$((WATCH - SECONDS))
  if [ -n "${WATCH_UNTIL:-}" ]; then sleep 0.2      # the text is looked for five times a second
  elif [ "$left" -gt 0 ]; then sleep $((left < 5 ? left : 5)); fi
done
n=$(wc -l < "$LOG"); [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" "$LOG"
snapshot
if alive; then echo "[bg] $NAME still running after this call's ${BUDGET} s; call again at once"; exit 3; fi
echo "[bg] $NAME finished: $(cat "$STATUS" 2>/dev/null || echo 'no status (killed?)')"; exit 0
