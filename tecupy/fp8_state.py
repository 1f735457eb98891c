"""FP8 scaling state owned by its caller (a module, or an explicit FP8State), its update,
and its save/restore.

An FP8State holds, per quantized tensor slot, `scale`, `scale_inv` and `amax_history[L, n]`,
laid out as Transformer Engine's fp8_meta: forward slots (input, weight, output) per GEMM,
backward slots (grad_output, grad_input) per GEMM. Casts write this step's amax into row 0
of the history (quantization.DelayedQuantizer). Forward slots are updated when the
outermost (enabled) autocast exits, for the states used while a Tape was recording
(autocast.py); backward slots after the backward, by the tape's after-backward hook
update_backward.
"""
import numbers

import numpy as np

from . import _check, backends
from ._array import xp_of
from .fp8 import FLT_MAX, quantize, scaled_max
from .recipe import Format

FWD_SLOTS = {"input": 0, "weight": 1, "output": 2}
BWD_SLOTS = {"grad_output": 0, "grad_input": 1}
META_ARRAYS = ("scale", "scale_inv", "amax_history")  # what a state_dict holds per meta


class FP8Meta:
    """scale, scale_inv, fp8_max [n] and amax_history [L, n] for n slots of one direction."""

    def __init__(self, xp, n, length, fmt):
        self.fmt = fmt
        self.scale = xp.ones((n,), np.float32)
        self.scale_inv = xp.ones((n,), np.float32)
        self.fp8_max = xp.full((n,), fmt.max, np.float32)
        self.amax_history = xp.zeros((length, n), np.float32)

    def resize(self, xp, length):
        """Transformer Engine's adjust_amax_history_length: keep the first rows, pad zeros."""
        old = self.amax_history
        self.amax_history = xp.zeros((length, old.shape[1]), np.float32)
        keep = min(length, old.shape[0])
        self.amax_history[:keep] = old[:keep]

    def set_format(self, fmt):
        """Another FP8 format: scales and history stay (see FP8State.bind)."""
        self.fmt = fmt
        self.fp8_max[...] = np.float32(fmt.max)


class FP8State:
    """FP8 scaling state of `num_gemms` GEMMs. Arrays are made on first use, on the device
    of the data, for the recipe of the autocast in force then."""

    def __init__(self, num_gemms=1):
        self.num_gemms = _check.size("FP8State", "num_gemms", num_gemms)
        self.recipe = self.fwd = self.bwd = None
        self.device = self.fp8_format = None  # "numpy" / "cupy", a recipe.Format
        # what callers derive from the arrays and keep (the quantizers of a GEMM: views
        # of the slots, ~5 us each to make on CuPy), dropped whenever the arrays or the
        # format change, and never pickled (a copied view would not see the copied state)
        self.derived = {}
        # a tecupy.distributed ProcessGroup (the tensor-parallel modules set their tp_group):
        # under a recipe with reduce_amax, this step's amaxes (history row 0) are maxed over
        # it before each update, as Transformer Engine reduces them over its amax group
        self.amax_group = None
        # the fp8_group of the autocast this state was last used in (autocast.note_used):
        # where one is given it takes the place of amax_group (TE: the autocast's group)
        self.autocast_group = None

    def __repr__(self):
        return f"FP8State(num_gemms={self.num_gemms}, recipe={self.recipe!r})"

    def __getstate__(self):  # (a process group is this process's: not pickled either)
        return {k: v for k, v in self.__dict__.items()
                if k not in ("derived", "amax_group", "autocast_group")}

    def __setstate__(self, d):
        self.__dict__.update(d, derived={}, amax_group=None, autocast_group=None)

    def bind(self, xp, recipe):
        """Make or adapt the arrays for `recipe`. A recipe with another fp8_format keeps the
        scales and amax history and changes the format and fp8_max, as Transformer Engine
        does (module/base.py: set_meta_tensor keeps an existing delayed-scaling state, only
        adjusting the history length; init_fp8_metadata takes fp8_max from the new recipe)."""
        fmt, length = recipe.fp8_format, recipe.amax_history_len
        if self.fwd is None:
            self._make(xp, fmt, length)
        else:
            if self.device != xp.__name__:
                raise TypeError("FP8State: state lives on one device; data moved between "
                                f"{self.device} and {xp.__name__}. Make a new FP8State (or "
                                "module) for the other device.")
            if self.fp8_format is not fmt:
                self.fwd.set_format(fmt.fwd)
                self.bwd.set_format(fmt.bwd)
                self.derived.clear()
            if self.fwd.amax_history.shape[0] != length:
                self.fwd.resize(xp, length)
                self.bwd.resize(xp, length)
                self.derived.clear()
        self.recipe, self.fp8_format = recipe, fmt

    def _make(self, xp, fmt, length):
        self.device, self.fp8_format = xp.__name__, fmt
        self.fwd = FP8Meta(xp, 3 * self.num_gemms, length, fmt.fwd)
        self.bwd = FP8Meta(xp, 2 * self.num_gemms, length, fmt.bwd)
        self.derived.clear()

    def slot(self, gemm, which):
        """(meta, i): slot `which` of GEMM `gemm`, index i of the fwd meta ("input",
        "weight", "output") or the bwd meta ("grad_output", "grad_input")."""
        if not 0 <= gemm < self.num_gemms:
            raise IndexError(f"FP8State has {self.num_gemms} GEMMs, asked for GEMM {gemm}")
        if which in FWD_SLOTS:
            return self.fwd, 3 * gemm + FWD_SLOTS[which]
        return self.bwd, 2 * gemm + BWD_SLOTS[which]

    def quantize_fwd(self, x, gemm, which, transpose=False):
        """quantize with a forward slot's scale, maxing x's amax into its history row 0."""
        m, i = self.slot(gemm, which)
        return quantize(x, m.scale[i:i + 1], m.fmt, amax_out=m.amax_history[0, i:i + 1],
                        transpose=transpose)

    def quantize_bwd(self, g, gemm, which, transpose=False, dbias_dtype=None):
        m, i = self.slot(gemm, which)
        return quantize(g, m.scale[i:i + 1], m.fmt, amax_out=m.amax_history[0, i:i + 1],
                        transpose=transpose, dbias_dtype=dbias_dtype)

    def update_forward(self):
        update_states([self], "fwd")

    def update_backward(self):
        update_states([self], "bwd")

    # ---- save and restore (Module.state_dict) -------------------------------------------
    def state_dict(self, prefix=""):
        """{prefix + "fp8_format": "HYBRID" | "E4M3" | None (never used in FP8),
        prefix + "amax_history_len": int | None, and when used, prefix + "fwd.scale",
        "fwd.scale_inv", "fwd.amax_history", "bwd.scale", ...: float32 numpy copies}."""
        from ._array import to_numpy
        used = self.fwd is not None
        sd = {prefix + "fp8_format": self.fp8_format.name if used else None,
              prefix + "amax_history_len": self.fwd.amax_history.shape[0] if used else None}
        for d in ("fwd", "bwd") if used else ():
            for name in META_ARRAYS:
                sd[f"{prefix}{d}.{name}"] = np.array(to_numpy(getattr(getattr(self, d), name)))
        return sd

    def check_state_dict(self, sd, prefix=""):
        """(the keys of `sd` this state would load, the errors loading it would meet, each
        naming the key, what it got and what was expected). Changes nothing."""
        keys = [prefix + "fp8_format", prefix + "amax_history_len"]
        errors = [mismatch(k, "missing", "present") for k in keys if k not in sd]
        if errors:
            return keys, errors
        errors = self._check_recipe(sd[keys[0]], sd[keys[1]], keys)
        if errors or sd[keys[0]] is None:
            return keys, errors
        length, n = int(sd[keys[1]]), self.num_gemms
        for d, per in (("fwd", 3), ("bwd", 2)):
            for name in META_ARRAYS:
                key = f"{prefix}{d}.{name}"
                shape = (length, per * n) if name == "amax_history" else (per * n,)
                keys.append(key)
                errors += check_array(sd, key, shape, np.dtype(np.float32))
        return keys, errors

    def _check_recipe(self, fmt, length, keys):
        """The saved format and history length: valid, and where this state is made
        already, its own (another recipe's state is not silently adopted)."""
        if fmt is None:
            return [] if length is None else [mismatch(keys[1], repr(length),
                                                       "None (fp8_format is None)")]
        if fmt not in ("E4M3", "HYBRID"):
            return [mismatch(keys[0], repr(fmt), "'E4M3', 'HYBRID' or None")]
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
            return [mismatch(keys[1], repr(length), "an int >= 1")]
        if self.fwd is None:
            return []
        errors = []
        if fmt != self.fp8_format.name:
            errors.append(mismatch(keys[0], repr(fmt), repr(self.fp8_format.name)))
        if length != self.fwd.amax_history.shape[0]:
            errors.append(mismatch(keys[1], length, self.fwd.amax_history.shape[0]))
        return errors

    def load_state_dict(self, sd, prefix="", xp=np):
        """Restore what state_dict gave onto `xp`'s device; check_state_dict first."""
        fmt = sd[prefix + "fp8_format"]
        if fmt is None:
            self.recipe = self.fwd = self.bwd = self.device = self.fp8_format = None
            self.derived.clear()
            return
        fmt, length = Format[fmt], int(sd[prefix + "amax_history_len"])
        if (self.fwd is None or self.device != xp.__name__ or self.fp8_format is not fmt
                or self.fwd.amax_history.shape[0] != length):
            self._make(xp, fmt, length)  # (a made state of another recipe: check refuses)
        for d in ("fwd", "bwd"):
            meta = getattr(self, d)
            for name in META_ARRAYS:
                getattr(meta, name)[...] = xp.asarray(sd[f"{prefix}{d}.{name}"])


def mismatch(key, got, expected):
    return f"key {key!r}: got {got}, expected {expected}"


def check_array(sd, key, shape, dtype):
    """[] when sd[key] is an array of `shape` and `dtype`, else [the error]."""
    if key not in sd:
        return [mismatch(key, "missing", f"an array of shape {shape}, {dtype}")]
    a = sd[key]
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        return [mismatch(key, type(a).__name__, f"an array of shape {shape}, {dtype}")]
    errors = []
    if tuple(a.shape) != tuple(shape):
        errors.append(mismatch(key, f"shape {tuple(a.shape)}", f"shape {tuple(shape)}"))
    if a.dtype != dtype:
        errors.append(mismatch(key, f"dtype {a.dtype}", f"dtype {dtype}"))
    return errors


def update_backward(states):
    """The tape's after-backward hook of FP8 ops: the backward slots of every state the
    backward used, in one launch per group (Transformer Engine updates them after backward)."""
    update_states(states, "bwd")


def update_states(states, direction):
    """Update the `direction` ("fwd" or "bwd") metas of many states: one launch per group
    of metas that share a recipe, a device and a history length."""
    if len(states) == 1:  # (one module's autocast: no grouping; every step pays it)
        s = states[0]
        meta = getattr(s, direction)
        if meta is not None and s.recipe is not None:
            if s.amax_group is not None or s.autocast_group is not None:
                reduce_amaxes(states, direction)
            _update_group(s.recipe, [meta])
        return
    reduce_amaxes(states, direction)
    groups = {}
    for s in states:
        meta = getattr(s, direction)
        if meta is not None and s.recipe is not None:
            key = (id(s.recipe), s.device, meta.amax_history.shape[0])
            groups.setdefault(key, (s.recipe, []))[1].append(meta)
    for recipe, metas in groups.values():
        _update_group(recipe, metas)


def reduce_amaxes(states, direction):
    """Transformer Engine's amax reduction (reduce_amax=True): this step's amaxes (row 0 of
    the `direction` histories) of the states with a group (the fp8_group of the autocast
    they were used in, else their amax_group) are maxed over that group,
    one call per group for all its states (all_reduce_many, in place on each history's row
    0: one NCCL group, one launch, as TE's one fused buffer), before the update;
    every rank then computes the same scales. Every rank of a group must update the same
    states in the same order (they do: the same modules run on every rank). Nothing is done
    (and nothing launched) for states without a group, or whose recipe says reduce_amax=False."""
    by_group = {}
    for s in states:
        group = s.autocast_group if s.autocast_group is not None else s.amax_group
        meta = getattr(s, direction)
        if (group is not None and meta is not None and s.recipe is not None
                and s.recipe.reduce_amax):
            by_group.setdefault(id(group), (group, []))[1].append(meta.amax_history)
    for group, hists in by_group.values():  # (row 0 of a history: contiguous, in place)
        group.all_reduce_many([h[0] for h in hists], "max")


def _update_group(recipe, metas):
    """The update of metas of one recipe, device and history length: one launch (the fused
    kernel), or per meta for a user's callables."""
    algo = recipe.amax_compute_algo
    if callable(algo) or recipe.scaling_factor_compute_algo is not None:
        for m in metas:
            _update_custom(m, recipe)
    else:
        backends.dispatch("delayed_scaling_update", metas, algo, recipe.margin)


def _custom_result(what, value, xp, n):
    """A user callable's amax or scale as float32 [n], or a clear error (before any change)."""
    out = xp.asarray(value, dtype=np.float32)
    if out.shape != (n,):
        raise ValueError(f"DelayedScaling: {what} returned shape {tuple(out.shape)}, expected "
                         f"({n},) (one value per FP8 slot)")
    return out


def _update_custom(meta, recipe):
    """Transformer Engine's unfused path, used for callables: always rolls the history.
    Everything is computed before anything is written: a callable that raises (or returns
    a wrong shape) leaves the state as it was."""
    h = meta.amax_history
    xp, n = xp_of(h), h.shape[1]
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = _custom_result("amax_compute_algo", algo(h), xp, n)
    elif algo == "max":
        amax = h.max(axis=0)
    else:
        amax = h[0].copy()
    if recipe.scaling_factor_compute_algo is not None:
        scale = _custom_result("scaling_factor_compute_algo", recipe.scaling_factor_compute_algo(
            amax, meta.scale.copy(), meta.fp8_max, recipe), xp, n)
    else:
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            sf = scaled_max(meta.fp8_max, recipe.margin) / amax
        sf = xp.where(amax > 0, sf, meta.scale)
        sf = xp.where(xp.isfinite(amax), sf, meta.scale)
        scale = xp.where(xp.isinf(sf), np.float32(FLT_MAX), sf).astype(np.float32)
    h[...] = xp.roll(h, -1, axis=0)
    h[0] = 0
    meta.scale[...] = scale
    backends.dispatch("fp8_scale_inv", meta.scale, meta.scale_inv)
