"""ProcessGroup: the collectives every backend provides, with their argument checks.

A backend (ThreadGroup here; an NCCL group over cupy.cuda.nccl later, see the README's
"Multi-GPU (in progress)") subclasses ProcessGroup and implements the `_`-prefixed methods;
the public methods check arguments once, here, so every backend fails the same way.
Collectives are called by every rank of the group, in the same order (as with NCCL).
"""
import numpy as np

OPS = ("sum", "max")


class GroupAborted(RuntimeError):
    """A collective could not complete: another rank raised, a rank did not arrive within
    the timeout, or the ranks called different collectives. Every waiting rank raises it
    with the same reason."""


class ProcessGroup:
    """rank (0..size-1) in a group of `size` ranks. Subclasses implement _all_reduce,
    _all_gather, _reduce_scatter, _broadcast, _barrier and _split."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"

    def all_reduce(self, x, op="sum"):
        """Reduce x over the ranks, in place; returns x. op: 'sum' or 'max'."""
        self._check_array("all_reduce", x)
        self._check_op("all_reduce", op)
        return self._all_reduce(x, op)

    def all_reduce_many(self, arrays, op="sum"):
        """all_reduce of each array in `arrays`, in place, as one call (a backend may fuse
        them: NCCL runs them as one group, one launch); returns the list."""
        arrays = list(arrays)
        for x in arrays:
            self._check_array("all_reduce_many", x)
        self._check_op("all_reduce_many", op)
        self._all_reduce_many(arrays, op)
        return arrays

    def _all_reduce_many(self, arrays, op):
        for x in arrays:
            self._all_reduce(x, op)

    def all_gather(self, x, axis=0):
        """The ranks' x concatenated along `axis`, in rank order (a new array)."""
        axis = self._check_axis("all_gather", x, axis)
        return self._all_gather(x, axis)

    def reduce_scatter(self, x, axis=0, op="sum"):
        """x reduced over the ranks, split along `axis` into `size` equal chunks; this rank's
        chunk (a new array). x.shape[axis] must be a multiple of the group's size."""
        axis = self._check_axis("reduce_scatter", x, axis)
        self._check_op("reduce_scatter", op)
        if x.shape[axis] % self.size:
            raise ValueError(f"reduce_scatter: x's axis {axis} has {x.shape[axis]} elements, "
                             f"not a multiple of the group's size {self.size}")
        return self._reduce_scatter(x, axis, op)

    def broadcast(self, x, root=0):
        """x of rank `root` copied into every rank's x, in place; returns x."""
        self._check_array("broadcast", x)
        if not (isinstance(root, (int, np.integer)) and 0 <= root < self.size):
            raise ValueError(f"broadcast: root must be a rank of 0..{self.size - 1}; got "
                             f"{root!r}")
        return self._broadcast(x, int(root))

    def shift(self, x, out):
        """Ring exchange: x goes to rank (rank + 1) % size, and what rank (rank - 1) % size
        sends lands in `out` (x's shape and dtype, both C-contiguous; not x itself). Every
        rank calls it; -> out. The point-to-point step of the comm-GEMM overlap
        (overlap.py): NCCL send + recv in one group, on the current stream."""
        self._check_array("shift", x)
        self._check_array("shift", out)
        if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
            raise ValueError(f"shift: out must have x's shape {tuple(x.shape)} and dtype "
                             f"{x.dtype}; got {tuple(out.shape)} {out.dtype}")
        if out is x:
            raise ValueError("shift: out must not be x (x is still being sent)")
        return self._shift(x, out)

    @property
    def can_shift(self):
        """Whether this group has shift() (point-to-point): the overlapped tensor-parallel
        GEMMs fall back to the plain collectives where it has not."""
        return type(self)._shift is not ProcessGroup._shift

    def _shift(self, x, out):
        raise NotImplementedError

    def barrier(self):
        """Return once every rank of the group has called barrier()."""
        self._barrier()

    def split(self, color, key=0):
        """Subgroups, as NCCL's ncclCommSplit: the ranks that pass one `color` form a group,
        ranked by (key, rank in this group); color None leaves this rank out (returns
        None). Every rank of this group must call split."""
        for name, v in (("color", color), ("key", key)):
            if not (isinstance(v, (int, np.integer)) or (name == "color" and v is None)):
                raise TypeError(f"split: {name} must be an int{' or None' * (name == 'color')}"
                                f"; got {v!r}")
        return self._split(None if color is None else int(color), int(key))

    def _check_array(self, op, x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{op}: x must be an array; got {type(x).__name__}")

    def _check_op(self, op, reduce_op):
        if reduce_op not in OPS:
            raise ValueError(f"{op}: op must be one of {OPS}; got {reduce_op!r}")

    def _check_axis(self, op, x, axis):
        self._check_array(op, x)
        if x.ndim == 0:
            raise ValueError(f"{op}: x must have at least 1 dimension")
        if not (isinstance(axis, (int, np.integer)) and -x.ndim <= axis < x.ndim):
            raise ValueError(f"{op}: axis must be an int in [{-x.ndim}, {x.ndim}) for x of "
                             f"shape {tuple(x.shape)}; got {axis!r}")
        return int(axis) % x.ndim
