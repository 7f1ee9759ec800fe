"""Record the flags an SGLang release's ``python -m sglang.launch_server`` accepts, read from its
unpacked wheel without importing it, into ``src/bistat/data/sglang_args.json`` (``bistat
register`` checks the ``args`` of ``sglang-server`` declarations against them).

    python scripts/sglang_arg_names.py VERSION SITE [VERSION SITE ...]

``SITE`` is the folder holding the ``sglang`` package (``pip install --no-deps --target SITE
sglang==VERSION`` or an unpacked wheel: ``python3 -m pip download --no-deps sglang==VERSION``,
then unzip). SGLang 0.5.23 builds its parser from the ``ServerArgs`` namespaces in
``sglang/srt/arg_groups/fields/*.py`` (``add_cli_args_from_dataclass`` in
``sglang/srt/arg_groups/arg_utils.py``): every field annotated ``A[T, "help"]`` or
``A[T, Arg(...)]`` becomes ``--field-name`` (or ``Arg(cli_name=...)``) plus its ``aliases``,
unless ``Arg(no_cli=True)``; a field with ``action=argparse.BooleanOptionalAction`` also takes
``--no-field-name``. ``ServerArgs.add_cli_args`` (``sglang/srt/server_args.py``) adds the flags
with dynamic choices, ``--config`` and deprecated spellings by ``parser.add_argument("--...")``.
Names are written as Python names (``--attention-backend`` -> ``attention_backend``), the way a
declaration's ``args`` spell them. ``tests/test_engine_sglang.py`` checks the result against
SGLang's own parser where a site with SGLang and a torch is at hand.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "bistat" / "data" / "sglang_args.json"


def _python_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _arg_call(annotation: ast.expr) -> ast.Call | str | None:
    """The ``Arg(...)`` call or the help string of an ``A[T, ...]`` annotation; None otherwise."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "A" and isinstance(annotation.slice, ast.Tuple)
            and len(annotation.slice.elts) >= 2):
        return None
    meta = annotation.slice.elts[1]
    if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
        return meta.value
    if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
        return meta
    return None


def _field_flags(name: str, meta: ast.Call | str) -> list[str]:
    """The flags one field adds (see the module docstring)."""
    if isinstance(meta, str):
        return [name]
    kw = {k.arg: k.value for k in meta.keywords if k.arg}
    if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
        return []
    cli = kw.get("cli_name")
    flags = [_python_name(cli.value) if isinstance(cli, ast.Constant) else name]
    aliases = kw.get("aliases")
    if isinstance(aliases, (ast.List, ast.Tuple)):
        flags += [_python_name(e.value) for e in aliases.elts if isinstance(e, ast.Constant)]
    action = kw.get("action")
    if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
        flags += ["no_" + f for f in list(flags)]
    return flags


def names(site: Path) -> list[str]:
    """Every flag of ``launch_server`` in the SGLang at ``site``, as Python names, sorted."""
    srt = site / "sglang" / "srt"
    flags: set[str] = set()
    for path in sorted((srt / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                meta = _arg_call(node.annotation)
                if meta is not None:
                    flags.update(_field_flags(node.target.id, meta))
    text = (srt / "server_args.py").read_text()
    flags.update(_python_name(m) for m in re.findall(r"""add_argument\(\s*["'](--[a-z][a-z0-9-]*)["']""",
                                                     text))
    if not flags:
        raise SystemExit(f"no flags found under {srt}: is this an SGLang 0.5 site?")
    return sorted(flags)


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 2:
        raise SystemExit(__doc__)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    for version, site in zip(argv[::2], argv[1::2]):
        data[version] = names(Path(site))
        print(f"SGLang {version}: {len(data[version])} launch_server argument names")
    OUT.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
