"""CUDA fused attention (cuda/attention.cu; on Hopper cuda/attention_sm90.cu) against the
float64 reference: the output, lse and all three gradients, by flash-attention's rule
(error at most 2x the error of the reference run in the same low precision, plus one unit of
the format's precision at the data's largest value: the kernel rounds P and dS to the input
dtype before the second matrix product, as FlashAttention does; the reference rounds only
its result). The deterministic backward (kernels.attention.deterministic()): its selection
and turn order on the CPU, its bits on the GPU."""
import ml_dtypes
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.kernels import attention as kernel
from tecupy.ops.attention import MASKS
from conftest import asnp, assert_within_2x_reference, f64, run

gpu = pytest.mark.gpu

DTYPES = [np.float16, tecupy.bfloat16]
CASES = {  # (b, sq, skv, h, hk, d, dropout), each under every mask type; tiles: 128/64 rows
    "gqa-d64": (2, 77, 131, 4, 2, 64, 0.0),
    "mha-d128": (2, 131, 77, 2, 2, 128, 0.0),
    "mqa-d128": (3, 200, 150, 4, 1, 128, 0.0),
    "gqa-d64-long": (3, 150, 270, 4, 2, 64, 0.0),
    "mqa-d128-long": (1, 300, 333, 2, 1, 128, 0.0),
    "gqa-d128-dropout": (2, 77, 131, 4, 2, 128, 0.1),
    "mha-d64-dropout": (2, 131, 77, 2, 2, 64, 0.1),
    # 18 (head, batch) pairs: causal blocks run longest first in groups of 8 pairs
    # (attention_common.cuh's longest_first), two whole groups and a part
    "mha-d128-pairs": (3, 140, 140, 6, 6, 128, 0.0),
}
UNPADDED = [name for name, mask in MASKS.items() if not mask.padding]


def _lengths(rng, b, s):
    """Uneven lengths: the full length, 0 (an empty sequence), then random ones."""
    lens = rng.integers(1, s + 1, size=b)
    lens[0] = s
    lens[1 % b] = 0 if b > 2 else lens[1 % b]
    return lens.astype(np.int32)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_fwd_bwd(rng, dtype, case, mask):
    _check(rng, dtype, case, mask)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("variant", kernel.FWD_VARIANTS, ids=str)
@pytest.mark.parametrize("case", ["mha-d128", "gqa-d64-long", "mha-d64-dropout"])
def test_attention_forward_variants(rng, monkeypatch, variant, case, mask):
    """Every forward variant (kernels.attention.FWD_VARIANTS; CONFIG picks one)."""
    monkeypatch.setitem(kernel.CONFIG, "fwd", variant)
    _check(rng, tecupy.bfloat16, case, mask)


@gpu
@pytest.mark.parametrize("det", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("variant", kernel.BWD_VARIANTS)
@pytest.mark.parametrize("case", ["gqa-d64", "mqa-d128", "mha-d64-dropout"])
def test_attention_backward_variants(rng, monkeypatch, variant, case, mask, det):
    """Both backward kernels (CONFIG["bwd"]; "sm90" runs on Hopper without dropout, else
    mma.sync's), dQ added by float reductions in any order or in turns (deterministic)."""
    monkeypatch.setitem(kernel.CONFIG, "bwd", variant)
    monkeypatch.setitem(kernel.CONFIG, "deterministic", det)
    _check(rng, tecupy.bfloat16, case, mask)


# b2 h8 s2048 d128: 16 KV blocks x 8 heads x 2 = 256 blocks (more than an H100 or H200 holds
# at once: some turns wait on blocks not yet started), 16 parts into each query block
DET_SHAPE = (2, 2048, 8, 128)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("variant", kernel.BWD_VARIANTS)
def test_deterministic_backward_is_bit_identical(rng, monkeypatch, variant, mask):
    """Deterministic mode at a size with many blocks: two eager backward runs and the replay
    of a CUDA graph of it give the same bits (dq too), within the float64 reference's
    tolerance (references on the GPU: float64, and the inputs' bf16 with float32 maths)."""
    import cupy
    from tecupy.reference import attention as ref
    monkeypatch.setitem(kernel.CONFIG, "bwd", variant)
    monkeypatch.setitem(kernel.CONFIG, "deterministic", True)
    b, s, h, d = DET_SHAPE
    do, q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, d)).astype(tecupy.bfloat16))
                   for _ in range(4))
    lens = cupy.asarray(_lengths(rng, b, s)) if MASKS[mask].padding else None
    tail = [float(rng.uniform(0.5, 2) / np.sqrt(d)), MASKS[mask], lens, lens, 0.0, None]
    o, lse = backends.dispatch("attention_fwd", q, k, v, *tail)
    args = (do, q, k, v, o, lse)
    first = backends.dispatch("attention_bwd", *args, *tail)
    second = backends.dispatch("attention_bwd", *args, *tail)
    step = tecupy.make_graphed_step(lambda *a: backends.dispatch("attention_bwd", *a, *tail),
                                    args)
    step(*args)
    replay = step(*args)
    for name, x, y, z in zip(("dq", "dk", "dv"), first, second, replay):
        for other in (y, z):
            assert cupy.array_equal(x.view(np.uint16), other.view(np.uint16)), name
    x64 = [t.astype(np.float64) for t in (do, q, k, v)]
    o64, lse64 = ref.attention_fwd(*x64[1:], *tail)
    want = ref.attention_bwd(*x64, o64, lse64, *tail)
    lp = ref.attention_bwd(*args[:4], *ref.attention_fwd(q, k, v, *tail), *tail)
    atol = float(ml_dtypes.finfo(tecupy.bfloat16).eps)
    for name, g, w, r in zip(("dq", "dk", "dv"), first, want, lp):
        assert_within_2x_reference(g, w, r, name, atol)


@gpu
@pytest.mark.parametrize("variant", kernel.BWD_VARIANTS)
def test_backward_mode_follows_the_environment(rng, monkeypatch, variant):
    """Nothing set: the float reductions' kernel (Transformer Engine's default);
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: the deterministic one (launch plans made afresh for
    each call, so each looks its kernel up)."""
    import cupy
    names, real = [], kernel._function
    monkeypatch.setattr(kernel, "_function", lambda name, smem, file=kernel.FILE: (
        names.append(name) or real(name, smem, file)))
    monkeypatch.setitem(kernel.CONFIG, "bwd", variant)
    for var in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "TECUPY_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    q = cupy.asarray(rng.standard_normal((1, 130, 2, 64)).astype(tecupy.bfloat16))
    tail = (0.125, MASKS["causal"], None, None, 0.0, None)
    o, lse = backends.dispatch("attention_fwd", q, q, q, *tail)
    for value, det in ((None, "false"), ("0", "true"), ("1", "false")):
        if value is not None:
            monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", value)
        names.clear()
        monkeypatch.setattr(kernel, "_plans", {})
        backends.dispatch("attention_bwd", q, q, q, q, o, lse, *tail)
        assert names[-1].startswith("attention_bwd") and names[-1].endswith(f", {det}>")


def _check(rng, dtype, case, mask_type):
    b, sq, skv, h, hk, d, p = CASES[case]
    mask = MASKS[mask_type]  # the kernels and the reference take the parsed Mask
    q, k, v, do = (rng.standard_normal(shape).astype(dtype) for shape in
                   ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, d), (b, sq, h, d)))
    lq = lkv = None
    if mask.padding:
        lq, lkv = _lengths(rng, b, sq), _lengths(rng, b, skv)[::-1].copy()
    scale = float(rng.uniform(0.5, 2) / np.sqrt(d))
    seed = int(rng.integers(0, 2**63))
    args = [q, k, v, scale, mask, lq, lkv, p, seed]
    atol = float(ml_dtypes.finfo(dtype).eps)
    o, lse = run("attention_fwd", args, True)
    o64, lse64 = run("attention_fwd", f64(args), False)
    o_lp, lse_lp = run("attention_fwd", args, False)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq)
    assert_within_2x_reference(o, o64, o_lp, "o", atol)
    np.testing.assert_allclose(asnp(lse), lse64, rtol=2e-5, atol=2e-5)  # +inf rows equal
    tail = [scale, mask, lq, lkv, p, seed]
    grads = run("attention_bwd", [do, q, k, v, o, lse] + tail, True)
    want = run("attention_bwd", f64([do, q, k, v, o64, lse64]) + tail, False)
    ref_lp = run("attention_bwd", [do, q, k, v, o_lp, lse_lp] + tail, False)
    for name, g, w, r, like in zip(("dq", "dk", "dv"), grads, want, ref_lp, (q, k, v)):
        assert g.dtype == like.dtype and g.shape == like.shape, name
        assert_within_2x_reference(g, w, r, name, atol)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_attention_dropout_reproducible(rng, dtype):
    """The same seed gives the same output; another seed another one."""
    import cupy
    q = cupy.asarray(rng.standard_normal((1, 64, 2, 64)).astype(dtype))
    args = [q, q, q, 0.125, MASKS["no_mask"], None, None, 0.2]
    a = backends.dispatch("attention_fwd", *args, 5)[0]
    assert cupy.array_equal(a, backends.dispatch("attention_fwd", *args, 5)[0])
    assert not cupy.array_equal(a, backends.dispatch("attention_fwd", *args, 6)[0])


@gpu
def test_attention_declines_what_it_cannot_take(rng):
    import cupy
    for dtype, d in ((np.float32, 64), (tecupy.bfloat16, 96)):
        q = cupy.asarray(rng.standard_normal((1, 8, 2, d)).astype(dtype))
        assert backends.chosen("attention_fwd", q, q, q, 0.1, MASKS["causal"], None, None,
                               0.0, None) == "reference"


@gpu
def test_dot_product_attention_sbhd_gqa_tape(rng):
    """The public function through the kernels: sbhd layout, GQA, gradients on the tape."""
    import cupy
    dt = tecupy.bfloat16
    q = cupy.asarray(rng.standard_normal((70, 2, 4, 64)).astype(dt))   # sbhd
    k = cupy.asarray(rng.standard_normal((90, 2, 2, 64)).astype(dt))
    v = cupy.asarray(rng.standard_normal((90, 2, 2, 64)).astype(dt))
    do = cupy.asarray(rng.standard_normal((70, 2, 4, 64)).astype(dt))
    with tecupy.Tape() as tape:
        o = tecupy.dot_product_attention(q, k, v, "causal", qkv_format="sbhd")
    grads = tape.gradient([o], [q, k, v], [do])
    ref = [a.get() for a in (q, k, v, do)]
    r64 = f64(ref)
    with tecupy.Tape() as tape:
        o_ref = tecupy.dot_product_attention(*r64[:3], "causal", qkv_format="sbhd")
    want = tape.gradient([o_ref], r64[:3], [r64[3]])
    with tecupy.Tape() as tape:
        o_lp = tecupy.dot_product_attention(*ref[:3], "causal", qkv_format="sbhd")
    lp = tape.gradient([o_lp], ref[:3], [ref[3]])
    atol = float(ml_dtypes.finfo(dt).eps)
    assert_within_2x_reference(o, o_ref, o_lp, "o", atol)
    for name, g, w, r in zip("qkv", grads, want, lp):
        assert_within_2x_reference(g, w, r, "d" + name, atol)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d, p", [(64, 0.1), (128, 0.0)])
def test_attention_reads_strided_views_in_place(rng, d, p, mask):
    """q, k, v as sbhd slices of one packed projection [s, b, h + 2 hk, d] (what the layer
    has), dO sbhd: the same bits as contiguous bshd copies, and outputs laid out like the
    inputs (o sequence-major, dq, dk, dv slices of one packed buffer: no copies around)."""
    import cupy
    s, b, h, hk = 150, 3, 4, 2
    packed = cupy.asarray(rng.standard_normal((s, b, h + 2 * hk, d)).astype(tecupy.bfloat16))
    do_sbhd = cupy.asarray(rng.standard_normal((s, b, h, d)).astype(tecupy.bfloat16))
    views = [packed[:, :, :h], packed[:, :, h:h + hk], packed[:, :, h + hk:], do_sbhd]
    q, k, v, do = (t.transpose(1, 0, 2, 3) for t in views)  # bshd-shaped views
    lens = cupy.asarray(_lengths(rng, b, s)) if MASKS[mask].padding else None
    args = (0.1, MASKS[mask], lens, lens, p, 1234)
    dense = [cupy.ascontiguousarray(t) for t in (q, k, v, do)]
    o, lse = backends.dispatch("attention_fwd", q, k, v, *args)
    o_c, lse_c = backends.dispatch("attention_fwd", *dense[:3], *args)
    assert o.transpose(1, 0, 2, 3).flags.c_contiguous  # sbhd memory, as q's
    np.testing.assert_array_equal(asnp(o).view(np.uint16), asnp(o_c).view(np.uint16))
    np.testing.assert_array_equal(asnp(lse), asnp(lse_c))
    grads = backends.dispatch("attention_bwd", do, q, k, v, o, lse, *args)
    grads_c = backends.dispatch("attention_bwd", dense[3], *dense[:3], o_c, lse_c, *args)
    for name, g, gc, t in zip("qkv", grads, grads_c, (q, k, v)):
        assert g.strides == t.strides  # laid out as the input: slices of one packed buffer
        if name == "q":  # dQ adds blocks' parts by atomics in any order: equal to rounding
            a, c = asnp(g).astype(np.float32), asnp(gc).astype(np.float32)
            assert np.abs(a - c).max() <= 2.0 ** -7 * np.abs(c).max()
        else:
            np.testing.assert_array_equal(asnp(g).view(np.uint16), asnp(gc).view(np.uint16))


@gpu
@pytest.mark.parametrize("mask", UNPADDED)
def test_attention_takes_size_one_dims_with_stride_zero(rng, mask):
    """x[None] gives the batch dim stride 0 (and x[:, None] the sequence dim): the same bits
    as contiguous copies."""
    import cupy
    qkv = [cupy.asarray(rng.standard_normal((150, 4, 64)).astype(tecupy.bfloat16))
           for _ in range(4)]
    views = [t[None] for t in qkv]
    assert views[0].strides[0] == 0
    dense = [cupy.ascontiguousarray(t).copy() for t in views]
    args = (0.1, MASKS[mask], None, None, 0.0, 0)
    o, lse = backends.dispatch("attention_fwd", *views[:3], *args)
    o_c, lse_c = backends.dispatch("attention_fwd", *dense[:3], *args)
    np.testing.assert_array_equal(asnp(o).view(np.uint16), asnp(o_c).view(np.uint16))
    grads = backends.dispatch("attention_bwd", views[3], *views[:3], o, lse, *args)
    grads_c = backends.dispatch("attention_bwd", dense[3], *dense[:3], o_c, lse_c, *args)
    for g, gc in zip(grads[1:], grads_c[1:]):  # dk, dv: deterministic
        np.testing.assert_array_equal(asnp(g).view(np.uint16), asnp(gc).view(np.uint16))
    short = [t[:, None] for t in qkv[:3]]  # sequence length 1, stride 0
    o1, _ = backends.dispatch("attention_fwd", *short, *args)
    o1_c, _ = backends.dispatch("attention_fwd", *(cupy.ascontiguousarray(t).copy()
                                                   for t in short), *args)
    np.testing.assert_array_equal(asnp(o1).view(np.uint16), asnp(o1_c).view(np.uint16))


@gpu
def test_packed_qkv_gradients_need_no_concatenate(rng):
    """The layer's path: one projection [s, b, (h + 2 hk) d], reshaped and split into q, k, v.
    The backward writes dq, dk, dv as slices of one packed buffer, which the split joins
    without a copy; the result equals the separate arrays' gradients, concatenated."""
    import cupy
    s, b, h, hk, d = 130, 2, 4, 2, 64
    dt = tecupy.bfloat16
    qkv = cupy.asarray(rng.standard_normal((s, b, (h + 2 * hk) * d)).astype(dt))
    do = cupy.asarray(rng.standard_normal((s, b, h, d)).astype(dt))
    with tecupy.Tape() as tape:
        x = tecupy.reshape(qkv, (s, b, h + 2 * hk, d))
        q, k, v = tecupy.split(x, [h, hk, hk], axis=2)
        o = tecupy.dot_product_attention(q, k, v, "causal", qkv_format="sbhd")
    (g,) = tape.gradient([o], [qkv], [do])
    assert g.flags.c_contiguous and g.shape == qkv.shape
    parts = [cupy.ascontiguousarray(t) for t in (q, k, v)]
    with tecupy.Tape() as tape:
        o2 = tecupy.dot_product_attention(*parts, "causal", qkv_format="sbhd")
    grads = tape.gradient([o2], parts, [do])
    want = cupy.concatenate(grads, axis=2).reshape(qkv.shape).astype(np.float32)
    np.testing.assert_array_equal(asnp(o).view(np.uint16), asnp(o2).view(np.uint16))
    err = float(cupy.abs(g.astype(np.float32) - want).max() / cupy.abs(want).max())
    assert err <= 2.0 ** -7, err  # dq's atomics may add in another order


# ---- CPU: choosing the deterministic backward, its launches, its turn order ---------------
@pytest.mark.parametrize("config, env, want", [
    (None, {}, False),
    (None, {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, False),
    (None, {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}, True),
    (None, {"TECUPY_DETERMINISTIC": "1"}, True),
    (None, {"TECUPY_DETERMINISTIC": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}, False),
    (True, {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, True),
    (False, {"TECUPY_DETERMINISTIC": "1"}, False),
])
def test_deterministic_selection(monkeypatch, config, env, want):
    """CONFIG["deterministic"] over TECUPY_DETERMINISTIC over TE's
    NVTE_ALLOW_NONDETERMINISTIC_ALGO (0: deterministic); by default the fast kernels."""
    for var in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "TECUPY_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setitem(kernel.CONFIG, "deterministic", config)
    assert kernel.deterministic() is want


@pytest.mark.parametrize("det", [False, True], ids=["fast", "deterministic"])
def test_backward_launches_without_gpu(monkeypatch, det):
    """The mma.sync backward's launches, CuPy's allocation and the kernels faked: the
    backward's name carries the mode; deterministic, the turn counters (int32, one per batch,
    query head and query block of 64 rows) go to the dot kernel (which zeroes them) and to
    the backward, else a null pointer does."""
    import cupy
    from tecupy import loader
    launched = []

    def fake(file, name):
        return lambda grid, block, args, **kw: launched.append((file, name, grid, args))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: np.empty(shape, dtype))
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32: np.zeros(shape, dtype))
    monkeypatch.setattr(cupy, "ascontiguousarray",
                        lambda a, dtype=None: np.ascontiguousarray(a, dtype))
    monkeypatch.setattr(kernel, "_strided", lambda t: t)
    monkeypatch.setattr(kernel, "grid_1d", lambda *a, **kw: 1)
    monkeypatch.setattr(loader, "function", fake)
    monkeypatch.setattr(kernel, "_function", lambda name, smem, file=kernel.FILE: fake(file, name))
    monkeypatch.setitem(kernel.CONFIG, "bwd", "mma")
    monkeypatch.setitem(kernel.CONFIG, "deterministic", det)
    b, sq, skv, h, hk, d = 2, 130, 200, 4, 2, 64
    q, do, o = (np.zeros((b, sq, h, d), tecupy.bfloat16) for _ in range(3))
    k, v = (np.zeros((b, skv, hk, d), tecupy.bfloat16) for _ in range(2))
    lse = np.zeros((b, h, sq), np.float32)
    kernel.attention_bwd(do, q, k, v, o, lse, 0.1, MASKS["causal"], None, None, 0.0, None)
    (_, dot, _, dot_args), (file, bwd, grid, bwd_args), (_, convert, _, _) = launched
    assert dot == "attention_bwd_dot<__nv_bfloat16, 64>" and convert.startswith("attention_con")
    assert bwd == f"attention_bwd<__nv_bfloat16, 64, 8, true, false, {'true' if det else 'false'}>"
    assert bwd in loader.declared()[kernel.FILE] and file == kernel.FILE
    assert grid == (2, hk, b)
    sem = dot_args[3]  # (dout, out, delta, dq_sem, ...) and (..., dq_acc, dq_sem, dk, ...)
    assert bwd_args[7] is sem and bwd_args[6].dtype == np.float32
    if det:
        assert sem.dtype == np.int32 and sem.shape == (b * h * 3,)
    else:
        assert isinstance(sem, np.uint64) and sem == 0


# Shared bytes of the Hopper backward, as attention_sm90.cu lays them out: d -> (BwdSm90Smem,
# BwdSm90SmemDq: the TMA dQ's 2 float32 staging tiles of 64 rows x d / 2 added)
SM90_BWD_SMEM = {64: (100392, 116776), 128: (165928, 198696)}


@pytest.mark.parametrize("d", kernel.HEAD_DIMS)
@pytest.mark.parametrize("options", [(), ("-DATTN_DQ_TMA=0",)], ids=["tma-dq", "red-dq"])
@pytest.mark.parametrize("det", [False, True], ids=["fast", "deterministic"])
def test_sm90_backward_plan_without_gpu(monkeypatch, det, options, d):
    """The Hopper backward's plan, the loader and Launcher faked: its shared bytes and its
    last argument (dq_acc's TMA descriptor) follow ATTN_DQ_TMA and the mode as the kernel
    declares them (the deterministic mode too), and CONFIG["sm90_options"] reaches
    attention_sm90.cu's kernels only."""
    from tecupy import loader
    made = []
    monkeypatch.setattr(loader, "function", lambda file, name, options=(): (
        made.append((file, options)) or name))
    monkeypatch.setattr(kernel, "opt_in_smem", lambda fn, smem: None)
    monkeypatch.setattr(kernel, "Launcher", lambda fn, grid, block, kinds, smem=0, pdl=True: (
        fn, kinds, smem))
    monkeypatch.setattr(kernel, "grid_1d", lambda *a, **kw: 1)
    monkeypatch.setitem(kernel.CONFIG, "sm90_options", options)
    b, sq, skv, h, hk = 2, 130, 200, 4, 2
    q, do, o, dq = (np.zeros((b, sq, h, d), tecupy.bfloat16) for _ in range(4))
    k, dk = (np.zeros((b, skv, hk, d), tecupy.bfloat16) for _ in range(2))
    dq_acc = np.zeros(q.shape, np.float32)
    name, kinds, smem = kernel._bwd_plan(do, q, k, o, dq_acc, dq, dk, 0.1, True, det)[2]
    tma = not options
    assert name == kernel._sm90_bwd_name("__nv_bfloat16", d, True, det)
    assert smem == SM90_BWD_SMEM[d][tma] and smem <= 227 * 1024
    assert len(kinds) == 19 + tma and (kinds[-1] is bytes) == tma
    assert sorted(set(made)) == sorted({(kernel.FILE, ()), (kernel.SM90_FILE, options)})


def test_every_backward_mode_is_declared():
    from tecupy import loader
    for det in (False, True):
        for causal in (False, True):
            for t, d in ((t, d) for t in kernel._TYPES for d in kernel.HEAD_DIMS):
                assert kernel._sm90_bwd_name(t, d, causal, det) in \
                    loader.declared("sm_90a")[kernel.SM90_FILE]
                for dropout in (False, True):
                    assert kernel._bwd_name(t, d, causal, dropout, det) in \
                        loader.declared("sm_89")[kernel.FILE]


def _turns(skv, q_len, kv_len, causal, group, bm=64, bn=128):
    """The kernels' loops and dq_turn (cuda/attention_common.cuh) mirrored for one (KV head,
    batch): each block's steps [(head, query block, turn)] by blockIdx.x."""
    nblocks = -(-skv // bn)
    steps = {}
    for x in range(nblocks):
        nb = nblocks - 1 - x if causal else x  # the causal grid runs backwards
        qb0 = nb * bn // bm if causal else 0
        nqb = max(-(-q_len // bm) - qb0, 0) if nb * bn < kv_len else 0
        nc = [min(-(-kv_len // bn), qb // (bn // bm) + 1) for qb in range(qb0, qb0 + nqb)]
        steps[x] = [(hh, qb0 + i, nc[i] - 1 - nb if causal else nb)
                    for hh in range(group) for i in range(nqb)]
    return steps


@pytest.mark.parametrize("skv, q_len, kv_len, causal, group", [
    (2048, 2048, 2048, False, 1), (2048, 2048, 2048, True, 1), (333, 250, 200, True, 2),
    (333, 300, 333, False, 3), (1000, 77, 1000, True, 1), (77, 130, 0, True, 1),
    (1000, 1000, 700, True, 2)])
@pytest.mark.parametrize("slots", [1, 3])
def test_dq_turns_are_a_deadlock_free_order(skv, q_len, kv_len, causal, group, slots):
    """Mirrored on the CPU: the blocks that meet query block qb are exactly those whose keys
    it attends to, their turns are 0 .. n - 1 in blockIdx.x order, and blocks dispatched in
    index order onto `slots` SMs, each waiting for its turn at every step, all finish."""
    steps = _turns(skv, q_len, kv_len, causal, group)
    meets = {}
    for x, work in steps.items():
        for hh, qb, turn in work:
            meets.setdefault((hh, qb), []).append((x, turn))
    nb_of = {x: -(-skv // 128) - 1 - x if causal else x for x in steps}
    for (hh, qb), who in meets.items():
        want = [x for x in steps if nb_of[x] * 128 < kv_len
                and (not causal or nb_of[x] * 128 <= 64 * qb + 63)]
        assert sorted(x for x, _ in who) == sorted(want)
        assert [t for _, t in sorted(who)] == list(range(len(who)))  # index order = turns
    count, waiting, resident, done = {}, sorted(steps), [], 0
    while waiting or resident:
        while waiting and len(resident) < slots:
            resident.append([waiting.pop(0), 0])
        moved = False
        for block in resident:
            x, i = block
            while i < len(steps[x]) and count.get(steps[x][i][:2], 0) == steps[x][i][2]:
                count[steps[x][i][:2]] = steps[x][i][2] + 1
                i, moved = i + 1, True
            block[1] = i
        finished = [b for b in resident if b[1] == len(steps[b[0]])]
        assert moved or finished, "deadlock"
        resident = [b for b in resident if b not in finished]
        done += len(finished)
    assert done == len(steps) and count == {key: len(who) for key, who in meets.items()}
