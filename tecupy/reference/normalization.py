"""Reference layer norm and RMSNorm, forward and backward, over the last axis.

LayerNorm: mu = mean(x), rsigma = 1/sqrt(mean((x-mu)^2) + eps), y = (x-mu)*rsigma*g + beta.
RMSNorm:   rsigma = 1/sqrt(mean(x^2) + eps),                      y = x*rsigma*g.
g = gamma + 1 with zero_centered_gamma, else gamma. mu and rsigma are saved per row
(float32, or float64 for float64 inputs) for the backward.
"""
from .. import backends
from .._array import compute_dtype, xp_of


def _gain(gamma, zero_centered_gamma, ct):
    g = gamma.astype(ct)
    return g + 1 if zero_centered_gamma else g


@backends.register("layernorm_fwd", "reference")
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    xf = x.astype(ct)
    mu = xf.mean(axis=-1)
    xc = xf - mu[..., None]
    rsigma = 1 / xp.sqrt((xc * xc).mean(axis=-1) + ct.type(eps))
    y = xc * rsigma[..., None] * _gain(gamma, zero_centered_gamma, ct) + beta.astype(ct)
    return y.astype(x.dtype), mu, rsigma


@backends.register("layernorm_bwd", "reference")
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma):
    ct = compute_dtype(x.dtype)
    dyf = dy.astype(ct)
    xhat = (x.astype(ct) - mu[..., None]) * rsigma[..., None]
    dxhat = dyf * _gain(gamma, zero_centered_gamma, ct)
    dx = rsigma[..., None] * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                              - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    dgamma = (dyf * xhat).sum(axis=rows)
    dbeta = dyf.sum(axis=rows)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


@backends.register("rmsnorm_fwd", "reference")
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    xf = x.astype(ct)
    rsigma = 1 / xp.sqrt((xf * xf).mean(axis=-1) + ct.type(eps))
    y = xf * rsigma[..., None] * _gain(gamma, zero_centered_gamma, ct)
    return y.astype(x.dtype), rsigma


@backends.register("rmsnorm_bwd", "reference")
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma):
    ct = compute_dtype(x.dtype)
    dyf = dy.astype(ct)
    xhat = x.astype(ct) * rsigma[..., None]
    dxhat = dyf * _gain(gamma, zero_centered_gamma, ct)
    dx = rsigma[..., None] * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    dgamma = (dyf * xhat).sum(axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype)
