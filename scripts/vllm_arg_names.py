"""Record the argument names a vLLM release accepts, read from its unpacked wheel without
importing it, into ``src/bistat/data/vllm_args.json`` (``bistat register`` checks the ``args``
of ``vllm-offline`` and ``vllm-server`` declarations against them).

    python scripts/vllm_arg_names.py VERSION SITE [VERSION SITE ...]

``SITE`` is the folder holding the ``vllm`` package (``pip install --no-deps --target SITE
vllm==VERSION`` or an unpacked wheel). Offline names: the fields of ``EngineArgs`` and the
parameters of ``LLM.__init__`` (``vllm.LLM`` keyword arguments). Server names: ``EngineArgs``'
fields and every ``--flag`` string in ``vllm/entrypoints`` (the frontend dataclasses and the
arguments ``vllm serve`` adds itself), written as Python names (``max_num_seqs``).
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "bistat" / "data" / "vllm_args.json"


def _class_fields(tree: ast.Module, name: str) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise SystemExit(f"class {name} not found")


def _init_params(tree: ast.Module, cls: str) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    a = fn.args
                    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                            if x.arg != "self"]
    raise SystemExit(f"{cls}.__init__ not found")


def names(site: Path) -> dict[str, list[str]]:
    vllm = site / "vllm"
    engine = _class_fields(ast.parse((vllm / "engine" / "arg_utils.py").read_text()), "EngineArgs")
    llm = _init_params(ast.parse((vllm / "entrypoints" / "llm.py").read_text()), "LLM")
    flags: set[str] = set()
    for path in (vllm / "entrypoints").rglob("*.py"):
        text = path.read_text(errors="replace")
        flags.update(m.replace("-", "_") for m in re.findall(r"""["']--([a-z][a-z0-9-]*)["']""", text))
        tree = ast.parse(text)
        for node in ast.walk(tree):   # the frontend dataclasses: every field becomes a flag
            if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
                flags.update(_class_fields(tree, node.name))
    return {"offline": sorted(set(engine) | set(llm)), "server": sorted(set(engine) | flags)}


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 2:
        raise SystemExit(__doc__)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    for version, site in zip(argv[::2], argv[1::2]):
        data[version] = names(Path(site))
        print(f"vLLM {version}: {len(data[version]['offline'])} offline, "
              f"{len(data[version]['server'])} server argument names")
    OUT.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
