#!/bin/bash
# First command on an nvidia-h200-x2 machine: two GPUs visible, NCCL all-reduce works with
# multicast off, before anything long runs. Then: stage/install as usual, prepare.sh, and
# run_bg.sh tp1-match, then run_bg.sh tp2-match, on the same host (≈ 6 min each: two engines, 10
# passes; scripts/device/README.md).
set -uo pipefail
. "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv
python3 - <<'PY'
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
assert os.environ["NCCL_NVLS_ENABLE"] == "0"
def work(rank):
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=rank, world_size=2)
    torch.cuda.set_device(rank); x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x); assert x.tolist() == [3.0] * 4, x; dist.destroy_process_group()
print("gpus:", torch.cuda.device_count()); mp.spawn(work, nprocs=2); print("all-reduce ok")
PY
