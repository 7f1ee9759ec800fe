"""The outputs compared, as a finding shows them: match rates and where outputs diverge.

The ``## Match`` section (each arm's match rate with its Wilson interval; the arms paired by
prompt: McNemar and Newcombe), the ``## First divergences`` section (with the KV length at which
they start and, where every one lies just past a power-of-two KV length, the attention tile that
explains it and what bistat has measured against it) and the divergence anatomy's section
(:mod:`bistat.report.anatomy`).
"""

from __future__ import annotations

from typing import Sequence

from bistat.analysis.results import RunSummary
from bistat.core.markdown import md_table
from bistat.report.anatomy import render_anatomy_section
from bistat.report.finding_cells import _f, _int


def _match(s: RunSummary, plot: str) -> list[str]:
    out = ["## Match", ""]
    rows = []
    for a in s.arms:
        iv = a.match_interval
        rows.append((f"{a.name} ({a.role})", ", ".join(str(p) for p in a.counted_passes) or "—",
                     str(a.n_prompts_recorded), str(a.n_prompts), str(a.n_excluded_failed),
                     str(a.n_excluded_missing), str(a.n_excluded_no_logprobs),
                     str(a.n_prompts_matched), f"{a.n_matched} / {a.n_units} {a.unit}s",
                     _f(a.match_rate),
                     "—" if iv is None else f"[{iv.low:.4f}, {iv.high:.4f}]"))
    cl = f"{s.confidence_level * 100:g} %"
    out += [md_table(("arm", "counted passes", "prompts recorded", "prompts compared",
                      "excluded: failed request", "excluded: missing", "excluded: no logprobs",
                      "prompts identical in all passes", "matched units", "match rate",
                      f"{cl} Wilson interval (two-sided)"), rows), ""]
    comp_rows = []
    for c in s.comparisons:
        mc = c.mcnemar
        d = c.difference
        comp_rows.append((f"{c.treatment} vs {c.control}", str(c.n_paired),
                          "—" if mc is None else f"{mc.b} / {mc.c}",
                          "—" if mc is None else f"{mc.pvalue:.4g} ({mc.method})",
                          "—" if d is None else f"[{d.low:+.4f}, {d.high:+.4f}]"))
    out += ["Between arms (paired by prompt; McNemar on prompts identical in all passes; "
            f"Newcombe {cl} interval for treatment − control match rate):", "",
            md_table(("comparison", "paired prompts", "discordant: control only / treatment only",
                      "McNemar p", f"Newcombe {cl} difference"), comp_rows), "",
            f"![Match intervals per arm]({plot})", ""]
    return out


def _divergence(s: RunSummary, plot: str) -> list[str]:
    out = ["## First divergences", "",
           "For each compared prompt that did not match, every counted pass whose output differs "
           "from the arm's first counted pass gives the token index where they first differ.", ""]
    rows = []
    with_kv = any(a.spread.kv_earliest is not None for a in s.arms)
    for a in s.arms:
        sp = a.spread
        row = [a.name, str(sp.n_prompts), str(sp.n_divergences), _int(sp.earliest),
               _int(sp.median), _int(sp.latest)]
        if with_kv:
            row += [_int(sp.kv_earliest), _int(sp.kv_median)]
        rows.append(tuple(row))
    head = ("arm", "prompts", "diverging passes", "earliest", "median (lower)", "latest")
    if with_kv:
        head += ("KV length at first divergence: earliest", "median (lower)")
        out += ["The KV length is the prompt's tokens plus the index: the keys the first "
                "differing token's attention read.", ""]
    out += [md_table(head, rows), "", *_kv_tile_boundary(s)]
    detail = [(d.arm, d.prompt_id, str(d.reference_pass), str(d.pass_index), str(d.position))
              for a in s.arms for d in a.divergences]
    if detail and len(detail) <= 200:
        out += ["<details><summary>Every divergence</summary>", "",
                md_table(("arm", "prompt", "reference pass", "pass", "first differing index"),
                         detail), "", "</details>", ""]
    elif detail:
        out += [f"{len(detail)} divergences: too many to list here; "
                "`bistat analyze --json` prints them.", ""]
    out += [f"![First-divergence positions]({plot})", ""]
    return out


def _kv_tile_boundary(s: RunSummary) -> list[str]:
    """Arms whose every first divergence lies just past a power-of-two KV length
    (``RunSummary.kv_tiles``): divergences that start exactly at tile + 1 point at the attention
    kernel's KV tile changing with the batch (FlashAttention 3 on Hopper picks its tile from the
    batch's longest query)."""
    out = []
    for kt in s.kv_tiles:
        tile = kt.tile
        which = "; ".join(f"{a.arm} (all {a.n_divergences}, {a.n_at_boundary} exactly at "
                          f"{tile + 1})" for a in kt.arms)
        out += [f"Every first divergence lies at a KV length of {tile + 1} or more in arm(s) "
                f"{which}, although every output began at {kt.min_prompt_tokens}-"
                f"{kt.max_prompt_tokens} keys. {tile} keys is one "
                f"attention tile of {tile}: up to it, any tile width reduces a row in the same "
                f"order; past it, a kernel whose KV tile width changes with the batch does not "
                f"(FlashAttention 3 on Hopper picks 128 or 192 keys per tile at head size 64 "
                f"from the batch's longest query). An attention backend with a fixed tile "
                f"(TRITON_ATTN in batch-invariant mode) is the test.", ""]
    if s.kv_tiles:
        out += _kv_tile_advice(s, [a.arm for kt in s.kv_tiles for a in kt.arms])
    return out


def _kv_tile_advice(s: RunSummary, arms: Sequence[str]) -> list[str]:
    """The attention backend and head size of ``arms`` (whose divergences start past a KV tile)
    and the remedies bistat has measured against it (:mod:`bistat.explain.remedies`)."""
    from bistat.explain.remedies import TABLE_PATH, advice_lines, load_table

    logged = {a.arm: a.attention for a in s.activation}
    model = (s.declaration.get("engine") or {}).get("model")
    lines = advice_lines({arm: logged.get(arm, ()) for arm in arms}, model, load_table())
    return [f"What those arms ran and what bistat has measured against it (`{TABLE_PATH}`):", "",
            *[f"- {x}" for x in lines], ""]


def _anatomy(s: RunSummary, plot: str | None) -> list[str]:
    if s.anatomy is None:
        return []
    return [render_anatomy_section(s.anatomy, plot)]
