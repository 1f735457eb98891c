"""The sequence-parallel linears with their collectives overlapped (overlap.py's rings):

    ring_column_linear_hp  x [s/tp, ..., in] -> gather(x) @ w.T + b  [s, ..., out/tp]
                           (high precision; FP8's is in fp8_gather.py, on the codes)
    ring_row_linear        x [s, ..., in/tp] -> reduce_scatter(x @ w.T) [s/tp, ..., out]
                           (high precision or FP8; the bias is the caller's, after)
    ring_act_row_linear    h -> reduce_scatter(act(h + b1) @ w2.T): LayerNormMLP's fc2
                           (ops.blocks._act_then_linear with the ring: under delayed
                           scaling the activation writes fc2's codes in its own pass)

Each is one tape node that computes what linear() and the collective node beside it
compute today, with the same kernels on row chunks: the forward bit for bit (module doc of
overlap.py), the backward's ring reduce-scatter in the ring's order of sums. The row
linears' backward gathers dy (reduce_scatter_sequence's backward) by ring_gather with
dgrad's rows of each chunk computed as it arrives (overlap.OVERLAP_DY): in high precision,
and in FP8 where dy's scale is known before its data (delayed scaling: each chunk is cast
with the slot's scale as it arrives, its amax maxed in: the codes and amax of one cast of
the whole; the bf16 dy travels, as today, not codes, which would need the amax of the
whole sequence first); wgrad then reads the gathered codes' transpose. Current and block
scaling gather dy first, as today. Under an FP8Inspector the chunks' casts are seen one
by one.
"""
import numpy as np

from .. import backends
from .._array import xp_of
from ..fp8 import FP8Tensor
from ..fp8_params import hp, weight_fp8
from ..ops.activation import GATED, activation as apply_activation, check_activation
from ..ops.blocks import kept_operands, released
from ..ops.linear import (_check_args, _dbias, as_2d, as_nd, check_fp8_dims, fp8_gemm,
                          fp8_linear_backward)
from ..quantization import gemm_quantizers
from ..tape import keeping, record, retaining
from . import overlap
from .overlap import ring_gather, ring_reduce_scatter


def gemm_rows(a, w, bias, out, trans_b=True):
    """out[...] = a @ w.T + bias (a @ w with trans_b False), as backends' "gemm" computes
    it: cuBLAS writes straight into `out` (a row slice of a larger output) where that is
    the implementation chosen, else the chosen one's result is copied in."""
    from ..kernels import gemm as cublas
    impl = backends.choose("gemm", a, w, out.dtype, bias, trans_b=trans_b)
    if (impl is None or impl.fn is not cublas.gemm or getattr(impl, "failure", None)
            is not None or not out.flags.c_contiguous or a.shape[1] == 0):
        out[...] = backends.dispatch("gemm", a, w, out.dtype, bias, trans_b=trans_b)
        return out
    import cupy
    m, k = a.shape
    n = w.shape[0] if trans_b else w.shape[1]
    op_b, ld_b, b = cublas._operand(w, transposed=not trans_b)
    op_a, ld_a, a = cublas._operand(a, transposed=True)
    dt = cublas.CUDA_DTYPE[a.dtype]
    cublas._check(cublas._cublas().cublasGemmEx(
        cublas._handle(cupy.cuda.get_current_stream().ptr), op_b, op_a, n, m, k,
        cublas._ALPHA.ctypes.data, b.data.ptr, dt, ld_b, a.data.ptr, dt, ld_a,
        cublas._BETA.ctypes.data, out.data.ptr, dt, n, cublas.COMPUTE_32F,
        cublas.GEMM_DEFAULT), "cublasGemmEx")
    if bias is not None:
        out += bias
    return out


def ring_column_linear_hp(x, weight, bias, group):
    """High-precision gather_sequence + linear with the gather a ring (overlap.ring_gather)
    and dgrad's reduce-scatter a ring (overlap.ring_reduce_scatter)."""
    _check_args("linear", x, weight, bias)
    xp, size = xp_of(x), group.size
    n, k = weight.shape
    w = hp(weight)
    m_local = x.size // k
    y2 = xp.empty((m_local * size, n), x.dtype)

    def gemm(c, chunk):
        gemm_rows(chunk, w, bias, y2[c * m_local:(c + 1) * m_local])
    full = ring_gather(group, xp.ascontiguousarray(x.reshape(m_local, k)), gemm)
    y = y2.reshape((x.shape[0] * size,) + x.shape[1:-1] + (n,))
    x_shape, x_dtype = x.shape, x.dtype

    def backward(dy):
        dy2 = dy.reshape(-1, n)

        def partial(c):  # dgrad's rows of chunk c
            return backends.dispatch("gemm", dy2[c * m_local:(c + 1) * m_local], w, x_dtype,
                                     None, trans_b=False)
        dx = ring_reduce_scatter(group, partial)
        dw = backends.dispatch("gemm", dy2.T, full, weight.dtype, None, trans_b=False)
        return dx.reshape(x_shape), dw, _dbias(dy2, bias)
    record(backward, (x, weight, bias), (y,))
    return y


def ring_row_linear(x, weight, group, fp8_state=None, gemm_index=0):
    """linear(x, weight) reduce-scattered along axis 0 over `group` (the row-parallel GEMM
    of sequence parallel, no bias), the reduce-scatter a ring whose steps' GEMMs are the
    partial outputs of the chunk that travels next -> this rank's [s/tp, ..., out]. x:
    [s, ..., in/tp], s a multiple of the group's size."""
    xp = _check_args("linear", x, weight, None)
    q = gemm_quantizers(fp8_state, gemm_index, xp)
    size = group.size
    n, k = weight.shape
    m = x.size // k
    m_local = m // size
    shape = (x.shape[0] // size,) + x.shape[1:-1] + (n,)
    x_shape, x_dtype = x.shape, x.dtype
    x2 = as_2d(x, m, k)
    if q is None:
        w = hp(weight)
        x2 = xp.ascontiguousarray(x2)
        y = ring_reduce_scatter(group, lambda c: backends.dispatch(
            "gemm", x2[c * m_local:(c + 1) * m_local], w, x_dtype, None)).reshape(shape)

        def backward(dy):
            if overlap.OVERLAP_DY:  # dgrad's row chunks as dy's chunks arrive
                dx = xp.empty((m, k), x_dtype)
                dy2 = ring_gather(group, xp.ascontiguousarray(dy.reshape(m_local, n)),
                                  lambda c, ch: gemm_rows(ch, w, None, dx[
                                      c * m_local:(c + 1) * m_local], trans_b=False))
            else:
                dy2 = group.all_gather(dy, 0).reshape(-1, n)
                dx = backends.dispatch("gemm", dy2, w, x_dtype, None, trans_b=False)
            dw = backends.dispatch("gemm", dy2.T, x2, weight.dtype, None, trans_b=False)
            return dx.reshape(x_shape), dw
        record(backward, (x, weight), (y,))
        return y
    check_fp8_dims("linear", m, n, k)
    tr = keeping()
    qx = q.input.quantize(x2, transpose=tr)
    qw = weight_fp8(q.weight, weight, tr)
    y = ring_reduce_scatter(group, lambda c: fp8_gemm(
        qx.rows(c * m_local, (c + 1) * m_local), qw, x_dtype)).reshape(shape)
    if not tr:
        return y
    saved = [qx.columnwise(), qw.columnwise()]  # (qx itself dies with this call)

    def backward(dy):
        dx, dw = _row_backward(group, dy, m, n, saved, q.grad_output, x_dtype)
        return as_nd(dx, x_shape), dw
    record(backward, (x, weight), (y,), after_backward=q.after_backward, once=q.once)
    return y


def ring_act_row_linear(xp, h, fc1_bias, activation, fc2_weight, group, fp8_state):
    """ops.blocks._act_then_linear (fc2 of the state's GEMM 1, no fc2 bias) with its output
    reduce-scattered along axis 0 by ring_reduce_scatter: each step's fc2 GEMM on the row
    chunk of the activation codes that travels next. Backward: dy all-gathered, then
    _act_then_linear's backward."""
    q = gemm_quantizers(fp8_state, 1, xp)
    if q is None or not q.input.fused_ok:
        a = apply_activation(h, activation, bias=fc1_bias)
        return ring_row_linear(a, fc2_weight, group, fp8_state, 1)
    check_activation(activation, h, fc1_bias)
    size = group.size
    n, k = fc2_weight.shape
    m = h.size // h.shape[-1]
    m_local = m // size
    check_fp8_dims("layernorm_mlp (fc2)", m, n, k)
    h2, qi = as_2d(h, m, h.shape[-1]), q.input
    codes, _ = backends.dispatch(f"{activation}_fwd", h2, fc1_bias, qi.scale, qi.fmt,
                                 amax_out=qi.amax_out)  # (maxed into the amax history row)
    qa = qi.wrap(codes)
    qw = weight_fp8(q.weight, fc2_weight, True)
    y = ring_reduce_scatter(group, lambda c: fp8_gemm(
        qa.rows(c * m_local, (c + 1) * m_local), qw, h.dtype))
    y = y.reshape((h.shape[0] // size,) + h.shape[1:-1] + (n,))
    saved = kept_operands(qa, qw)  # (qa: the activation wrote row-wise codes only)

    def backward(dy):
        da, dw = _row_backward(group, dy, m, n, released(saved), q.grad_output, h.dtype)
        dh, db1 = backends.dispatch(f"{activation}_bwd", da, h2, fc1_bias,
                                    out=None if activation in GATED else da)
        return as_nd(dh, h.shape), db1, dw.astype(fc2_weight.dtype, copy=False)
    record(backward, (h, fc1_bias, fc2_weight), (y,), after_backward=q.after_backward,
           once=q.once)
    return y


def _row_backward(group, dy, m, n, saved, q_dy, x_dtype):
    """The FP8 row GEMM's backward from this rank's dy chunk [m / size, ..., n] -> (dx [m,
    K], dw): fp8_linear_backward of the all-gathered dy; with overlap.OVERLAP_DY and a
    quantizer that casts with a known scale (delayed scaling), a ring instead: each dy
    chunk cast as it arrives (the same codes and amax as one cast of the whole: the cast
    is elementwise with the slot's scale, the amax a max) and its dgrad rows computed while
    the next travels; then wgrad from the gathered codes' transpose."""
    if not (overlap.OVERLAP_DY and q_dy.fused_ok):
        dx, dw, _ = fp8_linear_backward(as_2d(group.all_gather(dy, 0), m, n), saved, None,
                                        q_dy, x_dtype)
        return dx, dw
    qx_t, qw_t = saved
    if not retaining():
        saved.clear()
    xp, m_local = xp_of(dy), m // group.size
    codes = xp.empty((m, n), np.uint8)
    dx = xp.empty((m, qw_t.shape[0]), x_dtype)
    inv = []

    def step(c, chunk):
        rows = slice(c * m_local, (c + 1) * m_local)
        qc = q_dy.quantize(chunk)
        codes[rows] = qc.data
        inv.append(qc.scale_inv)
        fp8_gemm(qc, qw_t, x_dtype, split_accumulator=True, out=dx[rows])
    ring_gather(group, xp.ascontiguousarray(dy.reshape(m_local, n)), step)
    qdy = FP8Tensor.made(codes, q_dy.fmt, inv[0])
    dw = fp8_gemm(qdy.T, qx_t, x_dtype, split_accumulator=True)  # [N, M] x [K, M]^T
    return dx, dw


def row_ring_ok(x, group):
    """Whether ring_row_linear takes x: axis 0 splits into the group's chunks, and the
    chunks are whole rows of the [M, K] operand."""
    return x.ndim >= 2 and x.shape[0] % group.size == 0
