"""Data parallel: gradients averaged over a group, in buckets, the collectives overlapped
with the backward.

    reducer = dist.GradientReducer(group, model)         # once: buckets over its parameters
    grads = reducer.gradient(tape, loss)                 # each step: the ranks' mean (a dict)

reducer.gradient is `tape.gradient(loss, model, on_grad=reducer.ready)` then
`reducer.finish()`: the tape calls ready(i, grad) as soon as gradient i is final (after the
backward of its last consumer, tape.py); a bucket is reduced as soon as it and every bucket
before it are full (every rank launches the same collectives in the same order, as NCCL
needs), on a side stream on the GPU (it waits on an event of the backward's stream), so its
collective overlaps the rest of the backward, and so does the division by the group's size;
finish() makes the current stream wait for them and returns the means.

No copy for a large gradient: one of at least bucket_mb MiB is a bucket of its own, reduced
from the gradient itself into a new array (NCCL's out-of-place all-reduce; the ThreadGroup
reference copies first). Not in place: the backward may still read that very array (an
add hands one dy to both its inputs, so a parameter's gradient can be an activation's
too). Smaller gradients are copied into one flat buffer per bucket (one launch instead of
many); their means are views of it. So the means are new arrays, the ones handed to ready()
are only read.

    grads = tape.gradient(loss, params)
    dist.all_reduce_gradients(grads, group)            # in place, after the backward

does the same after the backward, on the current stream (nothing to overlap), in place: a
large gradient is all-reduced in place, the buckets' means are copied back.

reduce="reduce_scatter" (ZeRO-1, zero.py): each bucket, padded with zeros to a multiple of
the group's size, is reduce-scattered; finish() returns this rank's chunk of each bucket's
mean (a ShardedGradients list). A large gradient whose size splits evenly goes as it is.

Buckets: consecutive gradients of one dtype along `order` (by default the reverse of the
parameters' order: a backward finishes the last-made layers first; `reducer.arrived` is the
order of the last step's ready() calls, to pass as `order` to a new reducer), each up to
bucket_mb MiB; FP8 weights' gradients in buckets of their own. The mean is the group's sum,
then divided by its size. The buckets change no bit of the result on the reference
communicator (sums in rank order, element by element);
NCCL's order of summation over 3+ ranks may depend on an element's place in a bucket and
on the collective, so compare runs with the same buckets and the same `reduce`.
"""
import numpy as np

from .. import _check
from .._array import is_cupy, xp_of

REDUCES = ("all_reduce", "reduce_scatter")


def plan_buckets(grads, bucket_bytes):
    """-> lists of indices into grads: consecutive, one dtype, <= bucket_bytes each (or one
    gradient alone); FP8 weights' (quantized_model_init) apart from the others' (ZeRO keeps
    their shards as float32 master copies and gathers codes)."""
    buckets, size, kind = [], 0, None
    for i, g in enumerate(grads):
        nbytes = _nbytes(g)
        if not buckets or _kind(g) != kind or size + nbytes > bucket_bytes:
            buckets.append([])
            size, kind = 0, _kind(g)
        buckets[-1].append(i)
        size += nbytes
    return buckets


class ShardedGradients(list):
    """This rank's chunk of each bucket's mean gradient, in bucket order (1-D arrays): what
    GradientReducer(reduce="reduce_scatter") returns and ZeroOptimizer.step takes."""


class GradientReducer:
    """Averages a fixed list of gradients over `group`, bucket by bucket, as they come.

    grads_like: the parameters (or arrays of the gradients' shapes, dtypes and module) as a
    list/tuple, a dict name -> array or a tecupy.nn module (its named_parameters()), in the
    order ready() and Tape.gradient's on_grad number them (a dict's and a module's key
    order). order: "reverse" (default: the backward's order, roughly), "given", or a
    permutation of the indices (the order the gradients are expected to complete in, e.g. a
    previous reducer's `arrived`): buckets are cut along it. bucket_mb: a gradient of at
    least this many MiB is reduced alone with no copy, smaller ones are copied into buckets
    of up to this size. reduce: "all_reduce" (finish() -> the means) or "reduce_scatter"
    (-> this rank's chunk of each bucket: ZeRO-1). Every rank must build the same buckets
    (same grads_like, bucket_mb, order and reduce)."""

    def __init__(self, group, grads_like, bucket_mb=25, average=True, side_stream=True,
                 order="reverse", reduce="all_reduce"):
        self.reduce = _check.choice("GradientReducer", "reduce", reduce, REDUCES)
        self.group, self.average = group, average
        self.wrt = grads_like  # what gradient() differentiates by (a module, dict or list)
        like = _listed(grads_like)
        self.order = _order(order, len(like))
        self._like = [(tuple(a.shape), np.dtype(a.dtype)) for a in like]
        bucket_bytes = _bucket_bytes("GradientReducer", bucket_mb)
        cuts = plan_buckets([like[i] for i in self.order], bucket_bytes)
        self.buckets = [[self.order[k] for k in b] for b in cuts]
        self._of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        parts = group.size if reduce == "reduce_scatter" else 1
        self.numel = [sum(like[i].size for i in b) for b in self.buckets]
        self.padded = [-(-k // parts) * parts for k in self.numel]  # zeros after the grads
        # one gradient of >= bucket_mb goes to the collective as it is (if it splits evenly)
        self.direct = [len(b) == 1 and _nbytes(like[b[0]]) >= bucket_bytes and k == p
                       for b, k, p in zip(self.buckets, self.numel, self.padded)]
        self._stream = None
        if side_stream and like and _on_gpu(like[0]):
            import cupy
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.arrived = []  # the order of the last step's ready() calls
        self.reset()

    def reset(self):
        """Forget a step's gradients (finish() does; after a failed backward, call it)."""
        self._grads, self._out, self._next = {}, {}, 0
        self._left = [len(b) for b in self.buckets]
        self._arriving = []

    def gradient(self, tape, outputs, output_grad=None, retain_graph=False):
        """One line per step: tape.gradient(outputs, <grads_like>, output_grad, retain_graph,
        on_grad=self.ready), then finish(). -> the means as tape.gradient would return the
        gradients (a dict for a module or dict, a list for a list), or ShardedGradients
        (reduce_scatter); the current stream waits for the last collective."""
        try:
            grads = tape.gradient(outputs, self.wrt, output_grad, retain_graph,
                                  on_grad=self.ready)
        except BaseException:
            self.reset()
            raise
        means = self.finish()
        if isinstance(grads, dict) and not isinstance(means, ShardedGradients):
            return dict(zip(grads, means))
        return means

    def ready(self, i, grad):
        """Gradient i is complete (its values are final on the current stream; it is only
        read from here on)."""
        if i not in self._of:
            raise ValueError(f"GradientReducer.ready: no gradient {i!r} (this reducer has "
                             f"{len(self._of)}: 0..{len(self._of) - 1})")
        if i in self._grads:
            raise ValueError(f"GradientReducer.ready: gradient {i} given twice")
        shape, dtype = self._like[i]
        if tuple(grad.shape) != shape or np.dtype(grad.dtype) != dtype:
            raise ValueError(f"GradientReducer.ready: gradient {i} is {tuple(grad.shape)} "
                             f"{grad.dtype}; the buckets were planned for {shape} {dtype} "
                             "(grads_like)")
        self._grads[i] = grad
        self._arriving.append(i)
        self._left[self._of[i]] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b):
        grads = [self._grads[i] for i in self.buckets[b]]
        if self._stream is None:
            self._out[b] = self._reduce_bucket(b, grads)
            return
        xp = xp_of(grads[0])
        self._stream.wait_event(xp.cuda.get_current_stream().record())
        with self._stream:  # copy (small gradients), reduce and divide behind the backward
            self._out[b] = self._reduce_bucket(b, grads)

    def _reduce_bucket(self, b, grads):
        """-> bucket b's mean, a new array: flat (all_reduce; the gradient's own if direct)
        or this rank's chunk (reduce_scatter)."""
        xp = xp_of(grads[0])
        send = (xp.ascontiguousarray(grads[0]).reshape(-1) if self.direct[b]
                else _flatten(grads, self.padded[b]))
        if self.reduce == "reduce_scatter":
            out = self.group.reduce_scatter(send)
        elif self.direct[b]:  # the gradient only read: the backward may still read it
            out = _all_reduce_into(self.group, send, xp.empty_like(send))
        else:
            out = self.group.all_reduce(send)  # (our own copy: in place)
        n = _divisor(self.group, self.average)
        if n is not None:
            xp.true_divide(out, n, out=out)
        return out

    def finish(self):
        """Wait for every bucket; -> the means in index order (all_reduce: new arrays of
        the gradients' shapes; several small ones are views of one bucket) or this rank's
        chunk of each bucket (reduce_scatter: ShardedGradients)."""
        missing = [i for i in self._of if i not in self._grads]
        if missing:
            raise ValueError(f"GradientReducer.finish: gradients {sorted(missing)} never "
                             "given")
        if self._stream is not None and self._out:
            xp = xp_of(self._out[0])
            xp.cuda.get_current_stream().wait_event(self._stream.record())
        if self.reduce == "reduce_scatter":
            out = ShardedGradients(self._out[b] for b in range(len(self.buckets)))
        else:
            out = self._unflatten()
        self.arrived = self._arriving
        self.reset()
        return out

    def _unflatten(self):
        out = [None] * len(self._like)
        for b, idx in enumerate(self.buckets):
            at = 0
            for i in idx:
                shape = self._like[i][0]
                size = int(np.prod(shape, dtype=np.int64))
                out[i] = self._out[b][at:at + size].reshape(shape)
                at += size
        return out


def _kind(a):
    return np.dtype(a.dtype), bool(getattr(a, "_tecupy_codes", False))


def _nbytes(a):
    return a.size * np.dtype(a.dtype).itemsize


def _bucket_bytes(op, bucket_mb):
    return int(_check.real(op, "bucket_mb", bucket_mb, 0) * 2**20)


def _divisor(group, average):
    return group.size if average and group.size > 1 else None


def _flatten(grads, size):
    """The gradients raveled one after another into a new flat array of `size` elements
    (zeros after them: reduce_scatter's padding)."""
    xp = xp_of(grads[0])
    numel = sum(g.size for g in grads)
    flat = xp.empty(size, grads[0].dtype)
    xp.concatenate([g.ravel() for g in grads], out=flat[:numel])
    if size > numel:
        flat[numel:].fill(0)
    return flat


def _all_reduce_into(group, x, out):
    """x's sum over the group into out, x only read: NCCL's out-of-place all-reduce where
    the group has one (NcclGroup.all_reduce_into), else a copy reduced in place."""
    into = getattr(group, "all_reduce_into", None)
    if into is not None:
        return into(x, out)
    out[...] = x
    return group.all_reduce(out)


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
    """Average (or sum, average=False) the gradients over `group`, in place (after the
    backward), on the current stream: a gradient of at least bucket_mb MiB all-reduced in
    place, smaller ones one all-reduce per bucket of up to bucket_mb MiB (copied in, the
    means copied back); grads: a list/tuple or dict of arrays (None entries skipped; an
    array given twice is reduced once). -> grads."""
    items = list(grads.values()) if isinstance(grads, dict) else list(grads)
    # each array once: two parameters can get the very same gradient array (an add hands
    # one dy to both), which reduced twice in place would be summed twice
    live = list({id(g): g for g in items if g is not None}.values())
    bucket_bytes = _bucket_bytes("all_reduce_gradients", bucket_mb)
    n = _divisor(group, average)
    for b in plan_buckets(live, bucket_bytes):
        gs = [live[i] for i in b]
        xp = xp_of(gs[0])
        if len(gs) == 1 and _nbytes(gs[0]) >= bucket_bytes:  # no copy in or out
            group.all_reduce(gs[0])
            if n is not None:
                xp.true_divide(gs[0], n, out=gs[0])
            continue
        flat, at = group.all_reduce(_flatten(gs, sum(g.size for g in gs))), 0
        for g in gs:
            part = flat[at:at + g.size].reshape(g.shape)
            if n is None:
                g[...] = part
            else:  # the mean written straight into the gradient: one pass
                xp.true_divide(part, n, out=g)
            at += g.size
    return grads
