"""TEMPORARY (issue 20, step 1): the helpers that lived here moved, split by concern, into
dtypes (C type names, supports() tests, vec_width, cbool), launch (device queries, grids,
occupancy, plans, the PDL launch), tma (TMA descriptors), pools (amax slots, ring counters,
amax_args, amax_grid) and ring (ring planning and launch). This module only forwards to
them until the last `from .common import` is switched; then it is deleted.

Every name is re-exported, and a write goes to the owning module too, so
`monkeypatch.setattr(common, "PDL", False)` or `common._pools = {}` (the GPU tests do
both) still changes what the code there reads: a plain re-export would leave the owners
untouched."""
import sys as _sys
import types as _types

# (private names only here: `launch` must mean the function, as it did, not the module)
from . import dtypes as _dtypes, launch as _launch, pools as _pools_mod, ring as _ring, \
    tma as _tma

# name -> owning module, and each name copied here (pytest's monkeypatch reads the old
# value from this module's __dict__); modules that import a name from another come after
# its owner, so the owner is found first
_OWNER = {}
for _m in (_dtypes, _launch, _tma, _pools_mod, _ring):
    for _name, _value in vars(_m).items():
        if not _name.startswith("__") and _name not in _OWNER:
            _OWNER[_name] = _m
            globals()[_name] = _value
del _m, _name, _value


class _Forward(_types.ModuleType):
    """Writes (and deletes) reach the owner too."""

    def __setattr__(self, name, value):
        if name in _OWNER:
            setattr(_OWNER[name], name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in _OWNER:
            delattr(_OWNER[name], name)
        super().__delattr__(name)


_sys.modules[__name__].__class__ = _Forward
