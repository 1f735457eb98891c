"""Backend registry: op name -> implementations, each with a kind and a priority.

An op name is a kernel name such as ``layernorm_fwd``; its family is the name without the
``_fwd`` / ``_bwd`` / ``_fwd_fp8`` suffix (``layernorm``), which is what TECUPY_OP_BACKENDS
speaks of.

Selection for one call: the implementations that support the inputs, ordered by
  1. TECUPY_OP_BACKENDS="linear=reference,layernorm=cuda|reference" (per op family),
  2. TECUPY_BACKEND=<kind> (preferred kind for every op),
  3. priority (cutlass 30 > cuda 20 > reference 0 by default).
The first one runs; if it raises, the next one is tried with a warning, unless
TECUPY_STRICT=1, which makes the failure an error. TECUPY_PLUGINS="pkg.mod,other" names
modules to import (they call `register`); installed packages register through the
entry-point group ``tecupy.backends`` (each entry point is a module or a callable).
"""
import dataclasses
import importlib
import os
import warnings
from importlib import metadata

DEFAULT_PRIORITY = {"cutlass": 30, "cuda": 20, "reference": 0}
_registry = {}  # op name -> list of Impl
_plugins_loaded = False
_order_cache = {}  # (op, env settings, count) -> implementations in preference order


@dataclasses.dataclass
class Impl:
    op: str
    kind: str
    priority: int
    fn: object
    supports: object  # callable(*args, **kwargs) -> bool, or None for "everything"

    def accepts(self, args, kwargs):
        return self.supports is None or bool(self.supports(*args, **kwargs))


def register(op, kind, priority=None, supports=None):
    """Decorator: register `fn` as the `kind` implementation of `op`."""
    def deco(fn):
        prio = DEFAULT_PRIORITY.get(kind, 10) if priority is None else priority
        impls = [i for i in _registry.get(op, []) if i.kind != kind]
        impls.append(Impl(op, kind, prio, fn, supports))
        _registry[op] = impls
        _order_cache.clear()
        return fn
    return deco


def family(op):
    for suffix in ("_fwd_fp8", "_fwd", "_bwd"):
        if op.endswith(suffix):
            return op[: -len(suffix)]
    return op


def _op_preferences(op):
    spec = os.environ.get("TECUPY_OP_BACKENDS", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, kinds = item.partition("=")
        if not sep:
            raise ValueError(f"TECUPY_OP_BACKENDS entry {item!r} is not of the form op=kind[|kind]")
        if name.strip() in (op, family(op)):
            return [k.strip() for k in kinds.split("|") if k.strip()]
    return []


def _load_plugins():
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name in filter(None, (s.strip() for s in os.environ.get("TECUPY_PLUGINS", "").split(","))):
        importlib.import_module(name)
    for ep in metadata.entry_points(group="tecupy.backends"):
        obj = ep.load()
        if callable(obj):
            obj()


_env_keys = {}


def _env(name):
    """os.environ.get(name, "") for the settings read on every dispatch: through the
    environment's own mapping, as os.environ.get of an unset name costs ~1 us (a KeyError
    raised and caught)."""
    data = getattr(os.environ, "_data", None)  # (CPython's os._Environ)
    if data is None:
        return os.environ.get(name, "")
    key = _env_keys.get(name)
    if key is None:
        key = _env_keys[name] = os.environ.encodekey(name)
    value = data.get(key)
    return "" if value is None else os.environ.decodevalue(value)


def _ordered(op):
    """All implementations of `op` in preference order, cached per environment setting
    (dispatch is on every op's hot path)."""
    env = (_env("TECUPY_OP_BACKENDS"), _env("TECUPY_BACKEND"))
    key = (op, env, len(_registry.get(op, ())))
    if key not in _order_cache:
        _load_plugins()
        if op not in _registry:
            raise KeyError(f"no implementation registered for op {op!r}; "
                           f"registered: {sorted(_registry)}")
        prefs, kind_pref = _op_preferences(op), env[1].strip()

        def rank(i):
            per_op = prefs.index(i.kind) if i.kind in prefs else len(prefs)
            return (per_op, i.kind != kind_pref if kind_pref else False, -i.priority)
        _order_cache[key] = sorted(_registry[op], key=rank)
    return _order_cache[key]


def candidates(op, *args, **kwargs):
    """Implementations of `op` that accept these inputs, in the order they would be tried."""
    return [i for i in _ordered(op) if i.accepts(args, kwargs)]


def dispatch(op, *args, **kwargs):
    """Run the best implementation of `op`; fall back (or raise under TECUPY_STRICT=1).
    Only the first implementation that accepts the inputs is looked for before it runs:
    this is every op's hot path (the later ones' supports() cost ~1 us each)."""
    impls = _ordered(op)
    first = next((n for n, i in enumerate(impls) if i.accepts(args, kwargs)), None)
    if first is None:
        raise RuntimeError(f"no registered implementation of {op!r} supports these inputs")
    try:
        return impls[first].fn(*args, **kwargs)
    except (TypeError, ValueError):
        raise  # bad input is the caller's error, not the backend's
    except Exception as err:
        return _fall_back(op, impls[first], err, impls[first + 1:], args, kwargs)


def _fall_back(op, failed, err, later, args, kwargs):
    """After `failed` raised `err`: the next implementations that accept the inputs, each
    after a warning; re-raises under TECUPY_STRICT=1 or when none is left."""
    rest = [i for i in later if i.accepts(args, kwargs)]
    strict = os.environ.get("TECUPY_STRICT", "0") not in ("", "0")
    while True:
        if strict or not rest:
            raise err
        warnings.warn(f"tecupy: {failed.kind} implementation of {op} failed ({err!r}); "
                      f"falling back to {rest[0].kind}", RuntimeWarning, stacklevel=3)
        failed = rest.pop(0)
        try:
            return failed.fn(*args, **kwargs)
        except (TypeError, ValueError):
            raise
        except Exception as e:
            err = e


def registered():
    """{op: [(kind, priority), ...]} for every registered op."""
    _load_plugins()
    return {op: sorted(((i.kind, i.priority) for i in impls), key=lambda t: -t[1])
            for op, impls in sorted(_registry.items())}


def chosen(op, *args, **kwargs):
    """The kind that would run `op` on these inputs, or None."""
    impls = candidates(op, *args, **kwargs)
    return impls[0].kind if impls else None


def describe():
    """A printable table of registered ops and implementations."""
    lines = [f"{'op':28s} implementations (kind:priority, highest first)"]
    for op, impls in registered().items():
        lines.append(f"{op:28s} " + ", ".join(f"{k}:{p}" for k, p in impls))
    return "\n".join(lines)
