"""The tokenizer: a byte-level BPE (GPT-2 style, as SmolLM2's) on the ``tokenizers`` package.

``build_byte_level_bpe`` makes the ``tokenizers.Tokenizer`` from a vocabulary and merge list
(as a GGUF file holds them); ``Tokenizer`` wraps it with the model's special ids and chat template.

The pipeline is the one of SmolLM2's published ``tokenizer.json``, which llama.cpp calls the
``smollm`` pre-tokenizer (``llama-vocab.cpp``: ``\\p{N}`` split into single digits, then GPT-2's
regex): no normalizer; pre-tokenizer ``Sequence[Digits(individual_digits=True),
ByteLevel(add_prefix_space=False)]``; BPE model; ``ByteLevel`` decoder. Special tokens are added
tokens (``special=True, normalized=False``), matched before pre-tokenization.

References
----------
.. [1] A. Radford et al., Language Models are Unsupervised Multitask Learners (GPT-2), 2019,
       section 2.2 (byte-level BPE).
.. [2] ggml-org/llama.cpp, ``src/llama-vocab.cpp``, ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from bistat.model.chat import render_chat_template

__all__ = ["PRE_TOKENIZERS", "Tokenizer", "build_byte_level_bpe"]

#: Pre-tokenizer names (GGUF ``tokenizer.ggml.pre``) this module can rebuild.
PRE_TOKENIZERS = ("smollm", "gpt2")


def build_byte_level_bpe(tokens: Sequence[str], merges: Sequence[str | tuple[str, str]],
                         special_ids: Sequence[int], *, pre: str = "smollm") -> tokenizers.Tokenizer:
    """Build a byte-level BPE tokenizer.

    Parameters
    ----------
    tokens
        The vocabulary; ``tokens[i]`` is token id ``i`` (byte-level alphabet: space is ``Ġ``).
    merges
        BPE merges in rank order, as ``"a b"`` strings (GGUF) or ``(a, b)`` pairs.
    special_ids
        Ids of the control tokens (``<|endoftext|>``, ``<|im_start|>``, ...): added as special
        tokens, never split, dropped by ``decode(skip_special_tokens=True)``.
    pre
        ``"smollm"`` (single digits, then GPT-2's regex) or ``"gpt2"`` (GPT-2's regex only).
    """
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported; expected one of "
                         f"{', '.join(map(repr, PRE_TOKENIZERS))}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"the vocabulary has {len(tokens) - len(vocab)} duplicate token(s)")
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(merges):
        pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        if len(pair) != 2:
            raise ValueError(f"merge {i} ({m!r}) is not a pair of tokens")
        pairs.append(pair)  # type: ignore[arg-type]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    return tok


class Tokenizer:
    """A model's tokenizer: encode/decode text and apply the chat template.

    Parameters
    ----------
    backend
        The ``tokenizers.Tokenizer`` doing the work.
    chat_template
        Jinja source of the chat template.
    bos_token_id, eos_token_id
        The model's begin/end ids (SmolLM2-Instruct: ``<|im_start|>`` = 1, ``<|im_end|>`` = 2).
    pad_token_id
        Padding id, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str, *, bos_token_id: int,
                 eos_token_id: int, pad_token_id: int | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = int(bos_token_id)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"Tokenizer.{name} ({value}) lies outside the vocabulary "
                                 f"(size {self.vocab_size})")
        self.bos_token = backend.id_to_token(self.bos_token_id)
        self.eos_token = backend.id_to_token(self.eos_token_id)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, chat_template: str, **special_ids: Any) -> Tokenizer:
        """Load ``tokenizer.json`` (the ``tokenizers`` format) with the given template and ids."""
        return cls(tokenizers.Tokenizer.from_file(str(tokenizer_json)), chat_template, **special_ids)

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of the added special tokens, ascending."""
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids.

        ``add_special_tokens`` is accepted for transformers' signature; this tokenizer's post-processor
        adds no BOS/EOS either way (SmolLM2 adds none: GGUF ``tokenizer.ggml.add_bos_token`` is false).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` the special tokens are left out."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level alphabet), or None."""
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, or None."""
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for a conversation, rendered with the model's chat template;
        ``variables``: further variables the template reads (a switch such as
        ``enable_thinking``, as ``transformers``' ``apply_chat_template`` passes its keywords).

        Examples
        --------
        With SmolLM2-Instruct's template, ``[{"role": "user", "content": "Hi"}]`` renders to
        ``"<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging
        Face<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"``.
        """
        return render_chat_template(self.chat_template, messages,
                                    **{"add_generation_prompt": add_generation_prompt,
                                       "bos_token": self.bos_token, "eos_token": self.eos_token,
                                       **variables})

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id})")
