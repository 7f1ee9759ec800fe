"""What a vLLM wheel holds of the hooks the tuned-GEMM plugin needs, read with ``ast`` (no import).

``kernels/bistat_kernels/vllm_hooks/VERSION.json`` is one such manifest per vLLM release the plugin supports.
It is derived from the wheel itself, never written by hand::

    python -m bistat_kernels.hook_manifest 0.33.0                 # pip download --no-deps vllm==0.33.0
    python -m bistat_kernels.hook_manifest 0.33.0 --wheel PATH    # a wheel already here

A manifest holds (schema ``bistat_kernels.vllm_hooks/1``):

- ``vllm_version`` (the wheel's ``METADATA``), ``commit`` (``vllm/_version.py``'s
  ``__commit_id__``), ``wheel`` (file name) and ``wheel_sha256``;
- ``hook_module``: which of :data:`bistat_kernels.vllm_plugin.TARGET_MODULES` the wheel has, and
  every top-level function of it: parameters, the source text of their defaults, and the
  module-level names its body uses (:func:`bistat_kernels.vllm_plugin.hook_problems` reads this);
  ``call_path``: the chain from ``linear_batch_invariant`` to ``matmul_persistent``;
- ``callers``: for each of :data:`~bistat_kernels.vllm_plugin.CALLERS`, the names it imports from
  the hook module and whether it calls ``linear_batch_invariant``;
- ``tuned_tables``: vLLM's own M-bucketed GEMM tables where the release has them
  (``batch_invariant_configs._BATCH_INVARIANT_MATMUL_TUNED_CONFIGS``): the (N, K) shapes per
  architecture family, and whether ``matmul_persistent`` reads them (``_get_matmul_config``).

:func:`check_manifest` is what the tests run on every committed manifest: a vLLM that moves the
hooks fails a test here before it fails a user's run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from bistat_kernels import vllm_plugin

SCHEMA = "bistat_kernels.vllm_hooks/1"
MANIFEST_DIR = Path(__file__).resolve().parent / "vllm_hooks"
TABLES_MODULE = "vllm.model_executor.determinism.batch_invariant_configs"
TABLES_NAME = "_BATCH_INVARIANT_MATMUL_TUNED_CONFIGS"


def _path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _defined_names(tree: ast.Module) -> set[str]:
    """Module-level names: functions, classes, assignments, imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_view(source: str, module: str) -> dict[str, Any]:
    """The view :func:`bistat_kernels.vllm_plugin.hook_problems` reads, from source text:
    each top-level function's parameters, defaults (source text) and the module-level names
    (loaded, in its body and nested functions) it uses."""
    tree = ast.parse(source)
    top = _defined_names(tree)
    functions = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        positional = a.posonlyargs + a.args
        params = [p.arg for p in positional] + ([a.vararg.arg] if a.vararg else []) \
            + [p.arg for p in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
        defaults = {p.arg: ast.unparse(d) for p, d in zip(positional[len(positional)
                                                                     - len(a.defaults):],
                                                          a.defaults)}
        defaults.update({p.arg: ast.unparse(d) for p, d in zip(a.kwonlyargs, a.kw_defaults)
                         if d is not None})
        used = {n.id for stmt in node.body for n in ast.walk(stmt)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        functions[node.name] = {"params": params, "defaults": defaults,
                                "names": sorted(used & top)}
    return {"module": module, "functions": dict(sorted(functions.items()))}


def _caller_view(source: str, hook_module: str) -> dict[str, Any]:
    tree = ast.parse(source)
    imported = sorted({a.asname or a.name for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and node.module == hook_module
                       for a in node.names})
    calls = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id == vllm_plugin.ENTRY for n in ast.walk(tree))
    return {"imports_from_hook_module": imported, "calls_entry": calls}


def _tuned_tables(source: str) -> dict[str, list[str]]:
    """``{family: ["NxK", ...]}`` of the tuned-config table literal (keys only)."""
    tree = ast.parse(source)
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) else
                  node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and target.id == TABLES_NAME and node.value is not None:
            value = node.value
            if not isinstance(value, ast.Dict):
                return {}
            out = {}
            for fam, table in zip(value.keys, value.values):
                shapes = []
                if isinstance(table, ast.Dict):
                    for key in table.keys:
                        if isinstance(key, ast.Tuple):
                            shapes.append("x".join(ast.unparse(e) for e in key.elts))
                out[ast.literal_eval(fam)] = sorted(shapes)
            return dict(sorted(out.items()))
    return {}


def derive_manifest(wheel: str | Path) -> dict[str, Any]:
    """The manifest of a vLLM wheel (see the module docstring); nothing is imported.

    Raises
    ------
    ValueError
        The file is not a vLLM wheel, or holds none of the plugin's target modules.
    """
    wheel = Path(wheel)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())

        def text(path: str) -> str:
            return zf.read(path).decode("utf-8")

        meta = next((n for n in names if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)), None)
        if meta is None:
            raise ValueError(f"{wheel}: no vllm-*.dist-info/METADATA; not a vLLM wheel")
        version = re.search(r"^Version: (\S+)$", text(meta), re.M)
        commit = None
        if "vllm/_version.py" in names:
            for node in ast.parse(text("vllm/_version.py")).body:
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__commit_id__"
                        for t in ast.walk(node)):
                    commit = ast.literal_eval(node.value)
        hook = next((m for m in vllm_plugin.TARGET_MODULES if _path(m) in names), None)
        if hook is None:
            raise ValueError(f"{wheel}: holds none of {', '.join(vllm_plugin.TARGET_MODULES)}")
        view = module_view(text(_path(hook)), hook)
        callers = {m: (_caller_view(text(_path(m)), hook) if _path(m) in names else None)
                   for m in vllm_plugin.CALLERS}
        tables = (_tuned_tables(text(_path(TABLES_MODULE))) if _path(TABLES_MODULE) in names
                  else {})
    hook_fn = view["functions"].get(vllm_plugin.HOOK) or {}
    return {
        "schema": SCHEMA,
        "vllm_version": version.group(1) if version else None,
        "commit": commit,
        "wheel": wheel.name,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "derived_by": "python -m bistat_kernels.hook_manifest VERSION (ast, no import)",
        "hook_module": view,
        "call_path": vllm_plugin.call_path(view),
        "callers": callers,
        "tuned_tables": {"module": TABLES_MODULE if tables else None,
                         "read_by_hook": "_get_matmul_config" in (hook_fn.get("names") or []),
                         "shapes": tables},
    }


def check_manifest(manifest: dict[str, Any]) -> list[str]:
    """What keeps the plugin from hooking the release a manifest describes; empty: it can.

    :func:`bistat_kernels.vllm_plugin.hook_problems` on the hook module, and every caller of
    ``linear_batch_invariant`` importing it by name from that module and calling it.
    """
    problems = list(vllm_plugin.hook_problems(manifest.get("hook_module") or {}))
    hook = (manifest.get("hook_module") or {}).get("module")
    if hook not in vllm_plugin.TARGET_MODULES:
        problems.append(f"hook module {hook!r} is none of {', '.join(vllm_plugin.TARGET_MODULES)}")
    for caller in vllm_plugin.CALLERS:
        view = (manifest.get("callers") or {}).get(caller)
        if view is None:
            problems.append(f"{caller} is missing")
        elif vllm_plugin.ENTRY not in view.get("imports_from_hook_module", []):
            problems.append(f"{caller} does not import {vllm_plugin.ENTRY} from {hook}")
        elif not view.get("calls_entry"):
            problems.append(f"{caller} does not call {vllm_plugin.ENTRY}")
    return problems


def load_manifests(folder: Path = MANIFEST_DIR) -> dict[str, dict[str, Any]]:
    """The committed manifests, by vLLM version."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(folder.glob("*.json"))}


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def download_wheel(version: str, dest: Path) -> Path:
    """``pip download --no-deps vllm==VERSION`` (the manylinux x86_64 wheel) into ``dest``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                    "--python-version", "3.12", "-d", str(dest), f"vllm=={version}"], check=True)
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no vllm-{version}-*.whl in {dest}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.33.0")
    parser.add_argument("--wheel", type=Path, help="a wheel already here (else pip download)")
    parser.add_argument("--out", type=Path, default=MANIFEST_DIR,
                        help="folder for VERSION.json (default: kernels/bistat_kernels/vllm_hooks)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_wheel(args.version, Path(tmp))
        manifest = derive_manifest(wheel)
    if manifest["vllm_version"] != args.version:
        print(f"{wheel} is vLLM {manifest['vllm_version']}, not {args.version}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.version}.json"
    out.write_text(dumps(manifest), encoding="utf-8")
    problems = check_manifest(manifest)
    print(f"{out}: {manifest['hook_module']['module']}, path "
          f"{' -> '.join(manifest['call_path'] or ['none'])}; "
          + ("the plugin can hook it" if not problems else "NOT hookable: " + "; ".join(problems)))
    return 0 if not problems else 2


if __name__ == "__main__":
    sys.exit(main())
