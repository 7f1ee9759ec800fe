"""The request fields of vLLM's and SGLang's OpenAI-compatible servers that ``bistat serve`` does
not implement: honoured where it can, accepted where they cannot change this model's output,
refused where they would.

A client written for those servers sends more than the OpenAI API: a determinism-testing
client's standard chat payload carries ``chat_template_kwargs = {"enable_thinking": false}``,
``reasoning_effort`` and similar switches besides ``logprobs``. Refusing them all turns such a
client away (and one that then retries without logprobs silently loses its bitwise check);
ignoring them all would let a value that changes the output pass unnoticed. So each field is one
of (:func:`foreign_fields`):

* a **chat-template variable** (``chat_template_kwargs``' keys, ``reasoning_effort``,
  ``documents``, ``tools``): passed to the template when the model's template reads it
  (honoured), accepted when it does not -- the template renders the same prompt without it
  (``enable_thinking`` for a template without a thinking switch, a reasoning effort for a model
  without reasoning);
* a **sampling or output field** with a value that changes nothing (:data:`FOREIGN`:
  ``presence_penalty = 0``, ``repetition_penalty = 1``, ``response_format = {"type":
  "text"}``, ...): accepted at that value, refused at any other, naming what it would change;
* a **field without effect on the output** (``user``, ``metadata``, ``request_id``,
  ``include_reasoning`` for a model without reasoning, ...): accepted whatever its value.

Every field accepted without effect is recorded: the server logs it once per field and value
(``bistat.engines.serve.server``). A field neither bistat serve nor those servers know is refused
naming the closest known field, as before: a misspelt ``"temprature": 0`` would otherwise sample
at temperature 1.

The fields are those of vLLM 0.10's ``vllm/entrypoints/openai/protocol.py``
(``ChatCompletionRequest``, ``CompletionRequest``) and SGLang 0.5's
``sglang/srt/entrypoints/openai/protocol.py`` (its additions: ``separate_reasoning``,
``stream_reasoning``, ``rid``, ``no_stop_trim``, ``return_hidden_states``, ``lora_path``,
``session_params``, ``ebnf``, ``regex``, ``json_schema``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bistat.engines.serve.protocol import RequestError

__all__ = ["FOREIGN", "TEMPLATE_FIELDS", "FieldDecision", "Foreign", "foreign_fields"]


def _is(*values: Any) -> Callable[[Any], bool]:
    """True for the ``values`` (``None`` as ``None``, booleans as booleans, numbers as numbers:
    ``0`` and ``0.0`` alike, ``False`` never as ``0``)."""
    def check(v: Any) -> bool:
        for x in values:
            if x is None or isinstance(x, bool):
                if v is x:
                    return True
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and v == x:
                return True
        return False
    return check


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


@dataclass(frozen=True)
class Foreign:
    """A field vLLM's or SGLang's OpenAI server accepts that bistat serve does not implement.

    Attributes
    ----------
    name : str
    neutral : callable
        True for the values that cannot change the output.
    effect : str
        What the field does, in words (why another value is refused; why it is accepted).
    send : str
        How to send it so that it changes nothing (``""``: any value does).
    """

    name: str
    neutral: Callable[[Any], bool]
    effect: str
    send: str = ""


_NO_EFFECT = "does not change the tokens generated"
FOREIGN: dict[str, Foreign] = {f.name: f for f in (
    # sampling: each changes the tokens away from its neutral value
    Foreign("presence_penalty", _is(0, None), "penalises tokens already present", "0"),
    Foreign("frequency_penalty", _is(0, None), "penalises tokens by their count", "0"),
    Foreign("repetition_penalty", _is(1, None), "penalises repeated tokens", "1"),
    Foreign("min_p", _is(0, None), "drops tokens below a share of the best one's probability",
            "0"),
    Foreign("min_tokens", _is(0, None), "forbids end-of-sequence before that many tokens", "0"),
    Foreign("length_penalty", _is(1, None), "weighs beam-search candidates by length", "1"),
    Foreign("use_beam_search", _is(False, None), "replaces sampling by beam search", "false"),
    Foreign("best_of", _is(1, None), "samples several candidates and keeps the best", "1"),
    Foreign("logit_bias", _empty, "adds biases to the logits", "{}"),
    Foreign("allowed_token_ids", _empty, "restricts sampling to the tokens listed", "null"),
    Foreign("bad_words", _empty, "forbids the words listed", "[]"),
    Foreign("stop_token_ids", _empty, "stops at the token ids listed", "[]"),
    Foreign("logits_processors", _empty, "runs the server's logits processors", "null"),
    Foreign("vllm_xargs", _empty, "passes arguments to the server's extensions", "null"),
    # structured output
    Foreign("response_format", lambda v: v is None or v == {"type": "text"},
            "constrains the output to a format", '{"type": "text"}'),
    *(Foreign(name, _empty, "constrains the output to a grammar", "null") for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
        "guided_decoding_backend", "guided_whitespace_pattern", "ebnf", "regex", "json_schema")),
    # the prompt and the text returned
    Foreign("truncate_prompt_tokens", _is(None), "cuts the prompt to its last tokens", "null"),
    Foreign("prompt_logprobs", _is(None), "asks for the prompt's logprobs", "null"),
    Foreign("suffix", _empty, "appends a suffix to the completion", "null"),
    Foreign("include_stop_str_in_output", _is(False, None), "keeps the stop string in the text",
            "false"),
    Foreign("skip_special_tokens", _is(True, None), "writes special tokens into the text",
            "true"),
    Foreign("spaces_between_special_tokens", _is(True, None),
            "changes the spacing of special tokens in the text", "true"),
    Foreign("no_stop_trim", _is(False, None), "keeps the stop string in the text", "false"),
    Foreign("continue_final_message", _is(False, None), "continues the last message instead of "
            "starting the assistant's turn", "false"),
    Foreign("echo", _is(False, None), "writes the prompt (or the last message) before the "
            "output", "false"),
    Foreign("stream_options", _empty, "sets what a stream reports (streaming is off)", "null"),
    Foreign("return_hidden_states", _is(False, None), "returns hidden states", "false"),
    Foreign("priority", _is(0, None), "schedules the request before others, which changes the "
            "batches it runs in", "0"),
    Foreign("lora_path", _empty, "applies a LoRA adapter", "null"),
    Foreign("session_params", _empty, "continues an earlier session's cache", "null"),
    Foreign("kv_transfer_params", _empty, "moves the KV cache between servers", "null"),
    Foreign("mm_processor_kwargs", _empty, "configures a multimodal processor (the model has "
            "none)", "null"),
    # no effect on the output, whatever the value (the model has no reasoning, no tools parser,
    # no prefix cache)
    *(Foreign(name, lambda v: True, _NO_EFFECT) for name in (
        "user", "metadata", "store", "service_tier", "request_id", "rid", "cache_salt",
        "include_reasoning", "separate_reasoning", "stream_reasoning", "parallel_tool_calls")),
)}

#: Fields whose values are chat-template variables: the field -> the variable it sets.
TEMPLATE_FIELDS = {"reasoning_effort": "reasoning_effort", "documents": "documents",
                   "tools": "tools"}


@dataclass(frozen=True)
class FieldDecision:
    """What the server does with a request's foreign fields (:func:`foreign_fields`).

    Attributes
    ----------
    template_variables : dict
        Variables to pass to the chat template (it reads them): honoured.
    accepted : tuple of (str, object, str)
        Fields accepted without effect: the field (``chat_template_kwargs.enable_thinking`` for
        a template variable), its value, and why it changes nothing.
    """

    template_variables: Mapping[str, Any]
    accepted: tuple[tuple[str, Any, str], ...]


def _template_variable(field: str, variable: str, value: Any, reads: frozenset[str],
                       chat: bool, honoured: dict[str, Any],
                       accepted: list[tuple[str, Any, str]]) -> None:
    if variable in reads and chat:
        honoured[variable] = value
    elif variable in reads:
        raise RequestError(f"{field}: the chat template reads {variable!r}, but "
                           "/v1/completions renders no template; send it to "
                           "/v1/chat/completions", param=field)
    else:
        accepted.append((field, value, f"this model's chat template does not read {variable!r}, "
                                        "so the prompt is the same without it"))


def foreign_fields(data: Mapping[str, Any], known: Iterable[str], *, chat: bool,
                   template_reads: frozenset[str]) -> FieldDecision:
    """Sort a request's fields that the endpoint's model does not declare (see the module
    docstring).

    Parameters
    ----------
    data : mapping
        The request body.
    known : iterable of str
        The fields the endpoint implements (its pydantic model's).
    chat : bool
        ``/v1/chat/completions`` (a chat template is rendered) or ``/v1/completions``.
    template_reads : frozenset of str
        The variables the model's chat template reads.

    Raises
    ------
    RequestError
        A field at a value that would change the output, a template variable the template reads
        on an endpoint that renders none, tools the template renders (bistat serve parses no
        tool calls) or a ``tool_choice`` that needs a tool call, or a field nobody knows (naming
        the closest known one).
    """
    known = set(known)
    honoured: dict[str, Any] = {}
    accepted: list[tuple[str, Any, str]] = []
    for name in sorted(set(data) - known):
        value = data[name]
        if name == "chat_template_kwargs":
            if not isinstance(value, Mapping):
                raise RequestError("chat_template_kwargs: must be an object of template "
                                   "variables", param=name)
            for variable, v in sorted(value.items()):
                _template_variable(f"{name}.{variable}", str(variable), v, template_reads, chat,
                                   honoured, accepted)
        elif name in TEMPLATE_FIELDS:
            variable = TEMPLATE_FIELDS[name]
            if name == "tools" and variable in template_reads and not _empty(value):
                raise RequestError("tools: this model's chat template renders them, and bistat "
                                   "serve parses no tool calls from the output; leave tools out",
                                   param=name)
            if not _empty(value):
                _template_variable(name, variable, value, template_reads, chat, honoured,
                                   accepted)
        elif name == "add_special_tokens":   # vLLM's default: false for chat, true otherwise
            if value is not (not chat):
                raise RequestError(f"add_special_tokens = {value!r} changes the prompt's special "
                                   f"tokens, which bistat serve does not implement; send "
                                   f"{str(not chat).lower()} (vLLM's default here) or leave it "
                                   "out", param=name)
            accepted.append((name, value, "vLLM's default for this endpoint"))
        elif name == "tool_choice":
            if value not in (None, "none", "auto"):
                raise RequestError(f"tool_choice: {value!r} needs a tool call, which bistat serve "
                                   "does not make; send \"none\" or \"auto\" or leave it out",
                                   param=name)
            accepted.append((name, value, "bistat serve makes no tool calls: the model answers "
                                          "in text, as a model that chose no tool"))
        elif name in FOREIGN:
            f = FOREIGN[name]
            if not f.neutral(value):
                raise RequestError(f"{name} = {value!r} {f.effect}, which bistat serve does not "
                                   f"implement; send {f.send} or leave it out", param=name)
            accepted.append((name, value, f"it {f.effect}" if not f.send
                             else f"{f.send} is the value that changes nothing"))
        else:
            raise unknown_field(name, known)
    return FieldDecision(honoured, tuple(accepted))


def unknown_field(name: str, known: Iterable[str]) -> RequestError:
    """The 400 for a request field nobody knows: it would otherwise be ignored (a misspelt
    ``"temprature": 0`` samples at temperature 1), so it is refused, naming the field and the
    closest field known (bistat serve's, or vLLM's and SGLang's)."""
    own = sorted(known)
    close = difflib.get_close_matches(name, own + sorted(FOREIGN) + sorted(TEMPLATE_FIELDS)
                                      + ["chat_template_kwargs", "tool_choice"], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return RequestError(f"unknown field {name!r}: neither bistat serve nor vLLM's or SGLang's "
                        f"OpenAI servers know it, and ignoring it would change what is measured; "
                        f"{hint}the fields bistat serve implements: {', '.join(own)}", param=name)
