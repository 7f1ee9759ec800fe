"""The tuned-GEMM plugin's hooks against each supported vLLM release's recorded manifest
(kernels/bistat_kernels/vllm_hooks/VERSION.json, derived from the wheel by bistat_kernels.hook_manifest).

No vLLM and no torch needed: the manifests are read with ``ast`` from the wheels. A vLLM release
that moves the hooks fails here (its manifest, once derived, does not pass), not in a user's run.
"""

from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import pytest
from external import vllm_wheel

from bistat_kernels import hook_manifest, vllm_plugin

MANIFESTS = hook_manifest.load_manifests()
#: the releases the plugin (and the [vllm] extra) is tested on
SUPPORTED = ["0.25.0", "0.33.0", "0.34.0"]


def test_a_manifest_for_every_supported_release_and_no_other():
    assert sorted(MANIFESTS) == SUPPORTED
    for version, m in MANIFESTS.items():
        assert (m["schema"], m["vllm_version"]) == (hook_manifest.SCHEMA, version)


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_plugin_can_hook_every_supported_release(version):
    m = MANIFESTS[version]
    assert hook_manifest.check_manifest(m) == []
    assert m["call_path"] == vllm_plugin.call_path(m["hook_module"])


def test_what_moved_between_the_supported_releases():
    """0.25.0 -> 0.33.0 (#53619): the module moved to determinism/, the chain goes through
    mm_batch_invariant, and matmul_persistent reads vLLM's own tuned tables (13 Hopper shapes)."""
    old, new = MANIFESTS["0.25.0"], MANIFESTS["0.33.0"]
    assert (old["hook_module"]["module"], new["hook_module"]["module"]) == vllm_plugin.TARGET_MODULES[::-1]
    assert old["call_path"] == ["linear_batch_invariant", "matmul_batch_invariant", "matmul_persistent"]
    assert new["call_path"] == ["linear_batch_invariant", "mm_batch_invariant", "matmul_persistent"]
    assert (old["commit"], new["commit"]) == ("gdd10e03f9", "g4ba787ec9")
    assert not old["tuned_tables"]["read_by_hook"] and old["tuned_tables"]["shapes"] == {}
    assert new["tuned_tables"]["read_by_hook"]
    hopper = new["tuned_tables"]["shapes"]["hopper"]
    assert len(hopper) == 13
    # Qwen3-8B's qkv / o / gate_up / down / lm_head are tuned there; SmolLM2's 576-wide are not
    assert {"6144x4096", "4096x4096", "24576x4096", "4096x12288", "151936x4096"} <= set(hopper)
    assert not any(s.endswith("x576") or s.startswith("576x") for s in hopper)



def test_what_changed_from_033_to_034():
    """0.33.0 -> 0.34.0: the same module, chain, callers and tuned shapes; matmul_persistent
    gained ``out_dtype=None`` (for the new ``mm_dtype_batch_invariant``, aten::mm.dtype), which
    the plugin's replacement takes (tests/kernels/test_vllm_plugin.py), and a GPTQ path that
    dequantizes and calls ``mm_batch_invariant``."""
    old, new = MANIFESTS["0.33.0"], MANIFESTS["0.34.0"]
    assert new["commit"] == "g62d4bc3c7"
    for key in ("call_path", "callers", "tuned_tables"):
        assert new[key] == old[key], key
    fo, fn = old["hook_module"]["functions"], new["hook_module"]["functions"]
    assert set(fn) - set(fo) == {"mm_dtype_batch_invariant", "gptq_linear_batch_invariant",
                                 "dequantize_gptq_weight"} and set(fo) <= set(fn)
    assert fn["matmul_persistent"]["params"] == ["a", "b", "bias", "out_dtype"]
    assert fn["matmul_persistent"]["defaults"] == {"bias": "None", "out_dtype": "None"}
    assert "matmul_persistent" in fn["mm_dtype_batch_invariant"]["names"]
    assert {k for k in set(fo) & set(fn) if fo[k] != fn[k]} == {"matmul_persistent",
                                                                "enable_batch_invariant_mode"}

@pytest.mark.parametrize("breakage,problem", [
    (lambda m: m["hook_module"]["functions"].pop("matmul_persistent"),
     "no function matmul_persistent"),
    (lambda m: m["hook_module"]["functions"]["matmul_persistent"]["defaults"].pop("bias"),
     "matmul_persistent has parameters (a, b, bias), not (a, b, bias=None)"),
    (lambda m: m["hook_module"]["functions"]["mm_batch_invariant"]["names"].remove(
        "matmul_persistent"),
     "linear_batch_invariant does not reach matmul_persistent through module-level names "
     "within 3 calls"),
    (lambda m: m["callers"]["vllm.model_executor.layers.linear"][
        "imports_from_hook_module"].clear(),
     "vllm.model_executor.layers.linear does not import linear_batch_invariant from "
     "vllm.model_executor.determinism.batch_invariant"),
    (lambda m: m["hook_module"].update(module="vllm.model_executor.kernels.batch_invariant"),
     "hook module 'vllm.model_executor.kernels.batch_invariant' is none of "
     "vllm.model_executor.determinism.batch_invariant, vllm.model_executor.layers.batch_invariant"),
])
def test_a_release_that_moves_a_hook_fails_the_check(breakage, problem):
    m = copy.deepcopy(MANIFESTS["0.33.0"])
    breakage(m)
    assert hook_manifest.check_manifest(m) == [problem]


def _wheel(tmp_path: Path, version: str, files: dict[str, str]) -> Path:
    path = tmp_path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.4\nName: vllm\n"
                                                           f"Version: {version}\n")
        zf.writestr("vllm/_version.py", "__version__ = version = '%s'\n"
                                        "__commit_id__ = commit_id = 'gabc1234'\n" % version)
        for name, text in files.items():
            zf.writestr(name, text)
    return path


CALLER = ("from vllm.model_executor.determinism.batch_invariant import linear_batch_invariant\n"
          "def apply(x, w, b=None):\n    return linear_batch_invariant(x, w, b)\n")


def test_derive_reads_a_wheel_without_importing_it(tmp_path):
    """A made-up release 9.9.0 whose matmul_persistent takes a fourth required argument: the
    manifest says so and the check refuses it."""
    bi = ("import torch\n_CFG = {}\n"
          "def matmul_persistent(a, b, bias=None, *, config):\n    return torch.mm(a, b)\n"
          "def mm_batch_invariant(a, b, bias=None):\n    return matmul_persistent(a, b, bias)\n"
          "def linear_batch_invariant(input, weight, bias=None):\n"
          "    return mm_batch_invariant(input, weight.t(), bias=bias)\n")
    wheel = _wheel(tmp_path, "9.9.0", {
        "vllm/model_executor/determinism/batch_invariant.py": bi,
        "vllm/model_executor/layers/linear.py": CALLER,
        "vllm/model_executor/layers/vocab_parallel_embedding.py": CALLER,
        "vllm/model_executor/determinism/batch_invariant_configs.py":
            "_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS = {'hopper': {(6144, 4096): [], "
            "(4096, 4096): []}}\n"})
    m = hook_manifest.derive_manifest(wheel)
    assert (m["vllm_version"], m["commit"], m["wheel"]) == ("9.9.0", "gabc1234", wheel.name)
    assert m["hook_module"]["functions"]["matmul_persistent"] == {
        "params": ["a", "b", "bias", "config"], "defaults": {"bias": "None"},
        "names": ["torch"]}
    assert m["call_path"] == ["linear_batch_invariant", "mm_batch_invariant", "matmul_persistent"]
    assert m["tuned_tables"] == {"module": hook_manifest.TABLES_MODULE, "read_by_hook": False,
                                 "shapes": {"hopper": ["4096x4096", "6144x4096"]}}
    assert hook_manifest.check_manifest(m) == ["matmul_persistent requires more parameters: config"]


def test_derive_refuses_a_wheel_without_the_hook_module(tmp_path):
    wheel = _wheel(tmp_path, "9.9.1", {"vllm/__init__.py": ""})
    with pytest.raises(ValueError, match="holds none of vllm.model_executor.determinism"):
        hook_manifest.derive_manifest(wheel)


def test_the_command_writes_the_manifest_and_says_whether_it_is_hookable(tmp_path, capsys):
    bi = ("def matmul_persistent(a, b, bias=None):\n    pass\n"
                   "def linear_batch_invariant(input, weight, bias=None):\n"
                   "    return matmul_persistent(input, weight.t(), bias)\n")
    wheel = _wheel(tmp_path, "9.9.2", {"vllm/model_executor/determinism/batch_invariant.py": bi,
                                       "vllm/model_executor/layers/linear.py": CALLER,
                                       "vllm/model_executor/layers/vocab_parallel_embedding.py":
                                           CALLER})
    assert hook_manifest.main(["9.9.2", "--wheel", str(wheel), "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "9.9.2.json").read_text())
    assert written["call_path"] == ["linear_batch_invariant", "matmul_persistent"]
    assert capsys.readouterr().out.endswith(
        "vllm.model_executor.determinism.batch_invariant, path linear_batch_invariant -> "
        "matmul_persistent; the plugin can hook it\n")
    assert hook_manifest.main(["9.9.3", "--wheel", str(wheel), "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_committed_manifest_rederives_byte_for_byte_from_the_wheel(version):
    wheel = vllm_wheel(version)      # where BISTAT_VLLM_WHEELS names a folder with it
    assert hook_manifest.dumps(hook_manifest.derive_manifest(wheel)) == (
        hook_manifest.MANIFEST_DIR / f"{version}.json").read_text()
