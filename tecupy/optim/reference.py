"""The optimizers' reference: the maths of cuda/optim.cu (its header states them) on NumPy
or CuPy arrays, one tensor at a time, with the kernels' names and argument order. It
computes in float32 like the kernels (float64 where the parameter or its master copy is
float64), so on the CPU it is the optimizer itself and on the GPU the kernels' yardstick."""
import math

import numpy as np

from .._array import xp_of


def compute_dtype(dtype):
    """float64 for float64 arrays, else float32 (the kernels' float)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def grad_sumsq(grad):
    """The sum of squares of one gradient in float64 (a 0-d array of its array module)."""
    g = grad.astype(np.float64)
    return (g * g).sum()


def optim_prologue(sumsq, clip, max_norm, step, lr, beta1, beta2, wd, schedule, ct):
    """(t, lr_t, sc) of the step after `step` steps: t = step + 1; lr_t = schedule(step) with
    a schedule, else lr; sc = (lr, coef, step_size, bc2_sqrt, decay, grad_norm) in the
    compute dtype ct, coef and grad_norm as 0-d arrays of sumsq's module (no host sync on
    the GPU; 1 and None without clipping). As torch's clip_grad_norm_, a non-finite norm
    gives coef nan (or 0 for inf: inf gradients times 0 are nan)."""
    ct = np.dtype(ct).type
    t = step + 1
    lr_t = ct(schedule(step) if schedule is not None else lr)
    coef, norm = ct(1.0), None
    if clip:
        xp = xp_of(sumsq)
        norm = xp.sqrt(xp.asarray(sumsq, np.float64)).astype(ct)
        coef = ct(max_norm) / (norm + ct(1e-6))
        coef = xp.where(coef > 1, ct(1.0), coef).astype(ct)  # (nan stays nan)
    step_size = ct(float(lr_t) / (1.0 - beta1 ** t)) if beta1 is not None else ct(0)
    bc2_sqrt = ct(math.sqrt(1.0 - beta2 ** t)) if beta2 is not None else ct(1)
    decay = ct(1.0 - float(lr_t) * wd)
    return t, lr_t, (lr_t, coef, step_size, bc2_sqrt, decay, norm)


def _load(param, master, grad, coef, ct):
    """(p, g) in the compute dtype: the master copy (else the parameter) and grad * coef."""
    p = (master if master is not None else param).astype(ct)
    return p, grad.astype(ct) * coef


def _store(param, master, p):
    if master is not None:
        master[...] = p
    param[...] = p.astype(param.dtype)  # (bf16: ml_dtypes rounds to nearest even)


def adamw_update(param, master, exp_avg, exp_avg_sq, grad, sc, beta1, beta2, eps):
    """One AdamW step of one tensor, in place (moments stored in their own dtype)."""
    ct = compute_dtype((master if master is not None else param).dtype).type
    lr, coef, step_size, bc2_sqrt, decay, _ = sc
    p, g = _load(param, master, grad, coef, ct)
    b1, b2, one = ct(beta1), ct(beta2), ct(1)
    p = p * ct(decay)
    m = b1 * exp_avg.astype(ct) + (one - b1) * g
    v = b2 * exp_avg_sq.astype(ct) + (one - b2) * g * g
    xp = xp_of(p)
    p = p - ct(step_size) * (m / (xp.sqrt(v) / ct(bc2_sqrt) + ct(eps)))
    exp_avg[...] = m.astype(exp_avg.dtype)
    exp_avg_sq[...] = v.astype(exp_avg_sq.dtype)
    _store(param, master, p)


def sgd_update(param, master, buf, grad, sc, momentum, wd, nesterov):
    """One SGD step of one tensor, in place; buf None: no momentum."""
    ct = compute_dtype((master if master is not None else param).dtype).type
    lr, coef = sc[0], sc[1]
    p, g = _load(param, master, grad, coef, ct)
    d = g + ct(wd) * p
    if buf is not None:
        b = ct(momentum) * buf.astype(ct) + d
        buf[...] = b.astype(buf.dtype)
        d = d + ct(momentum) * b if nesterov else b
    _store(param, master, p - ct(lr) * d)
