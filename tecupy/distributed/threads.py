"""ThreadGroup: N ranks as threads of one process, on NumPy (or any array module whose
arrays support in-place ufuncs): the reference communicator that lets CI check parallel
numerics against a single device, with no GPU and no NCCL.

Each collective is two barrier phases: every rank deposits its array in its slot, waits,
computes its result from all slots (reductions in rank order, so every rank gets the same,
reproducible result), and waits again before a slot can be reused. A rank that raises
inside run_threads aborts the group: ranks waiting in (or later entering) a collective
raise GroupAborted naming that rank, at once. A barrier that waits longer than `timeout`
seconds aborts the group naming the ranks that did not arrive.
"""
import threading

from .._array import xp_of
from .group import GroupAborted, ProcessGroup

DEFAULT_TIMEOUT = 60.0


class _World:
    """What the ranks of one group share (a process-wide object only in the sense that its
    threads hold it: nothing global refers to it)."""

    def __init__(self, size, timeout):
        self.size, self.timeout = size, timeout
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size
        self.waits = [0] * size  # barrier phases each rank has entered: who is behind
        self.reason = None  # why the group was aborted, once it was
        self.lock = threading.Lock()
        self.children = []  # subgroups from split: aborted with this group
        self.pending = {}  # (split number, color) -> [world, members yet to take it]
        self.splits = [0] * size

    def abort(self, reason):
        with self.lock:
            if self.reason is None:
                self.reason = reason
            children = list(self.children)
        self.barrier.abort()
        for child in children:
            child.abort(reason)


class ThreadGroup(ProcessGroup):
    """One rank of a group of threads; made by run_threads (and split), one per thread."""

    def __init__(self, world, rank):
        super().__init__(rank, world.size)
        self._world = world

    def abort(self, reason):
        """Abort the group (as ncclCommAbort): every rank's pending and later collectives
        raise GroupAborted with `reason`."""
        self._world.abort(reason)

    def _fail(self, what):
        raise GroupAborted(f"{what} on rank {self.rank} of {self.size}: group aborted: "
                           f"{self._world.reason}")

    def _wait(self, what):
        w = self._world
        if w.reason is not None:
            self._fail(what)
        w.waits[self.rank] += 1
        try:
            w.barrier.wait(w.timeout)
        except threading.BrokenBarrierError:
            with w.lock:
                if w.reason is None:  # nobody aborted it: this wait timed out
                    mine = w.waits[self.rank]
                    late = [r for r in range(w.size) if w.waits[r] < mine]
                    w.reason = (f"rank(s) {late} did not arrive at {what} within "
                                f"{w.timeout:g} s")
            w.abort(w.reason)
            self._fail(what)

    def _collective(self, what, payload, compute):
        """Deposit (what, payload); wait; compute(payloads in rank order); wait."""
        w = self._world
        w.slots[self.rank] = (what, payload)
        self._wait(what)
        names = [s[0] for s in w.slots]
        if any(n != what for n in names):
            calls = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            w.abort(f"the ranks called different collectives ({calls})")
            self._fail(what)
        result = compute([s[1] for s in w.slots])
        self._wait(what)  # no rank reuses its slot before every rank has read them all
        return result

    def _all_reduce(self, x, op):
        acc = self._collective(_name("all_reduce", x, op), x, lambda xs: _reduce(xs, op))
        x[...] = acc
        return x

    def _all_gather(self, x, axis):
        what = _name("all_gather", x, f"axis={axis}")
        return self._collective(what, x, lambda xs: xp_of(x).concatenate(xs, axis=axis))

    def _reduce_scatter(self, x, axis, op):
        n = x.shape[axis] // self.size
        index = (slice(None),) * axis + (slice(self.rank * n, (self.rank + 1) * n),)
        what = _name("reduce_scatter", x, f"axis={axis}, {op}")
        return self._collective(what, x, lambda xs: _reduce([a[index] for a in xs], op))

    def _shift(self, x, out):
        prev = (self.rank - 1) % self.size  # (copied before the second wait: x stays put)
        src = self._collective(_name("shift", x, "ring"), x, lambda xs: xs[prev].copy())
        out[...] = src
        return out

    def _broadcast(self, x, root):
        mine = self.rank == root  # the others copy the root's array before the second wait
        src = self._collective(_name("broadcast", x, f"root={root}"), x,
                               lambda xs: None if mine else xs[root].copy())
        if not mine:
            x[...] = src
        return x

    def _barrier(self):
        self._collective("barrier", None, lambda xs: None)

    def _split(self, color, key):
        what = "split"
        pairs = self._collective(what, (color, key), lambda xs: list(xs))
        w = self._world
        w.splits[self.rank] += 1
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        with w.lock:  # the first member to get here makes the subgroup's world
            entry = w.pending.setdefault((w.splits[self.rank], color),
                                         [_World(len(members), w.timeout), len(members)])
            entry[1] -= 1
            if entry[1] == 0:
                del w.pending[(w.splits[self.rank], color)]
                w.children.append(entry[0])
        return ThreadGroup(entry[0], [r for _, r in members].index(self.rank))


def _name(op, x, extra):
    return f"{op}({tuple(x.shape)} {x.dtype}, {extra})"


def _reduce(xs, op):
    """xs reduced in rank order (every rank gets bit-identical results)."""
    acc = xs[0].copy()
    fn = xp_of(acc).add if op == "sum" else xp_of(acc).maximum
    for a in xs[1:]:
        fn(acc, a, out=acc)
    return acc


def run_threads(n, fn, *args, timeout=DEFAULT_TIMEOUT):
    """Run fn(group, *args) on n ranks, one thread each (group: that rank's ThreadGroup);
    -> the ranks' results in rank order. If a rank raises, the others' collectives abort
    (GroupAborted), and the first rank's own exception (not a GroupAborted, where there is
    one) is raised here, noted with its rank."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"run_threads: n must be an int >= 1; got {n!r}")
    world = _World(n, timeout)
    results, errors = [None] * n, [None] * n

    def body(rank):
        try:
            results[rank] = fn(ThreadGroup(world, rank), *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[rank] = e
            world.abort(f"rank {rank} raised {type(e).__name__}: {e}")
    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"tecupy-rank{r}")
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _raise_first(errors)
    return results


def _raise_first(errors):
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    own = [(r, e) for r, e in failed if not isinstance(e, GroupAborted)]
    rank, err = (own or failed)[0]
    if hasattr(err, "add_note"):
        err.add_note(f"(raised on rank {rank} of {len(errors)} in tecupy.distributed."
                     "run_threads)")
    raise err
