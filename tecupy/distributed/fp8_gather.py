"""Sequence parallel's all-gather before a column-parallel GEMM, in FP8 as uint8 codes.

    x [s/tp, b, in] (this rank's sequence chunk) -> y [s, b, out/tp] = gather(x) @ w.T + b

High precision: gather_sequence then linear. Under fp8_autocast every rank casts its own
chunk with one shared scale and the group all-gathers the codes (1 byte an element, half of
bf16's traffic, as Transformer Engine gathers FP8 activations); the GEMM reads the gathered
codes. Backward: wgrad reads the gathered codes' column-wise copy, dgrad's full-sequence dx
is reduce-scattered back to the chunks.

The scale must be one across the ranks (the codes of different scales cannot share one
scale_inv): delayed scaling uses the slot's scale, which is already one where amaxes are
reduced over this group (FP8State.amax_group is the group, recipe.reduce_amax); otherwise
the ranks take the smallest of their scales (a float32 min all-reduce: the largest amax,
so no rank's chunk saturates more than its own scale would). Current scaling maxes the
chunks' amaxes over the group first, so the scale is that of the whole sequence, as on
one device. Only the sequence axis 0 (sbhd) is gathered as codes: the chunks are then
whole rows of the [s*b, in] GEMM operand.

The row-parallel GEMM's mirror (linear_reduce_scatter, and LayerNormMLP's fc2 through
SequenceReduce): its output is reduce-scattered inside its FP8 node, so the backward gets this
rank's dy chunk, casts it with one scale across the ranks and all-gathers the codes (TE
gathers dy in FP8 too): half the bytes of gathering dy in bf16, and the cast reads a chunk;
wgrad's transposed copy of dy is made from the gathered codes.

Comm-GEMM overlap (overlap.py, on by default): the all-gather of the codes is a ring whose
chunks' GEMMs write their rows of the output as they arrive, and the backward's dgrad +
reduce-scatter a ring whose chunks' dgrad GEMMs run while the sums travel.
"""
from .. import backends
from .._array import xp_of
from ..fp8 import FP8Tensor, amax, cast, current_scale
from ..fp8_params import weight_fp8
from ..ops import linear
from ..ops.elementwise import add
from ..ops.linear import as_2d, as_nd, check_fp8_dims, fp8_dy, fp8_gemm, fp8_grads
from ..quantization import CurrentQuantizer, DelayedQuantizer, gemm_quantizers
from ..tape import keeping, record, retaining
from . import overlap
from .peer import peer_gather
from .ring_linear import ring_column_linear_hp


def gather_sequence_linear(x, weight, bias, group, fp8_state=None, gemm_index=0):
    """linear(all-gather of x along axis 0, weight, bias), the gather in FP8 codes under
    fp8_autocast; x's gradient is reduce-scattered back to this rank's chunk. With the
    comm-GEMM overlap (overlap.py) the gather is a ring whose chunks' GEMMs run as they
    arrive, and dgrad's reduce-scatter a ring whose chunks' GEMMs run as the sums travel."""
    from .tensor_parallel import gather_sequence
    q = gemm_quantizers(fp8_state, gemm_index, xp_of(x))
    ring = x.ndim >= 2 and overlap.enabled(group, x)
    if q is not None and not SequenceReduce.takes(q.input):
        # block scaling: x gathered in high precision, then quantized whole in its blocks as
        # on one device (its codes cannot travel with one per-tensor scale)
        return linear(gather_sequence(x, group, 0), weight, bias, fp8_state, gemm_index)
    if q is None:
        if ring:
            return ring_column_linear_hp(x, weight, bias, group)
        return linear(gather_sequence(x, group, 0), weight, bias, fp8_state, gemm_index)
    if x.ndim < 2:
        return linear(gather_sequence(x, group, 0), weight, bias, fp8_state, gemm_index)
    n, k = weight.shape
    m_local = x.size // k
    m = m_local * group.size
    check_fp8_dims("linear (sequence-parallel gather)", m, n, k)
    qi = q.input
    qx = cast(as_2d(x, m_local, k), shared_scale(qi, fp8_state, group, x), qi.fmt,
              qi.amax_out)
    tr = keeping()
    shape = (x.shape[0] * group.size,) + x.shape[1:-1] + (n,)
    full = full_t = None
    pg = None if ring else peer_gather(group, qx.data)  # (pushes read as they land: peer.py)
    if ring:
        qw = weight_fp8(q.weight, weight, tr)
        y2 = xp_of(x).empty((m, n), x.dtype)

        def gemm(c, chunk):  # the rows of chunk c, as the one GEMM would write them
            fp8_gemm(FP8Tensor.made(chunk, qi.fmt, qx.scale_inv), qw, x.dtype, bias,
                     out=y2[c * m_local:(c + 1) * m_local])
        full = FP8Tensor.made(overlap.ring_gather(group, qx.data, gemm), qi.fmt,
                              qx.scale_inv)
        del qx
        y = as_nd(y2, shape)
    elif pg is not None:
        y2, full_t, qw = pg.gemm(qx, lambda: weight_fp8(q.weight, weight, tr), x.dtype, bias,
                                 transpose=tr)
        del qx
        y = as_nd(y2, shape)
    else:
        full = FP8Tensor.made(group.all_gather(qx.data, 0), qi.fmt, qx.scale_inv)
        del qx
        qw = weight_fp8(q.weight, weight, tr)
        y = as_nd(fp8_gemm(full, qw, x.dtype, bias), shape)
    if not tr:
        return y
    x_shape, x_dtype = x.shape, x.dtype
    saved = [full.columnwise() if full_t is None else full_t, qw.columnwise()]
    full = full_t = None

    def backward(dy):
        if ring:
            dx, dw, db = _ring_backward(as_2d(dy, m, n), saved, bias, q.grad_output,
                                        x_dtype, group, m_local)
            return dx.reshape(x_shape), dw, db
        dx, dw, db = column_backward(as_2d(dy, m, n), saved, bias, q.grad_output, x_dtype,
                                     group, overlap.bulk(group, dy))
        return dx.reshape(x_shape), dw, db
    record(backward, (x, weight, bias), (y,), after_backward=q.after_backward, once=q.once)
    return y


def column_backward(dy2, saved, bias, q_dy, x_dtype, group, bulk):
    """A sequence-parallel column GEMM's backward: dy cast with its transposed copy and
    dbias, then column_grads -> (this rank's dx chunk, dw, dbias)."""
    qdy, db = fp8_dy(q_dy, dy2, bias)
    held = [qdy]
    del qdy
    local, dw = column_grads(held, saved, x_dtype, group, bulk)
    return local, dw, db


def column_grads(held, saved, x_dtype, group, bulk):
    """(this rank's chunk of dx, dw) from held = [dy's FP8 tensor]: bulk_grads (bulk: dgrad
    first, its reduce-scatter beside wgrad), else fp8_grads then the reduce-scatter."""
    if bulk:
        return bulk_grads(held, saved, x_dtype, group)
    dx, dw = fp8_grads(held, saved, x_dtype)
    return group.reduce_scatter(dx, 0), dw


def bulk_grads(held, saved, x_dtype, group):
    """fp8_grads with dgrad first: its reduce-scatter runs on the side stream while wgrad
    runs on the main one, leaving overlap.SM_MARGIN SMs to NCCL; held = [dy's FP8 tensor],
    saved = [x's column-wise copy, the weight's] (both lists emptied) -> (this rank's dx
    chunk, dw). The same GEMMs and collective as the plain order: bit for bit."""
    from ..kernels.launch import sm_margin
    qx_t, qw_t = saved
    if not retaining():
        saved.clear()
    qdy = held.pop()
    dx = fp8_gemm(qdy.rowwise(), qw_t, x_dtype, split_accumulator=True)  # [M, N] x [K, N]^T
    side = overlap._Side(group)
    local, event = side.collective(group.reduce_scatter, dx, 0)
    del dx
    with sm_margin(overlap.SM_MARGIN):
        dw = fp8_gemm(qdy.T, qx_t, x_dtype, split_accumulator=True)  # [N, M] x [K, M]^T
    side.wait(event)
    side.keep.clear()
    return local, dw


def _ring_backward(dy2, saved, bias, q_dy, x_dtype, group, m_local):
    """fp8_linear_backward (dy cast with its transposed copy and dbias, wgrad, then dgrad)
    with dgrad's reduce-scatter a ring: dgrad's row chunk of each step computed while the
    previous step's sum travels -> (this rank's dx chunk [m_local, K], dw, dbias)."""
    qx_t, qw_t = saved
    if not retaining():
        saved.clear()
    qdy, db = fp8_dy(q_dy, dy2, bias)
    dw = fp8_gemm(qdy.T, qx_t, x_dtype, split_accumulator=True)  # [N, M] x [K, M]^T
    del qx_t
    qdy = qdy.rowwise()

    def partial(c):  # dgrad's rows of chunk c: [m_local, N] x [K, N]^T
        return fp8_gemm(qdy.rows(c * m_local, (c + 1) * m_local), qw_t, x_dtype,
                        split_accumulator=True)
    return overlap.ring_reduce_scatter(group, partial), dw, db


def linear_reduce_scatter(x, weight, group, fp8_state=None, gemm_index=0, bias=None,
                          residual=None):
    """reduce_scatter_sequence(linear(x, weight)) over `group` (a row-parallel GEMM under
    sequence parallel) + bias (replicated: its gradient summed over the group) + residual
    (this rank's chunk, or None): under fp8_autocast one node whose backward all-gathers dy
    as FP8 codes (module doc), the bias and a residual of y's shape, dtype and array type
    added in one pass after the reduce-scatter and the bias's gradient from the cast of
    dy's chunk (dbias: no column sums of dy apart); else the ops."""
    from .tensor_parallel import bias_residual, reduce_scatter_sequence, replicated_grad
    comm = SequenceReduce(group, fp8_state)
    q = gemm_quantizers(fp8_state, gemm_index, xp_of(x))
    if q is None or x.ndim < 2 or not comm.takes(q.grad_output):
        y = reduce_scatter_sequence(linear(x, weight, None, fp8_state, gemm_index), group)
        return bias_residual(y, replicated_grad(bias, group), residual)
    n, k = weight.shape
    m = x.size // k
    check_fp8_dims("linear (sequence-parallel reduce-scatter)", m, n, k)
    rows = comm.rows(m)
    shape = (x.shape[0] * rows // m,) + x.shape[1:-1] + (n,)
    if not residual_fits(residual, x, shape):
        return add(linear_reduce_scatter(x, weight, group, fp8_state, gemm_index, bias),
                   residual)
    tr = keeping()
    qx = q.input.quantize(as_2d(x, m, k), transpose=tr)
    qw = weight_fp8(q.weight, weight, tr)
    y2 = comm.reduce(fp8_gemm(qx, qw, x.dtype), bias,
                     None if residual is None else as_2d(residual, rows, n))
    y = as_nd(y2, shape)
    if not tr:
        return y
    x_shape, x_dtype = x.shape, x.dtype
    saved = [qx.columnwise(), qw.columnwise()]
    del qx, y2

    def backward(dy):
        qdy, db = comm.dy_dbias(q.grad_output, as_2d(dy, rows, n), bias)
        if db is not None:
            db = group.all_reduce(db)
        dx, dw = fp8_grads([qdy], saved, x_dtype)
        return (as_nd(dx, x_shape), dw, db) + ((dy,) if residual is not None else ())
    record(backward, (x, weight, bias) + ((residual,) if residual is not None else ()), (y,),
           after_backward=q.after_backward, once=q.once)
    return y


class SequenceReduce:
    """The comm of an FP8 node whose output is reduce-scattered over the sequence (axis 0)
    inside it and whose dy is all-gathered as FP8 codes (module doc; ops.blocks.
    _act_then_linear's comm)."""

    def __init__(self, group, fp8_state):
        self.group, self.fp8_state = group, fp8_state

    @staticmethod
    def takes(quantizer):
        """A per-tensor quantizer (delayed or current scaling: one scale for all ranks' codes;
        block scaling's are per block)."""
        return isinstance(quantizer, (DelayedQuantizer, CurrentQuantizer))

    def rows(self, m):
        return m // self.group.size

    def reduce(self, y2, bias=None, residual=None):
        """y2 [M, N] reduce-scattered to this rank's rows, + bias (a row, replicated) +
        residual (this rank's rows, 2-D) in one pass where given (add_fwd: add_bias's
        kernel, no tape node)."""
        y2 = self.group.reduce_scatter(y2, 0)
        if bias is None and residual is None:
            return y2
        return backends.dispatch("add_fwd", y2, *((residual,) if bias is None
                                                  else (bias, residual)))

    def dy(self, q_dy, dy2):
        """dy2 (this rank's rows) cast by q_dy with the group's one scale, the codes
        all-gathered -> FP8Tensor of every rank's rows (its transposed copy made when wgrad
        asks for it)."""
        return self.dy_dbias(q_dy, dy2, None)[0]

    def dy_dbias(self, q_dy, dy2, bias):
        """(dy's FP8Tensor as dy gives it, the dbias of this rank's rows of dy2 or None
        without a bias): cast_dy, then the codes all-gathered by NCCL."""
        q, db = self.cast_dy(q_dy, dy2, bias)
        return FP8Tensor.made(self.group.all_gather(q.data, 0), q_dy.fmt, q.scale_inv), db

    def cast_dy(self, q_dy, dy2, bias):
        """(this rank's rows of dy2 cast by q_dy with the group's one scale, their dbias or
        None without a bias): dbias from the cast's read of dy2 (cast_transpose_dbias; its
        chunk's transposed codes are not used), for the caller to sum over the group."""
        scale = shared_scale(q_dy, self.fp8_state, self.group, dy2)
        if bias is None:
            return cast(dy2, scale, q_dy.fmt, q_dy.amax_out), None
        return cast(dy2, scale, q_dy.fmt, q_dy.amax_out, True, bias.dtype)


def residual_fits(residual, x, shape):
    """Whether a reduce-scattering FP8 node adds `residual` in its bias's pass: none, or an
    array of x's type and dtype of the node's output `shape` (else the add op after it)."""
    return residual is None or (type(residual) is type(x) and residual.shape == shape
                                and residual.dtype == x.dtype)


def shared_scale(quantizer, fp8_state, group, x):
    """The float32 (1,) scale every rank of `group` casts its chunk with (module doc)."""
    if not quantizer.fused_ok:  # current scaling: the whole sequence's amax
        a = group.all_reduce(amax(x), "max")
        return current_scale(a, quantizer.fmt)
    if scale_is_shared(quantizer, fp8_state, group):
        return quantizer.scale  # one already: the amaxes that made it were maxed over group
    neg = group.all_reduce(-quantizer.scale, "max")  # (min as a max: groups have sum, max)
    return -neg


def scale_is_shared(quantizer, fp8_state, group):
    """Whether the quantizer's own scale is one on every rank of `group` (delayed scaling
    whose amaxes are maxed over that group: recipe.reduce_amax, FP8State.amax_group), so
    its casts need no collective first."""
    recipe = getattr(fp8_state, "recipe", None)
    return (quantizer.fused_ok and fp8_state is not None
            and getattr(fp8_state, "amax_group", None) is group
            and getattr(recipe, "reduce_amax", False))
