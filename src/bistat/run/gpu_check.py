"""The busy-GPU check before a run starts engines on this machine's GPU: what else holds it
(:func:`busy_gpu`), the refusal unless allowed (:func:`check_gpu`, :class:`GpuBusyError`), and
what a run allowed anyway records (a ``gpu_busy`` event, which its finding lists as a deviation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bistat.engines.registry import capabilities
from bistat.run.progress import Reporter
from bistat.store.format import utc_now
from bistat.store.writer import RunWriter

if TYPE_CHECKING:  # pragma: no cover
    from bistat.declare.experiment import Experiment


class GpuBusyError(RuntimeError):
    """Other processes hold the GPU a run would start its engines on (see :func:`check_gpu`).

    ``detail`` names them, as recorded in a ``gpu_busy`` event when the run is allowed anyway.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(self.explain("allow_busy_gpu=True"))

    def explain(self, override: str) -> str:
        """The refusal in words, naming ``override`` as the way to run anyway (the CLI says
        ``--allow-busy-gpu``)."""
        return (f"other processes hold the GPU: {self.detail}. They would share its memory and "
                f"time with the engines this run starts (and a leftover run's engines are among "
                f"them). Stop them, or record the run anyway with {override} (its finding will "
                f"list this as a deviation)")


def busy_gpu(experiment: "Experiment") -> str | None:
    """What else holds this machine's GPU, in words, when ``experiment`` starts its engines on it
    (its kind's ``capabilities.local_gpu``); None: nothing there, not a local GPU run, or no ``nvidia-smi`` to
    tell (:func:`bistat.run.fingerprint.gpu_processes`)."""
    from bistat.run import fingerprint
    if not capabilities(getattr(experiment.engine, "kind", "")).local_gpu:
        return None
    procs = fingerprint.gpu_processes() or []
    if not procs:
        return None
    return "; ".join(f"pid {p['pid']} {p['name'] or '?'} ({p['used_memory_mib']} MiB on "
                     f"{p['gpu_uuid'] or '?'})" for p in procs)


def check_gpu(experiment: "Experiment", *, allow_busy_gpu: bool = False) -> str | None:
    """Refuse a run that starts vLLM engines while other processes hold the GPU (they share its
    memory and its time, and a leftover run's engines would outlive the check), unless allowed.

    Returns
    -------
    str or None
        What else held the GPU (:func:`busy_gpu`) when it was allowed, for the run's records;
        None when nothing was there.

    Raises
    ------
    GpuBusyError
        Other processes hold the GPU and ``allow_busy_gpu`` is false.
    """
    detail = busy_gpu(experiment)
    if detail and not allow_busy_gpu:
        raise GpuBusyError(detail)
    return detail


def _gpu_busy_to_record(experiment: "Experiment", gpu_busy: str | None, allow_busy_gpu: bool,
                        reporter: Reporter) -> str | None:
    """The ``gpu_busy`` detail a run records: the caller's, where it checked the GPU itself and
    allowed what it found, else :func:`check_gpu`'s (which refuses unless allowed)."""
    if gpu_busy:
        return gpu_busy
    found = check_gpu(experiment, allow_busy_gpu=allow_busy_gpu)
    if found:
        reporter.message(f"warning: other processes hold the GPU: {found}; recorded (allowed)")
    return found


def _record_gpu_busy(writer: RunWriter, detail: str | None) -> None:
    if detail:
        writer.append("events", {"arm": "*", "event": "gpu_busy", "time_utc": utc_now(),
                                 "detail": detail})
