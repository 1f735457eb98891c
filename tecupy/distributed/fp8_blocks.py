"""LayerNormLinear and LayerNormMLP under sequence parallel in FP8 as one node each, as on
one device (ops.blocks._norm_linear_fp8, _mlp_fp8), with the collectives inside.

The MLP: the norm writes this rank's FP8 codes in its pass, the group all-gathers them,
fc1, the activation cast in its pass, fc2, and fc2's partial sums reduce-scattered to this
rank's sequence chunk; the backward all-gathers dy's codes, casts the activation's backward
in fc2's dgrad chunks (with fc1's dbias), runs fc1's dgrad and reduce-scatters it (beside
fc1's wgrad: fp8_gather.column_grads), then the norm's backward on the chunk, whose two
parameter gradients are all-reduced in one group call. The LayerNormLinear (column
parallel: attention's qkv): the norm's codes all-gathered, the GEMM; backward: dgrad
reduce-scattered (beside wgrad), the norm's backward on the chunk.

Against the composed path (parallel norm, gather_sequence_linear, _act_then_linear's comm:
three nodes) this makes no high-precision copy of the norm's output and no separate
activation backward, dy cast or norm-parameter all-reduces (session 18's "work one GPU
fuses": ~0.3 ms at TP=2 on the quickstart layer). It runs where the composed path's FP8
node would and the norm can cast: delayed scaling with the amaxes reduced over this group
(then every rank's norm casts with one scale, fp8_gather.scale_is_shared), a plain activation,
sbhd input, no rings; else these return None and the caller composes.
"""
import os

from .. import backends
from .._array import xp_of
from ..fp8 import FP8Tensor
from ..fp8_params import weight_fp8
from ..ops.blocks import (DACT_CHUNK_BYTES, _fused_mlp_quantizers, _gemm_fp8, _norm_bwd,
                          _norm_fp8, dact_grads, kept_operands, released)
from ..ops.elementwise import add
from ..ops.linear import as_2d, as_nd, check_fp8_dims, fp8_gemm
from ..quantization import gemm_quantizers
from ..tape import keeping, record, retaining
from . import overlap
from .fp8_gather import (SequenceReduce, column_backward, column_grads, residual_fits,
                         scale_is_shared)
from .peer import peer_gather

# TECUPY_TP_FUSED=0 / FUSED = False: always the composed path (A/B; the rings' tests compare
# against it: the fused norm casts from float32, the composed one from its bf16 output)
FUSED = os.environ.get("TECUPY_TP_FUSED", "1").strip() not in ("", "0")


def layernorm_linear_sp(module, x):
    """linear(norm(x)) of a sequence-parallel, column-parallel LayerNormLinear `module` on
    this rank's chunk x [s/tp, b, in] as one FP8 node -> this rank's columns of the output
    over the whole sequence, or None where the node does not apply (module doc)."""
    if module.return_layernorm_output:
        return None
    q = gemm_quantizers(module.fp8_state, 0, xp_of(x))
    if q is None or not _applies(module, x, q.input, q.grad_output):
        return None
    return _norm_linear_sp_fp8(x, module, q)


def layernorm_mlp_sp(module, x, residual=None):
    """fc2(act(fc1(norm(x)))) + fc2's bias (+ residual) of a sequence-parallel LayerNormMLP
    `module` on this rank's chunk x [s/tp, b, hidden] as one FP8 node -> this rank's chunk
    of the reduce-scattered output, or None where the node does not apply (module doc).
    The bias and a residual of x's shape, dtype and array type are added in one pass after
    the reduce-scatter (add_fwd), inside the node (another residual: by the add op after
    it); fc2's bias gradient comes from the cast of dy's chunk (dbias) and is summed over
    the group in the norm's gradients' call."""
    q1, q2 = _fused_mlp_quantizers(xp_of(x), module.fp8_state, module.activation,
                                   module.return_layernorm_output)
    if q1 is None or not _applies(module, x, q1.input, q1.grad_output, q2.grad_output):
        return None
    fits = residual_fits(residual, x, x.shape)
    y = _mlp_sp_fp8(x, module, q1, q2, residual if fits else None)
    return y if fits else add(y, residual)


def _applies(module, x, q_in, *q_dys):
    """Whether the one-node path runs: sbhd input, no rings, the norm's cast with one scale
    on every rank (delayed scaling, amaxes reduced over the group), per-tensor dy casts."""
    g = module.tp_group
    if not FUSED or x.ndim < 2 or overlap.enabled(g, x):
        return False
    # (else the ranks' scales may differ: the composed path casts with their min)
    return (scale_is_shared(q_in, module.fp8_state, g)
            and all(SequenceReduce.takes(q) for q in q_dys))


def _norm_linear_sp_fp8(x, module, q):
    g, w, b, dtype = module.tp_group, module.weight, module.bias, x.dtype
    ln_w, ln_b, zcg = module.layer_norm_weight, module.layer_norm_bias, module.zero_centered_gamma
    n, k = w.shape
    m_local = x.size // k
    m = m_local * g.size
    check_fp8_dims("LayerNormLinear (sequence parallel)", m, n, k)
    x2 = as_2d(x, m_local, k)
    qx, stats = _norm_fp8(x2, ln_w, ln_b, module.eps, zcg, module.normalization == "RMSNorm",
                          q.input)
    y2, saved = _gathered_gemm(g, qx, w, q, dtype, b)
    del qx
    y = as_nd(y2, (x.shape[0] * g.size,) + x.shape[1:-1] + (n,))
    del y2

    def backward(dy, partial=None):
        dy2 = as_2d(dy, m, n)
        d_ln, dw, db = column_backward(dy2, released(saved), b, q.grad_output, dtype, g,
                                       overlap.bulk(g, dy))
        return _norm_backward(g, d_ln, x, x2, stats, module, partial) + (
            dw.astype(w.dtype, copy=False), db)
    record(backward, (x, ln_w, ln_b, w, b), (y,), after_backward=q.after_backward,
           once=q.once, partial=0)
    return y


def _gathered_gemm(g, qx, w, q, dtype, bias):
    """_gemm_fp8 of the all-gather of this rank's codes qx (the norm's, one scale on every
    rank) -> (y, what the backward keeps): the chunks pushed by the copy engines and read by
    the GEMM as they land (peer.PeerGather: the gathered codes transposed for wgrad here, so
    the shared buffer is free after the forward) where that applies, else NCCL's all-gather,
    then the GEMM."""
    pg = peer_gather(g, qx.data)
    if pg is not None:
        y, full_t, qw = pg.gemm(qx, lambda: weight_fp8(q.weight, w, True), dtype, bias)
        return y, [full_t, qw.columnwise(), True]
    full = FP8Tensor.made(g.all_gather(qx.data, 0), q.input.fmt, qx.scale_inv)
    return _gemm_fp8(full, w, q, dtype, bias)


def _dact_grads_peer(pg, qdy, saved2, h, b1, activation, g, dtype):
    """ops.blocks.dact_grads with dy all-gathered by the peer pushes (pg, PeerGather) of
    this rank's codes qdy: fc2's dgrad first, its first column chunk's GEMM reading dy's
    rows as they land, the activation's backward cast from it, then wgrad (dy's transpose)
    and the buffer released (the same GEMMs and casts: the same bits, wgrad after dgrad, so
    the activation's column-wise codes live through dgrad: [ffn / tp, M] bytes more at its
    peak) -> (FP8Tensor of dh, db1, dw2)."""
    full = FP8Tensor.made(pg.start(qdy.data), qdy.fmt, qdy.scale_inv)
    qa_t, qw_t = saved2
    saved2.clear()
    first = [True]  # (the first GEMM waits per chunk; the later ones find them all)

    def dgrad(c0, c1):  # dy's columns c0:c1 = dy @ (rows c0:c1 of w2's transposed codes).T
        w = qw_t.rows(c0, c1)
        if first[0]:
            first[0] = False
            return pg.matmul(full, w, dtype, split_accumulator=True)
        return fp8_gemm(full, w, dtype, split_accumulator=True)
    m, ffn = h.shape
    chunk = max(64, DACT_CHUNK_BYTES // (m * h.itemsize) // 64 * 64)
    qdh, db1 = g.quantize_dact(dgrad, h, b1, activation, None if b1 is None else b1.dtype,
                               chunk)
    assert not first[0], "dact_cast_chunked ran no dgrad chunk"  # (ffn >= 1 column)
    dw2 = fp8_gemm(full.T, qa_t, dtype, split_accumulator=True)
    del qa_t
    pg.finish()
    return qdh, db1, dw2


def _norm_backward(g, d_ln, x, x2, stats, module, partial, more=()):
    """(dx, dgamma, dbeta) of the chunk's norm; the parameters' gradients (the chunk's
    partial sums), and those of `more` (other replicated parameters' partial sums, None
    skipped), all-reduced in one group call."""
    dx, dg, dbeta = _norm_bwd(d_ln, x2, stats, module.layer_norm_weight,
                              module.zero_centered_gamma, partial)
    g.all_reduce_many([a for a in (dg, dbeta, *more) if a is not None])
    return as_nd(dx, x.shape), dg, dbeta


def _mlp_sp_fp8(x, module, q1, q2, residual=None):
    g = module.tp_group  # (the same steps as ops.blocks._mlp_fp8, with the collectives)
    w1, b1, w2, b2 = module.fc1_weight, module.fc1_bias, module.fc2_weight, module.fc2_bias
    ln_w, ln_b, dtype = module.layer_norm_weight, module.layer_norm_bias, x.dtype
    hidden, ffn = x.shape[-1], w1.shape[0]
    m_local = x.size // hidden
    m = m_local * g.size
    check_fp8_dims("LayerNormMLP (sequence parallel)", m, ffn, hidden)
    check_fp8_dims("LayerNormMLP (sequence parallel, fc2)", m, hidden, ffn)
    x2 = as_2d(x, m_local, hidden)
    qx, stats = _norm_fp8(x2, ln_w, ln_b, module.eps, module.zero_centered_gamma,
                          module.normalization == "RMSNorm", q1.input)
    h, saved1 = _gathered_gemm(g, qx, w1, q1, dtype, None)
    del qx
    qa = q2.input.quantize_act(h, b1, module.activation, transpose=keeping())
    qw2 = weight_fp8(q2.weight, w2, True)
    saved2 = kept_operands(qa, qw2)
    comm = SequenceReduce(g, module.fp8_state)
    y2 = comm.reduce(fp8_gemm(qa, qw2, dtype), b2,
                     None if residual is None else as_2d(residual, m_local, hidden))
    y = as_nd(y2, x.shape)
    kept = [h]
    del h, qa, qw2, y2
    own = residual is x  # (the pre-norm block's residual: dy is x's gradient too)

    def backward(dy, partial=None):
        h = kept[0] if retaining() else kept.pop()
        qdy, db2 = comm.cast_dy(q2.grad_output, as_2d(dy, m_local, hidden), b2)
        pg = peer_gather(g, qdy.data)
        if pg is not None:  # dy's chunks pushed, fc2's dgrad reading them as they land
            qdh, db1, dw2 = _dact_grads_peer(pg, qdy, released(saved2), h, b1,
                                             module.activation, q1.grad_output, dtype)
        else:
            held = [FP8Tensor.made(g.all_gather(qdy.data, 0), qdy.fmt, qdy.scale_inv)]
            qdh, db1, dw2 = dact_grads(held, released(saved2), h, b1, module.activation,
                                       q1.grad_output, dtype)
        del h, qdy
        held = [qdh]
        del qdh
        d_ln, dw1 = column_grads(held, released(saved1), dtype, g, overlap.bulk(g, dy))
        if own:  # the residual's dy joins x's other gradients in the norm's pass
            partial = dy if partial is None else backends.dispatch("add_fwd", partial, dy)
        return _norm_backward(g, d_ln, x, x2, stats, module, partial, (db2,)) + (
            dw1.astype(w1.dtype, copy=False), db1, dw2.astype(w2.dtype, copy=False), db2) + (
            (dy,) if residual is not None and not own else ())
    record(backward, (x, ln_w, ln_b, w1, b1, w2, b2) + (
        (residual,) if residual is not None and not own else ()), (y,),
           after_backward=q1.after_backward + q2.after_backward, once=q1.once, partial=0)
    return y
