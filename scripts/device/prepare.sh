#!/bin/bash
# Once per fresh machine, after scripts/device/install.sh (same call or a later warm one; either
# payload: env.sh picks $SITE, /tmp/site for 0.25, /tmp/site-latest for latest):
#  1. install bistat's dist-info into $SITE, so vLLM finds the tuned-GEMM plugin through the
#     `vllm.general_plugins` entry point (bistat_kernels.vllm_plugin; a no-op unless
#     BISTAT_TUNED_GEMM=1);
#  2. write the models the studies name: the 8-layer Qwen3-8B-shaped model with N(0, 0.02) weights
#     (torch on the GPU, ~5.6 GB), the 36-layer Qwen3-8B and the 28-layer Qwen3-1.7B configurations
#     for load_format dummy.
# Usage: bash scripts/device/prepare.sh            (idempotent: skips what exists)
set -euo pipefail
. "$(dirname "$0")/env.sh"
t0=$(date +%s)
if ! python3 -c 'import importlib.metadata as m; m.version("bistat")' 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" "$REPO" 2>&1 \
    | grep -v "^WARNING: Target directory" | tail -3 || true
fi
python3 - <<'PY'
import importlib.metadata as m
eps = [e for e in m.entry_points(group="vllm.general_plugins") if e.name == "bistat_tuned_gemm"]
print("[prepare] tuned-GEMM plugin entry point:", eps[0].value if eps else "MISSING")
# which batch-invariant module this vLLM has (by feature, as the plugin finds it) and whether the
# plugin can hook it: a vLLM without the hook fails here, not at the tuned arm's engine start
from bistat_kernels import vllm_plugin
module, tried = vllm_plugin.find_hook()
print("[prepare] vLLM", vllm_plugin.vllm_version(), "hook:",
      f"{module.__name__}.{vllm_plugin.HOOK}" if module else "NONE: " + "; ".join(tried))
PY
# SKIP_SYNTH=1: only the config-only models (studies with load_format dummy), 45 s less
[ "${SKIP_SYNTH:-0}" = 1 ] || [ -f /tmp/model/qwen3-8b-synth-l8/model.safetensors ] || \
  bistat synth-model --arch qwen3-8b --layers 8 --init normal --std 0.02 --seed 0 --backend torch \
    --out /tmp/model/qwen3-8b-synth-l8
[ -f /tmp/model/qwen3-8b-config/config.json ] || \
  bistat synth-model --arch qwen3-8b --layers 36 --config-only --out /tmp/model/qwen3-8b-config
[ -f /tmp/model/qwen3-1.7b-config/config.json ] || \
  bistat synth-model --arch qwen3-1.7b --layers 28 --config-only --out /tmp/model/qwen3-1.7b-config
[ "${SKIP_SYNTH:-0}" = 1 ] || cp /tmp/model/qwen3-8b-synth-l8/bistat-synth.json "$OUT/qwen3-8b-synth-l8.bistat-synth.json"
echo "[prepare] done in $(( $(date +%s) - t0 )) s"
