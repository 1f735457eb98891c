"""The fused blocks of Transformer Engine: LayerNorm+Linear and LayerNorm+MLP.

Composed from the tecupy ops (each records its own backward); a backend with a fused
kernel can take over the pieces. FP8: `fp8_state` holds one GEMM for layernorm_linear and
two (fc1, fc2) for layernorm_mlp.
"""
import numpy as np

from .. import _check, backends
from .._array import (_CUPY_ARRAY, FLOAT_SET, array_module, check_float, check_shape,
                      xp_of)
from ..fp8_params import check_qweight, weight_fp8
from ..quantization import gemm_quantizers
from ..tape import keeping, record, retaining
from .activation import ACTIVATIONS, GATED, activation as apply_activation, check_activation
from .elementwise import add
from .linear import (as_2d, as_nd, check_fp8_dims, check_fp8_state, fp8_dy, fp8_gemm,
                     fp8_grads, fp8_linear_backward, linear, linear_with, fusable_residual)
from .normalization import NORMALIZATIONS, normalize


def _check_norm(op, x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization,
                return_layernorm_output, **linear_arrays):
    """The norm's arguments, named as the caller named them (ln_weight, not layernorm's
    weight); -> (xp, eps, zero_centered_gamma, return_layernorm_output)."""
    xp = _plain_norm(x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization,
                     return_layernorm_output, linear_arrays)
    if xp is not None:
        return xp, eps, zero_centered_gamma, return_layernorm_output
    _check.choice(op, "normalization", normalization, NORMALIZATIONS)
    xp = array_module(op, x=x, ln_weight=ln_weight, ln_bias=ln_bias, **linear_arrays)
    for name, a in (("x", x), ("ln_weight", ln_weight), *linear_arrays.items()):
        if a is None and not name.endswith("bias"):
            _check.fail(op, name, "an array", None, TypeError)
    if normalization == "LayerNorm" and ln_bias is None:
        _check.fail(op, "ln_bias", "an array [hidden] for LayerNorm (None for RMSNorm)", None,
                    TypeError)
    if normalization == "RMSNorm" and ln_bias is not None:
        _check.fail(op, "ln_bias", "None for RMSNorm (it has no bias)", ln_bias)
    check_float(op, x=x, ln_weight=ln_weight, ln_bias=ln_bias, **linear_arrays)
    if x.ndim < 1 or x.shape[-1] == 0:
        _check.fail(op, "x", "an array [..., hidden] with hidden >= 1", x)
    for name, a in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        check_shape(op, name, a, (x.shape[-1],))
    return (xp, _check.real(op, "eps", eps, low=0, low_open=True),
            _check.flag(op, "zero_centered_gamma", zero_centered_gamma),
            _check.flag(op, "return_layernorm_output", return_layernorm_output))


def _plain_norm(x, ln_weight, ln_bias, eps, zcg, normalization, ret, linear_arrays):
    """The array module where the norm's arguments are the common case, else None (the
    full checks then run: ~6 us a call, two calls a layer step): exactly numpy's or cupy's
    arrays of one floating dtype (None where a bias may be), ln_weight and ln_bias [hidden]
    as the normalization asks, a positive finite float eps, bool flags."""
    t, dt = type(x), x.dtype
    if (not (t is np.ndarray or t is _CUPY_ARRAY) or dt not in FLOAT_SET or x.ndim < 1
            or type(eps) is not float or not 0 < eps < float("inf")
            or type(zcg) is not bool or type(ret) is not bool
            or type(normalization) is not str or normalization not in NORMALIZATIONS
            or (ln_bias is None) != (normalization == "RMSNorm")):
        return None
    hidden = (x.shape[-1],)
    for a in (ln_weight, ln_bias):
        if a is not None and not (type(a) is t and a.dtype == dt and a.shape == hidden):
            return None
    if ln_weight is None or not hidden[0]:
        return None
    for name, a in linear_arrays.items():
        if not (type(a) is t and a.dtype == dt) and not (a is None and name.endswith("bias")):
            return None
    return np if t is np.ndarray else xp_of(x)


def _norm_then_linear(xp, x, ln_weight, ln_bias, weight, bias, eps, zero_centered_gamma,
                      normalization, fp8_state, gemm=0, qweight=None):
    """linear(norm(x)); where the input's quantizer lets a producer cast (delayed scaling
    with a state), the norm writes its output straight to FP8 (one pass, no high-precision
    copy) and this records one node for both. qweight: linear's (the weight's kept FP8
    codes, or None). (Arguments checked by the caller.)"""
    q = gemm_quantizers(fp8_state, gemm, xp)
    if q is None or not q.input.fused_ok:  # high precision, or a cast that needs the amax
        ln_out = normalize(x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization)
        return linear_with(ln_out, weight, bias, q, None, qweight)
    return _norm_linear_fp8(x, ln_weight, ln_bias, weight, bias, eps, zero_centered_gamma,
                            normalization == "RMSNorm", q, qweight)


def released(saved):
    """The FP8 operands a fused block saved (_gemm_fp8's [input codes, the weight's
    column-wise copy, whether the first is column-wise already]), taken out of its closure
    as fp8_linear_backward takes them: [the input's column-wise copy, the weight's]. A
    producer (norm, activation under delayed scaling) wrote row-wise codes only; they die
    once transposed, and both copies once the GEMMs read them, not when the node's whole
    backward returns: its second part (the norm's or activation's backward) allocates as
    much again (issue 22: fc2's input codes are 128 MiB at the quickstart layer). Unless
    the tape retains the graph for another backward (current scaling)."""
    operands = [saved[0] if saved[2] else saved[0].columnwise(), saved[1]]
    if not retaining():
        saved.clear()
    return operands


def _norm_fp8(x2, ln_weight, ln_bias, eps, zcg, rms, qi):
    """The norm of x2 [M, K] written as FP8 codes by its kernel with the quantizer qi's scale
    (its amax maxed into qi's history row) -> (FP8Tensor, the statistics its backward
    reads: (rsigma,) or (mu, rsigma)). A quantizer that cannot cast in the norm's pass
    (not fused_ok: block scaling) quantizes the norm's output, with its column-wise copy."""
    if not qi.fused_ok:
        if rms:
            y, rsigma = backends.dispatch("rmsnorm_fwd", x2, ln_weight, eps, zcg)
            return qi.quantize(y, transpose=True), (rsigma,)
        y, mu, rsigma = backends.dispatch("layernorm_fwd", x2, ln_weight, ln_bias, eps, zcg)
        return qi.quantize(y, transpose=True), (mu, rsigma)
    inv = xp_of(x2).empty((1,), np.float32)  # (1 / scale: the norm's kernel writes it)
    if rms:
        codes, rsigma, _ = backends.dispatch("rmsnorm_fwd_fp8", x2, ln_weight, eps, zcg,
                                             qi.scale, qi.fmt, amax_out=qi.amax_out,
                                             scale_inv_out=inv)
        return qi.wrap(codes, inv), (rsigma,)
    codes, mu, rsigma, _ = backends.dispatch("layernorm_fwd_fp8", x2, ln_weight, ln_bias, eps,
                                             zcg, qi.scale, qi.fmt, amax_out=qi.amax_out,
                                             scale_inv_out=inv)
    return qi.wrap(codes, inv), (mu, rsigma)


def _norm_bwd(d_ln, x2, stats, ln_weight, zcg, partial):
    """-> (dx, dgamma, dbeta or None) of _norm_fp8; dx with `partial` (x's gradient from
    its other consumers: the residual's, tape.record's partial; None if none) added in the
    norm's pass."""
    dres = None if partial is None else as_2d(partial, *x2.shape)
    if len(stats) == 1:
        dx, dg = backends.dispatch("rmsnorm_bwd", d_ln, x2, stats[0], ln_weight, zcg, dres)
        return dx, dg, None
    return backends.dispatch("layernorm_bwd", d_ln, x2, *stats, ln_weight, zcg, dres)


def _gemm_fp8(qx, weight, q, out_dtype, bias, residual=None, qweight=None):
    """qx @ weight.T (+ bias) (+ residual [M, N], fusable_residual's) with weight cast by
    q.weight (or its kept codes qweight, where given) -> (y, what its backward keeps, as
    released() reads it). The backward reads only qx's column-wise copy (wgrad): where the
    cast made one beside the row-wise codes (block scaling, a cast with transpose), only that
    copy is kept, so the row-wise codes die with the caller's qx after this GEMM, not at the
    backward (fc2's input under block scaling: 128 MiB at the quickstart layer); a
    producer's row-wise codes (delayed scaling) are kept and transposed in the backward."""
    qw = weight_fp8(q.weight, weight, True, qweight)
    return fp8_gemm(qx, qw, out_dtype, bias, residual=residual), kept_operands(qx, qw)


def kept_operands(qx, qw):
    """What a fused block's backward keeps of a forward GEMM's FP8 operands (released()
    takes it): [qx's column-wise copy where the cast made one, else its row-wise codes;
    the weight's column-wise copy; whether the first is column-wise]."""
    col = qx.data_t is not None
    return [qx.columnwise() if col else qx, qw.columnwise(), col]


def _norm_linear_fp8(x, ln_weight, ln_bias, weight, bias, eps, zcg, rms, q, qweight=None):
    n, k = weight.shape
    m = x.size // k
    check_fp8_dims("layernorm_linear", m, n, k)
    x2 = as_2d(x, m, k)
    qx, stats = _norm_fp8(x2, ln_weight, ln_bias, eps, zcg, rms, q.input)
    y, saved = _gemm_fp8(qx, weight, q, x.dtype, bias, None, qweight)
    y = as_nd(y, x.shape[:-1] + (n,))
    del qx

    def backward(dy, partial=None):
        d_ln, dw, db = fp8_linear_backward(as_2d(dy, m, n), released(saved), bias,
                                           q.grad_output, x.dtype)
        dx, dg, dbeta = _norm_bwd(d_ln, x2, stats, ln_weight, zcg, partial)
        return as_nd(dx, x.shape), dg, dbeta, dw.astype(weight.dtype, copy=False), db
    record(backward, (x, ln_weight, ln_bias, weight, bias), (y,),
           after_backward=q.after_backward, once=q.once, partial=0)
    return y


def layernorm_linear(x, ln_weight, ln_bias, weight, bias=None, eps=1e-5,
                     zero_centered_gamma=False, normalization="LayerNorm",
                     return_layernorm_output=False, fp8_state=None, qweight=None):
    """linear(norm(x), weight, bias); norm is LayerNorm or RMSNorm (ln_bias None). Under
    FP8 delayed scaling with `fp8_state`, the norm casts its output to FP8 in its own pass.
    qweight: None or weight's kept FP8Tensor, read instead of casting weight (linear's)."""
    op = "layernorm_linear"
    xp, eps, zcg, ret = _check_norm(op, x, ln_weight, ln_bias, eps, zero_centered_gamma,
                                    normalization, return_layernorm_output, weight=weight,
                                    bias=bias)
    check_shape(op, "weight", weight, (None, x.shape[-1]))
    check_shape(op, "bias", bias, (weight.shape[0],))
    check_fp8_state(op, fp8_state, 0)
    check_qweight(op, "qweight", qweight, weight)
    if not ret:
        return _norm_then_linear(xp, x, ln_weight, ln_bias, weight, bias, eps, zcg,
                                 normalization, fp8_state, 0, qweight)
    ln_out = normalize(x, ln_weight, ln_bias, eps, zcg, normalization)
    return linear(ln_out, weight, bias, fp8_state=fp8_state, qweight=qweight), ln_out


def _check_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, fp8_state):
    op = "layernorm_mlp"
    check_shape(op, "fc1_weight", fc1_weight, (None, x.shape[-1]))
    gated = activation in GATED
    if gated and fc1_weight.shape[0] % 2:
        _check.fail(op, "fc1_weight", f"[2 * ffn, hidden] for {activation} (an even number "
                    "of rows: value and gate halves)", fc1_weight)
    check_shape(op, "fc1_bias", fc1_bias, (fc1_weight.shape[0],))
    ffn = fc1_weight.shape[0] // (2 if gated else 1)
    if fc2_weight.ndim != 2 or fc2_weight.shape[1] != ffn:
        raise ValueError(f"{op}: fc2_weight must be [hidden, {ffn}] for fc1_weight "
                         f"{tuple(fc1_weight.shape)} and {activation}, "
                         f"got {tuple(fc2_weight.shape)}")
    check_shape(op, "fc2_bias", fc2_bias, (fc2_weight.shape[0],))
    check_fp8_state(op, fp8_state, 0, num_gemms=2)


def layernorm_mlp(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                  eps=1e-5, zero_centered_gamma=False, normalization="LayerNorm",
                  activation="gelu", return_layernorm_output=False, fp8_state=None,
                  residual=None, fc1_qweight=None, fc2_qweight=None):
    """fc2(act(fc1(norm(x)))) (+ residual). fc1_weight [ffn, hidden] ([2*ffn, hidden] for
    the gated swiglu/geglu), fc2_weight [hidden, ffn]. residual: None or an array that adds
    to the output (x itself for a pre-norm block's residual connection); in FP8 the add runs
    in fc2's GEMM epilogue where it can (linear.py's residual), with the same bits.
    fc1_qweight, fc2_qweight: None or the weights' kept FP8Tensors (linear's qweight)."""
    _check.choice("layernorm_mlp", "activation", activation, ACTIVATIONS)
    xp, eps, zcg, ret = _check_norm(
        "layernorm_mlp", x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization,
        return_layernorm_output, fc1_weight=fc1_weight, fc1_bias=fc1_bias,
        fc2_weight=fc2_weight, fc2_bias=fc2_bias)
    _check_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, fp8_state)
    check_qweight("layernorm_mlp", "fc1_qweight", fc1_qweight, fc1_weight)
    check_qweight("layernorm_mlp", "fc2_qweight", fc2_qweight, fc2_weight)
    qws = (fc1_qweight, fc2_qweight)
    # fc1's bias is added inside the activation's pass, not by the GEMM
    q1, q2 = _fused_mlp_quantizers(xp, fp8_state, activation, ret)
    if q1 is not None:
        return _mlp_fp8(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, eps,
                        zcg, normalization == "RMSNorm", activation, q1, q2, residual, qws)
    if ret:
        ln_out = normalize(x, ln_weight, ln_bias, eps, zcg, normalization)
        h = linear(ln_out, fc1_weight, None, fp8_state=fp8_state, gemm_index=0,
                   qweight=fc1_qweight)
    else:
        h = _norm_then_linear(xp, x, ln_weight, ln_bias, fc1_weight, None, eps, zcg,
                              normalization, fp8_state, 0, fc1_qweight)
    y = _act_then_linear(xp, h, fc1_bias, activation, fc2_weight, fc2_bias, fp8_state,
                         residual, fc2_qweight)
    return (y, ln_out) if ret else y


# dtypes for which layernorm_mlp's gelu backward runs as the epilogue of fc2's dgrad GEMM
# (the FP8 GEMM has it for 16-bit outputs), written over h: 256 MiB less at the quickstart
# layer's peak (1.47 -> 1.22 GiB on an H100), but the epilogue does not overlap the MMAs
# yet and costs more than the one-pass dact cast saves (medium FP8 graphed step 1.87 ->
# 1.97 ms; PERFLOG.md, session 14). The transient it saves is one layer's, once per step,
# however deep the model. Off until the epilogue overlaps: (np.dtype(np.float16), bfloat16).
DGELU_EPILOGUE = ()


def _fused_mlp_quantizers(xp, fp8_state, activation, ret):
    """fc1's and fc2's quantizers where layernorm_mlp runs as one node (_mlp_fp8): a plain
    activation whose output and backward are cast in the activation's pass (fuses_act:
    delayed scaling's producers, whose scale is known before the data; block scaling's
    kernels, which read the activation's input); the norm's output cast by the norm where
    the quantizer lets it (fused_ok); else (None, None)."""
    if ret or activation in GATED:
        return None, None
    q1 = gemm_quantizers(fp8_state, 0, xp)
    if q1 is None or not q1.grad_output.fuses_act:
        return None, None
    q2 = gemm_quantizers(fp8_state, 1, xp)
    return (q1, q2) if q2.input.fuses_act else (None, None)


def _mlp_fp8(x, ln_weight, ln_bias, w1, b1, w2, b2, eps, zcg, rms, activation, q1, q2,
             residual=None, qws=(None, None)):
    """layernorm_mlp as one node, each cast in its producer's pass: the norm writes fc1's
    input codes (where fused_ok; else its output is quantized), the activation (with fc1's
    bias) fc2's, and in the backward the activation's backward writes fc1's dy codes with
    their transposed copy and dbias (quantize_dact): dh never exists in high precision
    (issue 21: one pass over [M, ffn] less; issue 22: h dies as soon as that cast has read
    it). residual: added in fc2's epilogue where it can (else by the add op after this
    node); x itself (the pre-norm block's residual) gets its dy in the norm backward's
    pass, as the add op's would."""
    hidden, ffn = x.shape[-1], w1.shape[0]
    m = x.size // hidden
    check_fp8_dims("layernorm_mlp", m, ffn, hidden)
    check_fp8_dims("layernorm_mlp (fc2)", m, hidden, ffn)
    x2 = as_2d(x, m, hidden)
    qx, stats = _norm_fp8(x2, ln_weight, ln_bias, eps, zcg, rms, q1.input)
    h, saved1 = _gemm_fp8(qx, w1, q1, x.dtype, None, None, qws[0])
    del qx
    # (fuses_act: never None here; the column-wise copy too, for wgrad: kept_operands)
    qa = q2.input.quantize_act(h, b1, activation, transpose=keeping())
    r2 = fusable_residual(residual, x, x.shape) if q2.input.residual_epilogue else None
    y, saved2 = _gemm_fp8(qa, w2, q2, x.dtype, b2, r2, qws[1])
    kept = [h]
    fused, own = r2 is not None, residual is x  # (own: dy is x's gradient too)
    del h, qa, r2

    def backward(dy, partial=None):
        h = kept[0] if retaining() else kept.pop()
        dy2, g, db_dtype = as_2d(dy, m, hidden), q1.grad_output, None if b1 is None else b1.dtype
        if activation == "gelu" and x.dtype in DGELU_EPILOGUE:
            # gelu's backward in fc2's dgrad epilogue (TE's DGELU), dh written over h (unless
            # the graph is retained): no [M, ffn] array beside h (issue 22)
            dh, dw2, db2 = fp8_linear_backward(dy2, released(saved2), b2, q2.grad_output,
                                               x.dtype, dgelu=(h, b1, not retaining()))
            del h
            qdh = g.quantize(dh, transpose=True, dbias_dtype=db_dtype)
            qdh, db1 = (qdh, None) if b1 is None else qdh
            del dh
        else:  # the activation's backward cast in one pass, from fc2's dgrad output
            qdh, db1, dw2, db2 = _dgrad_dact(dy2, saved2, b2, q2.grad_output, h, b1,
                                             activation, g, x.dtype)
            del h
        held = [qdh]
        del qdh
        d_ln, dw1 = fp8_grads(held, released(saved1), x.dtype)
        if fused and own:  # the residual's dy joins x's other gradients in the norm's pass
            partial = dy if partial is None else backends.dispatch("add_fwd", partial, dy)
        dx, dg, dbeta = _norm_bwd(d_ln, x2, stats, ln_weight, zcg, partial)
        return (as_nd(dx, x.shape), dg, dbeta, dw1.astype(w1.dtype, copy=False), db1,
                dw2.astype(w2.dtype, copy=False), db2) + ((dy,) if fused and not own else ())
    y = as_nd(y, x.shape)
    inputs = (x, ln_weight, ln_bias, w1, b1, w2, b2)
    record(backward, inputs + ((residual,) if fused and not own else ()), (y,),
           after_backward=q1.after_backward + q2.after_backward, once=q1.once, partial=0)
    return y if residual is None or fused else add(y, residual)


# fc2's dgrad output [M, ffn] (the activation's output gradient) is made and cast in column
# chunks of at most this many bytes (issue 22: 256 MiB at the quickstart layer, in one piece
# the largest transient of its backward); smaller ones in one piece
DACT_CHUNK_BYTES = 64 << 20


def _dgrad_dact(dy2, saved2, b2, q_dy, h, b1, activation, g, dtype):
    """fc2's backward and the activation's backward cast: dy cast (and fc2's dbias), then
    dact_grads -> (FP8Tensor of dh, db1, dw2, db2)."""
    qdy, db2 = fp8_dy(q_dy, dy2, b2)
    held = [qdy]
    del qdy
    qdh, db1, dw2 = dact_grads(held, released(saved2), h, b1, activation, g, dtype)
    return qdh, db1, dw2, db2


def dact_grads(held, saved2, h, b1, activation, g, dtype):
    """fc2's wgrad from held = [dy's FP8 tensor] and saved2 = [its input's column-wise copy,
    the weight's] (both lists emptied: the activation's codes die after wgrad), then its
    dgrad column chunk by column chunk, each cast with its columns of h by the quantizer g
    in the activation's backward (fp8.dact_cast_chunked, with fc1's dbias) -> (FP8Tensor of
    dh, db1, dw2)."""
    qdy = held.pop()
    qa_t, qw_t = saved2
    saved2.clear()
    dw2 = fp8_gemm(qdy.T, qa_t, dtype, split_accumulator=True)
    del qa_t
    qdy = qdy.rowwise()  # (dy's column-wise copy is wgrad's: dead now)
    m, ffn = h.shape
    chunk = max(64, DACT_CHUNK_BYTES // (m * h.itemsize) // 64 * 64)

    def dgrad(c0, c1):  # dy's columns c0:c1 = qdy @ (rows c0:c1 of w2's transposed codes).T
        return fp8_gemm(qdy, qw_t.rows(c0, c1), dtype, split_accumulator=True)
    db_dtype = None if b1 is None else b1.dtype
    qdh, db1 = g.quantize_dact(dgrad, h, b1, activation, db_dtype, chunk)
    return qdh, db1, dw2


def _act_then_linear(xp, h, fc1_bias, activation, fc2_weight, fc2_bias, fp8_state,
                     residual=None, qweight=None, comm=None):
    """linear(act(h + fc1_bias)) (+ residual); where fc2's input quantizer casts the
    activation's output in its pass (quantize_act: delayed scaling with a state, block
    scaling), it goes straight to FP8 for fc2 and this records one node for both. comm
    (that node only, no bias or residual; else None is returned): fc2's output is reduced
    inside the node by comm.reduce(y2) (a row-parallel GEMM's reduce-scatter, to
    comm.rows(M) rows) and its gradient arrives as comm.dy(dy's quantizer, dy2)
    (all-gathered as FP8 codes: distributed/fp8_gather.py)."""
    q = gemm_quantizers(fp8_state, 1, xp)
    if comm is not None and (q is None or not q.input.fused_ok or fc2_bias is not None
                             or residual is not None or not comm.takes(q.grad_output)):
        return None
    n, k = fc2_weight.shape
    m = h.size // h.shape[-1]
    qa = None
    if q is not None:
        check_activation(activation, h, fc1_bias)
        check_fp8_dims("layernorm_mlp (fc2)", m, n, k)
        h2 = as_2d(h, m, h.shape[-1])
        # (delayed: amax maxed in; the column-wise copy too, for wgrad: kept_operands)
        qa = q.input.quantize_act(h2, fc1_bias, activation, transpose=keeping())
    if qa is None:
        a = apply_activation(h, activation, bias=fc1_bias)
        return linear_with(a, fc2_weight, fc2_bias, q, residual, qweight)
    qw = weight_fp8(q.weight, fc2_weight, True, qweight)
    r2 = fusable_residual(residual, h, h.shape[:-1] + (n,))
    y2 = fp8_gemm(qa, qw, h.dtype, fc2_bias, residual=r2)
    rows = m if comm is None else comm.rows(m)
    y = as_nd(y2 if comm is None else comm.reduce(y2), (h.shape[0] * rows // m,)
              + h.shape[1:-1] + (n,))
    saved = kept_operands(qa, qw)
    fused = r2 is not None
    del r2, y2

    def backward(dy):
        if comm is None:
            da, dw, db2 = fp8_linear_backward(as_2d(dy, m, n), released(saved), fc2_bias,
                                              q.grad_output, h.dtype)
        else:
            da, dw = fp8_grads([comm.dy(q.grad_output, as_2d(dy, rows, n))],
                               released(saved), h.dtype)
            db2 = None
        # dh in da's place where shapes allow (plain activations): no third [M, ffn] array
        # beside h and da (issue 22)
        dh, db1 = backends.dispatch(f"{activation}_bwd", da, h2, fc1_bias,
                                    out=None if activation in GATED else da)
        return (as_nd(dh, h.shape), db1, dw.astype(fc2_weight.dtype, copy=False), db2) + (
            (dy,) if fused else ())
    record(backward, (h, fc1_bias, fc2_weight, fc2_bias) + ((residual,) if fused else ()),
           (y,), after_backward=q.after_backward, once=q.once)
    return y if residual is None or fused else add(y, residual)
