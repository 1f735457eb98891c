"""python -m tecupy.bench kernels: memory-bound kernels against copy bandwidth and peers.

For each kernel at 8192 x 4096 (bf16) and at an odd size: "call ms", the median time per
call of back-to-back calls between CUDA events (inputs rotated so the working set exceeds
L2), which is what a caller sees, Python dispatch included; "kern ms", the same calls
captured in a CUDA graph and replayed, which is the kernels' own time; achieved TB/s (from
kern ms) counting the fewest bytes the op must move, against the device-to-device copy
bandwidth measured in the same run ("%copy": of 1 GiB; "%size": of copies that move the
kernel's bytes, timed the same way, the fair bar for small sizes); the PyTorch op when
torch is importable (its call time, compared with ours); the NumPy reference on the CPU
(one call; at 8192 x 4096 only with --cpu). The first call (compile or cache load
included) is reported apart.
"""
import numpy as np

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3

from .timing import (first_call, gpu_name, gpu_time_ms, graph_time_ms, input_sets, once_ms,
                     torch_time_ms)

SIZES = [(8192, 4096), (3001, 1001)]
BF16 = tecupy.bfloat16


def cases(rows, hidden, rng):
    """(name, make_inputs() -> args, fn(*args), bytes moved, torch peer or None). All
    arrays an op needs are in args, so the same fn runs the NumPy reference on copies."""
    import cupy
    n, d = rows * hidden, backends.dispatch

    def X(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(BF16)
    g, one = X(hidden), cupy.ones((1,), np.float32)

    def Z():
        return cupy.zeros((1,), np.float32)

    def ln_bwd():
        x = X(rows, hidden)
        _, mu, rs = d("layernorm_fwd", x, g, g, 1e-5, False)
        return X(rows, hidden), x, mu, rs, g, False

    def ln_fwd_bwd(x, dy, g):
        _, mu, rs = d("layernorm_fwd", x, g, g, 1e-5, False)
        return d("layernorm_bwd", dy, x, mu, rs, g, False)

    def rms_bwd():
        x = X(rows, hidden)
        return X(rows, hidden), x, d("rmsnorm_fwd", x, g, 1e-5, False)[1], g, False
    return [
        # the FP8 outputs max their amax into an amax history row (amax_out), as in the
        # FP8 flow; "own amax": a fresh amax array per call
        ("cast_to_fp8+amax", lambda: (X(rows, hidden), one, E4M3, Z()),
         lambda x, s, f, a: d("cast_to_fp8", x, s, f, amax_out=a), 3 * n, "cast"),
        ("cast (own amax)", lambda: (X(rows, hidden), one, E4M3),
         lambda *a: d("cast_to_fp8", *a), 3 * n, None),
        ("layernorm_fwd", lambda: (X(rows, hidden), g, g, 1e-5, False),
         lambda *a: d("layernorm_fwd", *a), 4 * n, "layer_norm"),
        ("layernorm_fwd_fp8", lambda: (X(rows, hidden), g, g, 1e-5, False, one, E4M3, Z()),
         lambda *a: d("layernorm_fwd_fp8", *a[:-1], amax_out=a[-1]), 3 * n, None),
        ("rmsnorm_fwd", lambda: (X(rows, hidden), g, 1e-5, False),
         lambda *a: d("rmsnorm_fwd", *a), 4 * n, "rms_norm"),
        ("layernorm_bwd", ln_bwd, lambda *a: d("layernorm_bwd", *a), 6 * n, None),
        ("rmsnorm_bwd", rms_bwd, lambda *a: d("rmsnorm_bwd", *a), 6 * n, None),
        ("layernorm_fwd+bwd", lambda: (X(rows, hidden), X(rows, hidden), g), ln_fwd_bwd, 10 * n,
         "layer_norm_fwd_bwd"),
        ("gelu_fwd", lambda: (X(rows, hidden),), lambda *a: d("gelu_fwd", *a), 4 * n, "gelu"),
        ("gelu_bwd", lambda: (X(rows, hidden), X(rows, hidden)),
         lambda *a: d("gelu_bwd", *a), 6 * n, None),
        ("swiglu_fwd", lambda: (X(rows, 2 * hidden),), lambda *a: d("swiglu_fwd", *a),
         6 * n, None),
        ("swiglu_bwd", lambda: (X(rows, hidden), X(rows, 2 * hidden)),
         lambda *a: d("swiglu_bwd", *a), 10 * n, None),
        ("cast_transpose", lambda: (X(rows, hidden), one, E4M3, Z()),
         lambda x, s, f, a: d("cast_transpose", x, s, f, amax_out=a), 4 * n, None),
        ("dropout+residual", lambda: (X(rows, hidden), 0.1, 7, 0, X(rows, hidden)),
         lambda *a: d("dropout_fwd", *a), 7 * n, None),
        ("dropout_bwd", lambda: (X(rows, hidden), d("dropout_fwd", X(rows, hidden), 0.1, 7,
                                                    0)[1], 0.1),
         lambda *a: d("dropout_bwd", *a), 5 * n, None),
        ("softmax_fwd", lambda: (X(rows, hidden), 0.125, None, False),
         lambda *a: d("softmax_fwd", *a), 4 * n, "softmax"),
        ("softmax_bwd", lambda: (X(rows, hidden), X(rows, hidden), 0.125),
         lambda *a: d("softmax_bwd", *a), 6 * n, None),
    ]


def torch_peer(kind, rows, hidden):
    """A PyTorch version of the op on bf16 (None when torch is missing)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, w))
    dy = torch.randn_like(x)

    def ln_fwd_bwd():
        y = F.layer_norm(xg, (hidden,), wg, bg)
        return torch.autograd.grad(y, (xg, wg, bg), dy)
    fns = {"layer_norm": lambda: F.layer_norm(x, (hidden,), w, w),
           "rms_norm": lambda: F.rms_norm(x, (hidden,), w),
           "gelu": lambda: F.gelu(x, approximate="tanh"),
           "cast": lambda: (x.abs().amax(), (x.float() * 1.0).to(torch.float8_e4m3fn)),
           "softmax": lambda: torch.softmax(x * 0.125, dim=-1),
           "layer_norm_fwd_bwd": ln_fwd_bwd}
    return fns.get(kind)


def copy_bandwidth(nbytes=1 << 30):
    import cupy
    a = cupy.empty(nbytes, np.uint8)
    b = cupy.empty_like(a)
    ms = gpu_time_ms(lambda: cupy.copyto(b, a), [()], calls=10)
    return 2 * nbytes / ms / 1e9  # TB/s: bytes read + written


def sm_copy_bandwidth(unroll, nbytes=1 << 30):
    """TB/s of copy_u4 (cuda/transpose.cu), a plain grid-stride stream of 16-byte loads and
    stores: what SM-driven streaming reaches, next to the memcpy above."""
    import cupy
    from tecupy.kernels.transpose import copy_u4
    a = cupy.empty(nbytes, np.uint8)
    b = cupy.empty_like(a)
    ms = gpu_time_ms(lambda: copy_u4(a, b, unroll), [()], calls=10)
    return 2 * nbytes / ms / 1e9


def copy_at_size(nbytes):
    """TB/s of device-to-device copies moving `nbytes` (read + written), buffers rotated past
    L2 and replayed from a CUDA graph like the kernels."""
    import cupy
    half = max(1, nbytes // 2)
    sets = input_sets(lambda: (cupy.empty(half, np.uint8), cupy.empty(half, np.uint8)), nbytes)
    ms = graph_time_ms(lambda a, b: cupy.copyto(b, a), sets)
    return 2 * half / ms / 1e9 if ms else float("nan")


def run(args):
    import cupy
    rng = np.random.default_rng(0)
    copy = copy_bandwidth()
    tiny = cases(16, 128, rng)[1]  # layernorm_fwd on 16 x 128: the cost of a call itself
    floor = gpu_time_ms(tiny[2], [tiny[1]()], calls=200)
    print(f"{gpu_name()}: device-to-device "
          f"copy {copy:.2f} TB/s; one tecupy call costs at least {floor * 1e3:.0f} us "
          "(Python dispatch + launch): times near it are host-bound")
    sm = {u: sm_copy_bandwidth(u) for u in (1, 4)}
    print("a plain copy kernel (16-byte loads and stores, 1 or 4 in flight per thread): "
          + ", ".join(f"{sm[u]:.2f} TB/s ({100 * sm[u] / copy:.0f}%)" for u in sm))
    print(f"{'kernel':18s} {'size':>11s} {'backend':>9s} {'first ms':>8s} {'call ms':>8s} "
          f"{'kern ms':>8s} {'TB/s':>5s} {'%copy':>5s} {'%size':>5s} {'torch ms':>8s} "
          f"{'torch/call':>10s} {'numpy ms':>8s}")
    at_size = {}  # bytes moved -> TB/s of copies of that size (many kernels share one)
    for rows, hidden in SIZES:
        for name, make, fn, nbytes, peer in cases(rows, hidden, rng):
            sets = input_sets(make, nbytes)
            op = {"cast_to_fp8+amax": "cast_to_fp8", "cast (own amax)": "cast_to_fp8",
                  "dropout+residual": "dropout_fwd",
                  "layernorm_fwd+bwd": "layernorm_bwd"}.get(name, name)
            kind = backends.chosen(op, *sets[0])
            _, first = first_call(fn, *sets[0])
            ms = gpu_time_ms(fn, sets)
            kms = graph_time_ms(fn, sets) or float("nan")
            tbs = nbytes / kms / 1e9
            if nbytes not in at_size:
                at_size[nbytes] = copy_at_size(nbytes)
            pfn = torch_peer(peer, rows, hidden) if peer else None
            pms = torch_time_ms(pfn) if pfn else float("nan")
            nms = float("nan")
            if args.cpu or rows * hidden < 4e6:
                host = [a.get() if isinstance(a, cupy.ndarray) else a for a in sets[0]]
                nms = once_ms(lambda: fn(*host))  # NumPy arrays: the reference backend
            print(f"{name:18s} {rows:>5d}x{hidden:<5d} {kind:>9s} {first:8.1f} {ms:8.4f} "
                  f"{kms:8.4f} {tbs:5.2f} {100 * tbs / copy:4.0f}% "
                  f"{100 * tbs / at_size[nbytes]:4.0f}% {pms:8.4f} "
                  f"{pms / ms:9.2f}x {nms:8.1f}")
