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
  Float8BlockScaling    one scale per 128x128 block from the block's amax (the recipe's
                        fp8_quant_fwd_weight QParams); the transposed copy is the codes'
                        transpose, with the scales' (w_block_scaling_dim 2 only: a 1x128
                        weight's column-wise copy has blocks of its own).
The optimizer owns the float32 master copy: after each step it casts the master into the
weight's codes, in place (the arrays keep their addresses: a captured CUDA graph reads them).
Outside fp8_autocast an op dequantizes the weight (a high-precision GEMM on its FP8 value).

Also here, for high-precision weights: is_first_microbatch (TE's weight caching across the
microbatches of a minibatch: FIRST_MICROBATCH_DOC, microbatch_weights). The modules pass the
kept FP8Tensor to their ops as `qweight`, which weight_fp8 returns in place of a cast.
"""
import contextvars

import numpy as np

from . import _check, backends
from ._array import xp_of
from .autocast import active_recipe
from .fp8 import FP8BlockTensor, FP8Tensor, cast, current_scale, dequantize
from .fp8 import amax as tensor_amax
from .quantization import BlockQuantizer, gemm_quantizers
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

# (enabled, recipe, preserve_high_precision_init_val) of the innermost quantized_model_init
_init = contextvars.ContextVar("tecupy_quantized_model_init", default=None)


class quantized_model_init:
    """Inside, modules make their GEMM weights as FP8Weights (TE's quantized_model_init).
    recipe: DelayedScaling (None: its defaults), Float8CurrentScaling or Float8BlockScaling
    (with w_block_scaling_dim 2, its default), the recipe the weights are cast with and the
    modules run under; preserve_high_precision_init_val: keep the initial value on the host
    (`weight.get_high_precision_init_val()`), from which an optimizer made later starts its
    master copy (without it, the master starts from the FP8 value)."""

    def __init__(self, enabled=True, recipe=None, preserve_high_precision_init_val=False):
        op = "quantized_model_init"
        self.enabled = _check.flag(op, "enabled", enabled)
        if recipe is None:
            recipe = DelayedScaling()
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
            _check.fail(op, "recipe", "None, a tecupy.recipe.DelayedScaling, "
                        "Float8CurrentScaling or Float8BlockScaling", recipe, TypeError)
        if isinstance(recipe, Float8BlockScaling) and recipe.w_block_scaling_dim != 2:
            _check.fail(op, "recipe.w_block_scaling_dim", "2 (128x128 weight blocks, whose "
                        "column-wise copy is the codes' transpose)",
                        recipe.w_block_scaling_dim, ValueError)
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
        self.block_dim = 2 if isinstance(recipe, Float8BlockScaling) else None
        self._block_q = (BlockQuantizer(self.fmt, 2, recipe.fp8_quant_fwd_weight)
                         if self.block_dim else None)  # (stateless: made once)
        self._init_val = np.array(_host(value)) if preserve else None
        if isinstance(recipe, DelayedScaling):
            fp8_state.bind(xp_of(value), recipe)
        q = self._cast(value)
        self.data, self.data_t, self.scale_inv = q.data, q.data_t, q.scale_inv
        self.scale_inv_t = q.scale_inv_t if self.block_dim else None  # (block scales)

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
        if self.block_dim:
            return self._block_q.quantize(value, True)
        if isinstance(self.recipe, DelayedScaling):
            meta, i = self.state.slot(self.gemm, "weight")
            return cast(value, meta.scale[i:i + 1], meta.fmt, meta.amax_history[0, i:i + 1],
                        transpose=True)
        return cast(value, current_scale(tensor_amax(value), self.fmt), self.fmt,
                    transpose=True)

    def fp8(self):
        """The FP8Tensor (FP8BlockTensor under block scaling) the GEMMs read (no copy)."""
        if self.block_dim:
            return FP8BlockTensor.made(self.data, self.fmt, self.scale_inv, self.data_t,
                                       self.scale_inv_t, self.block_dim)
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
        if self.block_dim:
            self.scale_inv_t[...] = q.scale_inv_t

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
        """Write saved codes [out, in] and scale_inv (as state_dict gave them) in place."""
        self.data[...] = self.xp.asarray(codes)
        self.sync_copies(scale_inv)

    def sync_copies(self, scale_inv):
        """Once the row-wise codes were written in place (load, ZeroOptimizer's gather): the
        transposed copy made from them (fp8_transpose: a tiled kernel on the GPU, not a
        strided copy) and scale_inv written (128x128 blocks: the scales' transpose too)."""
        self.data_t[...] = backends.dispatch("fp8_transpose", self.data)
        self.scale_inv[...] = self.xp.asarray(scale_inv)
        if self.block_dim:
            self.scale_inv_t[...] = self.scale_inv.T


def _host(a):
    return a.get() if hasattr(a, "get") else a


def hp(weight, dtype=None):
    """weight as a high-precision array (itself where it is one)."""
    if isinstance(weight, FP8Weight):
        return weight.dequantize(dtype)
    return weight


def check_qweight(op, name, qweight, weight):
    """qweight is None or an FP8Tensor of weight's shape [out, in]."""
    if qweight is None or (isinstance(qweight, FP8Tensor) and weight is not None
                           and tuple(qweight.shape) == tuple(weight.shape)):
        return
    shape = None if weight is None else tuple(weight.shape)
    _check.fail(op, name, f"None or an FP8Tensor of the weight's shape {shape} (the "
                "weight's FP8 codes kept by its module)", qweight,
                ValueError if isinstance(qweight, FP8Tensor) else TypeError)


def weight_fp8(quantizer, weight, transpose, qweight=None):
    """The FP8Tensor a GEMM reads for `weight`: `qweight` where given (the weight's FP8
    codes its module kept from an earlier microbatch: nn.Linear's is_first_microbatch; no
    cast, no amax), its codes where it is an FP8Weight, else its cast by `quantizer` (with
    the transposed copy where `transpose`)."""
    if qweight is not None:
        return qweight
    if isinstance(weight, FP8Weight):
        blocks = getattr(quantizer, "block_dim", None)
        if blocks != weight.block_dim or (blocks and quantizer.fmt != weight.fmt):
            have = (f"one scale per {'128x128 block' if weight.block_dim else 'tensor'}"
                    f" ({weight.fmt.name})")
            want = (f"scales {'1x128' if blocks == 1 else '128x128'} blocks" if blocks
                    else "scales per tensor")
            raise TypeError(
                f"FP8 weight {weight!r} has {have}; the recipe in force ({quantizer!r}) "
                f"{want}: make the module without quantized_model_init (its weights are "
                "cast at the forward) or run it under the recipe it was made with")
        return weight.fp8()
    return quantizer.quantize(weight, transpose=transpose)


# ---- is_first_microbatch: FP8 weights kept across the microbatches of a minibatch --------
# Transformer Engine (module/linear.py, forward: cache_name = "weight" unless
# is_first_microbatch is None; update_ws = is_first_microbatch is None or
# is_first_microbatch; module/base.py, quantize_weight: a kept workspace is re-cast only
# where update_workspace, else returned as is). Under delayed scaling a skipped cast records
# no amax for the weight: its history row 0 stays 0 and the update at fp8_autocast exit
# leaves that slot's history and scale alone (common/recipe/delayed_scaling.cu: no roll when
# the newest amax is 0, the old scale kept when the amax is 0); the kept codes carry their
# own scale_inv (the one they were cast with), so the GEMM stays consistent whatever the
# state's scale became since. Unlike TE, False with nothing (valid) kept is an error here,
# not a silent cast: the caller's microbatch bookkeeping is wrong.
FIRST_MICROBATCH_DOC = """is_first_microbatch: None (default), True or False, Transformer
        Engine's: within a minibatch split into microbatches the weights do not change, so
        under fp8_autocast True casts the weight(s) as None does and keeps the FP8 tensors
        the GEMMs read (codes, transposed codes, scale_inv) on the module, and False reuses
        them: no cast (no launch, no allocation, no amax of the weight: under delayed
        scaling its amax history and scale stay as they are, as in TE). Gradients still go
        to the high-precision weight. The kept tensors live until the next True or None
        call (None drops them; a byte per weight element, twice). Outside fp8_autocast, for
        FP8 weights (quantized_model_init: already codes) and under tensor parallel it
        changes nothing. False with nothing kept, or kept under another recipe or format,
        or after the weight was replaced or reshaped, is a ValueError: call with True. An
        in-place change of the weights (an optimizer step, load_state_dict) starts a new
        minibatch: call with True then (False would read the codes of the old values)."""


def check_first_microbatch(op, value):
    """is_first_microbatch as None or a bool (TypeError otherwise: 0/1 and "yes" would be
    taken for truth values)."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    _check.fail(op, "is_first_microbatch", "None, True or False", value, TypeError)


def microbatch_weights(module, op, is_first_microbatch, *weights):
    """The ops' qweight arguments for `weights`, (parameter name, GEMM index of
    module.fp8_state) pairs: a tuple of FP8Tensor or None per weight, or None for all (the
    op casts: today's path). FIRST_MICROBATCH_DOC says what each value does; the kept
    tensors are module._fp8_workspaces[name] = (FP8Tensor, the weight, its signature, the
    recipe object, the weight's shape): a False call under the same recipe object reads
    them in a few comparisons (issue 21: host time per Linear)."""
    if is_first_microbatch is None:
        if module.__dict__.get("_fp8_workspaces"):
            module._fp8_workspaces = {}  # (None: TE's path without a cache; freed here)
        return None
    flag = check_first_microbatch(op, is_first_microbatch)
    recipe = active_recipe()
    if recipe is None:
        return None
    kept = module.__dict__.setdefault("_fp8_workspaces", {})
    out = []
    for name, gemm in weights:
        w = getattr(module, name)
        e = None if flag else kept.get(name)
        if e is not None and e[3] is recipe and e[1] is w and e[4] == w.shape:
            out.append(e[0])  # (the common False call)
        else:
            out.append(_microbatch_weight(module, op, flag, recipe, kept, name, gemm, w))
    return tuple(out)


def _microbatch_weight(module, op, flag, recipe, kept, name, gemm, w):
    """One weight's qweight of microbatch_weights, the general way: None for an FP8Weight;
    True: cast now (the recipe's weight quantizer) and kept; False: the kept one, checked."""
    if isinstance(w, FP8Weight):  # already the codes the GEMMs read
        return None
    q = gemm_quantizers(module.fp8_state, gemm, xp_of(w)).weight
    sig = (type(recipe).__name__, q.fmt.name.upper(), getattr(q, "block_dim", None),
           tuple(w.shape), w.dtype)
    if flag:
        t = weight_fp8(q, w, True)
    else:
        t = _reused(op, name, kept.get(name), w, sig)
    kept[name] = (t, w, sig, recipe, w.shape)
    return t


def _reused(op, name, entry, w, sig):
    """The kept FP8Tensor of weight `name` for is_first_microbatch=False, or a ValueError
    naming what is wrong and what to do."""
    head = (f"{op}: is_first_microbatch=False reuses the FP8 weight {name!r} kept by the "
            "last is_first_microbatch=True call under fp8_autocast")
    todo = "; call with is_first_microbatch=True (the first microbatch of the minibatch)"
    if entry is None:
        raise ValueError(head + ", but none is kept (never made, or dropped by a call with "
                         "is_first_microbatch=None)" + todo)
    t, kept_w, kept_sig = entry[:3]
    if kept_w is not w:
        raise ValueError(head + f", but the module's {name!r} is another array now "
                         "(replaced by an assignment since)" + todo)
    if kept_sig[3:] != sig[3:]:
        raise ValueError(head + f", cast from shape {kept_sig[3]} {kept_sig[4]}; the weight "
                         f"is {sig[3]} {sig[4]} now" + todo)
    if kept_sig[:3] != sig[:3]:
        raise ValueError(head + f", cast under {kept_sig[0]} ({kept_sig[1]}"
                         f"{_blocks(kept_sig[2])}); the recipe in force is {sig[0]} "
                         f"({sig[1]}{_blocks(sig[2])})" + todo)
    return t


def _blocks(block_dim):
    return "" if block_dim is None else (", 1x128 blocks" if block_dim == 1 else
                                         ", 128x128 blocks")

