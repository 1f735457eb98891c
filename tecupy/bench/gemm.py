"""python -m tecupy.bench gemm: the FP8 GEMM (E4M3 x E4M3, bf16 out) in TFLOP/s against
torch._scaled_mm (cuBLASLt, per-tensor scales) measured in the same run, with fast
accumulation on (ours: "fast") and off (ours: split accumulator), for 4096^3, 8192^3 and the
transformer-layer shapes. Times are medians of CUDA-event timings of back-to-back calls
(kernel time: the inputs fit in L2 for both sides alike), ours and the peer interleaved,
best of two medians each (the clocks drift by up to 10% between runs under FP8 load). Also
reports the largest difference between our output and cuBLASLt's, relative to the output's
magnitude.

--recipe block (python -m tecupy.bench.gemm --recipe block; `python -m tecupy.bench gemm
--recipe block` once the suite runner passes the option): the block-scaled GEMM
(Float8BlockScaling: A in 1x128 blocks, B in 128x128 blocks as a weight or 1x128 as wgrad's
operand) against our per-tensor FP8 GEMM with the split accumulator (the same accumulation:
the ratio is what the block factors cost), and against torch._scaled_mm with blockwise scales
(cuBLASLt, CUDA >= 12.9 on sm_90) where this torch has it, on the six shapes and DeepGEMM's
M=4096, N=7168, K=16384. "block" is fp8_block_gemm_tn (factors loaded from global memory in
the mainloop); the pipelined block kernel (kernels/fp8_gemm.py's BLOCK_PIPELINE, the default:
every factor from shared memory) is timed in the same run, interleaved with it: its TF/s, its
ratio to per-tensor split and to the other block kernel. Per row, the per-tensor GEMM, both
block kernels and the peer are timed in the same six rounds, in turns (every other round in
reverse order), after 2 s of load: TF/s of the best round, ratios to per-tensor the median of
the rounds' own ratios. First, before the table, DeepGEMM's shape timed by DeepGEMM's method.
"""
import numpy as np

from .timing import (first_call, flushed_ms, gpu_name, gpu_time_ms, in_turns, sustain,
                     torch_time_ms)

SHAPES = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192),
          ("qkv", 8192, 12288, 4096), ("proj", 8192, 4096, 4096),
          ("fc1", 8192, 16384, 4096), ("fc2", 8192, 4096, 16384)]


def _operands(m, n, k):
    import cupy
    import tecupy
    rng = cupy.random.default_rng(0)
    a = tecupy.quantize(rng.standard_normal((m, k), np.float32), 1.0, "e4m3")
    b = tecupy.quantize(rng.standard_normal((n, k), np.float32), 1.0, "e4m3")
    return a, b


def _torch_peer(a, b, fast):
    try:
        import torch
    except ImportError:
        return None, None
    ta = torch.from_dlpack(a.data).view(torch.float8_e4m3fn)
    tb = torch.from_dlpack(b.data).view(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda", dtype=torch.float32)

    def call():
        return torch._scaled_mm(ta, tb.t(), one, one, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    return call, lambda y: y.float().cpu().numpy()


def run(args):
    if getattr(args, "recipe", "tensor") == "block":
        return run_block(args)
    import cupy
    from tecupy import bfloat16
    from tecupy.kernels import fp8_gemm as K
    print(f"GPU: {gpu_name()}")
    print(f"{'shape':8s} {'M':>6s} {'N':>6s} {'K':>6s} {'accum':5s} {'first s':>8s} "
          f"{'ours TF/s':>10s} {'cuBLASLt':>9s} {'ratio':>6s} {'max|diff|':>9s}")
    ratios = {True: [], False: []}
    for label, m, n, k in SHAPES:
        a, b = _operands(m, n, k)
        for split in (False, True):
            def ours():
                return K.fp8_gemm(a.data, a.fmt, a.scale_inv, b.data, b.fmt, b.scale_inv,
                                  bfloat16, split_accumulator=split)
            y, first = first_call(ours)
            peer, to_np = _torch_peer(a, b, fast=not split)
            ms, pms = [], []
            for _ in range(2):  # interleaved, best of two: clocks drift under FP8 load
                ms.append(gpu_time_ms(ours, [()], calls=30))
                if peer is not None:
                    pms.append(torch_time_ms(peer, calls=30))
            tf = 2 * m * n * k / min(ms) / 1e9
            ptf, diff = float("nan"), float("nan")
            if peer is not None:
                ptf = 2 * m * n * k / min(pms) / 1e9
                ref = to_np(peer())
                diff = float(np.abs(cupy.asnumpy(y.astype(np.float32)) - ref).max()
                             / max(np.abs(ref).max(), 1e-30))
                ratios[split].append(tf / ptf)
            print(f"{label:8s} {m:6d} {n:6d} {k:6d} {'split' if split else 'fast':5s} "
                  f"{first / 1e3:8.2f} {tf:10.0f} {ptf:9.0f} {tf / ptf:6.2f} {diff:9.1e}")
    for split, r in ratios.items():
        if r:
            print(f"geomean ours/cuBLASLt ({'split' if split else 'fast'} accumulation): "
                  f"{np.exp(np.mean(np.log(r))):.3f}, min {min(r):.3f}")


# ---- --recipe block ----------------------------------------------------------------------
BLOCK_SHAPES = SHAPES + [("dsv3", 4096, 7168, 16384)]  # DeepGEMM's H800 figure: 1426 TF/s


def _block_operands(m, n, k, dim_b):
    """(codes, scale_inv) of A [M, K] in 1x128 blocks and B [N, K] in dim_b's blocks."""
    import cupy
    from tecupy import backends
    from tecupy.fp8 import E4M3
    rng = cupy.random.default_rng(0)
    out = []
    for shape, dim in (((m, k), 1), ((n, k), dim_b)):
        x = rng.standard_normal(shape, np.float32)
        out.append(backends.dispatch("block_quantize", x, E4M3, dim, True, 0.0, False)[:2])
        del x
    return out


def _torch_block_peer(a, sa, b, sb, dim_b):
    """torch._scaled_mm with blockwise scales, or (None, why). Its layouts (ATen's
    ScaledBlas.cpp, get_joint_scaling: scale_b is checked transposed, against mat2.t()):
    scale_a [M, K/128] M-major; 1x128 scale_b [K/128, N] N-major (ours as it is); 128x128
    scale_b [K/128 padded to 4, N/128] K-major."""
    try:
        import torch
    except ImportError:
        return None, "torch is not importable"
    import cupy
    ta = torch.from_dlpack(a).view(torch.float8_e4m3fn)
    tb = torch.from_dlpack(b).view(torch.float8_e4m3fn)
    scale_a = torch.from_dlpack(sa).t()  # ours [K/128, M] -> [M, K/128], stride (1, M)
    if dim_b == 1:
        scale_b = torch.from_dlpack(cupy.ascontiguousarray(sb))  # [K/128, N], stride (N, 1)
    else:  # ours [N/128, K/128] -> K/128 padded to a multiple of 4, then [L4, N/128]
        nb, kb = sb.shape
        padded = cupy.ones((nb, -(-kb // 4) * 4), np.float32)
        padded[:, :kb] = sb
        scale_b = torch.from_dlpack(padded).t()

    def call():
        return torch._scaled_mm(ta, tb.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
    try:
        call()
        torch.cuda.synchronize()
    except Exception as err:  # no blockwise _scaled_mm in this torch / CUDA / GPU
        return None, f"torch._scaled_mm has no blockwise scaling here ({err})".split("\n")[0]
    return call, None


def _per_tensor_call(m, n, k):
    """A call of our per-tensor FP8 GEMM with the split accumulator, bf16 out, at m x n x k."""
    from tecupy import bfloat16
    from tecupy.kernels import fp8_gemm as K
    a, b = _operands(m, n, k)

    def call():
        return K.fp8_gemm(a.data, a.fmt, a.scale_inv, b.data, b.fmt, b.scale_inv, bfloat16,
                          split_accumulator=True)
    call()
    return call


def _block_row(m, n, k, dim_b, notes, tensor):
    """(first call ms, ours TF/s, torch's TF/s or NaN, the pipelined kernel's TF/s, the
    per-tensor GEMM's TF/s, ours / per-tensor, pipelined / per-tensor) of the block GEMM
    (fp8_block_gemm_tn), B in dim_b's blocks; tensor: a call of the per-tensor GEMM of this
    shape. Why torch was skipped goes into `notes`. Every kernel is timed in the same
    ROUNDS rounds, in turns, every other round in reverse order: TF/s are the best round's;
    the ratios to per-tensor the median of each round's ratio (the clocks drift under FP8
    load, from round to round: a ratio of two best rounds compares two moments). The
    pipelined kernel (fp8_gemm.BLOCK_PIPELINE on, the default) is checked equal to the
    other."""
    from tecupy import bfloat16
    from tecupy.fp8 import E4M3
    from tecupy.kernels import block_scaling as B
    from tecupy.kernels import fp8_gemm as G
    (a, sa), (b, sb) = _block_operands(m, n, k, dim_b)
    was = G.BLOCK_PIPELINE

    def ours(pipe=False):
        G.BLOCK_PIPELINE = pipe
        try:
            return B.fp8_block_gemm(a, E4M3, sa, b, E4M3, sb, bfloat16)
        finally:
            G.BLOCK_PIPELINE = was
    y, first = first_call(ours)

    def piped():
        return ours(True)
    import cupy
    if not bool(cupy.array_equal(piped(), y)):
        notes.add(f"pipelined block kernel differs from the other at {m}x{n}x{k}, B {dim_b}")
    peer, why = _torch_block_peer(a, sa, b, sb, dim_b)
    if why:
        notes.add(why)
    elif not _close(cupy.from_dlpack(peer()), y):  # the scales' layout read as we mean it
        notes.add(f"cuBLASLt's output differs from ours at {m}x{n}x{k}, B {dim_b}")
    ms, pms, qms, tms = [], [], [], []
    turns = [(tms, lambda: gpu_time_ms(tensor, [()], calls=30)),
             (ms, lambda: gpu_time_ms(ours, [()], calls=30)),
             (qms, lambda: gpu_time_ms(piped, [()], calls=30))]
    if peer is not None:
        turns.append((pms, lambda: torch_time_ms(peer, calls=30)))
    for times, timed in in_turns(turns, ROUNDS):
        times.append(timed())
    flop = 2 * m * n * k
    nan = float("nan")
    return (first, flop / min(ms) / 1e9, flop / min(pms) / 1e9 if pms else nan,
            flop / min(qms) / 1e9, flop / min(tms) / 1e9,
            float(np.median(np.array(tms) / ms)), float(np.median(np.array(tms) / qms)))


ROUNDS = 6  # (block rows: even, so that each order runs as often)
SUSTAIN_S = 2.0  # seconds of FP8 load before the first block row


def _close(got, want, rtol=2 ** -7):
    """Two bf16 GEMM outputs agree within a bf16 rounding of the largest |want| (the sums'
    order differs between kernels)."""
    import cupy
    got, want = got.astype(np.float32), want.astype(np.float32)
    return bool(cupy.abs(got - want).max() <= rtol * cupy.abs(want).max())


def run_block(args):
    print(f"GPU: {gpu_name()}")
    # DeepGEMM's method first, on a GPU the table's ~40 s of FP8 load has not heated: right
    # after the table the same kernels measured ~3% lower (PERFLOG.md, session 31)
    _deepgemm_method(*BLOCK_SHAPES[-1][1:])
    print(f"{'shape':6s} {'M':>6s} {'N':>6s} {'K':>6s} {'B':7s} {'first s':>8s} "
          f"{'block TF/s':>10s} {'tensor':>7s} {'ratio':>6s} {'torch':>7s} {'ratio':>6s} "
          f"{'pipe TF/s':>9s} {'ratio':>6s} {'/block':>6s}")
    ratios, notes, piped = {1: [], 2: []}, set(), {1: [], 2: []}
    for i, (label, m, n, k) in enumerate(BLOCK_SHAPES):
        tensor = _per_tensor_call(m, n, k)
        if i == 0:  # the first shape's rounds would run while the clocks still sink
            sustain(tensor, SUSTAIN_S)
        for dim_b in (2, 1):
            first, tf, ptf, qtf, ttf, rb, rq = _block_row(m, n, k, dim_b, notes, tensor)
            ratios[dim_b].append(rb)
            piped[dim_b].append(rq)
            blocks = "128x128" if dim_b == 2 else "1x128"
            print(f"{label:6s} {m:6d} {n:6d} {k:6d} {blocks:7s} {first / 1e3:8.2f} {tf:10.0f} "
                  f"{ttf:7.0f} {rb:6.2f} {ptf:7.0f} {tf / ptf:6.2f} {qtf:9.0f} "
                  f"{rq:6.2f} {qtf / tf:6.2f}")
    for kind, table in (("block", ratios), ("pipelined block", piped)):
        for dim_b, r in table.items():
            print(f"geomean {kind} / per-tensor split (B "
                  f"{'128x128' if dim_b == 2 else '1x128'}): "
                  f"{np.exp(np.mean(np.log(r))):.3f}, min {min(r):.3f}")
    for why in sorted(notes):
        print(f"note: {why}")


def _deepgemm_method(m, n, k):
    """The pipelined block GEMM (B 128x128), our per-tensor split GEMM and cuBLASLt's
    blockwise one at m x n x k timed as DeepGEMM times its published figures (flushed_ms:
    an 8 GB memset before each call, the kernel alone): the table above times back-to-back
    calls, whose clocks sink under the sustained FP8 load (PERFLOG.md, session 27)."""
    from tecupy import bfloat16
    from tecupy.fp8 import E4M3
    from tecupy.kernels import block_scaling as B
    from tecupy.kernels import fp8_gemm as G
    (a, sa), (b, sb) = _block_operands(m, n, k, 2)
    qa, qb = _operands(m, n, k)
    calls = {"pipelined block": lambda: B.fp8_block_gemm(a, E4M3, sa, b, E4M3, sb, bfloat16),
             "per-tensor split": lambda: G.fp8_gemm(
                 qa.data, qa.fmt, qa.scale_inv, qb.data, qb.fmt, qb.scale_inv, bfloat16,
                 split_accumulator=True)}
    peer, _ = _torch_block_peer(a, sa, b, sb, 2)
    flop, got = 2 * m * n * k, {}
    for name, fn in calls.items():
        got[name] = flop / flushed_ms(fn) / 1e9
    if peer is not None:
        import torch
        got["cuBLASLt blockwise"] = flop / flushed_ms(peer, xp=torch) / 1e9
    print(f"{m} x {n} x {k}, DeepGEMM's method (30 calls, each after an 8 GB memset, the "
          "kernel alone; its H800 figure: 1426 TF/s): " +
          ", ".join(f"{name} {tf:.0f} TF/s" for name, tf in got.items()))


def main(argv=None):
    """python -m tecupy.bench.gemm [--recipe tensor|block]"""
    import argparse
    p = argparse.ArgumentParser(prog="python -m tecupy.bench.gemm", description=__doc__)
    p.add_argument("--recipe", choices=("tensor", "block"), default="tensor")
    args = p.parse_args(argv)
    import tecupy
    if not tecupy.gpu_available():
        raise SystemExit("tecupy.bench needs a CUDA device (CuPy sees none)")
    run(args)


if __name__ == "__main__":
    main()
