"""Reading an OpenAI-compatible server's answers: a completion's choice (token ids, text, logprobs,
top logprobs, finish reason, prompt length: :func:`parse_completion_choice`, whose fields an
adapter's ``parse_answer`` returns as a :class:`ParsedAnswer`; the token ids as
vLLM's ``return_token_ids`` and ``return_tokens_as_token_ids`` give them), the continuation's
logprobs in an answer's ``prompt_logprobs`` (:func:`parse_prompt_logprobs`), and what a server
declares about itself at start, from ``/version`` and ``/v1/models`` (:func:`server_report`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from bistat.engines.base import EngineError, EngineUnsupported


class ParsedAnswer(NamedTuple):
    """One generation answer as an HTTP adapter read it: what
    :class:`~bistat.engines.base.GenerationResult` records of the answer itself.

    ``preemptions`` is how often the engine preempted (retracted) the request, for engines whose
    answers say so (SGLang's ``meta_info.num_retractions``); None where the answer does not.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    n_prompt_tokens: int | None
    preemptions: int | None = None


def _parse_token(token: str) -> int:
    """``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not of the form 'token_id:N'")
    return int(token[len("token_id:"):])


def parse_completion_choice(
    data: Any, *, chat: bool
) -> tuple[list[int], str, list[float] | None, list[list[tuple[int, float]]] | None, str | None, int | None]:
    """Token ids, text, logprobs, top logprobs, finish reason and prompt length of an answer.

    Raises ``ValueError`` (or ``KeyError``/``TypeError``) when the body is not shaped like an
    OpenAI completion with token ids.
    """
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    lp = choice.get("logprobs")
    logprobs = top = None
    ids_from_tokens: list[int] | None = None
    if lp is not None:
        if chat:
            content = lp["content"] or []
            ids_from_tokens = [_parse_token(c["token"]) for c in content]
            logprobs = [float(c["logprob"]) for c in content]
            top = [sorted(((_parse_token(a["token"]), float(a["logprob"])) for a in c["top_logprobs"] or []),
                          key=lambda p: -p[1]) for c in content]
        else:
            ids_from_tokens = [_parse_token(t) for t in lp["tokens"]]
            logprobs = [float(x) for x in lp["token_logprobs"]]
            top = [sorted(((_parse_token(k), float(v)) for k, v in (d or {}).items()),
                          key=lambda p: -p[1]) for d in lp["top_logprobs"]]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = ids_from_tokens
    if token_ids is None:
        raise ValueError("the answer has neither token_ids nor logprobs tokens; the server must "
                         "support return_token_ids or return_tokens_as_token_ids")
    token_ids = [int(t) for t in token_ids]
    if ids_from_tokens is not None and ids_from_tokens != token_ids:
        raise ValueError("token_ids and the logprobs' tokens disagree")
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    if not isinstance(text, str):
        raise ValueError("the answer's text is not a string")
    n_prompt = None
    if choice.get("prompt_token_ids") is not None:
        n_prompt = len(choice["prompt_token_ids"])
    elif isinstance(data.get("usage"), dict) and data["usage"].get("prompt_tokens") is not None:
        n_prompt = int(data["usage"]["prompt_tokens"])
    return token_ids, text, logprobs, top, choice.get("finish_reason"), n_prompt


def parse_prompt_logprobs(data: Any, n_prompt: int, continuation: Sequence[int], *,
                          where: str = "the server") -> list[float]:
    """The continuation tokens' logprobs from a completion answer's ``prompt_logprobs``.

    vLLM returns one entry per prompt token (the first is null): a mapping from token id (as a
    string) to ``{"logprob": x, "rank": r, ...}`` (or to the bare logprob), holding at least the
    token actually at that position.

    Raises
    ------
    EngineUnsupported
        The answer has no ``prompt_logprobs`` (the server ignores the field).
    EngineError
        The list is too short or lacks a continuation token.
    """
    try:
        plp = data["choices"][0].get("prompt_logprobs")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise EngineError(f"{where}: not a completion answer ({type(exc).__name__}: {exc})") from exc
    if plp is None:
        raise EngineUnsupported(f"{where} returned no prompt_logprobs (the server does not "
                                "support vLLM's prompt_logprobs request field)")
    if not isinstance(plp, list) or len(plp) < n_prompt + len(continuation):
        raise EngineError(f"{where}: prompt_logprobs has {len(plp) if isinstance(plp, list) else 0}"
                          f" entries for {n_prompt + len(continuation)} prompt tokens")
    out: list[float] = []
    for j, tok in enumerate(continuation):
        entry = plp[n_prompt + j]
        got = entry.get(str(int(tok))) if isinstance(entry, dict) else None
        if got is None and isinstance(entry, dict):
            got = entry.get(f"token_id:{int(tok)}")
        if isinstance(got, dict):
            got = got.get("logprob")
        if got is None:
            raise EngineError(f"{where}: prompt_logprobs at position {n_prompt + j} lacks token "
                              f"{int(tok)}")
        out.append(float(got))
    return out


#: longest text kept of one value a server declares
_REPORTED_MAX = 200


def _scalars(data: Any, keys: int = 40) -> dict[str, Any] | None:
    """The first ``keys`` scalar entries of a JSON object (strings cut at 200 characters), sorted
    by key; None for anything else."""
    if not isinstance(data, dict):
        return None
    out = {}
    for key in sorted(data, key=str)[:keys]:
        value = data[key]
        if isinstance(value, str):
            out[str(key)] = value[:_REPORTED_MAX]
        elif value is None or isinstance(value, (bool, int, float)):
            out[str(key)] = value
    return out


def server_report(version: Any, model: Any) -> dict[str, Any]:
    """What a server declares about itself, as an ``openai`` arm records it: its ``GET /version``
    answer (``version``: bistat serve's is ``{"version", "server", "engine", "gemm", ...}``,
    vLLM's ``{"version"}``) and its ``GET /v1/models`` entry for the served model (``model``:
    ``max_model_len``, ``owned_by``, ``root`` where it says them), each a JSON object of scalars,
    None where the server answered nothing readable.

    >>> server_report({"version": "0.1.0", "gemm": "blas", "nested": {}}, {"id": "m", "max_model_len": 2048})
    {'version': {'gemm': 'blas', 'version': '0.1.0'}, 'model': {'id': 'm', 'max_model_len': 2048}}
    """
    entry = _scalars(model)
    if entry is not None:   # what the model entry says of the server, not when it was listed
        entry = {k: v for k, v in entry.items() if k in ("id", "max_model_len", "owned_by", "root")}
    return {"version": _scalars(version), "model": entry}
