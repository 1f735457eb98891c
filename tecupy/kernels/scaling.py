"""CUDA delayed-scaling update for many FP8 metas in one launch: cuda/delayed_scaling.cu."""
import numpy as np

from .. import backends, loader
from .._array import is_cupy
from ..graphs import keep_alive

FILE = "delayed_scaling.cu"
loader.declare(FILE, ["delayed_scaling_update", "scale_inverse"])


def supported(metas, algo, margin):
    lengths = {m.amax_history.shape[0] for m in metas}
    return bool(metas) and all(is_cupy(m.amax_history) for m in metas) and len(lengths) == 1


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


@backends.register("delayed_scaling_update", "cuda", supports=supported)
def delayed_scaling_update(metas, algo, margin):
    ptrs = [t.data.ptr for m in metas for t in (m.amax_history, m.scale, m.scale_inv,
                                                 m.fp8_max)]
    starts = np.cumsum([0] + [m.scale.size for m in metas])
    table = _device_table(ptrs + starts.tolist())
    keep_alive(table)  # a captured update reads it at every replay: not to be evicted then
    k = loader.function(FILE, "delayed_scaling_update")
    k((int(starts[-1]),), (128,), (table, np.int32(len(metas)),
      np.int32(metas[0].amax_history.shape[0]), np.int32(algo == "most_recent"),
      np.float32(2.0 ** -margin)))  # down: exact, margin <= 126 (recipe.py)


@backends.register("fp8_scale_inv", "cuda", supports=lambda s, out: is_cupy(s))
def scale_inverse(scale, out):
    n = scale.size
    loader.function(FILE, "scale_inverse")(((n + 127) // 128,), (128,),
                                           (scale, out, np.int32(n)))
