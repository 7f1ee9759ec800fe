"""Registration checks the adapters share: what a declaration's engine arguments must be for a run
to start and its requests to be answerable, checked before anything is sealed.

Each adapter's ``declaration_problems`` composes these (``(field, message with the fix)``
pairs, the field in the table it was written in: ``engine.args.url``, ``arms[1].args.url``); what an
adapter cannot know before its engine runs it states in ``declaration_limits``, which the design
report prints (``bistat register``, ``bistat design``).

- :func:`url_problem`: a server URL is ``http://HOST:PORT`` or ``https://HOST:PORT`` (a port, if
  given, in 1..65535), as :class:`~bistat.engines.openai_http.OpenAIHTTPEngine` will use it;
- :func:`chosen_address_problems`: ``host`` / ``port`` given to a server bistat starts, which
  bistat chooses itself (a free loopback port per arm): a declared one would be passed to the
  server after bistat's own and the server would listen where bistat never asks;
- :func:`number_problems`: the HTTP client's settings (``retries``, ``request_timeout_s``, ...)
  of the right type and range;
- :func:`context_problems`: ``workload.max_tokens`` plus the longest prompt against a declared
  context length (vLLM's ``max_model_len``, SGLang's ``context_length``): a request longer than
  the context is refused by the engine, every time.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["HTTP_NUMBERS", "DeclaredContext", "arg_tables", "chosen_address_problems", "context_limits", "context_problems",
           "declared_at", "merged_args", "number_problems", "prompt_lengths", "url_problem"]

#: The HTTP client's numeric settings: key -> (integer?, least value, least allowed inclusive?)
HTTP_NUMBERS: dict[str, tuple[bool, float, bool]] = {
    "retries": (True, 0, True),
    "backoff_s": (False, 0, False),
    "max_retry_wait_s": (False, 0, True),
    "request_timeout_s": (False, 0, False),
    "metrics_interval_s": (False, 0, True),
    "health_timeout_s": (False, 0, False),
    "stop_grace_s": (False, 0, True),
    "start_timeout_s": (False, 0, False),
    "pass_idle_timeout_s": (False, 0, False),
}


def arg_tables(experiment: Any) -> list[tuple[str, dict[str, Any]]]:
    """``[("engine.args", {...}), ("arms[0].args", {...}), ...]``: each table of engine arguments
    as declared."""
    tables = [("engine.args", dict(experiment.engine.args))]
    tables += [(f"arms[{i}].args", dict(arm.args)) for i, arm in enumerate(experiment.arms)]
    return tables


def merged_args(experiment: Any, arm: Any) -> dict[str, Any]:
    """One arm's engine arguments: ``engine.args`` overridden by the arm's ``args``."""
    return {**dict(experiment.engine.args), **dict(arm.args)}


def declared_at(experiment: Any, index: int, key: str) -> str:
    """The field where arm ``index``'s value of ``key`` was declared (its own ``args`` win)."""
    arm = experiment.arms[index]
    return f"arms[{index}].args.{key}" if key in arm.args else f"engine.args.{key}"


def url_problem(value: Any) -> str | None:
    """Why ``value`` is not a server URL bistat can connect to, or None.

    >>> url_problem("http://127.0.0.1:8000") is None, url_problem("https://h.example/v1") is None
    (True, True)
    >>> url_problem("127.0.0.1:8000")
    "'127.0.0.1:8000' is not a server URL; write it as http://HOST:PORT or https://HOST:PORT, e.g. \\"http://127.0.0.1:8000\\""
    >>> url_problem("http://127.0.0.1:99999")
    "'http://127.0.0.1:99999': port 99999 is not in 1..65535"
    """
    import httpx

    example = 'write it as http://HOST:PORT or https://HOST:PORT, e.g. "http://127.0.0.1:8000"'
    if not isinstance(value, str) or not value.strip():
        return f"{value!r} is not a server URL; {example}"
    try:
        url = httpx.URL(value.strip())
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        text = str(exc)
        if "port" in text.lower():
            port = value.rsplit(":", 1)[-1].split("/")[0]
            return f"{value!r}: port {port} is not in 1..65535"
        return f"{value!r} is not a server URL ({text}); {example}"
    if url.scheme not in ("http", "https") or not url.host:
        return f"{value!r} is not a server URL; {example}"
    if url.port is not None and not 1 <= url.port <= 65535:   # pragma: no cover - httpx refuses
        return f"{value!r}: port {url.port} is not in 1..65535"
    return None


def chosen_address_problems(experiment: Any, kind: str, *, unless: str | None = None
                            ) -> list[tuple[str, str]]:
    """``host`` and ``port`` in the arguments of a server bistat starts per arm (``kind``): bistat
    picks a free loopback port for each arm's server and connects there, so a declared one
    would make the server listen where bistat never asks. ``unless``: an argument under which no
    server is started (``url``: attach to one instead)."""
    problems = []
    for table, args in arg_tables(experiment):
        if unless is not None and unless in args:
            continue
        for key in ("host", "port"):
            if key in args:
                problems.append((f"{table}.{key}", f"engine {kind!r} starts each arm's server "
                                 "itself on a free loopback port it chooses (and connects "
                                 f"there); remove {key}, or attach to a server you started with "
                                 "kind = \"openai\" and its url"))
    return problems


def number_problems(experiment: Any, keys: Iterable[str]) -> list[tuple[str, str]]:
    """Each of ``keys`` (:data:`HTTP_NUMBERS`) declared with a value of the wrong type or range."""
    problems = []
    wanted = [k for k in keys if k in HTTP_NUMBERS]
    for table, args in arg_tables(experiment):
        for key in wanted:
            if key not in args:
                continue
            value = args[key]
            integer, least, inclusive = HTTP_NUMBERS[key]
            kind_ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
                and not isinstance(value, bool)
            range_ok = kind_ok and (value >= least if inclusive else value > least)
            if not range_ok:
                what = "an integer" if integer else "a number"
                bound = f">= {least:g}" if inclusive else f"> {least:g}"
                problems.append((f"{table}.{key}", f"{value!r} is not {what} {bound}; write e.g. "
                                 f"{key} = {'2' if integer else '30.0'}"))
    return problems


def prompt_lengths(prompts: Sequence[Any] | None) -> tuple[int, str | None, bool]:
    """``(tokens, prompt id, exact)`` of the longest prompt whose length is known before an engine
    tokenizes it: token-id prompts have their length; a text prompt counts as 1 token (``exact``
    False: its length is the engine's tokenizer's)."""
    longest, pid, exact = 1, None, True
    for p in prompts or ():
        if isinstance(p.prompt, str):
            exact = False
            continue
        if len(p.prompt) > longest or pid is None:
            longest, pid = max(longest, len(p.prompt)), p.prompt_id
    if not prompts:
        exact = False
    return longest, pid, exact


def context_problems(experiment: Any, key: str, engine: str,
                     prompts: Sequence[Any] | None = None,
                     lengths: tuple[int, str | None, bool] | None = None,
                     default: int | None = None) -> list[tuple[str, str]]:
    """``workload.max_tokens`` against the context length ``key`` (``max_model_len``,
    ``context_length``) each arm declares (or ``default``): a request whose prompt and output
    cannot fit is refused by the engine, every time it is sent.

    ``lengths``: the longest prompt's ``(tokens, id, exact)`` (:func:`prompt_lengths` of
    ``prompts`` by default).
    """
    longest, pid, exact = lengths if lengths is not None else prompt_lengths(prompts)
    max_tokens = experiment.workload.max_tokens
    groups: dict[tuple[str | None, int], list[str]] = {}
    for i, arm in enumerate(experiment.arms):
        args = merged_args(experiment, arm)
        context = args.get(key, default)
        if context is None or isinstance(context, bool) or not isinstance(context, int):
            continue
        field = declared_at(experiment, i, key) if key in args else None
        groups.setdefault((field, context), []).append(arm.name)
    problems: list[tuple[str, str]] = []
    for (field, context), arms in groups.items():
        if longest + max_tokens <= context:
            continue
        where = (f"{field} = {context}" if field is not None
                 else f"{engine}'s default {key} = {context}")
        prompt = (f"the longest prompt ({pid}, {longest} tokens)" if exact and pid is not None
                  else "a prompt of even 1 token")
        fit = context - longest
        lower = (f"lower workload.max_tokens to at most {fit}" if fit >= 1
                 else "shorten the prompts")
        who = (f"arm {arms[0]!r}" if len(arms) == 1
               else "arms " + ", ".join(repr(a) for a in arms))
        problems.append(("workload.max_tokens",
                         f"{max_tokens} new tokens plus {prompt} exceed {where} ({who}): "
                         f"{engine} refuses every such request; {lower}, or raise {key}"))
    return problems


def context_limits(experiment: Any, kind: str, key: str, engine: str) -> list[str]:
    """The registration limit of an engine whose context length is its model's unless declared
    (``key``): the arms that declare none, in words; none when every arm declares it."""
    undeclared = [arm.name for arm in experiment.arms
                  if key not in {**dict(experiment.engine.args), **dict(arm.args)}]
    if not undeclared:
        return ["engine %r: a text prompt's length is %s's tokenizer's, so workload.max_tokens "
                "is checked against %s with the prompt counted as 1 token" % (kind, engine, key)]
    return [f"engine {kind!r}: workload.max_tokens against the model's context length, for arm"
            f"{'s' if len(undeclared) > 1 else ''} {', '.join(map(repr, undeclared))}: no {key} "
            f"is declared, so {engine} takes the model's own when it starts; declare "
            f"engine.args.{key} to have it checked at registration (a pass in which every "
            "request fails stops the run)"]


class DeclaredContext:
    """The context checks of an adapter whose context length is an engine argument
    (``CONTEXT_ARG``, named ``CONTEXT_ENGINE``'s in messages): ``workload.max_tokens`` with the
    longest prompt against a declared one (:func:`context_problems`), and, for the design report,
    the arms that declare none (:func:`context_limits`)."""

    kind: str
    CONTEXT_ARG = "max_model_len"
    CONTEXT_ENGINE = "vLLM"

    @classmethod
    def prompt_problems(cls, experiment: Any, prompts: Sequence[Any]) -> list[tuple[str, str]]:
        """``workload.max_tokens`` with the longest prompt against a declared context length."""
        return context_problems(experiment, cls.CONTEXT_ARG, cls.CONTEXT_ENGINE, prompts)

    @classmethod
    def declaration_limits(cls, experiment: Any) -> list[str]:
        """What registration cannot check: the context of arms that declare none."""
        return context_limits(experiment, cls.kind, cls.CONTEXT_ARG, cls.CONTEXT_ENGINE)
