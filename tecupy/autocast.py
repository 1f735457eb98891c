"""FP8 state owned by its caller, and the autocast context stack.

An FP8State holds, per quantized tensor slot, `scale`, `scale_inv` and `amax_history[L, n]`,
laid out as Transformer Engine's fp8_meta: forward slots (input, weight, output) per GEMM,
backward slots (grad_output, grad_input) per GEMM. Casts write this step's amax into row 0
of the history; forward slots are updated when the outermost autocast exits, backward slots
when Tape.gradient finishes.
"""
import contextlib

import numpy as np

from . import backends
from ._array import xp_of
from .fp8 import FLT_MAX, quantize
from .recipe import DelayedScaling, Float8CurrentScaling

FWD_SLOTS = {"input": 0, "weight": 1, "output": 2}
BWD_SLOTS = {"grad_output": 0, "grad_input": 1}


class FP8Meta:
    """scale, scale_inv, fp8_max [n] and amax_history [L, n] for n slots of one direction."""

    def __init__(self, xp, n, length, fmt):
        self.fmt = fmt
        self.scale = xp.ones((n,), np.float32)
        self.scale_inv = xp.ones((n,), np.float32)
        self.fp8_max = xp.full((n,), fmt.max, np.float32)
        self.amax_history = xp.zeros((length, n), np.float32)

    def resize(self, xp, length):
        old = self.amax_history
        self.amax_history = xp.zeros((length, old.shape[1]), np.float32)
        keep = min(length, old.shape[0])
        self.amax_history[:keep] = old[:keep]


class FP8State:
    """FP8 scaling state of `num_gemms` GEMMs. Arrays are made on first use, on the device
    of the data, for the recipe of the autocast in force then."""

    def __init__(self, num_gemms=1):
        self.num_gemms = int(num_gemms)
        self.recipe = self.fwd = self.bwd = self.xp = None

    def __repr__(self):
        return f"FP8State(num_gemms={self.num_gemms}, recipe={self.recipe!r})"

    def bind(self, xp, recipe):
        if self.fwd is not None and self.xp is not xp:
            raise TypeError("FP8State: state lives on one device; data moved between numpy "
                            "and cupy. Make a new FP8State (or module) for the other device.")
        fmt = recipe.fp8_format
        if self.fwd is None or self.recipe.fp8_format is not fmt:
            self.xp = xp
            self.fwd = FP8Meta(xp, 3 * self.num_gemms, recipe.amax_history_len, fmt.fwd)
            self.bwd = FP8Meta(xp, 2 * self.num_gemms, recipe.amax_history_len, fmt.bwd)
        elif self.fwd.amax_history.shape[0] != recipe.amax_history_len:
            self.fwd.resize(xp, recipe.amax_history_len)
            self.bwd.resize(xp, recipe.amax_history_len)
        self.recipe = recipe

    def _slot(self, table, gemm, which, per):
        if not 0 <= gemm < self.num_gemms:
            raise IndexError(f"FP8State has {self.num_gemms} GEMMs, asked for GEMM {gemm}")
        return per * gemm + table[which]

    def fwd_slot(self, gemm, which):
        """(scale, amax_out) views, shape (1,), of one forward slot: for fused casts."""
        i = self._slot(FWD_SLOTS, gemm, which, 3)
        return self.fwd.scale[i:i + 1], self.fwd.amax_history[0, i:i + 1]

    def quantize_fwd(self, x, gemm, which, transpose=False):
        i = self._slot(FWD_SLOTS, gemm, which, 3)
        m = self.fwd
        return quantize(x, m.scale[i:i + 1], m.fmt, amax_out=m.amax_history[0, i:i + 1],
                        transpose=transpose)

    def quantize_bwd(self, g, gemm, which, transpose=False, dbias_dtype=None):
        i = self._slot(BWD_SLOTS, gemm, which, 2)
        m = self.bwd
        return quantize(g, m.scale[i:i + 1], m.fmt, amax_out=m.amax_history[0, i:i + 1],
                        transpose=transpose, dbias_dtype=dbias_dtype)

    def update_forward(self):
        update_states([self], "fwd")

    def update_backward(self):
        update_states([self], "bwd")


def update_states(states, direction):
    """Update the `direction` ("fwd" or "bwd") metas of many states: one launch per group
    of metas that share a recipe, a device and a history length."""
    groups = {}
    for s in states:
        meta = getattr(s, direction)
        if meta is not None:
            key = (id(s.recipe), id(s.xp), meta.amax_history.shape[0])
            groups.setdefault(key, (s.recipe, []))[1].append(meta)
    for recipe, metas in groups.values():
        algo = recipe.amax_compute_algo
        if callable(algo) or recipe.scaling_factor_compute_algo is not None:
            for m in metas:
                _update_custom(m, recipe)
        else:
            backends.dispatch("delayed_scaling_update", metas, algo, recipe.margin)


def _update_custom(meta, recipe):
    """Transformer Engine's unfused path, used for callables: always rolls the history."""
    h = meta.amax_history
    xp = xp_of(h)
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = xp.asarray(algo(h), dtype=np.float32)
    elif algo == "max":
        amax = h.max(axis=0)
    else:
        amax = h[0].copy()
    h[...] = xp.roll(h, -1, axis=0)
    h[0] = 0
    if recipe.scaling_factor_compute_algo is not None:
        scale = xp.asarray(recipe.scaling_factor_compute_algo(amax, meta.scale, meta.fp8_max,
                                                              recipe), dtype=np.float32)
    else:
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            sf = (meta.fp8_max / amax) / np.float32(2.0 ** recipe.margin)
        sf = xp.where(amax > 0, sf, meta.scale)
        sf = xp.where(xp.isfinite(amax), sf, meta.scale)
        scale = xp.where(xp.isinf(sf), np.float32(FLT_MAX), sf)
    meta.scale[...] = scale
    meta.scale_inv[...] = np.float32(1) / meta.scale


# ---- autocast: a small context stack -------------------------------------------------

_stack = []  # (enabled, recipe) per open autocast; states used are noted on the outermost
_used_states = []


@contextlib.contextmanager
def fp8_autocast(enabled=True, fp8_recipe=None):
    """Run tecupy's linear-type ops in FP8 inside the block (Transformer Engine's API)."""
    if fp8_recipe is not None and not isinstance(fp8_recipe, (DelayedScaling,
                                                              Float8CurrentScaling)):
        raise TypeError(f"fp8_recipe must be DelayedScaling or Float8CurrentScaling, "
                        f"got {type(fp8_recipe).__name__}")
    recipe = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    outermost = not _stack
    _stack.append((bool(enabled), recipe))
    try:
        yield
    finally:
        _stack.pop()
        if outermost:
            states, _used_states[:] = list(_used_states), []
            update_states(states, "fwd")


def autocast(enabled=True, recipe=None):
    """Transformer Engine 2.x spelling of fp8_autocast."""
    return fp8_autocast(enabled=enabled, fp8_recipe=recipe)


def active_recipe():
    """The recipe in force, or None when FP8 is off."""
    if _stack and _stack[-1][0]:
        return _stack[-1][1]
    return None


def fp8_enabled():
    return active_recipe() is not None


def use_state(state, xp):
    """Bind `state` to the recipe in force and note it for the forward update at exit.
    Returns None when the recipe is current scaling (no state is used)."""
    recipe = active_recipe()
    if state is None or not isinstance(recipe, DelayedScaling):
        return None
    state.bind(xp, recipe)
    if state not in _used_states:
        _used_states.append(state)
    return state
