"""CUDA block quantization (Float8BlockScaling): cuda/block_scaling.cu.

block_quantize(x, fmt, block_dim, power_2_scale, amax_epsilon, transpose) -> (codes,
scale_inv, codes_t or None, scale_inv_t or None), bit for bit the reference's
(reference/block_scaling.py, which documents the layouts): one launch reads x once and
writes the row-wise codes and, with transpose, the column-wise copy, each with its own
block scales.

fp8_block_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias, ...): the
Hopper FP8 GEMM (cutlass_templates/fp8_gemm.cu, fp8_block_gemm_tn) with the block factors
applied at each promotion over 128 of K, launched through kernels/fp8_gemm.py's plans; the
reference (reference/block_scaling.py) runs what it does not take (supports() says what).
"""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from ..fp8 import FP8Format
from ..reference.block_scaling import BLOCK, block_dim_of, value_for_inf
from . import fp8_gemm as G
from .colsum import col_sum
from .dtypes import CTYPE, FP8TYPE, LOW_PRECISION, cbool
from .launch import current_device, planned

FILE = "block_scaling.cu"
loader.declare(FILE, [f"block_quantize<{CTYPE[t]}, {f}, {d}, {p}>" for t, f, d, p in
                      itertools.product(LOW_PRECISION, FP8TYPE.values(), ("false", "true"),
                                        ("false", "true"))]
               + [f"block_quantize<{CTYPE[t]}, {f}, false, {p}, true>" for t, f, p in
                  itertools.product(LOW_PRECISION, FP8TYPE.values(), ("false", "true"))]
               # the activation's output quantized in its read of h (1x128, E4M3, 16-bit),
               # and its backward's with dbias
               + [f"block_quantize<{CTYPE[t]}, __nv_fp8_e4m3, false, {p}, {d}, Gelu{b}>"
                  for t, p, (d, b) in itertools.product(
                      LOW_PRECISION[1:], ("false", "true"),
                      (("false", ""), ("true", ", true"), ("false", ", true")))])


def _supported(x, fmt, block_dim, *args, **kwargs):
    """2-D CuPy float32 / float16 / bfloat16, rows and cols multiples of 8 (whole 8 x 8
    thread pieces, 8-byte code stores), 16-byte aligned; else the reference runs."""
    return (is_cupy(x) and x.ndim == 2 and x.dtype in LOW_PRECISION and x.shape[0] % 8 == 0
            and x.shape[1] % 8 == 0 and x.flags.c_contiguous and x.data.ptr % 16 == 0)


@backends.register("block_quantize", "cuda", supports=_supported)
def block_quantize(x, fmt, block_dim, power_2_scale=True, amax_epsilon=0.0, transpose=False):
    return _quantize(x, fmt, block_dim, power_2_scale, amax_epsilon, transpose)


@backends.register("block_quantize_dbias", "cuda",
                   supports=lambda x, *args: _supported(x, None, 1))
def block_quantize_dbias(x, fmt, power_2_scale, amax_epsilon, dbias_dtype):
    """block_quantize (1x128 blocks, both copies) and dbias from the same read of x: the
    kernel's per 128-row tile column sums, then colsum.col_sum's sum of them in
    dbias_dtype (cast_transpose_dbias's two stages)."""
    return _with_dbias(x, dbias_dtype, lambda part: _quantize(
        x, fmt, 1, power_2_scale, amax_epsilon, True, part))


def _with_dbias(x, dbias_dtype, run):
    """run(part) + (dbias,): part the [ceil(rows / 128), cols] float32 tile sums the DBIAS
    kernel writes (None where dbias_dtype is None, or x is empty), dbias their col_sum in
    dbias_dtype (None without it; zeros for no rows)."""
    import cupy
    if dbias_dtype is None:
        return run(None) + (None,)
    if x.size == 0:  # (no launch: zero sums)
        return run(None) + (cupy.zeros((x.shape[1],), dbias_dtype),)
    part = cupy.empty((-(-x.shape[0] // BLOCK), x.shape[1]), np.float32)
    return run(part) + (col_sum(part, dbias_dtype),)


def _act_supported(h, bias, name, fmt, block_dim, *args):
    """A plain activation (cuda/act_math.cuh's struct), block_quantize's inputs, a bias of
    h's dtype and columns, contiguous, or none."""
    from ..activation_table import TABLE
    act = TABLE.get(name)
    return (act is not None and not act.gated and _supported(h, fmt, block_dim)
            and (bias is None or (is_cupy(bias) and bias.dtype == h.dtype
                                  and bias.shape == (h.shape[1],)
                                  and bias.flags.c_contiguous)))


@backends.register("block_quantize_act", "cuda", supports=_act_supported)
def block_quantize_act(h, bias, name, fmt, block_dim, power_2_scale=True, amax_epsilon=0.0,
                       transpose=False):
    """block_quantize of the activation's output act(h + bias) (in h's dtype), computed in
    the kernel's read of h: no array of it."""
    from ..activation_table import TABLE
    return _quantize(h, fmt, block_dim, power_2_scale, amax_epsilon, transpose,
                     act=(TABLE[name].cuda, bias))


_named = set()  # kernel names _quantize has seen declared (no declared() dict per call)


def _dact_supported(dy, h, bias, name, fmt, *args):
    """block_quantize_act's inputs (h, bias, a plain activation), dy of h's shape and dtype,
    contiguous and 16-byte aligned."""
    return (_act_supported(h, bias, name, fmt, 1) and is_cupy(dy) and dy.shape == h.shape
            and dy.dtype == h.dtype and dy.flags.c_contiguous and dy.data.ptr % 16 == 0)


@backends.register("block_quantize_dact", "cuda", supports=_dact_supported)
def block_quantize_dact(dy, h, bias, name, fmt, power_2_scale, amax_epsilon, dbias_dtype):
    """block_quantize (1x128 blocks, both copies) of the activation's backward dx = dy *
    act'(h + bias) in dy's dtype, computed in the kernel's read of dy and h (dx never in
    memory), and dbias of dx where dbias_dtype (None: none) -> (codes, scale_inv, codes_t,
    scale_inv_t, dbias or None)."""
    from ..activation_table import TABLE
    act = (TABLE[name].cuda, bias)
    return _with_dbias(dy, dbias_dtype, lambda part: _quantize(
        dy, fmt, 1, power_2_scale, amax_epsilon, True, part, act, h))


def _quantize(x, fmt, block_dim, power_2_scale, amax_epsilon, transpose, part=None,
              act=None, h=None):
    """block_quantize's launch; part: None, or [ceil(rows / 128), cols] float32 for the
    tiles' column sums (1x128 blocks, transpose: the DBIAS kernel); act: None, or (the
    activation's struct, its bias or None): x is h (the ACT kernel), or with h given x is
    dy and h the activation's input (the BWD kernel: its dx quantized)."""
    import cupy
    rows, cols = x.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    q = cupy.empty((rows, cols), np.uint8)
    qt = cupy.empty((cols, rows), np.uint8) if transpose else None
    if block_dim == 2:
        s = cupy.empty((nr, nc), np.float32)
        st = cupy.empty((nc, nr), np.float32) if transpose else None
    else:
        s = cupy.empty((nc, rows), np.float32)
        st = cupy.empty((nr, cols), np.float32) if transpose else None
    if x.size:
        extra = ([] if part is None and act is None else [cbool(part is not None)]) + (
            [] if act is None else [act[0]]) + ([] if h is None else ["true"])
        name = (f"block_quantize<{CTYPE[x.dtype]}, {FP8TYPE[fmt.name]}, "
                f"{cbool(block_dim == 2)}, {cbool(power_2_scale)}"
                + "".join(", " + e for e in extra) + ">")
        if name not in _named:  # (a kernel not declared above, e.g. relu's: on first use)
            if name not in loader.declared().get(FILE, ()):
                loader.declare(FILE, [name])
            _named.add(name)
        k = loader.function(FILE, name)
        null, abias = np.uint64(0), None if act is None else act[1]
        k((nc, nr), (256,), (x, q, s, null if qt is None else qt, null if st is None else st,
                             np.int32(rows), np.int32(cols), np.float32(fmt.max),
                             np.float32(amax_epsilon), value_for_inf(x.dtype),
                             null if part is None else part, null if abias is None else abias,
                             null if h is None else h))
    return q, s, qt, st


# ---- the block GEMM ----------------------------------------------------------------------
def _gemm_names():
    """The block GEMMs built ahead of a first call (others compile on theirs): E4M3 x E4M3
    (the recipe's default) and E5M2 x E4M3 (HYBRID's dgrad and wgrad), both split
    configurations; 128x128 B (fprop, dgrad: the weight) plain or with a bias, and gelu's
    backward; 1x128 B (wgrad: x's column-wise copy) plain."""
    for pair in (("e4m3", "e4m3"), ("e5m2", "e4m3")):
        for config, _ in G.DEFAULTS[True]:
            for out in G._OUT:
                for epi in (0, 1):
                    yield G.kernel_name(*pair, out, epi, False, config, 2)
                yield G.kernel_name(*pair, out, 0, False, config, 1)
            for out in G._OUT[1:]:
                yield G.kernel_name(*pair, out, 3, False, config, 2)
    yield from _residual_names(False)


def _residual_names(pipe):
    """The residual add in the epilogue (4 none, 5 bias): forward GEMMs (E4M3 codes, 128x128
    B: the weight) with a 16-bit output, as the layer's proj and fc2 run."""
    for config, _ in G.DEFAULTS[True]:
        for out in G._OUT[1:]:
            for epi in (4, 5):
                yield G.kernel_name("e4m3", "e4m3", out, epi, False, config, 2, pipe)


def _pipe_names():
    """The pipelined kernels (fp8_gemm.BLOCK_PIPELINE) of the same GEMMs."""
    for pair in (("e4m3", "e4m3"), ("e5m2", "e4m3")):
        for config, _ in G.DEFAULTS[True]:
            for out in G._OUT:
                for epi in (0, 1):
                    yield G.kernel_name(*pair, out, epi, False, config, 2, True)
                yield G.kernel_name(*pair, out, 0, False, config, 1, True)
            for out in G._OUT[1:]:
                yield G.kernel_name(*pair, out, 3, False, config, 2, True)
    yield from _residual_names(True)


loader.declare(G.FILE, list(_gemm_names()) + list(_pipe_names()), archs=("sm_90a",),
               options=G.OPTIONS)


def _gemm_supported(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None,
                    out=None, accumulate=False, split_accumulator=True, out_scale=None,
                    amax_out=None, gelu=False, dgelu_aux=None, residual=None):
    """What the split-accumulating FP8 GEMM takes (fp8_gemm.supported: a Hopper GPU, 2-D
    CuPy codes, K % 16 == 0, N % 8 == 0, contiguous 16-byte aligned operands; a float32,
    float16 or bfloat16 output, no FP8 output, no gelu forward epilogue), with float32 CuPy
    scales in a block layout of their operand: any M, a K tail past the last 128 (TMA zero-
    fills it), either operand's blocks 1x128 or 128x128. A residual: a fresh 16-bit output,
    E4M3 codes, 128x128 B (the forward GEMMs' kernels built with it)."""
    if not (is_cupy(a_scale_inv) and is_cupy(b_scale_inv)
            and a_scale_inv.dtype == np.float32 and b_scale_inv.dtype == np.float32):
        return False
    if not G.supported(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias, out,
                       accumulate, True, out_scale, amax_out, gelu, dgelu_aux):
        return False
    if residual is not None and not (
            out is None and dgelu_aux is None and not accumulate
            and not isinstance(out_dtype, FP8Format) and np.dtype(out_dtype).itemsize == 2
            and a_fmt.name == b_fmt.name == "e4m3"
            and G._residual_ok(residual, out_dtype, a.shape[0], b.shape[0])):
        return False
    try:
        block_dim_of(a.shape, a_scale_inv.shape)
        dim_b = block_dim_of(b.shape, b_scale_inv.shape)
    except ValueError:
        return False
    # 1x128 B: its factors reach shared memory by bulk copies of 16-byte aligned rows (a
    # non-contiguous array is copied into a fresh, aligned one)
    if dim_b == 2:
        return True
    return residual is None and (not b_scale_inv.flags.c_contiguous
                                 or b_scale_inv.data.ptr % 16 == 0)


_gemm_plans = {}  # (shape, formats, B's blocks, output, epilogue, device) -> launch plan


@backends.register("fp8_block_gemm", "cutlass", supports=_gemm_supported)
def fp8_block_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None,
                   out=None, accumulate=False, split_accumulator=True, out_scale=None,
                   amax_out=None, gelu=False, dgelu_aux=None, residual=None):
    """The reference's fp8_block_gemm on the GPU: D = sum over 128-blocks kb of K of
    (a_kb . b_kb^T) * sa[m, kb] * sb[n, kb], accumulated in float32 (split accumulation
    always: split_accumulator is accepted and ignored), then bias, the output dtype,
    accumulate into `out`, dgelu_aux or the residual add as fp8_gemm's epilogue."""
    import cupy
    (m, k), n = a.shape, b.shape[0]
    dim_b = block_dim_of(b.shape, b_scale_inv.shape, "fp8_block_gemm (b)")
    act = ("dgelu" if dgelu_aux is not None else None if residual is None
           else "residual" if G.RESIDUAL_PREFETCH else "residual, no prefetch")
    key = (m, n, k, a_fmt.name, b_fmt.name, dim_b, out_dtype, bias is None, accumulate, act,
           current_device(), G.BLOCK_PIPELINE, G.launch_module.margin())
    plan, pipe = planned(_gemm_plans, key, _gemm_plan, m, n, k, a_fmt, b_fmt, dim_b,
                         out_dtype, bias is None, accumulate, act)
    sa = _a_factors(a.shape, a_scale_inv)
    if pipe and sa.data.ptr % 16:  # its rows go by bulk copies: 16-byte aligned
        sa = sa.copy()
    sb = pipe_b_factors(b_scale_inv) if pipe and dim_b == 2 else b_scale_inv
    return G._run(plan, a, sa, b, cupy.ascontiguousarray(sb), bias, out, None,
                  None, residual if dgelu_aux is None else dgelu_aux)


def pipe_b_factors(scale_inv):
    """128x128-block factors [ceil(N / 128), nk] as the pipelined kernel reads them: rows of
    a multiple of 4 floats, 16-byte aligned (each row goes by one bulk copy); the array
    itself where it is so already (nk % 4 == 0: K a multiple of 512), else a padded copy."""
    import cupy
    rows, nk = scale_inv.shape
    if nk % 4 == 0 and scale_inv.flags.c_contiguous and scale_inv.data.ptr % 16 == 0:
        return scale_inv
    out = cupy.zeros((rows, -(-nk // 4) * 4), np.float32)
    out[:, :nk] = scale_inv
    return out


def _gemm_plan(m, n, k, a_fmt, b_fmt, dim_b, out_dtype, no_bias, accumulate, act):
    """(launch plan, pipelined?): the per-tensor split GEMM's default tile for this shape,
    K included (with K <= SHORT_K the 256-wide tile's 1.0 speed holds for block scaling too:
    H100, PERFLOG.md session 28; with longer K and 128x128 B, BLOCK_LONG_K_SPEED's 0.98:
    session 31), as a block-scaled kernel; the pipelined one
    (fp8_block_gemm_pipe_tn) where BLOCK_PIPELINE is on and it takes the call: M % 4 == 0
    (A's factor rows go by 16-byte bulk copies) and, with B in 128x128 blocks, its B-factor
    tables (two of 2 x K / 128 floats) fit in shared memory."""
    config = G.default_config(m, n, True, k=k, block=dim_b == 2)
    staged = not isinstance(out_dtype, FP8Format) and G.tma_store(out_dtype, act, accumulate,
                                                                  config[0])
    pipe = (G.BLOCK_PIPELINE and m % 4 == 0
            and G.smem_bytes(config, staged, dim_b, k) <= G.SMEM_MAX)
    return G._plan(config, a_fmt, b_fmt, out_dtype, no_bias, accumulate, act, m, n, k,
                   scale=dim_b, pipe=pipe, pdl=GEMM_PDL), pipe


# The block GEMM launched with PDL (its set-up overlapping the kernel before): the quickstart
# layer's step under Float8BlockScaling was 0.2 ms slower with it (H100, session 19: 13.34
# vs 13.14 ms graphed), where the per-tensor GEMM's step does not move. Off.
GEMM_PDL = False


def _a_factors(shape, scale_inv):
    """A's factors as the kernel reads them, [ceil(K / 128), M] float32 (1x128 blocks: the
    array itself, when contiguous); 128x128 blocks (x_ or grad_block_scaling_dim 2) are
    spread to every row of their block (a copy)."""
    import cupy
    if block_dim_of(shape, scale_inv.shape, "fp8_block_gemm (a)") == 1:
        return cupy.ascontiguousarray(scale_inv)
    return cupy.ascontiguousarray(cupy.repeat(scale_inv.T, BLOCK, axis=1)[:, :shape[0]])
