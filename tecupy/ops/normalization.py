"""layernorm and rmsnorm over the last axis (maths in reference/normalization.py)."""
from .. import _check, backends
from .._array import array_module, check_float, check_shape
from ..tape import record


def _check_args(op, x, weight, bias, eps, zero_centered_gamma, has_bias):
    """-> (eps, zero_centered_gamma) as float and bool. Transformer Engine's LayerNorm
    always has a bias (its kernels take a beta tensor), so layernorm requires one."""
    array_module(op, x=x, weight=weight, bias=bias)
    if weight is None:
        _check.fail(op, "weight", "an array [hidden]", None, TypeError)
    if has_bias and bias is None:
        _check.fail(op, "bias", "an array [hidden] (LayerNorm has a bias; rmsnorm has none)",
                    None, TypeError)
    check_float(op, x=x, weight=weight, bias=bias)
    if x.ndim < 1 or x.shape[-1] == 0:
        _check.fail(op, "x", "an array [..., hidden] with hidden >= 1", x)
    check_shape(op, "weight", weight, (x.shape[-1],))
    check_shape(op, "bias", bias, (x.shape[-1],))
    return (_check.real(op, "eps", eps, low=0, low_open=True),
            _check.flag(op, "zero_centered_gamma", zero_centered_gamma))


def layernorm(x, weight, bias, eps=1e-5, zero_centered_gamma=False):
    """y = (x - mean) / sqrt(var + eps) * (weight [+ 1]) + bias; weight, bias [hidden]."""
    eps, zcg = _check_args("layernorm", x, weight, bias, eps, zero_centered_gamma, True)
    y, mu, rsigma = backends.dispatch("layernorm_fwd", x, weight, bias, eps, zcg)

    def backward(dy, partial=None):  # partial: x's gradient from its other consumers
        return backends.dispatch("layernorm_bwd", dy, x, mu, rsigma, weight, zcg, partial)
    record(backward, (x, weight, bias), (y,), partial=0)
    return y


def rmsnorm(x, weight, eps=1e-5, zero_centered_gamma=False):
    """y = x / sqrt(mean(x^2) + eps) * (weight [+ 1]); weight [hidden]."""
    eps, zcg = _check_args("rmsnorm", x, weight, None, eps, zero_centered_gamma, False)
    y, rsigma = backends.dispatch("rmsnorm_fwd", x, weight, eps, zcg)

    def backward(dy, partial=None):
        return backends.dispatch("rmsnorm_bwd", dy, x, rsigma, weight, zcg, partial)
    record(backward, (x, weight), (y,), partial=0)
    return y


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(x, weight, bias, eps, zero_centered_gamma, normalization):
    """LayerNorm or RMSNorm by name (Transformer Engine's `normalization` option)."""
    if normalization == "LayerNorm":
        return layernorm(x, weight, bias, eps, zero_centered_gamma)
    if normalization == "RMSNorm":
        if bias is not None:
            _check.fail("rmsnorm", "bias", "None (RMSNorm has no bias)", bias)
        return rmsnorm(x, weight, eps, zero_centered_gamma)
    _check.fail("normalize", "normalization", "one of " + ", ".join(map(repr, NORMALIZATIONS)),
                normalization)
