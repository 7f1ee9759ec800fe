"""Small models for tests: random weights of any LLaMA shape, with a real tokenizer.

``tiny_random_model`` lets the engine, server and runner be tested in milliseconds without the
98 MB download. Its tokenizer is SmolLM2's when that model is in the cache (``tokenizer="auto"``),
else a small byte-level BPE trained in memory on a fixed text by the ``tokenizers`` package (same
pipeline as SmolLM2's, `bistat.model.tokenizer.build_byte_level_bpe`; the same special ids:
``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2; the same ChatML template).
Pass ``tokenizer="byte"`` for a result that does not depend on the cache.
"""

from __future__ import annotations

import functools
import json

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from bistat.model import cache
from bistat.model.chat import CHATML_TEMPLATE
from bistat.model.config import ModelConfig
from bistat.model.errors import ModelError
from bistat.model.loader import Model, model_files
from bistat.model.tokenizer import Tokenizer, build_byte_level_bpe

__all__ = ["TINY_CONFIG", "byte_level_test_tokenizer", "tiny_random_model"]

#: Shape of ``tiny_random_model`` unless overridden (grouped-query attention, 2 layers).
TINY_CONFIG: dict[str, object] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2,
}

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
    "What is the capital of France? What is the largest planet in the solar system? Jupiter is.",
    "Hello, how are you today? I am a helpful assistant, and I am happy to help you with that.",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.",
    "Write a short poem about the sea. Explain how photosynthesis works in simple terms.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Numbers like 12, 345 and 2024 are split into single digits before merging.",
)


@functools.lru_cache(maxsize=1)
def _byte_level_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    trainer_tok = _HFTokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=2, show_progress=False,
                                  special_tokens=list(_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    return tokens, merges


def byte_level_test_tokenizer() -> Tokenizer:
    """A small byte-level BPE (a few hundred tokens) with SmolLM2's special ids and chat template."""
    tokens, merges = _byte_level_parts()
    backend = build_byte_level_bpe(tokens, merges, special_ids=range(len(_SPECIAL_TOKENS)))
    return Tokenizer(backend, CHATML_TEMPLATE, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _tokenizer(choice: str | Tokenizer) -> Tokenizer:
    if isinstance(choice, Tokenizer):
        return choice
    if choice == "byte":
        return byte_level_test_tokenizer()
    if choice in ("auto", "smollm2-135m"):
        from bistat.model.loader import load_tokenizer

        try:
            return load_tokenizer("smollm2-135m")
        except ModelError:
            if choice == "auto":
                return byte_level_test_tokenizer()
            raise
    raise ValueError(f"tokenizer must be 'auto', 'byte', 'smollm2-135m' or a Tokenizer, got {choice!r}")


def tiny_random_model(seed: int = 0, *, tokenizer: str | Tokenizer = "auto", **config: object) -> Model:
    """A LLaMA model with seeded random weights and a real tokenizer.

    Parameters
    ----------
    seed
        Seeds ``numpy.random.default_rng``; equal seeds, shapes and tokenizers give bitwise equal weights.
    tokenizer
        ``"auto"`` (SmolLM2's if cached, else ``"byte"``), ``"byte"`` (`byte_level_test_tokenizer`),
        ``"smollm2-135m"`` (must be cached) or a `Tokenizer`.
    **config
        `ModelConfig` fields overriding `TINY_CONFIG`; ``vocab_size`` defaults to the tokenizer's
        and may exceed it (padded vocabularies), never fall short of it.

    Returns
    -------
    Model
        Float32 weights: embeddings N(0, 1), linear layers N(0, 1/in_features) (so activations keep
        unit scale and the tied logits are peaked, unlike vLLM's near-flat dummy weights), norm
        weights 1 + N(0, 0.1^2). ``name`` is ``tiny-random-<seed>``; ``sha256`` is the content hash
        its saved folder would have (`bistat.model.loader.save_model`).

    Examples
    --------
    >>> m = tiny_random_model(0, tokenizer="byte", num_hidden_layers=1)
    >>> m.weights["model.layers.0.self_attn.k_proj.weight"].shape
    (32, 64)
    """
    tok = _tokenizer(tokenizer)
    unknown = sorted(set(config) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown ModelConfig field(s) {unknown}")
    fields = {**TINY_CONFIG, "vocab_size": tok.vocab_size, **config}
    cfg = ModelConfig(**fields)  # type: ignore[arg-type]
    if cfg.vocab_size < tok.vocab_size:
        raise ValueError(f"vocab_size={cfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens")
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in cfg.weight_shapes().items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[name] = w.astype(np.float32)
    sha = cache.content_sha256(model_files(cfg, weights, tok))
    return Model(config=cfg, weights=weights, tokenizer=tok, name=f"tiny-random-{seed}", sha256=sha)
