"""ZeroOptimizer's casts of FP8 weights (quantized_model_init) from shards of their float32
master copies (zero.py): each rank casts its share of each weight's master into codes,
which the ranks then all-gather; the codes and scale_inv are those of the weight's own cast
of its whole master (fp8_params.FP8Weight.quantize_), bit for bit, for every recipe."""
import numpy as np

from .. import backends
from .._array import xp_of
from ..fp8 import amax as tensor_amax
from ..fp8 import cast, current_scale
from ..recipe import DelayedScaling


def cast_shards(items, reduce_max):
    """ZeroOptimizer's casts (distributed/zero.py): items [(weight, part, offset)], part this
    rank's share of the weight's float32 master copy (1-D, possibly empty), from element
    `offset` of the weight on (row-major), every weight's item on every rank; reduce_max(v)
    maxes a float32 vector over the ranks, in place. The codes of each part are those of the
    weight's own cast of its whole master (quantize_), element by element, and so is its
    scale_inv: current scaling's amax is the max of the parts' amaxes; delayed scaling
    casts with its state's scale and maxes the parts' amaxes into its history's row 0 over
    the ranks; 128x128 blocks (_BlockShard) take each block's amax over the ranks. One
    reduce_max for the amaxes, one more for block scales. -> [(codes (uint8, part's size),
    scale_inv (float32 (1,), or the weight's [rows / 128, cols / 128] grid))]."""
    xp = xp_of(items[0][1])
    codes, amaxes, scales = [None] * len(items), [], []
    for j, (w, part, off) in enumerate(items):
        if w.block_dim:
            scales.append(_BlockShard(w, part, off))
            amaxes.append(scales[-1].amax)
        elif isinstance(w.recipe, DelayedScaling):  # (its scale is known: cast now)
            meta, i = w.state.slot(w.gemm, "weight")
            amaxes.append(meta.amax_history[0, i:i + 1])  # (a view: maxed by the cast)
            scales.append(meta.scale[i:i + 1])
            codes[j] = _cast_part(part, scales[-1], meta.fmt, amaxes[-1])
        else:
            amaxes.append(tensor_amax(part))  # (0 where empty)
            scales.append(None)
    flat, starts, v = _reduced(xp, amaxes, reduce_max)
    current = {}  # fmt -> current_scale of every reduced amax: one pass, not one per weight
    for j, (w, part, _) in enumerate(items):
        if isinstance(scales[j], _BlockShard):
            codes[j] = scales[j].cast(v[j])
        elif scales[j] is None:
            if w.fmt not in current:
                current[w.fmt] = current_scale(flat, w.fmt)
            scales[j] = current[w.fmt][starts[j]:starts[j] + 1]
            codes[j] = _cast_part(part, scales[j], w.fmt, None)
        else:
            amaxes[j][...] = v[j]
    tensor = [j for j, s in enumerate(scales) if not isinstance(s, _BlockShard)]
    inv = xp.empty(len(tensor), np.float32)
    if tensor:
        backends.dispatch("fp8_scale_inv", xp.concatenate([scales[j] for j in tensor]), inv)
    blocks = [j for j, s in enumerate(scales) if isinstance(s, _BlockShard)]
    grids = _reduced(xp, [scales[j].scale_inv for j in blocks], reduce_max)[2] if blocks else []
    out = dict(zip(tensor, (inv[k:k + 1] for k in range(len(tensor)))))
    out.update(zip(blocks, grids))
    return [(c, out[j]) for j, c in enumerate(codes)]


def _reduced(xp, arrays, reduce_max):
    """The arrays maxed over the ranks by one reduce_max of them end to end -> (that flat
    vector, each array's start in it, each array's part of it in the array's shape)."""
    v = xp.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32)
    reduce_max(v)
    starts = np.cumsum([0] + [a.size for a in arrays[:-1]]).tolist()
    return v, starts, [v[at:at + a.size].reshape(a.shape) for at, a in zip(starts, arrays)]


def _cast_part(part, scale, fmt, amax_out):
    if not part.size:
        return xp_of(part).empty(0, np.uint8)
    return cast(part, scale, fmt, amax_out).data


class _BlockShard:
    """A part of a 128x128-blocked FP8 weight's master (cast_shards). Its rows, widened to
    whole block rows, go in a zero buffer (zeros change no block's amax): `amax`, the
    weight's block grid of amaxes with this part's blocks filled. cast(amax): each block
    the part covers only partly gets the whole weight's block amax (the max over the ranks)
    written at one of its places outside the part, so that the weight's own block quantize
    of the buffer gives the part the whole weight's block scales, bit for bit; -> the part's
    codes. `scale_inv`: the weight's grid with this part's block rows filled (0 elsewhere:
    the max over the ranks completes it)."""

    def __init__(self, w, part, off):
        xp = xp_of(part)
        rows, cols = w.shape
        self.w, self.n = w, part.size
        self.amax = xp.zeros((-(-rows // 128), -(-cols // 128)), np.float32)
        self.scale_inv = xp.zeros_like(self.amax)
        if not self.n:
            return
        self.b0 = off // cols // 128  # the first block row, and the buffer's
        r0, r1 = self.b0 * 128, min(((off + self.n - 1) // cols // 128 + 1) * 128, rows)
        self.c0 = off - r0 * cols  # the part's place in the buffer (flat)
        self.flat = xp.zeros((r1 - r0) * cols + 1, np.float32)  # (+ 1: a scratch place)
        self.flat[self.c0:self.c0 + self.n] = part
        self.buf = self.flat[:-1].reshape(r1 - r0, cols)
        self.nb = -(-(r1 - r0) // 128)
        self.amax[self.b0:self.b0 + self.nb] = _block_amax(self.buf)

    def cast(self, amax):
        if not self.n:
            return xp_of(self.amax).empty(0, np.uint8)
        xp = xp_of(self.buf)
        r, cols = self.buf.shape
        bi, bj = xp.meshgrid(xp.arange(self.nb), xp.arange(-(-cols // 128)), indexing="ij")
        first = bi * 128 * cols + bj * 128  # each block's first and last place (flat)
        last = (xp.minimum(bi * 128 + 127, r - 1) * cols
                + xp.minimum(bj * 128 + 127, cols - 1))
        lo, hi = self.c0, self.c0 + self.n
        # (blocks wholly in the part have their amax already: written to the scratch place)
        at = xp.where(first < lo, first, xp.where(last >= hi, last, self.flat.size - 1))
        self.flat[at] = amax[self.b0:self.b0 + self.nb]
        bq = self.w._block_q  # (its kernel, not its quantize: no FP8Inspector record)
        q, s, _, _ = backends.dispatch("block_quantize", self.buf, bq.fmt, 2, bq.power_2_scale,
                                       bq.amax_epsilon, False)
        self.scale_inv[self.b0:self.b0 + self.nb] = s
        return q.reshape(-1)[lo:hi]


def _block_amax(x32):
    """The amax of each 128x128 block of x32 [r, c] (NaN ignored, as the block cast)."""
    xp = xp_of(x32)
    r, c = x32.shape
    rb, cb = -(-r // 128), -(-c // 128)
    xb = xp.zeros((rb * 128, cb * 128), np.float32)
    xb[:r, :c] = xp.abs(x32)
    return xp.where(xp.isnan(xb), np.float32(0), xb).reshape(rb, 128, cb, 128).max(axis=(1, 3))
