"""The activation table: one row per activation, which the op (tecupy.activation's names and
checks), the NumPy reference, the CUDA kernels' instantiations and the tests all iterate.

A new activation is a row here with its maths in float64, and, when its function is new,
a struct with f and df in float in cuda/act_math.cuh (no other file names activations).
Gated rows take x [..., 2n] and return f(a) * b, a the first half and b the second, as
Transformer Engine's swiglu and geglu; the names are Transformer Engine's.

The maths are array-generic, (x, xp) -> array, with xp numpy or cupy, in x's dtype.
"""
from typing import Callable, NamedTuple

_K0, _K1 = 0.7978845608028654, 0.044715  # sqrt(2/pi), the cubic coefficient


def gelu(x, xp):
    """tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + xp.tanh(_K0 * x * (1 + _K1 * x * x)))


def dgelu(x, xp):
    t = xp.tanh(_K0 * x * (1 + _K1 * x * x))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K0 * (1 + 3 * _K1 * x * x)


def silu(x, xp):
    return x / (1 + xp.exp(-x))


def dsilu(x, xp):
    s = 1 / (1 + xp.exp(-x))
    return s * (1 + x * (1 - s))


def relu(x, xp):
    return xp.maximum(x, 0)


def drelu(x, xp):
    return (x > 0).astype(x.dtype)


class Activation(NamedTuple):
    name: str       # tecupy.activation(x, name); its ops are "<name>_fwd" and "<name>_bwd"
    gated: bool     # x [..., 2n] -> f(a) * b (cuda/act.cu's gated_* kernels, else act_*)
    cuda: str       # the struct of cuda/act_math.cuh with f and df in float
    f: Callable     # reference maths: (x, xp) -> f(x)
    df: Callable    # (x, xp) -> f'(x)


TABLE = {a.name: a for a in (
    Activation("gelu", False, "Gelu", gelu, dgelu),
    Activation("relu", False, "Relu", relu, drelu),
    Activation("swiglu", True, "Silu", silu, dsilu),
    Activation("geglu", True, "Gelu", gelu, dgelu),
)}
