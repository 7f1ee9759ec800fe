"""``ModelConfig``: a LLaMA model's shape, with Hugging Face's ``LlamaConfig`` field names.

The names follow ``transformers.LlamaConfig`` so that ``config.json`` written from it is read by
transformers and vLLM unchanged (see ``to_hf_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a LLaMA-architecture decoder (``LlamaForCausalLM``).

    Parameters
    ----------
    hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, vocab_size, rope_theta, rms_norm_eps, tie_word_embeddings, max_position_embeddings,
    bos_token_id, eos_token_id, pad_token_id
        As in ``transformers.LlamaConfig``. ``num_key_value_heads < num_attention_heads`` means
        grouped-query attention; ``tie_word_embeddings`` means the output projection is
        ``model.embed_tokens.weight`` (no ``lm_head.weight`` tensor).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} ({value}) must lie in [0, vocab_size={self.vocab_size})")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rope_theta ({self.rope_theta}) and rms_norm_eps "
                             f"({self.rms_norm_eps}) must be positive")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's Hugging Face name and shape ([out, in] for linear layers)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, d)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (d,)
            shapes[p + "self_attn.q_proj.weight"] = (self.num_attention_heads * hd, d)
            shapes[p + "self_attn.k_proj.weight"] = (self.num_key_value_heads * hd, d)
            shapes[p + "self_attn.v_proj.weight"] = (self.num_key_value_heads * hd, d)
            shapes[p + "self_attn.o_proj.weight"] = (d, self.num_attention_heads * hd)
            shapes[p + "post_attention_layernorm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (f, d)
            shapes[p + "mlp.up_proj.weight"] = (f, d)
            shapes[p + "mlp.down_proj.weight"] = (d, f)
        shapes["model.norm.weight"] = (d,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, d)
        return shapes

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` with this shape."""
        d = dataclasses.asdict(self)
        if d["pad_token_id"] is None:
            del d["pad_token_id"]
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            initializer_range=0.02,
            pretraining_tp=1,
            rope_scaling=None,
            use_cache=True,
            torch_dtype=torch_dtype,
        )
        return dict(sorted(d.items()))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Read the fields this class knows from a ``config.json`` dict; ignore the others.

        ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads``
        to ``num_attention_heads``, as in ``transformers.LlamaConfig``.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw.setdefault("num_key_value_heads", data.get("num_attention_heads"))
        if kw.get("head_dim") is None and "hidden_size" in kw and kw.get("num_attention_heads"):
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        missing = sorted(known - set(kw) - {"pad_token_id"})
        if missing:
            raise ValueError(f"config.json lacks the field(s) {', '.join(missing)}")
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)
