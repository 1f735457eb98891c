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


class QParams:
    """How one tensor of Float8BlockScaling is quantized (Transformer Engine's QParams):
    power_2_scale rounds each block's scale down to a power of two (the mantissa bits
    cleared: the dequantizing factor is then exact, and so are its products in the GEMM),
    amax_epsilon floors each block's amax before scale = fp8_max / amax (0: no floor)."""
    __slots__ = ("power_2_scale", "amax_epsilon")

    def __init__(self, power_2_scale=True, amax_epsilon=0.0):
        power_2_scale = _bool_field("QParams", "power_2_scale", power_2_scale)
        if isinstance(amax_epsilon, (bool, np.bool_)) or not isinstance(amax_epsilon,
                                                                        numbers.Real):
            raise TypeError(f"QParams: amax_epsilon must be a finite number >= 0, got "
                            f"{amax_epsilon!r} ({type(amax_epsilon).__name__})")
        if not (math.isfinite(amax_epsilon) and amax_epsilon >= 0):
            raise ValueError(f"QParams: amax_epsilon must be a finite number >= 0, got "
                             f"{amax_epsilon!r}")
        object.__setattr__(self, "power_2_scale", power_2_scale)
        object.__setattr__(self, "amax_epsilon", float(np.float32(amax_epsilon)))

    def __setattr__(self, name, value):
        raise AttributeError("QParams is immutable: make a new one")

    def __eq__(self, other):
        return (isinstance(other, QParams) and self.power_2_scale == other.power_2_scale
                and self.amax_epsilon == other.amax_epsilon)

    def __hash__(self):
        return hash((self.power_2_scale, self.amax_epsilon))

    def __reduce__(self):
        return QParams, (self.power_2_scale, self.amax_epsilon)

    def __repr__(self):
        return f"QParams(power_2_scale={self.power_2_scale}, amax_epsilon={self.amax_epsilon})"


_BS = "Float8BlockScaling"


def _qparams_field(name):
    def check(value):
        if not isinstance(value, QParams):
            raise TypeError(f"{_BS}: {name} must be a tecupy.recipe.QParams, got {value!r} "
                            f"({type(value).__name__})")
        return value
    return check


def _block_dim_field(name):
    return lambda value: _int_field(_BS, name, value, 1, 2)  # 1: 1x128 blocks, 2: 128x128


def _true_field(name, why):
    def check(value):
        if not _bool_field(_BS, name, value):
            raise ValueError(f"{_BS}: {name} must be True ({why})")
        return True
    return check


def _false_field(name, why):
    def check(value):
        if _bool_field(_BS, name, value):
            raise ValueError(f"{_BS}: {name} must be False ({why})")
        return False
    return check


_SPLIT = "block scaling needs split accumulation: the scales apply per 128 of K"
_BS_FIELDS = {
    "fp8_format": lambda v: _format_field(_BS, v),
    "fp8_quant_fwd_inp": _qparams_field("fp8_quant_fwd_inp"),
    "fp8_quant_fwd_weight": _qparams_field("fp8_quant_fwd_weight"),
    "fp8_quant_bwd_grad": _qparams_field("fp8_quant_bwd_grad"),
    "x_block_scaling_dim": _block_dim_field("x_block_scaling_dim"),
    "w_block_scaling_dim": _block_dim_field("w_block_scaling_dim"),
    "grad_block_scaling_dim": _block_dim_field("grad_block_scaling_dim"),
    "fp8_gemm_fprop_split_accumulator": _true_field("fp8_gemm_fprop_split_accumulator", _SPLIT),
    "fp8_gemm_dgrad_split_accumulator": _true_field("fp8_gemm_dgrad_split_accumulator", _SPLIT),
    "fp8_gemm_wgrad_split_accumulator": _true_field("fp8_gemm_wgrad_split_accumulator", _SPLIT),
    "fp8_dpa": _false_field("fp8_dpa", "FP8 attention is not supported for block scaling, "
                                       "as in Transformer Engine"),
    "fp8_mha": _false_field("fp8_mha", "FP8 attention is not supported for block scaling, "
                                       "as in Transformer Engine"),
}


class Float8BlockScaling(Recipe):
    """Block scaling (Transformer Engine's Float8BlockScaling, DeepSeek-V3's recipe): one
    float32 scale per block of 128 values, from that block's own amax; no state.

    fp8_format: Format.E4M3 (default: E4M3 for gradients too) or Format.HYBRID (E5M2 for
        gradients); Format.E5M2 is refused.
    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1x128 blocks: 128
        consecutive values of a row; the column-wise copy wgrad reads has its own, 128 rows
        of a column) or 2 (128x128 tiles); defaults 1, 2, 1. No GEMM may multiply two
        128x128-blocked operands (TE's rule): of x, w and grad at most one is 2.
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: QParams per tensor
        (default: power-of-two scales, amax_epsilon 0). TE reads
        NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 for float32 scales; here pass
        QParams(power_2_scale=False).
    fp8_gemm_{fprop,dgrad,wgrad}_split_accumulator: must stay True (TE's MMParams, asserted
        the same way: the scales apply at each promotion over 128 of K).
    fp8_dpa, fp8_mha: must stay False (no FP8 attention under block scaling, as in TE).
    Checked at construction; as TE checks in __post_init__, fields assigned later are
    checked one by one (the 2D-by-2D rule at construction only).
    """
    _FIELDS = _BS_FIELDS

    def __init__(self, fp8_format=Format.E4M3, fp8_quant_fwd_inp=None,
                 fp8_quant_fwd_weight=None, fp8_quant_bwd_grad=None, x_block_scaling_dim=1,
                 w_block_scaling_dim=2, grad_block_scaling_dim=1,
                 fp8_gemm_fprop_split_accumulator=True, fp8_gemm_dgrad_split_accumulator=True,
                 fp8_gemm_wgrad_split_accumulator=True, fp8_dpa=False, fp8_mha=False):
        q = (fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad)
        q = [QParams() if p is None else p for p in q]
        self._set_all(dict(
            fp8_format=fp8_format, fp8_quant_fwd_inp=q[0], fp8_quant_fwd_weight=q[1],
            fp8_quant_bwd_grad=q[2], x_block_scaling_dim=x_block_scaling_dim,
            w_block_scaling_dim=w_block_scaling_dim,
            grad_block_scaling_dim=grad_block_scaling_dim,
            fp8_gemm_fprop_split_accumulator=fp8_gemm_fprop_split_accumulator,
            fp8_gemm_dgrad_split_accumulator=fp8_gemm_dgrad_split_accumulator,
            fp8_gemm_wgrad_split_accumulator=fp8_gemm_wgrad_split_accumulator,
            fp8_dpa=fp8_dpa, fp8_mha=fp8_mha))
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}
        two = [k for k, v in dims.items() if v == 2]
        if len(two) > 1:
            raise ValueError(f"{_BS}: {' and '.join(k + '_block_scaling_dim' for k in two)} "
                             "are both 2: a GEMM of two 128x128-blocked operands is not "
                             "supported (as in Transformer Engine); at most one may be 2")

    def __repr__(self):
        return (f"Float8BlockScaling(fp8_format={self.fp8_format.name}, "
                f"x_block_scaling_dim={self.x_block_scaling_dim}, "
                f"w_block_scaling_dim={self.w_block_scaling_dim}, "
                f"grad_block_scaling_dim={self.grad_block_scaling_dim}, "
                f"fp8_quant_fwd_inp={self.fp8_quant_fwd_inp}, "
                f"fp8_quant_fwd_weight={self.fp8_quant_fwd_weight}, "
                f"fp8_quant_bwd_grad={self.fp8_quant_bwd_grad})")
