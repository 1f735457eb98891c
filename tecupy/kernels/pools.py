"""Zeroed slots without a memset: the {max, count} pairs of kernels that end in grid_amax
(common.cuh) and the ring kernels' row counters (RowTaker, bulk.cuh), from per-device pools;
the amax arguments and grid of a grid_amax kernel."""
import threading

import numpy as np

from .._array import is_cupy
from .launch import grid_1d, resident_blocks


def amax_grid(k, n, per_thread, threads=256):
    """Blocks for a grid-stride kernel `k` over n items that ends in grid_amax: no more than
    fit on the GPU at once, as each block's end waits for a round trip to L2 (the count of
    grid_amax), best paid once per resident block (H200, cast at 8192 x 4096: 89.6 -> 91.0% of
    copy against 16 blocks per SM, 64 -> 71% at 2048 x 4096; PERFLOG.md)."""
    return grid_1d(n, per_thread, threads, resident_blocks(k, threads, 0))


# amax outputs without a zeroing memset: kernels reduce into a zeroed {max, count} slot
# (grid_amax, common.cuh), the grid's last block writes amax and zeroes the slot again. The
# ring kernels' row counters (RowTaker, bulk.cuh) come the same way: RING_COUNTERS counters
# 128 bytes apart per launch, left at zero by the launch. Slots come round-robin from a
# per-device pool of each kind, zeroed once; a call captured into a CUDA graph gets a slot
# of its own for good (its replays may run at any time), so a slot is reused only a pool's
# length of eager calls later, long after its last kernel ended.
AMAX_SLOTS = 1 << 14
RING_SLOTS, RING_COUNTERS = 1 << 12, 16  # 8 MB, made at the first launch with counters
_pools = {}  # (kind, device) -> [uint32 (slots, words) zeros, next slot, slots kept by graphs]
_pool_lock = threading.Lock()


def _pool_slot(kind, slots, words):
    """A zero slot of `words` uint32 from the pool of `kind`: its address as a NumPy uint64
    (a pointer argument), or a fresh CuPy array of zeros."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    capturing = cupy.cuda.get_current_stream().is_capturing()
    with _pool_lock:  # two threads never get one slot
        pool = _pools.get((kind, dev))
        if pool is None:
            if capturing:  # no pool yet, and no memset may run outside the graph
                return cupy.zeros(words, np.uint32)
            pool = _pools[kind, dev] = [cupy.zeros((slots, words), np.uint32), 0, set()]
            cupy.cuda.Device().synchronize()  # zero before any stream uses a slot
        buf, i, kept = pool
        for _ in range(slots):
            i = (i + 1) % slots
            if i not in kept:
                break
        else:
            return cupy.zeros(words, np.uint32)  # every slot kept by graphs: a zeroed one
        pool[1] = i
        if capturing:
            kept.add(i)
    return np.uint64(buf.data.ptr + 4 * words * i)  # (CuPy indexing costs ~5 us)


def amax_slot():
    """A zero {max, count} pair of uint32 for one launch of a grid_amax kernel."""
    return _pool_slot("amax", AMAX_SLOTS, 2)


def ring_counters():
    """RING_COUNTERS zero uint32 row counters, 128 bytes apart, for one ring launch."""
    return _pool_slot("ring", RING_SLOTS, 32 * RING_COUNTERS)


def amax_args(amax_out, n):
    """(amax, slot) arguments of a kernel ending in grid_amax, for an output of n values: a
    given amax_out (float32, one element, >= +0), which each block atomicMax-es into (no
    slot: Transformer Engine's way, ~1 us less per launch than a fresh amax), or a fresh
    amax, written once through a slot of the pool (zeros and no slot where n is 0: no
    launch)."""
    import cupy
    if amax_out is not None:
        if not (is_cupy(amax_out) and amax_out.dtype == np.float32 and amax_out.size == 1):
            raise TypeError("amax_out must be a float32 CuPy array of one element, got "
                            f"{type(amax_out).__name__} {getattr(amax_out, 'dtype', '')} "
                            f"shape {getattr(amax_out, 'shape', '')}")
        return amax_out, np.uint64(0)
    if not n:
        return cupy.zeros((1,), np.float32), np.uint64(0)
    return cupy.empty((1,), np.float32), amax_slot()
