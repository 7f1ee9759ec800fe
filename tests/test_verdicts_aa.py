"""A mode that does nothing is never *working*: by seeded simulation over the
classifier -- the default rule's false-*working* rate in A/A experiments at most its alpha over a
grid of match rates, pass-to-pass CVs and pass counts, checked against a binomial acceptance band
computed from the replication count -- and end to end on the embedded engine.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from bistat.core.classify import ArmStats, PairedCounts, classify
from bistat.core.rule import Label, Rule
from bistat.declare.template import default_rule

#: The default rule's labels without its cost rule: the label reads no throughput, and the cost
#: rule's search for the passes that would decide an undecidable cost is slow to repeat.
LABELS_ONLY = default_rule().model_copy(update={"cost": None})
ALPHA = 1.0 - LABELS_ONLY.confidence_level
#: Replications per grid point, and the band: the 99.9th percentile of Binomial(REPS, ALPHA).
REPS = 300
UPPER = sps.binom.ppf(0.999, REPS, ALPHA)


def _aa_arms(rng: np.random.Generator, n: int, rate: float, passes: int, cv: float
             ) -> tuple[ArmStats, ArmStats, PairedCounts]:
    """One A/A experiment: both arms the same engine setting. Each prompt has its own chance to
    stay identical across the passes (Beta around ``rate``: some prompts fragile, some not), the
    same in both arms, so the arms' outcomes are correlated by prompt as in a real run; per-pass
    throughputs are lognormal with the same mean in both arms."""
    if rate >= 1.0:
        chance = np.ones(n)
    else:
        chance = rng.beta(2.0 * rate, 2.0 * (1.0 - rate), n)
    control = rng.random(n) < chance
    treatment = rng.random(n) < chance
    sigma = np.sqrt(np.log1p(cv * cv))
    tc = tuple(100.0 * np.exp(sigma * rng.standard_normal(passes)))
    tt = tuple(100.0 * np.exp(sigma * rng.standard_normal(passes)))
    paired = PairedCounts(n, int((control & ~treatment).sum()), int((treatment & ~control).sum()))
    return (ArmStats("a", "control", n, int(control.sum()), tc),
            ArmStats("a2", "treatment", n, int(treatment.sum()), tt), paired)


def _false_working(rule: Rule, rate: float, passes: int, cv: float, seed: int, n: int = 288
                   ) -> int:
    rng = np.random.default_rng([20261202, seed])
    count = 0
    for _ in range(REPS):
        control, treatment, paired = _aa_arms(rng, n, rate, passes, cv)
        count += classify(rule, control, treatment, paired=paired).label is Label.WORKING
    return count


GRID = [(rate, cv, passes) for rate in (0.5, 0.9, 0.97, 0.99, 0.999, 1.0)
        for cv in (0.02, 0.20) for passes in (2, 5)]


@pytest.mark.parametrize("rate, cv, passes", GRID)
def test_the_default_rule_is_rarely_working_in_an_a_a_experiment(rate, cv, passes):
    seed = GRID.index((rate, cv, passes))
    got = _false_working(LABELS_ONLY, rate, passes, cv, seed)
    assert got <= UPPER, f"{got} of {REPS} A/A experiments classified working"


def test_the_check_has_power_a_rule_without_activation_evidence_fails_it():
    """The same harness on a rule whose working needs only an invariant treatment: a mode that
    does nothing passes whenever the engine is invariant anyway, far above alpha. So the band
    above can fail."""
    lax = Rule.model_validate({"alternative": "greater", "labels": [
        {"label": "working", "all": [
            {"criterion": "match_lower_bound", "arm": "treatment", "at_least": 0.99}]}]})
    assert _false_working(lax, 1.0, 3, 0.05, seed=99) > UPPER
    # and a McNemar-only rule false-fires now and then (its directional rate is at most
    # alpha / 2; the continuity correction makes it conservative), inside the band
    mcnemar = Rule.model_validate({"labels": [{"label": "working", "all": [
        {"criterion": "treatment_beats_control", "mcnemar_below": 0.05}]}]})
    got = _false_working(mcnemar, 0.5, 3, 0.05, seed=98)
    assert 0 < got <= UPPER


# ---- end to end on the embedded engine ------------------------------------------------------


def _study(root, name: str, arms) -> "object":
    """Register a declaration with the default rule verbatim (288 prompts: enough for its
    one-sided 0.99 bound) over the near-tie tiny model, record it with the real runner and the
    real embedded adapter, and analyse it."""
    from helpers_explain import declaration_toml, save_near_tie

    from bistat.analysis.summary import analyze_run
    from bistat.declare.prereg import register
    from bistat.run.runner import start_run
    from bistat.declare.template import DEFAULT_RULE_TOML

    model = save_near_tie(root / "model")
    text = declaration_toml(name, model, arms, n_prompts=288, passes=2)
    text = text[:text.index("[rule]")] + DEFAULT_RULE_TOML
    text = text.replace("max_tokens = 24", "max_tokens = 6")
    decl = root / "experiments" / f"{name}.toml"
    decl.parent.mkdir(parents=True, exist_ok=True)
    decl.write_text(text, encoding="utf-8")
    reg, _ = register(decl, registrations_dir=root / "preregistrations")
    assert reg.experiment().rule == default_rule()
    run_dir = root / "runs" / name
    outcome = start_run(reg.experiment(), reg.reference(), run_dir, command=["bistat", "run"])
    assert outcome.status == "complete", outcome
    return analyze_run(run_dir, reg.path)


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    root = tmp_path_factory.mktemp("aa")
    return {
        "blas vs invariant": _study(root, "ab", (("blas", "control", "blas"),
                                                 ("invariant", "treatment", "invariant"))),
        "blas vs blas": _study(root, "aa-blas", (("blas-a", "control", "blas"),
                                                 ("blas-b", "treatment", "blas"))),
        "invariant vs invariant": _study(root, "aa-inv", (("inv-a", "control", "invariant"),
                                                          ("inv-b", "treatment", "invariant"))),
    }


def test_the_mode_that_acts_is_working_end_to_end(studies):
    """The positive control: the near-tie model's BLAS GEMM flips greedy tokens with the batch,
    the invariant GEMM never does, so the default rule can say working here."""
    s = studies["blas vs invariant"]
    arms = {a.name: a for a in s.arms}
    assert arms["invariant"].n_matched == arms["invariant"].n_units == 288
    assert arms["blas"].n_matched < 281   # the control diverged under the same load
    (c,) = s.comparisons
    assert c.verdict.label is Label.WORKING
    assert c.verdict.cost is not None


@pytest.mark.parametrize("which, label", [("blas vs blas", Label.DOUBTFUL),
                                          ("invariant vs invariant", Label.REPORTED_AS_OBSERVED)])
def test_a_mode_that_does_nothing_is_never_working_end_to_end(studies, which, label):
    """A/A: the treatment declared with the control's settings. Both BLAS: the treatment
    diverges (doubtful). Both invariant: the control does not diverge, so nothing shows the
    mode acting (reported as observed). Never working."""
    s = studies[which]
    (c,) = s.comparisons
    assert c.verdict.label is label
    assert c.verdict.label is not Label.WORKING
    working = s.comparisons[0].verdict.labels[0]
    assert working.label == "working" and not working.met
