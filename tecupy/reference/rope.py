"""Reference rotary position embedding (kernels/rope.py mirrors these names and arguments).

t [s, b, H, d] (sbhd) or [b, s, H, d] (bshd); freqs [s2 >= s, 1, 1, d2], d2 even <= d.
Heads [0, nq) rotate with freqs_q, [nq, nq + nk) with freqs_k (freqs_q when None), the rest
and the columns >= d2 pass through. With C = cos freqs, S = sin freqs of each position:
    forward   y = x C + rotate_half(x) S,            rotate_half(z) = [-z2, z1]
    backward dx = dy C + rotate_half^T(dy S),        rotate_half^T(z) = [z2, -z1]
(z1, z2 the halves of the first d2 columns), in float32 (float64 for float64 t).
"""
from .. import backends
from .._array import compute_dtype, xp_of


def _cos_sin(freqs, s, ct, fmt):
    """cos and sin of freqs' first s rows, shaped to broadcast against sbhd or bshd."""
    f = freqs[:s].reshape(s, 1, 1, freqs.shape[-1]).astype(ct)
    xp = xp_of(f)
    c, sn = xp.cos(f), xp.sin(f)
    return (c, sn) if fmt == "sbhd" else (c.transpose(1, 0, 2, 3), sn.transpose(1, 0, 2, 3))


def _rotate(x, c, sn, transpose):
    xp, d2 = xp_of(x), c.shape[-1]
    r, rest = x[..., :d2], x[..., d2:]
    if not transpose:
        z1, z2 = xp.split(r, 2, axis=-1)
        out = r * c + xp.concatenate([-z2, z1], axis=-1) * sn
    else:
        z1, z2 = xp.split(r * sn, 2, axis=-1)
        out = r * c + xp.concatenate([z2, -z1], axis=-1)
    return xp.concatenate([out, rest], axis=-1)


def _apply(x, freqs_q, freqs_k, nq, nk, fmt, transpose):
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    s = x.shape[0 if fmt == "sbhd" else 1]
    xf = x.astype(ct)
    parts = [(0, nq, freqs_q), (nq, nq + nk, freqs_q if freqs_k is None else freqs_k)]
    out = [xf[:, :, a:b] if a == b else _rotate(xf[:, :, a:b], *_cos_sin(f, s, ct, fmt),
                                                  transpose) for a, b, f in parts]
    out.append(xf[:, :, nq + nk:])
    return xp.concatenate(out, axis=2).astype(x.dtype)


@backends.register("rope_fwd", "reference")
def rope_fwd(x, freqs_q, freqs_k, nq, nk, tensor_format):
    return _apply(x, freqs_q, freqs_k, nq, nk, tensor_format, False)


@backends.register("rope_bwd", "reference")
def rope_bwd(dy, freqs_q, freqs_k, nq, nk, tensor_format):
    return _apply(dy, freqs_q, freqs_k, nq, nk, tensor_format, True)
