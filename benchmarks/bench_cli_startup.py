#!/usr/bin/env python3
"""Benchmark: the start-up time of ``bistat --help`` and of every command's ``--help``.

Goal: every ``--help`` under 0.3 s on the 2-core machine. The heavy libraries
(matplotlib, pandas, pyarrow, scipy, numpy, pydantic, httpx, ...) load only when a command runs;
``tests/test_lazy.py`` checks that no ``--help`` imports them, this script measures the time. It
prints figures; it is not a timed test::

    python benchmarks/bench_cli_startup.py                   # median of 7 runs per command
    python benchmarks/bench_cli_startup.py --repeat 11
    git archive REV src kernels | tar -x -C /tmp/base        # another bistat, side by side:
    python benchmarks/bench_cli_startup.py --baseline /tmp/base/src

Each run is a whole new process, ``python -m bistat ... --help`` with its output thrown away, timed
from outside (``time.perf_counter`` around ``subprocess.run``): interpreter start-up and imports
included, which is what a user waits for. The commands are this checkout's (``bistat``, then every
command and subcommand). With ``--baseline SRC`` the runs alternate between this checkout and the
bistat under SRC (first on ``PYTHONPATH``, with SRC's sibling ``kernels``), so that a drift of the
machine's speed touches both alike, and the ratio baseline / this is printed per command.
Two yardsticks come first: ``python -c pass`` and ``python -c "import click"``, the floor any
click command stands on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 0.3


def _help_paths() -> list[list[str]]:
    """``[]`` (bistat itself) and the path of every command and subcommand, in help order."""
    sys.path.insert(0, str(ROOT / "src"))
    from bistat.cli import cli

    def walk(group: click.Group, prefix: list[str]):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            yield prefix + [name]
            if isinstance(cmd, click.Group):
                yield from walk(cmd, prefix + [name])

    return [[], *walk(cli, [])]


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(src.parent / "kernels"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _once(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace').strip()[-500:]}")
    return wall


def _medians(argv: list[str], envs: list[dict[str, str]], repeat: int) -> list[float]:
    """The median wall time of ``argv`` under each environment, the runs alternating."""
    _once(argv, envs[0])                      # a warm-up: the files in the page cache
    walls: list[list[float]] = [[] for _ in envs]
    for _ in range(repeat):
        for i, env in enumerate(envs):
            walls[i].append(_once(argv, env))
    return [statistics.median(w) for w in walls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per command (default 7)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another bistat's src folder, timed side by side")
    args = parser.parse_args()
    this = _env(ROOT / "src")
    envs = [this] + ([_env(args.baseline.resolve())] if args.baseline else [])
    load = os.getloadavg()
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; load average before: {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")
    print(f"# median wall seconds of {args.repeat} whole-process runs each (after one warm-up)"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    py = sys.executable
    for name, argv in (("python -c pass", [py, "-c", "pass"]),
                       ("python -c 'import click'", [py, "-c", "import click"])):
        print(f"# yardstick {name}: {_medians(argv, [this], args.repeat)[0]:.3f} s")
    head = "command,median_s" + (",baseline_median_s,baseline_over_this" if args.baseline else "")
    print(head)
    rows = []
    for path in _help_paths():
        medians = _medians([py, "-m", "bistat", *path, "--help"], envs, args.repeat)
        label = " ".join(["bistat", *path, "--help"])
        rows.append((label, medians[0]))
        line = f"{label},{medians[0]:.3f}"
        if args.baseline:
            line += f",{medians[1]:.3f},{medians[1] / medians[0]:.2f}"
        print(line, flush=True)
    slowest = max(rows, key=lambda r: r[1])
    print(f"# slowest: {slowest[0]} {slowest[1]:.3f} s over {len(rows)} commands; median of the "
          f"commands' medians {statistics.median(r[1] for r in rows):.3f} s")
    met = slowest[1] < GOAL_S
    print(f"# goal every --help < {GOAL_S} s: {'met' if met else 'NOT met'}")
    load = os.getloadavg()
    print(f"# load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
