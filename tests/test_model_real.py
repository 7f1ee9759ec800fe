"""The real SmolLM2-135M-Instruct, as fetched into the cache by `bistat model fetch smollm2-135m`.

Skipped (with the reason) when the model is not in the cache. The conversion check is MODELS.md's
reference behaviour: with the chat template applied, greedy decoding answers "The capital of
France is Paris." (checked here teacher-forced: one forward pass of prompt + answer with a plain
numpy LLaMA, `helpers_model.reference_logits`, whose argmax at each answer position must be the
next answer token). A wrong Q/K un-permutation, tensor mapping or tokenizer breaks it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_model import reference_bpe, reference_logits

from bistat.model import REGISTRY, load_model
from bistat.model.fetch import is_cached

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not is_cached("smollm2-135m"),
                       reason="smollm2-135m is not in the cache; run `bistat model fetch smollm2-135m`"),
]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2-135m")


def test_config(model):
    c = model.config
    assert (c.vocab_size, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (49152, 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-05, 8192)
    assert c.tie_word_embeddings and (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)
    assert model.n_parameters == 134_515_008
    assert model.weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert model.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_tokenizer(model):
    tok = model.tokenizer
    assert tok.vocab_size == 49152
    assert tok.special_token_ids == list(range(17))
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.encode(" 2024") == [216, 34, 32, 34, 36]  # digits one by one, as SmolLM2's tokenizer.json
    prompt = tok.apply_chat_template(FRANCE)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tok.encode(prompt)[:3] == [1, 9690, 198]


@pytest.mark.parametrize("text", ["What is the capital of France?", "naïve café, Zürich – 東京 🤖 2024",
                                  "def f(x):\n    return x**2  # square", "   many   spaces\n\n\nand lines"])
def test_tokenizer_matches_plain_python_bpe(model, text):
    ids = model.tokenizer.encode(text)
    assert ids == reference_bpe(model.tokenizer, text)
    assert model.tokenizer.decode(ids) == text


def test_greedy_answer_is_paris(model):
    tok = model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(FRANCE))
    answer = tok.encode("The capital of France is Paris.") + [tok.eos_token_id]
    assert answer == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    logits = reference_logits(model, prompt + answer[:-1])            # [S, vocab]
    predicted = np.argmax(logits[len(prompt) - 1:], axis=-1).tolist()
    assert predicted == answer


def test_registry_hashes_match_the_manifest(model):
    import json

    from bistat.model import cache

    manifest = json.loads((cache.model_dir("smollm2-135m") / "manifest.json").read_text())
    spec = REGISTRY["smollm2-135m"]
    assert (manifest["source"]["wheel_sha256"], manifest["source"]["gguf_sha256"]) == (spec.wheel_sha256,
                                                                                      spec.gguf_sha256)
    assert manifest["sha256"] == model.sha256
