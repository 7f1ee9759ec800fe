#!/bin/bash
# Re-tune the table's buckets on the lent GPU, then bench the new table twice more, independently
# (the re-tune's own bench chose its launches by their time on this GPU: optimistic). Meant to run
# in the background on the image's torch/triton while the same machine stages a vLLM payload, so
# that it costs little device time of its own:
#   bash kernels/device/retune_and_confirm.sh DIR MID_MIN MID_MAX SPLIT_SHAPES SPLIT_MIN BUDGET_S
# 1. every shape's buckets MID_MIN..MID_MAX (gpu_call.py buckets --min-m/--retune-max-m);
# 2. the buckets from SPLIT_MIN up of SPLIT_SHAPES (NxK,...: the split-K shapes, whose large and
#    prefill buckets now also try the flat fused form), starting from step 1's table;
#    then probe (both gates on every entry of the new table) and bench;
# 3. two more benches of the new table (confirm1, confirm2), each from its own folder.
# Everything goes under DIR (outside $OUT: the calls that follow copy it back); DIR/log.txt has
# every command's output and DIR/done is written last with the exit statuses.
set -uo pipefail
DIR=$1 MID_MIN=$2 MID_MAX=$3 SPLIT_SHAPES=$4 SPLIT_MIN=$5 BUDGET=$6
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$DIR"
# a private copy of the package: later calls may replace the checkout's files under it
rm -rf "$DIR/src" && mkdir -p "$DIR/src" && cp -r "$REPO/kernels" "$DIR/src/"
cd "$DIR/src"
export PYTHONPATH="$DIR/src/kernels"
slug=nvidia_h200
status=""
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
  python3 kernels/device/gpu_call.py buckets --min-m "$MID_MIN" --retune-max-m "$MID_MAX" \
    --out "$DIR/mid" --budget-s "$BUDGET"
  status="$status mid=$?"
  mkdir -p "$DIR/after"
  if [ -f "$DIR/mid/$slug.json" ]; then cp "$DIR/mid/$slug.json" "$DIR/after/"; fi
  python3 kernels/device/gpu_call.py buckets probe bench --shapes "$SPLIT_SHAPES" \
    --min-m "$SPLIT_MIN" --out "$DIR/after" --budget-s "$BUDGET"
  status="$status after=$?"
  for n in 1 2; do
    mkdir -p "$DIR/confirm$n"
    cp "$DIR/after/$slug.json" "$DIR/confirm$n/"
    python3 kernels/device/gpu_call.py bench --out "$DIR/confirm$n" --budget-s 60
    status="$status confirm$n=$?"
  done
  date -u +%FT%TZ
} > "$DIR/log.txt" 2>&1
echo "$status" > "$DIR/done"
