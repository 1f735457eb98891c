"""FP8Inspector: what every FP8 cast does to its tensor, per step (Transformer Engine's
LogFp8TensorStats, for tecupy's quantizers).

    with FP8Inspector(model) as ins:
        for batch in data:
            ...                 # forward + backward under fp8_autocast
            ins.step()          # one host read of this step's numbers
    ins.to_dict()["fc1.gemm0.input"]["underflow"]    # numpy array over steps

While active (in this thread or context: the inspector is a contextvar), every cast through a
quantizer (quantization.py: DelayedQuantizer / CurrentQuantizer .quantize, and .wrap for
producer-fused casts) calls `record`, which runs one extra pass over the tensor with array
ops on its own device and keeps a float64 vector there; nothing is read to the host until
`step()` (or exit). When none is active, a cast pays one contextvar read.

Per tensor and step:
    amax       max |x| (NaN ignored), the max over the step's casts of that tensor
    scale      the scale the cast used (the last cast's)
    underflow  nonzero, non-NaN values whose FP8 code is +-0, over the nonzero non-NaN values
    overflow   non-NaN values with |float32(x) * scale| > the format's max (saturated to
               +-max, inf included), over the non-NaN values
    rel_error  ||dequantize(cast(x)) - x|| / ||x|| (L2, float64, finite x only) on a strided
               sample of at most `sample` elements (all of them with exact=True)
    numel      elements cast
A producer-fused cast (a norm or activation kernel writing FP8 itself: quantizer.wrap) never
shows its high-precision output: amax (the slot's amax history row 0 at that point: the
producer maxed its output's amax into it) and scale only; underflow, overflow and rel_error
are NaN. Casts not made by a quantizer (fp8.quantize called directly, FP8State.quantize_fwd,
the fused dact_cast of layernorm_mlp's backward) are not seen.

Labels: "<module path>.gemm<g>.<tensor>" ("fc1.gemm0.input"; the root module's own state
gives "gemm0.input") for delayed scaling with a state inside `modules`; with modules=None,
states not named there are "state<k>", in order of first cast. Current scaling has no state:
"current<n>.<tensor>", n the order of that tensor's casts within the step (recorded only with
modules=None).
"""
import contextvars
import csv
import math

import numpy as np

from . import _check, backends
from ._array import to_numpy, xp_of
from .fp8 import amax as _amax
from .fp8 import current_scale

# The inspector the quantizers report to (None: off). A contextvar, as the autocast stack:
# another thread, or an asyncio task started outside the `with`, is not inspected.
ACTIVE_INSPECTOR = contextvars.ContextVar("tecupy_fp8_inspector", default=None)

TENSORS = ("input", "weight", "grad_output")
FIELDS = ("amax", "scale", "underflow", "overflow", "rel_error", "numel")
_OP = "FP8Inspector"
# a record on the device: amax, scale, nonzero, flushed, non-NaN, saturated, err^2, ref^2
_N_RECORD = 8


class FP8Inspector:
    """Context manager recording the FP8 casts of `modules` (None: every cast; a
    tecupy.nn.Module: the FP8 states inside it, labelled with their paths; a dict of
    name -> Module or FP8State) for the tensors named in `tensors`. exact=True measures
    rel_error on every element instead of a strided sample of `sample` elements."""

    def __init__(self, modules=None, tensors=TENSORS, exact=False, sample=65536):
        self._paths, self._all = _state_paths(modules), modules is None
        self.tensors = _check_tensors(tensors)
        self.exact = _check.flag(_OP, "exact", exact)
        self.sample = _check.integer(_OP, "sample", sample, low=1)
        self.formats = {}     # label -> "e4m3" / "e5m2"
        self._rows = []       # per finished step: {label: np.array(FIELDS)}
        self._pending = []    # this step: (label, device vector, numel)
        self._current_seen = {}
        self._token = None

    def __repr__(self):
        return f"FP8Inspector(steps={len(self._rows)}, tensors={len(self.formats)})"

    def __enter__(self):
        if self._token is not None:
            raise RuntimeError("FP8Inspector: this inspector is already active")
        self._token = ACTIVE_INSPECTOR.set(self)
        return self

    def __exit__(self, *exc):
        ACTIVE_INSPECTOR.reset(self._token)
        self._token = None
        if self._pending:
            self.step()
        return False

    # ---- the quantizers' hook -------------------------------------------------------------
    def record(self, quantizer, x, out):
        """Called by a quantizer after a cast: x the high-precision input (None for a
        producer-fused cast), out the FP8Tensor (or (FP8Tensor, dbias))."""
        label = self._label(quantizer)
        if label is None:
            return
        t = out[0] if isinstance(out, tuple) else out
        if x is None:
            vec = _fused_stats(quantizer)
        else:
            vec = _cast_stats(x, t, quantizer, self.exact, self.sample)
        self.formats.setdefault(label, t.fmt.name)
        self._pending.append((label, vec, int(t.data.size)))

    def _label(self, quantizer):
        site = getattr(quantizer, "site", None)
        if site is None:
            return self._current_label(quantizer)
        state_id, gemm, which = site
        if which not in self.tensors:
            return None
        path = self._paths.get(state_id)
        if path is None:
            if not self._all:
                return None
            path = self._paths[state_id] = f"state{len(self._paths)}."
        return f"{path}gemm{gemm}.{which}"

    def _current_label(self, quantizer):
        """current<n>.<tensor>: a CurrentQuantizer is shared by every GEMM, so its tensor is
        found by identity among the ones quantization.py made, and n counts this step's."""
        from .quantization import _current_gemms
        if not self._all:
            return None
        which = next((w for g in _current_gemms.values() for w in TENSORS
                      if getattr(g, w) is quantizer), None)
        if which not in self.tensors:
            return None
        n = self._current_seen.get(which, 0)
        self._current_seen[which] = n + 1
        return f"current{n}.{which}"

    # ---- reading back ---------------------------------------------------------------------
    def step(self):
        """End a step: read its records to the host (one copy per device) into a row."""
        pending, self._pending, self._current_seen = self._pending, [], {}
        by_xp = {}
        for label, vec, numel in pending:
            by_xp.setdefault(xp_of(vec), []).append((label, vec, numel))
        totals = {}
        for xp, recs in by_xp.items():
            host = to_numpy(xp.stack([v for _, v, _ in recs]))
            for (label, _, numel), h in zip(recs, host):
                _accumulate(totals, label, h, numel)
        self._rows.append({label: _finish(t) for label, t in totals.items()})

    @property
    def steps(self):
        return len(self._rows)

    @property
    def labels(self):
        return list(self.formats)

    def to_dict(self):
        """{label: {field: float64 numpy array over finished steps}} (NaN where the tensor
        was not cast in a step), fields as in FIELDS."""
        out = {}
        for label in self.formats:
            rows = np.array([r.get(label, np.full(len(FIELDS), np.nan)) for r in self._rows])
            rows = rows.reshape(len(self._rows), len(FIELDS))
            out[label] = {f: rows[:, k].copy() for k, f in enumerate(FIELDS)}
        return out

    def to_csv(self, path):
        """One line per (step, tensor) cast: step, tensor, format, then FIELDS."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("step", "tensor", "format") + FIELDS)
            for s, row in enumerate(self._rows):
                for label, v in row.items():
                    w.writerow([s, label, self.formats[label]] + [repr(float(a)) for a in v])


def _accumulate(totals, label, h, numel):
    """Several casts of one tensor in a step (micro-batches, recompute): max of amaxes, the
    last scale, sums of the counts and squares."""
    t = totals.get(label)
    if t is None:
        totals[label] = [h.copy(), numel]
        return
    t[0][0] = max(t[0][0], h[0])
    t[0][1] = h[1]
    t[0][2:] += h[2:]
    t[1] += numel


def _ratio(num, den):
    if math.isnan(num) or math.isnan(den):
        return math.nan
    return num / den if den > 0 else 0.0


def _finish(total):
    h, numel = total
    amax, scale, nonzero, flushed, valid, saturated, err2, ref2 = h
    return np.array([amax, scale, _ratio(flushed, nonzero), _ratio(saturated, valid),
                     math.sqrt(_ratio(err2, ref2)) if not math.isnan(err2) else math.nan,
                     numel], np.float64)


def _cast_stats(x, t, quantizer, exact, sample):
    """The record of one cast (float64 (_N_RECORD,) on x's device), in array ops."""
    xp, fmt = xp_of(x), t.fmt
    xf = x.reshape(-1)
    if xf.dtype not in (np.float32, np.float64):  # half types: exact in float32
        xf = xf.astype(np.float32)
    codes = t.data.reshape(-1)
    a = _amax(x)
    # current scaling computes its scale from this same amax: the same value, recomputed
    scale = quantizer.scale if quantizer.scale is not None else current_scale(a, fmt)
    valid = ~xp.isnan(xf)
    nonzero = valid & (xf != 0)
    flushed = nonzero & ((codes & 0x7F) == 0)  # +-0 codes of both formats
    with np.errstate(over="ignore", invalid="ignore"):  # as the cast: float32 product
        saturated = xp.abs(xf.astype(np.float32) * scale[0]) > np.float32(fmt.max)
    err2, ref2 = _round_trip(xf, codes, t, exact, sample)
    parts = (a[0], scale[0], nonzero.sum(), flushed.sum(), valid.sum(), saturated.sum(),
             err2, ref2)
    return xp.stack([xp.asarray(p, dtype=np.float64).reshape(()) for p in parts])


def _round_trip(xf, codes, t, exact, sample):
    """(sum of squared errors of the dequantized codes, sum of squares of x) over the finite
    elements of a fixed strided sample (every element when exact or small)."""
    xp = xp_of(xf)
    if not exact and xf.size > sample:
        stride = -(-xf.size // sample)  # ceil: at most `sample` elements
        xf, codes = xf[::stride], xp.ascontiguousarray(codes[::stride])
    deq = backends.dispatch("fp8_dequantize", codes, t.fmt, t.scale_inv, np.dtype(np.float32))
    ref = xf.astype(np.float64)
    finite = xp.isfinite(ref)
    ref = xp.where(finite, ref, 0.0)
    err = xp.where(finite, deq.astype(np.float64) - ref, 0.0)
    return (err * err).sum(), (ref * ref).sum()


def _fused_stats(quantizer):
    """A producer-fused cast: the slot's amax so far and the scale; the rest NaN."""
    xp = xp_of(quantizer.scale)
    head = xp.concatenate([quantizer.amax_out, quantizer.scale]).astype(np.float64)
    return xp.concatenate([head, xp.full((_N_RECORD - 2,), np.nan, np.float64)])


def _state_paths(modules):
    """{id(FP8State): label prefix} of the states in `modules` (None: {})."""
    from .fp8_state import FP8State
    from .nn.module import Module
    if modules is None:
        return {}
    if isinstance(modules, Module):
        modules = {"": modules}
    if not isinstance(modules, dict) or not all(
            isinstance(k, str) and isinstance(v, (Module, FP8State))
            for k, v in modules.items()):
        _check.fail(_OP, "modules", "None, a tecupy.nn.Module, or a dict of name -> Module "
                    "or FP8State", modules, TypeError)
    paths = {}
    for name, m in modules.items():
        name = name + "." if name else ""
        if isinstance(m, FP8State):
            paths[id(m)] = name
            continue
        for prefix, state in m._fp8_states():
            # "fc1.fp8_state." -> "fc1.": every module names its state fp8_state
            paths[id(state)] = name + prefix.removesuffix("fp8_state.")
    return paths


def _check_tensors(tensors):
    ok = isinstance(tensors, (tuple, list)) and len(tensors) > 0 and all(
        isinstance(t, str) and t in TENSORS for t in tensors)
    if not ok:
        _check.fail(_OP, "tensors", f"a non-empty tuple of names from {TENSORS}", tensors,
                    ValueError if isinstance(tensors, (tuple, list)) else TypeError)
    return tuple(tensors)
