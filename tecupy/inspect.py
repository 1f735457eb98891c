"""FP8Inspector: what every FP8 cast does to its tensor, per step (Transformer Engine's
LogFp8TensorStats, for tecupy's quantizers).

    with FP8Inspector(model) as ins:
        for batch in data:
            ...                 # forward + backward under fp8_autocast
            ins.step()          # one host read of this step's numbers
    ins.to_dict()["fc1.gemm0.input"]["underflow"]    # numpy array over steps

While active (in this thread or context: the inspector is a contextvar), every FP8 cast
calls it: the quantizers' (quantization.py: DelayedQuantizer / CurrentQuantizer .quantize,
and .wrap for producer-fused casts), the fused activation-backward cast (fp8.dact_cast:
LayerNormMLP's dGELU + cast of fc1's grad_output) and direct calls of tecupy.quantize (also
fp8.quantize_current, FP8State.quantize_fwd / _bwd). Each record is one pass over the cast's
input and its codes (backend op inspect_cast: cuda/inspect.cu on CuPy, 3 bytes read per bf16
element; a cast counted from its codes, inspect_codes: 1 byte), adding into a row of this
step's int64 accumulator on the tensor's device (current scaling first recomputes the scale
from x's amax: one more read of x); nothing is read to the host until `step()` (or exit).
When none is active, a cast pays one contextvar read. Block scaling (Float8BlockScaling):
each BlockQuantizer cast's row-wise codes, with `scale` the smallest of its blocks' scales
(1 / max scale_inv: the block of the largest amax) and overflow counted against each
value's own block scale (inspect_block_cast: array ops, on the GPU too, a few passes over
x); the casts fused into an activation's kernel are counted from their codes (exact=True
does not recompute them). Not seen: the casts of FP8 weights
(fp8_params.py: the optimizer writes their codes with fp8.cast after its step; the forward
reads them without a cast).

Per tensor and step:
    amax       max |x| (NaN ignored), the max over the step's casts of that tensor
    scale      the scale the cast used (the last cast's)
    underflow  nonzero, non-NaN values whose FP8 code is +-0, over the nonzero non-NaN values
    overflow   non-NaN values with |float32(x) * scale| > the format's max (saturated to
               +-max, inf included), over the non-NaN values
    rel_error  ||dequantize(cast(x)) - x|| / ||x|| (L2, float64, finite x only) on a strided
               sample of at most `sample` elements (all of them with exact=True)
    numel      elements cast
Producer-fused casts never show their high-precision input: a norm or activation kernel
writing FP8 itself (quantizer.wrap), and dact_cast, whose dx = dy * f'(h + b) exists only
inside its kernel. They are counted from their codes (`counted_from[label] == "codes"`):
amax is the slot's amax history row 0 at that point (the producer maxed its output's amax
into it), underflow the fraction of non-NaN codes that are +-0 (flushed values and true
zeros alike: an upper bound of the flushed fraction), overflow the fraction at +-max
(saturated values and values that round to max: an upper bound), rel_error NaN. With
exact=True, dact_cast is counted exactly instead: the inspector recomputes dx with the
activation's backward kernel (<name>_bwd, dx rounded to dy's dtype as dact_cast rounds it
before its cast) in one extra pass and one [rows, cols] temporary, and records it as any
cast with its input (`counted_from` "input").

CUDA graphs: a graph's replays run no Python, so no inspector can count them. A cast made
while a CUDA graph is being recorded (make_graphed_step, or a CuPy stream recording one)
with an inspector active raises a RuntimeError saying so; inspect eager steps, and make the
graph outside the `with`. (Replays of a graph made outside are not seen.)

Labels: "<module path>.gemm<g>.<tensor>" ("fc1.gemm0.input"; the root module's own state
gives "gemm0.input") for delayed scaling with a state inside `modules`; with modules=None,
states not named there are "state<k>", in order of first cast. Current scaling has no state:
"current<n>.<tensor>", n the order of that tensor's casts within the step; block scaling
likewise "block<n>.<tensor>" (modules=None only). A direct
tecupy.quantize call has no module nor tensor role: "quantize<n>", n its order within the step;
a dact_cast whose amax slot is no quantizer's: "dact_cast<n>". These three are recorded only
with modules=None ("every cast"), whatever `tensors` says for direct casts.
"""
import contextlib
import contextvars
import csv
import math
import warnings

import numpy as np

from . import _check, backends
from ._array import to_numpy, xp_of
from .fp8 import current_scale
from .fp8 import amax as _amax

# The inspector the quantizers report to (None: off). A contextvar, as the autocast stack:
# another thread, or an asyncio task started outside the `with`, is not inspected.
ACTIVE_INSPECTOR = contextvars.ContextVar("tecupy_fp8_inspector", default=None)

TENSORS = ("input", "weight", "grad_output")
FIELDS = ("amax", "scale", "underflow", "overflow", "rel_error", "numel")
_OP = "FP8Inspector"
# a record on the device (int64 words; float64 bits for amax, scale and the sums): amax,
# scale, nonzero, flushed, non-NaN, saturated, err^2, ref^2 (cuda/inspect.cu)
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
        self._pending = []    # this step: (label, _Records, row, numel)
        self._acc = {}        # this step: (array module, device) -> _Records being filled
        self.counted_from = {}  # label -> "input" / "codes" (producer-fused) / "input+codes"
        self._seen = {}       # this step's casts per kind (the n of current<n>, quantize<n>)
        self._token = None
        self._warned = False  # (a stateless recipe's cast seen with modules given)

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

    # ---- the casts' hooks ------------------------------------------------------------------
    def record(self, quantizer, x, out):
        """A quantizer's cast (quantization._inspected): x its high-precision input, None for
        a producer-fused cast (quantizer.wrap: counted from its codes); out the FP8Tensor
        (or (FP8Tensor, dbias))."""
        t = out[0] if isinstance(out, tuple) else out
        _refuse_graph(xp_of(t.data))
        label = self._label(quantizer)
        if label is None:
            return
        if getattr(t, "block_dim", None) is not None:  # block scaling: a scale per block
            self._block(label, x, t)
        elif x is None:
            self._codes(label, t, quantizer.scale, quantizer.amax_out)
        else:
            self._cast(label, x, t, quantizer.scale, self.exact)

    def record_dact(self, t, scale, amax_out, make_dx):
        """fp8.dact_cast's cast t (with the `scale` and amax slot `amax_out` it was given) of
        dx, which is not in memory: counted from the codes, or with exact=True on the dx
        that make_dx() recomputes (one extra pass)."""
        from .quantization import quantizer_of
        _refuse_graph(xp_of(t.data))
        q = quantizer_of(amax_out)
        label = self._direct_label("dact_cast") if q is None else self._label(q)
        if label is None:
            return
        if self.exact:
            self._cast(label, make_dx(), t, scale, True)
        else:
            self._codes(label, t, scale, amax_out)

    def record_quantize(self, x, t, scale):
        """A direct fp8.quantize (tecupy.quantize) of x into t with `scale` (float32 (1,))."""
        _refuse_graph(xp_of(t.data))
        label = self._direct_label("quantize")
        if label is not None:
            self._cast(label, x, t, scale, self.exact)

    def _cast(self, label, x, t, scale, exact):
        """The record of one cast of x with `scale` (float32 (1,); None: current scaling's,
        from x's amax) into t: one pass over x and its codes (kernels/inspect.py), the
        round-trip error over a strided sample of at most self.sample elements unless
        exact."""
        if scale is None:  # current scaling computed it from this same amax: the same value
            scale = current_scale(_amax(x), t.fmt)
        rec, row = self._row(t.data)
        stride = 1 if exact else -(-x.size // self.sample)
        backends.dispatch("inspect_cast", x, t.data, t.fmt, scale, t.scale_inv, rec.buf, row,
                          stride)
        self._add(label, t, rec, row, "input")

    def _block(self, label, x, t):
        """The record of a block cast t (FP8BlockTensor) of x (None: fused into an
        activation's kernel, counted from its codes with amax NaN): as _cast, with scale the
        smallest of the blocks' (inspect_block_cast)."""
        if x is None:
            scale = (1.0 / t.scale_inv.max().astype(np.float64)).astype(np.float32)
            self._codes(label, t, xp_of(t.data).asarray(scale).reshape(1), None)
            return
        rec, row = self._row(t.data)
        stride = 1 if self.exact else -(-x.size // self.sample)
        backends.dispatch("inspect_block_cast", x, t.data, t.fmt, t.scale_inv, rec.buf, row,
                          stride)
        self._add(label, t, rec, row, "input")

    def _codes(self, label, t, scale, amax_out):
        """The record of a producer-fused cast t from its codes alone: amax the slot's
        amax_out so far (NaN without one), the scale, non-NaN codes (as nonzero and as
        valid), +-0 codes (as flushed), +-max codes (as saturated); rel_error NaN."""
        rec, row = self._row(t.data)
        backends.dispatch("inspect_codes", t.data, t.fmt, scale, amax_out, rec.buf, row)
        self._add(label, t, rec, row, "codes")

    def _row(self, data):
        """(this step's _Records on data's device, a fresh row of it)."""
        xp = xp_of(data)
        key = (xp, None if xp is np else data.device.id)
        rec = self._acc.get(key)
        if rec is None or rec.used == len(rec.buf):
            rec = self._acc[key] = _Records(xp, key[1])
        rec.used += 1
        return rec, rec.used - 1

    def _add(self, label, t, rec, row, counted_from):
        self.formats.setdefault(label, t.fmt.name)
        was = self.counted_from.setdefault(label, counted_from)
        if counted_from not in was.split("+"):
            self.counted_from[label] = "input+codes"
        self._pending.append((label, rec, row, int(t.data.size)))

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
        """current<n>.<tensor> (block<n>.<tensor> under block scaling): a CurrentQuantizer
        (BlockQuantizer) is shared by every GEMM, so its tensor is found by identity among
        the ones quantization.py made, and n counts this step's."""
        from .quantization import BlockQuantizer, _block_gemms, _current_gemms
        if not self._all:
            if not self._warned:  # (else an inspector of a model records nothing, silently)
                self._warned = True
                warnings.warn(
                    "FP8Inspector(modules=...) records delayed scaling's casts only (their "
                    "FP8 states name the module); Float8CurrentScaling and Float8BlockScaling "
                    "keep no state per module: inspect them with FP8Inspector() (every cast, "
                    "labelled current<n>.<tensor> / block<n>.<tensor>)", stacklevel=4)
            return None
        block = isinstance(quantizer, BlockQuantizer)
        which = next((w for g in (_block_gemms if block else _current_gemms).values()
                      for w in TENSORS if getattr(g, w) is quantizer), None)
        if which not in self.tensors:
            return None
        kind = "block" if block else "current"
        return f"{kind}{self._count(kind + which)}.{which}"

    def _direct_label(self, kind):
        """<kind><n> for a cast of no quantizer (modules=None only), n its order this step."""
        return f"{kind}{self._count(kind)}" if self._all else None

    def _count(self, key):
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        return n

    # ---- reading back ---------------------------------------------------------------------
    def step(self):
        """End a step: read its records to the host (one copy per device and 64 casts)
        into a row."""
        chunks = {id(rec): rec for _, rec, _, _ in self._pending}
        for xp in {xp_of(rec.buf) for rec in chunks.values()}:
            _refuse_graph(xp)  # (the read below would sync inside the graph)
        pending, self._pending, self._seen, self._acc = self._pending, [], {}, {}
        host = {k: _decode(to_numpy(rec.buf[:rec.used])) for k, rec in chunks.items()}
        totals = {}
        for label, rec, row, numel in pending:
            _accumulate(totals, label, host[id(rec)][row], numel)
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
        """One line per (step, tensor) cast: step, tensor, format, counted_from ("input",
        "codes": a producer-fused cast), then FIELDS."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("step", "tensor", "format", "counted_from") + FIELDS)
            for s, row in enumerate(self._rows):
                for label, v in row.items():
                    w.writerow([s, label, self.formats[label], self.counted_from[label]]
                               + [repr(float(a)) for a in v])


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


class _Records:
    """This step's records on one device: int64 [RECORDS, _N_RECORD], zero until a cast's
    statistics are added into its row (cuda/inspect.cu describes the words); rows handed
    out in cast order, a new _Records when full."""
    __slots__ = ("buf", "used")
    RECORDS = 64

    def __init__(self, xp, device):
        if device is None:
            self.buf = xp.zeros((self.RECORDS, _N_RECORD), np.int64)
        else:
            with xp.cuda.Device(device):
                self.buf = xp.zeros((self.RECORDS, _N_RECORD), np.int64)
        self.used = 0


def _decode(words):
    """Records as read from the device (int64 [n, _N_RECORD]) -> float64 [n, _N_RECORD]:
    amax, scale and the two sums are float64 bits, the four counts integers."""
    out = words.view(np.float64).copy()
    out[:, 2:6] = words[:, 2:6]
    return out


def _in_graph(xp):
    """Whether a CUDA graph is being recorded on this thread's current stream (or by
    make_graphed_step, whatever the stream): CuPy's streamIsCapturing (a bool; a capture
    that an error invalidated raises CuPy's RuntimeError). xp: the data's array module
    (NumPy: never)."""
    from .graphs import capturing
    if capturing():
        return True
    if xp is np:
        return False
    return bool(xp.cuda.runtime.streamIsCapturing(xp.cuda.get_current_stream().ptr))


def _refuse_graph(xp):
    if _in_graph(xp):  # (worded without "captur": make_graphed_step passes it on as is)
        raise RuntimeError(
            "FP8Inspector: an FP8 cast inside a CUDA graph being recorded (make_graphed_step, "
            "or a CuPy stream recording a graph) while an FP8Inspector is active. A graph's "
            "replays run no Python, so the inspector cannot count them (and its per-step "
            "read would sync inside the graph). Make the graph outside the `with "
            "FP8Inspector(...)` block, and inspect eager steps of the same function")


@contextlib.contextmanager
def paused():
    """No inspector inside (casts that are not the user's: tecupy.plot's scale sweep)."""
    token = ACTIVE_INSPECTOR.set(None)
    try:
        yield
    finally:
        ACTIVE_INSPECTOR.reset(token)


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
