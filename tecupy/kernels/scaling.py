"""CUDA delayed-scaling update for many FP8 metas in one launch: cuda/delayed_scaling.cu."""
import numpy as np

from .. import backends, loader
from .._array import is_cupy
from ..graphs import keep_alive
from .launch import Launcher, planned

FILE = "delayed_scaling.cu"
loader.declare(FILE, ["delayed_scaling_update", "scale_inverse"])


def supported(metas, algo, margin):
    """CuPy metas of one history length (a loop, not a set and a generator: every exit)."""
    if not metas:
        return False
    length = metas[0].amax_history.shape[0]
    for m in metas:
        h = m.amax_history
        if not is_cupy(h) or h.shape[0] != length:
            return False
    return True


# Device copies of the pointer tables, by content and device: a module's FP8 metas keep
# their arrays from step to step, so after the first step the update makes no host-to-device
# copy (a copy per call cost host time, and a CUDA graph capture refuses one). A table holds
# only addresses and counts, so reusing one whose arrays were freed and reallocated at the
# same addresses is still right. Bounded: the oldest table goes first.
_tables = {}
MAX_TABLES = 256


def _device_table(values):
    import cupy
    key = (cupy.cuda.runtime.getDevice(), tuple(values))
    table = _tables.get(key)
    if table is None:
        if len(_tables) >= MAX_TABLES:
            _tables.pop(next(iter(_tables)))
        table = _tables[key] = cupy.asarray(np.array(values, np.int64))
    return table


# Launch plans by (device, algo, margin, the metas' ids): (the metas' arrays when planned,
# Launcher, arguments). A repeated exit with the same states checks 4 identities per
# meta: no pointer list, cumsum or hash of every pointer, no copy (issue 21: ~17 us of the
# FP8 Linear's host time on an H100). The plan holds the arrays it read, so their ids are
# not reused while it lives: a meta whose arrays were replaced (a resized history, a state
# made again) fails the check and is planned again. Bounded: the oldest plan goes first.
_plans = {}
MAX_PLANS = 256
_ARRAYS = ("amax_history", "scale", "scale_inv", "fp8_max")  # the table's order per meta


@backends.register("delayed_scaling_update", "cuda", supports=supported)
def delayed_scaling_update(metas, algo, margin):
    import cupy
    key = (cupy.cuda.runtime.getDevice(), algo, margin, *map(id, metas))
    plan = _plans.get(key)
    if plan is None or not _same_arrays(plan[0], metas):
        if len(_plans) >= MAX_PLANS and key not in _plans:
            _plans.pop(next(iter(_plans)))
        plan = _plans[key] = _plan(metas, algo, margin)
    _, run, args = plan
    keep_alive(args[0])  # a captured update reads the table at every replay: kept with it
    run(args)


def _same_arrays(arrays, metas):
    """Whether each meta still holds the arrays the plan read (by identity: no __eq__)."""
    i = 0
    for m in metas:
        if not (arrays[i] is m.amax_history and arrays[i + 1] is m.scale
                and arrays[i + 2] is m.scale_inv and arrays[i + 3] is m.fp8_max):
            return False
        i += 4
    return True


def _plan(metas, algo, margin):
    """(arrays, Launcher, arguments) of the update of `metas`: the device table holds each
    meta's 4 pointers, then the slot offsets (a cumsum of the slot counts); one block per
    slot of all metas."""
    arrays = tuple(getattr(m, name) for m in metas for name in _ARRAYS)
    starts = np.cumsum([0] + [m.scale.size for m in metas])
    table = _device_table([a.data.ptr for a in arrays] + starts.tolist())
    k = loader.function(FILE, "delayed_scaling_update")
    args = (table, np.int32(len(metas)), np.int32(metas[0].amax_history.shape[0]),
            np.int32(algo == "most_recent"),
            np.float32(2.0 ** -margin))  # down: exact, margin <= 126 (recipe.py)
    import cupy
    kinds = (cupy.ndarray, np.int32, np.int32, np.int32, np.float32)
    return arrays, Launcher(k, (int(starts[-1]),), (128,), kinds), args


@backends.register("fp8_scale_inv", "cuda", supports=lambda s, out: is_cupy(s))
def scale_inverse(scale, out):
    import cupy
    run, n = planned(_inverse_plans, (scale.size, cupy.cuda.runtime.getDevice()),
                     _inverse_plan, scale.size)
    run((scale, out, n))


_inverse_plans = {}  # scale_inverse's launch plans (launch.planned), by size and device


def _inverse_plan(n):
    """(Launcher, n as the kernel's int32) of scale_inverse: one thread per element."""
    import cupy
    k = loader.function(FILE, "scale_inverse")
    return (Launcher(k, ((n + 127) // 128,), (128,), (cupy.ndarray, cupy.ndarray, np.int32)),
            np.int32(n))
