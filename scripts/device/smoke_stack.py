"""Device side (install.sh, VLLM_PAYLOAD=latest; from ../shared/device-latest/smoke.py): the carried stack imports and computes. Prints versions, where each module and CUDA
library was loaded from, a bf16 GEMM on the GPU against fp32, a Triton kernel, FA2/FA3 availability."""
import os, re, sys, time, json, subprocess
t0 = time.time()
import torch, triton, triton.language as tl
import vllm
maps = open("/proc/self/maps").read()
libs = sorted(set(re.findall(r"(/\S+/lib(?:nccl|cudnn|cublas|cublasLt|cudart|cusparseLt|nvshmem_host|nvrtc)\.so[^\s]*)", maps)))
info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "vllm": vllm.__version__, "torch_file": torch.__file__,
        "triton_file": triton.__file__, "vllm_file": vllm.__file__, "cuda_libs": libs,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "cudnn": torch.backends.cudnn.version(),
        "import_s": round(time.time() - t0, 1)}
import torchvision, torchaudio, transformers, numpy
info.update(torchvision=torchvision.__version__, torchaudio=torchaudio.__version__,
            transformers=transformers.__version__, numpy=numpy.__version__)
dev = torch.cuda.get_device_name(0); cap = torch.cuda.get_device_capability(0)
x = torch.randn(2, 2, device="cuda"); y = x @ x.T
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
c = (a @ b).float(); ref = a.float() @ b.float()
rel = ((c - ref).abs().max() / ref.abs().max()).item()

@triton.jit
def _add(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m), mask=m)

u = torch.randn(100000, device="cuda"); v = torch.randn(100000, device="cuda"); o = torch.empty_like(u)
_add[(triton.cdiv(u.numel(), 1024),)](u, v, o, u.numel(), BLOCK=1024)
torch.cuda.synchronize()
info.update(device=dev, capability=cap, tiny_matmul=y.tolist(), bf16_4096_rel_err=rel,
            triton_add_ok=bool(torch.equal(o, u + v)))
t1 = time.time()
from vllm import LLM, SamplingParams  # noqa
import vllm._C_stable_libtorch  # noqa
from vllm.vllm_flash_attn import flash_attn_interface as fa
info.update(llm_import_s=round(time.time() - t1, 1), FA2=[fa.FA2_AVAILABLE, fa.FA2_UNAVAILABLE_REASON],
            FA3=[fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON], FA4=[fa.FA4_AVAILABLE, str(fa.FA4_UNAVAILABLE_REASON)[:120]])
try:
    info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total,serial",
                                  "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except Exception as e:  # noqa
    info["gpu"] = repr(e)
info["total_s"] = round(time.time() - t0, 1)
print("[smoke]", json.dumps(info, indent=1))
out = os.environ.get("OUT")
if out:
    json.dump(info, open(os.path.join(out, "smoke.json"), "w"), indent=1)
