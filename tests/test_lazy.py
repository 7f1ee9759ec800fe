"""bistat.core.lazy: the heavy libraries load on first use, and the stand-ins give the real
results."""

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
