"""Engine metrics in Prometheus text format: vLLM's metric names, parsed into a ``MetricsSample``.

vLLM (and ``bistat serve``, which copies its names) exposes at ``/metrics``:

==================================== ======= ==============================================
sample name                          type    meaning
==================================== ======= ==============================================
``vllm:num_requests_running``        gauge   requests in the running batch
``vllm:num_requests_waiting``        gauge   requests queued, not yet scheduled
``vllm:num_preemptions_total``       counter requests preempted (KV cache full) so far
``vllm:generation_tokens_total``     counter output tokens generated so far
``vllm:prompt_tokens_total``         counter prompt tokens processed so far
==================================== ======= ==============================================

Each sample carries a ``model_name`` label (vLLM also adds ``engine``). A server may serve several
models or run several engine cores; the values of every label set that matches ``model_name``
(all label sets when ``model_name`` is None) are summed. Parsing uses ``prometheus_client``'s own
parser, never a hand-written one.

SGLang 0.5.23 (``--enable-metrics``; sglang/srt/observability/metrics_collector.py) names the same
quantities differently (:data:`SGLANG_SAMPLE_NAMES`, :func:`parse_sglang_metrics`):

============================================ ======= ==========================================
sample name                                  type    meaning
============================================ ======= ==========================================
``sglang:num_running_reqs``                  gauge   requests in the running batch
``sglang:num_queue_reqs``                    gauge   requests in the waiting queue
``sglang:num_retracted_requests_total``      counter requests retracted (KV cache full) so far:
                                                     SGLang's preemption
``sglang:generation_tokens_total``           counter output tokens generated so far
``sglang:prompt_tokens_total``               counter prompt tokens processed so far
============================================ ======= ==========================================

Its labels are ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` (the
token counters add ``is_streaming``); with priority scheduling the gauges carry the total under
``priority=""`` and a breakdown under ``priority="N"``, which is left out here (it would count
each request twice). SGLang updates its scheduler gauges at every prefill batch, once per
``--decode-log-interval`` decode steps (40 by default) and when it falls idle, not at every
scrape: a sample reads the last such update. Its token counters grow when a request finishes
(its one-token health checks are not counted; its start-up warm-up request is).

SGLang's retraction counter is labelled, so its series exists only from the first retraction on
(prometheus_client makes a labelled child at its first ``inc``: the scheduler's
``increment_retracted_reqs``), and in SGLang's multiprocess registry the whole family is absent
until then. :func:`parse_sglang_metrics` therefore reads the counter as 0 wherever the
scheduler's own gauges are in the answer and the counter is not.
"""

from __future__ import annotations

import dataclasses
import math

from prometheus_client.parser import text_string_to_metric_families

from bistat.engines.base import MetricsSample

#: MetricsSample field -> Prometheus sample name (counters carry their ``_total`` suffix).
VLLM_SAMPLE_NAMES: dict[str, str] = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_preemptions_total": "vllm:num_preemptions_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
}


#: MetricsSample field -> SGLang 0.5.23's Prometheus sample name (see the module docstring).
SGLANG_SAMPLE_NAMES: dict[str, str] = {
    "num_requests_running": "sglang:num_running_reqs",
    "num_requests_waiting": "sglang:num_queue_reqs",
    "num_preemptions_total": "sglang:num_retracted_requests_total",
    "generation_tokens_total": "sglang:generation_tokens_total",
    "prompt_tokens_total": "sglang:prompt_tokens_total",
}


class MetricsParseError(ValueError):
    """The text is not in Prometheus exposition format."""


def parse_vllm_metrics(
    text: str, *, t: float, model_name: str | None = None, source: str = "prometheus"
) -> MetricsSample:
    """Parse a Prometheus exposition into a ``MetricsSample`` with vLLM's metric names.

    Parameters
    ----------
    text : str
        The body of a ``GET /metrics`` answer.
    t : float
        Seconds since the pass started, stored as the sample's time.
    model_name : str or None
        Keep only samples whose ``model_name`` label equals this (samples without the label are
        kept). None keeps all.
    source : str
        Stored as ``MetricsSample.source``.

    Returns
    -------
    MetricsSample
        Values summed over matching label sets; a metric absent from ``text`` is NaN (not 0:
        absence is not the same as an idle engine).

    Raises
    ------
    MetricsParseError
        When ``prometheus_client`` cannot parse ``text``.

    Examples
    --------
    >>> s = parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 3.0\\n', t=1.0)
    >>> s.num_requests_running, math.isnan(s.num_requests_waiting)
    (3.0, True)
    """
    return parse_prometheus(text, VLLM_SAMPLE_NAMES, t=t, model_name=model_name, source=source)


def parse_sglang_metrics(
    text: str, *, t: float, model_name: str | None = None, source: str = "prometheus"
) -> MetricsSample:
    """:func:`parse_vllm_metrics` for SGLang's names (:data:`SGLANG_SAMPLE_NAMES`); a gauge's
    per-priority breakdown (``priority="N"``) is left out.

    No retraction yet reads 0, not NaN: ``sglang:num_retracted_requests_total`` is a labelled
    counter whose series SGLang 0.5.23 creates at the first retraction
    (sglang/srt/observability/metrics_collector.py, ``num_retracted_reqs_total``, incremented by
    the scheduler only when it retracts), and its multiprocess registry leaves the whole family
    out until then. Where the scheduler's running-requests gauge is in the answer (the scheduler
    is reporting) and the counter is not, the counter is 0. Read as NaN, a pass without a
    retraction could not be checked against ``max_preemptions = 0``, and a pass whose first
    retraction starts the series at k would show an increase of k - k = 0.

    Examples
    --------
    >>> s = parse_sglang_metrics('sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0\\n'
    ...                          'sglang:num_queue_reqs{model_name="m",priority="1"} 2.0\\n', t=0.5)
    >>> s.num_requests_running, math.isnan(s.num_requests_waiting), s.num_preemptions_total
    (7.0, True, 0.0)
    >>> math.isnan(parse_sglang_metrics('sglang:prompt_tokens_total 9.0\\n', t=0.0)
    ...            .num_preemptions_total)
    True
    """
    sample = parse_prometheus(text, SGLANG_SAMPLE_NAMES, t=t, model_name=model_name,
                              source=source)
    if math.isnan(sample.num_preemptions_total) and not math.isnan(sample.num_requests_running):
        return dataclasses.replace(sample, num_preemptions_total=0.0)
    return sample


def parse_prometheus(text: str, names: dict[str, str], *, t: float,
                     model_name: str | None = None, source: str = "prometheus") -> MetricsSample:
    """A ``MetricsSample`` from the samples ``names`` maps to its fields (field -> sample name),
    summed over matching label sets as :func:`parse_vllm_metrics` describes; samples with a
    non-empty ``priority`` label (SGLang's per-priority breakdown) are left out."""
    wanted = {name: field for field, name in names.items()}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = wanted.get(sample.name)
                if field is None:
                    continue
                if sample.labels.get("priority", ""):
                    continue
                label = sample.labels.get("model_name")
                if model_name is not None and label is not None and label != model_name:
                    continue
                totals[field] = totals.get(field, 0.0) + float(sample.value)
    except ValueError as exc:
        raise MetricsParseError(f"not Prometheus text format: {exc}") from exc
    return MetricsSample(
        t=t,
        num_requests_running=totals.get("num_requests_running", math.nan),
        num_requests_waiting=totals.get("num_requests_waiting", math.nan),
        num_preemptions_total=totals.get("num_preemptions_total", math.nan),
        generation_tokens_total=totals.get("generation_tokens_total", math.nan),
        prompt_tokens_total=totals.get("prompt_tokens_total", math.nan),
        source=source,
    )
