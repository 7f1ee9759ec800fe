"""Before any device time, on the CPU: do bistat's vLLM adapters build what this vLLM accepts?

For every declaration given (default: every ``experiments/*.toml`` with a vLLM engine) and each of
its arms, through bistat's own adapters (``VLLMServerEngine.from_experiment(...).argv`` and
``VLLMOfflineEngine.from_experiment(...).engine_args``):

- ``vllm-server``: the ``vllm serve`` command line goes through vLLM's own ``serve`` argument
  parser and its ``validate`` (``vllm.entrypoints.cli.serve.cmd_init()``, the subcommand ``vllm``
  itself runs), then ``EngineArgs.from_cli_args``;
- ``vllm-offline``: the ``vllm.LLM`` keyword arguments must each be a parameter of ``LLM`` or a
  field of ``EngineArgs`` (``LLM`` hands its keyword arguments to ``EngineArgs``), and
  ``EngineArgs(model=..., **kwargs)`` must construct.

With ``--config MODELS`` it also predicts the compilation / CUDA-graph mode each arm will run in on
an H200, by vLLM 0.33's own rule and its Hopper table (``_predicted_mode``), with the model paths
under ``/tmp/model`` mapped to ``MODELS`` (folders holding the models' ``config.json``:
``bistat synth-model --config-only`` writes the Qwen3 ones, ``bistat model export`` SmolLM2's).
(Building the full ``VllmConfig`` on the CPU stops at vLLM's CUDA-only model inspection.) vLLM's
platform is faked as an H200 (``../shared/device-latest/sim_imports.py``'s way; its CUDA extensions
are stubbed, so a CPU torch will do). vLLM is imported; run it with the vLLM to check on the path:

    PYTHONPATH=SITE python scripts/device/check_vllm_args.py [--config MODELS] [TOML ...]

Exit 0 when every arm passed, 1 otherwise. No GPU, no network.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import inspect
import io
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def _serve_parser():
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    (serve,) = cmd_init()
    serve.subparser_init(subparsers)
    return parser, serve


def _fake_h200() -> None:
    """torch.cuda and vLLM's platform detection see an H200 (capability 9.0)."""
    import types

    import torch

    props = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200", multi_processor_count=132,
                                  total_memory=150 * 2**30, gcnArchName="", L2_cache_size=50 * 2**20,
                                  warp_size=32, max_threads_per_multi_processor=2048,
                                  regs_per_multiprocessor=65536, shared_memory_per_block_optin=232448,
                                  uuid="fake")
    torch.cuda.get_device_capability = lambda d=None: (9, 0)
    torch.cuda.get_device_properties = lambda d=None: props
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda d=None: "NVIDIA H200"
    torch.cuda.current_device = lambda: 0
    # vLLM's CUDA extensions need a CUDA torch and a driver; building configs runs none of them
    for ext in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C", "vllm._qutlass_C"):
        sys.modules.setdefault(ext, types.ModuleType(ext))

    class _Stub(types.ModuleType):  # FlashAttention's extension: names only, nothing runs
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    sys.modules.setdefault("vllm.vllm_flash_attn", _Stub("vllm.vllm_flash_attn"))
    import vllm.platforms as platforms

    platforms.builtin_platform_plugins["cuda"] = lambda: "vllm.platforms.cuda.CudaPlatform"
    platforms.builtin_platform_plugins["cpu"] = lambda: None


def _predicted_mode(model_dir: Path, args: dict[str, Any], env: dict[str, str]) -> str:
    """The mode vLLM 0.33 picks, by its own rule (vllm/config/vllm.py,
    ``_uses_breakable_cudagraph_for_batch_invariance``): with ``VLLM_BATCH_INVARIANT=1``, bf16,
    unquantized, not eager, on a GPU family with a tuned table, and any of the model's qkv / o /
    gate_up / down (N, K) shapes in that table, vLLM sets ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` and
    compilation mode NONE, unless the environment already sets that variable (``0`` opts out);
    otherwise torch.compile (VLLM_COMPILE). The Hopper table comes from the
    release's hook manifest (kernels/bistat_kernels/vllm_hooks/VERSION.json, read from the wheel)."""
    import json

    import vllm

    from bistat_kernels.hook_manifest import load_manifests

    manifest = load_manifests().get(vllm.__version__)
    tables = (manifest or {}).get("tuned_tables", {}).get("shapes", {})
    if args.get("enforce_eager"):
        return "eager (enforce_eager): no torch.compile, no CUDA graphs"
    if env.get("VLLM_BATCH_INVARIANT") != "1" or "hopper" not in tables:
        return "torch.compile (VLLM_COMPILE) + CUDA graphs"
    if env.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "0":  # the arm opts out of vLLM's choice
        return "torch.compile (VLLM_COMPILE) + CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=0)"
    if not (model_dir / "config.json").is_file():
        return f"not predicted ({model_dir} is not a local model folder)"
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, head = cfg.get("num_key_value_heads", heads), cfg.get("head_dim", hidden // heads)
    tp = int(args.get("tensor_parallel_size") or 1)
    inter = cfg.get("intermediate_size")
    shapes = [((heads // tp + 2 * max(kv // tp, 1)) * head, hidden), (hidden, heads // tp * head)]
    if isinstance(inter, int):
        shapes += [(2 * inter // tp, hidden), (hidden, inter // tp)]
    hit = [f"{n}x{k}" for n, k in shapes if f"{n}x{k}" in tables["hopper"]]
    if hit and str(args.get("dtype", "bfloat16")) in ("bfloat16", "auto"):
        return f"breakable CUDA graphs, no torch.compile (tuned shapes {', '.join(hit)})"
    return "torch.compile (VLLM_COMPILE) + CUDA graphs (no shape in vLLM's Hopper table)"


def _map_model(model: str, models: Path | None) -> str:
    if models is not None and model.startswith("/tmp/model/"):
        return str(models / model[len("/tmp/model/"):])
    return model


def check(paths: list[str], models: Path | None) -> int:
    _fake_h200()  # before vLLM resolves its platform: its argument defaults read it
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from bistat.engines.vllm_offline import VLLMOfflineEngine
    from bistat.engines.vllm_server import VLLMServerEngine
    from bistat.declare.experiment import load_experiment

    parser, serve = _serve_parser()
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    llm_params = set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    failed = 0
    for path in paths:
        exp = load_experiment(path)
        kind = exp.engine.kind
        if not kind.startswith("vllm"):
            continue
        for arm in exp.arms:
            where = f"{Path(path).name} [{arm.name}] {kind}"
            try:
                if kind == "vllm-server":
                    server = VLLMServerEngine.from_experiment(exp, arm)
                    argv = server.argv(8000)
                    argv[2] = _map_model(argv[2], models)
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err):
                        try:
                            args = parser.parse_args(argv[1:])
                        except SystemExit:
                            raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
                    serve.validate(args)
                    if getattr(args, "model_tag", None):
                        args.model = args.model_tag
                    EngineArgs.from_cli_args(args)
                    what = f"`{' '.join(argv[1:3])} ...` ({len(argv) - 3} flags) parsed"
                else:
                    offline = VLLMOfflineEngine.from_experiment(exp, arm)
                    kwargs = dict(offline.engine_args)
                    unknown = sorted(set(kwargs) - fields - llm_params)
                    if unknown:
                        raise ValueError(f"vllm.LLM takes no {', '.join(unknown)}")
                    EngineArgs(model=_map_model(exp.engine.model, models),
                                             **{k: v for k, v in kwargs.items() if k in fields})
                    what = f"LLM kwargs {sorted(kwargs)} accepted"
                if models is not None:
                    merged = {**dict(exp.engine.args), **dict(arm.args)}
                    what += "; predicted: " + _predicted_mode(
                        Path(_map_model(exp.engine.model, models)), merged, dict(arm.env))
                print(f"OK   {where}: {what}")
            except Exception as exc:  # noqa: BLE001 - each arm's failure is reported, not raised
                failed += 1
                print(f"FAIL {where}: {type(exc).__name__}: {exc}")
    print(f"{failed} arm(s) failed" if failed else "every arm passed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("declarations", nargs="*")
    ap.add_argument("--config", type=Path, metavar="MODELS",
                    help="also build each arm's VllmConfig on a faked H200 (models under MODELS)")
    args = ap.parse_args()
    paths = args.declarations or sorted(glob.glob(str(ROOT / "experiments" / "*.toml")))
    return check(paths, args.config)


if __name__ == "__main__":
    sys.exit(main())
