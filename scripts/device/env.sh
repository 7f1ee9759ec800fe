#!/bin/bash
# Sourced by every script here. The environment every bistat and vLLM process needs on the lent H200
# (vLLM 0.25.0 installed into /tmp/site by ../shared/device/install.sh), run from the repo root.
# NVLink multicast stays off in every process (KINDS.md): NCCL, PyTorch symmetric memory, NVSHMEM.
export REPO=${REPO:-$(pwd)}
export PYTHONPATH="$REPO/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bistat() { python3 -c 'from bistat.cli import main; main()' "$@"; }
# Kill GPU processes this job left behind (by pid, never by name).
gpu_clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  echo "gpu_clean: killing leftover GPU pid $p"; kill -9 "$p" 2>/dev/null; done; }
