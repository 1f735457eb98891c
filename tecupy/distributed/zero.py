"""ZeRO-1, as PyTorch's ZeroRedundancyOptimizer: the optimizer state (float32 master copies,
moments) sharded over the data-parallel ranks, 1/N of it on each.

    zero = dist.ZeroOptimizer(tecupy.optim.AdamW, model, group, lr=3e-4, weight_decay=0.1)
    grads = zero.gradient(tape, loss)   # reduce-scattered during the backward (side stream)
    zero.step(grads)                    # this rank's shard stepped, the parameters gathered
    # or after the backward:  zero.step(tape.gradient(loss, model))

Layout: the parameters are cut into the buckets of a GradientReducer(reduce=
"reduce_scatter") (data_parallel.py: consecutive, one dtype, up to bucket_mb MiB; one of
>= bucket_mb MiB alone); each bucket is a flat segment padded with zeros to a multiple of
the group's size N, and rank r owns its r-th chunk. A step: the gradients reduce-scattered
bucket by bucket into those chunks and divided by N; one `optimizer_cls` over this rank's
chunks (a 1-D parameter per bucket, named "bucket<b>") steps them; each segment is
all-gathered back into the parameters. A bucket of one parameter whose size splits evenly
is a view of the parameter itself: its chunk is stepped in place and NCCL gathers in place,
no copy. The small parameters of a bucket live in a flat copy (this rank's chunk copied
from them before the step, the gathered segment copied back after).

Bit for bit the non-sharded step (GradientReducer or all_reduce_gradients, then the same
optimizer over the parameters) on the ThreadGroup reference: reduce_scatter and all_reduce
both add in rank order, element by element; the update is element by element; the padding
stays zero (zero gradient, zero parameter). On NCCL the same for 2 ranks (a + b commutes);
over 3+ ranks NCCL's reduce-scatter and all-reduce may add in different orders (last bits).

max_grad_norm clips by the norm of the whole averaged gradient, as the non-sharded step:
each rank's optimizer sums the squares of its shard and the group all-reduces those sums
(Optimizer.sumsq_reduce) before the norm is taken; the sum runs over shards, then ranks, so
the norm and the clip factor agree with the non-sharded step's to float rounding, not bit
for bit. `last_grad_norm` is that norm, the same on every rank.

FP8 weights (quantized_model_init) go in buckets of their own, whose
shards are float32 master copies (the optimizer's parameters: 4 bytes per element over N,
where the plain optimizer keeps all of it): a step casts each rank's share of every weight's
master into codes (fp8_shards.cast_shards: one all-reduce of the amaxes, max) and
all-gathers the codes (1 byte per element); each weight's transposed copy is made from them.
Under block scaling each 128x128 block's amax is maxed over the ranks, and the ranks'
block scales after the cast (a second all-reduce). The codes, scale_inv and amax history
equal the plain optimizer's bit for bit (the update and the cast are element by element;
an amax is a max), whatever the group's size. The masters' shards are in state_dict
(zero.fp8.bucket<b>).
"""
import numpy as np

from .._array import to_numpy, xp_of
from ..fp8_params import FP8Weight
from .fp8_shards import cast_shards
from ..optim.optimizer import Optimizer, grads_by_name
from .data_parallel import GradientReducer, ShardedGradients

OP = "ZeroOptimizer"


class ZeroOptimizer:
    """optimizer_cls (tecupy.optim.AdamW or SGD) over this rank's shard of `params` (a list,
    a dict name -> array or a tecupy.nn module), the gradients averaged over `group`.
    bucket_mb, order, side_stream: the reducer's (GradientReducer); every rank must pass
    the same. **kw: the optimizer's (lr, betas, weight_decay, schedule, ...)."""

    def __init__(self, optimizer_cls, params, group, bucket_mb=25, order="reverse",
                 side_stream=True, **kw):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(f"{OP}: optimizer_cls must be a tecupy.optim optimizer class "
                            f"(AdamW, SGD); got {optimizer_cls!r:.60}")
        self.names, self.params, self._keyed = _parse_params(params)
        self.group = group
        self.reducer = GradientReducer(group, self.params, bucket_mb, True, side_stream,
                                       order, reduce="reduce_scatter")
        self.segments = [_segment([self.params[i] for i in b], padded, group.rank, group.size)
                         for b, padded in zip(self.reducer.buckets, self.reducer.padded)]
        self.optimizer = optimizer_cls({f"bucket{b}": s.chunk
                                        for b, s in enumerate(self.segments)}, **kw)
        self.optimizer.sumsq_reduce = group.all_reduce  # (clipping: the whole gradient's norm)

    def gradient(self, tape, outputs, output_grad=None, retain_graph=False):
        """tape.gradient over the parameters with each bucket reduce-scattered as it fills
        (GradientReducer.gradient) -> ShardedGradients for step()."""
        return self.reducer.gradient(tape, outputs, output_grad, retain_graph)

    def step(self, grads):
        """One step: grads are ShardedGradients (gradient()) or this rank's own gradients
        as tape.gradient returns them (a list in the parameters' order, or a dict), which
        are reduce-scattered first; this rank's shard is stepped, the parameters
        all-gathered (in place)."""
        if not isinstance(grads, ShardedGradients):
            grads = self._reduce(grads)
        if len(grads) != len(self.segments):
            raise ValueError(f"{OP}.step: ShardedGradients of {len(grads)} buckets; this "
                             f"optimizer has {len(self.segments)} (another reducer's?)")
        grads = list(grads)
        for b, s in enumerate(self.segments):
            s.refresh()
            if s.fp8:  # (the master's float32: exact, as the fused update reads a bf16 one)
                grads[b] = grads[b].astype(np.float32)
        self.optimizer.step(grads)
        self._cast_fp8()
        for s in self.segments:
            _all_gather_into(self.group, s.send, s.full)
            s.scatter()

    def _cast_fp8(self):
        """The FP8 segments' shards of master copies cast into this rank's codes (send)."""
        fp8 = [s for s in self.segments if s.fp8]
        if not fp8:
            return
        items = [item for s in fp8 for item in s.parts()]
        casts = iter(cast_shards(items, lambda v: self.group.all_reduce(v, op="max")))
        for s in fp8:
            s.take([next(casts) for _ in s.members])

    def _reduce(self, grads):
        """A rank's full gradients -> its ShardedGradients (reduce-scattered after the
        backward, in the buckets' order)."""
        op = f"{OP}.step"
        if isinstance(grads, dict) and self._keyed:
            grads = grads_by_name(op, self.names, grads)
        elif isinstance(grads, dict):  # tape.gradient(loss, module) for module.parameters()
            grads = list(grads.values())
        elif not isinstance(grads, (list, tuple)):
            raise TypeError(f"{op}: grads must be ShardedGradients (from gradient()), a list "
                            f"or a dict of arrays; got {type(grads).__name__}")
        if len(grads) != len(self.params):
            raise ValueError(f"{op}: grads must have one array per parameter "
                             f"({len(self.params)}), got {len(grads)}")
        try:
            for i in self.reducer.order:
                self.reducer.ready(i, grads[i])
        except BaseException:
            self.reducer.reset()
            raise
        return self.reducer.finish()

    # ---- the optimizer's state ----------------------------------------------------------
    @property
    def step_count(self):
        return self.optimizer.step_count

    def get_lr(self):
        return self.optimizer.get_lr()

    @property
    def last_grad_norm(self):
        """The norm of the whole averaged gradient at the last step (tecupy.optim's
        last_grad_norm: one element, the same on every rank; nan before the first step);
        None without max_grad_norm."""
        return self.optimizer.last_grad_norm

    def set_lr(self, lr):
        self.optimizer.set_lr(lr)

    def _meta(self):
        layout = "|".join(",".join(self.names[i] for i in b) for b in self.reducer.buckets)
        return {"zero.rank": self.group.rank, "zero.size": self.group.size,
                "zero.layout": layout}

    def _fp8_masters(self):
        return {f"zero.fp8.bucket{b}": s.chunk for b, s in enumerate(self.segments) if s.fp8}

    def state_dict(self):
        """This rank's state: the optimizer's state_dict over its chunks (keys as
        tecupy.optim's, each parameter named bucket<b>: exp_avg.bucket0, master.bucket0,
        ...), zero.rank, zero.size, zero.layout (the parameters' names per bucket) and
        zero.fp8.bucket<b>, the float32 master copies of a bucket of FP8 weights."""
        sd = self.optimizer.state_dict()
        sd.update(self._meta())
        sd.update({k: np.array(to_numpy(a)) for k, a in self._fp8_masters().items()})
        return sd

    def load_state_dict(self, state_dict):
        """Restore what state_dict gave on the same rank of a group of the same size with the
        same buckets (else a ValueError, nothing loaded)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"{OP}.load_state_dict: state_dict must be a dict; got "
                            f"{type(state_dict).__name__}")
        bad = [f"{k}: {state_dict.get(k, 'missing')!r}, this rank's {v!r}"
               for k, v in self._meta().items() if state_dict.get(k) != v]
        bad += [f"{k}: {_shape_of(state_dict.get(k))}, this rank's {a.shape} float32"
                for k, a in self._fp8_masters().items()
                if _shape_of(state_dict.get(k)) != (a.shape, np.dtype(np.float32))]
        if bad:
            raise ValueError(f"{OP}.load_state_dict: nothing was loaded; each rank loads the "
                             "state_dict its own rank saved, in a group of the same size "
                             "with the same buckets:\n  " + "\n  ".join(bad))
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items()
                                        if not k.startswith("zero.")})
        for k, a in self._fp8_masters().items():
            a[...] = xp_of(a).asarray(state_dict[k])
        return self


def _layout(params, padded, rank, size):
    """([(parameter, its offset in the bucket)], this rank's chunk [lo, hi) of the bucket)."""
    members, at = [], 0
    for p in params:
        members.append((p, at))
        at += p.size
    k = padded // size
    return members, rank * k, (rank + 1) * k


def _segment(params, padded, rank, size):
    if isinstance(params[0], FP8Weight):  # (the reducer's buckets keep them apart)
        return _FP8Segment(params, padded, rank, size)
    return _Segment(params, padded, rank, size)


class _Segment:
    """One bucket's parameters: `full` (their values flat, zero-padded to `padded`: the
    parameter itself, viewed flat, where the bucket is one parameter of that size, else a
    copy) and `chunk`, this rank's part of it, the optimizer's parameter and what the
    all-gather sends (`send`)."""
    fp8 = False

    def __init__(self, params, padded, rank, size):
        self.members, self.lo, self.hi = _layout(params, padded, rank, size)
        p = params[0]
        self.view = len(params) == 1 and p.size == padded and p.flags.c_contiguous
        if self.view:
            self.full = p.reshape(-1)
        else:
            self.full = xp_of(p).zeros(padded, p.dtype)
            for q, at in self.members:
                self.full[at:at + q.size] = q.ravel()
        self.chunk = self.send = self.full[self.lo:self.hi]

    def refresh(self):
        """This rank's chunk from the parameters (set from outside since, e.g. loaded)."""
        if self.view:
            return
        for p, at in self.members:
            lo, hi = max(at, self.lo), min(at + p.size, self.hi)
            if lo < hi:
                self.full[lo:hi] = p.ravel()[lo - at:hi - at]

    def scatter(self):
        """The gathered values back into the parameters."""
        if self.view:
            return
        for p, at in self.members:
            p[...] = self.full[at:at + p.size].reshape(p.shape)


class _FP8Segment:
    """One bucket of FP8 weights: `chunk`, this rank's part of their float32 master copies
    laid end to end (zero-padded to `padded`), the optimizer's parameter; `full`, their codes
    flat (the weight's own codes, viewed flat, where the bucket is one weight of that size,
    else a copy), `send` this rank's part of it."""
    fp8 = True

    def __init__(self, weights, padded, rank, size):
        self.members, self.lo, self.hi = _layout(weights, padded, rank, size)
        first, xp = weights[0], weights[0].xp
        self.chunk = xp.zeros(self.hi - self.lo, np.float32)
        for w, at in self.members:
            lo, hi = self._overlap(w, at)
            if lo < hi:
                self.chunk[lo - self.lo:hi - self.lo] = w.master().reshape(-1)[lo - at:hi - at]
        self.view = len(weights) == 1 and first.size == padded
        self.full = first.data.reshape(-1) if self.view else xp.zeros(padded, np.uint8)
        self.send = self.full[self.lo:self.hi]
        self._inv = []

    def _overlap(self, w, at):
        return max(at, self.lo), min(at + w.size, self.hi)

    def parts(self):
        """[(weight, its part of this rank's masters, the part's first element in the
        weight)] for every member (empty parts too)."""
        out = []
        for w, at in self.members:
            lo, hi = self._overlap(w, at)
            out.append((w, self.chunk[lo - self.lo:max(lo, hi) - self.lo], lo - at))
        return out

    def take(self, casts):
        """cast_shards' (codes, scale_inv) of each member: the codes into send."""
        self._inv = [inv for _, inv in casts]
        for (w, at), (codes, _) in zip(self.members, casts):
            lo, hi = self._overlap(w, at)
            if lo < hi:
                self.send[lo - self.lo:hi - self.lo] = codes

    def refresh(self):
        """(The masters are the optimizer's, not the weights'.)"""

    def scatter(self):
        """The gathered codes into each weight, its transposed copy and scale_inv."""
        for (w, at), inv in zip(self.members, self._inv):
            if not self.view:
                w.data[...] = self.full[at:at + w.size].reshape(w.shape)
            w.sync_copies(inv)


def _shape_of(v):
    return "missing" if v is None else (tuple(np.shape(v)), np.asarray(v).dtype)


def _all_gather_into(group, x, out):
    """The ranks' x into out (flat, rank order): NCCL's in-place all-gather where the group
    has one (NcclGroup.all_gather_into), else a gathered copy."""
    into = getattr(group, "all_gather_into", None)
    if into is not None:
        return into(x, out)
    out[...] = group.all_gather(x)
    return out


def _parse_params(params):
    """(names, arrays, keyed) of a list, a dict or a tecupy.nn module."""
    if callable(getattr(params, "named_parameters", None)):
        params = params.named_parameters()
    if isinstance(params, dict):
        names, arrays, keyed = list(params), list(params.values()), True
    elif isinstance(params, (list, tuple)):
        names, arrays, keyed = [str(i) for i in range(len(params))], list(params), False
    else:
        raise TypeError(f"{OP}: params must be a list or dict of arrays or a tecupy.nn "
                        f"module; got {type(params).__name__}")
    if not arrays:
        raise ValueError(f"{OP}: params is empty; pass at least one parameter")
    for n, p in zip(names, arrays):
        if not (isinstance(p, FP8Weight)
                or hasattr(p, "shape") and hasattr(p, "dtype") and hasattr(p, "ravel")):
            raise TypeError(f"{OP}: params[{n!r}] must be a numpy or cupy array; got "
                            f"{type(p).__name__}")
    return names, arrays, keyed
