"""The declaration of an experiment (``experiments/NAME.toml``): pydantic models and loading.

``load_experiment(path)`` reads TOML and validates it. Every error names the file, the field
path, what was wrong and how to fix it, e.g.::

    experiments/q.toml: arms[1].role: 'treatmnt' is not allowed; expected one of 'control', 'treatment'

All problems are reported at once in a ``DeclarationError``. ``Experiment.resolved()`` is the
fully resolved declaration (every default filled in): the canonical form that gets sealed by
``bistat.declare.prereg``.

The engine kinds a declaration accepts are the engine registry's
(:data:`bistat.engines.registry.ENGINE_KINDS`; adapters add theirs with ``register_adapter``).
Engine and arm ``args`` are free-form (kind-specific; for example
``tensor_parallel_size`` is an ordinary engine argument); arm ``env`` values must be strings.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, Union, Annotated
import types

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from bistat.declare.errors import DeclarationError
from bistat.engines import registry
from bistat.core.rule import (
    CRITERION_NAMES,
    NEEDS_REPEAT_MATCH,
    EngineLog,
    Rule,
    semantic_error,
)

if TYPE_CHECKING:  # pragma: no cover
    from packaging.specifiers import SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "DeclarationError",
    "EngineSpec",
    "Arm",
    "Workload",
    "Match",
    "Validity",
    "Design",
    "Experiment",
    "load_experiment",
    "required_specifier",
    "validate_experiment",
]


def required_specifier(text: str) -> SpecifierSet:
    """``engine.required_version`` as a PEP 440 specifier set: a bare version means exactly it.

    >>> str(required_specifier("0.33.0")), str(required_specifier(">=0.33,<0.34"))
    ('==0.33.0', '<0.34,>=0.33')

    Raises
    ------
    ValueError
        Neither a version nor a specifier set.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    text = text.strip()
    try:
        return SpecifierSet(f"=={Version(text)}")
    except InvalidVersion:
        pass
    try:
        spec = SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(f"{text!r} is neither a version nor a version specifier (PEP 440); "
                         "write e.g. \"0.33.0\" or \">=0.33,<0.34\"") from exc
    if not str(spec):
        raise ValueError("an empty version requirement; write e.g. \"0.33.0\" or \">=0.33,<0.34\"")
    return spec

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
SOURCE_PATTERN = r"^(builtin:chat|builtin:token-ids(\?[a-z0-9=&_.]*)?|file:.+\.jsonl)$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EngineSpec(_Model):
    """The engine every arm runs on; arms differ only by their ``env`` and ``args``."""

    kind: str = Field(description="the engine kind: embedded, vllm-server, vllm-offline, openai, "
                                  "sglang-server (SGLang per arm), command-server (any "
                                  "OpenAI-compatible server started from a command template)")
    model: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)
    engines_concurrent: bool | Literal["auto"] = Field(
        default="auto", description="keep every arm's engine up at once (true), restart per block "
                                    "of passes (false), or decide from the engine kind (auto)")

    required_version: str | None = Field(
        default=None, description="the engine version the study requires: a version (\"0.33.0\", "
                                  "exactly it) or a PEP 440 specifier (\">=0.33,<0.34\"); a run "
                                  "on another version is a deviation in its finding")

    @field_validator("required_version")
    @classmethod
    def _version_spec(cls, text: str | None) -> str | None:
        if text is None:
            return None
        try:
            required_specifier(text)
        except ValueError as exc:
            raise PydanticCustomError("bistat_required_version", "{detail}",
                                      {"detail": str(exc)}) from None
        return text

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in registry.ENGINE_KINDS:
            expected = ", ".join(repr(k) for k in registry.ENGINE_KINDS)
            raise PydanticCustomError(
                "bistat_engine_kind", "{detail}",
                {"detail": f"unknown engine {kind!r}; expected one of {expected}"})
        return kind


class Arm(_Model):
    """One arm: its role, environment variables and engine arguments (override ``engine.args``)."""

    name: str = Field(pattern=NAME_PATTERN)
    role: Literal["control", "treatment"]
    env: dict[str, str] = Field(default_factory=dict)
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"{key!r} is not a valid environment variable name "
                                 "(letters, digits and '_', not starting with a digit)")
        return env


class Workload(_Model):
    """What is sent, how often, and in which order."""

    source: str = Field(pattern=SOURCE_PATTERN)
    n_prompts: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    max_tokens_min: int | None = Field(
        default=None, ge=1, description="when set, prompt i's output length is drawn uniformly from "
                                        "[max_tokens_min, max_tokens] (seeded per prompt, the same in "
                                        "every pass and arm); use with ignore_eos = true")
    concurrency: int = Field(ge=1)
    passes: int = Field(ge=1, description="counted passes per arm")
    warmup_passes: int = Field(default=1, ge=0)
    order: Literal["abba", "random"] = "abba"
    seed: int = 0
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    ignore_eos: bool = False
    shuffle_within_pass: bool = True
    retries: int = Field(default=2, ge=0, description="transport retries per request")
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    top_logprobs: int = Field(
        default=5, ge=1, le=20,
        description="top-k alternatives recorded with their logprobs at every output position "
                    "(the runner and the probe ask every request for them): the divergence "
                    "anatomy reads the top-1/top-2 margin there. 1..20 (OpenAI's and vLLM's "
                    "limit for chat completions is 20)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int) -> int:
        if top_k == 0:
            raise ValueError("0 is ambiguous across engines; use -1 for off or a positive k")
        return top_k

    @model_validator(mode="after")
    def _min_tokens(self) -> "Workload":
        if self.max_tokens_min is not None and self.max_tokens_min > self.max_tokens:
            raise ValueError(f"max_tokens_min ({self.max_tokens_min}) exceeds max_tokens "
                             f"({self.max_tokens}); lower it or raise max_tokens")
        return self


class Match(_Model):
    """What counts as two passes of a prompt matching."""

    unit: Literal["token_ids", "text", "token_ids+logprobs"] = "token_ids"
    multi_pass: Literal["all", "pairwise"] = "all"
    near_tie_epsilon: float = Field(
        default=0.125, ge=0.0,
        description="ε in nats: a first divergence whose top-1/top-2 logprob margin is within ε "
                    "is a near-tie flip, one beyond it a large drift (bistat.analysis.anatomy). 0.125 is "
                    "one bfloat16 step (ulp = 2**-3) for logits of magnitude 16 to 32, where the "
                    "top logits of served LLMs lie, so a flip one rounding step causes shows a "
                    "margin of at most 0.125; a float32 engine (bistat's embedded one) rounds "
                    "about 65,000 times finer and may declare 1e-3")


class Validity(_Model):
    """Checks that must pass for the run to test the hypothesis (else the verdict is *untested*)."""

    min_mean_running: float | None = Field(default=1.5, ge=0.0,
                                           description="false (or 0) disables the check")
    max_preemptions: int | None = Field(default=None, ge=0)
    same_gpu: bool = True
    same_versions: bool = True

    @field_validator("min_mean_running", mode="before")
    @classmethod
    def _disable(cls, value: Any) -> Any:
        # TOML has no null: ``min_mean_running = false`` switches the check off.
        return None if value is False else value


class Design(_Model):
    """Assumptions for the design analysis (``bistat design``); they do not change the verdict."""

    assumed_match_rate: float = Field(default=0.999, ge=0.0, le=1.0)
    assumed_control_match_rate: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="the control arm's assumed match rate, for the power of the activation "
                    "criteria (control_diverges, treatment_beats_control)")
    expected_cv: float | None = Field(default=None, gt=0.0)
    cv_from: str | None = Field(default=None, min_length=1)
    true_ratios: list[float] = Field(default_factory=lambda: [0.8, 0.9, 1.0], min_length=1)
    power_target: float = Field(default=0.8, gt=0.0, lt=1.0)
    time_budget_s: float | None = Field(
        default=None, gt=0.0,
        description="the wall time in seconds the run must fit in (e.g. one device session "
                    "after its set-up: a run must finish on one machine); the design analysis "
                    "estimates the run's time from the earlier run design.cv_from names and "
                    "warns, with the workload.passes that would fit, when it is over")

    @field_validator("true_ratios")
    @classmethod
    def _positive(cls, ratios: list[float]) -> list[float]:
        for r in ratios:
            if not r > 0:
                raise ValueError(f"every true ratio must be > 0, got {r!r}")
        return ratios

    @model_validator(mode="after")
    def _one_cv(self) -> "Design":
        if self.expected_cv is not None and self.cv_from is not None:
            raise ValueError("give either expected_cv or cv_from, not both")
        return self

    def resolved_cv(self) -> float | None:
        """``expected_cv``, its default (0.05) when neither it nor ``cv_from`` is given."""
        if self.cv_from is not None:
            return self.expected_cv
        return DEFAULT_CV if self.expected_cv is None else self.expected_cv


#: The pass-to-pass coefficient of variation assumed when a declaration states none.
DEFAULT_CV = 0.05

class Experiment(_Model):
    """A whole declaration. See ``docs/CONTRACTS.md`` ("Declaration") for the TOML shape."""

    name: str = Field(pattern=NAME_PATTERN)
    hypothesis: str = Field(min_length=1)
    engine: EngineSpec
    arms: list[Arm] = Field(min_length=2)
    workload: Workload
    match: Match = Field(default_factory=Match)
    validity: Validity = Field(default_factory=Validity)
    design: Design = Field(default_factory=Design)
    rule: Rule

    @model_validator(mode="after")
    def _cross_checks(self) -> "Experiment":
        issues: list[tuple[str, str]] = []
        controls = [i for i, a in enumerate(self.arms) if a.role == "control"]
        if not controls:
            issues.append(("arms", "no arm has role = 'control'; declare exactly one control arm"))
        for i in controls[1:]:
            issues.append((f"arms[{i}].role", f"a second control arm (arms[{controls[0]}] is "
                                              "already the control); declare exactly one control "
                                              "and make the others 'treatment'"))
        if not any(a.role == "treatment" for a in self.arms):
            issues.append(("arms", "no arm has role = 'treatment'; declare at least one"))
        seen: dict[str, int] = {}
        for i, arm in enumerate(self.arms):
            if arm.name in seen:
                issues.append((f"arms[{i}].name", f"{arm.name!r} is already the name of "
                                                  f"arms[{seen[arm.name]}]; arm names must be unique"))
            seen.setdefault(arm.name, i)
        issues.extend(_unevaluable_criteria(self))
        floor = self.validity.min_mean_running
        if floor is not None and floor > self.workload.concurrency:
            issues.append(("validity.min_mean_running",
                           f"{floor:g} can never be reached with workload.concurrency = "
                           f"{self.workload.concurrency}; lower it or raise the concurrency"))
        if issues:
            raise semantic_error(issues)
        return self

    @property
    def control(self) -> Arm:
        return next(a for a in self.arms if a.role == "control")

    @property
    def treatments(self) -> list[Arm]:
        return [a for a in self.arms if a.role == "treatment"]

    def arm_args(self, arm: Arm | str) -> dict[str, Any]:
        """Engine arguments for one arm: ``engine.args`` overridden by the arm's ``args``."""
        if isinstance(arm, str):
            arm = next(a for a in self.arms if a.name == arm)
        return {**self.engine.args, **arm.args}

    def resolved(self) -> dict[str, Any]:
        """The fully resolved declaration (every default filled in), as JSON-ready data.

        This is the canonical content sealed by ``bistat.declare.prereg``; the design's CV default is
        filled in too (``design.expected_cv``), unless ``design.cv_from`` names an earlier run.
        """
        data = self.model_dump(mode="json", by_alias=True)
        data["design"]["expected_cv"] = self.design.resolved_cv()
        return data


def _unevaluable_criteria(exp: "Experiment") -> list[tuple[str, str]]:
    """Criteria of the rule this declaration's run could never evaluate, each with the fix:
    refused at registration instead of giving a verdict that could not have been otherwise. What
    only the run can tell (a probe report in the run directory) is left to the classifier, which
    then says *untested*."""
    issues: list[tuple[str, str]] = []
    passes = exp.workload.passes
    kind = exp.engine.kind
    for li, spec in enumerate(exp.rule.labels):
        for ci, crit in enumerate(spec.criteria):
            field = f"rule.labels[{li}].all[{ci}]"
            if isinstance(crit, NEEDS_REPEAT_MATCH) and passes < 2:
                issues.append((field, f"{crit.criterion} needs at least 2 counted passes per arm, "
                                      f"but workload.passes = {passes}: a single pass always "
                                      "matches itself, so no arm can diverge; set "
                                      "workload.passes >= 2"))
            if isinstance(crit, EngineLog) and not registry.capabilities(kind).engine_log:
                allowed = ", ".join(repr(k) for k in registry.ENGINE_KINDS
                                    if registry.capabilities(k).engine_log)
                issues.append((field, f"engine_log cannot be evaluated: engine.kind {kind!r} keeps "
                                      "no engine log (only "
                                      f"{allowed} do); remove the criterion or run on one of "
                                      "those engines"))
    if exp.rule.cost is not None and passes < 2:
        issues.append(("rule.cost", f"the cost rule needs at least 2 counted passes per arm for "
                                    f"the ratio's interval, but workload.passes = {passes}; set "
                                    "workload.passes >= 2 or remove [rule.cost]"))
    return issues


# --------------------------------------------------------------------------------------------
# loading and error rewriting


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate a declaration file.

    Raises
    ------
    DeclarationError
        The file is missing, is not TOML, or does not validate; one message per problem, each
        naming the file and the field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise DeclarationError([f"{path}: no such file"]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DeclarationError([f"{path}: cannot read: {exc}"]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DeclarationError([f"{path}: not valid TOML: {exc}"]) from exc
    return validate_experiment(data, source=str(path))


def validate_experiment(data: dict[str, Any], source: str = "<declaration>") -> Experiment:
    """Validate already-parsed declaration data; errors are named after ``source``."""
    try:
        return Experiment.model_validate(data)
    except ValidationError as exc:
        raise DeclarationError(format_validation_error(exc, source)) from exc


def format_validation_error(exc: ValidationError, source: str) -> list[str]:
    """Rewrite pydantic's errors as ``source: field.path: what was wrong; how to fix it``."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = _clean_loc(err["loc"])
        if err["type"] == "bistat_semantic":
            for field, msg in err["ctx"]["issues"]:
                lines.append(f"{source}: {_join(loc, field)}: {msg}")
            continue
        lines.append(f"{source}: {_format_loc(loc) or '(top level)'}: "
                     f"{_message(err, loc, tuple(err['loc']))}")
    return lines


def _clean_loc(loc: tuple) -> tuple:
    # Discriminated unions put the tag into the location ("...all[1].throughput_ratio.below");
    # users never wrote that segment, so drop it.
    out: list = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and part in CRITERION_NAMES and i > 0 and isinstance(loc[i - 1], int):
            continue
        out.append(part)
    return tuple(out)


def _format_loc(loc: tuple) -> str:
    s = ""
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        else:
            s += f".{part}" if s else str(part)
    return s


def _join(loc: tuple | str, field: str) -> str:
    base = loc if isinstance(loc, str) else _format_loc(loc)
    if not base:
        return field
    if not field:
        return base
    return f"{base}.{field}"


def _got(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a {'table' if isinstance(value, dict) else 'list'}"
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return f"{shown} ({_toml_type(value)})"


def _toml_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(type(value),
                                                                             type(value).__name__)


_TYPE_WORDS = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number",
    "bool_type": "true or false", "dict_type": "a table", "list_type": "a list",
    "model_type": "a table", "model_attributes_type": "a table", "int_from_float": "an integer",
}


def _message(err: dict, loc: tuple, raw_loc: tuple) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind == "missing":
        return _missing(loc, raw_loc)
    if kind == "extra_forbidden":
        return _unknown_field(raw_loc)
    if kind == "literal_error":
        expected = ctx.get("expected", "").replace(" or ", ", ")
        return f"{value!r} is not allowed; expected one of {expected}"
    if kind == "union_tag_invalid":
        expected = ", ".join(repr(t) for t in CRITERION_NAMES)
        return f"unknown criterion {ctx.get('tag')!r}; expected one of {expected}"
    if kind == "union_tag_not_found":
        return "each criterion needs a 'criterion' key, e.g. { criterion = \"match_lower_bound\", " \
               "arm = \"treatment\", at_least = 0.99 }"
    if kind in _TYPE_WORDS:
        hint = ""
        if kind == "string_type" and not isinstance(value, (dict, list)):
            hint = f"; quote it: \"{value if not isinstance(value, bool) else str(value).lower()}\""
        return f"expected {_TYPE_WORDS[kind]}, got {_got(value)}{hint}"
    if kind == "string_pattern_mismatch":
        pattern = ctx.get("pattern", "")
        if pattern == NAME_PATTERN:
            return (f"{value!r} is not a valid name; use lower-case letters, digits, '-' and '_', "
                    "starting with a letter or digit")
        if pattern == SOURCE_PATTERN:
            return (f"{value!r} is not a prompt source; expected 'builtin:chat', "
                    "'builtin:token-ids' or 'file:PATH.jsonl'")
        return f"{value!r} does not match {pattern}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        words = {"greater_than": "greater than {gt}", "greater_than_equal": "at least {ge}",
                 "less_than": "less than {lt}", "less_than_equal": "at most {le}"}[kind]
        return f"must be {words.format(**ctx)}, got {value!r}"
    if kind in ("too_short", "too_long"):
        if ctx.get("field_type") == "String" or isinstance(value, str):
            return "must not be empty"
        if kind == "too_short":
            n = ctx.get("min_length")
            return f"needs at least {n} {'entry' if n == 1 else 'entries'}, got {len(value)}"
        return f"has more than {ctx.get('max_length')} entries"
    msg = err["msg"]
    if kind == "value_error" and msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    if kind.startswith("bistat_"):
        return msg
    return f"{msg[0].lower()}{msg[1:]}, got {_got(value)}"


def _missing(loc: tuple, raw_loc: tuple) -> str:
    model = _model_at(raw_loc)
    if model is not None:
        return f"required section is missing; add a [{_format_loc(loc)}] table"
    if _model_at(raw_loc + (0,)) is not None:
        return f"required section is missing; add [[{_format_loc(loc)}]] tables"
    if len(loc) <= 1:
        return "required field is missing; add it at the top of the file"
    parent = _format_loc(loc[:-1])
    where = parent if isinstance(loc[-2], int) else f"[{parent}]"
    return f"required field is missing; add it to {where}"


def _unknown_field(loc: tuple) -> str:
    name = loc[-1] if loc else "?"
    model = _model_at(loc[:-1])
    if model is None:
        return f"unknown field {name!r}; remove it"
    allowed = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(name), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"unknown field {name!r}; {hint}allowed: {', '.join(allowed)}")


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model class that validates the value at ``loc`` (None for free-form values)."""
    tp: Any = Experiment
    for part in loc:
        tp = _strip(tp)
        if isinstance(part, int):
            if get_origin(tp) is list:
                tp = get_args(tp)[0]
                continue
            return None
        if get_origin(tp) in (Union, types.UnionType):
            # a discriminated union (a criterion): the raw location carries the tag
            tp = next((m for m in get_args(tp)
                       if getattr(m, "model_fields", {}).get("criterion") is not None
                       and m.model_fields["criterion"].default == part), None)
            if tp is None:
                return None
            continue
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None
            tp = field.annotation
            continue
        return None
    tp = _strip(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _strip(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return tp
