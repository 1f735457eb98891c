"""Activations by name, activation(x, name): the rows of tecupy/activation_table.py. The
first four (gelu (tanh approximation), relu, swiglu, geglu) also have functions of their own.

Gated activations take [..., 2n] (first half through the activation, second half the
gate) and return [..., n], as Transformer Engine's.
"""
from .. import _check, backends
from .._array import array_module, check_float, check_shape
from ..activation_table import TABLE
from ..tape import record

ACTIVATIONS = tuple(TABLE)  # the names (layernorm_mlp and the nn modules check against them)
GATED = tuple(a.name for a in TABLE.values() if a.gated)


def check_activation(name, x, bias):
    _check.choice("activation", "name", name, ACTIVATIONS)
    array_module(name, x=x, bias=bias)
    check_float(name, x=x, bias=bias)
    if bias is not None and x.ndim < 1:
        _check.fail(name, "x", "an array of at least 1 dimension when a bias is given", x)
    if name in GATED and (x.ndim < 1 or x.shape[-1] % 2):
        _check.fail(name, "x", "an array [..., 2n] (value and gate halves: an even last "
                    "dimension)", x)
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
