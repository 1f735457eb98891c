"""Reference layer norm and RMSNorm, forward and backward, over the last axis.

LayerNorm: mu = mean(x), rsigma = 1/sqrt(mean((x-mu)^2) + eps), y = (x-mu)*rsigma*g + beta.
RMSNorm:   rsigma = 1/sqrt(mean(x^2) + eps),                      y = x*rsigma*g.
g = gamma + 1 with zero_centered_gamma, else gamma. mu and rsigma are saved per row
(float32, or float64 for float64 inputs) for the backward. The *_fwd_fp8 variants write
the output as FP8 codes (the input of the next FP8 GEMM) instead.
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of
from .fp8 import cast_to_fp8


def _gain(gamma, zero_centered_gamma, ct):
    g = gamma.astype(ct)
    return g + 1 if zero_centered_gamma else g


def _layernorm(x, gamma, beta, eps, zero_centered_gamma):
    """(y in the compute dtype, mu, rsigma)."""
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    xf = x.astype(ct)
    mu = xf.mean(axis=-1)
    xc = xf - mu[..., None]
    rsigma = 1 / xp.sqrt((xc * xc).mean(axis=-1) + ct.type(eps))
    y = xc * rsigma[..., None] * _gain(gamma, zero_centered_gamma, ct) + beta.astype(ct)
    return y, mu, rsigma


@backends.register("layernorm_fwd", "reference")
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    y, mu, rsigma = _layernorm(x, gamma, beta, eps, zero_centered_gamma)
    return y.astype(x.dtype), mu, rsigma


@backends.register("layernorm_fwd_fp8", "reference")
def layernorm_fwd_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, fmt, amax_out=None,
                      scale_inv_out=None):
    """LayerNorm whose output goes straight to FP8: (codes of y * scale, mu, rsigma, amax of
    y), y cast from float32 without a round trip through x's dtype; amax_out and
    scale_inv_out (1 / scale written into it) as in cast_to_fp8."""
    y, mu, rsigma = _layernorm(x, gamma, beta, eps, zero_centered_gamma)
    q, amax = cast_to_fp8(y.astype(np.float32), scale, fmt, amax_out, scale_inv_out)
    return q, mu, rsigma, amax


def _with_residual(dx, dres, dtype):
    """dx (compute dtype) + dres, the gradient the norm's input already has from another
    consumer (None: none), rounded once to x's dtype (the kernels' fused sum)."""
    return (dx if dres is None else dx + dres.astype(dx.dtype)).astype(dtype)


@backends.register("layernorm_bwd", "reference")
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, dres=None):
    ct = compute_dtype(x.dtype)
    dyf = dy.astype(ct)
    xhat = (x.astype(ct) - mu[..., None]) * rsigma[..., None]
    dxhat = dyf * _gain(gamma, zero_centered_gamma, ct)
    dx = rsigma[..., None] * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                              - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    dgamma = (dyf * xhat).sum(axis=rows)
    dbeta = dyf.sum(axis=rows)
    return (_with_residual(dx, dres, x.dtype), dgamma.astype(gamma.dtype),
            dbeta.astype(gamma.dtype))


def _rmsnorm(x, gamma, eps, zero_centered_gamma):
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    xf = x.astype(ct)
    rsigma = 1 / xp.sqrt((xf * xf).mean(axis=-1) + ct.type(eps))
    return xf * rsigma[..., None] * _gain(gamma, zero_centered_gamma, ct), rsigma


@backends.register("rmsnorm_fwd", "reference")
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    y, rsigma = _rmsnorm(x, gamma, eps, zero_centered_gamma)
    return y.astype(x.dtype), rsigma


@backends.register("rmsnorm_fwd_fp8", "reference")
def rmsnorm_fwd_fp8(x, gamma, eps, zero_centered_gamma, scale, fmt, amax_out=None,
                    scale_inv_out=None):
    """RMSNorm with its output cast to FP8 in the same pass: (codes, rsigma, amax);
    scale_inv_out as in cast_to_fp8."""
    y, rsigma = _rmsnorm(x, gamma, eps, zero_centered_gamma)
    q, amax = cast_to_fp8(y.astype(np.float32), scale, fmt, amax_out, scale_inv_out)
    return q, rsigma, amax


@backends.register("rmsnorm_bwd", "reference")
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma, dres=None):
    ct = compute_dtype(x.dtype)
    dyf = dy.astype(ct)
    xhat = x.astype(ct) * rsigma[..., None]
    dxhat = dyf * _gain(gamma, zero_centered_gamma, ct)
    dx = rsigma[..., None] * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    dgamma = (dyf * xhat).sum(axis=tuple(range(x.ndim - 1)))
    return _with_residual(dx, dres, x.dtype), dgamma.astype(gamma.dtype)
