"""CUDA cast to FP8 (with amax, also with its transpose) and dequantize: cuda/cast.cu.

scale_inv_out (float32, one element, or None): the casts write 1 / scale into it from the
kernel (IEEE division; CuPy's own 1 / scale flushes to 0 above 2^126), so an FP8Tensor's
scale_inv costs no launch of its own."""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from ..activation_table import TABLE
from .colsum import col_sum
from .dtypes import CTYPE, FP8TYPE, LOW_PRECISION, cbool, on_gpu, vec_width
from .launch import Launcher, current_device, grid_1d, planned, resident_blocks, sm_count
from .pools import amax_args, amax_grid
from .scaling import scale_inverse

FILE = "cast.cu"
_VECS = {"float": 4, "double": 2, "__half": 8, "__nv_bfloat16": 8}  # 16-byte loads
# CAST_WIDE: each thread converts two 16-byte vectors per step (two loads in flight, one
# 16-byte store of codes) where the size and a 32-byte aligned base allow (H200, bf16:
# 85 -> 86.6% of copy at 8192 x 4096, 84 -> 86% at 4096 x 8192; PERFLOG.md)
CAST_WIDE = True
loader.declare(FILE, [f"cast_to_fp8<{t}, {f}, {v}>" for t, f in itertools.product(
    CTYPE.values(), FP8TYPE.values()) for v in (1, _VECS[t], 2 * _VECS[t])]
    + [f"fp8_dequantize<{f}, {t}>" for t, f in itertools.product(CTYPE.values(),
                                                                 FP8TYPE.values())]
    + [f"cast_transpose_tiled<{CTYPE[d]}, {f}, 1, {b}, {r}>" for d in LOW_PRECISION
       for f in FP8TYPE.values() for b in ("false", "true") for r in ("false", "true")]
    + [f"cast_transpose_tiled<{CTYPE[d]}, {f}, 1, {b}, false, {a.cuda}>" for d in LOW_PRECISION
       for f in FP8TYPE.values() for b in ("false", "true") for a in TABLE.values()
       if not a.gated]
    + [f"cast_transpose_tiled<{CTYPE[d]}, {f}, 1, false, false, Fwd<{a.cuda}>>"
       for d in LOW_PRECISION for f in FP8TYPE.values() for a in TABLE.values() if not a.gated]
    + [f"cast_transpose_pair<{CTYPE[d]}, {f}>" for d in LOW_PRECISION for f in FP8TYPE.values()])


def scale_inv_arg(scale, scale_inv_out, n):
    """The kernels' scale_inv pointer: scale_inv_out, or nullptr where there is none. With
    no element to cast there is no cast launch: the inverse gets its own."""
    if scale_inv_out is None:
        return np.uint64(0)
    if not (is_cupy(scale_inv_out) and scale_inv_out.dtype == np.float32
            and scale_inv_out.size == 1):
        raise TypeError("scale_inv_out must be a float32 CuPy array of one element, got "
                        f"{type(scale_inv_out).__name__} {getattr(scale_inv_out, 'dtype', '')}")
    if not n:
        scale_inverse(scale, scale_inv_out)
    return scale_inv_out


@backends.register("cast_to_fp8", "cuda", supports=on_gpu)
def cast_to_fp8(x, scale, fmt, amax_out=None, scale_inv_out=None):
    import cupy
    x = cupy.ascontiguousarray(x)
    q = cupy.empty(x.shape, np.uint8)
    amax, slot = amax_args(amax_out, x.size)
    inv = scale_inv_arg(scale, scale_inv_out, x.size)
    if not x.size:
        return q, amax
    vec = vec_width(x.dtype, x.size)
    if CAST_WIDE and vec > 1 and x.size % (2 * vec) == 0 and x.data.ptr % 32 == 0:
        vec *= 2
    run, n = planned(_plans, (x.size, vec, x.dtype, fmt.name, current_device()), _cast_plan,
                     x.size, vec, x.dtype, fmt.name)
    run((x, scale, q, inv, amax, slot, n))
    return q, amax


_NULL = np.uint64(0)  # a null pointer argument


def _array_type():
    import cupy
    return cupy.ndarray


def _cast_plan(n, vec, dtype, fmt):
    """(the Launcher, n as the kernel's int64): kernel, grid and argument kinds fixed."""
    k = loader.function(FILE, f"cast_to_fp8<{CTYPE[dtype]}, {FP8TYPE[fmt]}, {vec}>")
    nd = _array_type()  # x, scale, q, inv (or null), amax, slot (or an array), n
    kinds = (nd, nd, nd, np.uint64, nd, np.uint64, np.int64)
    return Launcher(k, (amax_grid(k, n, vec),), (256,), kinds), np.int64(n)


@backends.register("fp8_dequantize", "cuda", supports=on_gpu)
def fp8_dequantize(data, fmt, scale_inv, dtype):
    import cupy
    data = cupy.ascontiguousarray(data)
    y = cupy.empty(data.shape, dtype)
    if data.size:
        kernel = loader.function(FILE, f"fp8_dequantize<{FP8TYPE[fmt.name]}, {CTYPE[y.dtype]}>")
        kernel((grid_1d(data.size),), (256,), (data, scale_inv, y, np.int64(data.size)))
    return y


def _ct_supported(x, scale, fmt, *args, **kwargs):
    return is_cupy(x) and x.dtype in LOW_PRECISION and x.ndim == 2


@backends.register("cast_transpose", "cuda", supports=_ct_supported)
def cast_transpose(x, scale, fmt, amax_out=None, scale_inv_out=None):
    import cupy
    x = cupy.ascontiguousarray(x)
    if _one_float(amax_out, cupy) and _one_float(scale_inv_out, cupy) and x.size:
        return _ct_given(x, scale, fmt, amax_out, scale_inv_out, cupy)
    return _cast_transpose(x, scale, fmt, None, amax_out, scale_inv_out)


_F32 = np.dtype(np.float32)


def _one_float(a, cupy):
    """a is a float32 CuPy array of one element (what amax_args and scale_inv_arg check, in the
    few comparisons of the common case; anything else takes their path and errors)."""
    return isinstance(a, cupy.ndarray) and a.dtype is _F32 and a.size == 1


def _ct_given(x, scale, fmt, amax_out, inv, cupy):
    """cast_transpose of contiguous x (not empty) with amax_out and scale_inv_out given and
    checked (the quantizers' casts, two per FP8 linear): the plan's arguments of the plain
    kernel (no activation, no dbias partials) come from the plan, ~1 us less per call."""
    rows, cols = x.shape
    q, qt = cupy.empty((rows, cols), np.uint8), cupy.empty((cols, rows), np.uint8)
    run, _, _, tail = planned(
        _plans, (rows, cols, x.dtype, fmt.name, False, None, current_device()), _ct_plan,
        rows, cols, x.dtype, fmt.name, False, None)
    run((x, scale, q, qt, inv, amax_out, _NULL, amax_out) + tail)
    return q, qt, amax_out


def _ct_bind(rows, cols, dtype, fmt):
    """cast_transpose of [rows, cols] arrays of `dtype` (rows * cols > 0) to `fmt`, its
    plan made now: cast(x, scale, amax_out, q=None) -> (q, qt, scale_inv), the three made
    here (q: given, a contiguous uint8 [rows, cols] array the codes are written into) and
    amax_out (a float32 CuPy array of one element) taken as it is (the caller checked it):
    an op's kept plan (ops/linear.py's common case), what cast_transpose does after its
    dispatch and checks."""
    import cupy
    run, _, _, tail = planned(_plans, (rows, cols, dtype, fmt.name, False, None, current_device()),
                              _ct_plan, rows, cols, dtype, fmt.name, False, None)

    off = -(-rows * cols // 256) * 256  # (scale_inv's place in a carved allocation)

    def cast(x, scale, amax_out, q=None):
        # (the row-wise codes first, as cast_transpose allocates them: they take the block
        # the last call's row-wise codes freed, where the transposed copy, alive until the
        # backward, would take it and move them: a new address, the GEMM's TMA descriptors
        # encoded again at every call)
        x = cupy.ascontiguousarray(x)
        if CARVE_SCALE_INV:
            q = cupy.empty((rows, cols), np.uint8) if q is None else q
            mem = cupy.cuda.alloc(off + 4)
            inv = cupy.ndarray((1,), np.float32, memptr=mem + off)
            qt = cupy.ndarray((cols, rows), np.uint8, memptr=mem)
        else:
            inv = cupy.empty((1,), np.float32)
            q = cupy.empty((rows, cols), np.uint8) if q is None else q
            qt = cupy.empty((cols, rows), np.uint8)
        run((x, scale, q, qt, inv, amax_out, _NULL, amax_out) + tail)
        return q, qt, inv
    return cast


def _ct_pair_bind(shape_a, shape_b, dtype, fmt):
    """Two bound casts (_ct_bind) in one launch (cast_transpose_pair: an FP8 linear's input
    and weight, one launch less per forward), its plan made now: pair(xa, scale_a, amax_a,
    xb, scale_b, amax_b, qa=None, qb=None) -> ((q, qt, scale_inv) of a, those of b), the
    same codes as two bound casts (qa, qb: given row-wise outputs, as _ct_bind's q); None
    where a shape is empty or not whole 16-row, 8-column tiles (the ragged kernel) or the
    scale_inv is carved."""
    if CARVE_SCALE_INV or not all(r * c and r % 16 == 0 and c % 8 == 0
                                  for r, c in (shape_a, shape_b)):
        return None
    import cupy
    (ra, ca), (rb, cb) = shape_a, shape_b
    run, tail_a, tail_b = planned(_plans, ("pair", shape_a, shape_b, dtype, fmt.name,
                                           current_device()), _pair_plan, shape_a, shape_b, dtype,
                                  fmt.name)

    def pair(xa, sa, amax_a, xb, sb, amax_b, qa=None, qb=None):
        xa, xb = cupy.ascontiguousarray(xa), cupy.ascontiguousarray(xb)
        # (each one's arrays in the order _ct_bind's cast makes them)
        inva = cupy.empty((1,), np.float32)
        qa = cupy.empty((ra, ca), np.uint8) if qa is None else qa
        qta, invb = cupy.empty((ca, ra), np.uint8), cupy.empty((1,), np.float32)
        qb = cupy.empty((rb, cb), np.uint8) if qb is None else qb
        qtb = cupy.empty((cb, rb), np.uint8)
        run((xa, sa, qa, qta, inva, amax_a) + tail_a + (xb, sb, qb, qtb, invb, amax_b)
            + tail_b)
        return (qa, qta, inva), (qb, qtb, invb)
    return pair


def _pair_plan(shape_a, shape_b, dtype, fmt):
    """(Launcher, a's rows and cols, b's rows, cols and a's block count) of
    cast_transpose_pair: each cast its own grid-stride blocks, as many as _ct_plan's."""
    k = loader.function(FILE, f"cast_transpose_pair<{CTYPE[dtype]}, {FP8TYPE[fmt]}>")
    most = sm_count() * resident_blocks(k, 256, 0)
    blocks = [min(-(-r // 128) * -(-c // 64), most) for r, c in (shape_a, shape_b)]
    nd, i32 = _array_type(), np.int32
    run = Launcher(k, (sum(blocks),), (256,), ((nd,) * 6 + (i32, i32)) * 2 + (i32,))
    return run, (i32(shape_a[0]), i32(shape_a[1])), (i32(shape_b[0]), i32(shape_b[1]),
                                                     i32(blocks[0]))


# The bound cast's scale_inv carved out of the transposed codes' allocation: the two live
# and die together (a linear's backward keeps both; the row-wise codes, which die after the
# forward GEMM, stay apart: issue 22), so one pool allocation (malloc and free) less per
# cast, for an array made on a given pointer. Off until timed on a GPU: CuPy's own costs
# decide (scripts/linear_host.py --parts --ab prints both and the A/B).
CARVE_SCALE_INV = False


cast_transpose.bind = _ct_bind  # (backends.choose's callers look for it on the function)
cast_transpose.bind_pair = _ct_pair_bind


@backends.register("cast_transpose_dbias", "cuda", supports=_ct_supported)
def cast_transpose_dbias(x, scale, fmt, dbias_dtype, amax_out=None, scale_inv_out=None):
    """cast_transpose, and dbias = the float32 column sums of x in dbias_dtype, from the
    same read of x (per 128-row block partials, then their sum)."""
    return _cast_transpose(x, scale, fmt, dbias_dtype, amax_out, scale_inv_out)


def _dact_supported(dy, x, bias, name, *args, out=None, **kwargs):
    """Plain activations, 2-D, rows % 16 and cols % 8 (the FP8 GEMMs' shapes: no ragged
    variant is built); x and out's q may be column chunks of wider arrays (rows apart by a
    multiple of 8 elements, 16-byte aligned), out's qt whole rows."""
    return (_ct_supported(dy, None, None) and not TABLE[name].gated and x.shape == dy.shape
            and x.dtype == dy.dtype and dy.shape[0] % 16 == 0 and dy.shape[1] % 8 == 0
            and (bias is None or bias.dtype == dy.dtype) and _rows_ok(x, 8)
            and (out is None or (_rows_ok(out[0], 8) and out[1].flags.c_contiguous)))


def _rows_ok(a, align):
    """a's rows are contiguous, `align`-element multiples apart, and start 16-byte aligned."""
    return (a.strides[-1] == a.itemsize and a.strides[0] % (align * a.itemsize) == 0
            and a.data.ptr % 16 == 0)


@backends.register("dact_cast_transpose", "cuda", supports=_dact_supported)
def dact_cast_transpose(dy, x, bias, name, scale, fmt, dbias_dtype=None, amax_out=None,
                        scale_inv_out=None, out=None):
    """The activation `name`'s backward, dx = dy * f'(x + bias) rounded to dy's dtype, cast
    and transposed in the same pass (cast_transpose_dbias of dx without dx in memory:
    Transformer Engine's cast_transpose_dbias_dgelu) -> (q, qt, amax, dbias or None).
    out: None or (q, qt) to write: q [rows, cols] and qt [cols, rows] may be a column chunk
    and a row chunk of wider arrays (x too: its rows are read ld apart)."""
    import cupy
    act = (TABLE[name].cuda, x, None if bias is None else cupy.ascontiguousarray(bias))
    res = _cast_transpose(dy, scale, fmt, dbias_dtype, amax_out, scale_inv_out, act, out)
    return res if dbias_dtype is not None else res + (None,)


def _act_supported(x, bias, name, *args, **kwargs):
    """Plain activations, 2-D contiguous x with rows % 16 and cols % 8 (the FP8 GEMMs'
    shapes: no ragged variant is built), a bias of x's dtype or none."""
    return (_ct_supported(x, None, None) and not TABLE[name].gated and x.flags.c_contiguous
            and x.shape[0] % 16 == 0 and x.shape[1] % 8 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.shape == x.shape[1:])))


@backends.register("act_cast_transpose", "cuda", supports=_act_supported)
def act_cast_transpose(x, bias, name, scale, fmt, amax_out=None, scale_inv_out=None):
    """The activation `name`'s forward f(x + bias) cast to FP8 with its transpose in one
    pass (act_fwd's codes and amax, and their transpose: fc2's input and wgrad's copy) ->
    (q, qt, amax)."""
    import cupy
    act = (f"Fwd<{TABLE[name].cuda}>", None,
           None if bias is None else cupy.ascontiguousarray(bias))
    return _cast_transpose(x, scale, fmt, None, amax_out, scale_inv_out, act)


def _cast_transpose(x, scale, fmt, dbias_dtype, amax_out, scale_inv_out, act=None, out=None):
    """act: None, or (struct of act_math.cuh, h, hbias or None): x is dy, cast is dx (h's
    rows may be ld apart); or (Fwd<struct>, None, hbias or None): cast is f(x + hbias).
    out: None or (q, qt) to write (q's rows may be ld apart)."""
    import cupy
    x = cupy.ascontiguousarray(x)
    rows, cols = x.shape
    if out is None:
        q, qt = cupy.empty((rows, cols), np.uint8), cupy.empty((cols, rows), np.uint8)
    else:
        q, qt = out
    amax, slot = amax_args(amax_out, x.size)
    inv = scale_inv_arg(scale, scale_inv_out, x.size)
    dbias = dbias_dtype is not None
    part = cupy.empty((-(-rows // 128), cols), np.float32) if dbias else amax
    if x.size:
        name = None if act is None else act[0]
        run, rows32, cols32, tail = planned(
            _plans, (rows, cols, x.dtype, fmt.name, dbias, name, current_device()), _ct_plan, rows,
            cols, x.dtype, fmt.name, dbias, name)
        if act is None and out is None:  # (no activation, whole arrays: the plan's tail)
            run((x, scale, q, qt, inv, amax, slot, part) + tail)
        else:
            h, hb = (None, None) if act is None else act[1:]
            ldh = cols if h is None else h.strides[0] // h.itemsize  # (uint8 q: bytes)
            ldq = cols if out is None else q.strides[0]
            run((x, scale, q, qt, inv, amax, slot, part, rows32, cols32,
                 _NULL if h is None else h, _NULL if hb is None else hb, np.int64(ldh),
                 np.int64(ldq)))
    if not dbias:
        return q, qt, amax
    if not x.size:
        return q, qt, amax, cupy.zeros((cols,), dbias_dtype)
    return q, qt, amax, col_sum(part, dbias_dtype)  # (in dbias_dtype: no astype launch)


_plans = {}  # launch plans (launch.planned): the kernel and grid per call shape



def _ct_plan(rows, cols, dtype, fmt, dbias, act=None):
    """(Launcher, rows and cols as the kernel's int32, the plain kernel's arguments from
    rows on: rows, cols, null h and hbias, ldh = ldq = cols) of cast_transpose: 128 x 64 tiles
    (G = 1; PERFLOG.md, session 3: 80% of copy on an H200), a grid-stride over them with at
    most the resident blocks. act: the struct of an activation whose backward is cast
    (dact_cast_transpose), or None."""
    tail = "" if act is None else f", {act}"
    k = loader.function(FILE, f"cast_transpose_tiled<{CTYPE[dtype]}, {FP8TYPE[fmt]}, 1, "
                              f"{cbool(dbias)}, {cbool(rows % 16 != 0 or cols % 8 != 0)}"
                              f"{tail}>")
    tiles = -(-rows // 128) * -(-cols // 64)
    grid = (min(tiles, sm_count() * resident_blocks(k, 256, 0)),)
    # the arguments: x, scale, q, qt, inv (or null), amax, slot, part, rows, cols, h, hb,
    # ldh, ldq
    nd = _array_type()
    kinds = (nd,) * 4 + (np.uint64, nd, np.uint64, nd, np.int32, np.int32, np.uint64,
                         np.uint64, np.int64, np.int64)
    rows32, cols32, ld = np.int32(rows), np.int32(cols), np.int64(cols)
    return Launcher(k, grid, (256,), kinds), rows32, cols32, (rows32, cols32, _NULL, _NULL,
                                                              ld, ld)
