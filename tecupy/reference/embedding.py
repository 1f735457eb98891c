"""Reference embedding (kernels/embedding.py mirrors these names and arguments).

Forward: out[..., :] = weight[ids[...], :]. Backward: dweight[v] = sum of dout[t] over the
tokens t with ids[t] == v, in float32 (float64 for float64), cast to dout's dtype.
An id outside [0, V) gives a NaN output row and adds nothing to dweight (ops/embedding.py
raises first on NumPy; on CuPy the NaN row is how it shows, with no host sync).
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of


def _valid(ids, num_embeddings):
    return (ids >= 0) & (ids < num_embeddings)


@backends.register("embedding_fwd", "reference")
def embedding_fwd(weight, ids):
    xp = xp_of(weight)
    ok = _valid(ids, weight.shape[0])
    out = weight[xp.where(ok, ids, 0)]
    if out.dtype.kind == "f":  # (an empty weight: nothing to poison)
        out = xp.where(ok[..., None], out, out.dtype.type(np.nan)).astype(weight.dtype)
    return out


@backends.register("embedding_bwd", "reference")
def embedding_bwd(dout, ids, num_embeddings):
    """Sums in ascending token order on NumPy (np.add.at), the cuda kernel's order. On CuPy,
    cupy.add.at adds with atomics: correct, not bit-reproducible (the cuda kernel is)."""
    xp, ct = xp_of(dout), compute_dtype(dout.dtype)
    d = dout.shape[-1]
    flat, g = ids.reshape(-1), dout.reshape(-1, d).astype(ct)
    ok = _valid(flat, num_embeddings)
    dw = xp.zeros((num_embeddings, d), ct)
    xp.add.at(dw, flat[ok], g[ok])
    return dw.astype(dout.dtype)
