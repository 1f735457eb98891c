"""cross_entropy over the last axis (maths in reference/loss.py)."""
from .. import backends
from .._array import array_module, check_float
from ..tape import record

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """Softmax cross entropy of logits [..., V] against integer targets [...]. reduction:
    mean (over tokens whose target is not ignore_index), sum, or none (per token). The loss
    is float32 (float64 for float64 logits)."""
    xp = array_module("cross_entropy", logits=logits, target=target)
    check_float("cross_entropy", logits=logits)
    if target.dtype.kind not in "iu" or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: target must be an int array of shape "
                         f"{tuple(logits.shape[:-1])}, got {target.dtype} {tuple(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0 <= label_smoothing <= 1:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    args = (int(ignore_index), float(label_smoothing))
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
