"""Provenance of a measurement: which GPU, driver, software and command produced a number."""

from __future__ import annotations

import datetime as _dt
import shlex
import subprocess
import sys
from typing import Any


def _nvidia_smi(index: int) -> dict[str, str]:
    query = "name,uuid,driver_version,serial"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={query}", "--format=csv,noheader"],
            check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return {"nvidia_smi_error": f"{type(exc).__name__}: {exc}"}
    fields = [f.strip() for f in out.split(",")]
    return dict(zip(["gpu_name", "gpu_uuid", "driver", "gpu_serial"], fields))


def gpu_provenance(device_index: int = 0, command: list[str] | None = None) -> dict[str, Any]:
    """GPU name/UUID/serial/driver (nvidia-smi), torch/triton/CUDA versions, UTC date, command."""
    import torch
    import triton

    prov: dict[str, Any] = _nvidia_smi(device_index)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device_index)
        prov["torch_device_name"] = props.name
        prov["multiprocessors"] = props.multi_processor_count
        prov["compute_capability"] = f"{props.major}.{props.minor}"
    prov["torch"] = torch.__version__
    prov["cuda"] = torch.version.cuda
    prov["triton"] = triton.__version__
    prov["python"] = sys.version.split()[0]
    prov["date_utc"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    prov["command"] = shlex.join(command if command is not None else sys.argv)
    return prov
