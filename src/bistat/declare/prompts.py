"""Prompt sources: the prompts a run or a probe sends, built deterministically from a declaration.

They belong to the declaration (``workload.source``, ``workload.n_prompts``): ``bistat register``
reads them as the run will (:func:`bistat.declare.prereg.registration_problems`), so a source
that cannot give the declared prompts is refused before anything is sealed; the requests of a
pass are built from them by :mod:`bistat.run.workload`.

Three sources, named by the declaration's ``workload.source``:

``builtin:chat``
    A deterministic generator of diverse chat questions: :data:`CHAT_TOPICS` × :data:`CHAT_TEMPLATES`
    (1,200 distinct questions), visited in an order that spreads topics and templates (prompt ``i``
    takes topic ``i mod 40`` and template ``(i // 40 + 7 i) mod 30``; the map is a bijection on
    ``0 … 1199``), so the first few dozen prompts already differ in topic, form and length. Each
    prompt is a single user message (``chat = True``): the engine applies its own chat template.
``builtin:token-ids``
    Seeded random token-id prompts for models with synthetic weights, where text is meaningless.
    Parameters follow a ``?``: ``builtin:token-ids?length=32&vocab=32000&low=3`` (defaults shown):
    each prompt has ``length`` ids drawn uniformly from ``[low, vocab)`` by
    ``numpy.random.default_rng(SeedSequence([seed, index]))`` — prompt ``i`` is the same whatever
    ``n_prompts`` is. ``low`` keeps the special tokens at the bottom of most vocabularies out.
``file:PATH.jsonl``
    One JSON object per line: ``{"id": ..., "prompt": "..."}`` (raw text), ``{"id": ...,
    "messages": [{"role": "user", "content": "..."}]}`` (one user message: a chat prompt) or
    ``{"id": ..., "token_ids": [...]}``. ``id`` is optional (default: the 0-based line number of
    the prompt) and must be unique. A relative ``PATH`` is resolved against ``base_dir`` (the
    current directory unless the caller says otherwise). Blank lines are skipped. The first
    ``n_prompts`` prompts are used; a file with fewer is an error.

Every error names the source (file and line where there is one), what was wrong, and the fix.
"""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from bistat.engines.base import GenerationRequest

__all__ = [
    "CHAT_CAPACITY",
    "CHAT_TEMPLATES",
    "CHAT_TOPICS",
    "SOURCES",
    "Prompt",
    "WorkloadError",
    "builtin_chat_prompts",
    "file_prompts",
    "load_prompts",
    "prompts_sha256",
    "token_id_prompts",
]

SOURCES = ("builtin:chat", "builtin:token-ids", "file:PATH.jsonl")


class WorkloadError(ValueError):
    """A prompt source could not be read or does not hold what the declaration asks for."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload.

    ``prompt`` is text (``chat`` says whether it is a user message to wrap in the engine's chat
    template, or raw text) or a tuple of token ids. ``index`` is its 0-based position in the
    workload; ``prompt_id`` is a stable string id recorded with every response.
    """

    prompt_id: str
    index: int
    prompt: str | tuple[int, ...]
    chat: bool

    def request(
        self,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        ignore_eos: bool,
        logprobs: int = 1,
    ) -> GenerationRequest:
        """The engine request for this prompt with the given sampling settings."""
        prompt: str | list[int] = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        return GenerationRequest(
            prompt_id=self.prompt_id,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            chat=self.chat,
        )


# --------------------------------------------------------------------------------------------
# builtin:chat
# --------------------------------------------------------------------------------------------

CHAT_TOPICS: tuple[str, ...] = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest",
    "the water cycle", "public-key cryptography", "the Roman Empire", "plate tectonics",
    "vaccines", "the stock market", "climate change", "the human heart", "machine learning",
    "the printing press", "volcanoes", "inflation", "honeybees", "the Moon landing",
    "recursion in programming", "the Silk Road", "antibiotics", "electric cars", "jazz music",
    "the immune system", "coral reefs", "the Industrial Revolution", "prime numbers",
    "sleep", "the Great Wall of China", "solar panels", "DNA", "ancient Egypt",
    "supply and demand", "earthquakes", "the internet", "chess openings", "bread baking",
    "the theory of evolution", "rainbows", "democracy",
)

CHAT_TEMPLATES: tuple[str, ...] = (
    "Explain {t} to a ten-year-old.",
    "What are the three most important facts about {t}?",
    "Write a short poem about {t}.",
    "Give me a step-by-step explanation of {t}.",
    "What is a common misconception about {t}, and what is the truth?",
    "Summarize the history of {t} in one paragraph.",
    "How would you teach {t} to a university student in five minutes?",
    "List five questions a curious person might ask about {t}, with short answers.",
    "Compare {t} with something from everyday life.",
    "Why does {t} matter today?",
    "Write a dialogue between a teacher and a student about {t}.",
    "What would happen if {t} did not exist?",
    "Describe {t} in exactly three sentences.",
    "What are the pros and cons of learning about {t}?",
    "Tell me a surprising story involving {t}.",
    "Write a haiku about {t}, then explain it.",
    "What vocabulary should I know before studying {t}? Define each term.",
    "Create a short quiz with answers about {t}.",
    "How has our understanding of {t} changed over time?",
    "Explain {t} using an analogy with cooking.",
    "What are the key numbers someone should remember about {t}?",
    "Write a news headline and a short article about {t}.",
    "If you had to give a one-minute speech on {t}, what would you say?",
    "What careers involve {t}, and what do those people do all day?",
    "Describe {t} as if you were a pirate.",
    "What experiment could a student do at home to learn about {t}?",
    "What are the open questions about {t}?",
    "Write a limerick about {t}.",
    "Explain the cause and effect relationships in {t}.",
    "Give a detailed outline for an essay on {t}.",
)

_N_TOPICS = len(CHAT_TOPICS)
_N_TEMPLATES = len(CHAT_TEMPLATES)
CHAT_CAPACITY = _N_TOPICS * _N_TEMPLATES


def _chat_cell(index: int) -> tuple[int, int]:
    """(topic, template) of builtin chat prompt ``index``; a bijection on ``range(CHAT_CAPACITY)``.

    ``index = r * T + c`` (``T`` topics) maps to topic ``c`` and template ``(r + 7 c) mod M``
    (``M`` templates): for a fixed topic ``c``, ``r ↦ (r + 7 c) mod M`` is a bijection, so every
    cell is reached exactly once.
    """
    r, c = divmod(index, _N_TOPICS)
    return c, (r + 7 * c) % _N_TEMPLATES


def builtin_chat_prompts(n_prompts: int) -> list[Prompt]:
    """The first ``n_prompts`` built-in chat questions (at most :data:`CHAT_CAPACITY`).

    Examples
    --------
    >>> [p.prompt for p in builtin_chat_prompts(2)]
    ['Explain photosynthesis to a ten-year-old.', 'List five questions a curious person might ask about the French Revolution, with short answers.']
    """
    if n_prompts > CHAT_CAPACITY:
        raise WorkloadError(
            f"builtin:chat: n_prompts = {n_prompts} but the built-in chat source holds "
            f"{CHAT_CAPACITY} distinct prompts; lower workload.n_prompts or use a file:PATH.jsonl source"
        )
    prompts = []
    for i in range(n_prompts):
        topic, template = _chat_cell(i)
        text = CHAT_TEMPLATES[template].format(t=CHAT_TOPICS[topic])
        prompts.append(Prompt(prompt_id=f"chat-{i:04d}", index=i, prompt=text, chat=True))
    return prompts


# --------------------------------------------------------------------------------------------
# builtin:token-ids
# --------------------------------------------------------------------------------------------

_TOKEN_ID_PARAMS = {"length": 32, "vocab": 32000, "low": 3}


def _token_id_params(source: str) -> dict[str, int]:
    _, _, query = source.partition("?")
    params = dict(_TOKEN_ID_PARAMS)
    for key, values in urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        if key not in params:
            raise WorkloadError(
                f"{source}: unknown parameter {key!r}; expected one of "
                + ", ".join(repr(k) for k in _TOKEN_ID_PARAMS)
            )
        try:
            params[key] = int(values[-1])
        except ValueError as exc:
            raise WorkloadError(f"{source}: parameter {key!r} must be an integer, got {values[-1]!r}") from exc
    if params["length"] < 1:
        raise WorkloadError(f"{source}: length must be at least 1, got {params['length']}")
    if not 0 <= params["low"] < params["vocab"]:
        raise WorkloadError(
            f"{source}: need 0 <= low < vocab, got low={params['low']}, vocab={params['vocab']}; "
            "set vocab to the model's vocabulary size"
        )
    return params


def token_id_prompts(n_prompts: int, seed: int, *, length: int = 32, vocab: int = 32000, low: int = 3) -> list[Prompt]:
    """``n_prompts`` seeded random token-id prompts of ``length`` ids drawn from ``[low, vocab)``.

    Prompt ``i`` depends only on ``(seed, i)``, not on ``n_prompts``.
    """
    prompts = []
    for i in range(n_prompts):
        rng = np.random.default_rng(np.random.SeedSequence([seed, i]))
        ids = tuple(int(x) for x in rng.integers(low, vocab, size=length))
        prompts.append(Prompt(prompt_id=f"ids-{i:04d}", index=i, prompt=ids, chat=False))
    return prompts


# --------------------------------------------------------------------------------------------
# file:PATH.jsonl
# --------------------------------------------------------------------------------------------


def _file_prompt(obj: object, where: str, index: int) -> Prompt:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = [k for k in ("prompt", "messages", "token_ids") if k in obj]
    if len(kinds) != 1:
        raise WorkloadError(
            f"{where}: expected exactly one of 'prompt', 'messages', 'token_ids', got "
            + (", ".join(repr(k) for k in kinds) if kinds else "none")
        )
    unknown = sorted(set(obj) - {"id", "prompt", "messages", "token_ids"})
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field(s) {', '.join(repr(k) for k in unknown)}; "
            "allowed: 'id', 'prompt', 'messages', 'token_ids'"
        )
    raw_id = obj.get("id", index)
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise WorkloadError(f"{where}: 'id' must be a string or an integer, got {raw_id!r}")
    prompt_id = str(raw_id)
    kind = kinds[0]
    value = obj[kind]
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(prompt_id=prompt_id, index=index, prompt=value, chat=False)
    if kind == "token_ids":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
        ):
            raise WorkloadError(f"{where}: 'token_ids' must be a non-empty list of non-negative integers")
        return Prompt(prompt_id=prompt_id, index=index, prompt=tuple(value), chat=False)
    # messages: the engine protocol carries one user message (chat=True); the engine applies
    # its own chat template. Multi-turn conversations would need the template applied here.
    if (
        not isinstance(value, list)
        or len(value) != 1
        or not isinstance(value[0], dict)
        or value[0].get("role") != "user"
        or not isinstance(value[0].get("content"), str)
    ):
        raise WorkloadError(
            f"{where}: 'messages' must hold exactly one {{\"role\": \"user\", \"content\": \"...\"}} "
            "message; for other conversations apply the chat template yourself and use 'prompt'"
        )
    return Prompt(prompt_id=prompt_id, index=index, prompt=value[0]["content"], chat=True)


def file_prompts(path: Path, n_prompts: int, *, label: str | None = None) -> list[Prompt]:
    """The first ``n_prompts`` prompts of a JSONL file (see the module docstring for the format)."""
    label = label or str(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise WorkloadError(f"{label}: prompt file not found; check workload.source") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{label}: cannot read prompt file: {exc}") from exc
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if len(prompts) == n_prompts:
            break
        if not line.strip():
            continue
        where = f"{label}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        prompt = _file_prompt(obj, where, len(prompts))
        if prompt.prompt_id in seen:
            raise WorkloadError(
                f"{where}: duplicate id {prompt.prompt_id!r} (first on line {seen[prompt.prompt_id]}); ids must be unique"
            )
        seen[prompt.prompt_id] = lineno
        prompts.append(prompt)
    if len(prompts) < n_prompts:
        raise WorkloadError(
            f"{label}: holds {len(prompts)} prompts but workload.n_prompts = {n_prompts}; "
            "add prompts or lower n_prompts"
        )
    return prompts


# --------------------------------------------------------------------------------------------
# dispatch and per-pass requests
# --------------------------------------------------------------------------------------------


def load_prompts(source: str, n_prompts: int, seed: int, *, base_dir: Path | None = None) -> list[Prompt]:
    """The workload's prompts from a declared ``source`` (see the module docstring).

    Raises
    ------
    WorkloadError
        unknown source, unreadable or malformed file (naming file and line), too few prompts.
    """
    if n_prompts < 1:
        raise WorkloadError(f"workload.n_prompts must be at least 1, got {n_prompts}")
    if source == "builtin:chat":
        return builtin_chat_prompts(n_prompts)
    if source == "builtin:token-ids" or source.startswith("builtin:token-ids?"):
        return token_id_prompts(n_prompts, seed, **_token_id_params(source))
    if source.startswith("file:"):
        raw = source[len("file:"):]
        if not raw:
            raise WorkloadError("workload.source 'file:' names no file; write file:PATH.jsonl")
        path = Path(raw)
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        return file_prompts(path, n_prompts, label=raw)
    raise WorkloadError(
        f"workload.source: unknown source {source!r}; expected one of " + ", ".join(repr(s) for s in SOURCES)
    )


def prompts_sha256(prompts: Iterable[Prompt]) -> str:
    """The SHA-256 of a workload's prompts (ids, indexes, contents, chat flags, in order): the
    ``workload_sha256`` of ``run.json``, by which a resumed run or a probe's ``--needle-from``
    knows that it has the prompts a run was recorded with."""
    data = [[p.prompt_id, p.index, p.prompt if isinstance(p.prompt, str) else list(p.prompt), p.chat]
            for p in prompts]
    return hashlib.sha256(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
