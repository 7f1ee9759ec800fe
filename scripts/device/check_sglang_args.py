"""Before any device time, on the CPU: does bistat's sglang-server adapter build command lines that
this SGLang accepts?

For every declaration given (default: every ``experiments/*.toml`` with ``kind = "sglang-server"``)
and each of its arms, the command line bistat's adapter builds
(``SGLangServerEngine.from_experiment(...).argv``) goes through SGLang's own argument parser and
``ServerArgs`` construction: ``sglang.srt.server_args.prepare_server_args``, what
``python -m sglang.launch_server`` itself runs first. SGLang's resolution (which reads the model's
config and the GPU) is not run. With ``--names`` it first checks that the flags recorded in
``src/bistat/data/sglang_args.json`` (``scripts/sglang_arg_names.py``) are exactly the option
strings of this SGLang's parser (``ServerArgs.add_cli_args``).

SGLang is imported, but no GPU is touched. A site that imports ``sglang.srt.server_args`` on the
CPU: ``pip install --no-deps --target SITE sglang==0.5.23 orjson pybase64 msgspec aiohttp multidict
yarl propcache aiohappyeyeballs aiosignal frozenlist`` plus a torch (a CPU torch 2.13 does) and
bistat's own dependencies (pydantic, numpy, ...) on the interpreter:

    PYTHONPATH=SITE python scripts/device/check_sglang_args.py [--names] [TOML ...]

Exit 0 when every arm passed (and the names agree), 1 otherwise. No GPU, no network.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def check_names(version: str) -> bool:
    """The recorded flags against the parser's option strings; prints the comparison."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    real = {o.lstrip("-").replace("-", "_") for a in parser._actions for o in a.option_strings
            if o.startswith("--")} - {"help"}
    recorded = json.loads((ROOT / "src" / "bistat" / "data" / "sglang_args.json").read_text())
    names = set(recorded.get(version, ()))
    same = names == real
    print(f"recorded names: {len(names)}, the parser's: {len(real)}, "
          f"{'equal' if same else 'DIFFERENT'}")
    if not same:
        print(f"  only recorded: {sorted(names - real)[:20]}")
        print(f"  only in the parser: {sorted(real - names)[:20]}")
    return same


def check(paths: list[str]) -> int:
    from sglang.srt.server_args import prepare_server_args

    from bistat.declare.experiment import load_experiment
    from bistat.engines.sglang_server import SGLangServerEngine

    failed = 0
    for path in paths:
        exp = load_experiment(path)
        if exp.engine.kind != "sglang-server":
            continue
        for arm in exp.arms:
            where = f"{Path(path).name} [{arm.name}]"
            engine = SGLangServerEngine.from_experiment(exp, arm)
            argv = engine.argv(30000)
            flags = argv[len(engine.command):]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    try:
                        server_args = prepare_server_args(flags)
                    except SystemExit:
                        raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
                backend = getattr(server_args, "attention_backend", None)
                det = getattr(server_args, "enable_deterministic_inference", None)
                print(f"OK   {where}: {len(flags)} flags parsed; attention_backend={backend}, "
                      f"enable_deterministic_inference={det}")
            except Exception as exc:  # noqa: BLE001 - each arm's failure is reported, not raised
                failed += 1
                print(f"FAIL {where}: {type(exc).__name__}: {exc}")
    print(f"{failed} arm(s) failed" if failed else "every arm passed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("declarations", nargs="*")
    ap.add_argument("--names", action="store_true",
                    help="also compare the recorded flag names with this SGLang's parser")
    args = ap.parse_args()
    import importlib.metadata
    import importlib.util

    version = importlib.metadata.version("sglang")
    where = list(importlib.util.find_spec("sglang").submodule_search_locations)[0]
    print(f"SGLang {version} from {where}")
    ok = check_names(version) if args.names else True
    paths = args.declarations or sorted(glob.glob(str(ROOT / "experiments" / "*.toml")))
    rc = check(paths)
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
