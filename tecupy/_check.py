"""Argument checks of the public API, in one message style:

    "<op>: <argument> must be <what is accepted>, got <what was given>"

TypeError for a value of the wrong kind, ValueError for one of the right kind out of range.
The checks read Python scalars and arrays' shapes and dtypes only, never the values of a
CuPy array (that would synchronise the host with the GPU on every call).
"""
import math
import numbers

import numpy as np

from ._array import is_cupy

SEED_LIMIT = 2**64  # Philox keys and counters are 64-bit: a larger seed would wrap


def _shown(value):
    """An array by its kind, dtype and shape (never its values: no copy from the GPU)."""
    if isinstance(value, np.ndarray) or is_cupy(value):
        kind = "numpy" if isinstance(value, np.ndarray) else "cupy"
        return f"a {kind} array of dtype {value.dtype} and shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(op, name, accepted, value, exc=ValueError):
    raise exc(f"{op}: {name} must be {accepted}, got {_shown(value)}")


def is_int(value):
    """A Python or NumPy int, not a bool (the ABC check is slow: plain ints skip it)."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, (bool, np.bool_)))


def _bounds(kind, low, high, low_open=False, high_open=True):
    high = "2**64" if high == SEED_LIMIT else high
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high}"
    return kind


def integer(op, name, value, low=None, high=None):
    """An int (Python or NumPy, not a bool) in [low, high) (None: unbounded); returns int."""
    if not is_int(value):
        fail(op, name, _bounds("an int", low, high), value, TypeError)
    if (low is not None and value < low) or (high is not None and value >= high):
        fail(op, name, _bounds("an int", low, high), value)
    return int(value)


def size(op, name, value):
    """A positive int: a layer's width, a number of heads."""
    return integer(op, name, value, low=1)


def seed(op, name, value):
    """None (drawn at random) or an int in [0, 2**64): Philox takes 64-bit keys, and a seed
    outside that range would silently give the mask of another seed."""
    if value is None or (type(value) is int and 0 <= value < SEED_LIMIT):
        return value
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        fail(op, name, "None or an int in [0, 2**64)", value,
             ValueError if is_int(value) else TypeError)
    return int(value)


def real(op, name, value, low=None, high=None, low_open=False, high_open=False):
    """A finite real number (not a bool) within the bounds; returns float. NaN and inf are
    refused: they pass no comparison and would poison every result."""
    if type(value) not in (float, int) and (not isinstance(value, numbers.Real)
                                            or isinstance(value, (bool, np.bool_))):
        fail(op, name, _bounds("a finite number", low, high, low_open, high_open), value,
             TypeError)
    v = float(value)
    if (not math.isfinite(v) or (low is not None and (v <= low if low_open else v < low))
            or (high is not None and (v >= high if high_open else v > high))):
        fail(op, name, _bounds("a finite number", low, high, low_open, high_open), value)
    return v


def flag(op, name, value):
    """True or False: bool("no") is True, so a truthy string would silently turn a switch on."""
    if not isinstance(value, (bool, np.bool_)):
        fail(op, name, "True or False", value, TypeError)
    return bool(value)


def choice(op, name, value, choices):
    """One of the strings `choices`."""
    if not (isinstance(value, str) and value in choices):
        fail(op, name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def broadcast_to(op, name, shape, target, target_name):
    """`shape` broadcasts to `target` without changing it (NumPy's rule, trailing axes)."""
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
    if not ok:
        raise ValueError(f"{op}: {name} must broadcast to {target_name}'s shape "
                         f"{tuple(target)}, got shape {tuple(shape)}")


def broadcast_shapes(op, a_name, a_shape, b_name, b_shape):
    """NumPy's broadcast of two shapes, or a clear error naming both."""
    n = max(len(a_shape), len(b_shape))
    a, b = (1,) * (n - len(a_shape)) + tuple(a_shape), (1,) * (n - len(b_shape)) + tuple(b_shape)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise ValueError(f"{op}: {a_name} and {b_name} must have shapes that broadcast "
                         f"together, got {tuple(a_shape)} and {tuple(b_shape)}")
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def last_dim(op, name, x, want, what):
    """x is an array of at least 1 dimension whose last is `want` (the layer's `what`); the
    error names the input, not the layer's weight."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        fail(op, name, "a numpy or cupy array", x, TypeError)
    if x.ndim < 1 or x.shape[-1] != want:
        raise ValueError(f"{op}: {name} must have last dimension {want} ({what}), got shape "
                         f"{tuple(x.shape)}")
