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

# A tuple of (enabled, recipe, used) per open autocast; `used` is one list shared by the
# frames of an outermost autocast: the states to update when it exits. A context variable,
# so one thread's autocast exit never pops another thread's recipe.
_stack = contextvars.ContextVar("tecupy_autocast", default=())


def _checked_args(op, enabled, recipe_name, recipe):
    """(enabled, recipe), checked when the call is made: a bad value fails at its line."""
    if recipe is not None and not isinstance(recipe, Recipe):
        names = [c.__name__ for c in Recipe.__subclasses__()]  # every recipe there is
        _check.fail(op, recipe_name, f"None, a tecupy.recipe.{', '.join(names[:-1])} or "
                    f"{names[-1]}", recipe, TypeError)
    return _bool_field(op, "enabled", enabled), recipe  # "False" would be truthy


def fp8_autocast(enabled=True, fp8_recipe=None):
    """Run tecupy's linear-type ops in FP8 inside the block (Transformer Engine's API).
    fp8_recipe: None (a default DelayedScaling) or a recipe; enabled: a bool."""
    return _autocast(*_checked_args("fp8_autocast", enabled, "fp8_recipe", fp8_recipe))


def autocast(enabled=True, recipe=None):
    """Transformer Engine 2.x spelling of fp8_autocast."""
    return _autocast(*_checked_args("autocast", enabled, "recipe", recipe))


class _autocast(contextlib.ContextDecorator):
    """The context of one autocast (a class, not contextlib.contextmanager: its generator
    costs ~2 us more per with-block, paid on every step). Also a decorator."""

    def __init__(self, enabled, recipe):
        self.enabled, self.recipe = enabled, recipe

    def _recreate_cm(self):  # each decorated call its own context (recursion, threads)
        return _autocast(self.enabled, self.recipe)

    def __enter__(self):
        recipe = self.recipe if self.recipe is not None else DelayedScaling()
        self.outer = outer = _stack.get()
        self.used = outer[0][2] if outer else []
        _stack.set(outer + ((self.enabled, recipe, self.used),))

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
        used = _stack.get()[0][2]
        for s in used:
            if s is state:
                return
        used.append(state)
