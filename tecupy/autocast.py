"""The autocast context stack, one per thread: which recipe is in force, and which FP8
states to update when the outermost autocast exits.

Forward slots of the states used while a Tape was recording are updated at the outermost
(enabled) exit: Transformer Engine updates forward meta only when gradients are enabled
(pytorch/quantization.py, autocast_exit); an inference pass leaves its amax in row 0, where
the next training step's update takes it in. (Backward slots: fp8_state.update_backward,
run by the tape after a backward.)
"""
import contextlib
import contextvars

from . import _check
from .fp8_state import update_states
from .recipe import DelayedScaling, Recipe, _bool_field
from .tape import recording

# A tuple of (enabled, recipe, used, group) per open autocast; `used` is one list shared by
# the frames of an outermost autocast: the states to update when it exits; `group` the amax
# reduction group. A context variable, so one thread's autocast exit never pops another
# thread's recipe.
_stack = contextvars.ContextVar("tecupy_autocast", default=())


def _checked_args(op, enabled, recipe_name, recipe, group_name, group):
    """(enabled, recipe, group), checked when the call is made: a bad value fails at its
    line."""
    if recipe is not None and not isinstance(recipe, Recipe):
        names = [c.__name__ for c in Recipe.__subclasses__()]  # every recipe there is
        _check.fail(op, recipe_name, f"None, a tecupy.recipe.{', '.join(names[:-1])} or "
                    f"{names[-1]}", recipe, TypeError)
    if group is not None:
        from .distributed.group import ProcessGroup  # (distributed imports ops: not at top)
        if not isinstance(group, ProcessGroup):
            _check.fail(op, group_name, "None or a tecupy.distributed process group",
                        group, TypeError)
    return _bool_field(op, "enabled", enabled), recipe, group  # "False" would be truthy


def fp8_autocast(enabled=True, fp8_recipe=None, fp8_group=None):
    """Run tecupy's linear-type ops in FP8 inside the block (Transformer Engine's API).
    fp8_recipe: None (a default DelayedScaling) or a recipe; enabled: a bool. fp8_group:
    None, or a tecupy.distributed process group over which delayed scaling's amaxes are
    maxed before each update (TE: under recipe.reduce_amax, the forward amaxes at the
    outermost exit and the backward ones after the backward, for every FP8 state used in
    the block), so that every rank of it (data- and tensor-parallel ranks alike) computes
    the same scales. It takes the place of a tensor-parallel module's own group (its
    tp_group) for the states used in the block, as TE's modules take the autocast's."""
    return _autocast(*_checked_args("fp8_autocast", enabled, "fp8_recipe", fp8_recipe,
                                    "fp8_group", fp8_group))


def autocast(enabled=True, recipe=None, amax_reduction_group=None):
    """Transformer Engine 2.x spelling of fp8_autocast (amax_reduction_group: its
    fp8_group)."""
    return _autocast(*_checked_args("autocast", enabled, "recipe", recipe,
                                    "amax_reduction_group", amax_reduction_group))


class _autocast(contextlib.ContextDecorator):
    """The context of one autocast (a class, not contextlib.contextmanager: its generator
    costs ~2 us more per with-block, paid on every step). Also a decorator."""

    def __init__(self, enabled, recipe, group=None):
        self.enabled, self.recipe, self.group = enabled, recipe, group

    def _recreate_cm(self):  # each decorated call its own context (recursion, threads)
        return _autocast(self.enabled, self.recipe, self.group)

    def __enter__(self):
        recipe = self.recipe if self.recipe is not None else DelayedScaling()
        self.outer = outer = _stack.get()
        self.used = outer[0][2] if outer else []
        _stack.set(outer + ((self.enabled, recipe, self.used, self.group),))

    def __exit__(self, *exc):
        _stack.set(self.outer)
        # TE (autocast_exit): only the outermost exit, and only if that autocast is enabled
        if not self.outer and self.enabled:
            update_states(self.used, "fwd")
        return False


def active_recipe():
    """The recipe in force in this thread, or None when FP8 is off."""
    stack = _stack.get()
    if stack and stack[-1][0]:
        return stack[-1][1]
    return None


def fp8_enabled():
    return active_recipe() is not None


def note_used(state):
    """Note `state` for the forward update at the outermost exit, only while a Tape records
    (TE: forward meta updates only with gradients enabled). Call under an active recipe."""
    if recording():
        stack = _stack.get()
        used = stack[0][2]
        # the amax group of this use: the innermost autocast's (TE keeps the autocast's
        # fp8_group in the module's meta at each forward; the backward's update reads it)
        state.autocast_group = stack[-1][3]
        for s in used:
            if s is state:
                return
        used.append(state)
