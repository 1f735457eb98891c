"""layernorm and rmsnorm over the last axis (maths in reference/normalization.py)."""
from .. import backends
from .._array import array_module, check_float, check_shape
from ..tape import record


def _check(op, x, weight, bias, eps):
    array_module(op, x=x, weight=weight, bias=bias)
    check_float(op, x=x, weight=weight, bias=bias)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got {tuple(x.shape)}")
    check_shape(op, "weight", weight, (x.shape[-1],))
    check_shape(op, "bias", bias, (x.shape[-1],))
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")


def layernorm(x, weight, bias, eps=1e-5, zero_centered_gamma=False):
    """y = (x - mean) / sqrt(var + eps) * (weight [+ 1]) + bias; weight, bias [hidden]."""
    _check("layernorm", x, weight, bias, eps)
    zcg = bool(zero_centered_gamma)
    y, mu, rsigma = backends.dispatch("layernorm_fwd", x, weight, bias, eps, zcg)

    def backward(dy):
        return backends.dispatch("layernorm_bwd", dy, x, mu, rsigma, weight, zcg)
    record(backward, (x, weight, bias), (y,))
    return y


def rmsnorm(x, weight, eps=1e-5, zero_centered_gamma=False):
    """y = x / sqrt(mean(x^2) + eps) * (weight [+ 1]); weight [hidden]."""
    _check("rmsnorm", x, weight, None, eps)
    zcg = bool(zero_centered_gamma)
    y, rsigma = backends.dispatch("rmsnorm_fwd", x, weight, eps, zcg)

    def backward(dy):
        return backends.dispatch("rmsnorm_bwd", dy, x, rsigma, weight, zcg)
    record(backward, (x, weight), (y,))
    return y


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(x, weight, bias, eps, zero_centered_gamma, normalization):
    """LayerNorm or RMSNorm by name (Transformer Engine's `normalization` option)."""
    if normalization == "LayerNorm":
        return layernorm(x, weight, bias, eps, zero_centered_gamma)
    if normalization == "RMSNorm":
        if bias is not None:
            raise ValueError("RMSNorm takes no bias (got a layernorm bias); pass None")
        return rmsnorm(x, weight, eps, zero_centered_gamma)
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
