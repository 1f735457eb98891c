"""gemm_chunked (kernels/fp8_gemm.py, fp8_gemm_tn_wait): the FP8 GEMM whose A rows arrive in
chunks while it runs, each chunk's tiles waiting for its flag. On one GPU the chunks come
from the host by a copy engine on another stream, each flag written by that stream after
its copy (the mechanism a peer's push uses: tecupy/distributed/peer.py)."""
import subprocess
import sys
import time

import numpy as np
import pytest

import tecupy
from tecupy.fp8 import E4M3, E5M2
from conftest import HAVE_GPU, asnp

pytestmark = pytest.mark.gpu


def _hopper():
    from tecupy.kernels.fp8_gemm import hopper
    return HAVE_GPU and hopper()


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the FP8 GEMM kernel needs sm_90")


def _operands(rng, m, n, k, fa=E4M3, fb=E4M3, bias=False):
    import cupy
    a = tecupy.quantize(rng.standard_normal((m, k)).astype(np.float32), 1.0, fa).data
    b = tecupy.quantize(rng.standard_normal((n, k)).astype(np.float32), 1.0, fb).data
    sa = cupy.asarray(np.array([rng.uniform(0.5, 2)], np.float32))
    sb = cupy.asarray(np.array([rng.uniform(0.01, 0.1)], np.float32))
    bv = (cupy.asarray(rng.standard_normal(n).astype(tecupy.bfloat16)) if bias else None)
    return cupy.asarray(a), sa, cupy.asarray(b), sb, bv


def _plain(a, sa, b, sb, bias, fa, fb, split, gelu=False):
    """fp8_gemm with the configuration gemm_chunked takes (default_config, no cluster)."""
    from tecupy.kernels import fp8_gemm as G
    config = G.default_config(a.shape[0], b.shape[0], split, k=a.shape[1])[:3] + (1,)
    return G.launch(config, a, fa, sa, b, fb, sb, tecupy.bfloat16, bias, gelu=gelu)


@needs_hopper
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("first", [0, 2, 3])
@pytest.mark.parametrize("mnk", [(1024, 272, 4112), (512, 520, 256)], ids=str)
def test_chunked_is_fp8_gemm_bit_for_bit(rng, split, bias, first, mnk):
    """Every flag set before the launch: the rotated tile order gives fp8_gemm's bits, and
    every element is written (the output poisoned with NaN first)."""
    import cupy
    from tecupy.kernels import fp8_gemm as G
    m, n, k = mnk
    a, sa, b, sb, bv = _operands(rng, m, n, k, bias=bias)
    want = _plain(a, sa, b, sb, bv, E4M3, E4M3, split)
    out = cupy.full((m, n), np.nan, tecupy.bfloat16)
    ready = cupy.ones(4, np.uint32)
    got = G.gemm_chunked(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, bv, ready, m // 4, first,
                         split_accumulator=split, out=out)
    assert got is out
    np.testing.assert_array_equal(asnp(got).view(np.uint16), asnp(want).view(np.uint16))
    np.testing.assert_array_equal(asnp(ready), 1)  # (read only)


@needs_hopper
def test_chunked_gelu_and_e5m2(rng):
    """The gelu epilogue (fc1's forward) and a mixed format pair, against fp8_gemm."""
    from tecupy.kernels import fp8_gemm as G
    import cupy
    a, sa, b, sb, bv = _operands(rng, 768, 384, 512, E5M2, E4M3, bias=True)
    want, want_aux = _plain(a, sa, b, sb, bv, E5M2, E4M3, False, gelu=True)
    got, aux = G.gemm_chunked(a, E5M2, sa, b, E4M3, sb, tecupy.bfloat16, bv,
                              cupy.ones(3, np.uint32), 256, 1, gelu=True)
    for g, w in ((got, want), (aux, want_aux)):
        np.testing.assert_array_equal(asnp(g).view(np.uint16), asnp(w).view(np.uint16))


@needs_hopper
@pytest.mark.parametrize("first", [0, 1])
def test_chunked_waits_for_chunks_copied_later(rng, first):
    """A's other chunks start as NaN codes; after the launch a copy engine brings each from
    pinned host memory on a non-blocking stream and writes its flag: the result is that of
    the whole A (no tile read a chunk before its flag), and the GEMM did wait (its stream's
    time covers the host's delay before the copies)."""
    import cupy
    from tecupy.distributed.peer import write_flag
    from tecupy.kernels import fp8_gemm as G
    m, n, k, chunks = 1024, 512, 1024, 4
    rows = m // chunks
    a, sa, b, sb, _ = _operands(rng, m, n, k)
    want = _plain(a, sa, b, sb, None, E4M3, E4M3, False)
    host = cupy.cuda.alloc_pinned_memory(a.nbytes)
    np.frombuffer(host, np.uint8, a.nbytes)[:] = asnp(a).ravel()
    late = cupy.full((m, k), 0x7F, np.uint8)  # E4M3 NaN everywhere
    late[first * rows:(first + 1) * rows] = a[first * rows:(first + 1) * rows]
    ready = cupy.zeros(chunks, np.uint32)
    ready[first] = 1
    side = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.get_current_stream()
    cupy.cuda.Device().synchronize()
    start = main.record()
    got = G.gemm_chunked(late, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, None, ready, rows,
                         first, limit_s=30.0)
    end = main.record()
    time.sleep(0.05)  # the GEMM runs its own chunk, then waits
    for c in range(chunks):
        if c == first:
            continue
        off = c * rows * k
        cupy.cuda.runtime.memcpyAsync(late.data.ptr + off, host.ptr + off, rows * k,
                                      cupy.cuda.runtime.memcpyHostToDevice, side.ptr)
        write_flag(ready.data.ptr + 4 * c, 1, side)
    end.synchronize()
    side.synchronize()
    np.testing.assert_array_equal(asnp(got).view(np.uint16), asnp(want).view(np.uint16))
    assert cupy.cuda.get_elapsed_time(start, end) > 30.0  # ms: it waited for the copies


@needs_hopper
def test_chunked_refuses_bad_chunks(rng):
    import cupy
    from tecupy.kernels import fp8_gemm as G
    a, sa, b, sb, _ = _operands(rng, 512, 256, 256)
    ok = cupy.ones(4, np.uint32)
    args = (a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, None)
    for rows in (0, 100, 192, 384):  # not a multiple of 128, or not dividing M
        with pytest.raises(ValueError, match="chunk_rows"):
            G.gemm_chunked(*args, ok, rows, 0)
    with pytest.raises(TypeError, match="ready"):
        G.gemm_chunked(*args, cupy.ones(4, np.int64), 128, 0)
    with pytest.raises(TypeError, match="ready"):
        G.gemm_chunked(*args, cupy.ones(2, np.uint32), 128, 0)
    with pytest.raises(ValueError, match="first"):
        G.gemm_chunked(*args, ok, 128, 4)


_NEVER = """
import numpy as np, cupy, tecupy
from tecupy.fp8 import E4M3
from tecupy.kernels import fp8_gemm as G
a = cupy.zeros((512, 256), np.uint8); b = cupy.zeros((256, 256), np.uint8)
s = cupy.ones(1, np.float32)
ready = cupy.zeros(4, np.uint32); ready[0] = 1
G.gemm_chunked(a, E4M3, s, b, E4M3, s, tecupy.bfloat16, None, ready, 128, 0, limit_s=0.5)
cupy.cuda.Device().synchronize()
print("finished")
"""


@needs_hopper
def test_chunked_traps_when_a_chunk_never_comes():
    """A flag never set (a dead peer): the kernel traps after limit_s and the process gets
    an error instead of hanging (in a child process: a trap loses the CUDA context)."""
    t0 = time.time()
    run = subprocess.run([sys.executable, "-c", _NEVER], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "finished" not in run.stdout, run.stdout + run.stderr
    assert "CUDA" in run.stderr or "cuda" in run.stderr, run.stderr[-2000:]
    assert time.time() - t0 < 100
