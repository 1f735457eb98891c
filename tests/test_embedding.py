"""tecupy.embedding and nn.Embedding: gather forward, deterministic scatter-add backward, the
tied LM head. CPU: the reference against float64 maths written here, gradients against
finite differences, errors naming the argument. GPU (marked): the kernels against float64 on
odd sizes with poisoned outputs, bit-identical backward runs with many repeated ids."""
import numpy as np
import pytest

import tecupy
from tecupy import Tape, backends
from tecupy._array import bfloat16
from tecupy.nn import Embedding

from conftest import asnp, assert_within_2x_reference, poison_gpu_pool, run
from test_gradients import fd_check

DTYPES = [np.float32, bfloat16, np.float64]


def _table(rng, v, d, dtype=np.float64):
    return rng.standard_normal((v, d)).astype(dtype)


def _scatter64(dout, ids, v):
    """dweight in float64, a plain loop: row ids[t] += dout[t]."""
    d = dout.shape[-1]
    dw = np.zeros((v, d))
    for t, i in enumerate(ids.reshape(-1)):
        dw[i] += dout.reshape(-1, d)[t].astype(np.float64)
    return dw


def _scatter_in_order32(dout, ids, v):
    """The order the kernel promises: each row summed in float32 in ascending token order."""
    d = dout.shape[-1]
    dw = np.zeros((v, d), np.float32)
    for t, i in enumerate(ids.reshape(-1)):
        dw[i] = dw[i] + dout.reshape(-1, d)[t].astype(np.float32)
    return dw


# ---- reference against float64 maths -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64, np.uint8])
def test_forward_gathers_rows(rng, dtype, id_dtype):
    w = _table(rng, 23, 7, dtype)
    ids = rng.integers(0, 23, size=(3, 5)).astype(id_dtype)
    out = tecupy.embedding(w, ids)
    assert out.shape == (3, 5, 7) and out.dtype == w.dtype
    assert np.array_equal(out.astype(np.float64), w.astype(np.float64)[ids.astype(np.int64)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_sums_rows(rng, dtype):
    v, d = 13, 6
    ids = rng.integers(0, v, size=(4, 9))
    ids[0, :4] = 2  # repeats
    dout = rng.standard_normal((4, 9, d)).astype(dtype)
    dw = backends.dispatch("embedding_bwd", dout, ids, v)
    assert dw.shape == (v, d) and dw.dtype == dout.dtype
    want = _scatter64(dout, ids, v)
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1e-2)
    np.testing.assert_allclose(dw.astype(np.float64), want, rtol=tol, atol=tol)
    untouched = np.setdiff1d(np.arange(v), ids)
    assert np.all(dw[untouched].astype(np.float64) == 0)


def test_backward_order_is_ascending_tokens(rng):
    """The reference's float32 sums are, bit for bit, sequential in token order: the order
    the cuda kernel implements (its GPU test compares bits against this reference)."""
    ids = rng.integers(0, 5, size=400)
    dout = (rng.standard_normal((400, 9)) * np.exp(rng.uniform(-8, 8, (400, 1))))
    dout = dout.astype(np.float32)
    dw = backends.dispatch("embedding_bwd", dout, ids, 5)
    assert dw.tobytes() == _scatter_in_order32(dout, ids, 5).tobytes()


def test_gradient_finite_differences(xp, rng):
    w = xp.asarray(_table(rng, 9, 4))
    ids = xp.asarray(np.array([[1, 3, 1], [8, 1, 0]]))
    fd_check(lambda: tecupy.embedding(w, ids), {"weight": w}, rng, n=36)


def test_tape_gives_ids_no_gradient(rng):
    w, ids = _table(rng, 5, 3), np.array([0, 4, 4])
    with Tape() as tape:
        y = tecupy.embedding(w, ids)
    dw, dids = tape.gradient(y, [w, ids], output_grad=np.ones_like(y))
    assert dids is None or not np.any(dids)
    np.testing.assert_array_equal(dw[:, 0], [1, 0, 0, 0, 2])


def test_empty_ids(rng):
    w = _table(rng, 5, 3)
    ids = np.zeros((0, 2), np.int64)
    assert tecupy.embedding(w, ids).shape == (0, 2, 3)
    assert not backends.dispatch("embedding_bwd", np.zeros((0, 2, 3)), ids, 5).any()


# ---- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 7])
def test_out_of_range_id_is_a_value_error(rng, bad):
    ids = np.array([[0, 1], [bad, 2]])
    with pytest.raises(ValueError, match=rf"embedding: ids must be in \[0, 7\).*{bad}.*\(1, 0\)"):
        tecupy.embedding(_table(rng, 7, 3), ids)


def test_bad_arguments_are_named(rng):
    w = _table(rng, 7, 3)
    with pytest.raises(TypeError, match="embedding: ids must be an integer array"):
        tecupy.embedding(w, np.zeros(3))
    with pytest.raises(ValueError, match="embedding: weight must be a 2-D array"):
        tecupy.embedding(w[0], np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="embedding: weight has dtype int64"):
        tecupy.embedding(np.zeros((7, 3), np.int64), np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="embedding: ids must be a numpy or cupy array"):
        tecupy.embedding(w, [1, 2])
    for name, args in (("num_embeddings", (0, 4)), ("embedding_dim", (4, -1))):
        with pytest.raises(ValueError, match=f"Embedding: {name} must be an int >= 1"):
            Embedding(*args, device="cpu")


# ---- the module and a tied LM head -------------------------------------------------------

def test_module_init_and_seed():
    e = Embedding(2000, 64, device="cpu", seed=3)
    assert e.weight.shape == (2000, 64) and e.weight.dtype == np.float32
    assert abs(e.weight.std() - 0.02) < 0.001 and abs(e.weight.mean()) < 0.001
    assert np.array_equal(Embedding(2000, 64, device="cpu", seed=3).weight, e.weight)
    assert list(e.named_parameters()) == ["weight"]
    assert Embedding(5, 3, params_dtype=bfloat16, device="cpu").weight.dtype == bfloat16


def test_module_gradient(rng):
    e = Embedding(6, 4, params_dtype=np.float64, device="cpu", seed=1)
    ids = rng.integers(0, 6, size=(2, 5))
    fd_check(lambda: e(ids), dict(e.named_parameters()), rng, module=e, n=24)


def _tied_lm(e, ids, target):
    h = e(ids)                                  # [b, s, D]
    logits = tecupy.linear(h, e.weight)         # [b, s, V]: the head is the table itself
    return tecupy.cross_entropy(logits, target)


def test_tied_lm_head_gradient(rng):
    """logits = h E^T with h = E[ids]: the tape sums the head's and the gather's gradients
    into E; against finite differences and against the float64 maths written here."""
    v, d = 11, 5
    e = Embedding(v, d, params_dtype=np.float64, device="cpu", seed=2)
    e.weight[...] = rng.standard_normal((v, d))
    ids, target = rng.integers(0, v, size=(2, 7)), rng.integers(0, v, size=(2, 7))
    fd_check(lambda: _tied_lm(e, ids, target), dict(e.named_parameters()), rng, module=e,
             n=55)
    w, n = e.weight, ids.size
    h = w[ids].reshape(n, d)
    z = h @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = (p - np.eye(v)[target.reshape(-1)]) / n   # mean cross entropy
    want = dz.T @ h + _scatter64(dz @ w, ids.reshape(-1), v)  # head + gather
    with Tape() as tape:
        loss = _tied_lm(e, ids, target)
    got = tape.gradient(loss, e, output_grad=np.ones(()))["weight"]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# ---- GPU: kernels against float64, poisoned outputs, determinism -------------------------

GPU_DTYPES = [np.float32, bfloat16, np.float16, np.float64]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 37, 64, 771])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_kernel_forward(rng, dtype, d, id_dtype):
    v = int(rng.integers(500, 1500))
    w = _table(rng, v, d, dtype)
    ids = rng.integers(0, v, size=(int(rng.integers(3, 9)), int(rng.integers(50, 300))))
    out = run("embedding_fwd", (w, ids.astype(id_dtype)), on_gpu=True)  # poisoned first
    assert asnp(out).tobytes() == w[ids].tobytes()  # a copy: exact


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("d", [3, 64, 259])
def test_kernel_backward(rng, dtype, d):
    """Bit for bit the reference's in-order float32 sums (float64 for float64), and close to
    the float64 maths; rows no token picked are 0, not poison."""
    v, n = int(rng.integers(300, 900)), int(rng.integers(2000, 6000))
    ids = rng.integers(0, v // 3, size=n)  # many repeats, and untouched rows
    ids[: n // 4] = 7  # one hot row
    dout = rng.standard_normal((n, d)).astype(dtype)
    got = asnp(run("embedding_bwd", (dout, ids, v), on_gpu=True))
    assert got.tobytes() == backends.dispatch("embedding_bwd", dout, ids, v).tobytes()
    want = _scatter64(dout, ids, v)
    tol = 1e-9 if dtype == np.float64 else 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol,
                               atol=tol * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
def test_kernel_backward_is_bit_identical_across_runs(rng, dtype):
    import cupy
    v, d, n = 97, 257, 300_000
    ids = cupy.asarray(rng.integers(0, 16, size=(600, 500)))  # ~19k repeats per id
    dout = cupy.asarray(rng.standard_normal((600, 500, d)).astype(dtype))
    runs = []
    for _ in range(2):
        poison_gpu_pool()
        runs.append(backends.dispatch("embedding_bwd", dout, ids, v).get().tobytes())
    assert n == ids.size and runs[0] == runs[1]


@pytest.mark.gpu
def test_kernel_out_of_range_ids_give_nan_rows(rng):
    import cupy
    w = _table(rng, 50, 33, np.float32)
    ids = np.array([[3, -1, 7], [50, 7, 1 << 40]])
    gw, gids = cupy.asarray(w), cupy.asarray(ids)
    with Tape() as tape:
        out = tecupy.embedding(gw, gids)  # no ValueError: CuPy ids are not read back
    bad = (ids < 0) | (ids >= 50)
    o = asnp(out)
    assert np.all(np.isnan(o[bad])) and np.array_equal(o[~bad], w[ids[~bad]])
    dw = asnp(tape.gradient(out, gw, output_grad=cupy.ones(out.shape, np.float32)))
    np.testing.assert_array_equal(dw[:, 0], np.bincount(ids[~bad], minlength=50))


@pytest.mark.gpu
def test_tied_lm_head_on_gpu_matches_cpu(rng):
    v, d = 301, 48
    ids, target = rng.integers(0, v, size=(4, 33)), rng.integers(0, v, size=(4, 33))
    grads = []
    for device in ("cpu", "cuda"):
        e = Embedding(v, d, device=device, seed=5)
        xp = e.xp
        with Tape() as tape:
            loss = _tied_lm(e, xp.asarray(ids), xp.asarray(target))
        grads.append(asnp(tape.gradient(loss, e, output_grad=xp.ones((), np.float32))
                          ["weight"]))
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-4, atol=1e-7)


# ---- GPU: cross_entropy's kernels on an LM head's logits ---------------------------------

def _max_allocation(fn):
    """(fn(), the largest single CuPy allocation made while it ran)."""
    import cupy
    pool, sizes = cupy.get_default_memory_pool(), []

    def malloc(size):
        sizes.append(size)
        return pool.malloc(size)
    with cupy.cuda.using_allocator(malloc):
        out = fn()
    return out, max(sizes, default=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.float16], ids=str)
@pytest.mark.parametrize("vocab", [5, 1001, 50257])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_kernels(rng, dtype, vocab, eps):
    """Loss, lse and dlogits against the float64 reference (2x the same-precision
    reference's error); ignored targets give 0, bad ones NaN, with no host sync."""
    rows = int(rng.integers(30, 90))
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(dtype)
    target = rng.integers(0, vocab, size=rows)
    target[:3] = [-100, vocab, -1]  # ignored, out of range, out of range
    dloss = rng.standard_normal(rows).astype(np.float32)
    args = (-100, eps)
    got = run("cross_entropy_fwd", (logits, target, *args), on_gpu=True)
    want = backends.dispatch("cross_entropy_fwd", logits.astype(np.float64), target, *args)
    ref = backends.dispatch("cross_entropy_fwd", logits, target, *args)
    loss = asnp(got[0])
    assert loss[0] == 0 and np.all(np.isnan(loss[1:3]))
    for g, w, r, name in zip(got, want, ref, ("loss", "lse")):
        assert_within_2x_reference(asnp(g)[3:], w[3:], r[3:], name, atol=1e-6)
    lse = asnp(got[1])
    dx = asnp(run("cross_entropy_bwd", (dloss, logits, target, lse, *args), on_gpu=True))
    want = backends.dispatch("cross_entropy_bwd", dloss, logits.astype(np.float64), target,
                             lse.astype(np.float64), *args)
    ref = backends.dispatch("cross_entropy_bwd", dloss, logits, target, lse, *args)
    assert dx.dtype == logits.dtype and np.all(dx[0].astype(np.float64) == 0)
    assert np.all(np.isnan(dx[1:3].astype(np.float64)))
    assert_within_2x_reference(dx[3:], want[3:], ref[3:], "dlogits", atol=1e-6)


@pytest.mark.gpu
def test_cross_entropy_allocates_no_float32_copy_of_the_logits(rng):
    """At vocab 50257 the forward and backward allocate nothing of the logits' size but
    dlogits (bf16): no float32 [tokens, vocab] temporary."""
    import cupy
    logits = cupy.asarray(rng.standard_normal((512, 50257)).astype(bfloat16))
    target = cupy.asarray(rng.integers(0, 50257, size=512))

    def step():
        with Tape() as tape:
            loss = tecupy.cross_entropy(logits, target)
        return tape.gradient(loss, logits, output_grad=cupy.ones((), np.float32))
    dx, biggest = _max_allocation(step)
    assert dx.dtype == logits.dtype and biggest <= logits.nbytes
