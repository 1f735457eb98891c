"""Issue 3 on the GPU: every variant of the memory-bound kernels, checked, then timed.

For each op and each variant in tecupy/kernels/{norm,softmax}.py (*_VARIANTS: the default
and the one that runs off Hopper; cast_transpose and the softmax backward have one kernel,
the winners of PERFLOG.md's session 3): the
result against the NumPy reference (float64; FP8 codes bit for bit) on fresh random bf16
8192 x 4096 and an odd size, outputs poisoned first; then the time per call from CUDA-graph
replay (tecupy.bench.timing.graph_time_ms: the kernels' own time), TB/s over the fewest
bytes the op must move, and % of the device-to-device copy measured in the same run. Also
times the two dgamma/dbeta reduce kernels alone (even and odd hidden). A table comes last.

    PYTHONPATH=. python scripts/issue3_device.py            # on a Hopper GPU, < 4 minutes
    PYTHONPATH=. python scripts/issue3_device.py --compile-only --arch sm_90a   # no GPU
    --only norm,softmax,cast_transpose,reduce  restricts the ops.

Kernels come from TECUPY_CACHE_DIR (fill it with --compile-only); missing ones compile in
parallel at start.
"""
import argparse
import concurrent.futures
import itertools
import os
import sys
import time

import numpy as np

os.environ.setdefault("TECUPY_STRICT", "1")  # a failing kernel raises, never falls back

import tecupy  # noqa: E402
from tecupy import backends, loader  # noqa: E402
from tecupy.bench.kernels import copy_bandwidth  # noqa: E402
from tecupy.bench.timing import graph_time_ms  # noqa: E402
from tecupy.fp8 import E4M3  # noqa: E402
from tecupy.kernels import cast as ck, norm as nk, softmax as sk  # noqa: E402
from tecupy.reference import fp8 as fp8_ref  # noqa: E402

BF16 = tecupy.bfloat16
BIG, ODD = (8192, 4096), (3008, 1000)  # odd: partial tiles and rows, 125 chunks per row
TOL = 8e-3  # max |got - want| / max |want| for bf16 outputs: two bf16 half-ulps


def kernel_names():
    """The bf16 instantiations this script can launch (norm: 16-byte vectors, no FP8)."""
    def norm(n):
        return "reduce" in n or (", 8," in n and "fp8" not in n)
    keep = {nk.FWD_FILE: norm, nk.BWD_FILE: norm,
            "cast.cu": lambda n: n.startswith("cast_transpose") and "e4m3" in n,
            "softmax.cu": lambda n: True}
    return [(f, n) for f, names in loader.declared().items() if f in keep
            for n in names if "__nv_bfloat16" in n and keep[f](n)]


def compile_all(arch):
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(lambda fn: loader.compile_kernel(fn[0], fn[1], arch), kernel_names()))
    print(f"{len(kernel_names())} kernels for {arch} ready in {time.perf_counter() - t0:.1f} s "
          f"(cache {loader.cache_dir()})", flush=True)


def poison(nbytes):
    """Fill pool blocks with 0xFF (NaN in bf16/float) and free them: outputs allocated next
    reuse them, so an element a kernel forgets to write shows up."""
    import cupy
    bufs = [cupy.empty(nbytes, np.uint8) for _ in range(6)]
    for b in bufs:
        b.fill(0xFF)
    del bufs


def rel_err(got, want):
    got = np.asarray(got.get() if hasattr(got, "get") else got).astype(np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def bf16_pair(rng, shape, scale=1.0, shift=0.0):
    """(cupy bf16, the same values as NumPy float64)."""
    import cupy
    x = cupy.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32)).astype(BF16)
    return x, x.get().astype(np.float64)


# ---- ops: (name, module, attribute, variants, make(rows, cols, rng), bytes per element) ----
# make returns (gpu args, check(outputs) -> max relative error over the outputs).

def make_norm_fwd(rms):
    def make(rows, cols, rng):
        x, xh = bf16_pair(rng, (rows, cols), 3, 1)
        g, gh = bf16_pair(rng, (cols,))
        b, bh = bf16_pair(rng, (cols,))
        args = (x, g, 1e-5, False) if rms else (x, g, b, 1e-5, False)
        want = backends.dispatch(*(("rmsnorm_fwd", xh, gh) if rms else
                                   ("layernorm_fwd", xh, gh, bh)), 1e-5, False)
        # y within TOL; mu and rsigma (float32) within 1e-5, scaled onto the same TOL
        return args, lambda got: max(rel_err(o, w) * (1 if i == 0 else TOL / 1e-5)
                                     for i, (o, w) in enumerate(zip(got, want)))
    return make


def make_norm_bwd(rms):
    def make(rows, cols, rng):
        x, xh = bf16_pair(rng, (rows, cols), 3, 1)
        dy, dyh = bf16_pair(rng, (rows, cols))
        g, gh = bf16_pair(rng, (cols,))
        import cupy
        if rms:
            rs = backends.dispatch("rmsnorm_fwd", xh, gh, 1e-5, False)[1].astype(np.float32)
            args = (dy, x, cupy.asarray(rs), g, False)
            want = backends.dispatch("rmsnorm_bwd", dyh, xh, rs.astype(np.float64), gh, False)
        else:
            _, mu, rs = backends.dispatch("layernorm_fwd", xh, gh, gh, 1e-5, False)
            mu, rs = mu.astype(np.float32), rs.astype(np.float32)
            args = (dy, x, cupy.asarray(mu), cupy.asarray(rs), g, False)
            want = backends.dispatch("layernorm_bwd", dyh, xh, mu.astype(np.float64),
                                     rs.astype(np.float64), gh, False)
        return args, lambda got: max(rel_err(o, w) for o, w in zip(got, want))
    return make


def make_cast_transpose(rows, cols, rng):
    import cupy
    x, _ = bf16_pair(rng, (rows, cols), 4)
    scale = cupy.asarray([rng.uniform(0.5, 8)], np.float32)
    q, qt, amax = fp8_ref.cast_transpose(x.get(), scale.get(), E4M3)

    def check(got):  # bit for bit: 0 when equal, inf otherwise
        same = [np.array_equal(g.get(), w) for g, w in zip(got, (q, qt, amax))]
        return 0.0 if all(same) else float("inf")
    return (x, scale, E4M3), check


def make_softmax_fwd(rows, cols, rng):
    x, xh = bf16_pair(rng, (rows, cols), 4)
    causal = cols != BIG[1]  # the odd size also checks the causal path
    want = backends.dispatch("softmax_fwd", xh, 0.125, None, causal)
    return (x, 0.125, None, causal), lambda got: rel_err(got, want)


def make_softmax_bwd(rows, cols, rng):
    import cupy
    x, xh = bf16_pair(rng, (rows, cols), 4)
    y = backends.dispatch("softmax_fwd", xh, 0.125, None, False).astype(np.float32)
    y = cupy.asarray(y).astype(BF16)
    dy, dyh = bf16_pair(rng, (rows, cols))
    want = backends.dispatch("softmax_bwd", dyh, y.get().astype(np.float64), 0.125)
    return (dy, y, 0.125), lambda got: rel_err(got, want)


# cast_transpose and the softmax backward have one kernel choice left (PERFLOG.md, session 3
# and the end): attribute None, timed as they are.
OPS = [("layernorm_fwd", nk, "FWD_VARIANT", nk.FWD_VARIANTS, make_norm_fwd(False), 4, "norm"),
       ("rmsnorm_fwd", nk, "FWD_VARIANT", nk.FWD_VARIANTS, make_norm_fwd(True), 4, "norm"),
       ("layernorm_bwd", nk, "BWD_VARIANT", nk.BWD_VARIANTS, make_norm_bwd(False), 6, "norm"),
       ("rmsnorm_bwd", nk, "BWD_VARIANT", nk.BWD_VARIANTS, make_norm_bwd(True), 6, "norm"),
       ("cast_transpose", ck, None, ("tiled1",), make_cast_transpose, 4, "cast_transpose"),
       ("softmax_fwd", sk, "FWD_VARIANT", sk.FWD_VARIANTS, make_softmax_fwd, 4, "softmax"),
       ("softmax_bwd", sk, None, ("block2",), make_softmax_bwd, 6, "softmax")]


def run_op(op, module, attr, variants, make, per_elem, copy, rng, rows_out):
    """Check and time every variant of one op at both sizes; appends table rows."""
    default = getattr(module, attr) if attr else None
    for rows, cols in (BIG, ODD):
        args, check = make(rows, cols, rng)
        for v in variants:
            if attr:
                setattr(module, attr, v)
            try:
                poison(rows * cols * 4)
                err = check(backends.dispatch(op, *args))
                ms = graph_time_ms(lambda *a: backends.dispatch(op, *a), [args]) or float("nan")
            except Exception as e:  # report and go on with the other variants
                print(f"{op} {v} {rows}x{cols}: FAILED {type(e).__name__}: {e}", flush=True)
                err, ms = float("inf"), float("nan")
            tbs = per_elem * rows * cols / ms / 1e9
            row = (op, v, f"{rows}x{cols}", ms, tbs, 100 * tbs / copy, err,
                   "ok" if err <= TOL else "WRONG")
            rows_out.append(row)
            print(fmt_row(row), flush=True)
    if attr:
        setattr(module, attr, default)


def time_reduces(copy, rng, rows_out):
    """The dgamma/dbeta reduce alone on the partials of 8192 rows (264 blocks: the base grid
    on 132 SMs; 256: a balanced ring grid): norm_bwd_reduce_vec at an even hidden size,
    norm_bwd_reduce at an odd one."""
    import cupy
    for hidden, nparts in itertools.product((BIG[1], BIG[1] - 1), (264, 256)):
        part = cupy.asarray(rng.standard_normal((nparts, 2 * hidden)).astype(np.float32))
        want = part.get().astype(np.float64).sum(0)
        dg, db = cupy.empty(hidden, BF16), cupy.empty(hidden, BF16)
        def fn(p, g, b):
            return nk._bwd_reduce(p, nparts, hidden, g, b, False)
        fn(part, dg, db)
        err = rel_err(cupy.concatenate([dg, db]).astype(np.float32), want)
        ms = graph_time_ms(fn, [(part, dg, db)]) or float("nan")
        tbs = part.nbytes / ms / 1e9
        kind = "vec" if hidden % 2 == 0 else "scalar"
        row = (f"bwd_reduce_{kind}", f"{nparts} parts", f"{nparts}x{2 * hidden}", ms, tbs,
               100 * tbs / copy, err, "ok" if err <= TOL else "WRONG")
        rows_out.append(row)
        print(fmt_row(row), flush=True)


def fmt_row(r):
    return (f"{r[0]:16s} {r[1]:10s} {r[2]:>10s} {r[3]:8.4f} {r[4]:6.2f} {r[5]:5.0f}% "
            f"{r[6]:9.2e} {r[7]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--arch", default=None, help="with --compile-only (default sm_90a)")
    p.add_argument("--only", default="norm,cast_transpose,softmax,reduce")
    a = p.parse_args()
    if a.compile_only:
        return compile_all(a.arch or "sm_90a")
    import cupy
    t0 = time.perf_counter()
    compile_all(loader.arch_of_device())
    rng = np.random.default_rng()
    copy = copy_bandwidth()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}: device-to-device copy {copy:.2f} TB/s", flush=True)
    header = (f"{'op':16s} {'variant':10s} {'size':>10s} {'ms':>8s} {'TB/s':>6s} {'%copy':>6s} "
              f"{'max err':>9s} check")
    print(header)
    rows_out, only = [], a.only.split(",")
    for op, module, attr, variants, make, per_elem, group in OPS:
        if group in only:
            run_op(op, module, attr, variants, make, per_elem, copy, rng, rows_out)
    if "reduce" in only:
        time_reduces(copy, rng, rows_out)
    print(f"\n## summary ({name}, copy {copy:.2f} TB/s, {time.perf_counter() - t0:.0f} s; err: "
          "max |got - want| / max |want| vs the float64 reference, FP8 codes exact)")
    print(header)
    for r in rows_out:
        print(fmt_row(r))
    return 1 if any(r[7] != "ok" for r in rows_out) else 0


if __name__ == "__main__":
    sys.exit(main())
