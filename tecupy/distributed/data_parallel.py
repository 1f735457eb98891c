"""Data parallel: gradients averaged over a group, in buckets (one all-reduce each), the
all-reduces overlapped with the backward.

    reducer = dist.GradientReducer(group, model)         # once: buckets over its parameters
    grads = reducer.gradient(tape, loss)                 # each step: the ranks' mean (a dict)

reducer.gradient is `tape.gradient(loss, model, on_grad=reducer.ready)` then
`reducer.finish()`: the tape calls ready(i, grad) as soon as gradient i is final (after the
backward of its last consumer, tape.py); a bucket is all-reduced as soon as it and every
bucket before it are full (every rank launches the same all-reduces in the same order, as
NCCL needs), on a side stream on the GPU (it waits on an event of the backward's stream),
so its all-reduce overlaps the rest of the backward; finish() writes the means back in
place and makes the current stream wait for them (the optimizer reads them after).

    grads = tape.gradient(loss, params)
    dist.all_reduce_gradients(grads, group)            # in place, after the backward

does the same after the backward, on the current stream (nothing to overlap): the buckets
still cut the launches from one per gradient to one per bucket_mb.

Buckets: consecutive gradients of one dtype along `order` (by default the reverse of the
parameters' order: a backward finishes the last-made layers first; `reducer.arrived` is the
order of the last step's ready() calls, to pass as `order` to a new reducer), each up to
bucket_mb MiB (a single larger gradient is a bucket of its own). The mean is the group's
sum, then divided by its size. The buckets change no bit of the result on the reference
communicator (sums in rank order, element by element); NCCL's order of summation over 3+
ranks may depend on an element's place in a bucket, so compare runs with the same buckets.
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
    """Averages a fixed list of gradients over `group`, bucket by bucket, as they come.

    grads_like: the parameters (or arrays of the gradients' shapes, dtypes and module) as a
    list/tuple, a dict name -> array or a tecupy.nn module (its named_parameters()), in the
    order ready() and Tape.gradient's on_grad number them (a dict's and a module's key
    order). order: "reverse" (default: the backward's order, roughly), "given", or a
    permutation of the indices (the order the gradients are expected to complete in, e.g. a
    previous reducer's `arrived`): buckets are cut along it. Every rank must build the same
    buckets (same grads_like, bucket_mb and order)."""

    def __init__(self, group, grads_like, bucket_mb=25, average=True, side_stream=True,
                 order="reverse"):
        self.group, self.average = group, average
        self.wrt = grads_like  # what gradient() differentiates by (a module, dict or list)
        like = _listed(grads_like)
        self.order = _order(order, len(like))
        cuts = plan_buckets([like[i] for i in self.order], int(bucket_mb * 2**20))
        self.buckets = [[self.order[k] for k in b] for b in cuts]
        self._of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._stream = None
        if side_stream and like and _on_gpu(like[0]):
            import cupy
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.arrived = []  # the order of the last step's ready() calls
        self.reset()

    def reset(self):
        """Forget a step's gradients (finish() does; after a failed backward, call it)."""
        self._grads, self._flat, self._next = {}, {}, 0
        self._left = [len(b) for b in self.buckets]
        self._arriving = []

    def gradient(self, tape, outputs, output_grad=None, retain_graph=False):
        """One line per step: tape.gradient(outputs, <grads_like>, output_grad, retain_graph,
        on_grad=self.ready), then finish(). -> what tape.gradient returns (a dict for a
        module or dict, a list for a list), each gradient the mean over the group, written
        in place; the current stream waits for the last all-reduce."""
        try:
            grads = tape.gradient(outputs, self.wrt, output_grad, retain_graph,
                                  on_grad=self.ready)
        except BaseException:
            self.reset()
            raise
        self.finish()
        return grads

    def ready(self, i, grad):
        """Gradient i is complete (its values are final on the current stream)."""
        if i not in self._of:
            raise ValueError(f"GradientReducer.ready: no gradient {i!r} (this reducer has "
                             f"{len(self._of)}: 0..{len(self._of) - 1})")
        if i in self._grads:
            raise ValueError(f"GradientReducer.ready: gradient {i} given twice")
        self._grads[i] = grad
        self._arriving.append(i)
        self._left[self._of[i]] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b):
        # Always a copy, even of a gradient alone in its bucket: reduced in place during
        # the backward, it would change under nodes that still read the same array (an
        # add's backward hands dy to both inputs: a bias's gradient can be the gradient of
        # the activation beside it). The means go back in finish(), after the backward.
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
        in index order."""
        missing = [i for i in self._of if i not in self._grads]
        if missing:
            raise ValueError(f"GradientReducer.finish: gradients {sorted(missing)} never "
                             "given")
        if self._stream is None:
            self._unflatten()
        else:
            xp = xp_of(self._grads[self.buckets[0][0]])
            # (the write-back waits for what the current stream has queued on them too)
            self._stream.wait_event(xp.cuda.get_current_stream().record())
            with self._stream:
                self._unflatten()
            xp.cuda.get_current_stream().wait_event(self._stream.record())
        out = [self._grads[i] for i in range(len(self._grads))]
        self.arrived = self._arriving
        self.reset()
        return out

    def _unflatten(self):
        n = self.group.size if self.average and self.group.size > 1 else None
        for b, idx in enumerate(self.buckets):
            flat, at = self._flat[b], 0
            xp = xp_of(flat)
            for i in idx:
                g = self._grads[i]
                part = flat[at:at + g.size].reshape(g.shape)
                if n is None:
                    g[...] = part
                else:  # the mean written straight into the gradient: one pass
                    xp.true_divide(part, n, out=g)
                at += g.size


def _listed(grads_like):
    """grads_like as a list, in the index order of Tape.gradient's on_grad."""
    if callable(getattr(grads_like, "named_parameters", None)):  # a tecupy.nn module
        grads_like = grads_like.named_parameters()
    if isinstance(grads_like, dict):
        return list(grads_like.values())
    if isinstance(grads_like, (list, tuple)):
        return list(grads_like)
    raise TypeError("GradientReducer: grads_like must be a list/tuple or dict of arrays or "
                    f"a tecupy.nn module; got {type(grads_like).__name__}")


def _on_gpu(a):
    """A CuPy array, or an FP8 weight whose codes are one (tecupy.fp8_params.FP8Weight)."""
    return is_cupy(a) or (getattr(a, "_tecupy_codes", False) and is_cupy(a.data))


def _order(order, n):
    if isinstance(order, str) and order in ("reverse", "given"):
        return list(range(n))[::-1] if order == "reverse" else list(range(n))
    if isinstance(order, str) or sorted(order) != list(range(n)):
        raise ValueError(f"GradientReducer: order must be 'reverse', 'given' or a "
                         f"permutation of 0..{n - 1}; got {order!r:.60}")
    return [int(i) for i in order]


def all_reduce_gradients(grads, group, bucket_mb=25, average=True):
    """Average (or sum, average=False) the gradients over `group`, in place, one
    all-reduce per bucket of up to bucket_mb MiB; grads: a list/tuple or dict of arrays
    (None entries skipped). -> grads."""
    items = list(grads.values()) if isinstance(grads, dict) else list(grads)
    live = [g for g in items if g is not None]
    if not live:
        return grads
    reducer = GradientReducer(group, live, bucket_mb, average, side_stream=False,
                              order="given")
    for i, g in enumerate(live):
        reducer.ready(i, g)
    reducer.finish()
    return grads
