#!/bin/bash
# Bench two GEMM tables on one GPU, interleaved, ROUNDS times each: a before/after comparison that
# counts (same node, minutes apart, the same command), on the image's torch/triton:
#   bash kernels/device/bench_tables.sh DIR ROUNDS TABLE_A TABLE_B
# Round i benches TABLE_A into DIR/a<i>/ and then TABLE_B into DIR/b<i>/ (each table copied into
# its folder first, where gpu_call.py's bench reads it). DIR/summary.txt lists every run's
# geometric means (tuned / torch.mm: the goal set, and M <= 32), one line per run, in run order.
# E.g. the k11 table against the committed one:
#   git show 6c5f5a8:kernels/bistat_kernels/tables/nvidia_h200.json > .dev/k11.json   (here)
#   bash kernels/device/bench_tables.sh $OUT/k13 2 .dev/k11.json kernels/bistat_kernels/tables/nvidia_h200.json
# BENCH_ARGS (optional) goes to every bench, word-split: e.g. BENCH_ARGS="--bench-shapes
# 151936x4096" (one shape), "--reverse" (the shapes in reverse order), "--empty-cache"
# (torch.cuda.empty_cache() before each shape); summary.txt ends each line with it.
set -euo pipefail
DIR=$1 ROUNDS=$2 A=$3 B=$4
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$REPO/kernels${PYTHONPATH:+:$PYTHONPATH}"
slug=nvidia_h200
mkdir -p "$DIR"
: > "$DIR/summary.txt"
for i in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    table=$A; [ "$side" = b ] && table=$B
    out="$DIR/$side$i"
    mkdir -p "$out"
    cp "$table" "$out/$slug.json"
    # shellcheck disable=SC2086
    python3 "$REPO/kernels/device/gpu_call.py" bench --out "$out" --budget-s 60 ${BENCH_ARGS:-}
    python3 - "$out/bench_$slug.json" "$side$i" "$table" "${BENCH_ARGS:-}" >> "$DIR/summary.txt" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
s = doc["summary"]
print(f"{sys.argv[2]} {s['geomean_tuned_over_mm']:.4f} {s['decode_geomean_tuned_over_mm']:.4f} "
      f"{doc['provenance']['gpu_uuid']} {doc['provenance']['date_utc']} {sys.argv[3]}"
      + (f" {sys.argv[4]}" if sys.argv[4] else ""))
EOF
  done
done
cat "$DIR/summary.txt"
