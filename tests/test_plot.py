"""tecupy.plot: each helper returns a matplotlib Figure with what it promises (matplotlib
is in the test extra: these fail without it), and says how to install it when missing."""
import sys

import numpy as np
import pytest

import tecupy
from tecupy import fp8, plot, recipe
from tecupy.inspect import FP8Inspector


@pytest.fixture
def plt():
    import matplotlib as mpl
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    yield plt
    plt.close("all")


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import fails
    with pytest.raises(ImportError, match=r'pip install "tecupy\[notebooks\]"'):
        plot.plot_fp8_grid("e4m3")


def _inspected_steps(rng, steps=3):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    state = tecupy.FP8State()
    with FP8Inspector({"lin": state}) as ins:
        for s in range(steps):
            xs = x * np.float32(10.0 ** s)  # the amax jumps every step
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
                y = tecupy.linear(xs, w, fp8_state=state)
            tape.gradient(y, [xs], np.ones_like(y))
            ins.step()
    return state, ins


def test_amax_history_of_a_state_and_an_inspector(plt, rng):
    state, ins = _inspected_steps(rng)
    fig = plot.plot_amax_history(state)
    assert isinstance(fig, plt.Figure)
    assert len(fig.axes[0].get_lines()) == 3  # input, weight, grad_output were used
    fig = plot.plot_amax_history(ins)
    assert len(fig.axes) == 2 and len(fig.axes[0].get_lines()) == 3
    with pytest.raises(TypeError, match="source must be"):
        plot.plot_amax_history(5)
    with pytest.raises(ValueError, match="never used"):
        plot.plot_amax_history(tecupy.FP8State())


def test_flush_heatmap(plt, rng):
    _, ins = _inspected_steps(rng)
    fig = plot.plot_flush_heatmap(ins)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 2 and images[0].get_array().shape == (3, 3)
    with pytest.raises(ValueError, match="no step"):
        plot.plot_flush_heatmap(FP8Inspector())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_grid(plt, rng, fmt):
    f = fp8.as_format(fmt)
    values = plot.fp8_values(f)
    assert values[-1] == f.max and values[0] == 2.0 ** (1 - f.bias - f.mbits)
    assert len(values) == (126 if fmt == "e4m3" else 123)
    assert isinstance(plot.plot_fp8_grid(fmt), plt.Figure)
    fig = plot.plot_fp8_grid(f, rng.standard_normal(1000), scale=4.0)
    assert len(fig.axes[0].patches) > 0  # the histogram's bars


def test_flush_heatmap_marks_casts_counted_from_codes(plt, rng):
    m = tecupy.nn.LayerNormMLP(32, 64, device="cpu", seed=0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    with FP8Inspector(m) as ins:
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            y = m(x)
        tape.gradient(y, [x], np.ones_like(y))
    fig = plot.plot_flush_heatmap(ins)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "gemm0.input (codes)" in ticks and "gemm1.input (codes)" in ticks
    assert "gemm0.weight" in ticks  # the weights' casts see their input


def test_error_vs_scale(plt, rng):
    x = rng.standard_normal(500).astype(np.float32)
    with FP8Inspector() as ins:  # the sweep's casts are the picture's, not the user's
        fig = plot.plot_error_vs_scale(x, "e4m3")
    assert ins.labels == []
    errors = fig.axes[0].get_lines()[0].get_ydata()
    # too small a scale flushes everything (error 1), current scaling's is small
    assert errors[0] > 0.5 and min(errors) < 0.05
