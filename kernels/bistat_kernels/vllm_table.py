"""vLLM's own batch-invariant GEMM table, read from the installed vLLM as a fallback.

vLLM 0.33.0 and later keep their M-bucketed launch configurations for the batch-invariant GEMM in
``vllm/model_executor/determinism/batch_invariant_configs.py``
(``_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS[family][(N, K)]``, family from the compute capability;
bfloat16 only; ``GROUP_SIZE_M`` 8 and ``min(NUM_SMS, tiles)`` programs, no split-K), and use a
fixed configuration for every other shape. Where bistat's table has no entry for a shape, or no
table resolves for the GPU, that shape is handed to vLLM's table rather than to a fixed
configuration, so that switching bistat's GEMM on is never slower than vLLM as shipped for it.

The file is located without importing vLLM (``importlib.util.find_spec`` only finds the package;
its ``__init__`` pulls in the whole engine) and read with ``ast``
(:func:`bistat_kernels.export_vllm.parse_vllm_source`): nothing of vLLM's is executed, and nothing
of vLLM's is copied into bistat. Each entry becomes a :class:`~bistat_kernels.tables.ShapeConfig`
with vLLM's launch (``split_k`` 1, ``group_m`` 8, one program per multiprocessor), which bistat's
kernel runs with the same tiles and the same K-reduction order per row (BLOCK_K shape-wide).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bistat_kernels.tables import BucketConfig, GemmTable, ShapeConfig

CONFIGS_MODULE = "vllm.model_executor.determinism.batch_invariant_configs"
CONFIGS_REL = Path("model_executor/determinism/batch_invariant_configs.py")
TABLE_VARIABLE = "_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS"
GROUP_M = 8  # vLLM's launch fixes GROUP_SIZE_M (batch_invariant_configs._get_matmul_config)


@dataclass(frozen=True)
class VllmTable:
    """vLLM's table for one architecture family, or why there is none.

    ``table`` is None when vLLM is not installed, has no tuned tables (before 0.33.0), or has no
    family for the GPU's compute capability; ``reason`` then says which.
    """

    table: GemmTable | None
    family: str | None
    version: str | None
    path: str | None
    reason: str = ""

    def label(self) -> str:
        """``"vLLM 0.34.0's hopper table"`` (the words logs and findings use)."""
        return f"vLLM {self.version or '(version unknown)'}'s {self.family} table"

    def describe(self) -> str:
        """One phrase: what serves a shape without a bistat entry."""
        if self.table is None:
            return f"vLLM's fixed configuration ({self.reason})"
        return (f"{self.label()} ({len(self.table.entries)} shapes), else vLLM's fixed "
                "configuration")


def configs_path() -> Path | None:
    """The installed vLLM's ``batch_invariant_configs.py``, without importing vLLM; None when
    vLLM is not installed or the file is absent (vLLM before 0.33.0)."""
    loaded = sys.modules.get(CONFIGS_MODULE)
    if loaded is not None and getattr(loaded, "__file__", None):
        return Path(loaded.__file__)
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = getattr(spec, "submodule_search_locations", None) if spec is not None else None
    if not locations:
        return None
    path = Path(next(iter(locations))) / CONFIGS_REL
    return path if path.is_file() else None


def _version_beside(path: Path) -> str | None:
    """vLLM's version from ``vllm/_version.py`` beside the package (vcs-versioning's file)."""
    version_file = path.parents[2] / "_version.py"
    try:
        text = version_file.read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    return match.group(1) if match else None


def read_vllm_table(path: Path | None, compute_capability: str | None,
                    version: str | None = None) -> VllmTable:
    """vLLM's entries for the family of ``compute_capability`` (``"9.0"``) from ``path``.

    Parameters
    ----------
    path : Path or None
        A ``batch_invariant_configs.py`` (:func:`configs_path` finds the installed one).
    compute_capability : str or None
        ``"major.minor"`` of the GPU; vLLM's ``_get_tuned_matmul_arch_family`` maps it to a family.
    version : str, optional
        vLLM's version (default: read from ``_version.py`` beside the package).

    Returns
    -------
    VllmTable
        With ``table`` None and the reason when there is nothing to use. A file that does not
        parse as vLLM's format is such a reason too (named), never a crash: the GEMM still runs
        on the fixed configuration.

    Examples
    --------
    >>> read_vllm_table(None, "9.0").describe()
    "vLLM's fixed configuration (vLLM is not installed)"
    """
    from bistat_kernels.export_vllm import ExportError, arch_family_for, parse_vllm_source

    if path is None:
        return VllmTable(None, None, version, None, "vLLM is not installed")
    version = version or _version_beside(path)
    family = arch_family_for(compute_capability) if compute_capability else None
    if family is None:
        return VllmTable(None, None, version, str(path),
                         f"vLLM {version} has no tuned table for compute capability "
                         f"{compute_capability or 'unknown'}")
    try:
        text = path.read_text(encoding="utf-8")
        parsed = parse_vllm_source(text, TABLE_VARIABLE)
    except (OSError, SyntaxError, ExportError) as exc:
        return VllmTable(None, family, version, str(path),
                         f"{path} could not be read as vLLM's table: {exc}")
    provenance = {"source": f"vLLM {version} {CONFIGS_REL.as_posix()} [{family!r}]",
                  "path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                  "compute_capability": compute_capability}
    entries = {}
    for (n, k), (block_k, buckets) in parsed.get(family, {}).items():
        entries[("bfloat16", n, k)] = ShapeConfig(
            "bfloat16", n, k, block_k, 1,
            tuple(BucketConfig(max_m, bm, bn, GROUP_M, warps, stages)
                  for max_m, (bm, bn, warps, stages) in buckets),
            provenance=provenance)
    label = f"vLLM {version or '(version unknown)'}'s {family} table"
    return VllmTable(GemmTable(label, entries, str(path)), family, version, str(path))
