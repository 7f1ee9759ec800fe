"""GGUF (llama.cpp) -> Hugging Face LLaMA: config, float32 weights, tokenizer and chat template.

Follows what ``transformers`` does when it loads a GGUF file (``modeling_gguf_pytorch_utils.py``,
``integrations/ggml.py``): read the metadata and tensors with the ``gguf`` package, dequantize
every tensor to float32 (``gguf.quants.dequantize``), map llama.cpp tensor names to Hugging Face
names, and undo the row permutation llama.cpp's converter applies to the Q and K projections.

References
----------
.. [1] ggml-org/llama.cpp, ``convert_hf_to_gguf.py``, ``LlamaModel.permute`` (the permutation undone here)
       and ``gguf-py/gguf/quants.py`` (the Q4_1 / Q8_0 block formats).
.. [2] huggingface/transformers, ``src/transformers/modeling_gguf_pytorch_utils.py``,
       ``reverse_permute_weights``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken

from bistat.model.config import ModelConfig
from bistat.model.errors import ConversionError
from bistat.model.tokenizer import PRE_TOKENIZERS, Tokenizer, build_byte_level_bpe

__all__ = ["GGUFModel", "hf_name", "permute_qk", "read_gguf", "unpermute_qk"]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# llama.cpp's gguf.TokenType: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K projection rows (Hugging Face order -> GGUF order).

    Within each head, Hugging Face's rotary layout pairs row ``j`` with row ``j + head_dim/2``
    (``rotate_half``); llama.cpp pairs rows ``2j`` and ``2j+1``. This is ``LlamaModel.permute``
    of ``convert_hf_to_gguf.py``: ``[n_head, 2, head_dim/2, in] -> swap axes 1, 2``.

    Parameters
    ----------
    w
        ``[n_head * head_dim, in]`` (or ``[n_head * head_dim]``).
    n_head
        Heads in ``w``: ``num_attention_heads`` for Q, ``num_key_value_heads`` for K.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk` (GGUF order -> Hugging Face order): ``unpermute_qk(permute_qk(w, h), h) == w``."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES \
            and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise ConversionError(f"GGUF tensor {gguf_name!r} has no Hugging Face LLaMA counterpart")


@dataclass(frozen=True, eq=False)
class GGUFModel:
    """What a LLaMA GGUF file holds, converted: config, tokenizer and a reader for the weights."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    metadata: dict[str, Any]
    reader: GGUFReader

    def iter_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(Hugging Face name, float32 array [out, in])`` per tensor, Q/K un-permuted."""
        cfg = self.config
        for t in self.reader.tensors:
            name = hf_name(t.name)
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_qk(w, cfg.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_qk(w, cfg.num_key_value_heads)
            yield name, np.ascontiguousarray(w)

    def weights(self) -> dict[str, np.ndarray]:
        """All weights, checked against the config's names and shapes."""
        out: dict[str, np.ndarray] = {}
        for name, w in self.iter_weights():
            if name in out:
                raise ConversionError(f"{self.path}: tensor {name} appears twice")
            out[name] = w
        expected = self.config.weight_shapes()
        missing = sorted(set(expected) - set(out))
        extra = sorted(set(out) - set(expected))
        if missing or extra:
            raise ConversionError(f"{self.path}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in expected.items():
            if out[name].shape != shape:
                raise ConversionError(f"{self.path}: tensor {name} has shape {out[name].shape}, "
                                      f"the metadata implies {shape}")
        return out


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_shortest(x: float) -> float:
    # GGUF stores eps as float32 (1e-5 -> 9.99999974e-06); give back the decimal it was written from
    return float(str(np.float32(x)))


def _config(path: Path, r: GGUFReader, n_tokens: int) -> ModelConfig:
    def get(key: str, default: Any = ...) -> Any:
        value = _field(r, key)
        if value is None:
            if default is ...:
                raise ConversionError(f"{path}: metadata key {key!r} is missing")
            return default
        return value

    arch = get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: general.architecture is {arch!r}; only 'llama' is supported")
    for key in ("llama.rope.scaling.type", "llama.rope.scale_linear", "llama.expert_count"):
        if key in r.fields:
            raise ConversionError(f"{path}: metadata key {key!r} (rope scaling / experts) is not supported")
    hidden = int(get("llama.embedding_length"))
    n_head = int(get("llama.attention.head_count"))
    head_dim = int(get("llama.attention.key_length", hidden // n_head))
    rope_dim = int(get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(f"{path}: llama.rope.dimension_count {rope_dim} differs from head_dim "
                              f"{head_dim}; partial rotary embeddings are not supported")
    tied = not any(t.name == "output.weight" for t in r.tensors)
    pad = get("tokenizer.ggml.padding_token_id", None)
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=int(get("llama.feed_forward_length")),
        num_hidden_layers=int(get("llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(get("llama.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        vocab_size=int(get("llama.vocab_size", n_tokens)),
        rope_theta=float(get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_shortest(get("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tied,
        max_position_embeddings=int(get("llama.context_length")),
        bos_token_id=int(get("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id")),
        pad_token_id=None if pad is None else int(pad),
    )


def _tokenizer(path: Path, r: GGUFReader, cfg_ids: dict[str, int | None]) -> Tokenizer:
    kind = _field(r, "tokenizer.ggml.model")
    pre = _field(r, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ConversionError(f"{path}: tokenizer.ggml.model {kind!r} with pre-tokenizer {pre!r} is not "
                              f"supported; expected 'gpt2' (byte-level BPE) with one of {list(PRE_TOKENIZERS)}")
    tokens = _field(r, "tokenizer.ggml.tokens")
    merges = _field(r, "tokenizer.ggml.merges")
    types = _field(r, "tokenizer.ggml.token_type")
    template = _field(r, "tokenizer.chat_template")
    for key, value in (("tokens", tokens), ("merges", merges), ("token_type", types)):
        if value is None:
            raise ConversionError(f"{path}: metadata key 'tokenizer.ggml.{key}' is missing")
    if template is None:
        raise ConversionError(f"{path}: metadata key 'tokenizer.chat_template' is missing")
    if len(types) != len(tokens):
        raise ConversionError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    special = [i for i, t in enumerate(types) if t == _CONTROL]
    backend = build_byte_level_bpe(tokens, merges, special, pre=pre)
    user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok = Tokenizer(backend, template, bos_token_id=cfg_ids["bos"], eos_token_id=cfg_ids["eos"],
                    pad_token_id=cfg_ids["pad"])
    verify_vocabulary(path, tok, tokens, special)
    return tok


def verify_vocabulary(path: Path, tok: Tokenizer, tokens: list[str], special: list[int]) -> None:
    """Check the built tokenizer against the GGUF's token list.

    Every id maps to the GGUF's string and back; every control token encodes to its own single id.
    """
    if tok.vocab_size != len(tokens):
        raise ConversionError(f"{path}: the tokenizer has {tok.vocab_size} tokens, the GGUF {len(tokens)}")
    for i, t in enumerate(tokens):
        if tok.id_to_token(i) != t or tok.token_to_id(t) != i:
            raise ConversionError(f"{path}: token {i} ({t!r}) does not map to itself in the rebuilt tokenizer")
    for i in special:
        if tok.encode(tokens[i]) != [i]:
            raise ConversionError(f"{path}: control token {tokens[i]!r} encodes to {tok.encode(tokens[i])}, not [{i}]")


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a LLaMA GGUF file: metadata -> `ModelConfig`, vocabulary -> `Tokenizer`; weights on demand.

    Raises
    ------
    ConversionError
        Another architecture, rope scaling, partial rotary, a tokenizer other than byte-level BPE,
        no chat template, or a vocabulary the rebuilt tokenizer does not reproduce.
    """
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ConversionError(f"{path}: not a readable GGUF file ({exc})") from exc
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = _config(path, reader, len(tokens) if tokens is not None else 0)
    tokenizer = _tokenizer(path, reader, {"bos": config.bos_token_id, "eos": config.eos_token_id,
                                          "pad": config.pad_token_id})
    if tokenizer.vocab_size > config.vocab_size:
        raise ConversionError(f"{path}: {tokenizer.vocab_size} tokens but llama.vocab_size {config.vocab_size}")
    keys = ("general.name", "general.organization", "general.finetune", "general.size_label", "general.license",
            "general.file_type", "tokenizer.ggml.pre")
    metadata = {k: _field(reader, k) for k in keys if k in reader.fields}
    return GGUFModel(path=path, config=config, tokenizer=tokenizer, metadata=metadata, reader=reader)
