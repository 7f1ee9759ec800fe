"""GGUF conversion pieces: the Q/K permutation, tensor names, unsupported files; bf16 and safetensors export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import tokenizers
from helpers_model import write_fake_gguf

from bistat.model import ConversionError, load_model, save_model
from bistat.model.gguf_convert import hf_name, permute_qk, read_gguf, unpermute_qk
from bistat.model.hf_export import bf16_to_fp32, export_hf, fp32_to_bf16, read_safetensors, write_safetensors
from bistat.model.testing import tiny_random_model


@pytest.mark.parametrize("n_head,head_dim,cols", [(1, 4, 3), (9, 64, 5), (3, 64, 1), (4, 8, 0)])
def test_unpermute_inverts_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(n_head * head_dim)
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    assert not np.array_equal(permute_qk(w, n_head), w)


def test_permute_is_llama_cpps_row_order():
    # HF's rotate_half pairs row j with j + head_dim/2; llama.cpp pairs 2j with 2j+1. For one head of
    # dim 4 the HF rows [0, 1, 2, 3] are stored as [0, 2, 1, 3]; per head for two heads of dim 4.
    rows = np.arange(8)
    assert permute_qk(rows, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert permute_qk(np.arange(6), 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_qk(np.array([0, 3, 1, 4, 2, 5]), 1).tolist() == [0, 1, 2, 3, 4, 5]


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ConversionError, match=r"^GGUF tensor 'blk.0.attn_qkv.weight' has no Hugging Face "):
        hf_name("blk.0.attn_qkv.weight")


def test_fake_gguf_metadata_to_config(tmp_path):
    cfg, _, tokens = write_fake_gguf(tmp_path / "m.gguf")
    g = read_gguf(tmp_path / "m.gguf")
    assert g.config == cfg
    assert g.tokenizer.vocab_size == len(tokens)
    assert g.tokenizer.special_token_ids == [0, 1, 2]


def test_other_architecture_is_refused(tmp_path):
    write_fake_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ConversionError, match=r"general.architecture is 'gpt2'; only 'llama' is supported$"):
        read_gguf(tmp_path / "m.gguf")


def test_missing_chat_template_is_refused(tmp_path):
    write_fake_gguf(tmp_path / "m.gguf", chat_template=None)
    with pytest.raises(ConversionError, match=r"metadata key 'tokenizer.chat_template' is missing$"):
        read_gguf(tmp_path / "m.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"hello world, not gguf")
    with pytest.raises(ConversionError, match=r"x.gguf: not a readable GGUF file"):
        read_gguf(tmp_path / "x.gguf")


# ---- bfloat16 ----

def _nearest_bf16_reference(x: np.ndarray) -> np.ndarray:
    """Nearest bfloat16 by exhaustive comparison with both neighbours (ties: even mantissa), in float64."""
    u = x.view(np.uint32)
    lo = (u & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    hi = ((u & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    xd = x.astype(np.float64)
    d_lo, d_hi = np.abs(xd - lo), np.abs(hi - xd)
    lo_even = ((u >> np.uint32(16)) & np.uint32(1)) == 0
    take_lo = (d_lo < d_hi) | ((d_lo == d_hi) & lo_even)
    return np.where(take_lo, u >> np.uint32(16), (u >> np.uint32(16)) + np.uint32(1)).astype(np.uint16)


def test_bf16_rounds_to_nearest_even():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-20, 20, 200_000))).astype(np.float32)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130 * 3], dtype=np.float32)
    x = np.concatenate([x, ties])
    np.testing.assert_array_equal(fp32_to_bf16(x), _nearest_bf16_reference(x))
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: even mantissa (1.0, 0x3F80) wins; 1 + 3*2^-8 goes up
    assert fp32_to_bf16(ties[:2]).tolist() == [0x3F80, 0x3F82]


def test_bf16_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38], dtype=np.float32)
    b = fp32_to_bf16(x)
    assert b[:4].tolist() == [0x0000, 0x8000, 0x7F80, 0xFF80]
    assert np.isnan(bf16_to_fp32(b[4:5]))[0]
    assert bf16_to_fp32(b[5:6])[0] == np.inf  # above bf16's largest finite value: rounds to infinity
    y = np.array([1.5, -2.25, 0.0078125], dtype=np.float32)  # exactly representable
    np.testing.assert_array_equal(bf16_to_fp32(fp32_to_bf16(y)), y)


# ---- safetensors ----

def test_safetensors_bf16_round_trip_and_official_parser(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"b.weight": rng.standard_normal((3, 5)).astype(np.float32),
               "a.weight": rng.standard_normal((7,)).astype(np.float32)}
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    back, meta = read_safetensors(path)
    assert meta == {"format": "pt"}
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], bf16_to_fp32(fp32_to_bf16(v)))
    parsed = dict(safetensors.deserialize(path.read_bytes()))  # the safetensors package's own (Rust) parser
    assert sorted(parsed) == ["a.weight", "b.weight"]
    assert parsed["b.weight"]["dtype"] == "BF16" and list(parsed["b.weight"]["shape"]) == [3, 5]
    assert bytes(parsed["b.weight"]["data"]) == fp32_to_bf16(tensors["b.weight"]).tobytes()
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert n % 8 == 0


def test_safetensors_float32_readable_by_safetensors_numpy(tmp_path):
    rng = np.random.default_rng(2)
    tensors = {"x": rng.standard_normal((4, 6)).astype(np.float32)}
    write_safetensors(tmp_path / "f.safetensors", tensors, dtype="float32")
    loaded = safetensors.numpy.load_file(str(tmp_path / "f.safetensors"))
    np.testing.assert_array_equal(loaded["x"], tensors["x"])


def test_export_hf_folder(tmp_path):
    model = tiny_random_model(3, tokenizer="byte")
    files = export_hf(model, tmp_path / "hf")
    assert [f.name for f in files] == ["chat_template.jinja", "config.json", "generation_config.json",
                                       "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == model.tokenizer.chat_template
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["unk_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                                  "<|endoftext|>")
    hf_tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    text = "Hello, world 123 <|im_end|>"
    assert hf_tok.encode(text, add_special_tokens=False).ids == model.tokenizer.encode(text)
    back, meta = read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert meta["bistat_sha256"] == model.sha256
    assert sorted(back) == sorted(model.weights)
    for k, w in model.weights.items():
        np.testing.assert_array_equal(back[k], bf16_to_fp32(fp32_to_bf16(w)))
        np.testing.assert_allclose(back[k], w, rtol=2**-8, atol=0)


def test_export_float32_is_exact_and_save_load_round_trip(tmp_path):
    model = tiny_random_model(4, tokenizer="byte")
    manifest = save_model(model, tmp_path / "saved")
    assert manifest["sha256"] == model.sha256
    loaded = load_model(tmp_path / "saved")
    assert loaded.sha256 == model.sha256 and loaded.config == model.config
    export_hf(loaded, tmp_path / "hf32", dtype="float32")
    back = safetensors.numpy.load_file(str(tmp_path / "hf32" / "model.safetensors"))
    for k, w in model.weights.items():
        np.testing.assert_array_equal(back[k], w)
