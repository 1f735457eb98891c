"""cross_entropy over the last axis (maths in reference/loss.py).

A target must lie in [0, vocab) or equal ignore_index. NumPy inputs are checked on the
host (a clear ValueError). CuPy targets are not read back (that would synchronise every
call, as PyTorch's CUDA kernel avoids with a device assert): a token whose target is out of
range gets a NaN loss (so a NaN mean or sum) and a NaN gradient row, never another token's.
"""
import numpy as np

from .. import _check, backends
from .._array import array_module, check_float
from ..tape import record

REDUCTIONS = ("mean", "sum", "none")


def _check_args(logits, target, reduction, ignore_index, label_smoothing):
    op = "cross_entropy"
    xp = array_module(op, logits=logits, target=target)
    check_float(op, logits=logits)
    if logits.ndim < 1 or logits.shape[-1] == 0:
        _check.fail(op, "logits", "an array [..., vocab] with vocab >= 1", logits)
    if target.dtype.kind not in "iu" or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: target must be an int array of shape "
                         f"{tuple(logits.shape[:-1])}, got {target.dtype} {tuple(target.shape)}")
    _check.choice(op, "reduction", reduction, REDUCTIONS)
    ignore_index = _check.integer(op, "ignore_index", ignore_index)
    label_smoothing = _check.real(op, "label_smoothing", label_smoothing, 0, 1)
    if xp is np:
        _check_targets(target, logits.shape[-1], ignore_index)
    return xp, ignore_index, label_smoothing


def _check_targets(target, vocab, ignore_index):
    """NumPy only: the first target outside [0, vocab) that is not ignore_index is an error
    (NumPy would wrap a negative one around or raise an IndexError)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        where = tuple(int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"cross_entropy: target must be in [0, {vocab}) or ignore_index "
                         f"({ignore_index}), got {int(target[where])} at index {where}")


def cross_entropy(logits, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """Softmax cross entropy of logits [..., V] against integer targets [...] in [0, V) or
    ignore_index. reduction: mean (over tokens whose target is not ignore_index), sum, or
    none (per token). The loss is float32 (float64 for float64 logits)."""
    xp, ignore_index, label_smoothing = _check_args(logits, target, reduction, ignore_index,
                                                    label_smoothing)
    args = (ignore_index, label_smoothing)
    loss, lse = backends.dispatch("cross_entropy_fwd", logits, target, *args)
    count = xp.maximum((target != ignore_index).sum(), 1).astype(loss.dtype)
    out = {"none": loss, "sum": loss.sum(), "mean": loss.sum() / count}[reduction]
    out = xp.asarray(out)  # NumPy reductions give scalars; ops take and return arrays

    def backward(dout):
        dloss = dout if reduction == "none" else xp.broadcast_to(dout, loss.shape)
        if reduction == "mean":
            dloss = dloss / count
        return backends.dispatch("cross_entropy_bwd", dloss, logits, target, lse, *args), None
    record(backward, (logits, target), (out,))
    return out
