"""bistat.model.testing.tiny_random_model: deterministic, shaped as asked, with a real tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from bistat.model import Model, ModelConfig
from bistat.model.testing import TINY_CONFIG, byte_level_test_tokenizer, tiny_random_model


def test_same_seed_same_bits_other_seed_other_bits():
    a, b, c = (tiny_random_model(s, tokenizer="byte") for s in (0, 0, 1))
    assert a.sha256 == b.sha256 != c.sha256
    for k in a.weights:
        assert a.weights[k].tobytes() == b.weights[k].tobytes()
        assert not np.array_equal(a.weights[k], c.weights[k])


def test_shapes_and_overrides():
    m = tiny_random_model(0, tokenizer="byte", num_hidden_layers=3, num_key_value_heads=4, vocab_size=600)
    assert isinstance(m, Model) and isinstance(m.config, ModelConfig)
    assert m.config.num_hidden_layers == 3 and m.config.vocab_size == 600
    assert m.weights["model.embed_tokens.weight"].shape == (600, TINY_CONFIG["hidden_size"])
    assert m.weights["model.layers.2.self_attn.k_proj.weight"].shape == (64, 64)
    assert m.weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert "lm_head.weight" not in m.weights
    assert all(w.dtype == np.float32 for w in m.weights.values())
    untied = tiny_random_model(0, tokenizer="byte", tie_word_embeddings=False)
    assert untied.weights["lm_head.weight"].shape == (untied.tokenizer.vocab_size, 64)


def test_weight_scales():
    m = tiny_random_model(5, tokenizer="byte", hidden_size=256, num_attention_heads=16, head_dim=16)
    q = m.weights["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std() * np.sqrt(256) - 1) < 0.02
    norm = m.weights["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1) < 0.03 and 0.05 < norm.std() < 0.15


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size=10 is smaller than the tokenizer's \d+ tokens"):
        tiny_random_model(0, tokenizer="byte", vocab_size=10)
    with pytest.raises(TypeError, match=r"unknown ModelConfig field\(s\) \['hidden'\]"):
        tiny_random_model(0, tokenizer="byte", hidden=3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        tiny_random_model(0, tokenizer="byte", num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"tokenizer must be 'auto', 'byte'"):
        tiny_random_model(0, tokenizer="gpt2")


def test_auto_falls_back_to_byte_level_without_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path))
    m = tiny_random_model(0)
    assert m.tokenizer.vocab_size == byte_level_test_tokenizer().vocab_size
    assert m.config.vocab_size == m.tokenizer.vocab_size
