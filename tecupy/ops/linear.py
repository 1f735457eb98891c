"""linear: y = x @ weight.T + bias, in high precision or (under fp8_autocast) FP8.

FP8 path (Transformer Engine's): x and weight are cast to the forward format (E4M3), the
GEMM accumulates in float32 and applies scale_inv_x * scale_inv_w; in backward dy is cast
to the backward format (E5M2 under HYBRID), dgrad = dy8 @ w8 and wgrad = dy8.T @ x8 use the
transposed FP8 copies, dbias = sum(dy) in high precision. The casts are the quantizers of
the recipe in force (quantization.py): slots of the caller's FP8State under delayed
scaling, each tensor's own amax with no state or under Float8CurrentScaling.

residual: y = linear(x) + residual (the residual connection). In FP8 the add runs in the
GEMM's epilogue (every FP8 GEMM op takes residual=) where the input's quantizer says so
(residual_epilogue) and the residual has y's shape, dtype and array type, contiguous (issue
21: no add kernel, no [M, N] pass); the epilogue rounds as the GEMM then the add op do, so
the result is the same bits. Its gradient is dy.
Elsewhere (high precision, broadcast residuals) the op runs linear, then add.
"""
import threading

from .. import _array, _check, backends
from .._array import FLOAT_SET, array_module, check_float, check_shape
from ..fp8 import bound_cast, bound_cast_pair
from ..fp8_params import FP8Weight, check_qweight, hp, weight_fp8
from ..inspect import ACTIVE_INSPECTOR
from ..fp8_state import FP8State
from ..quantization import gemm_quantizers
from ..tape import keeping, record, retaining
from .elementwise import add

FP8_ALIGN = 16
# The residual add in the FP8 GEMM's epilogue (linear's and layernorm_mlp's residual); off:
# the GEMM, then the add op (the same bits: the GPU tests and the bench compare the two)
RESIDUAL_EPILOGUE = True


def check_fp8_dims(op, m, n, k):
    if not (m % FP8_ALIGN or n % FP8_ALIGN or k % FP8_ALIGN):
        return
    bad = {name: v for name, v in (("M", m), ("N", n), ("K", k)) if v % FP8_ALIGN}
    if bad:
        raise ValueError(
            f"{op}: FP8 GEMM needs M (the product of x's leading dims), N (out features) and "
            f"K (in features) to be multiples of {FP8_ALIGN} (Transformer Engine's rule, plus "
            f"16-byte rows for wgrad's transposed FP8 copies); got M={m}, N={n}, K={k}")


def fp8_gemm(qa, qb, out_dtype, bias=None, split_accumulator=False, residual=None,
             **epilogue):
    """qa [M, K] @ qb [N, K].T for FP8Tensors -> [M, N] in out_dtype. split_accumulator:
    accumulate in float32 rather than the tensor cores' faster, shorter accumulator
    (Transformer Engine: off for the forward GEMM, on for dgrad and wgrad). residual: [M, N]
    added in the epilogue (fusable_residual's). epilogue: the GEMM op's other epilogue options
    (dgelu_aux)."""
    if qa.gemm_op != qb.gemm_op:  # (a per-tensor GEMM would read one of the blocks' scales)
        raise TypeError(f"fp8_gemm: qa and qb must be of one scaling (both per tensor or both "
                        f"per block), got {type(qa).__name__} and {type(qb).__name__}")
    if residual is not None:
        epilogue["residual"] = residual
    return backends.dispatch(qa.gemm_op, qa.data, qa.fmt, qa.scale_inv, qb.data, qb.fmt,
                             qb.scale_inv, out_dtype, bias,
                             split_accumulator=split_accumulator, **epilogue)


def _check_args(op, x, weight, bias):
    xp = array_module(op, x=x, weight=weight, bias=bias)
    if _plain(x, weight, bias):
        return xp
    for name, a in (("x", x), ("weight", weight)):
        if a is None:
            _check.fail(op, name, "an array", None, TypeError)
    check_float(op, x=x, weight=weight, bias=bias)
    if x.ndim < 1:
        _check.fail(op, "x", "an array [..., in_features] of at least 1 dimension", x)
    check_shape(op, "weight", weight, (None, x.shape[-1]))
    check_shape(op, "bias", bias, (weight.shape[0],))
    return xp


def _plain(x, weight, bias):
    """The common case of linear's arguments, in a few comparisons (the full checks below
    cost several us per call): x [..., K] and weight [N, K] of one floating dtype, bias [N] or None
    of it too (the array module is checked before)."""
    if x is None or weight is None:
        return False
    dt = x.dtype
    return (dt in FLOAT_SET and weight.dtype == dt and x.ndim >= 1 and weight.ndim == 2
            and weight.shape[1] == x.shape[-1]
            and (bias is None or (bias.dtype == dt and bias.shape == (weight.shape[0],))))


def check_fp8_state(op, fp8_state, gemm_index, num_gemms=1):
    """fp8_state is None or an FP8State of at least `num_gemms` GEMMs; gemm_index one of
    them (an IndexError deep in the state otherwise)."""
    if fp8_state is None or (type(fp8_state) is FP8State and type(gemm_index) is int
                             and num_gemms <= fp8_state.num_gemms
                             and 0 <= gemm_index < fp8_state.num_gemms):
        return  # (the common case, in a few comparisons)
    if not isinstance(fp8_state, FP8State):
        _check.fail(op, "fp8_state", "None or a tecupy.FP8State", fp8_state, TypeError)
    if fp8_state.num_gemms < num_gemms:
        _check.fail(op, "fp8_state", f"an FP8State of at least {num_gemms} GEMMs "
                    f"(FP8State(num_gemms={num_gemms}))", fp8_state)
    _check.integer(op, "gemm_index", gemm_index, 0, fp8_state.num_gemms)


def linear(x, weight, bias=None, fp8_state=None, gemm_index=0, residual=None,
           qweight=None):
    """y = x @ weight.T + bias (+ residual). x [..., in], weight [out, in], bias [out] or
    None, residual None or an array that adds to y (y's shape: in the FP8 GEMM's epilogue).

    Under fp8_autocast the GEMMs run in FP8 with scales from `fp8_state` (an FP8State;
    `gemm_index` picks its GEMM) or, when none is given, per-tensor current scaling.
    qweight: None, or the FP8Tensor of `weight` made earlier (with its transposed copy) that
    the GEMMs read instead of casting weight (nn.Linear's is_first_microbatch=False: no cast,
    no amax of the weight); the gradient still goes to `weight`. Ignored outside FP8."""
    xp = _check_args("linear", x, weight, bias)
    check_fp8_state("linear", fp8_state, gemm_index)
    check_qweight("linear", "qweight", qweight, weight)
    return linear_with(x, weight, bias, gemm_quantizers(fp8_state, gemm_index, xp),
                       residual, qweight)


def linear_with(x, weight, bias, q, residual=None, qweight=None):
    """linear with its GEMM's quantizers `q` (quantization.GemmQuantizers), high precision
    where q is None (FP8 off), + residual (None: none); qweight: linear's. Arguments checked
    by the caller."""
    if q is None:
        y = _linear_hp(x, weight, bias)
        return y if residual is None else add(y, residual)
    return _linear_fp8(x, weight, bias, q, residual, qweight)


def fusable_residual(residual, like, shape):
    """residual as [M, N] (N = shape[-1]) for an FP8 GEMM's epilogue, or None (none, or
    the switch is off, or it is not of `shape`, of like's dtype and array type, contiguous:
    linear then add)."""
    if (residual is None or not RESIDUAL_EPILOGUE or type(residual) is not type(like)
            or residual.dtype != like.dtype or residual.shape != shape
            or not residual.flags.c_contiguous):
        return None
    return as_2d(residual, residual.size // shape[-1], shape[-1])




def _dbias(dy2, bias):
    if bias is None:
        return None
    return backends.dispatch("bias_grad", dy2, bias.dtype)


def _linear_hp(x, weight, bias):
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    w = hp(weight)  # (an FP8 weight outside fp8_autocast: its dequantized value)
    y = backends.dispatch("gemm", x2, w, x.dtype, bias).reshape(x.shape[:-1] + (n,))

    def backward(dy):
        dy2 = dy.reshape(-1, n)
        dx = backends.dispatch("gemm", dy2, w, x.dtype, None, trans_b=False)
        dw = backends.dispatch("gemm", dy2.T, x2, weight.dtype, None, trans_b=False)
        db = _dbias(dy2, bias)
        return dx.reshape(x.shape), dw, db
    record(backward, (x, weight, bias), (y,))
    return y


def _linear_fp8(x, weight, bias, q, residual=None, qweight=None):
    n, k = weight.shape
    m = x.size // k
    check_fp8_dims("linear", m, n, k)
    tr = keeping()  # the backward needs the transposed FP8 copies (none in a checkpoint)
    x2 = as_2d(x, m, k)
    r2 = (fusable_residual(residual, x, x.shape[:-1] + (n,)) if q.input.residual_epilogue
          else None)
    key = _kept_key(x2, weight, bias, q, r2, qweight) if tr and KEPT else None
    got = None if key is None else _kept_forward(key, x2, weight, bias, q, r2, qweight)
    if got is None:
        qx = q.input.quantize(x2, transpose=tr)
        qw = weight_fp8(q.weight, weight, tr, qweight)
        y2 = fp8_gemm(qx, qw, x.dtype, bias, residual=r2)
        if key is not None and key not in _kept:
            if len(_kept) > 1024:  # many shapes: start over rather than grow
                _kept.clear()
            _kept[key] = _kept_plan(x2, weight, bias, q, qx, qw, r2, qweight)
    else:
        qx, qw, y2 = got
    fused = r2 is not None
    del r2
    y = as_nd(y2, x.shape[:-1] + (n,))
    if not tr:
        return y if residual is None or fused else add(y, residual)

    x_shape, x_dtype = x.shape, x.dtype  # the backward keeps the FP8 codes, not x
    saved = [qx.columnwise(), qw.columnwise()]  # and of those, the column-wise copies

    def backward(dy):  # (dy is the gradient of the residual the epilogue added)
        dx, dw, db = fp8_linear_backward(as_2d(dy, m, n), saved, bias, q.grad_output, x_dtype)
        return (as_nd(dx, x_shape), dw, db) + ((dy,) if fused else ())
    record(backward, (x, weight, bias) + ((residual,) if fused else ()), (y,),
           after_backward=q.after_backward, once=q.once)
    return y if residual is None or fused else add(y, residual)


# ---- the kept plan of the common case (issue 21: host time per FP8 linear) ---------------
# A forward whose quantizers cast with a known scale (fused_ok: the producers' contract of
# quantization.py, a cast with q.scale maxing into q.amax_out), on a CuPy x, under a Tape,
# no FP8Inspector: the implementations dispatch chose at the first such call (the casts'
# bound launches, fp8.bound_cast; the GEMM's function, chosen for that call's codes) are
# kept per key of everything their choice read (shapes, dtypes, array types, the
# quantizers, the device, backends.token()): the same kernels, arguments and allocations
# as the general path, without dispatch, supports() and the wrappers' checks per call.
# KEPT off: the general path always (A/B, tests).
# A given qweight (a module's kept FP8 weight, is_first_microbatch=False) is keyed apart: its
# plan casts x only and reads the given codes (no weight cast, no amax of the weight).
# KEPT_PAIR: the plan casts x and the weight in one launch (cast_transpose_pair; the same
# codes), where both are cast, of one dtype and format, in whole tiles.
KEPT = True
KEPT_PAIR = True
_kept = {}  # key -> (cast x, cast w or None: given or FP8 weight codes, GEMM fn, holds,
#                   cast both or None, (device, x's shape, the weight's) of held rows)

# The forward's row-wise codes (x's, and the weight's where it is cast) die once the forward
# GEMM has read them: the backward keeps the column-wise copies. An eager kept plan casts them
# into arrays held per thread, stream, device and shapes (shared by the linears of those)
# instead of fresh ones: two pool allocations and frees less per call (issue 21, ~4 us each
# on the lent hosts). A stream's next cast is ordered after the GEMM that read them, the rule
# CuPy's pool keeps for a freed block. Held only where both fit in HELD_ROWS_BYTES (host-bound
# sizes: larger GEMMs take longer on the GPU than their host side, and held codes would raise
# the step's peak, issue 22), HELD_ROWS_TOTAL per thread; never while a stream captures (a
# graph's replays may run beside other work). 0: fresh arrays always (A/B, tests).
HELD_ROWS_BYTES = 32 << 20
HELD_ROWS_TOTAL = 64 << 20
_held = threading.local()  # .rows: (stream, plan's held) -> arrays; .bytes: their total


def _kept_key(x2, weight, bias, q, r2, qweight=None):
    """Everything the kept choices read, or None where the common case cannot apply. r2:
    the residual (fusable_residual's: of y's shape, dtype, array type, contiguous) or None;
    qweight: linear's (given or not: a plan without the weight's cast)."""
    if not _array.is_cupy(x2) or ACTIVE_INSPECTOR.get() is not None:
        return None  # (NumPy: the reference runs; no device to ask)
    return (id(q.input), id(q.weight), type(x2), x2.shape, x2.dtype, type(weight),
            weight.shape, None if bias is None else (type(bias), bias.dtype),
            backends.token(), _array.cupy.cuda.runtime.getDevice(),
            None if r2 is None else r2.data.ptr % 16,
            None if qweight is None else type(qweight))


def _kept_forward(key, x2, weight, bias, q, r2=None, qweight=None):
    """(qx, qw, y2) by the kept plan of `key`, or None: no plan (yet, or for good), or the
    plan failed (the general path then runs, with dispatch's fallback; a cast run again
    maxes the same amax again: no change)."""
    plan = _kept.get(key)
    if not plan:
        return None
    cast_x, cast_w, gemm, _, pair, held = plan
    try:
        rows = _NO_ROWS if held is None else _held_rows(held)
        if pair is not None:
            qx, qw = pair(x2, weight, *rows)
        else:
            qx = cast_x(x2, rows[0])
            qw = (qweight if qweight is not None else weight.fp8() if cast_w is None
                  else cast_w(weight, rows[1]))
        more = {} if r2 is None else {"residual": r2}  # (a plan with r2 has an op taking it)
        return qx, qw, gemm(qx.data, qx.fmt, qx.scale_inv, qw.data, qw.fmt, qw.scale_inv,
                            x2.dtype, bias, split_accumulator=False, **more)  # (fp8_gemm's)
    except (TypeError, ValueError):
        raise
    except Exception:
        _kept[key] = False
        return None


def _kept_plan(x2, weight, bias, q, qx, qw, r2=None, qweight=None):
    """The plan of _kept_forward for inputs like these, from this call's (general path)
    codes qx and qw, or False (not the common case). r2: the residual the GEMM's epilogue
    added (fusable_residual's) or None; qweight given: no weight cast in the plan."""
    no_cast = qweight is not None or isinstance(weight, FP8Weight)
    cast = [(x2, q.input)] + ([] if no_cast else [(weight, q.weight)])
    if not all(getattr(t, "fused_ok", False) for _, t in cast):
        return False
    casts = [bound_cast(a, t.scale, t.fmt, t.amax_out) for a, t in cast] + [None]
    # the GEMM chosen for codes as the casts make them (fresh: contiguous, aligned)
    more = {} if r2 is None else {"residual": r2}
    impl = backends.choose(qx.gemm_op, qx.data, qx.fmt, qx.scale_inv, qw.data, qw.fmt,
                           qw.scale_inv, x2.dtype, bias, **more)
    if not all(casts[:len(cast)]) or impl is None or impl.failure is not None:
        return False
    pair = bound_cast_pair(x2, q.input, weight, q.weight) if KEPT_PAIR and not no_cast else None
    shapes = (x2.shape, None if no_cast else weight.shape)
    size = sum(a * b for a, b in filter(None, shapes))  # (uint8 codes)
    # (the plan's device is part of the held arrays' key: every device's null stream is 0)
    held = ((_array.cupy.cuda.runtime.getDevice(),) + shapes
            if size <= min(HELD_ROWS_BYTES, HELD_ROWS_TOTAL) else None)
    return casts[0], casts[1], impl.fn, (q.input, q.weight), pair, held


_NO_ROWS = (None, None)


def _held_rows(held):
    """The held arrays (x's rows, the weight's rows or None) of held = (device, x's shape,
    the weight's or None) for this thread's current stream, made at its first call; (None,
    None) while the stream captures."""
    stream = _array.cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return _NO_ROWS
    key = (stream.ptr, held)
    rows = getattr(_held, "rows", None)
    got = None if rows is None else rows.get(key)
    if got is None:
        shapes = held[1:]
        size = sum(a * b for a, b in filter(None, shapes))
        if rows is None or _held.bytes + size > HELD_ROWS_TOTAL:
            # (dropping the others is safe: CuPy's pool reuses a freed block on its own
            # stream only, after the GEMMs queued there)
            rows = _held.rows = {}
            _held.bytes = 0
        empty = _array.cupy.empty
        got = rows[key] = tuple(None if s is None else empty(s, "uint8") for s in shapes)
        _held.bytes += size
    return got


def as_2d(a, m, k):
    """a as [m, k]: itself where it is 2-D already (a CuPy reshape, a view, costs ~3-5 us
    of host time even when the shape does not change)."""
    return a if a.ndim == 2 else a.reshape(m, k)


def as_nd(a, shape):
    """a (2-D) in `shape`, itself where that is its shape."""
    return a if len(shape) == 2 else a.reshape(shape)


def fp8_linear_backward(dy2, saved, bias, q_dy, x_dtype, dgelu=None):
    """dy2 [M, N] -> (dx [M, K], dw [N, K], dbias) from saved = [qx_t, qw_t], the column-wise
    FP8 copies of x ([K, M]) and w ([K, N]), taken out of the list (unless the tape is
    retaining the graph for another backward):
    dy cast by the quantizer q_dy to the backward format (with its transposed copy and,
    with a bias, dbias from the same read of dy), wgrad = dy8.T @ x8 first, then x's copy
    dies and dgrad = dy8 @ w8 (issue 22: x's copy is the activation's, often the largest
    operand; dgrad's output the largest result: they need not live at once). dgelu:
    (h, bias, in_place) of a gelu that made x, whose backward dgrad's epilogue then applies
    (dx is gelu's input gradient; written over h where in_place)."""
    qdy, db = fp8_dy(q_dy, dy2, bias)
    held = [qdy]
    del qdy
    dx, dw = fp8_grads(held, saved, x_dtype, dgelu)
    return dx, dw, db


def fp8_dy(q_dy, dy2, bias):
    """dy2 cast by q_dy with its transposed copy, and dbias (None without a bias) from the
    same read -> (FP8Tensor, dbias)."""
    qdy = q_dy.quantize(dy2, transpose=True, dbias_dtype=None if bias is None else bias.dtype)
    return (qdy, None) if bias is None else qdy


def fp8_grads(held, saved, x_dtype, dgelu=None):
    """(dx, dw) of fp8_linear_backward from held = [dy's FP8 tensor, with its transposed
    copy], taken out of the list: the copy dies once wgrad has read it, before dgrad
    allocates (issue 22: [M, N] bytes less at dgrad; fc1's dh copy is 128 MiB at the
    quickstart layer)."""
    qx_t, qw_t = saved
    if not retaining():
        saved.clear()
    qdy = held.pop()
    dw = fp8_gemm(qdy.T, qx_t, x_dtype, split_accumulator=True)  # [N, M] x [K, M]^T
    del qx_t
    qdy = qdy.rowwise()
    if dgelu is None:
        dx = fp8_gemm(qdy, qw_t, x_dtype, split_accumulator=True)  # [M, N] x [K, N]^T
    else:
        h, bias, in_place = dgelu
        dx = fp8_gemm(qdy, qw_t, x_dtype, bias, split_accumulator=True, dgelu_aux=h,
                      out=h if in_place else None)
    return dx, dw
