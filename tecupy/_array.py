"""Array-module helpers: one code path for NumPy and CuPy, and the input checks every op uses."""
import numpy as np
import ml_dtypes

try:  # CuPy imports fine on a machine without a GPU; arrays need a device.
    import cupy
except ImportError:  # pragma: no cover - cupy is a declared dependency
    cupy = None

bfloat16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
_DTYPE_NAMES = "float16, bfloat16, float32, float64"


def gpu_available():
    """True when CuPy can see at least one CUDA device."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_cupy(x):
    return cupy is not None and isinstance(x, cupy.ndarray)


def xp_of(x):
    return cupy if is_cupy(x) else np


_CUPY_ARRAY = None if cupy is None else cupy.ndarray


def array_module(op, **arrays):
    """The one array module (numpy or cupy) of all non-None `arrays`; mixing is an error."""
    kind = None  # fast path (every op's): arrays all exactly numpy's or all exactly cupy's
    for a in arrays.values():
        t = type(a)
        if t is kind or a is None:
            continue
        if kind is not None or not (t is np.ndarray or t is _CUPY_ARRAY):
            return _array_module(op, arrays)  # mixed, a subclass or not an array
        kind = t
    return cupy if kind is not None and kind is _CUPY_ARRAY else np


def _array_module(op, arrays):
    kinds = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if getattr(a, "_tecupy_codes", False):  # an FP8 weight: its codes' module
            a = a.data
        if is_cupy(a):
            kinds.setdefault("cupy", name)
        elif isinstance(a, np.ndarray):
            kinds.setdefault("numpy", name)
        else:
            raise TypeError(f"{op}: {name} must be a numpy or cupy array, got {type(a).__name__}")
    if len(kinds) > 1:
        raise TypeError(f"{op}: {kinds['numpy']} is a numpy array but {kinds['cupy']} is a cupy "
                        "array; pass all arrays of one call on the same device")
    return cupy if "cupy" in kinds else np


FLOAT_SET = frozenset(FLOAT_DTYPES)  # (a set: one hash, not four comparisons)


def check_float(op, dtype=None, **arrays):
    """Every array in `arrays` is floating (fp16/bf16/fp32/fp64) and of one dtype; returns it."""
    for name, a in arrays.items():
        if a is None:
            continue
        if dtype is None:
            if a.dtype not in FLOAT_SET:
                raise TypeError(f"{op}: {name} has dtype {a.dtype}; accepted: {_DTYPE_NAMES}")
            dtype, first = a.dtype, name
        elif a.dtype != dtype:
            if a.dtype not in FLOAT_SET:
                raise TypeError(f"{op}: {name} has dtype {a.dtype}; accepted: {_DTYPE_NAMES}")
            raise TypeError(f"{op}: {name} has dtype {a.dtype} but {first} has {dtype}; "
                            "one call takes one floating dtype")
    return dtype


def check_shape(op, name, a, shape):
    """`a.shape == shape`, where None in `shape` matches any size."""
    if a is None:
        return
    got = a.shape
    if len(got) == len(shape):
        for s, d in zip(shape, got):  # (a loop: a generator costs ~1 us more per call)
            if s is not None and s != d:
                break
        else:
            return
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    raise ValueError(f"{op}: {name} has shape {tuple(a.shape)}, expected {want}")


def compute_dtype(dtype):
    """Low-precision inputs are computed in float32 (as Transformer Engine does); float64 stays."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def to_numpy(x):
    return cupy.asnumpy(x) if is_cupy(x) else np.asarray(x)


def row_of(a, b):
    """b is a row of a's last dimension that broadcasts over a's rows ((n,), (1, ..., n)):
    a + b has a's shape and b's gradient is dy's column sums."""
    return (0 < b.ndim <= a.ndim and b.shape[-1] == a.shape[-1] and b.size == a.shape[-1]
            and b.size != a.size)


def unbroadcast(g, shape):
    """Sum `g` down to `shape` (the inverse of NumPy broadcasting)."""
    if g.shape == tuple(shape):
        return g
    xp = xp_of(g)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return xp.reshape(g, shape)
