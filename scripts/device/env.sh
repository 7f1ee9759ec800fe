#!/bin/bash
# Sourced by every script here. The environment every bistat and vLLM process needs on the lent H200,
# run from the repo root, for either payload (VLLM_PAYLOAD; install.sh remembers the one it installed
# in /tmp/vllm-payload, so later calls need not say it again):
#   0.25    vLLM 0.25.0 on the image's torch 2.11 (install.sh into /tmp/site)
#   latest  vLLM 0.34.0 (the newest release) with torch 2.14.0, triton 3.8.0, torchvision 0.29.0 and
#           NCCL 2.30.7 carried (install.sh into /tmp/site-latest; ../shared/device-latest/README.md is
#           the tested recipe for 0.33.0, whose torch stack 0.34.0 pins unchanged)
#   0.33    vLLM 0.33.0 on the same carried stack, into the same /tmp/site-latest
#   sglang  SGLang 0.5.23 with torch 2.14.1 carried (wheels-sglang-0.5.23.txt), into /tmp/site-latest
# NVLink multicast stays off in every process (KINDS.md): NCCL, PyTorch symmetric memory, NVSHMEM.
export REPO=${REPO:-$(pwd)}
export VLLM_PAYLOAD=${VLLM_PAYLOAD:-${PAYLOAD:-$(cat /tmp/vllm-payload 2>/dev/null || echo 0.25)}}
case "$VLLM_PAYLOAD" in
  latest|0.33|sglang) export SITE=${SITE_LATEST:-/tmp/site-latest}
          # torch 2.14 is built against cuDNN 9.24, the image has 9.19 (all needed symbols present)
          export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 ;;
  0.25)   export SITE=/tmp/site ;;
  *) echo "env.sh: VLLM_PAYLOAD=$VLLM_PAYLOAD; expected 0.25, 0.33, latest or sglang" >&2; return 1 2>/dev/null || exit 1 ;;
esac
# SGLang compiles kernels at first use (load_jit("fused_rope") on every Llama/Qwen rotary call,
# FlashInfer's JIT, DeepGEMM in the deterministic arms): nvcc and ninja are on the image, and the
# CUDA toolkit's location is set here rather than guessed by each of them
if [ "$VLLM_PAYLOAD" = sglang ]; then
  _nvcc=$(command -v nvcc 2>/dev/null || true)
  for _c in "${CUDA_HOME:-}" /usr/local/cuda "${_nvcc:+$(dirname "$(dirname "$(readlink -f "$_nvcc")")")}"; do
    if [ -n "$_c" ] && [ -x "$_c/bin/nvcc" ]; then export CUDA_HOME=$_c; break; fi; done
  [ -n "${CUDA_HOME:-}" ] && export CUDA_PATH=$CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
  unset _nvcc _c
fi
# the carried torch (latest) shadows the image's: $SITE comes before the image's site-packages
export PYTHONPATH="$REPO/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0      # flashinfer is not carried; the sampler would import it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# this machine reaches no package index: runs record "not checked" instead of waiting on DNS; the
# newest release is the one sealed at registration (bistat.declare.releases)
export BISTAT_PACKAGE_INDEX=off
# the copy's .git can be an earlier commit's: runs record the commit travel.sh says travelled
if [ -f "$REPO/scripts/device/SOURCE_COMMIT" ]; then
  export BISTAT_SOURCE_COMMIT="$(cat "$REPO/scripts/device/SOURCE_COMMIT")"; fi
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# SIGINT back to Python's handler first: a background job of a non-interactive shell (run_bg.sh's
# `setsid nohup ... &`) starts with SIGINT ignored, and Python then installs none, so a SIGINT to
# the run did nothing (2026-12-03); `bistat run` handles both SIGINT and SIGTERM itself too
bistat() { python3 -c 'import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
from bistat.cli import main; main()' "$@"; }
# Kill GPU processes this job left behind (by pid, never by name).
gpu_clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  echo "gpu_clean: killing leftover GPU pid $p"; kill -9 "$p" 2>/dev/null; done; }
