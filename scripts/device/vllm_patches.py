"""Device side (install.sh, VLLM_PAYLOAD=latest): the one change the carried vLLM 0.34.0 needs,
applied only to the exact stock file it was written for, and reported.

vLLM 0.34.0's ``kernel_warmup`` (``vllm/model_executor/warmup/kernel_warmup.py``, on every CUDA
engine) imports ``vllm.model_executor.warmup.minimax_m3_msa_warmup``, which imports the MiniMax-M3
model's CuTe-DSL kernels and so ``cutlass`` (``nvidia-cutlass-dsl``). The payload leaves
nvidia-cutlass-dsl out (92 MB of compiler libraries; as the 0.33.0 recipe did, where nothing on the
tested paths imported it), so every engine start failed (the H200 session of 2026-12-02,
GPU-771be303: "ModuleNotFoundError: No module named 'cutlass'"; carrying the three cutlass-dsl
wheels on ``PYTHONPATH`` did not import either: its ``.pth`` is not read there).

The stock ``minimax_m3_msa_warmup(worker)`` returns at once unless the model has a
``MiniMaxM3SparseAttention`` layer and the GPU is in the SM100 family: for any other model, and for
every model on Hopper, it does nothing. The replacement below is that function with the import
removed: it returns None. Behaviour on the models bistat runs is unchanged; a MiniMax-M3 model on
an SM100 GPU would lose its kernel prebuild (and still need cutlass-dsl to run).

Usage: ``python3 scripts/device/vllm_patches.py SITE`` (exit 0: applied, or already applied; 1: a
file is neither the stock one nor the patched one, and nothing was changed).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

#: path under SITE -> (sha256 of vLLM 0.34.0's stock file, the replacement text)
PATCHES = {
    "vllm/model_executor/warmup/minimax_m3_msa_warmup.py": (
        "9db63673c20d1e57b6b150ceb9277fdb9531c432611fabbb60e5793499f513ca",
        '"""bistat device patch (scripts/device/vllm_patches.py) of vLLM 0.34.0\'s module of\n'
        "the same name: the stock function returns at once unless the model has MiniMax-M3\n"
        "sparse attention and the GPU is SM100; its module imports cutlass-dsl, which the\n"
        'payload does not carry."""\n'
        "\n\n"
        "def minimax_m3_msa_warmup(worker):\n"
        "    return None\n"),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def apply(site: Path) -> list[str]:
    """Apply every patch under ``site``; the lines to print. Raises SystemExit(1), changing
    nothing, when a file is neither the stock one nor already patched."""
    plans, report = [], []
    for rel, (stock, text) in PATCHES.items():
        path = site / rel
        if not path.is_file():
            raise SystemExit(f"vllm_patches: {path} is missing: is {site} vLLM 0.34.0's install?")
        digest = _sha256(path)
        if path.read_text(encoding="utf-8") == text:
            report.append(f"vllm_patches: {rel} already patched")
        elif digest == stock:
            plans.append((path, text))
            report.append(f"vllm_patches: {rel} patched (stock sha256 {stock[:16]}...)")
        else:
            raise SystemExit(f"vllm_patches: {path} has sha256 {digest}, not vLLM 0.34.0's "
                             f"{stock}: nothing patched; check the file and this script's PATCHES")
    for path, text in plans:
        path.write_text(text, encoding="utf-8")
        for cached in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            cached.unlink()
    return report


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 scripts/device/vllm_patches.py SITE")
    print("\n".join(apply(Path(sys.argv[1]))))
