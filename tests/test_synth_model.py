"""bistat synth-model: published configs, tensor layout, bf16 rounding, the safetensors file, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from bistat.model import synth as sm
from bistat.cli import cli

TINY = {
    **sm.ARCHITECTURES["qwen3-8b"],
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "num_hidden_layers": 3,
}


@pytest.fixture
def tiny_arch(monkeypatch):
    monkeypatch.setitem(sm.ARCHITECTURES, "tiny-qwen3", dict(TINY))
    monkeypatch.setitem(sm.ARCHITECTURES, "tiny-qwen3-tied", {**TINY, "tie_word_embeddings": True})
    return "tiny-qwen3"


def _read_safetensors(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Parse the file by the format's definition (independently of the writer)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        bits = np.frombuffer(data[base + start:base + end], dtype="<u2")
        f32 = (bits.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = f32.reshape(info["shape"])
    return header, tensors


def test_published_configs_give_the_shapes_in_models_md():
    # ../shared/MODELS.md: (N = out, K = in) for qkv, o, gate_up, down, lm_head
    for arch, want in {
        "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                     "down": (4096, 12288), "lm_head": (151936, 4096)},
        "qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
                       "down": (2048, 6144), "lm_head": (151936, 2048)},
    }.items():
        specs = {s.name: s.shape for s in sm.tensor_specs(sm.model_config(arch, 2))}
        p = "model.layers.1."
        q, k, v = (specs[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        assert (q[0] + k[0] + v[0], q[1]) == want["qkv"]
        assert specs[p + "self_attn.o_proj.weight"] == want["o"]
        g, u = specs[p + "mlp.gate_proj.weight"], specs[p + "mlp.up_proj.weight"]
        assert (g[0] + u[0], g[1]) == want["gate_up"]
        assert specs[p + "mlp.down_proj.weight"] == want["down"]
        lm = specs.get("lm_head.weight", specs["model.embed_tokens.weight"])
        assert lm == want["lm_head"]
    assert "lm_head.weight" not in {s.name for s in sm.tensor_specs(sm.model_config("qwen3-1.7b", 1))}
    assert sum(s.numel for s in sm.tensor_specs(sm.model_config("qwen3-8b", 36))) == 8_190_735_360


def test_model_config_overrides_only_the_layer_count():
    cfg = sm.model_config("qwen3-8b", 8)
    assert cfg["num_hidden_layers"] == 8 and cfg["max_window_layers"] == 8
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "max_window_layers")} == \
        {k: v for k, v in sm.ARCHITECTURES["qwen3-8b"].items()
         if k not in ("num_hidden_layers", "max_window_layers")}
    assert sm.ARCHITECTURES["qwen3-8b"]["num_hidden_layers"] == 36  # the table is not mutated


@pytest.mark.parametrize("arch, layers, message", [
    ("llama-7b", 2, "unknown architecture 'llama-7b'; expected one of 'qwen3-8b', 'qwen3-1.7b'"),
    ("qwen3-8b", 0, "--layers must be at least 1, got 0"),
])
def test_model_config_errors(arch, layers, message):
    with pytest.raises(sm.SynthModelError) as err:
        sm.model_config(arch, layers)
    assert str(err.value) == message


def test_bf16_rounding_is_nearest_even_and_matches_torch():
    # exact values, halfway cases (ties to even both ways), just above a tie, signs, inf, nan
    x = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, np.nextafter(np.float32(1.00390625), np.float32(2)), -3.1415927, np.inf, -np.inf,
                  3.4e38, 1e-40], dtype=np.float32)
    got = sm.float32_to_bf16_bits(x)
    assert got[:5].tolist() == [0x0000, 0x8000, 0x3F80, 0x3F80, 0x3F82]
    assert got[5] == 0x3F81  # above the tie: rounds up
    assert sm.float32_to_bf16_bits(np.array([np.nan], dtype=np.float32)).tolist() == [0x7FC0]
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    y = np.concatenate([x, rng.standard_normal(10_000).astype(np.float32) * 0.02])
    want = torch.from_numpy(y).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(sm.float32_to_bf16_bits(y), want)


def test_numpy_backend_writes_a_loadable_folder(tmp_path, tiny_arch):
    res = sm.write_synthetic_model(tmp_path / "m", arch=tiny_arch, layers=3, std=0.02, seed=7,
                                   backend="numpy")
    out = tmp_path / "m"
    assert sorted(p.name for p in out.iterdir()) == sorted(res.files)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["architectures"] == ["Qwen3ForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    header, tensors = _read_safetensors(out / "model.safetensors")
    assert (8 + int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")) % 8 == 0
    assert header["__metadata__"]["format"] == "pt"
    specs = sm.tensor_specs(sm.model_config(tiny_arch, 3))
    assert list(k for k in header if k != "__metadata__") == [s.name for s in specs]
    assert res.n_parameters == sum(s.numel for s in specs) == sum(t.size for t in tensors.values())
    for s in specs:
        t = tensors[s.name]
        assert t.shape == s.shape
        if s.fill == "ones":
            assert np.all(t == 1.0), s.name
        else:
            assert abs(float(t.mean())) < 0.004 and 0.017 < float(t.std()) < 0.023, s.name
    names = [s.name for s in specs]
    assert "lm_head.weight" in names and "model.layers.2.self_attn.q_norm.weight" in names
    assert not np.array_equal(tensors["model.layers.0.mlp.up_proj.weight"],
                              tensors["model.layers.1.mlp.up_proj.weight"])
    prov = json.loads((out / sm.PROVENANCE_FILE).read_text())
    assert prov["backend"] == "numpy" and prov["weights"]["sha256"] == res.sha256
    import hashlib
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == res.sha256


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny_arch):
    a = sm.write_synthetic_model(tmp_path / "a", arch=tiny_arch, layers=1, seed=3, backend="numpy")
    b = sm.write_synthetic_model(tmp_path / "b", arch=tiny_arch, layers=1, seed=3, backend="numpy")
    c = sm.write_synthetic_model(tmp_path / "c", arch=tiny_arch, layers=1, seed=4, backend="numpy")
    assert a.sha256 == b.sha256 != c.sha256


def test_chunked_generation_equals_one_draw(tmp_path, tiny_arch, monkeypatch):
    monkeypatch.setattr(sm, "_CHUNK_ELEMENTS", 200)  # many blocks per tensor
    small = sm.write_synthetic_model(tmp_path / "s", arch=tiny_arch, layers=1, seed=5, backend="numpy")
    monkeypatch.setattr(sm, "_CHUNK_ELEMENTS", 1 << 22)
    big = sm.write_synthetic_model(tmp_path / "b", arch=tiny_arch, layers=1, seed=5, backend="numpy")
    assert small.sha256 == big.sha256


def test_torch_backend_on_cpu_writes_the_same_layout(tmp_path, tiny_arch):
    pytest.importorskip("torch")
    res = sm.write_synthetic_model(tmp_path / "t", arch="tiny-qwen3-tied", layers=2, seed=1,
                                   backend="torch")
    assert (res.backend, res.device) == ("torch", "cpu")
    header, tensors = _read_safetensors(tmp_path / "t" / "model.safetensors")
    assert "lm_head.weight" not in header
    from safetensors.torch import load_file  # the reference reader agrees, value for value
    ref = load_file(str(tmp_path / "t" / "model.safetensors"))
    assert set(ref) == set(tensors)
    for name, t in tensors.items():
        assert np.array_equal(ref[name].float().numpy(), t), name
    w = tensors["model.layers.1.mlp.down_proj.weight"]
    assert 0.017 < float(w.std()) < 0.023
    assert np.all(tensors["model.norm.weight"] == 1.0)


def test_refuses_existing_folder_and_bad_arguments(tmp_path, tiny_arch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("keep")
    with pytest.raises(sm.SynthModelError, match="folder exists and is not empty; choose another "
                                                 "--out or pass --overwrite"):
        sm.write_synthetic_model(tmp_path / "m", arch=tiny_arch, layers=1, backend="numpy")
    assert (tmp_path / "m" / "x").read_text() == "keep"
    with pytest.raises(sm.SynthModelError, match="--init 'uniform' is not supported"):
        sm.write_synthetic_model(tmp_path / "n", arch=tiny_arch, layers=1, init="uniform")
    with pytest.raises(sm.SynthModelError, match="--std must be a positive number, got 0"):
        sm.write_synthetic_model(tmp_path / "n", arch=tiny_arch, layers=1, std=0)


def test_short_producer_is_an_error_and_leaves_no_file(tmp_path):
    spec = sm.TensorSpec("w", (2, 3), "normal")
    with pytest.raises(sm.SynthModelError, match="w: produced 10 bytes, expected 12"):
        sm.write_safetensors_stream(tmp_path / "x.safetensors", [spec], lambda i, s: [b"\0" * 10])
    assert not (tmp_path / "x.safetensors").exists()


def test_resolve_backend_without_gpu_is_numpy_for_auto():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert sm.resolve_backend("auto") == ("torch", "cuda")
    else:
        assert sm.resolve_backend("auto") == ("numpy", "cpu")
    assert sm.resolve_backend("numpy") == ("numpy", "cpu")


def test_cli_writes_the_folder_and_reports(tmp_path, tiny_arch):
    from bistat.cli import cmd_synth

    group = cli if "synth-model" in cli.commands else _group_with(cmd_synth)
    out = tmp_path / "m"
    r = CliRunner().invoke(group, ["synth-model", "--arch", tiny_arch, "--layers", "2", "--seed", "3",
                                   "--backend", "numpy", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["files"] == ["config.json", "generation_config.json", "model.safetensors",
                             "bistat-synth.json"]
    assert (data["backend"], data["layers"]) == ("numpy", 2)
    r = CliRunner().invoke(group, ["synth-model", "--arch", tiny_arch, "--layers", "2",
                                   "--backend", "numpy", "--out", str(out)])
    assert r.exit_code == 1
    assert r.output == (f"Error: {out}: folder exists and is not empty; choose another --out or "
                        "pass --overwrite\n")
    r = CliRunner().invoke(group, ["synth-model", "--arch", "gpt2", "--layers", "2", "--out",
                                   str(tmp_path / "z")])
    assert r.exit_code == 1
    assert r.output.startswith("Error: unknown architecture 'gpt2'; expected one of 'qwen3-8b', "
                               "'qwen3-1.7b'")
    r = CliRunner().invoke(group, ["synth-model", "--arch", tiny_arch, "--layers", "0", "--out",
                                   str(tmp_path / "z")])
    assert r.exit_code == 2 and "0 is not in the range x>=1" in r.output


def _group_with(module):
    import click

    group = click.Group()
    module.register(group)
    return group


def test_config_only_writes_no_weights(tmp_path):
    res = sm.write_synthetic_model(tmp_path / "c", arch="qwen3-8b", layers=36, config_only=True)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json",
                                                                  "generation_config.json"]
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == sm.ARCHITECTURES["qwen3-8b"]
    assert (res.n_bytes, res.n_parameters) == (0, 8_190_735_360)
