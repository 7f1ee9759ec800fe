#!/bin/bash
# Device check of bistat's FlashAttention-3 pin (scripts/device/fa3_check.py says what
# each part does and expects), on the vLLM 0.33.0 install of shared/device-latest/README.md
# (its env.sh; ENV_SH to override). The FA3 kernel check and the engine arms run at once on the
# one GPU (0.2 of its memory and a 4 GiB KV cache per engine); each engine arm is its own process
# with its own compile cache. Estimated ≈ 3-3.5 min on an H200 with cold caches (the recipe's BI
# engine start 143 s, its five-trial needles ≈ 50 s per arm; TRIALS=3 saves ≈ 20 s), not measured.
# Usage: export OUT; bash scripts/device/fa3_check.sh        (ARMS="bi_fa3 bi_fa3_pin bi_triton")
set -u
ENV_SH=${ENV_SH:-.dev/latest/s/env.sh}
if [ -f "$ENV_SH" ]; then . "$ENV_SH"; else echo "no $ENV_SH: using this environment as it is"; fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader
[ -f "${MODEL:-/tmp/model/smollm2}/config.json" ] || { echo "no ${MODEL:-/tmp/model/smollm2}: install first"; exit 3; }
S=$(cd "$(dirname "$0")" && pwd); T0=$SECONDS
( timeout -k 10 120 python3 "$S/fa3_check.py" kernel "$OUT/fa3_kernel.json" > "$OUT/fa3_kernel.log" 2>&1
  echo "kernel rc=$? wall=$((SECONDS - T0)) s" ) &
for arm in ${ARMS:-bi_fa3 bi_fa3_pin bi_triton}; do
  ( export VLLM_CACHE_ROOT=/tmp/vc_fa3_$arm TORCHINDUCTOR_CACHE_DIR=/tmp/ind_fa3_$arm
    timeout -k 10 "${ARM_TIMEOUT:-400}" python3 "$S/fa3_check.py" "$arm" "$OUT/fa3_$arm.json" \
      > "$OUT/fa3_$arm.log" 2>&1
    echo "arm $arm rc=$? wall=$((SECONDS - T0)) s" ) &
  sleep 2
done
wait
type gpu_clean >/dev/null 2>&1 && gpu_clean
for f in "$OUT"/fa3_kernel.log "$OUT"/fa3_bi_*.log; do
  [ -f "$f" ] || continue; echo "==== $(basename "$f")"
  grep -E "KV [0-9]+:|RESULT|engine ready|bistat_kernels: FlashAttention-3 pin" "$f" | cut -c1-300 | awk '!seen[$0]++'
  grep -q RESULT "$f" || { echo "== FAILED, tail:"; tail -25 "$f" | cut -c1-300; }
done
echo "total wall $((SECONDS - T0)) s"
