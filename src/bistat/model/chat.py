"""Render a model's Jinja chat template, the way ``transformers`` does, in a sandbox.

The template comes from the model file (GGUF key ``tokenizer.chat_template``), so it is untrusted
input: it is rendered in jinja2's ``ImmutableSandboxedEnvironment`` with the same settings as
``transformers.utils.chat_template_utils._compile_jinja_template`` (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``raise_exception`` global).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "render_chat_template", "template_variables", "validate_messages"]

#: ChatML as SmolLM2-Instruct writes it (its GGUF's ``tokenizer.chat_template``), used by the
#: in-memory test tokenizer of ``bistat.model.testing``; real models carry their own template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its caller (``messages``, ``add_generation_prompt``,
    a switch such as ``enable_thinking``...): those it uses without setting them itself.

    Examples
    --------
    >>> sorted(template_variables(CHATML_TEMPLATE))
    ['add_generation_prompt', 'messages']
    >>> "enable_thinking" in template_variables("{% if enable_thinking %}<think>{% endif %}")
    True
    """
    env = _environment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template))) - set(env.globals)


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Check that ``messages`` is a list of ``{"role": str, "content": str}``; return plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r}")
        out.append(dict(m))
    return out


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``template`` for ``messages``.

    Parameters
    ----------
    template
        Jinja source of the chat template.
    messages
        ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
    add_generation_prompt
        Append the header that starts the assistant's turn.
    **variables
        Further template variables (``bos_token``, ``eos_token``, ...).

    Returns
    -------
    str
        The prompt text, special tokens written out as text.

    Raises
    ------
    jinja2.exceptions.TemplateError
        The template is malformed, raised ``raise_exception``, or tried to leave the sandbox.
    """
    return _compile(template).render(messages=validate_messages(messages),
                                     add_generation_prompt=add_generation_prompt, **variables)
