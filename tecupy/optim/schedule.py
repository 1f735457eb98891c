"""Learning-rate schedules: `warmup_cosine`, a pure function of the step, and `WarmupCosine`,
the same schedule as an object an optimizer takes (`AdamW(..., schedule=WarmupCosine(...))`):
the optimizer then computes each step's lr itself, on the device from its device step
counter (cuda/optim.cu, optim_prologue: the schedule's numbers are kernel arguments), so a
step captured in a CUDA graph follows the schedule when replayed, with no host write."""
import math

from .. import _check


def warmup_cosine(step, base_lr, warmup_steps, total_steps, min_lr=0.0):
    """The lr of the 0-based optimizer step `step` (the first step() is step 0):

        step < warmup_steps:           base_lr * (step + 1) / warmup_steps   (linear warm-up)
        warmup_steps <= step < total:  min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2,
                                       p = (step - warmup_steps) / (total_steps - warmup_steps)
        step >= total_steps:           min_lr

    so the last warm-up step and the first cosine step both run at base_lr."""
    _check_args("warmup_cosine", base_lr, warmup_steps, total_steps, min_lr)
    step = _check.integer("warmup_cosine", "step", step, 0)
    if step < warmup_steps:
        return base_lr * ((step + 1) / warmup_steps)  # (exactly base_lr at the end)
    if step >= total_steps:
        return float(min_lr)
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _check_args(op, base_lr, warmup_steps, total_steps, min_lr):
    _check.real(op, "base_lr", base_lr, 0)
    _check.real(op, "min_lr", min_lr, 0)
    _check.integer(op, "warmup_steps", warmup_steps, 0)
    _check.integer(op, "total_steps", total_steps, 1)
    if total_steps <= warmup_steps:
        raise ValueError(f"{op}: total_steps must be > warmup_steps ({warmup_steps}), got "
                         f"{total_steps}")


class WarmupCosine:
    """warmup_cosine with fixed numbers; calling it gives the lr of a step on the host."""
    name = "WarmupCosine"

    def __init__(self, base_lr, warmup_steps, total_steps, min_lr=0.0):
        _check_args(self.name, base_lr, warmup_steps, total_steps, min_lr)
        self.base_lr, self.min_lr = float(base_lr), float(min_lr)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)

    def __call__(self, step):
        return warmup_cosine(step, self.base_lr, self.warmup_steps, self.total_steps,
                             self.min_lr)

    def kernel_args(self):
        """(schedule kind 1, base_lr, min_lr, warmup_steps, total_steps): optim_prologue's."""
        return 1, self.base_lr, self.min_lr, self.warmup_steps, self.total_steps

    def state(self):
        """Its numbers, for an optimizer's state_dict ("schedule.<name>")."""
        return {"base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr": self.min_lr}

    def __repr__(self):
        return (f"WarmupCosine(base_lr={self.base_lr}, warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps}, min_lr={self.min_lr})")
