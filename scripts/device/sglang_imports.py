"""On the CPU, without importing SGLang: which third-party modules ``python -m sglang.launch_server``
imports when its modules load (the import simulation behind scripts/device/wheels-sglang-0.5.23.txt).

From the entry modules (default :data:`ENTRIES`: the launcher, the HTTP server, the scheduler and
detokenizer processes, the model runner, the Llama/Qwen3 models, the fa3 / triton / flashinfer
attention backends, the sampler and the batch-invariant ops), every ``import`` that runs when a
module loads (module level, class bodies, ``try`` / ``if`` blocks; not function bodies, which run
only when called) is followed through the ``sglang`` package; imports of other packages are
collected by top-level name. An import inside ``try: ... except ImportError`` (or a bare
``except``/``Exception``) is *optional*: SGLang runs without it.

    python scripts/device/sglang_imports.py SITE [MODULE ...]

prints ``KIND NAME (first importer)`` lines, ``required`` first, then ``conditional`` (only under an
``if``: SGLang imports it on some platforms or settings) and ``optional``. ``SITE`` holds the
unpacked ``sglang`` package. Function-level imports that a start on the GPU runs (the chosen
backend's kernels) are caught by naming their modules as entries; what this cannot see, the
device smoke test (scripts/device/sglang_smoke.py) does.
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
OPTIONAL_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", None}


def _module_file(site: Path, name: str) -> Path | None:
    base = site.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    pkg = parts[:len(parts) - node.level + (1 if _is_pkg(module) else 0)]
    return ".".join(pkg + ([node.module] if node.module else []))


_PKG: set[str] = set()


def _is_pkg(module: str) -> bool:
    return module in _PKG


def _load_time_imports(tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    """Import statements that run at load time, each ``required``, ``conditional`` (inside an
    ``if``: a platform or flag decides) or ``optional`` (an except clause guards it)."""
    found: list[tuple[ast.stmt, str]] = []

    def walk(stmts: list[ast.stmt], guarded: str) -> None:
        for st in stmts:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                found.append((st, guarded))
            elif isinstance(st, ast.Try):
                catches = any(h.type is None or getattr(h.type, "id", None) in OPTIONAL_EXCEPTIONS
                              or (isinstance(h.type, ast.Tuple) and any(
                                  getattr(e, "id", None) in OPTIONAL_EXCEPTIONS for e in h.type.elts))
                              for h in st.handlers)
                walk(st.body, "optional" if catches else guarded)
                for h in st.handlers:
                    walk(h.body, guarded)
                walk(st.orelse, guarded)
                walk(st.finalbody, guarded)
            elif isinstance(st, ast.If):
                if "TYPE_CHECKING" in ast.unparse(st.test):
                    continue  # never at run time
                sub = guarded if guarded == "optional" else "conditional"
                walk(st.body, sub)
                walk(st.orelse, sub)
            elif isinstance(st, ast.With):
                walk(st.body, guarded)
            elif isinstance(st, ast.ClassDef):
                walk(st.body, guarded)
    walk(tree.body, "required")
    return found


RANK = {"required": 0, "conditional": 1, "optional": 2}


def closure(site: Path, entries: list[str]) -> dict[str, tuple[str, str]]:
    """Top-level name -> (the strongest kind it is imported with, its first importer of that
    kind) over the load-time closure; a module reached only through conditional or optional
    imports passes that kind on to what it imports."""
    found: dict[str, tuple[str, str]] = {}
    seen: set[str] = set()
    todo = [(e, "required") for e in entries]
    while todo:
        module, guarded = todo.pop()
        key = f"{module}:{guarded}"
        if key in seen:
            continue
        seen.add(key)
        path = _module_file(site, module)
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
            if isinstance(st, ast.ImportFrom):  # `from pkg import sub` may load pkg.sub
                names += [f"{names[0]}.{a.name}" for a in st.names]
            for name in names:
                top = name.split(".")[0]
                if top == "sglang":
                    todo.append((name, kind))
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    if top not in found or RANK[kind] < RANK[found[top][0]]:
                        found[top] = (kind, module)
    return found


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    found = closure(Path(argv[0]), argv[1:] or ENTRIES)
    for name, (kind, where) in sorted(found.items(), key=lambda x: (RANK[x[1][0]], x[0])):
        print(f"{kind} {name} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
