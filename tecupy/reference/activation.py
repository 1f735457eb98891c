"""Reference activations, forward and backward: each row of tecupy/activation_table.py
registered with its maths, plain (y = f(x)) or gated (x [..., 2n] -> f(a) * b).
Optional: a bias over the last axis added to the input (its gradient, dbias, comes back from
the backward), and an FP8 output (the codes of y * scale with amax of y) for the next GEMM.
"""
import numpy as np

from .. import backends
from ..activation_table import TABLE
from .._array import compute_dtype, xp_of
from .fp8 import cast_to_fp8


def _input(x, bias, ct):
    xf = x.astype(ct)
    return xf if bias is None else xf + bias.astype(ct)


def _output(y, dtype, scale, fmt, amax_out):
    """y in `dtype`, or (FP8 codes of y * scale, amax of y) when `fmt` is given (amax_out as
    in cast_to_fp8)."""
    if fmt is None:
        return y.astype(dtype)
    return cast_to_fp8(y.astype(np.float32), scale, fmt, amax_out)


def _dbias(dxf, bias):
    return None if bias is None else dxf.sum(axis=tuple(range(dxf.ndim - 1))).astype(bias.dtype)


def _into(out, dx):
    """dx, written into `out` when one is given (the CUDA kernels' in-place backward)."""
    if out is None:
        return dx
    if out.shape != dx.shape or out.dtype != dx.dtype:
        raise ValueError(f"activation backward: out must be a {dx.dtype} array of shape "
                         f"{dx.shape}, got {out.dtype} {out.shape}")
    out[...] = dx
    return out


def _plain(name, f, df):
    @backends.register(f"{name}_fwd", "reference")
    def fwd(x, bias=None, scale=None, fmt=None, amax_out=None):
        xp = xp_of(x)
        return _output(f(_input(x, bias, compute_dtype(x.dtype)), xp), x.dtype, scale, fmt,
                       amax_out)

    @backends.register(f"{name}_bwd", "reference")
    def bwd(dy, x, bias=None, out=None):
        """-> (dx, dbias or None); dbias sums the float dx over the rows. out: where dx goes
        (None: a new array; may be dy itself)."""
        xp, ct = xp_of(x), compute_dtype(x.dtype)
        dxf = dy.astype(ct) * df(_input(x, bias, ct), xp)
        return _into(out, dxf.astype(x.dtype)), _dbias(dxf, bias)
    return fwd, bwd


def _gated(name, f, df):
    @backends.register(f"{name}_fwd", "reference")
    def fwd(x, bias=None, scale=None, fmt=None, amax_out=None):
        xp = xp_of(x)
        a, b = xp.split(_input(x, bias, compute_dtype(x.dtype)), 2, axis=-1)
        return _output(f(a, xp) * b, x.dtype, scale, fmt, amax_out)

    @backends.register(f"{name}_bwd", "reference")
    def bwd(dy, x, bias=None, out=None):
        xp, ct = xp_of(x), compute_dtype(x.dtype)
        a, b = xp.split(_input(x, bias, ct), 2, axis=-1)
        dyf = dy.astype(ct)
        dxf = xp.concatenate([dyf * b * df(a, xp), dyf * f(a, xp)], axis=-1)
        return _into(out, dxf.astype(x.dtype)), _dbias(dxf, bias)
    return fwd, bwd


# name -> (forward, backward) as registered
KERNELS = {a.name: (_gated if a.gated else _plain)(a.name, a.f, a.df)
           for a in TABLE.values()}
