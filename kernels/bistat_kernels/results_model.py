"""The numbers of ``kernels/RESULTS.md``, from the recorded JSON: one frozen model per section.

Every ratio, geometric mean, sum and pass count on the page is computed in this module's parts;
the template (``templates/RESULTS.md.j2``) only words and formats these fields. Pure: the builders
take the loaded JSON documents (dicts) and return models; :mod:`bistat_kernels.make_results` loads
the files and renders. Needs only the standard library.

This module names the parts, each a module of its own, and exports every builder and model from
them (``make_results`` reads them through here):

- :mod:`bistat_kernels.results_common` -- what the sections share: the earlier goals' targets,
  the models' layer counts (``LAYERS``), :func:`geomean`, :class:`Provenance`.
- :mod:`bistat_kernels.results_status` -- the status: the goal (:func:`goal`) and each
  artefact's GPU and command (:func:`status`).
- :mod:`bistat_kernels.results_bench` -- the bench: per row, per model, per decode step, the
  roofline and the host cost (:func:`bench`), and the earlier runs (:func:`history`).
- :mod:`bistat_kernels.results_table` -- the table and how it was made: its entries and buckets
  (:func:`table`), the fused split-K comparison (:func:`fused`), the sweep timing check
  (:func:`sweep_timing`).
- :mod:`bistat_kernels.results_gates` -- the gates: the probe (:func:`probe`) and the kernel
  checks on the GPU (:func:`check`, :func:`check_configs`).
- :mod:`bistat_kernels.results_vllm` -- the tuned GEMM inside compiled vLLM: the decode profile
  (:func:`profile`) and bistat's probe of the plugin (:func:`plugin_probe`).
"""

from __future__ import annotations

from bistat_kernels.results_bench import (Bench, BenchRow, EarlierRun, History, Host, HostRow,
                                          ModelGeomean, Roofline, RooflineRow, StepSum, VllmColumn,
                                          bench, history)
from bistat_kernels.results_common import (DECODE_LAYERS, GOAL_DECODE, GOAL_OVERALL, LAYERS,
                                           SPEEDUP_GOAL, Provenance, geomean, provenance)
from bistat_kernels.results_gates import (Check, CheckConfigs, CompiledCheck, Probe, ProbeRow,
                                          check, check_configs, probe)
from bistat_kernels.results_status import (ArtefactRow, Goal, OtherGpu, Status, artefact_row, goal,
                                           status)
from bistat_kernels.results_table import (BeforeFix, BucketCell, Fused, FusedRow, Launch,
                                          SweepShape, SweepTiming, Table, TableEntry, Variant,
                                          fused, launch, sweep_timing, table, variant)
from bistat_kernels.results_vllm import (KERNEL_NAME_WIDTH, PROFILE_CATEGORIES,
                                         VLLM_COMPILATION_MODES, GraphRow, OpLaunch, OpLaunches,
                                         PluginProbe, PluginRow, ProbeArm, ProbeModel, ProbeTrial,
                                         Profile, ProfileArm, ProfileComparison, Sidecar,
                                         TopKernel, beyond_graphs, gemm_kind, largest_capture_size,
                                         layer_names, model_layers, plugin_probe, profile)

__all__ = [
    "ArtefactRow",
    "BeforeFix",
    "Bench",
    "BenchRow",
    "BucketCell",
    "Check",
    "CheckConfigs",
    "CompiledCheck",
    "DECODE_LAYERS",
    "EarlierRun",
    "Fused",
    "FusedRow",
    "GOAL_DECODE",
    "GOAL_OVERALL",
    "Goal",
    "GraphRow",
    "History",
    "Host",
    "HostRow",
    "KERNEL_NAME_WIDTH",
    "LAYERS",
    "Launch",
    "ModelGeomean",
    "OpLaunch",
    "OpLaunches",
    "OtherGpu",
    "PROFILE_CATEGORIES",
    "PluginProbe",
    "PluginRow",
    "Probe",
    "ProbeArm",
    "ProbeModel",
    "ProbeRow",
    "ProbeTrial",
    "Profile",
    "ProfileArm",
    "ProfileComparison",
    "Provenance",
    "Roofline",
    "RooflineRow",
    "SPEEDUP_GOAL",
    "Sidecar",
    "Status",
    "StepSum",
    "SweepShape",
    "SweepTiming",
    "Table",
    "TableEntry",
    "TopKernel",
    "VLLM_COMPILATION_MODES",
    "Variant",
    "VllmColumn",
    "artefact_row",
    "bench",
    "beyond_graphs",
    "check",
    "check_configs",
    "fused",
    "gemm_kind",
    "geomean",
    "goal",
    "history",
    "largest_capture_size",
    "launch",
    "layer_names",
    "model_layers",
    "plugin_probe",
    "probe",
    "profile",
    "provenance",
    "status",
    "sweep_timing",
    "table",
    "variant",
]
