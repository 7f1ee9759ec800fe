"""bistat.core.lazy: the heavy libraries load on first use, and the stand-ins give the real
results; ``bistat --help`` and every command's ``--help`` load none of them (the import graph is
checked here, the time in benchmarks/bench_cli_startup.py)."""

import ast
import subprocess
import sys

from bistat.core.lazy import lazy_function, lazy_module


def test_lazy_module_and_function_give_the_real_values():
    norm = lazy_module("scipy.stats").norm
    assert round(float(norm.ppf(0.975)), 6) == 1.959964
    confint = lazy_function("statsmodels.stats.proportion", "proportion_confint")
    low, high = confint(8, 10, alpha=0.05, method="wilson")
    # Wilson 95 % interval of 8/10: (0.4902, 0.9433) (Newcombe 1998, Table I)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)


def test_importing_the_cli_loads_neither_scipy_nor_statsmodels():
    code = ("import sys, bistat.cli, bistat.core.stats, bistat.core.design;"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'statsmodels'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: What a command loads when it runs, never for its help: the numeric, table and plot libraries,
#: the declaration's models (pydantic), the HTTP client, the tokenizer, the progress display and
#: the GPU stack.
HEAVY = ("httpx", "jinja2", "matplotlib", "numpy", "pandas", "psutil", "pyarrow", "pydantic",
         "rich", "scipy", "statsmodels", "tokenizers", "torch", "triton", "vllm")


def test_every_help_loads_no_heavy_library():
    # one fresh interpreter: import the CLI, run `bistat --help` and every (sub)command's --help
    # through CliRunner, then see what was imported
    code = (
        "import sys, click\n"
        "from click.testing import CliRunner\n"
        "from bistat.cli import cli\n"
        "def walk(group, prefix):\n"
        "    ctx = click.Context(group)\n"
        "    for name in group.list_commands(ctx):\n"
        "        cmd = group.get_command(ctx, name)\n"
        "        yield prefix + [name]\n"
        "        if isinstance(cmd, click.Group):\n"
        "            yield from walk(cmd, prefix + [name])\n"
        "paths = [[]] + list(walk(cli, []))\n"
        "for path in paths:\n"
        "    result = CliRunner().invoke(cli, path + ['--help'])\n"
        "    assert result.exit_code == 0, (path, result.output)\n"
        f"loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(len(paths), loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n_helps, loaded = out.stdout.strip().split(" ", 1)
    assert int(n_helps) >= 30          # bistat and every command and subcommand
    assert loaded == "[]"


def test_the_heavy_list_names_what_the_commands_load():
    # the check above could pass by naming modules nothing imports: running a command loads them
    code = ("import sys\n"
            "import bistat.analysis.summary, bistat.report.finding, bistat.declare.experiment\n"
            "import bistat.declare.releases, bistat.run.runner\n"
            "bistat.declare.releases.check_newest_release('vllm', index='http://127.0.0.1:9')\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout.strip()))
    assert {"httpx", "matplotlib", "numpy", "pandas", "pyarrow", "pydantic"} <= loaded
