"""The optimizer's step inside the backward (Optimizer.step_in_backward; PyTorch's pattern of
an optimizer per parameter in a post-accumulate-grad hook, done explicitly):

    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
        loss = model(x)
    opt.step_in_backward(tape, loss)     # no gradient comes back: each was applied and freed

The tape hands each parameter's gradient over as soon as it is final (Tape.gradient's
on_grad, right after the last node that reads the parameter ran, so the parameter may change
in place) and drops it once the update is launched (keep_grads=False): a model's gradients
are never all alive at once; at most those one node's backward makes together (issue 22: the
3 GiB of gradients an 8-layer quickstart stack held at its peak).

The step is the whole step's, one tensor at a time: the prologue (step += 1, lr from the
schedule, bias corrections) runs once, before the first update, and each update is the
kernel (or reference) of Optimizer.step on that one tensor, so the result is bit-identical.
Global-norm clipping cannot work so: the norm needs every gradient before any update.
"""
from ..graphs import capturing


def step_in_backward(opt, tape, outputs, output_grad, params):
    op = f"{type(opt).__name__}.step_in_backward"
    _check(opt, op, tape, params)
    apply = _Apply(opt, op)
    tape.gradient(outputs, opt._wrt, output_grad, on_grad=apply, keep_grads=False)
    apply.finish()


def _check(opt, op, tape, params):
    """Everything that can be refused before the backward runs."""
    if opt.max_grad_norm is not None:
        raise ValueError(
            f"{op}: this optimizer clips by the global gradient norm (max_grad_norm="
            f"{opt.max_grad_norm}), which is known only once every gradient is: build it "
            "with max_grad_norm=None, or take the gradients (tape.gradient) and call step()")
    if not callable(getattr(tape, "gradient", None)):
        raise TypeError(f"{op}: tape must be the tecupy.Tape that recorded the forward, got "
                        f"{type(tape).__name__} {tape!r:.40}")
    if not opt.fused and capturing():
        raise RuntimeError(
            f"{op}: these parameters run on the reference optimizer (its step counter lives "
            "on the host), which a CUDA graph cannot capture; the fused kernels take "
            "C-contiguous float32, float16 or bfloat16 CuPy arrays")
    if params is not None:
        _check_same(opt, op, params)


def _check_same(opt, op, params):
    """params (a module, list or dict) must be exactly the optimizer's parameters."""
    if callable(getattr(params, "named_parameters", None)):
        params = params.named_parameters()
    if isinstance(params, dict):
        names, arrays = [repr(k) for k in params], list(params.values())
    elif isinstance(params, (list, tuple)):
        names, arrays = [str(n) for n in range(len(params))], list(params)
    else:
        raise TypeError(f"{op}: params must be None, a tecupy.nn module, a list or a dict of "
                        f"parameters, got {type(params).__name__} {params!r:.40}")
    mine, given = {id(p) for p in opt._wrt}, {id(p) for p in arrays}
    extra = [f"params[{n}]" for n, p in zip(names, arrays) if id(p) not in mine]
    missing = [n for n, p in zip(opt.names, opt._wrt) if id(p) not in given]
    if extra or missing:
        raise ValueError(
            f"{op}: params must be this optimizer's parameters, every one of them (a step "
            f"updates them all); not in the optimizer: {extra or 'none'}; the optimizer's "
            f"not given: {missing or 'none'}")


class _Apply:
    """The on_grad of one step_in_backward: the prologue at the first gradient (a backward
    the tape refuses changes nothing), then each parameter's update, once."""

    def __init__(self, opt, op):
        self.opt, self.op, self.sc = opt, op, None
        self.done = [False] * len(opt.params)

    def __call__(self, i, grad):
        opt = self.opt
        if self.done[i]:
            raise RuntimeError(f"{self.op}: parameter {opt.names[i]!r} was handed over twice "
                               "in one backward")
        grad = opt._check_grad(self.op, opt.names[i], grad, opt.params[i],
                               opt._grad_dtypes[i])
        if self.sc is None:
            self.sc = opt._begin_step()
        opt._step_one(i, grad, self.sc)
        self.done[i] = True

    def finish(self):
        """After the backward: every parameter was updated (the tape hands every index
        over, zeros for those no node reached, as step() gets them)."""
        left = [n for n, d in zip(self.opt.names, self.done) if not d]
        if left:
            raise RuntimeError(f"{self.op}: the backward handed over no gradient for "
                               f"{left}: the step is incomplete")
