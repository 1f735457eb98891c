"""Data parallel: gradients averaged over a group, in buckets (one all-reduce each).

    grads = tape.gradient(loss, params)
    dist.all_reduce_gradients(grads, group)            # in place: the mean over the ranks

GradientReducer is the machinery, written for a per-gradient hook: `ready(i, grad)` as each
gradient is complete; a bucket is reduced as soon as it and every bucket before it are full
(every rank launches the same all-reduces in the same order, as NCCL needs), on a side
stream on the GPU, so its all-reduce overlaps the rest of the backward; `finish()` waits
and writes the means back. The tape has no such hook yet (README, "Multi-GPU"), so
all_reduce_gradients calls ready() for every gradient after the backward, on the current
stream (a side stream would have nothing to overlap): the buckets still cut the launches
from one per gradient to one per bucket_mb.

Buckets: consecutive gradients of one dtype, in the order given (reverse them to match a
backward that finishes the last layer first), each up to bucket_mb MiB (a single larger
gradient is a bucket of its own). The mean is the group's sum, then divided by its size.
"""
import numpy as np

from .._array import is_cupy, xp_of


def plan_buckets(grads, bucket_bytes):
    """-> lists of indices into grads: consecutive, one dtype, <= bucket_bytes each (or one
    gradient alone)."""
    buckets, size, dtype = [], 0, None
    for i, g in enumerate(grads):
        nbytes = g.size * np.dtype(g.dtype).itemsize
        if not buckets or g.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, g.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


class GradientReducer:
    """Averages a fixed list of gradients over `group`, bucket by bucket. grads_like:
    arrays of the gradients' shapes, dtypes and module, in the order ready() numbers them."""

    def __init__(self, group, grads_like, bucket_mb=25, average=True, side_stream=True):
        self.group, self.average = group, average
        self.buckets = plan_buckets(grads_like, int(bucket_mb * 2**20))
        self._of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._stream = None
        if side_stream and grads_like and is_cupy(grads_like[0]):
            import cupy
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.reset()

    def reset(self):
        self._grads, self._flat, self._next = {}, {}, 0
        self._left = [len(b) for b in self.buckets]

    def ready(self, i, grad):
        """Gradient i is complete (its values are final on the current stream)."""
        if i in self._grads:
            raise ValueError(f"GradientReducer.ready: gradient {i} given twice")
        self._grads[i] = grad
        self._left[self._of[i]] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b):
        grads = [self._grads[i] for i in self.buckets[b]]
        xp = xp_of(grads[0])
        if self._stream is None:
            self._flat[b] = self.group.all_reduce(xp.concatenate([g.ravel() for g in grads]))
            return
        self._stream.wait_event(xp.cuda.get_current_stream().record())
        with self._stream:  # flatten, and all-reduce, behind the backward
            self._flat[b] = self.group.all_reduce(xp.concatenate([g.ravel() for g in grads]))

    def finish(self):
        """Wait for every bucket, write each gradient's mean back in place; -> grads
        in the given order."""
        missing = [i for i in self._of if i not in self._grads]
        if missing:
            raise ValueError(f"GradientReducer.finish: gradients {missing} never given")
        if self._stream is None:
            self._unflatten()
        else:
            with self._stream:
                self._unflatten()
            xp = xp_of(self._grads[0])
            xp.cuda.get_current_stream().wait_event(self._stream.record())
        out = [self._grads[i] for i in range(len(self._grads))]
        self.reset()
        return out

    def _unflatten(self):
        for b, idx in enumerate(self.buckets):
            flat, at = self._flat[b], 0
            if self.average and self.group.size > 1:
                flat /= self.group.size
            for i in idx:
                g = self._grads[i]
                g[...] = flat[at:at + g.size].reshape(g.shape)
                at += g.size


def all_reduce_gradients(grads, group, bucket_mb=25, average=True):
    """Average (or sum, average=False) the gradients over `group`, in place, one
    all-reduce per bucket of up to bucket_mb MiB; grads: a list/tuple or dict of arrays
    (None entries skipped). -> grads."""
    items = list(grads.values()) if isinstance(grads, dict) else list(grads)
    live = [g for g in items if g is not None]
    if not live:
        return grads
    reducer = GradientReducer(group, live, bucket_mb, average, side_stream=False)
    for i, g in enumerate(live):
        reducer.ready(i, g)
    reducer.finish()
    return grads
