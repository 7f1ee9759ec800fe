"""Which third-party modules ``python -m sglang.launch_server`` imports when its modules load (the
import simulation behind scripts/device/wheels-sglang-0.5.23.txt), read on the CPU without
importing SGLang; and, on the device, the same modules imported for real.

From the entry modules (default :data:`ENTRIES`: the launcher, the HTTP server, the scheduler and
detokenizer processes, the model runner, the Llama/Qwen3 models, the fa3 / triton / flashinfer
attention backends, the sampler and the batch-invariant ops; with :data:`MODEL_PATH`, what the
scheduler imports inside functions while it builds the model), every ``import`` that runs when a
module loads (module level, class bodies, ``try`` / ``if`` / ``with`` blocks; not function bodies,
which run only when called) is followed through the ``sglang`` package, or with ``follow_all``
through every package of the site (scripts/device/payload_check.py ``imports``); imports of other
packages are collected by top-level name. An import guarded by ``except ImportError`` (or a bare
``except``/``Exception``), in such a clause's fallback, or under ``with suppress(ImportError)`` is
*optional*: the module runs without it.

    python scripts/device/sglang_imports.py SITE [MODULE ...]
    python scripts/device/sglang_imports.py --import-check [MODULE ...]   # on the device

The first prints ``KIND NAME (first importer)`` lines, ``required`` first, then ``conditional``
(only under an ``if``: SGLang imports it on some platforms or settings) and ``optional``. ``SITE``
holds the unpacked ``sglang`` package. The second imports ENTRIES and MODEL_PATH in this
interpreter (install.sh runs it and stops on a failure). What neither can see (kernels compiled
at first use: ``load_jit``, FlashInfer's JIT) the device smoke test (scripts/device/sglang_smoke.py)
does.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ENTRIES = """sglang.launch_server sglang.srt.entrypoints.http_server sglang.srt.entrypoints.engine
sglang.srt.managers.scheduler sglang.srt.managers.detokenizer_manager sglang.srt.managers.tokenizer_manager
sglang.srt.model_executor.model_runner sglang.srt.models.llama sglang.srt.models.qwen3
sglang.srt.layers.attention.flashattention_backend sglang.srt.layers.attention.triton_backend
sglang.srt.layers.attention.flashinfer_backend sglang.srt.layers.sampler
sglang.srt.batch_invariant_ops.batch_invariant_ops sglang.srt.server_args""".split()
#: Modules the scheduler imports inside functions while it builds a Llama/Qwen3 model and runs its
#: first forward (``DualGemm.__init__`` imports the CuTe DSL dual GEMM for the Llama MLP, which
#: imports ``cutlass.cute``; the rotary embedding JIT-loads ``fused_rope``): not load-time imports
#: of any module above, so they are named as entries.
MODEL_PATH = """sglang.kernels.ops.gemm.cutedsl_dual_gemm sglang.kernels.ops.gemm
sglang.srt.layers.quantization.unquant sglang.srt.layers.rotary_embedding
sglang.srt.layers.dual_gemm sglang.srt.layers.linear sglang.srt.layers.layernorm
sglang.srt.layers.activation sglang.srt.layers.logits_processor""".split()
OPTIONAL_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", None}


def _module_file(site: Path, name: str) -> Path | None:
    base = site.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _locate(roots: list[Path], name: str) -> tuple[str, Path | None]:
    """Where ``name`` is under ``roots``: ``("source", file)``, ``("binary", None)`` for an
    extension module, ``("namespace", None)`` for a folder without ``__init__.py``, or
    ``("absent", None)``."""
    for root in roots:
        path = _module_file(root, name)
        if path is not None:
            return "source", path
    parts = name.split(".")
    for root in roots:
        for i in range(len(parts), 0, -1):  # an extension module registers its own submodules
            base = root.joinpath(*parts[:i])
            if base.parent.is_dir() and (any(base.parent.glob(base.name + ".*.so"))
                                         or (base.parent / (base.name + ".so")).is_file()):
                return "binary", None
        if root.joinpath(*parts).is_dir():
            return "namespace", None
    return "absent", None


def site_roots(site: Path) -> list[Path]:
    """``site`` and the folders its ``.pth`` files add (cutlass-dsl's ``dsl_packages``), as
    ``site.addsitedir`` finds them in a bare interpreter (``-I -S``)."""
    import subprocess

    code = ("import site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
            "print('\\n'.join(p for p in sys.path if p not in before))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(site)],
                          capture_output=True, text=True, check=False)
    roots = [Path(p) for p in done.stdout.splitlines() if p] if done.returncode == 0 else []
    return [site] + [p for p in roots if p != site and p.is_dir()]


class Closure(dict):
    """Top-level name -> (kind, first importer), as :func:`closure` returns it; with
    ``follow_all``, ``missing`` maps each module that resolves nowhere in the site to (the
    strongest kind it is imported with, the chain of importers that reaches it)."""

    missing: dict[str, tuple[str, list[str]]]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    pkg = parts[:len(parts) - node.level + (1 if _is_pkg(module) else 0)]
    return ".".join(pkg + ([node.module] if node.module else []))


_PKG: set[str] = set()


def _is_pkg(module: str) -> bool:
    return module in _PKG


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    """Whether an ``except`` clause catches a failed import (bare, ImportError, Exception...)."""
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(t, "id", None) in OPTIONAL_EXCEPTIONS for t in types)


def _load_time_imports(tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    """Import statements that run at load time, each ``required``, ``conditional`` (inside an
    ``if``: a platform or flag decides) or ``optional`` (an except clause guards it)."""
    found: list[tuple[ast.stmt, str]] = []

    def walk(stmts: list[ast.stmt], guarded: str) -> None:
        for st in stmts:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                found.append((st, guarded))
            elif isinstance(st, ast.Try):
                catches = any(_catches_import_error(h) for h in st.handlers)
                walk(st.body, "optional" if catches else guarded)
                for h in st.handlers:  # a fallback runs only when the guarded import failed
                    walk(h.body, "optional" if _catches_import_error(h) else guarded)
                walk(st.orelse, guarded)
                walk(st.finalbody, guarded)
            elif isinstance(st, ast.If):
                if "TYPE_CHECKING" in ast.unparse(st.test):
                    continue  # never at run time
                sub = guarded if guarded == "optional" else "conditional"
                walk(st.body, sub)
                walk(st.orelse, sub)
            elif isinstance(st, ast.With):  # `with suppress(ImportError):` guards its body
                suppressed = any("suppress" in ast.unparse(item.context_expr)
                                 and "Error" in ast.unparse(item.context_expr)
                                 for item in st.items)
                walk(st.body, "optional" if suppressed else guarded)
            elif isinstance(st, ast.ClassDef):
                walk(st.body, guarded)
    walk(tree.body, "required")
    return found


RANK = {"required": 0, "conditional": 1, "optional": 2}
#: Modules every interpreter has (the standard library, ``__main__``, ``__future__``).
STDLIB = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"__main__", "__future__"}


def closure(site: Path, entries: list[str], *, follow_all: bool = False) -> Closure:
    """Top-level name -> (the strongest kind it is imported with, its first importer of that
    kind) over the load-time closure; a module reached only through conditional or optional
    imports passes that kind on to what it imports.

    By default only ``sglang``'s own modules are followed. ``follow_all`` follows every module
    the site holds (and the folders its ``.pth`` files add): a dependency's module-level imports
    count as SGLang's do, and each import that resolves nowhere is kept in ``missing``."""
    found = Closure()
    found.missing = {}
    roots = site_roots(site) if follow_all else [site]
    seen: set[str] = set()
    parent: dict[str, str] = {}
    todo = [(e, "required") for e in entries]

    def chain(module: str) -> list[str]:
        out = [module]
        while out[-1] in parent and parent[out[-1]] not in out and len(out) < 12:
            out.append(parent[out[-1]])
        return out[1:]

    while todo:
        module, guarded = todo.pop()
        key = f"{module}:{guarded}"
        if key in seen:
            continue
        seen.add(key)
        where, path = _locate(roots, module)
        if path is None:
            continue
        if path.name == "__init__.py":
            _PKG.add(module)
        # a submodule's import runs its packages' __init__ first
        parts = module.split(".")
        todo += [(".".join(parts[:i]), guarded) for i in range(1, len(parts))]
        tree = ast.parse(path.read_text(errors="replace"))
        for st, kind in _load_time_imports(tree):
            kind = max(kind, guarded, key=RANK.__getitem__)
            names = ([a.name for a in st.names] if isinstance(st, ast.Import)
                     else [_resolve(module, st)])
            # `from pkg import sub` may load pkg.sub, or only read an attribute of pkg
            maybe = [f"{names[0]}.{a.name}" for a in st.names] if isinstance(st, ast.ImportFrom) else []
            for name in names + maybe:
                top = name.split(".")[0]
                if not top or top in STDLIB:
                    continue
                if top != "sglang":
                    if top not in found or RANK[kind] < RANK[found[top][0]]:
                        found[top] = (kind, module)
                    if not follow_all:
                        continue
                if name != module:
                    parent.setdefault(name, module)
                state, _ = _locate(roots, name) if follow_all else ("source", None)
                if state == "absent":
                    if name in maybe:
                        continue  # an attribute of its package, not a module
                    old = found.missing.get(name)
                    if old is None or RANK[kind] < RANK[old[0]]:
                        found.missing[name] = (kind, [module] + chain(module))
                    continue
                todo.append((name, kind))
    return found


def import_check(modules: list[str]) -> int:
    """Import each module for real (on the device, after install.sh): the number that failed,
    each printed with its error. A module that fails here would fail the server's start."""
    import importlib
    import traceback

    failed = 0
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - any failure to import is the finding
            failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(f"[import-check] {module}: {type(exc).__name__}: {exc} "
                  f"({where.filename}:{where.lineno})", flush=True)
    print(f"[import-check] {len(modules) - failed} of {len(modules)} modules import", flush=True)
    return failed


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "--import-check":
        return 1 if import_check(argv[1:] or ENTRIES + MODEL_PATH) else 0
    found = closure(Path(argv[0]), argv[1:] or ENTRIES)
    for name, (kind, where) in sorted(found.items(), key=lambda x: (RANK[x[1][0]], x[0])):
        print(f"{kind} {name} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
