"""The KV length at each first divergence (prompt tokens + index), and the finding's remark when
every divergence of an arm starts just past a power-of-two KV length (an attention tile)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bistat.analysis.summary import Divergence, analyze_run
from bistat.analysis.anatomy import MIN_DIVERGENCES_FOR_KV_BOUNDARY
from bistat.report.finding import _kv_tile_boundary

ROOT = Path(__file__).resolve().parents[1]
FA3 = ROOT / "tests" / "data" / "vllm-h200" / "h200-fixture-triton-attn"


@pytest.fixture(scope="module")
def fa3():
    return analyze_run(FA3)


def test_kv_length_is_prompt_tokens_plus_index():
    assert Divergence("a", "p", 1, 0, 90, n_prompt_tokens=39).kv_length == 129
    assert Divergence("a", "p", 1, 0, 90).kv_length is None


def test_the_fa3_fixture_diverges_only_past_one_128_key_tile(fa3):
    arms = {a.name: a for a in fa3.arms}
    kv = sorted(d.kv_length for d in arms["bi-flash-attn"].divergences)
    assert (len(kv), kv[0], kv.count(129), kv[-1]) == (197, 129, 67, 140)
    assert all(d.n_prompt_tokens + d.position == d.kv_length for d in arms["bi-flash-attn"].divergences)
    assert arms["bi-triton-attn"].divergences == ()
    text = "\n".join(_kv_tile_boundary(fa3))
    assert text.startswith("Every first divergence lies at a KV length of 129 or more in arm(s) "
                           "bi-flash-attn (all 197, 67 exactly at 129), although every output "
                           "began at 37-51 keys. 128 keys is one attention tile of 128")
    # the backend (engine log), the head size (bistat's model table) and what bistat
    # measured against it, with the finding that showed it
    advice = _kv_tile_boundary(fa3)[2:]
    assert advice[0] == ("What those arms ran and what bistat has measured against it "
                         "(`src/bistat/data/attention_remedies.toml`):")
    assert advice[2].startswith("- arm bi-flash-attn: attention backend FLASH_ATTN (FA3) (engine "
                                "log), head size 64 (SmolLM2-135M-Instruct: 9 query heads, 3 KV "
                                "heads; ")
    assert advice[3].startswith('- remedy for FLASH_ATTN (FA3) at head size 64: `attention_backend '
                                '= "TRITON_ATTN"` (engine argument) with `VLLM_BATCH_INVARIANT=1`: '
                                "working — 541/541 prompts")
    assert "(`findings/h200/h200-match-smollm2-r2.md`, arm bi-triton-attn; " in advice[3]
    assert advice[5].startswith("- remedy for FLASH_ATTN (FA3) at head size 64: `BISTAT_FA3_PIN=1` "
                                "with `VLLM_BATCH_INVARIANT=1` (bistat's FlashAttention-3 pin, "
                                "kernels/bistat_kernels/vllm_fa3.py): working — 541/541 prompts")
    assert "(`findings/h200/h200-v033-match-smollm2.md`, arm bi-fa3-pin; " in advice[5]


def _shifted(summary, arm, shift=0, keep=None):
    """``summary`` with ``arm``'s divergences moved by ``shift`` tokens (and cut to ``keep``)."""
    arms = []
    for a in summary.arms:
        if a.name == arm:
            divs = tuple(dataclasses.replace(d, position=d.position + shift)
                         for d in a.divergences)[:keep]
            a = dataclasses.replace(a, divergences=divs)
        arms.append(a)
    return dataclasses.replace(summary, arms=tuple(arms))


def test_no_remark_off_a_power_of_two_or_with_few_divergences(fa3):
    assert _kv_tile_boundary(_shifted(fa3, "bi-flash-attn", shift=1)) == []   # earliest 130
    assert _kv_tile_boundary(_shifted(fa3, "bi-flash-attn", shift=-64)) != []  # earliest 64 + 1
    few = _shifted(fa3, "bi-flash-attn", keep=MIN_DIVERGENCES_FOR_KV_BOUNDARY - 1)
    assert _kv_tile_boundary(few) == []
    # the synthetic example's divergences start at KV length 31: no tile boundary
    synth = analyze_run(ROOT / "examples" / "synthetic" / "run")
    assert min(d.kv_length for a in synth.arms for d in a.divergences) == 31
    assert _kv_tile_boundary(synth) == []
