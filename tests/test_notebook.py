"""Run the notebooks (quickstart, FP8 primer, train_gpt) end to end at
TECUPY_NOTEBOOK_SIZE=small and fail on any cell error; check that each is stored as valid
nbformat 4 without outputs, and that it draws its figures: the expected number of image/png
outputs per notebook (FIGURES; matplotlib is in the `test` extra, so CI counts them). Run
again with matplotlib hidden from the kernel, each draws none and says that matplotlib is
missing (the path of a user without the `notebooks` extra).

The kernel is the interpreter running pytest (a "python3" kernelspec written to a temporary
JUPYTER_PATH, so a user-level python3 kernelspec pointing elsewhere cannot be picked up). It
starts in notebooks/, as Jupyter would. It imports the same tecupy as the tests (its folder put
first on the kernel's PYTHONPATH).
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import tecupy

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
# the tecupy under test (the checkout's, or the installed wheel's when CI runs the tests
# from outside the checkout): the kernel imports that one
TECUPY_ROOT = Path(tecupy.__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
# notebook -> text its run must print
NOTEBOOKS = {"quickstart.ipynb": "TransformerLayer in FP8", "fp8_primer.ipynb": "fp8_gemm runs on",
             "train_gpt.ipynb": "trained bf16 and FP8"}
# notebook -> image/png outputs it draws when matplotlib is importable (fp8_primer: two FP8
# grids, the error against the scale, the inspector's amax history and flush heatmap;
# quickstart: the FP8 error per weight, the timings; train_gpt: the loss curves, the
# inspector's amax history and flush heatmap)
FIGURES = {"quickstart.ipynb": 2, "fp8_primer.ipynb": 5, "train_gpt.ipynb": 3}
NO_MATPLOTLIB = "matplotlib is not installed"
# the kernel runs this interpreter with this PYTHONPATH: it imports matplotlib iff we can
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# first on the kernel's PYTHONPATH to hide matplotlib: a package whose import fails
HIDE_MATPLOTLIB = 'raise ImportError("matplotlib hidden by tests/test_notebook.py")\n'
CELL_TIMEOUT_S = 600


def _kernel_env(tmp_path, hide_matplotlib=False):
    """Environment for the kernel: small sizes, this interpreter's kernelspec, tecupy on path
    (after a package that makes `import matplotlib` fail, with hide_matplotlib)."""
    env = dict(os.environ)
    env["TECUPY_NOTEBOOK_SIZE"] = "small"
    # ipykernel picks its inline backend (figures as image/png outputs) only when no other
    # backend is asked for
    env.pop("MPLBACKEND", None)
    parts = [str(TECUPY_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if hide_matplotlib:
        (tmp_path / "hide" / "matplotlib").mkdir(parents=True)
        (tmp_path / "hide" / "matplotlib" / "__init__.py").write_text(HIDE_MATPLOTLIB)
        parts.insert(0, str(tmp_path / "hide"))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }))
    jupyter_path = [str(tmp_path / "jupyter")] + [
        p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_PATH"] = os.pathsep.join(jupyter_path)
    return env


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_is_stored_clean(name):
    nb = nbformat.read(str(REPO / "notebooks" / name), as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for n, cell in enumerate(code):
        assert cell.outputs == [], f"code cell {n} is stored with outputs; clear them"
        assert cell.execution_count is None, f"code cell {n} is stored with an execution count"
    first = code[0].source
    assert 'os.environ.get("TECUPY_NOTEBOOK_SIZE", "full")' in first


def _run(tmp_path, monkeypatch, name, hide_matplotlib=False):
    """(printed text, image/png outputs) of the notebook run in a fresh kernel."""
    env = _kernel_env(tmp_path, hide_matplotlib)
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    nb = nbformat.read(str(REPO / "notebooks" / name), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "SCALE='small'" in text, text[:2000]
    assert NOTEBOOKS[name] in text
    return text, [o for o in outputs if "image/png" in o.get("data", {})]


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs(tmp_path, monkeypatch, name):
    assert HAVE_MATPLOTLIB, ('the notebooks\' figures need matplotlib, part of the test '
                             'extra: pip install ".[test]"')
    text, figures = _run(tmp_path, monkeypatch, name)
    assert len(figures) == FIGURES[name], (
        f"{name} drew {len(figures)} figures, expected {FIGURES[name]}")
    assert NO_MATPLOTLIB not in text


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs_without_matplotlib(tmp_path, monkeypatch, name):
    text, figures = _run(tmp_path, monkeypatch, name, hide_matplotlib=True)
    assert figures == []
    assert NO_MATPLOTLIB in text, text[:2000]
