"""python -m tecupy --check (or python -m tecupy.check): can this machine run tecupy's
kernels? A broken setup shows in seconds instead of as a slow silent fallback.

Prints the versions (Python, NumPy, CuPy, NVRTC, the CUDA driver), the GPU or one line
saying why there is none, the header roots and whether the CUDA, CCCL and CUTLASS/CuTe
headers are there, and the cache folder; compiles one small kernel with NVRTC past the
cache. On a GPU it then compiles and runs one instantiation of each kernel family through
the public ops (forward and backward, TECUPY_STRICT=1 so a failure is reported, not fallen
back from), compares each with the NumPy reference (loosely: this finds broken builds and
garbage, the tests check accuracy) and prints ok / FAILED, the time with compiling and
which implementation each op chose. Exit status 1 when a family failed on a GPU; a
machine with no usable GPU is a supported setup (NumPy reference) and exits 0.
"""
import contextlib
import os
import platform
import re
import sys
import time

import numpy as np

import tecupy
from . import backends, loader
from ._array import to_numpy
from .fp8 import FP8Tensor
from .recipe import DelayedScaling, Float8CurrentScaling

NVRTC_PROBE = ("delayed_scaling.cu", "delayed_scaling_update")  # the smallest kernel
NO_GPU_ARCH = "sm_90a"  # what the NVRTC probe compiles for without a GPU
# Header roots: what a root provides, told by a file the kernels include, and the version
# it defines (CUDA_VERSION 13000 = 13.0, CCCL_VERSION 3000001 = 3.0.1).
HEADERS = (("CUDA", "cuda_fp8.h", "cuda.h", r"#define CUDA_VERSION (\d+)",
            lambda v: f"{v // 1000}.{v % 1000 // 10}"),
           ("CCCL", "cuda/std/type_traits", "cuda/std/__cccl/version.h",
            r"#define CCCL_VERSION (\d+)",
            lambda v: f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"),
           ("CUTLASS/CuTe", "cute/tensor.hpp", "cutlass/version.h",
            r"#define CUTLASS_MAJOR (\d+)\s+#define CUTLASS_MINOR (\d+)\s+"
            r"#define CUTLASS_PATCH (\d+)", None))


def gpu_problem():
    """None when CuPy sees a GPU tecupy can use (sm_80 or newer), else one line why not."""
    try:
        import cupy
    except Exception as err:  # not installed, or its CUDA libraries are missing
        return f"CuPy cannot be imported ({type(err).__name__}: {err})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no driver, no device, or a driver older than CuPy's CUDA
        import ctypes.util
        if "NoDevice" in str(err):  # cudaErrorNoDevice, e.g. CUDA_VISIBLE_DEVICES=""
            return "CuPy sees no CUDA device"
        if ctypes.util.find_library("cuda") is None:
            return "no NVIDIA driver is installed (libcuda not found)"
        return (f"the NVIDIA driver cannot run CUDA 13 (it needs driver 580 or newer): "
                f"{str(err).strip() or type(err).__name__}")
    if count == 0:
        return "CuPy sees no CUDA device"
    cc = int(cupy.cuda.Device().compute_capability)
    if cc < 80:
        return f"the GPU ({_gpu_name()}) is sm_{cc}; tecupy's kernels need sm_80 or newer"
    return None


def _gpu_name():
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _cuda_version(v):
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def _version_lines(problem):
    lines = [f"tecupy {tecupy.__version__}: setup check",
             f"python        {platform.python_version()}", f"numpy         {np.__version__}"]
    try:
        import cupy
        from cupy.cuda import nvrtc
        rt = cupy.cuda.runtime
        lines.append(f"cupy          {cupy.__version__} (CUDA runtime "
                     f"{_cuda_version(rt.runtimeGetVersion())})")
        lines.append("nvrtc         {}.{}".format(*nvrtc.getVersion()))
        lines.append(f"cuda driver   {_cuda_version(rt.driverGetVersion())}")
    except Exception as err:  # a CuPy that cannot load is reported by gpu_problem too
        lines.append(f"cupy          unusable ({type(err).__name__}: {err})")
    if problem:
        lines.append(f"gpu           none: {problem}")
    else:
        import cupy
        dev = cupy.cuda.Device()
        lines.append(f"gpu           {_gpu_name()}, sm_{dev.compute_capability} "
                     f"(kernels built for {loader.arch_of_device()})")
    return lines


def _header_lines():
    """The include roots with what each provides, whether every header family the kernels
    need is there, and the cache folder."""
    lines, found = ["include roots (searched in this order):"], {}
    for d in loader.include_dirs():
        have = [f"{family} {_version(d, entry)}" for family, *entry in HEADERS
                if (d / entry[0]).is_file()]
        for item in have:
            found.setdefault(item.rsplit(" ", 1)[0], item)
        lines.append(f"  {d}" + (f"  ({', '.join(have)})" if have else ""))
    lines.append("headers       " + ", ".join(
        found.get(family, f"{family} MISSING (no root has {needed})")
        for family, needed, *_ in HEADERS))
    lines.append(f"cache         {loader.cache_dir()}")
    return lines


def _version(root, entry):
    """The version a header root defines, as x.y[.z], or '?'."""
    _, version_file, pattern, fmt = entry
    m = re.search(pattern, _read(root / version_file))
    if not m:
        return "?"
    return fmt(int(m.group(1))) if fmt else ".".join(m.groups())


def _read(path):
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _nvrtc_line(arch):
    """Compile the smallest kernel past the cache: NVRTC and the headers work here."""
    file, name = NVRTC_PROBE
    t0 = time.perf_counter()
    try:
        binary, _ = loader.compile_uncached(file, name, arch)
        if binary[:4] != b"\x7fELF":
            raise loader.CompileError("NVRTC returned something that is not a cubin")
    except Exception as err:
        return False, f"nvrtc compile FAILED: {file} for {arch}: {_reason(err)}"
    return True, (f"nvrtc compile ok: {file} for {arch}, {len(binary)} bytes, "
                  f"{time.perf_counter() - t0:.2f} s")


def _reason(err):
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}"


# ---- one probe per kernel family: public ops on tiny inputs, forward and backward ------

BF16 = tecupy.bfloat16


def _randn(xp, shape, dtype, seed, scale=1.0):
    a = np.random.default_rng(seed).standard_normal(shape) * scale
    return xp.asarray(a.astype(dtype))


def _with_grads(xp, fn, *inputs):
    """[fn(*inputs), its gradients w.r.t. inputs for a fixed random output gradient]."""
    with tecupy.Tape() as tape:
        y = fn(*inputs)
    dy = _randn(xp, y.shape, y.dtype, seed=99)
    return [y] + tape.gradient(y, list(inputs), output_grad=dy)


def _cast(xp):
    q = tecupy.quantize(_randn(xp, (64, 256), np.float32, 1, scale=50.0), 1.0, "e4m3")
    return [q.dequantize(np.float32)]


def _norm(xp):
    x, w, b = (_randn(xp, s, BF16, seed) for s, seed in (((64, 256), 2), ((256,), 3),
                                                         ((256,), 4)))
    return _with_grads(xp, tecupy.layernorm, x, w, b)


def _scaling(xp):
    state = tecupy.FP8State()
    state.bind(xp, DelayedScaling(amax_history_len=4))
    state.fwd.amax_history[...] = xp.abs(_randn(xp, (4, 3), np.float32, 8))
    state.update_forward()
    return [state.fwd.scale, state.fwd.scale_inv, state.fwd.amax_history]


def _transpose(xp):
    codes = np.random.default_rng(9).integers(0, 0x7F, (64, 128), dtype=np.uint8)
    return [FP8Tensor(xp.asarray(codes), "e4m3", xp.ones((1,), np.float32)).transpose().data]


def _attention(xp):
    q, k, v = (_randn(xp, (2, 64, 2, 64), BF16, seed) for seed in (10, 11, 12))
    return _with_grads(xp, lambda *t: tecupy.dot_product_attention(*t, "causal"), q, k, v)


def _fp8_gemm(xp):
    x, w = _randn(xp, (32, 64), BF16, 13), _randn(xp, (64, 64), BF16, 14, scale=0.1)
    with tecupy.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        return _with_grads(xp, tecupy.linear, x, w)


# family -> (probe(xp) -> arrays, largest error allowed relative to the reference's max|.|)
PROBES = {
    "cast": (_cast, 0.07),  # one E4M3 step
    "norm": (_norm, 0.05),
    "act": (lambda xp: _with_grads(xp, tecupy.gelu, _randn(xp, (64, 256), BF16, 5)), 0.05),
    "softmax": (lambda xp: _with_grads(xp, tecupy.softmax, _randn(xp, (64, 256), BF16, 6)),
                0.05),
    "dropout": (lambda xp: _with_grads(xp, lambda x: tecupy.dropout(x, 0.1, seed=7),
                                       _randn(xp, (64, 256), BF16, 7)), 0.05),
    "delayed_scaling": (_scaling, 1e-6),
    "transpose": (_transpose, 0.0),
    "attention": (_attention, 0.05),
    "fp8_gemm": (_fp8_gemm, 0.05),
}


def max_error(got, want):
    """The largest |got - want| over the largest |want|, over pairs of arrays (NaN: inf)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = (to_numpy(a).astype(np.float64) for a in (g, w))
        if g.shape != w.shape:
            raise ValueError(f"shape {g.shape}, the reference's {w.shape}")
        err = np.abs(g - w).max(initial=0.0) / max(np.abs(w).max(initial=0.0), 1e-30)
        worst = max(worst, err if np.isfinite(err) else np.inf)
    return worst


@contextlib.contextmanager
def _recording(chosen):
    """Note backends.chosen(op, ...) of every dispatch in the block into `chosen` (through
    the module attribute every op calls; only for the check, off the hot path)."""
    real = backends.dispatch

    def dispatch(op, *args, **kwargs):
        chosen.setdefault(op, backends.chosen(op, *args, **kwargs))
        return real(op, *args, **kwargs)
    backends.dispatch = dispatch
    try:
        yield
    finally:
        backends.dispatch = real


def run_family(name, xp):
    """(ok, line) for one family: its probe on `xp` (cupy on a GPU) against NumPy."""
    probe, tol = PROBES[name]
    chosen = {}
    t0 = time.perf_counter()
    try:
        with _recording(chosen):
            got = probe(xp)
            if hasattr(xp, "cuda"):
                xp.cuda.Device().synchronize()  # a failing launch shows here
        secs = time.perf_counter() - t0
        err = max_error(got, probe(np))
    except Exception as e:  # a failure is what the check reports
        return False, f"  {name:16s} FAILED  {_reason(e)}"
    kinds = " ".join(f"{op}={kind}" for op, kind in chosen.items())
    if not err <= tol:
        return False, (f"  {name:16s} FAILED  error {err:.2e} > {tol:g} against the NumPy "
                       f"reference  ({kinds})")
    return True, f"  {name:16s} ok  {secs:6.2f} s  error {err:.1e}  {kinds}"


@contextlib.contextmanager
def _strict():
    old = os.environ.get("TECUPY_STRICT")
    os.environ["TECUPY_STRICT"] = "1"  # a failing kernel is reported, not fallen back from
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TECUPY_STRICT", None)
        else:
            os.environ["TECUPY_STRICT"] = old


def _gpu_arrays():
    import cupy
    return cupy


def _families(echo):
    xp = _gpu_arrays()
    echo("kernel families (compiled and run on this GPU with TECUPY_STRICT=1, time with "
         "compiling; op=implementation chosen):")
    failed = []
    with _strict():
        for name in PROBES:
            ok, line = run_family(name, xp)
            echo(line)
            failed += [] if ok else [name]
    return failed


def check(echo=None):
    """(ok, text) of the whole check; `echo(line)` also gets each line as it comes."""
    lines = []

    def say(line):
        lines.append(line)
        if echo is not None:
            echo(line)
    problem = gpu_problem()
    for line in _version_lines(problem) + _header_lines():
        say(line)
    nvrtc_ok, line = _nvrtc_line(NO_GPU_ARCH if problem else loader.arch_of_device())
    say(line)
    if problem:
        say("no GPU: kernels not run; every op uses the NumPy reference on this machine "
            "(a supported setup)")
        return True, "\n".join(lines)
    t0 = time.perf_counter()
    failed = _families(say) + ([] if nvrtc_ok else ["nvrtc"])
    for (op, kind), err in backends.failures().items():
        say(f"remembered failure in this process: {kind} {op}: {_reason(err)}")
    say(f"result: {'ok' if not failed else 'FAILED: ' + ', '.join(failed)} "
        f"({time.perf_counter() - t0:.1f} s)")
    return not failed, "\n".join(lines)


def main():
    """Print the check as it runs; 0 when ok (or no usable GPU), 1 when something failed."""
    ok, _ = check(echo=print)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
