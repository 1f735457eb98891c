"""Activations: gelu (tanh approximation), relu, and the gated swiglu, geglu.

Gated activations take [..., 2n] (first half through the activation, second half the
gate) and return [..., n], as Transformer Engine's.
"""
from .. import backends
from .._array import array_module, check_float, check_shape
from ..tape import record

ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")


def check_activation(name, x, bias):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    array_module(name, x=x, bias=bias)
    check_float(name, x=x, bias=bias)
    if name in GATED and (x.ndim < 1 or x.shape[-1] % 2):
        raise ValueError(f"{name}: last dimension must be even (value and gate halves), "
                         f"got shape {tuple(x.shape)}")
    check_shape(name, "bias", bias, (x.shape[-1],))


def activation(x, name, bias=None):
    """Apply the activation called `name` (one of ACTIVATIONS) to x (+ bias over the last
    axis, added in the same pass)."""
    check_activation(name, x, bias)
    y = backends.dispatch(f"{name}_fwd", x, bias)

    def backward(dy):
        return backends.dispatch(f"{name}_bwd", dy, x, bias)
    record(backward, (x, bias), (y,))
    return y


def gelu(x):
    return activation(x, "gelu")


def relu(x):
    return activation(x, "relu")


def swiglu(x):
    return activation(x, "swiglu")


def geglu(x):
    return activation(x, "geglu")
