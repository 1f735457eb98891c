"""The optimizers' common part: parameters and their checks, the device step counter and lr,
the step (fused kernels on the GPU, the reference elsewhere), state_dict / load_state_dict.
AdamW and SGD (adam.py) add their hyperparameters, state slots and per-tensor update."""
import numpy as np

from .. import _check
from .._array import FLOAT_SET, bfloat16, is_cupy, to_numpy
from ..fp8_params import FP8Weight
from ..fp8_state import check_array, mismatch
from ..graphs import capturing
from . import kernels, reference
from .schedule import WarmupCosine

HALF = (np.dtype(np.float16), bfloat16)


class Optimizer:
    """Subclasses set `kind` and define _slots, _hyper, _hyper_checks, _set_hyper,
    _prologue_args, _kernel_hyper and _update (see AdamW)."""
    kind = None
    # With max_grad_norm over a shard of the parameters (distributed.ZeroOptimizer): a
    # callable that sums, in place over every rank, the array holding this optimizer's sum
    # of squares (the kernels' float32 partials per chunk, or the reference's float64 [1])
    # before the norm is taken from it; None: the norm is this optimizer's own.
    sumsq_reduce = None

    def __init__(self, params, lr, max_grad_norm, schedule, master_weights):
        op = type(self).__name__
        self.names, self.params, self._keyed = _parse_params(op, params)
        # FP8 weights (quantized_model_init): the optimizer owns their float32 master copy,
        # which stands in their place below (updated as a float32 parameter from the
        # weight's gradient); each step casts it into the weight's codes
        self._grad_dtypes = [p.dtype for p in self.params]
        self._wrt = list(self.params)  # what a tape sees: FP8 weights as themselves
        self._fp8 = [(i, p) for i, p in enumerate(self.params) if isinstance(p, FP8Weight)]
        for i, p in self._fp8:
            self.params[i] = p.master()
        self.max_grad_norm = _max_grad_norm(op, max_grad_norm)
        self.schedule = _schedule(op, schedule)
        lr = _check.real(op, "lr", lr, 0)
        if not (master_weights is None or isinstance(master_weights, (bool, np.bool_))):
            _check.fail(op, "master_weights", "None or a bool", master_weights, TypeError)
        self.master_weights = master_weights is not False
        self.fused = kernels.supported(self.params)
        on_gpu = is_cupy(self.params[0])
        self.xp = _xp(on_gpu)
        wide = any(p.dtype == np.float64 for p in self.params)
        self._ct = np.dtype(np.float64 if wide and not self.fused else np.float32)
        self.masters = [p.astype(np.float32) if self.master_weights and p.dtype in HALF
                        else None for p in self.params]
        # the step counter and lr the kernels read (host arrays on the reference path)
        sxp = self.xp if self.fused else np
        self.step_array = sxp.zeros((1,), np.int32 if self.fused else np.int64)
        self.lr_array = sxp.full((1,), self.schedule(0) if self.schedule else lr, self._ct)
        self._sc = sxp.asarray(np.array([0, 1, 0, 1, 1, np.nan], self._ct))
        self._norm = None
        self._set_clip(self.max_grad_norm)

    def _set_clip(self, max_grad_norm):
        """max_grad_norm, and the array of the last norm when clipping (made once)."""
        self.max_grad_norm = max_grad_norm
        if max_grad_norm is not None and self._norm is None:
            self._norm = self._sc[5:6] if self.fused else self.xp.full((1,), np.nan, self._ct)

    def _build_table(self):
        """The fused path's device table, in table order (parameters grouped by dtype, so
        that one launch covers each group); after the subclass made its state."""
        if not self.fused:
            return
        self._order = sorted(range(len(self.params)), key=lambda i: str(self.params[i].dtype))
        self._pos = {i: k for k, i in enumerate(self._order)}  # parameter -> table position
        rows = self._table_rows()
        self._table = kernels.Table(*[[row[i] for i in self._order] for row in rows])
        self._dtypes = [self.params[i].dtype for i in self._order]

    # ---- the public API ----------------------------------------------------------------
    @property
    def last_grad_norm(self):
        """The global gradient norm of the last step (a one-element device array, float32 on
        the GPU; nan before the first step); None without max_grad_norm."""
        return self._norm

    @property
    def step_count(self):
        """Steps taken (reads the device counter: a host sync)."""
        return int(self.step_array[0])

    def get_lr(self):
        """The lr of the last step, or of the next one when set_lr was called after it (a
        host sync). With a schedule, the lr of the last step (schedule(0) before any)."""
        return float(self.lr_array[0])

    def set_lr(self, lr):
        """Set the lr of the next steps (a fill kernel on the GPU, no host-to-device copy;
        under a CUDA graph capture the value is baked into the graph: use schedule=)."""
        op = f"{type(self).__name__}.set_lr"
        lr = _check.real(op, "lr", lr, 0)
        if self.schedule is not None:
            raise RuntimeError(f"{op}: this optimizer's lr follows its schedule "
                               f"({self.schedule!r}); build it without schedule= to set the "
                               "lr by hand")
        self.lr_array.fill(lr)

    def step(self, grads):
        """Update every parameter in place from `grads`: a list in the order of the
        parameters, or a dict: by name when the parameters were a dict, else its values in
        the parameters' order (tape.gradient(loss, module) for module.parameters())."""
        grads = self._check_grads(grads)
        if self.fused:
            kernels.step(self.kind, self._table, [grads[i] for i in self._order], self._dtypes,
                         self._moments_dtype(), (self.step_array, self.lr_array, self._sc),
                         self._kernel_hyper(), self.max_grad_norm, self.schedule,
                         self.sumsq_reduce)
        elif capturing():
            raise RuntimeError(
                f"{type(self).__name__}.step: these parameters run on the reference optimizer "
                "(its step counter lives on the host), which a CUDA graph cannot capture; the "
                "fused kernels take C-contiguous float32, float16 or bfloat16 CuPy arrays")
        else:
            self._reference_step(grads)
        for i, weight in self._fp8:
            weight.quantize_(self.params[i])

    def _reference_step(self, grads):
        sc = self._reference_prologue(grads)
        for i, g in enumerate(grads):
            self._update(i, g, sc)

    def _reference_prologue(self, grads):
        """The step's scalars sc (step += 1, lr; the norm of grads when clipping)."""
        clip = self.max_grad_norm is not None
        sumsq = sum(reference.grad_sumsq(g) for g in grads) if clip else None
        if clip and self.sumsq_reduce is not None:
            total = self.xp.asarray(sumsq, np.float64).reshape(1)
            self.sumsq_reduce(total)
            sumsq = total[0]
        beta1, beta2, wd = self._prologue_args()
        t, lr, sc = reference.optim_prologue(
            sumsq, clip, self.max_grad_norm, int(self.step_array[0]), self.lr_array[0],
            beta1, beta2, wd, self.schedule, self._ct)
        self.step_array[0], self.lr_array[0] = t, lr
        if clip:
            self._norm[...] = sc[5]
        return sc

    # ---- the step in the backward (in_backward.py) --------------------------------------
    def step_in_backward(self, tape, outputs, output_grad=None, params=None):
        """The backward of `outputs` on `tape` with this optimizer's step inside it
        (PyTorch's optimizer-in-backward): each parameter is updated as soon as its gradient
        is final (Tape.gradient's on_grad) and that gradient is then dropped, so the
        parameters' gradients are never all alive at once (issue 22). Bit-identical to
        step(tape.gradient(outputs, params, output_grad)): the step counter, lr and bias
        corrections advance once, before the first update; an FP8 weight's codes are cast
        from its master right after its update. Returns None: no gradient is kept.

        output_grad: as Tape.gradient's. params: None, or the optimizer's parameters again
        (a module, a list or a dict) as a check: all of them and no other. Not with
        max_grad_norm: clipping needs the norm of every gradient, known only after the whole
        backward. A refused backward (on a tape whose backward already ran, ...) changes
        nothing; one that fails midway leaves the parameters handed over by then updated."""
        from .in_backward import step_in_backward
        step_in_backward(self, tape, outputs, output_grad, params)

    def _begin_step(self):
        """The step's prologue, without clipping; -> the scalars sc the updates read."""
        if self.fused:
            hyper = self._kernel_hyper()
            kernels.begin(self.kind, self._table, (self.step_array, self.lr_array, self._sc),
                          hyper, self.schedule)
            return self._sc
        return self._reference_prologue([])

    def _step_one(self, i, grad, sc):
        """Update parameter i from grad (checked) with the step's scalars sc; then its FP8
        weight's codes, if it is one."""
        if self.fused:
            kernels.update_one(self.kind, self._table, self._pos[i], grad,
                               self.params[i].dtype, self._moments_dtype(), sc,
                               self._kernel_hyper())
        else:
            self._update(i, grad, sc)
        if isinstance(self._wrt[i], FP8Weight):
            self._wrt[i].quantize_(self.params[i])

    # ---- gradients ---------------------------------------------------------------------
    def _check_grads(self, grads):
        """grads as a list in parameter order, each checked against its parameter."""
        op = f"{type(self).__name__}.step"
        if isinstance(grads, dict) and not self._keyed:  # tape.gradient(loss, module) for
            grads = list(grads.values())                 # params=module.parameters()
        elif isinstance(grads, dict):
            grads = grads_by_name(op, self.names, grads)
        elif not isinstance(grads, (list, tuple)):
            _check.fail(op, "grads", "a list of arrays, or a dict by parameter name", grads,
                        TypeError)
        if len(grads) != len(self.params):
            raise ValueError(f"{op}: grads must have one array per parameter "
                             f"({len(self.params)}), got {len(grads)}")
        return [self._check_grad(op, n, g, p, d)
                for n, g, p, d in zip(self.names, grads, self.params, self._grad_dtypes)]

    def _check_grad(self, op, name, g, p, dtype):
        where = f"grads[{name!r}]" if self._keyed else f"grads[{name}]"
        kind = "a cupy array" if is_cupy(p) else "a numpy array"
        if not (isinstance(g, np.ndarray) or is_cupy(g)) or is_cupy(g) != is_cupy(p):
            _check.fail(op, where, f"{kind} (as its parameter)", g, TypeError)
        if g.shape != p.shape or g.dtype not in (dtype, np.float32):
            _check.fail(op, where, f"an array of shape {tuple(p.shape)} and dtype {dtype} "
                        "or float32 (as its parameter)", g)
        if is_cupy(g):
            if g.device.id != p.device.id:
                raise ValueError(f"{op}: {where} is on GPU {g.device.id}, its parameter on "
                                 f"GPU {p.device.id}")
            if self.fused and not g.flags.c_contiguous:
                g = self.xp.ascontiguousarray(g)  # the kernels read it flat
        return g

    # ---- state_dict --------------------------------------------------------------------
    def _arrays(self):
        """{state_dict key: the array it holds}: every state slot and master copy."""
        out = {}
        for slot, row in list(self._slots().items()) + [("master", self.masters)]:
            out.update({f"{slot}.{n}": a for n, a in zip(self.names, row) if a is not None})
        out.update({f"master.{self.names[i]}": self.params[i] for i, _ in self._fp8})
        return out

    def _values(self):
        """{key: value} of the plain values: hyperparameters, step, lr, schedule."""
        sd = {"optimizer": type(self).__name__, "step": self.step_count, "lr": self.get_lr(),
              "max_grad_norm": self.max_grad_norm,
              "schedule": None if self.schedule is None else self.schedule.name}
        sd.update(self._hyper())
        if self.schedule is not None:
            sd.update({f"schedule.{k}": v for k, v in self.schedule.state().items()})
        return sd

    def state_dict(self):
        """A flat dict (str keys; numpy arrays, int, float, str or None values, copies):
          optimizer        "AdamW" | "SGD"
          step, lr         steps taken (int), the lr of the last step (float)
          max_grad_norm    float or None; and the optimizer's hyperparameters (AdamW:
                           beta1, beta2, eps, weight_decay, moments_dtype; SGD: momentum,
                           weight_decay, nesterov as 0/1)
          schedule         None or "WarmupCosine", with schedule.base_lr, .warmup_steps,
                           .total_steps, .min_lr
          <slot>.<name>    each parameter's state (AdamW: exp_avg, exp_avg_sq; SGD with
                           momentum: momentum_buffer), <name> its index in the parameter list
                           or its key in the parameter dict
          master.<name>    the float32 master copy of each 16-bit parameter that has one,
                           and of each FP8 weight (quantized_model_init)
        The parameters themselves are the module's (Module.state_dict)."""
        sd = {k: np.array(to_numpy(a)) for k, a in self._arrays().items()}
        sd.update(self._values())
        return sd

    def load_state_dict(self, state_dict):
        """Restore what state_dict gave (arrays written in place). Every key is checked first;
        a missing or unexpected key, an array of another shape or dtype, or a value of the
        wrong kind is a ValueError listing each, and nothing is loaded."""
        errors = self._check_state_dict(state_dict)
        if errors:
            raise ValueError(f"{type(self).__name__}.load_state_dict: nothing was loaded; "
                             f"{len(errors)} mismatch(es):\n  " + "\n  ".join(errors))
        for k, a in self._arrays().items():
            a[...] = self.xp.asarray(state_dict[k])
        self.step_array.fill(state_dict["step"])
        self.lr_array.fill(state_dict["lr"])
        self._set_clip(state_dict["max_grad_norm"])
        self._set_hyper(state_dict)
        if self.schedule is not None:
            self.schedule = WarmupCosine(**{k: state_dict[f"schedule.{k}"]
                                            for k in self.schedule.state()})
        return self

    def _check_state_dict(self, sd):
        if not isinstance(sd, dict):
            return [f"state_dict must be a dict, got {type(sd).__name__}"]
        arrays, values = self._arrays(), self._values()
        errors = []
        for k, a in arrays.items():
            errors += check_array(sd, k, a.shape, a.dtype)
        fixed = ("optimizer", "schedule", "moments_dtype")
        checks = {"step": lambda v: _check.integer("", "step", v, 0, 2**31),
                  "lr": lambda v: _check.real("", "lr", v, 0),
                  "max_grad_norm": lambda v: _max_grad_norm("", v), **self._hyper_checks()}
        for k in values:
            if k not in sd:
                errors.append(mismatch(k, "missing", f"a value like {values[k]!r}"))
            elif k in fixed and sd[k] != values[k]:
                errors.append(mismatch(k, repr(sd[k]), repr(values[k])))
            elif k in checks:
                errors += _try(k, checks[k], sd[k])
        keys = [f"schedule.{k}" for k in (self.schedule.state() if self.schedule else ())]
        if keys and all(k in sd for k in keys):  # the schedule's numbers, checked together
            errors += _try(", ".join(keys), lambda v: WarmupCosine(*v), [sd[k] for k in keys])
        errors += [mismatch(k, "an unexpected key", f"only the keys of {type(self).__name__}"
                            ".state_dict()") for k in sorted(set(sd) - set(arrays) - set(values))]
        return errors

    def _moments_dtype(self):
        return np.dtype(np.float32)


def grads_by_name(op, names, grads):
    """The dict `grads` as a list in the order of `names`, which must be its keys exactly."""
    missing = [k for k in names if k not in grads]
    extra = [k for k in grads if k not in names]
    if missing or extra:
        raise ValueError(f"{op}: grads must have the parameters' names; missing "
                         f"{missing}, unexpected {extra}")
    return [grads[k] for k in names]


def _try(key, check, value):
    try:
        check(value)
    except (TypeError, ValueError) as err:
        accepted = str(err).split("must be ", 1)[-1].rsplit(", got ", 1)[0]
        return [mismatch(key, repr(value), accepted)]
    return []


def _xp(on_gpu):
    if on_gpu:
        import cupy
        return cupy
    return np


def _parse_params(op, params):
    """(names, arrays, keyed): a dict name -> array keeps its names; a list gets "0", "1"..."""
    keyed = isinstance(params, dict)
    if keyed:
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            _check.fail(op, "params", "a dict with str keys", bad[0], TypeError)
        names, arrays = list(params), list(params.values())
    elif isinstance(params, (list, tuple)):
        names, arrays = [str(i) for i in range(len(params))], list(params)
    else:
        _check.fail(op, "params", "a list of arrays (module.parameters()) or a dict name -> "
                    "array (module.named_parameters())", params, TypeError)
    if not arrays:
        raise ValueError(f"{op}: params is empty; pass at least one parameter")
    for n, p in zip(names, arrays):
        where = f"params[{n!r}]" if keyed else f"params[{n}]"
        if isinstance(p, FP8Weight):
            continue
        if not (isinstance(p, np.ndarray) or is_cupy(p)) or p.dtype not in FLOAT_SET:
            _check.fail(op, where, "a numpy or cupy array of float16, bfloat16, float32 or "
                        "float64, or an FP8Weight", p, TypeError)
        if is_cupy(p) != is_cupy(_codes(arrays[0])):
            raise TypeError(f"{op}: params mix numpy and cupy arrays; keep them on one device")
    if len({id(p) for p in arrays}) != len(arrays):
        raise ValueError(f"{op}: params holds the same array twice; it would be updated twice")
    return names, arrays, keyed


def _max_grad_norm(op, value):
    """None (no clipping) or a number > 0; inf measures the norm without clipping."""
    if value is None or value == float("inf"):
        return value if value is None else float(value)
    return _check.real(op, "max_grad_norm", value, 0, low_open=True)


def _schedule(op, schedule):
    if not (schedule is None or isinstance(schedule, WarmupCosine)):
        _check.fail(op, "schedule", "None or a tecupy.optim.WarmupCosine", schedule, TypeError)
    return schedule


def _codes(p):
    """An array standing for p's device: p, or an FP8 weight's codes."""
    return p.data if isinstance(p, FP8Weight) else p
