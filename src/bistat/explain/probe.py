"""The probe's former module path, kept so that code importing it keeps working.

The probe has one home per stage: :mod:`bistat.run.probe` runs and records it,
:mod:`bistat.analysis.probe_report` decides its outcome,
and :mod:`bistat.cli.cmd_probe` is ``bistat probe``;
:mod:`bistat.analysis.probe_needle` chooses a needle from a recorded run. Import from those.
"""

from __future__ import annotations

from bistat.analysis.probe_needle import NEEDLE_UNIT, NeedleError, needle_from_run
from bistat.analysis.probe_report import run_probe
from bistat.run.probe import (filler_tokens_of, fillers_in_flight, long_needle, probe_arm,
                              record_probe, shared_step_evidence)

__all__ = [
    "NEEDLE_UNIT",
    "NeedleError",
    "filler_tokens_of",
    "fillers_in_flight",
    "long_needle",
    "needle_from_run",
    "probe_arm",
    "record_probe",
    "run_probe",
    "shared_step_evidence",
]
