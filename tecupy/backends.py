"""Backend registry: op name -> implementations, each with a kind and a priority.

An op name is a kernel name such as ``layernorm_fwd``; its family is the name without the
``_fwd`` / ``_bwd`` / ``_fwd_fp8`` suffix (``layernorm``), which is what TECUPY_OP_BACKENDS
speaks of.

Selection for one call: the implementations that support the inputs, ordered by
  1. TECUPY_OP_BACKENDS="linear=reference,layernorm=cuda|reference" (per op family),
  2. TECUPY_BACKEND=<kind> (preferred kind for every op),
  3. priority (cutlass 30 > cuda 20 > reference 0 by default).
The first one runs; if it raises, the next one is tried with a warning, unless
TECUPY_STRICT=1, which makes the failure an error. A vendor implementation that fails to
build or load (NVRTC, the driver refusing the module) is remembered for the rest of the
process: it is warned about once, with the fallback's estimated cost, and skipped after
(`failures()`, `clear_failures()`). TECUPY_PLUGINS="pkg.mod,other" names
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
_failures = {}  # (op, kind) -> (error, its traceback) of a build or load failure

# How much slower the reference is likely to be than the vendor kernel on a GPU, per op
# family: an estimate, not a measurement. The reference's GEMMs run cuBLAS in float32
# (no FP8/bf16 tensor cores), attention writes the whole score matrix, the memory-bound
# ops run several CuPy kernels with float32 temporaries where ours make one pass.
SLOWDOWN = {"fp8_gemm": 50, "gemm": 15, "attention": 50, "layernorm": 10, "rmsnorm": 10,
            "softmax": 5, "dropout": 20, "delayed_scaling_update": 20, "cast_to_fp8": 10,
            "cast_transpose": 10, "cast_transpose_dbias": 10, "fp8_dequantize": 5,
            "fp8_transpose": 5, "add": 2, "bias_grad": 3}
DEFAULT_SLOWDOWN = 5  # activations and the rest


@dataclasses.dataclass
class Impl:
    op: str
    kind: str
    priority: int
    fn: object
    supports: object  # callable(*args, **kwargs) -> bool, or None for "everything"
    failure: object = None  # the remembered build/load error; fn then only raises it

    def accepts(self, args, kwargs):
        return self.supports is None or bool(self.supports(*args, **kwargs))


def register(op, kind, priority=None, supports=None):
    """Decorator: register `fn` as the `kind` implementation of `op`."""
    def deco(fn):
        prio = DEFAULT_PRIORITY.get(kind, 10) if priority is None else priority
        impls = [i for i in _registry.get(op, []) if i.kind != kind]
        impls.append(Impl(op, kind, prio, fn, supports))
        _registry[op] = impls
        _failures.pop((op, kind), None)  # a new implementation gets a new chance
        _order_cache.clear()
        _last.clear()
        _generation[0] += 1
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
    (dispatch is on every op's hot path): the op's last answer is kept with what it was
    given, the two settings' raw values and the registry's list, each compared by identity
    (an environment value set again is a new object: the general lookup, same answer)."""
    data = getattr(os.environ, "_data", None)  # the settings as raw bytes (see _env)
    if data is None:
        return _ordered_env(op, (os.environ.get("TECUPY_OP_BACKENDS"),
                                 os.environ.get("TECUPY_BACKEND")))
    per_op, kind = data.get(_OP_BACKENDS), data.get(_BACKEND)
    last = _last.get(op)
    if last is not None and last[0] is per_op and last[1] is kind \
            and last[2] is _registry.get(op) and last[3] == len(last[2]):
        return last[4]
    order = _ordered_env(op, (per_op, kind))
    impls = _registry.get(op)  # (_ordered_env raised where there is none)
    _last[op] = (per_op, kind, impls, len(impls), order)
    return order


_last = {}  # op -> (settings' raw values, its registry list and length, order); cleared
#            with _order_cache (a registration, a remembered or cleared failure)


def _ordered_env(op, env):
    key = (op, env, len(_registry.get(op, ())))
    order = _order_cache.get(key)
    if order is None:
        order = _order_cache[key] = _order(op)
    return order


_OP_BACKENDS, _BACKEND = (os.environ.encodekey(k) for k in ("TECUPY_OP_BACKENDS",
                                                            "TECUPY_BACKEND"))


def _order(op):
    _load_plugins()
    if op not in _registry:
        raise KeyError(f"no implementation registered for op {op!r}; "
                       f"registered: {sorted(_registry)}")
    prefs, kind_pref = _op_preferences(op), _env("TECUPY_BACKEND").strip()

    def rank(i):
        per_op = prefs.index(i.kind) if i.kind in prefs else len(prefs)
        return (per_op, i.kind != kind_pref if kind_pref else False, -i.priority)
    return [_stand_in(i) for i in sorted(_registry[op], key=rank)]


class _Remembered(Exception):
    """Raised by the stand-in of an implementation that failed to build or load."""


def _stand_in(impl):
    """`impl`, or where it failed to build or load, a copy whose fn raises _Remembered at
    once: dispatch's hot path stays as it is and the fallback skips it (no rebuild)."""
    failure = _failures.get((impl.op, impl.kind))
    if failure is None:
        return impl

    def failed(*args, **kwargs):
        raise _Remembered(*failure)
    return dataclasses.replace(impl, fn=failed, failure=failure[0])


def _strict():
    return _env("TECUPY_STRICT") not in ("", "0")


def candidates(op, *args, **kwargs):
    """Implementations of `op` that accept these inputs, in the order they would be tried
    (without those remembered as failed, unless TECUPY_STRICT=1 makes them errors)."""
    strict = _strict()
    return [i for i in _ordered(op) if (strict or i.failure is None) and i.accepts(args, kwargs)]


def dispatch(op, *args, **kwargs):
    """Run the best implementation of `op`; fall back (or raise under TECUPY_STRICT=1).
    Only the first implementation that accepts the inputs is looked for before it runs:
    this is every op's hot path (the later ones' supports() cost ~1 us each)."""
    impls = _ordered(op)
    for first, impl in enumerate(impls):  # (a plain loop: a generator costs ~1 us more)
        supports = impl.supports
        if supports is None or supports(*args, **kwargs):
            break
    else:
        raise RuntimeError(f"no registered implementation of {op!r} supports these inputs")
    try:
        return impl.fn(*args, **kwargs)
    except (TypeError, ValueError):
        raise  # bad input is the caller's error, not the backend's
    except Exception as err:
        return _fall_back(op, impl, err, impls[first + 1:], args, kwargs)


def choose(op, *args, **kwargs):
    """The implementation dispatch would run first for these inputs (None if none accepts
    them). A call site that keeps it (a launch plan of an op's common case) keeps it only
    while token() is unchanged and for inputs that every supports() answers alike for."""
    for impl in _ordered(op):
        if impl.supports is None or impl.supports(*args, **kwargs):
            return impl
    return None


_generation = [0]  # registrations, remembered and cleared failures so far (see token)


def token():
    """What dispatch's choice depends on besides the inputs: the registry's generation
    (register(), a remembered or cleared failure) and the settings' raw values
    (TECUPY_OP_BACKENDS, TECUPY_BACKEND, TECUPY_STRICT). Equal tokens: the same choice."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return (_generation[0],) + tuple(map(os.environ.get, _SETTINGS))
    return (_generation[0], data.get(_OP_BACKENDS), data.get(_BACKEND), data.get(_STRICT))


_SETTINGS = ("TECUPY_OP_BACKENDS", "TECUPY_BACKEND", "TECUPY_STRICT")
_STRICT = os.environ.encodekey("TECUPY_STRICT")


def _fall_back(op, failed, err, later, args, kwargs):
    """After `failed` raised `err`: the next implementations that accept the inputs, each
    after a warning; re-raises under TECUPY_STRICT=1 or when none is left."""
    rest = [i for i in later if i.accepts(args, kwargs)]
    strict = _strict()
    while True:
        quiet = isinstance(err, _Remembered)  # warned when it first failed
        if quiet:  # its first traceback, not one grown by every call since
            err = err.args[0].with_traceback(err.args[1])
        # remembered only where falling back is allowed (strict: every call raises)
        if not (quiet or strict) and isinstance(err, _build_errors()):
            _remember(op, failed.kind, err)
            if rest:
                _warn_build_failure(op, failed.kind, err, rest[0].kind)
            quiet = True
        if strict or not rest:
            raise err
        if not quiet:
            warnings.warn(f"tecupy: {failed.kind} implementation of {op} failed ({err!r}); "
                          f"falling back to {rest[0].kind} (TECUPY_STRICT=1 makes this an "
                          "error)", RuntimeWarning, stacklevel=3)
        failed = rest.pop(0)
        try:
            return failed.fn(*args, **kwargs)
        except (TypeError, ValueError):
            raise
        except Exception as e:
            err = e


_BUILD_ERRORS = []


def _build_errors():
    """The exceptions that mean a kernel failed to build or load: NVRTC (the loader's
    CompileError, CuPy's CompileException) and the driver (CUDADriverError: a module
    the GPU cannot load, a launch it refuses). TypeError/ValueError never get here."""
    if not _BUILD_ERRORS:
        from .loader import CompileError
        _BUILD_ERRORS.append(CompileError)
        try:
            from cupy.cuda import compiler, driver
            _BUILD_ERRORS.extend([compiler.CompileException, driver.CUDADriverError])
        except ImportError:
            pass
    return tuple(_BUILD_ERRORS)


def _remember(op, kind, err):
    _failures[(op, kind)] = (err, err.__traceback__)
    _order_cache.clear()
    _last.clear()
    _generation[0] += 1


def _warn_build_failure(op, kind, err, fallback):
    """The one warning for a remembered failure: what failed, the estimated cost, the cure."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    fam = family(op)
    factor = SLOWDOWN.get(op, SLOWDOWN.get(fam, DEFAULT_SLOWDOWN))
    warnings.warn(
        f"tecupy: the {kind} implementation of {op} failed to build or load "
        f"({type(err).__name__}: {first}); {op} runs on {fallback} for the rest of this "
        f"process, roughly {factor}x slower on a GPU (an estimate for {fam}). Set "
        f"TECUPY_STRICT=1 to make this an error; tecupy.backends.failures() has the full "
        f"error.", RuntimeWarning, stacklevel=4)


def failures():
    """{(op, kind): error} of the implementations that failed to build or load in this
    process and are skipped since."""
    return {key: err for key, (err, _) in _failures.items()}


def clear_failures():
    """Forget the remembered failures: the next call tries those implementations again
    (after a fix, e.g. a header installed or the cache cleared)."""
    _failures.clear()
    _order_cache.clear()
    _last.clear()
    _generation[0] += 1


def registered():
    """{op: [(kind, priority), ...]} for every registered op."""
    _load_plugins()
    return {op: sorted(((i.kind, i.priority) for i in impls), key=lambda t: -t[1])
            for op, impls in sorted(_registry.items())}


def chosen(op, *args, **kwargs):
    """The kind that would run `op` on these inputs (past remembered failures), or None."""
    impls = candidates(op, *args, **kwargs)
    return impls[0].kind if impls else None


def describe():
    """A printable table of registered ops and implementations."""
    lines = [f"{'op':28s} implementations (kind:priority, highest first)"]
    for op, impls in registered().items():
        lines.append(f"{op:28s} " + ", ".join(f"{k}:{p}" for k, p in impls))
    if _failures:
        lines.append("failed to build or load in this process (skipped; "
                     "tecupy.backends.clear_failures() retries):")
        for (op, kind), err in sorted(failures().items()):
            first = (str(err).strip().splitlines() or [""])[0][:100]
            lines.append(f"  {op:26s} {kind}: {type(err).__name__}: {first}")
    return "\n".join(lines)
