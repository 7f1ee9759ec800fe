"""The OpenAI-compatible wire format of ``bistat serve``: request models and response bodies.

Requests are validated with pydantic v2; responses are plain dicts shaped like vLLM 0.25.0's
(``vllm/entrypoints/openai/protocol.py``): completions-style logprobs (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), vLLM's extensions ``top_k``,
``ignore_eos``, ``return_tokens_as_token_ids`` (tokens written ``"token_id:{id}"``) and
``return_token_ids`` (``choices[i].token_ids`` and ``prompt_token_ids``), and errors as
``{"error": {"message", "type", "param", "code"}}``.

Nothing here does I/O; ``bistat.engines.serve.server`` moves these bodies over HTTP.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bistat.engines.base import GenerationRequest, GenerationResult

#: Most alternatives per position a request may ask for (vLLM's default ``--max-logprobs``).
MAX_LOGPROBS = 20


class RequestError(Exception):
    """A request the server rejects with an OpenAI-style 4xx error."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_


def error_body(message: str, *, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:  # vLLM: 0 and -1 both mean "off"
            return -1
        if value < -1:
            raise ValueError("top_k must be -1 (off) or a positive integer")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported; send the prompt several times instead")
        return value

    @field_validator("stream")
    @classmethod
    def _stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("streaming is not supported by bistat serve; send stream=false")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings are allowed, got {len(stops)}")
        return stops or None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by bistat serve")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per choice (a batch prompt is a list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if len(p) == 0:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


@dataclass(frozen=True)
class Choice:
    """One finished prompt, ready to be written into a response."""

    result: GenerationResult
    prompt_token_ids: list[int] | None


def generation_request(
    body: _SamplingFields, prompt: str | list[int], *, max_tokens: int, logprobs: int | None,
    chat: bool,
) -> GenerationRequest:
    """The engine request for one prompt of a validated body."""
    return GenerationRequest(
        prompt_id=uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        logprobs=max(1, logprobs or 0),
        ignore_eos=body.ignore_eos,
        chat=chat,
    )


def apply_stop(result: GenerationResult, stops: Sequence[str] | None, decode) -> GenerationResult:
    """Cut a finished result at the first stop string, as vLLM reports it.

    The engine has no stop strings, so they are applied to the finished output: the returned
    token ids end with the token that completed the stop string, the text ends just before it,
    and ``finish_reason`` is ``"stop"``. The output is the same as with an early stop; only the
    compute for the tokens after it is spent.
    """
    if not stops or result.error is not None:
        return result
    ids = result.token_ids
    first = min((i for i in (result.text.find(s) for s in stops) if i >= 0), default=-1)
    if first < 0:
        return result
    n = len(ids)
    for k in range(1, len(ids) + 1):  # smallest prefix whose text reaches past the stop's start
        prefix = decode(ids[:k])
        if any(prefix.find(s) >= 0 for s in stops):
            n = k
            break
    cut = lambda xs: None if xs is None else list(xs[:n])  # noqa: E731
    return GenerationResult(
        prompt_id=result.prompt_id, token_ids=list(ids[:n]), text=result.text[:first],
        logprobs=cut(result.logprobs), top_logprobs=cut(result.top_logprobs),
        finish_reason="stop", n_prompt_tokens=result.n_prompt_tokens, t_submit=result.t_submit,
        t_first_token=result.t_first_token, t_done=result.t_done, error=None,
        attempts=result.attempts,
    )


def _token_string(token_id: int, as_ids: bool, decode) -> str:
    return f"token_id:{token_id}" if as_ids else decode([token_id])


def _top_list(result: GenerationResult, i: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` best alternatives at position ``i``, plus the chosen token (as vLLM does)."""
    chosen = result.token_ids[i]
    alts = list(result.top_logprobs[i]) if result.top_logprobs is not None else []
    alts.sort(key=lambda pair: -pair[1])
    top = [(int(t), float(lp)) for t, lp in alts[:k]]
    if result.logprobs is not None and all(t != chosen for t, _ in top):
        top.insert(0, (int(chosen), float(result.logprobs[i])))
    return top


def _usage(choices: Sequence[Choice]) -> dict[str, int]:
    prompt = sum(c.result.n_prompt_tokens or 0 for c in choices)
    completion = sum(len(c.result.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(
    body: CompletionRequest, choices: Sequence[Choice], *, model_name: str, decode
) -> dict[str, Any]:
    """The ``text_completion`` response for finished choices."""
    out = []
    for index, choice in enumerate(choices):
        r = choice.result
        logprobs = None
        if body.logprobs is not None and r.logprobs is not None:
            tokens = [_token_string(t, body.return_tokens_as_token_ids, decode) for t in r.token_ids]
            offsets, pos = [], 0
            for tok in tokens:
                offsets.append(pos)
                pos += len(tok)
            top = [
                {_token_string(t, body.return_tokens_as_token_ids, decode): lp
                 for t, lp in _top_list(r, i, body.logprobs)}
                for i in range(len(r.token_ids))
            ]
            logprobs = {"text_offset": offsets, "token_logprobs": [float(x) for x in r.logprobs],
                        "tokens": tokens, "top_logprobs": top}
        entry: dict[str, Any] = {"index": index, "text": r.text, "logprobs": logprobs,
                                 "finish_reason": r.finish_reason, "stop_reason": None,
                                 "prompt_logprobs": None}
        if body.return_token_ids:
            entry["token_ids"] = list(r.token_ids)
            entry["prompt_token_ids"] = choice.prompt_token_ids
        out.append(entry)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name, "choices": out,
            "usage": _usage(choices)}


def chat_body(
    body: ChatCompletionRequest, choice: Choice, *, model_name: str, decode
) -> dict[str, Any]:
    """The ``chat.completion`` response for one finished choice."""
    r = choice.result
    logprobs = None
    if body.logprobs and r.logprobs is not None:
        k = body.top_logprobs or 0
        as_ids = body.return_tokens_as_token_ids
        content = []
        for i, token_id in enumerate(r.token_ids):
            tok = _token_string(token_id, as_ids, decode)
            alts = [{"token": _token_string(t, as_ids, decode), "logprob": lp,
                     "bytes": list(_token_string(t, as_ids, decode).encode())}
                    for t, lp in _top_list(r, i, k)[:k]] if k else []
            content.append({"token": tok, "logprob": float(r.logprobs[i]),
                            "bytes": list(tok.encode()), "top_logprobs": alts})
        logprobs = {"content": content}
    entry: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": logprobs, "finish_reason": r.finish_reason,
                             "stop_reason": None}
    if body.return_token_ids:
        entry["token_ids"] = list(r.token_ids)
        entry["prompt_token_ids"] = choice.prompt_token_ids
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model_name, "choices": [entry],
            "usage": _usage([choice])}
