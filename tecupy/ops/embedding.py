"""embedding: rows of a table picked by integer ids (maths in reference/embedding.py).

Ids must lie in [0, num_embeddings). NumPy ids are checked on the host (a ValueError naming
ids and the first bad one). CuPy ids are not read back (that would synchronise every call):
a token whose id is out of range gets a NaN output row (so a NaN loss, as cross_entropy
does for bad targets) and adds nothing to the weight's gradient.

The weight's gradient is deterministic on the GPU: the cuda backend sorts the tokens by id
and sums each row in ascending token order (kernels/embedding.py), never float atomics.
"""
import numpy as np

from .. import _check, backends
from .._array import array_module, check_float
from ..tape import record


def _check_args(weight, ids):
    op = "embedding"
    xp = array_module(op, weight=weight, ids=ids)
    check_float(op, weight=weight)
    if weight.ndim != 2:
        _check.fail(op, "weight", "a 2-D array [num_embeddings, embedding_dim]", weight)
    if ids.dtype.kind not in "iu":
        _check.fail(op, "ids", "an integer array", ids, TypeError)
    if xp is np:
        _check_ids(ids, weight.shape[0])


def _check_ids(ids, num_embeddings):
    """NumPy only: the first id outside [0, num_embeddings) is an error (NumPy would wrap a
    negative one around, or raise an IndexError that names no argument)."""
    bad = (ids < 0) | (ids >= num_embeddings)
    if bad.any():
        where = tuple(int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"embedding: ids must be in [0, {num_embeddings}) (the weight's "
                         f"rows), got {int(ids[where])} at index {where}")


def embedding(weight, ids):
    """weight [num_embeddings, D] gathered at integer ids [...] -> [..., D] in weight's
    dtype. Differentiable in weight (ids get no gradient)."""
    _check_args(weight, ids)
    out = backends.dispatch("embedding_fwd", weight, ids)
    num = weight.shape[0]  # (the closure keeps the size, not the weight)

    def backward(dout):
        return backends.dispatch("embedding_bwd", dout, ids, num), None
    record(backward, (weight, ids), (out,))
    return out
