"""The default decision rule and the commented declaration ``bistat new NAME`` writes.

The default rule calls batch invariance *working* from evidence that the mode acts,
never from a slowdown, and states the cost as a verdict of its own:

- **working**: the treatment is invariant (its one-sided 95 % Wilson lower bound of the match
  rate is at least 0.99) *and* the mode acts: under the same load the control diverges (its
  one-sided upper bound is at most 0.99: the control is demonstrably not invariant by the same
  bar) and the treatment beats it, paired by prompt (McNemar p < 0.05 with the treatment
  ahead). A treatment declared with the control's settings (an A/A experiment) is therefore
  *working* with probability at most about 0.025, McNemar's directional false-positive rate
  (``tests/test_verdicts_aa.py`` checks it by simulation and end to end);
- **doubtful**: the treatment itself diverges (its one-sided upper bound is below 0.99);
- otherwise **reported as observed** (e.g. the control did not diverge either: the load
  revealed nothing, so the run cannot say whether the mode acts);
- **cost**: the throughput ratio's 95 % interval against +/- 10 % (*costs* wholly beyond on the
  slower side, *faster* wholly beyond on the faster side, *no measurable cost* when its slower
  end is within the margin -- non-inferiority, not equivalence -- or *undecidable* with the
  passes that would decide it). The interval is ``interval = "hac"``: the passes paired, with
  an interval that keeps its coverage when passes on one engine are serially correlated. The
  simulation in ``docs/COST-INTERVALS.md`` chose it: Welch's and the paired interval state 95 %
  and cover 73-87 % at a lag-1 autocorrelation of 0.5; the HAC one stays within 1.5 points of
  95 % up to about 0.5 from 16 pairs, exact when passes are independent. Rules sealed before keep
  their interval.

One-sided bounds: the rule's claims are one-directional ("at least 0.99", "at most 0.99"), and a
one-sided 95 % bound lets 268 prompts show 0.99 (the two-sided bound needs 381). The probe
(``probe_confirmed``) and the engine log (``engine_log``) are left out of the default so that a
run alone can decide it; the template shows how to add them.

:data:`DEFAULT_RULE_TOML` is the one source of the rule: ``bistat new`` writes it into the
declaration, :func:`default_rule` parses it, and the exploratory registrations of the committed
H200 runs use it verbatim (``experiments/*-exploratory.toml``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bistat.declare.experiment import NAME_PATTERN
from bistat.core.rule import Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["DEFAULT_RULE_TOML", "default_rule", "declaration_template", "write_declaration"]

#: The default decision rule, as TOML (``[rule]`` to the end of a declaration).
DEFAULT_RULE_TOML = '''\
# The default decision rule (bistat.declare.template): batch invariance is called working from evidence
# that the mode acts -- never from a slowdown -- and its cost is a verdict of its own.
[rule]
confidence_level = 0.95
alternative = "greater"          # one-sided bounds: "at least 0.99", "at most 0.99"
otherwise = "reported as observed"

# working: the treatment is invariant AND the mode acts: under the same load the control
# diverges, and the treatment beats it prompt by prompt.
[[rule.labels]]
label = "working"
all = [ { criterion = "match_lower_bound", arm = "treatment", at_least = 0.99 },
        { criterion = "control_diverges", at_most = 0.99 },
        { criterion = "treatment_beats_control", mcnemar_below = 0.05 } ]
# More activation evidence can be required in the same list:
#   { criterion = "probe_confirmed" }    -- bistat probe REGISTRATION --output RUN_DIR/probe.json
#   { criterion = "engine_log", marker = "batch_invariant_kernels" }   -- vLLM engines only;
#     circumstantial, never sufficient alone
#   newcombe_at_least = 0.0, require = "both" | "either"   -- beside mcnemar_below

# doubtful: the treatment itself diverges.
[[rule.labels]]
label = "doubtful"
all = [ { criterion = "match_upper_bound", arm = "treatment", below = 0.99 } ]

# The cost, a verdict of its own: the throughput ratio's 95 % interval against +/- 10 %:
# costs (wholly beyond, slower), faster (wholly beyond, faster), no measurable cost (its slower
# end within the margin: non-inferiority, so faster is never worse), or undecidable (with the
# passes that would decide it). metric = "latency" judges mean request latency.
# The interval pairs the passes each round of the schedule runs side by side, one per arm, and allows
# for passes on one engine being serially correlated, which "welch" and "paired" assume they are
# not (docs/COST-INTERVALS.md). It keeps 95 % up to a lag-1 autocorrelation of the pairs of 0.3
# from 8 pairs and about 0.5 from 16; at 3 pairs it is the paired t interval (bistat design warns).
[rule.cost]
metric = "throughput"
margin = 0.10
confidence_level = 0.95
interval = "hac"
hac_kernel = "cosine"            # equal-weighted cosine transforms, t with B degrees of freedom
hac_bandwidth = "llsw"           # B = max(2, floor(0.4 n^(2/3))) cosine terms for n pairs
'''


def default_rule() -> Rule:
    """The default rule, parsed from :data:`DEFAULT_RULE_TOML`."""
    return Rule.model_validate(tomllib.loads(DEFAULT_RULE_TOML)["rule"])


_DECLARATION = '''\
# {name}: written by `bistat new {name}`. Edit, then check the plan and seal it before any data:
#   bistat design experiments/{name}.toml      # what the plan can and cannot conclude
#   bistat register experiments/{name}.toml    # seal preregistrations/{name}.json
#   bistat run preregistrations/{name}.json    # record (append-only)
#   bistat analyze RUN_DIR                     # recompute, classify, report: findings/local/
# As written it runs on any CPU: bistat's embedded numpy engine with SmolLM2-135M-Instruct
# (`bistat model fetch smollm2-135m`), its BLAS GEMM against its batch-invariant GEMM.
name = "{name}"
hypothesis = """With the batch-invariant GEMM every prompt's greedy continuation (token ids and \\
logprobs, bitwise) is identical across passes whose batch compositions differ, while the BLAS \\
GEMM arm diverges under the same load. What the invariant GEMM does to throughput is not \
assumed: [rule.cost] measures it (it depends on the machine's BLAS and load)."""

[engine]
kind = "embedded"                  # {kinds}
model = "smollm2-135m"
args = {{ max_batch_size = 32, max_model_len = 2048 }}

# One control (the mode off) and one or more treatments (the mode on); arms differ only by
# their env and args. An A/A check: a treatment with the control's settings is never working.
[[arms]]
name = "blas"
role = "control"
args = {{ gemm = "blas" }}

[[arms]]
name = "invariant"
role = "treatment"
args = {{ gemm = "invariant" }}

# The load must give the control a fair chance to diverge: new submission orders per pass,
# staggered output lengths, a running batch that changes size from step to step.
[workload]
source = "builtin:chat"
n_prompts = 288                    # the one-sided 0.99 bound needs at least 268
max_tokens = 16
max_tokens_min = 4
concurrency = 8
passes = 3                         # counted passes per arm (>= 2: matching and cost need them)
warmup_passes = 1
order = "abba"
seed = 0
temperature = 0.0
ignore_eos = true
shuffle_within_pass = true

[match]
unit = "token_ids+logprobs"        # token ids and logprobs, bitwise
multi_pass = "all"

[validity]
min_mean_running = 3.0
max_preemptions = 0
same_gpu = true
same_versions = true

# Assumptions for the design analysis only (they never change a verdict).
[design]
assumed_match_rate = 1.0           # the treatment's
assumed_control_match_rate = 0.96  # the control's, under this load
expected_cv = 0.05                 # pass-to-pass CV of throughput (or cv_from = "runs/...")
true_ratios = [0.7, 0.9, 1.0]
# time_budget_s = 1380             # wall time (s) the run must fit in, timed from cv_from's run

{rule}'''


def declaration_template(name: str) -> str:
    """The commented declaration ``bistat new NAME`` writes, with the default rule.

    Raises
    ------
    ValueError
        ``name`` is not a valid experiment name.
    """
    if not re.fullmatch(NAME_PATTERN.strip("^$"), name):
        raise ValueError(f"{name!r} is not a valid name; use lower-case letters, digits, '-' and "
                         "'_', starting with a letter or digit")
    from bistat.engines.registry import ENGINE_KINDS

    return _DECLARATION.format(name=name, rule=DEFAULT_RULE_TOML, kinds=" | ".join(ENGINE_KINDS))


def write_declaration(name: str, experiments_dir: str | Path = "experiments") -> Path:
    """Write ``experiments_dir/NAME.toml`` from :func:`declaration_template`; never overwrites.

    Raises
    ------
    ValueError
        Bad name.
    FileExistsError
        The file exists already.
    """
    text = declaration_template(name)
    path = Path(experiments_dir) / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x", encoding="utf-8") as fh:
        fh.write(text)
    return path
