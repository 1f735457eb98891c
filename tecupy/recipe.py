"""FP8 recipes with Transformer Engine's names, fields and defaults.

Every field is checked when the recipe is made and again when it is assigned later, so a bad
value is an error at the line that wrote it, never a NaN scale or a half-applied update at
the next autocast exit. Transformer Engine types the fields through pydantic
(common/recipe/__init__.py), which also coerces "16" -> 16, True -> 1 and "no" -> False;
tecupy refuses those (a string or a bool in an int field is almost always a config bug) and
accepts what pydantic's int accepts otherwise: ints, and floats with an integral value.
"""
import enum
import math
import numbers
import warnings

import numpy as np

from .fp8 import E4M3 as _E4M3, E5M2 as _E5M2


class Format(enum.Enum):
    """E4M3 everywhere, E5M2 everywhere, or HYBRID: E4M3 forward, E5M2 for gradients."""
    E4M3 = (_E4M3, _E4M3)
    E5M2 = (_E5M2, _E5M2)
    HYBRID = (_E4M3, _E5M2)

    @property
    def fwd(self):
        return self.value[0]

    @property
    def bwd(self):
        return self.value[1]

    max_fwd = property(lambda self: self.fwd.max)
    max_bwd = property(lambda self: self.bwd.max)


_ALGOS = ("max", "most_recent")
# 2**-margin must be a normal float32: fp8_max * 2**-margin is then exact, and the same on
# the device (which flushes subnormals) as in the NumPy reference.
MAX_MARGIN = 126


def _int_field(owner, name, value, low, high=None):
    """An int (or an integral float, as pydantic's int takes it) in [low, high]."""
    accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be {accepted}, got {value!r} "
                        f"({type(value).__name__})")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ValueError(f"{owner}: {name} must be {accepted}, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ValueError(f"{owner}: {name} must be {accepted}, got {value}")
    return value


def _bool_field(owner, name, value):
    """True/False (or 0/1, as pydantic's bool takes them); strings are refused: "false" is
    truthy, the classic config bug."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral)
                                               and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{owner}: {name} must be True or False, got {value!r} "
                    f"({type(value).__name__})")


def _format_field(owner, value):
    if not isinstance(value, Format):
        raise TypeError(f"{owner}: fp8_format must be a tecupy.recipe.Format (E4M3 or "
                        f"HYBRID), got {value!r} ({type(value).__name__})")
    if value is Format.E5M2:  # Transformer Engine asserts the same in both recipes
        raise ValueError(f"{owner}: fp8_format=Format.E5M2: pure E5M2 training is not "
                         "supported (as in Transformer Engine); use Format.HYBRID or Format.E4M3")
    return value


def _algo_field(value):
    if callable(value) or (isinstance(value, str) and value in _ALGOS):
        return value
    raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a "
                     f"callable f(amax_history [L, n]) -> amax [n], got {value!r}")


def _sf_algo_field(value):
    if value is None or callable(value):
        return value
    raise TypeError(f"DelayedScaling: scaling_factor_compute_algo must be None or a callable "
                    f"f(amax, scale, fp8_max, recipe) -> scale, got {value!r}")


_DS = "DelayedScaling"
_DS_FIELDS = {
    "margin": lambda v: _int_field(_DS, "margin", v, 0, MAX_MARGIN),
    "fp8_format": lambda v: _format_field(_DS, v),
    "amax_history_len": lambda v: _int_field(_DS, "amax_history_len", v, 1),
    "amax_compute_algo": _algo_field,
    "scaling_factor_compute_algo": _sf_algo_field,
    "reduce_amax": lambda v: _bool_field(_DS, "reduce_amax", v),
    "fp8_dpa": lambda v: _bool_field(_DS, "fp8_dpa", v),
    "fp8_mha": lambda v: _bool_field(_DS, "fp8_mha", v),
}


class _Checked:
    """Fields validated on every assignment (the table _FIELDS: name -> check)."""
    _FIELDS = {}

    def __setattr__(self, name, value):
        check = self._FIELDS.get(name)
        object.__setattr__(self, name, value if check is None else check(value))

    def _set_all(self, values):
        checked = {k: self._FIELDS[k](v) for k, v in values.items()}  # all, then assign
        for k, v in checked.items():
            object.__setattr__(self, k, v)


class Recipe(_Checked):
    """The base of the FP8 recipes: what autocast takes. Each recipe's casts are its
    quantizers (quantization.py), which the ops call without knowing the recipe."""


class DelayedScaling(Recipe):
    """Scale from the history of amaxes of earlier steps (Transformer Engine's default recipe).

    margin: int in [0, 126]; scale = (fp8_max * 2**-margin) / amax (TE's fused update).
    amax_history_len: int >= 1.
    amax_compute_algo: "max" (of the history), "most_recent", or a callable
        f(amax_history [L, n]) -> amax [n].
    scaling_factor_compute_algo: None, or f(amax, scale, fp8_max, recipe) -> new scale.
    reduce_amax, fp8_dpa, fp8_mha: bools, kept for Transformer Engine compatibility
        (reduce_amax is a no-op on one device).
    interval: removed from Transformer Engine; accepted and ignored with a warning.
    """
    _FIELDS = _DS_FIELDS

    def __init__(self, margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
                 amax_compute_algo="max", scaling_factor_compute_algo=None, reduce_amax=True,
                 interval=None, fp8_dpa=False, fp8_mha=False):
        self._set_all(dict(margin=margin, fp8_format=fp8_format,
                           amax_history_len=amax_history_len,
                           amax_compute_algo=amax_compute_algo,
                           scaling_factor_compute_algo=scaling_factor_compute_algo,
                           reduce_amax=reduce_amax, fp8_dpa=fp8_dpa, fp8_mha=fp8_mha))
        if interval is not None:
            warnings.warn("DelayedScaling(interval=...) is deprecated and ignored: the scale "
                          "is updated every step, as in Transformer Engine", DeprecationWarning,
                          stacklevel=2)

    def __repr__(self):
        return (f"DelayedScaling(margin={self.margin}, fp8_format={self.fp8_format.name}, "
                f"amax_history_len={self.amax_history_len}, "
                f"amax_compute_algo={self.amax_compute_algo!r})")


class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from this step's own amax: no history, no state."""
    _FIELDS = {"fp8_format": lambda v: _format_field("Float8CurrentScaling", v)}

    def __init__(self, fp8_format=Format.HYBRID):
        self._set_all(dict(fp8_format=fp8_format))

    def __repr__(self):
        return f"Float8CurrentScaling(fp8_format={self.fp8_format.name})"
