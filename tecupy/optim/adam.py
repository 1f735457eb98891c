"""AdamW and SGD: their hyperparameters, state slots and per-tensor reference update; the
step, checks and state_dict are the Optimizer's (optimizer.py), the maths cuda/optim.cu's."""
import numpy as np

from .. import _check
from .._array import bfloat16
from . import reference
from .optimizer import Optimizer


def _betas(op, betas):
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        _check.fail(op, "betas", "a pair (beta1, beta2) of numbers in [0, 1)", betas,
                    TypeError)
    return tuple(_check.real(op, f"betas[{i}]", b, 0, 1, high_open=True)
                 for i, b in enumerate(betas))


def _moments(op, dtype):
    """None (float32; float64 for float64 parameters), float32 or bfloat16."""
    if dtype is None:
        return None
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in (np.dtype(np.float32), bfloat16):
        _check.fail(op, "moments_dtype", "None, float32 or tecupy.bfloat16", dtype, TypeError)
    return d


class AdamW(Optimizer):
    """torch.optim.AdamW's maths (decoupled weight decay p -= lr * wd * p, bias-corrected
    moments; no amsgrad), fused on the GPU: all parameters in one or a few launches.

    params: a list of arrays (module.parameters()) or a dict name -> array
    (module.named_parameters()); updated in place. master_weights: None or True (default):
    float16 / bfloat16 parameters get a float32 master copy that the update works on (the
    parameter gets it rounded to nearest even); False: updated in their own dtype.
    moments_dtype: None (float32; float64 for float64 parameters) or tecupy.bfloat16.
    max_grad_norm: clip the gradients by their global norm (torch's clip_grad_norm_: coef =
    min(1, max_norm / (norm + 1e-6)), computed on the device, no host sync; a non-finite
    norm is no error: the parameters go nan, as in torch); inf measures without clipping.
    The norm is `last_grad_norm`. schedule: None (lr as given, or set by set_lr) or a
    WarmupCosine, which then gives each step's lr (the lr argument is unused)."""
    kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 master_weights=None, moments_dtype=None, max_grad_norm=None, schedule=None):
        op = type(self).__name__
        self.betas = _betas(op, betas)
        self.eps = _check.real(op, "eps", eps, 0)
        self.weight_decay = _check.real(op, "weight_decay", weight_decay, 0)
        moments = _moments(op, moments_dtype)
        super().__init__(params, lr, max_grad_norm, schedule, master_weights)
        self.moments_dtype = moments

        def zeros(p):
            if moments is not None:  # (not `moments or`: a dtype's truth is its len, 0)
                return self.xp.zeros(p.shape, moments)
            return self.xp.zeros(p.shape, np.float64 if p.dtype == np.float64 else np.float32)
        self.exp_avg = [zeros(p) for p in self.params]
        self.exp_avg_sq = [zeros(p) for p in self.params]
        self._build_table()

    def _slots(self):
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def _table_rows(self):
        return self.params, self.masters, self.exp_avg, self.exp_avg_sq

    def _moments_dtype(self):
        m = self.moments_dtype
        return np.dtype(np.float32) if m is None else m

    def _hyper(self):
        return {"beta1": self.betas[0], "beta2": self.betas[1], "eps": self.eps,
                "weight_decay": self.weight_decay,
                "moments_dtype": None if self.moments_dtype is None else str(self.moments_dtype)}

    def _hyper_checks(self):
        return {"beta1": lambda v: _check.real("", "beta1", v, 0, 1, high_open=True),
                "beta2": lambda v: _check.real("", "beta2", v, 0, 1, high_open=True),
                "eps": lambda v: _check.real("", "eps", v, 0),
                "weight_decay": lambda v: _check.real("", "weight_decay", v, 0)}

    def _set_hyper(self, sd):
        self.betas = (float(sd["beta1"]), float(sd["beta2"]))
        self.eps, self.weight_decay = float(sd["eps"]), float(sd["weight_decay"])

    def _prologue_args(self):
        return self.betas[0], self.betas[1], self.weight_decay

    def _kernel_hyper(self):
        return self.betas[0], self.betas[1], self.eps, self.weight_decay

    def _update(self, i, grad, sc):
        reference.adamw_update(self.params[i], self.masters[i], self.exp_avg[i],
                               self.exp_avg_sq[i], grad, sc, self.betas[0], self.betas[1],
                               self.eps)


class SGD(Optimizer):
    """torch.optim.SGD's maths with dampening 0: d = g + wd * p; with momentum, buf =
    momentum * buf + d and d = buf (nesterov: d + momentum * buf); p -= lr * d. Parameters,
    master_weights, max_grad_norm and schedule as AdamW's; the momentum buffers are float32
    (float64 for float64 parameters)."""
    kind = "sgd"

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False,
                 max_grad_norm=None, schedule=None, master_weights=None):
        op = type(self).__name__
        self.momentum = _check.real(op, "momentum", momentum, 0)
        self.weight_decay = _check.real(op, "weight_decay", weight_decay, 0)
        self.nesterov = _check.flag(op, "nesterov", nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError(f"{op}: nesterov=True needs a momentum > 0, got momentum=0")
        super().__init__(params, lr, max_grad_norm, schedule, master_weights)
        self.momentum_buffer = [
            self.xp.zeros(p.shape, np.float64 if p.dtype == np.float64 else np.float32)
            if self.momentum else None for p in self.params]
        self._build_table()

    def _slots(self):
        return {"momentum_buffer": self.momentum_buffer}

    def _table_rows(self):
        return self.params, self.masters, self.momentum_buffer, [None] * len(self.params)

    def _hyper(self):
        return {"momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": int(self.nesterov)}

    def _hyper_checks(self):
        def nesterov(v):
            if v not in (0, 1) or isinstance(v, float):
                raise ValueError("nesterov must be 0 or 1")
        return {"momentum": lambda v: _check.real("", "momentum", v, 0),
                "weight_decay": lambda v: _check.real("", "weight_decay", v, 0),
                "nesterov": nesterov}

    def _set_hyper(self, sd):
        self.momentum, self.weight_decay = float(sd["momentum"]), float(sd["weight_decay"])
        self.nesterov = bool(sd["nesterov"])

    def _prologue_args(self):
        return None, None, 0.0

    def _kernel_hyper(self):
        return self.momentum, self.weight_decay, int(self.nesterov)

    def _update(self, i, grad, sc):
        reference.sgd_update(self.params[i], self.masters[i], self.momentum_buffer[i], grad,
                             sc, self.momentum, self.weight_decay, self.nesterov)
