"""Optimizers: AdamW and SGD with torch.optim's maths, fused multi-tensor CUDA kernels
(cuda/optim.cu) on the GPU and the NumPy/CuPy reference (reference.py) elsewhere; FP32
master weights, bf16 moments, gradient clipping by global norm and an LR schedule on the
device, so a whole training step (optimizer included) can be captured in a CUDA graph.

    opt = tecupy.optim.AdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1,
                             max_grad_norm=1.0,
                             schedule=tecupy.optim.WarmupCosine(3e-4, 100, 2000, 3e-5))
    grads = tape.gradient(loss, model)   # a dict by parameter name
    opt.step(grads)                      # parameters updated in place

or the step inside the backward (without max_grad_norm), each parameter updated as soon as
its gradient is final and the gradient freed, the same bits (in_backward.py):

    opt.step_in_backward(tape, loss)     # returns None: no gradient is kept
"""
from . import schedule  # noqa: F401
from .adam import SGD, AdamW  # noqa: F401
from .optimizer import Optimizer  # noqa: F401
from .schedule import WarmupCosine, warmup_cosine  # noqa: F401
