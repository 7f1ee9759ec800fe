"""Which GEMM table serves a GPU, and which table serves each weight shape on it.

The table, first that applies (:func:`resolve`):

1. ``$BISTAT_GEMM_TABLE``: a table file, or the name of a shipped table (``env``);
2. a table of the GPU's name among the user's tables (:func:`user_tables_dir`: what
   ``bistat kernels tune`` writes) (``user``);
3. a table of the GPU's name shipped with bistat (``name``);
4. a table measured on a GPU of the same compute capability and the same number of
   multiprocessors, the user's before the shipped ones, each in file-name order (``architecture``):
   the H200's table on an H100 (both sm_90 with 132 multiprocessors, one Hopper die; the launch
   parameters depend on the die and the SM count, the tile schedule on the SM count);
5. none (``none``).

A shape is served by that table's entry; without one (or without a table) by vLLM's own
batch-invariant table for the GPU's architecture family where the installed vLLM has one
(:mod:`bistat_kernels.vllm_table`), else by vLLM's fixed configuration
(:data:`bistat_kernels.tables.DEFAULT_CONFIGS`). :meth:`TableResolution.shape_source` says which.

Resolution reads files and the environment, so it runs once per process
(:func:`bistat_kernels.tables.resolve_device_table` keeps the result in a module-level value); the
launcher's lookup afterwards is a dict lookup and a scan over a short tuple, which torch.compile
can trace (FIELD-NOTES: no ``functools.lru_cache`` around a device lookup).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bistat_kernels import tables
from bistat_kernels.vllm_table import VllmTable, configs_path, read_vllm_table

#: a folder of user tables (``bistat kernels tune`` writes there); default under ``$BISTAT_HOME``
TABLE_DIR_ENV = "BISTAT_GEMM_TABLE_DIR"
HOWS = ("env", "user", "name", "architecture", "none")
#: the words the log, ``bistat doctor`` and a finding use for each way a table resolved
HOW_WORDS = {"env": f"named by {tables.TABLE_ENV}",
             "user": "this GPU's own, from `bistat kernels tune`",
             "name": "shipped for this GPU", "architecture": "by architecture", "none": "no table"}


@dataclass(frozen=True)
class DeviceFacts:
    """What resolution needs to know of a GPU: torch's name for it, its compute capability
    (``"9.0"``) and its number of multiprocessors. ``name`` None: no GPU (the Triton
    interpreter on the CPU)."""

    name: str | None
    compute_capability: str | None = None
    multiprocessors: int | None = None

    def architecture(self) -> str | None:
        """``'compute capability 9.0, 132 multiprocessors'``; None where either is unknown (no
        match by architecture is tried then)."""
        if self.compute_capability is None or self.multiprocessors is None:
            return None
        return (f"compute capability {self.compute_capability}, {self.multiprocessors} "
                "multiprocessors")

    def describe(self) -> str:
        """``'NVIDIA H100 80GB HBM3 (compute capability 9.0, 132 multiprocessors)'``."""
        if self.name is None:
            return "no GPU"
        arch = self.architecture()
        return self.name if arch is None else f"{self.name} ({arch})"


def cuda_device_facts(index: int = 0) -> DeviceFacts:
    """The facts of CUDA device ``index`` from torch (imported here, not at module level)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(props.name, f"{props.major}.{props.minor}", props.multi_processor_count)


def user_tables_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's GEMM tables: ``$BISTAT_GEMM_TABLE_DIR``, else ``gemm_tables`` in bistat's
    cache folder (``$BISTAT_HOME``, else ``$XDG_CACHE_HOME/bistat``, else ``~/.cache/bistat``:
    :func:`bistat.model.cache.cache_root` on Linux, where the CUDA GPUs are; this module needs
    the standard library only, inside vLLM's workers and on bare GPU images).

    >>> user_tables_dir({"BISTAT_HOME": "/data/b"}).as_posix()
    '/data/b/gemm_tables'
    """
    env = os.environ if environ is None else environ
    if env.get(TABLE_DIR_ENV):
        return Path(env[TABLE_DIR_ENV])
    if env.get("BISTAT_HOME"):
        return Path(env["BISTAT_HOME"]) / "gemm_tables"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "bistat" / "gemm_tables"
    return Path.home() / ".cache" / "bistat" / "gemm_tables"


@dataclass(frozen=True)
class TableResolution:
    """The outcome of :func:`resolve` for one GPU (see the module docstring)."""

    device: DeviceFacts
    how: str
    table: tables.GemmTable | None
    path: str | None
    vllm: VllmTable

    def table_text(self) -> str:
        """The table and how it was chosen, in one phrase (no newline)."""
        if self.table is None or self.path is None:
            if self.device.name is None:
                return "none (no GPU)"
            arch = self.device.architecture()
            return (f"none (no table for {self.device.name}"
                    + ("" if arch is None else f" or for its {arch}")
                    + "; make one with `bistat kernels tune`)")
        name = Path(self.path).name
        if self.how == "architecture":
            return (f"{name}, by architecture (no table for {self.device.name}; "
                    f"{self.table.device_name}'s was measured with the same compute capability "
                    f"{self.device.compute_capability} and {self.device.multiprocessors} "
                    "multiprocessors)")
        if self.how == "user":
            return f"{name}, {HOW_WORDS['user']} ({self.path})"
        if self.how == "env":
            return f"{name}, {HOW_WORDS['env']}, measured on {self.table.device_name}"
        return f"{name}, {HOW_WORDS['name']}"

    def describe(self) -> str:
        """The one line the log, ``bistat doctor`` and a finding's environment give."""
        return (f"{self.table_text()}; shapes without an entry: {self.vllm.describe()}")

    def shape_source(self, dtype: str, n: int, k: int, *, vllm_kernel: bool = False) -> str:
        """Which table serves ``(dtype, N, K)``: ``'bistat table nvidia_h200.json'``,
        ``"vLLM 0.34.0's hopper table"`` or ``"vLLM's fixed configuration"``, followed by the
        kernel that runs it where that is vLLM's own (``vllm_kernel``: the plugin hands such
        shapes to vLLM's ``matmul_persistent``)."""
        if self.table is not None and self.table.lookup(dtype, n, k) is not None:
            return f"bistat table {Path(self.path or self.table.source).name}"
        kernel = ", on vLLM's own kernel" if vllm_kernel else ", on bistat's kernel"
        if self.vllm.table is not None and self.vllm.table.lookup(dtype, n, k) is not None:
            return self.vllm.label() + kernel
        return "vLLM's fixed configuration" + kernel

    def to_dict(self) -> dict[str, Any]:
        """JSON for ``bistat doctor --json`` and the bench and probe documents."""
        return {"device": self.device.name, "compute_capability": self.device.compute_capability,
                "multiprocessors": self.device.multiprocessors, "how": self.how,
                "table": self.path, "table_device": (self.table.device_name
                                                     if self.table is not None else None),
                "shapes": len(self.table.entries) if self.table is not None else 0,
                "vllm_table": self.vllm.path if self.vllm.table is not None else None,
                "vllm_family": self.vllm.family, "vllm_version": self.vllm.version,
                "vllm_shapes": (len(self.vllm.table.entries) if self.vllm.table is not None
                                else 0),
                "describe": self.describe()}


def _tables_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []


def _architecture(table: tables.GemmTable) -> tuple[str | None, int | None]:
    """(compute capability, multiprocessors) every entry's provenance agrees on; None where they
    disagree or do not say (such a table matches no other GPU by architecture)."""
    caps = {str(e.provenance.get("compute_capability")) for e in table.entries.values()}
    sms = {e.provenance.get("multiprocessors") for e in table.entries.values()}
    cap = caps.pop() if len(caps) == 1 else None
    sm = sms.pop() if len(sms) == 1 else None
    return (None if cap in (None, "None") else cap, sm if isinstance(sm, int) else None)


def resolve(device: DeviceFacts, environ: Mapping[str, str] | None = None,
            shipped_dir: Path | None = None, user_dir: Path | None = None,
            vllm_configs: Path | None | str = "installed") -> TableResolution:
    """Choose the table for ``device`` (the order is the module docstring's).

    Parameters
    ----------
    device : DeviceFacts
    environ : mapping, optional
        Where ``$BISTAT_GEMM_TABLE`` and the user folder's variables are read (default: the
        process's environment).
    shipped_dir, user_dir : Path
        The shipped tables (default :data:`bistat_kernels.tables.TABLES_DIR`) and the user's
        (default :func:`user_tables_dir`).
    vllm_configs : Path, None or "installed"
        vLLM's ``batch_invariant_configs.py`` (default: the installed vLLM's; None: none).

    Raises
    ------
    TableError
        A table file that breaks the schema, or ``$BISTAT_GEMM_TABLE`` naming nothing.
    """
    env = os.environ if environ is None else environ
    shipped_dir = tables.TABLES_DIR if shipped_dir is None else shipped_dir
    user_dir = user_tables_dir(env) if user_dir is None else user_dir
    configs = configs_path() if vllm_configs == "installed" else vllm_configs
    vllm = read_vllm_table(Path(configs) if configs is not None else None,
                           device.compute_capability)

    def done(how: str, path: Path | None, table: tables.GemmTable | None = None
             ) -> TableResolution:
        if path is not None and table is None:
            table = tables.load_table(path)
        return TableResolution(device, how, table, None if path is None else str(path), vllm)

    override = env.get(tables.TABLE_ENV)
    if override:
        return done("env", tables.override_path(override, shipped_dir))
    if device.name is not None:
        for how, folder in (("user", user_dir), ("name", shipped_dir)):
            path = tables.table_path_for(device.name, folder)
            if path.is_file():
                return done(how, path)
        if device.architecture() is not None:
            for path in _tables_in(user_dir) + _tables_in(shipped_dir):
                try:
                    table = tables.load_table(path)
                except tables.TableError:
                    continue  # not a table (a user's stray file): it matches nothing
                if _architecture(table) == (device.compute_capability, device.multiprocessors):
                    return done("architecture", path, table)
    return done("none", None)
