"""FP8 recipes with Transformer Engine's names, fields and defaults."""
import enum
import warnings

from .fp8 import E4M3 as _E4M3, E5M2 as _E5M2


class Format(enum.Enum):
    """E4M3 everywhere, E5M2 everywhere, or HYBRID: E4M3 forward, E5M2 for gradients."""
    E4M3 = (_E4M3, _E4M3)
    E5M2 = (_E5M2, _E5M2)
    HYBRID = (_E4M3, _E5M2)

    @property
    def fwd(self):
        return self.value[0]

    @property
    def bwd(self):
        return self.value[1]

    max_fwd = property(lambda self: self.fwd.max)
    max_bwd = property(lambda self: self.bwd.max)


_ALGOS = ("max", "most_recent")


class DelayedScaling:
    """Scale from the history of amaxes of earlier steps (Transformer Engine's default recipe).

    margin: scale = fp8_max / amax / 2**margin.
    amax_compute_algo: "max" (of the history), "most_recent", or a callable
        f(amax_history [L, n]) -> amax [n].
    scaling_factor_compute_algo: None, or f(amax, scale, fp8_max, recipe) -> new scale.
    reduce_amax: kept for Transformer Engine compatibility; a no-op on one device.
    interval: removed from Transformer Engine; accepted and ignored with a warning.
    """

    def __init__(self, margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
                 amax_compute_algo="max", scaling_factor_compute_algo=None, reduce_amax=True,
                 interval=None, fp8_dpa=False, fp8_mha=False):
        if interval is not None:
            warnings.warn("DelayedScaling(interval=...) is deprecated and ignored: the scale "
                          "is updated every step, as in Transformer Engine", DeprecationWarning,
                          stacklevel=2)
        if not isinstance(fp8_format, Format):
            raise TypeError(f"fp8_format must be a tecupy.recipe.Format, got {fp8_format!r}")
        if fp8_format is Format.E5M2:
            raise ValueError("pure E5M2 training is not supported (as in Transformer Engine); "
                             "use Format.HYBRID or Format.E4M3")
        if not (callable(amax_compute_algo) or amax_compute_algo in _ALGOS):
            raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, "
                             f"got {amax_compute_algo!r}")
        if int(amax_history_len) < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {amax_history_len}")
        if scaling_factor_compute_algo is not None and not callable(scaling_factor_compute_algo):
            raise TypeError("scaling_factor_compute_algo must be None or a callable")
        self.margin, self.fp8_format = margin, fp8_format
        self.amax_history_len = int(amax_history_len)
        self.amax_compute_algo = amax_compute_algo
        self.scaling_factor_compute_algo = scaling_factor_compute_algo
        self.reduce_amax, self.fp8_dpa, self.fp8_mha = reduce_amax, fp8_dpa, fp8_mha

    def __repr__(self):
        return (f"DelayedScaling(margin={self.margin}, fp8_format={self.fp8_format.name}, "
                f"amax_history_len={self.amax_history_len}, "
                f"amax_compute_algo={self.amax_compute_algo!r})")


class Float8CurrentScaling:
    """Per-tensor scaling from this step's own amax: no history, no state."""

    def __init__(self, fp8_format=Format.HYBRID):
        if not isinstance(fp8_format, Format):
            raise TypeError(f"fp8_format must be a tecupy.recipe.Format, got {fp8_format!r}")
        self.fp8_format = fp8_format

    def __repr__(self):
        return f"Float8CurrentScaling(fp8_format={self.fp8_format.name})"
