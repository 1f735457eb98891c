"""Pictures of FP8 numerics (matplotlib, an optional extra: pip install "tecupy[notebooks]").

    plot_amax_history(state_or_inspector)   amax (and scale) of every FP8 tensor over steps
    plot_flush_heatmap(inspector)           underflow / overflow per tensor x step
    plot_fp8_grid(fmt, x=None, scale=1.0)   the format's values against a tensor's histogram
    plot_error_vs_scale(x, fmt)             the round trip's error as the scale sweeps
Each returns its matplotlib Figure. matplotlib is imported inside the functions: tecupy
itself never needs it.
"""
import numpy as np

from ._array import to_numpy
from .fp8 import as_format

_HINT = 'tecupy.plot needs matplotlib: pip install "tecupy[notebooks]" (or matplotlib)'


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(_HINT) from e
    return plt


def plot_amax_history(source):
    """An FP8State: each used slot's amax history, oldest left, this step's row (row 0, not
    yet rolled in) rightmost; the legend gives the scale now. An FP8Inspector: amax and scale
    of every tensor over its steps."""
    from .fp8_state import FP8State
    from .inspect import FP8Inspector
    if isinstance(source, FP8State):
        return _state_history(source)
    if isinstance(source, FP8Inspector):
        return _inspector_history(source)
    raise TypeError("plot_amax_history: source must be an FP8State or an FP8Inspector, got "
                    f"{type(source).__name__}")


def _state_history(state):
    from .fp8_state import BWD_SLOTS, FWD_SLOTS
    if state.fwd is None:
        raise ValueError("plot_amax_history: this FP8State was never used in FP8 (no history)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for meta, names in ((state.fwd, list(FWD_SLOTS)), (state.bwd, list(BWD_SLOTS))):
        # the update rolls by -1 and zeroes row 0: rows 1..L-1 are oldest..newest, row 0 now
        h = np.roll(to_numpy(meta.amax_history), -1, axis=0)
        scale = to_numpy(meta.scale)
        steps = np.arange(1 - h.shape[0], 1)
        for i in range(h.shape[1]):
            if h[:, i].any():
                name = f"gemm{i // len(names)}.{names[i % len(names)]}"
                ax.step(steps, h[:, i], where="mid", label=f"{name} (scale {scale[i]:.3g})")
    ax.set(xlabel="step (0: this step, not yet in the scale)", ylabel="amax",
           title="amax history")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _inspector_history(ins):
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
    for label, r in ins.to_dict().items():
        line, = a1.plot(r["amax"], marker=".", label=label)
        a2.plot(r["scale"], marker=".", color=line.get_color())
    a1.set(xlabel="step", ylabel="amax", yscale="log", title="amax per FP8 tensor")
    a2.set(xlabel="step", ylabel="scale", yscale="log", title="scale used by the cast")
    a1.legend(fontsize="x-small")
    fig.tight_layout()
    return fig


def plot_flush_heatmap(inspector):
    """Two heatmaps, tensors x steps: the fraction of nonzero values flushed to zero
    (underflow) and of values saturated at the format's max (overflow); for a producer-fused
    cast (counted from its codes, "(codes)" after its label) the fractions of +-0 and of
    +-max codes, upper bounds of those. Blank: not cast in that step."""
    d = inspector.to_dict()
    if not d or inspector.steps == 0:
        raise ValueError("plot_flush_heatmap: the inspector has recorded no step yet")
    plt = _pyplot()
    labels = list(d)
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.5 + 0.3 * len(labels)), squeeze=False)
    for ax, field in zip(axes[0], ("underflow", "overflow")):
        grid = np.ma.masked_invalid(np.array([d[k][field] for k in labels]))
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set(title=field, xlabel="step", yticks=range(len(labels)))
        names = [k + (" (codes)" if inspector.counted_from.get(k) == "codes" else "")
                 for k in labels]
        ax.set_yticklabels(names if ax is axes[0][0] else [], fontsize="x-small")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def fp8_values(fmt):
    """The positive finite values of an FP8 format, ascending (subnormals included)."""
    fmt = as_format(fmt, "fp8_values")
    v = np.arange(256, dtype=np.uint8).view(fmt.ml_dtype).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v > 0)])


def plot_fp8_grid(fmt, x=None, scale=1.0):
    """The format's positive values (a rug on a log axis: denser where the mantissa bits
    count, one octave per exponent) with its limits; with `x`, the histogram of |x * scale|
    over them: what lies left of half the smallest subnormal flushes to zero, right of max
    saturates."""
    fmt = as_format(fmt, "plot_fp8_grid")
    plt = _pyplot()
    values = fp8_values(fmt)
    tiny, normal = values[0], 2.0 ** (1 - fmt.bias)
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.vlines(values, 0, 1, transform=ax.get_xaxis_transform(), lw=0.6, color="0.6",
              label=f"{fmt.name} values ({len(values)} > 0)")
    for at, name, color in ((tiny / 2, "flush below", "tab:blue"),
                            (normal, "smallest normal", "tab:green"),
                            (fmt.max, f"max {fmt.max:g}", "tab:red")):
        ax.axvline(at, color=color, lw=1.5, label=name)
    ax.set(xscale="log", xlabel="|value|", title=f"{fmt.name.upper()} grid")
    if x is not None:
        a = np.abs(to_numpy(x).astype(np.float64).ravel() * float(scale))
        a = a[np.isfinite(a) & (a > 0)]
        if a.size:
            lo, hi = min(a.min(), tiny / 4), max(a.max(), fmt.max * 2)
            ax.hist(a, bins=np.geomspace(lo, hi, 120), color="tab:orange", alpha=0.7,
                    label=f"|x * {float(scale):.3g}|")
            ax.set(ylabel="count")
        ax.set_yscale("log")
    else:
        ax.set_yticks([])
    ax.legend(fontsize="x-small", loc="upper left")
    fig.tight_layout()
    return fig


def plot_error_vs_scale(x, fmt, scales=None):
    """Relative L2 error of x's FP8 round trip (dequantize(quantize(x, s))) for each scale s
    (default: fmt.max / amax(x) times 2^-24 .. 2^6): too small a scale flushes values to
    zero, too large a one saturates them; the dashed line is current scaling's choice."""
    from .fp8 import dequantize, quantize
    from .inspect import paused
    fmt = as_format(fmt, "plot_error_vs_scale")
    xn = to_numpy(x).astype(np.float64)
    amax = np.abs(xn[np.isfinite(xn)]).max()
    best = fmt.max / amax
    if scales is None:
        scales = best * 2.0 ** np.arange(-24, 7)
    ref = np.linalg.norm(xn[np.isfinite(xn)])
    errors = []
    with paused():  # a sweep of the picture's own, not casts of the user's to inspect
        for s in scales:
            y = to_numpy(dequantize(quantize(x, float(s), fmt), np.float64))
            errors.append(np.linalg.norm((y - xn)[np.isfinite(xn)]) / ref)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(scales, errors, marker=".")
    ax.axvline(best, ls="--", color="tab:red", label="fmt.max / amax")
    ax.set(xscale="log", yscale="log", xlabel="scale", ylabel="relative error",
           title=f"{fmt.name.upper()} round trip error against the scale")
    ax.legend()
    fig.tight_layout()
    return fig
