"""Execute the notebooks in notebooks/ so that they cannot rot (they assert their numbers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
    """A 'python3' kernel spec that runs this interpreter, first on JUPYTER_PATH.

    In a fresh virtual environment no kernel spec may be installed, or a user-wide 'python3'
    may point at another interpreter without bistat's dependencies; this one always runs
    ``sys.executable``.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (bistat tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "python3"


def test_there_is_a_notebook():
    assert [p.name for p in NOTEBOOKS] == ["h200-studies.ipynb", "synthetic-example.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, python3_kernel):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=python3_kernel, timeout=300,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert errors == []
