"""Quantizers: how each FP8 recipe casts a tensor, behind one seam, so that no op branches
on the recipe.

A quantizer casts a high-precision array to FP8:
    quantize(x, transpose=False, dbias_dtype=None) -> FP8Tensor, or (FP8Tensor, dbias)
        (transpose: 2-D x, the transposed copy too; dbias_dtype: with transpose, also the
        column sums of x from the same read: the backward's cast of dy)
and tells a fused producer (a norm or activation kernel with an FP8 output) what it needs:
    fmt         the FP8Format of the codes
    fused_ok    whether a producer may cast in its own pass: the scale must be known before
                the data is (False for current scaling, whose scale comes from the amax)
    residual_epilogue  whether a linear adds its residual in the GEMM's epilogue (every
                FP8 GEMM op takes residual=; where it is slower than the add: False)
    scale       float32 (1,): what the producer multiplies by (None unless fused_ok)
    amax_out    float32 (1,): where the producer maxes its output's amax (None unless fused_ok)
    wrap(codes) the FP8Tensor of the codes such a producer wrote (scale_inv from a kernel)
    fuses_act   whether quantize_act and quantize_dact cast in the activation's pass
    quantize_act(h, bias, name, transpose)  the FP8Tensor of act(h + bias) cast in the
                activation's own pass (the next GEMM's input, never in memory in high
                precision; with transpose its column-wise copy too, from the same pass), or
                None where the recipe has no such cast
    quantize_dact(dgrad, h, bias, name, dbias_dtype, chunk)  (FP8Tensor with its
                transposed copy, dbias or None) of the activation's backward dy * act'(h +
                bias), dy = dgrad(c0, c1) made by column chunks (fuses_act only)

The quantizers of one GEMM, x @ w.T with dy in backward, come together as GemmQuantizers
(input, weight, grad_output, and what the op's tape node needs: after_backward hooks and
the run-once reason, tape.record's arguments) from gemm_quantizers(state, gemm, xp), which
looks the recipe in force up in RECIPE_QUANTIZERS: the one place a recipe is looked at.
    DelayedScaling        DelayedQuantizer per tensor: a slot of the caller's FP8State
                          (fp8_state.py); without a state, current scaling in its format.
    Float8CurrentScaling  CurrentQuantizer per tensor: the format only.
    Float8BlockScaling    BlockQuantizer per tensor: its block dim (1x128 / 128x128) and
                          QParams; FP8BlockTensor, whose GEMM is "fp8_block_gemm".

A new recipe touches (issue 20), for block scaling: recipe.py (its class); this file (its
quantizer, its FP8Tensor subclass naming its GEMM op in gemm_op, its row of
RECIPE_QUANTIZERS); cuda/block_scaling.cu (the quantize kernels, new);
cutlass_templates/fp8_gemm.cu (its GEMM: a scale mode of the FP8 GEMM); kernels/block_scaling.py
(their launchers, registered as its ops, new); reference/block_scaling.py (the NumPy references
of both, new): 6 source files, plus the new modules' names in the import lists of
kernels/__init__.py and reference/__init__.py. No op, no module, not the tape. A recipe
with one scale per tensor needs no GEMM of its own: 5.

Block scaling, done so far: the recipe, BlockQuantizer (above: fused_ok False, so
producers never cast in their own pass; dbias from its own read of dy), FP8BlockTensor
(fp8.py: per-block scale_inv, its own column-wise copy, gemm_op "fp8_block_gemm"), the
NumPy references of block quantize, dequantize and the block GEMM
(reference/block_scaling.py), and the CUDA block-quantize kernel (cuda/block_scaling.cu,
kernels/block_scaling.py: both copies from one read of x), and the block GEMM on Hopper
(fp8_block_gemm_tn in cutlass_templates/fp8_gemm.cu: the factors applied at each promotion
over 128 of K; what it does not take, e.g. an FP8 output, runs on the reference). FP8Inspector
does not see block casts, and quantized_model_init (fp8_params.py) does not know this recipe
yet.
"""
import weakref

import numpy as np

from . import backends
from ._array import xp_of
from .activation_table import TABLE
from .autocast import active_recipe, note_used
from .fp8 import FP8BlockTensor, FP8Tensor, amax, cast, current_scale, dact_cast_chunked
from .fp8_state import update_backward
from .inspect import ACTIVE_INSPECTOR
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

# tape.record's `once` for a node whose backward casts with a state's backward slots
FP8_ONCE = ("FP8 ops", "(it recorded the gradients' amaxes and updated the backward FP8 "
            "scales); running it again would give different gradients and record the "
            "amaxes twice")


class DelayedQuantizer:
    """Delayed scaling: one slot of an FP8State. Casts with the slot's scale (from the
    amaxes of earlier steps) and maxes the tensor's amax into the slot's history row 0."""
    fused_ok = fuses_act = True
    residual_epilogue = True  # (a GEMM of its codes adds a residual in its epilogue)

    def __init__(self, meta, i, site=None):
        self.fmt = meta.fmt
        self.scale = meta.scale[i:i + 1]  # views, float32 (1,)
        self.amax_out = meta.amax_history[0, i:i + 1]
        self.site = site  # (id(state), gemm, tensor): FP8Inspector's label (an id: no cycle)
        _by_slot[id(self.amax_out)] = self  # (quantizer_of: fp8.dact_cast's label)

    def __repr__(self):
        return f"DelayedQuantizer({self.fmt.name})"

    def quantize(self, x, transpose=False, dbias_dtype=None):
        out = cast(x, self.scale, self.fmt, self.amax_out, transpose, dbias_dtype)
        return _inspected(self, x, out)

    def quantize_act(self, h, bias, name, transpose=False):
        """The FP8Tensor (row-wise codes; with transpose, and their column-wise copy, from
        the same pass: a fused block's GEMM then keeps only that copy for wgrad) of the
        activation `name`'s output act(h + bias), cast by the activation kernel in its own
        pass (its amax maxed into the slot)."""
        if transpose and not TABLE[name].gated:
            inv = xp_of(h).empty((1,), np.float32)
            q, qt, _ = backends.dispatch("act_cast_transpose", h, bias, name, self.scale,
                                         self.fmt, amax_out=self.amax_out, scale_inv_out=inv)
            return _inspected(self, None, FP8Tensor.made(q, self.fmt, inv, qt))
        codes, _ = backends.dispatch(f"{name}_fwd", h, bias, self.scale, self.fmt,
                                     amax_out=self.amax_out)
        return self.wrap(codes)

    def quantize_dact(self, dgrad, h, bias, name, dbias_dtype, chunk):
        """fp8.dact_cast_chunked with this slot's scale and amax row."""
        return dact_cast_chunked(dgrad, h, bias, name, self.scale, self.fmt, self.amax_out,
                                 dbias_dtype, chunk)

    def wrap(self, codes, inv=None):
        """The FP8Tensor of `codes` that a producer wrote with self.scale, maxing their
        amax into self.amax_out. Its scale_inv is a fresh 1 / scale from a kernel (IEEE;
        CuPy's own division flushes it to 0 above 2^126): the forward update at autocast
        exit rewrites the state's scales before backward uses this tensor. inv: a fresh
        float32 (1,) the producer wrote 1 / scale into (the norms: scale_inv_out), else
        None (written here, by a launch of its own)."""
        if inv is None:
            inv = xp_of(codes).empty((1,), np.float32)
            backends.dispatch("fp8_scale_inv", self.scale, inv)
        return _inspected(self, None, FP8Tensor.made(codes, self.fmt, inv))


def _inspected(quantizer, x, out):
    """out, after the active FP8Inspector (if any: one contextvar read) has seen the cast
    (x None: a producer-fused cast)."""
    inspector = ACTIVE_INSPECTOR.get()
    if inspector is not None:
        inspector.record(quantizer, x, out)
    return out


# id(amax_out view) -> its live DelayedQuantizer: an op that casts with a quantizer's scale
# and amax slot outside its methods (fp8.dact_cast) is labelled by the inspector through it
_by_slot = weakref.WeakValueDictionary()


def quantizer_of(amax_out):
    """The DelayedQuantizer whose amax slot is the array object `amax_out`, or None."""
    q = _by_slot.get(id(amax_out))
    return q if q is not None and q.amax_out is amax_out else None


class CurrentQuantizer:
    """Current scaling: each tensor's own amax (one pass), then the cast with
    fmt.max / amax (fp8.current_scale). No state."""
    fused_ok = fuses_act = False  # the scale needs the whole tensor's amax before any code
    residual_epilogue = True
    scale = amax_out = site = None

    def __init__(self, fmt):
        self.fmt = fmt

    def __repr__(self):
        return f"CurrentQuantizer({self.fmt.name})"

    def quantize(self, x, transpose=False, dbias_dtype=None):
        out = cast(x, current_scale(amax(x), self.fmt), self.fmt, None, transpose, dbias_dtype)
        return _inspected(self, x, out)

    def quantize_act(self, h, bias, name, transpose=False):
        return None  # (the scale needs the activation's whole output first)

    def wrap(self, codes, inv=None):
        raise TypeError("CurrentQuantizer.wrap: current scaling cannot cast in a producer's "
                        "pass (fused_ok is False): quantize the producer's output instead")


class BlockQuantizer:
    """Block scaling (Float8BlockScaling): one scale per 1x128 (block_dim 1) or 128x128
    (block_dim 2) block from that block's own amax, TE's compute_scale_from_amax with the
    tensor's QParams (power-of-two scales by default). No state. The column-wise copy
    (transpose=True) is quantized from x in its own blocks (1x128 along the columns), in the
    same pass on the GPU (kernels/block_scaling.py)."""
    fused_ok = False  # a block's scale needs the block's amax before its codes
    fuses_act = True  # (its kernel reads the activation's input: block_quantize_act, _dact)
    # the block GEMM takes a residual (bit for bit the add), but its epilogue cost more than
    # the add kernel it saves (quickstart layer, H100, session 19): off
    residual_epilogue = False
    scale = amax_out = site = None

    def __init__(self, fmt, block_dim, qparams):
        self.fmt, self.block_dim = fmt, block_dim
        self.power_2_scale, self.amax_epsilon = qparams.power_2_scale, qparams.amax_epsilon

    def __repr__(self):
        return (f"BlockQuantizer({self.fmt.name}, "
                f"{'1x128' if self.block_dim == 1 else '128x128'}, "
                f"power_2_scale={self.power_2_scale})")

    def quantize(self, x, transpose=False, dbias_dtype=None):
        """-> FP8BlockTensor (2-D x), or (it, dbias) with dbias_dtype (transpose, 1x128
        blocks: dbias from the same read of x, block_quantize_dbias). FP8Inspector sees the
        row-wise codes."""
        if x.ndim != 2:
            raise ValueError(f"BlockQuantizer.quantize: needs 2-D x, got shape "
                             f"{tuple(x.shape)}")
        if dbias_dtype is not None and transpose and self.block_dim == 1:
            q, s, qt, st, dbias = backends.dispatch(
                "block_quantize_dbias", x, self.fmt, self.power_2_scale, self.amax_epsilon,
                dbias_dtype)
            return _inspected(self, x, (FP8BlockTensor.made(q, self.fmt, s, qt, st, 1), dbias))
        q, s, qt, st = backends.dispatch("block_quantize", x, self.fmt, self.block_dim,
                                         self.power_2_scale, self.amax_epsilon, transpose)
        t = _inspected(self, x, FP8BlockTensor.made(q, self.fmt, s, qt, st, self.block_dim))
        if dbias_dtype is None:
            return t
        return t, backends.dispatch("bias_grad", x, dbias_dtype)

    def quantize_act(self, h, bias, name, transpose=True):
        """The FP8BlockTensor (both copies, whatever transpose says) of act(h + bias) in h's
        dtype, quantized in the kernel's read of h (block_quantize_act: the activation's
        output never in memory); None for a gated activation."""
        if TABLE[name].gated:
            return None
        q, s, qt, st = backends.dispatch("block_quantize_act", h, bias, name, self.fmt,
                                         self.block_dim, self.power_2_scale,
                                         self.amax_epsilon, True)
        return _inspected(self, None, FP8BlockTensor.made(q, self.fmt, s, qt, st,
                                                          self.block_dim))

    def quantize_dact(self, dgrad, h, bias, name, dbias_dtype, chunk):
        """The activation's backward of dy = dgrad(0, cols) (whole: a column chunk's 1x128
        blocks would need the kernel to write into wider arrays), quantized in 1x128 blocks
        with its column-wise copy in the kernel's read of dy and h (block_quantize_dact),
        and its dbias (None without dbias_dtype)."""
        q, s, qt, st, db = backends.dispatch("block_quantize_dact", dgrad(0, h.shape[1]), h,
                                             bias, name, self.fmt, self.power_2_scale,
                                             self.amax_epsilon, dbias_dtype)
        return _inspected(self, None, FP8BlockTensor.made(q, self.fmt, s, qt, st, 1)), db

    def wrap(self, codes, inv=None):
        raise TypeError("BlockQuantizer.wrap: block scaling cannot cast in a producer's "
                        "pass (fused_ok is False): quantize the producer's output instead")


_block_gemms = {}  # the recipe's fields -> GemmQuantizers (no state: made once)


def _block(recipe, state, gemm, xp):
    """Block scaling: input, weight and grad_output quantizers from the recipe's block
    dims and QParams (the format's fwd for x and w, bwd for dy); the state is not used."""
    key = (recipe.fp8_format, recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
           recipe.grad_block_scaling_dim, recipe.fp8_quant_fwd_inp,
           recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
    q = _block_gemms.get(key)
    if q is None:
        fmt = recipe.fp8_format
        q = _block_gemms[key] = GemmQuantizers(
            BlockQuantizer(fmt.fwd, recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp),
            BlockQuantizer(fmt.fwd, recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight),
            BlockQuantizer(fmt.bwd, recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad))
    return q


class GemmQuantizers:
    """The quantizers of one GEMM's tensors, and what its op passes to tape.record:
    after_backward ((fn, item) hooks) and once (None or (what, why))."""
    __slots__ = ("input", "weight", "grad_output", "after_backward", "once")

    def __init__(self, input, weight, grad_output, after_backward=(), once=None):
        self.input, self.weight, self.grad_output = input, weight, grad_output
        self.after_backward, self.once = after_backward, once

    def __repr__(self):
        return (f"GemmQuantizers(input={self.input}, weight={self.weight}, "
                f"grad_output={self.grad_output})")


_current_gemms = {}  # recipe.Format -> GemmQuantizers (they hold no state: made once)


def _current(recipe, state, gemm, xp):
    """Current scaling in the recipe's format (E4M3 forward; E5M2 for dy under HYBRID)."""
    fmt = recipe.fp8_format
    q = _current_gemms.get(fmt)
    if q is None:
        q = _current_gemms[fmt] = GemmQuantizers(
            CurrentQuantizer(fmt.fwd), CurrentQuantizer(fmt.fwd), CurrentQuantizer(fmt.bwd))
    return q


def _delayed(recipe, state, gemm, xp):
    """Slots of `state` bound to the recipe (noted for the forward update at autocast exit;
    the backward update runs after backward as the node's hook). No state: current
    scaling in the recipe's format."""
    if state is None:
        return _current(recipe, state, gemm, xp)
    state.bind(xp, recipe)
    note_used(state)
    slots = state.derived.get(gemm)
    if slots is None:  # kept on the state: slicing costs ~5 us a view on CuPy
        slots = state.derived[gemm] = tuple(
            DelayedQuantizer(*state.slot(gemm, which), (id(state), gemm, which))
            for which in ("input", "weight", "grad_output"))
    # (made per call: kept on the state, the hook's reference to it would make a cycle)
    return GemmQuantizers(*slots, after_backward=((update_backward, state),), once=FP8_ONCE)


# recipe class -> f(recipe, state, gemm, xp) -> GemmQuantizers
RECIPE_QUANTIZERS = {DelayedScaling: _delayed, Float8CurrentScaling: _current,
                     Float8BlockScaling: _block}


def gemm_quantizers(state, gemm, xp):
    """The quantizers of GEMM `gemm` under the recipe in force in this thread, None when
    FP8 is off. state: the caller's FP8State or None; xp: the data's array module."""
    recipe = active_recipe()
    if recipe is None:
        return None
    make = RECIPE_QUANTIZERS.get(type(recipe))
    if make is None:  # a subclass of a recipe
        make = next(RECIPE_QUANTIZERS[c] for c in type(recipe).__mro__
                    if c in RECIPE_QUANTIZERS)
    return make(recipe, state, gemm, xp)
