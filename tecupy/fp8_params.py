"""FP8 weights (Transformer Engine's `quantized_model_init`, formerly `fp8_model_init`).

    with tecupy.quantized_model_init(recipe=DelayedScaling()):
        layer = tecupy.nn.TransformerLayer(...)   # its GEMM weights are FP8Weights
    opt = tecupy.optim.AdamW(layer.named_parameters())  # keeps the float32 master copies

An FP8Weight holds what the GEMMs read: the E4M3 codes [out, in] (the forward GEMM), their
transposed copy [in, out] (dgrad) and scale_inv, and no high-precision copy: a module's
weights take a byte per element in each layout instead of two bytes plus the casts' codes
made at every forward (issue 22). Its `dtype` is the module's parameter dtype: the dtype of
its gradient (wgrad's output) and of its dequantized value.

Casts follow the recipe the weight was made under, as TE's quantizers do:
  DelayedScaling        the module's FP8State weight slot: its scale (from the amax history),
                        the tensor's amax maxed into the history's row 0 (the next update at
                        fp8_autocast exit reads it). The first cast, at init, has the state's
                        initial scale, 1, as in TE.
  Float8CurrentScaling  the tensor's own amax (fmt.max / amax).
The optimizer owns the float32 master copy: after each step it casts the master into the
weight's codes, in place (the arrays keep their addresses: a captured CUDA graph reads them).
Outside fp8_autocast an op dequantizes the weight (a high-precision GEMM on its FP8 value).
"""
import contextvars

import numpy as np

from . import _check
from ._array import xp_of
from .fp8 import FP8Tensor, cast, current_scale, dequantize
from .fp8 import amax as tensor_amax
from .recipe import DelayedScaling, Float8CurrentScaling

# (enabled, recipe, preserve_high_precision_init_val) of the innermost quantized_model_init
_init = contextvars.ContextVar("tecupy_quantized_model_init", default=None)


class quantized_model_init:
    """Inside, modules make their GEMM weights as FP8Weights (TE's quantized_model_init).
    recipe: DelayedScaling (None: its defaults) or Float8CurrentScaling, the recipe the
    weights are cast with; preserve_high_precision_init_val: keep the initial value on the
    host (`weight.get_high_precision_init_val()`), from which an optimizer made later starts
    its master copy (without it, the master starts from the FP8 value)."""

    def __init__(self, enabled=True, recipe=None, preserve_high_precision_init_val=False):
        op = "quantized_model_init"
        self.enabled = _check.flag(op, "enabled", enabled)
        if recipe is None:
            recipe = DelayedScaling()
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
            _check.fail(op, "recipe", "None, a tecupy.recipe.DelayedScaling or "
                        "Float8CurrentScaling", recipe, TypeError)
        self.recipe = recipe
        self.preserve = _check.flag(op, "preserve_high_precision_init_val",
                                    preserve_high_precision_init_val)

    def __enter__(self):  # (a stack of tokens: the same object may be entered nested)
        self._tokens = getattr(self, "_tokens", []) + [
            _init.set((self.enabled, self.recipe, self.preserve))]
        return self

    def __exit__(self, *exc):
        _init.reset(self._tokens.pop())
        return False


def active_init():
    """(recipe, preserve) of the quantized_model_init in force in this thread, or None."""
    state = _init.get()
    return None if state is None or not state[0] else state[1:]


class FP8Weight:
    """A GEMM weight as FP8 codes (see the module's docstring). Made by the modules under
    quantized_model_init: FP8Weight(value, recipe, fp8_state, gemm)."""
    _tecupy_codes = True  # an op's array-module check takes the codes' module (_array.py)

    def __init__(self, value, recipe, fp8_state, gemm, preserve=False):
        if value.ndim != 2:
            raise ValueError(f"FP8Weight: a 2-D weight [out, in], got shape {value.shape}")
        self.dtype, self.recipe = value.dtype, recipe
        self.state, self.gemm = fp8_state, gemm
        self.fmt = recipe.fp8_format.fwd
        self._init_val = np.array(_host(value)) if preserve else None
        if isinstance(recipe, DelayedScaling):
            fp8_state.bind(xp_of(value), recipe)
        q = self._cast(value)
        self.data, self.data_t, self.scale_inv = q.data, q.data_t, q.scale_inv

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: 2)
    size = property(lambda self: self.data.size)
    nbytes = property(lambda self: self.data.nbytes + self.data_t.nbytes)
    xp = property(lambda self: xp_of(self.data))

    def __repr__(self):
        return (f"FP8Weight(shape={self.shape}, fmt={self.fmt.name}, dtype={self.dtype}, "
                f"recipe={type(self.recipe).__name__})")

    def _cast(self, value):
        """value cast to FP8 with this weight's recipe, with its transposed copy."""
        if isinstance(self.recipe, DelayedScaling):
            meta, i = self.state.slot(self.gemm, "weight")
            return cast(value, meta.scale[i:i + 1], meta.fmt, meta.amax_history[0, i:i + 1],
                        transpose=True)
        return cast(value, current_scale(tensor_amax(value), self.fmt), self.fmt,
                    transpose=True)

    def fp8(self):
        """The FP8Tensor the GEMMs read (no copy)."""
        return FP8Tensor.made(self.data, self.fmt, self.scale_inv, self.data_t)

    def dequantize(self, dtype=None):
        """The weight's value in `dtype` (default: its own dtype)."""
        return dequantize(self.fp8(), self.dtype if dtype is None else dtype)

    def quantize_(self, value):
        """Cast `value` (float, [out, in], on this weight's device) into this weight's codes,
        in place: the optimizer's step from its master copy."""
        q = self._cast(value)
        self.data[...] = q.data
        self.data_t[...] = q.data_t
        self.scale_inv[...] = q.scale_inv

    def get_high_precision_init_val(self):
        """The initial value (a NumPy array of the weight's dtype), kept where the weight was
        made with preserve_high_precision_init_val=True; else None."""
        return self._init_val

    def clear_high_precision_init_val(self):
        self._init_val = None

    def master(self):
        """A float32 master copy for an optimizer: the preserved initial value, else the
        FP8 value."""
        if self._init_val is not None:
            return self.xp.asarray(self._init_val.astype(np.float32))
        return self.dequantize(np.float32)

    def load(self, codes, scale_inv):
        """Write saved codes [out, in] and scale_inv (as state_dict gave them) in place; the
        transposed copy is made from them."""
        xp = self.xp
        self.data[...] = xp.asarray(codes)
        self.data_t[...] = self.data.T
        self.scale_inv[...] = xp.asarray(scale_inv)


def _host(a):
    return a.get() if hasattr(a, "get") else a


def hp(weight, dtype=None):
    """weight as a high-precision array (itself where it is one)."""
    if isinstance(weight, FP8Weight):
        return weight.dequantize(dtype)
    return weight


def weight_fp8(quantizer, weight, transpose):
    """The FP8Tensor a GEMM reads for `weight`: its codes where it is an FP8Weight, else
    its cast by `quantizer` (with the transposed copy where `transpose`)."""
    if isinstance(weight, FP8Weight):
        if getattr(quantizer, "block_dim", None) is not None:
            raise TypeError(
                f"FP8 weight {weight!r} has one scale per tensor; the recipe in force "
                f"({quantizer!r}) scales blocks: make the module without "
                "quantized_model_init (its weights are cast per block at the forward) or "
                "run it under the recipe it was made with")
        return weight.fp8()
    return quantizer.quantize(weight, transpose=transpose)
