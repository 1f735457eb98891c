"""Reference activations, forward and backward (Transformer Engine's definitions).

gelu: tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Gated (input [..., 2n]: a = first half, b = second half): swiglu = silu(a) * b,
geglu = gelu(a) * b.
"""
from .. import backends
from .._array import compute_dtype, xp_of

_K0, _K1 = 0.7978845608028654, 0.044715  # sqrt(2/pi), the cubic coefficient


def _gelu(x, xp):
    return 0.5 * x * (1 + xp.tanh(_K0 * x * (1 + _K1 * x * x)))


def _dgelu(x, xp):
    t = xp.tanh(_K0 * x * (1 + _K1 * x * x))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K0 * (1 + 3 * _K1 * x * x)


def _silu(x, xp):
    return x / (1 + xp.exp(-x))


def _dsilu(x, xp):
    s = 1 / (1 + xp.exp(-x))
    return s * (1 + x * (1 - s))


def _relu(x, xp):
    return xp.maximum(x, 0)


def _drelu(x, xp):
    return (x > 0).astype(x.dtype)


_PLAIN = {"gelu": (_gelu, _dgelu), "relu": (_relu, _drelu)}
_GATED = {"swiglu": (_silu, _dsilu), "geglu": (_gelu, _dgelu)}


def _plain(name, f, df):
    @backends.register(f"{name}_fwd", "reference")
    def fwd(x):
        xp = xp_of(x)
        return f(x.astype(compute_dtype(x.dtype)), xp).astype(x.dtype)

    @backends.register(f"{name}_bwd", "reference")
    def bwd(dy, x):
        xp, ct = xp_of(x), compute_dtype(x.dtype)
        return (dy.astype(ct) * df(x.astype(ct), xp)).astype(x.dtype)
    return fwd, bwd


def _gated(name, f, df):
    @backends.register(f"{name}_fwd", "reference")
    def fwd(x):
        xp, ct = xp_of(x), compute_dtype(x.dtype)
        a, b = xp.split(x.astype(ct), 2, axis=-1)
        return (f(a, xp) * b).astype(x.dtype)

    @backends.register(f"{name}_bwd", "reference")
    def bwd(dy, x):
        xp, ct = xp_of(x), compute_dtype(x.dtype)
        a, b = xp.split(x.astype(ct), 2, axis=-1)
        dyf = dy.astype(ct)
        return xp.concatenate([dyf * b * df(a, xp), dyf * f(a, xp)], axis=-1).astype(x.dtype)
    return fwd, bwd


KERNELS = {name: _plain(name, *fs) for name, fs in _PLAIN.items()}
KERNELS.update({name: _gated(name, *fs) for name, fs in _GATED.items()})
GATED = tuple(_GATED)
