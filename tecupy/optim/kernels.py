"""CUDA launches of the fused optimizer step: cuda/optim.cu. The parameters' table (pointers
to each parameter, master copy and moments, sizes, chunk starts) is built once; the
gradients' pointers go by value in a GradPack argument every step, so a step makes no
host-to-device copy and can be captured in a CUDA graph (the pointers are baked into it)."""
import numpy as np

from .. import loader
from .._array import bfloat16
from ..graphs import keep_alive

FILE = "optim.cu"
CHUNK, PACK, ROWS = 4096, 256, 5  # kChunk, kPack, kRows of optim.cu
THREADS, PROLOGUE_THREADS = 256, 1024
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
CTYPE = {F32: "float", F16: "__half", bfloat16: "__nv_bfloat16"}
# (param, grad) dtype pairs: a gradient in the parameter's dtype or in float32; a float32
# parameter with a 16-bit gradient: an FP8 weight's master copy (fp8_params.py)
PAIRS = [(F32, F32), (F32, F16), (F32, bfloat16), (F16, F16), (F16, F32),
         (bfloat16, bfloat16), (bfloat16, F32)]
MOMENTS = (F32, bfloat16)
loader.declare(FILE, ["optim_prologue"]
               + [f"grad_sumsq<{CTYPE[g]}>" for g in CTYPE]
               + [f"sgd_update<{CTYPE[p]}, {CTYPE[g]}>" for p, g in PAIRS]
               + [f"adamw_update<{CTYPE[p]}, {CTYPE[g]}, {CTYPE[m]}>" for p, g in PAIRS
                  for m in MOMENTS])
PACK_DTYPE = np.dtype([("g", np.uint64, (PACK,))])  # struct GradPack


def supported(params):
    """Whether the kernels take these parameters: CuPy arrays of float32, float16 or
    bfloat16, C-contiguous (the kernels read them flat)."""
    from .._array import is_cupy
    return all(is_cupy(p) and p.dtype in CTYPE and p.flags.c_contiguous for p in params)


class Table:
    """The device table of n tensors (in the optimizer's table order) and its chunk starts.
    rows: lists of arrays or None (param, master, m or buf, v)."""

    def __init__(self, params, masters, m, v):
        import cupy
        n = len(params)
        ptr = [[0 if a is None else a.data.ptr for a in row] for row in (params, masters, m, v)]
        numel = [p.size for p in params]
        self.starts = np.concatenate([[0], np.cumsum([-(-k // CHUNK) for k in numel])])
        host = np.array(sum(ptr, []) + numel + self.starts.tolist(), np.int64)
        self.n, self.chunks = n, int(self.starts[-1])
        self.array = cupy.asarray(host)  # once: parameters do not move
        self.partials = cupy.zeros((max(1, self.chunks),), np.float32)


def groups(param_dtypes, grads):
    """[(first, count, param dtype, grad dtype)]: runs of consecutive tensors of one (param,
    grad) dtype pair, at most PACK each (one launch of a kernel per run)."""
    out = []
    for i, (pd, g) in enumerate(zip(param_dtypes, grads)):
        last = out[-1] if out else None
        if last and last[2] == pd and last[3] == g.dtype and last[1] < PACK:
            out[-1] = (last[0], last[1] + 1, pd, g.dtype)
        else:
            out.append((i, 1, pd, g.dtype))
    return out


def grad_pack(grads, first, count):
    """The GradPack of grads[first:first + count]: a size-one numpy array of the struct,
    which CuPy passes by value."""
    pack = np.zeros(1, PACK_DTYPE)
    pack["g"][0, :count] = [g.data.ptr for g in grads[first:first + count]]
    return pack


def step(kind, table, grads, param_dtypes, moments_dtype, state, hyper, clip, schedule,
         sumsq_reduce=None):
    """One optimizer step on the device. kind: "adamw" | "sgd"; grads in table order (CuPy,
    C-contiguous, checked); state: (step int32 [1], lr float32 [1], sc float32 [6]); hyper:
    the kernel's own floats (beta1, beta2, eps) or (momentum, wd, nesterov); clip: max_norm
    or None; schedule: None or a WarmupCosine; sumsq_reduce: Optimizer.sumsq_reduce (given
    the partial sums of squares, between their kernel and the prologue)."""
    runs = [(r, grad_pack(grads, r[0], r[1])) for r in groups(param_dtypes, grads)]
    keep_alive((table, state))  # a captured step reads them at every replay
    if clip is not None:
        for (first, count, _, gd), pack in runs:
            _launch(f"grad_sumsq<{CTYPE[gd]}>", table, first, count,
                    (table.array, np.int32(table.n), pack, np.int32(first), np.int32(count),
                     table.partials))
        if sumsq_reduce is not None:
            sumsq_reduce(table.partials)
    _prologue(table, state, clip, hyper if kind == "adamw" else None, schedule)
    for (first, count, pd, gd), pack in runs:
        _update(kind, table, first, count, pd, gd, pack, state[2], moments_dtype, hyper)


def begin(kind, table, state, hyper, schedule):
    """A step's prologue without clipping (step += 1, lr, the scalars sc), for updates
    one tensor at a time (update_one): Optimizer.step_in_backward."""
    keep_alive((table, state))
    _prologue(table, state, None, hyper if kind == "adamw" else None, schedule)


def update_one(kind, table, pos, grad, param_dtype, moments_dtype, sc, hyper):
    """The update of the tensor at table position `pos` alone, from `grad` (CuPy,
    C-contiguous, checked), with the scalars sc of begin(): the same kernel as step's, a
    launch of count 1 (each element's maths is its own: bit-identical to step's)."""
    _update(kind, table, pos, 1, param_dtype, grad.dtype, grad_pack([grad], 0, 1), sc,
            moments_dtype, hyper)


def _update(kind, table, first, count, pd, gd, pack, sc, moments_dtype, hyper):
    if kind == "adamw":
        name = f"adamw_update<{CTYPE[pd]}, {CTYPE[gd]}, {CTYPE[moments_dtype]}>"
    else:
        name = f"sgd_update<{CTYPE[pd]}, {CTYPE[gd]}>"
    _launch(name, table, first, count, (table.array, np.int32(table.n), pack,
            np.int32(first), np.int32(count), sc) + _floats(kind, hyper))


def _floats(kind, hyper):
    if kind == "adamw":
        beta1, beta2, eps, _ = hyper
        return np.float32(beta1), np.float32(beta2), np.float32(eps)
    momentum, wd, nesterov = hyper
    return np.float32(momentum), np.float32(wd), np.int32(nesterov)


def _launch(name, table, first, count, args):
    blocks = int(table.starts[first + count] - table.starts[first])
    if blocks:  # (a run of empty tensors has no chunk)
        loader.function(FILE, name)((blocks,), (THREADS,), args)


def _prologue(table, state, clip, adam, schedule):
    """step += 1, lr (from the schedule), the norm and the step's scalars; adam: (beta1,
    beta2, eps, weight_decay) for AdamW, None for SGD (its weight decay is coupled)."""
    step_, lr, sc = state
    beta1, beta2, _, wd = adam if adam is not None else (0.0, 0.0, 0.0, 0.0)
    sched = schedule.kernel_args() if schedule is not None else (0, 0.0, 0.0, 0, 1)
    kind, base, min_lr, warmup, total = sched
    loader.function(FILE, "optim_prologue")((1,), (PROLOGUE_THREADS,), (
        table.partials, np.int64(table.chunks), np.int32(clip is not None),
        np.float32(np.inf if clip is None else clip), step_, lr, sc, np.float64(beta1),
        np.float64(beta2), np.float64(wd), np.int32(kind), np.float64(base),
        np.float64(min_lr), np.int64(warmup), np.int64(total)))
