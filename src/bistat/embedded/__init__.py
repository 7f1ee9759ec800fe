"""bistat's embedded numpy LLaMA engine (float32, CPU): forward pass, KV cache, continuous
batching, sampling, and two GEMM modes — ``"blas"`` (batch-variant) and ``"invariant"``.

Modules: :mod:`~bistat.embedded.ops` (operators and the GEMM modes),
:mod:`~bistat.embedded.forward` (weights preparation and one engine step),
:mod:`~bistat.embedded.kvcache`, :mod:`~bistat.embedded.sampling`,
:mod:`~bistat.embedded.scheduler` (continuous batching policy) and
:mod:`~bistat.embedded.engine` (``EmbeddedEngine``, the loop thread).
"""

from bistat.embedded.engine import EmbeddedEngine
from bistat.embedded.ops import GEMM_MODES

__all__ = ["EmbeddedEngine", "GEMM_MODES"]
