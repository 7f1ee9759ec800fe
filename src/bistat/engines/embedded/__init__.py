"""bistat's embedded numpy LLaMA engine (float32, CPU): forward pass, KV cache, continuous
batching, sampling, and two GEMM modes — ``"blas"`` (batch-variant) and ``"invariant"``.

Modules: :mod:`~bistat.engines.embedded.ops` (operators and the GEMM modes),
:mod:`~bistat.engines.embedded.forward` (weights preparation and one engine step),
:mod:`~bistat.engines.embedded.kvcache`, :mod:`~bistat.engines.embedded.sampling`,
:mod:`~bistat.engines.embedded.scheduler` (continuous batching policy) and
:mod:`~bistat.engines.embedded.engine` (``EmbeddedEngine``, the loop thread), and
:mod:`~bistat.engines.embedded.adapter` (the engine adapter that runs it for ``bistat run``).
"""

from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.embedded.ops import GEMM_MODES

__all__ = ["EmbeddedEngine", "GEMM_MODES"]
