"""Tokenizer and chat template: round trips, special tokens, an independent BPE check, the sandbox."""

from __future__ import annotations

import jinja2
import pytest
from helpers_model import reference_bpe
from jinja2.sandbox import SecurityError

from bistat.model.chat import CHATML_TEMPLATE, render_chat_template
from bistat.model.testing import byte_level_test_tokenizer
from bistat.model.tokenizer import build_byte_level_bpe

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                 "<|im_start|>assistant\n")
TEXTS = ["What is the capital of France?", "  leading and trailing spaces  ", "line\nbreaks\n\n\ttabs",
         "digits 2024 and 3.14159", "naïve café, Zürich – “quotes” — 東京 🤖", "def f(x):\n    return x**2",
         "", " ", "aaaaaaa bbbb", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def tok():
    return byte_level_test_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_plain_python_bpe(tok, text):
    assert tok.encode(text) == reference_bpe(tok, text)


def test_merges_are_used(tok):
    ids = tok.encode("The capital of France is Paris.")
    assert len(ids) < len(b"The capital of France is Paris.") // 2


def test_digits_are_split_singly(tok):
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_special_tokens(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.special_token_ids == [0, 1, 2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # SmolLM2 adds no BOS


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match=rf"token id\(s\) \[{tok.vocab_size}\] outside the vocabulary"):
        tok.decode([5, tok.vocab_size])


def test_chat_template_france(tok):
    assert tok.apply_chat_template(FRANCE) == FRANCE_PROMPT
    no_prompt = FRANCE_PROMPT[:-len("<|im_start|>assistant\n")]
    assert tok.apply_chat_template(FRANCE, add_generation_prompt=False) == no_prompt
    with_system = [{"role": "system", "content": "Be brief."}] + FRANCE
    assert tok.apply_chat_template(with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_chat_template_is_sandboxed():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        render_chat_template(evil, FRANCE)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        render_chat_template("{{ raise_exception('no system') }}", FRANCE)


def test_messages_are_validated():
    with pytest.raises(TypeError, match=r"^messages\[0\] must be a dict with str 'role' and 'content', got "):
        render_chat_template(CHATML_TEMPLATE, [{"role": "user"}])
    with pytest.raises(TypeError, match=r"^messages must be a list"):
        render_chat_template(CHATML_TEMPLATE, "hello")


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match=r"^pre-tokenizer 'llama3' is not supported"):
        build_byte_level_bpe(["a"], [], [], pre="llama3")
    with pytest.raises(ValueError, match=r"^merge 0 \('abc'\) is not a pair of tokens$"):
        build_byte_level_bpe(["a", "b"], ["abc"], [])
    with pytest.raises(ValueError, match=r"duplicate"):
        build_byte_level_bpe(["a", "a"], [], [])
