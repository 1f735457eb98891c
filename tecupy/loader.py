"""The one module that owns NVRTC: kernel sources, include paths, options, the cubin cache
and error messages.

Sources are `cuda/*.cu` and `cutlass_templates/*.cu` (from a checkout: <repo>/cuda; from an
install: tecupy/cuda). Each kernel module in tecupy/kernels declares its file, the template
instantiations it needs, and optionally the archs it is for and extra NVRTC options
(`declare`); `function` compiles them once per (file, arch, options) with NVRTC into a cubin
kept on disk (TECUPY_CACHE_DIR, default ~/.cache/tecupy) and loads it with CuPy.
Compiling needs no GPU, so `python -m tecupy.build --arch sm_90a` fills the cache ahead of
time on any machine.

The cache cannot lie: an entry is <stem>-<arch>-<key>.cubin plus a .json holding the
instantiation's name, its lowered name and the cubin's size and sha256; the key covers the
file, arch, options, NVRTC version, the sources and the versions of every header root
(CUDA, CCCL, CUTLASS). An entry that fails any check is rebuilt with a warning naming the
file. Files are written to unique temp names and moved into place (os.replace), and one
flock per entry lets one process (or thread) build it while the others wait and reuse it.
"""
import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import tempfile
import warnings
from importlib import metadata

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, the writes stay atomic
    fcntl = None

_PKG = pathlib.Path(__file__).resolve().parent
BASE_OPTIONS = ("-std=c++17",)  # no fast math: denormals and IEEE division as TE
_declared = {}   # file name -> sorted name expressions
_file_meta = {}  # file name -> (archs it is built for or None = all, extra NVRTC options)
_functions = {}  # (file, name, arch, options) -> cupy function


class CompileError(RuntimeError):
    pass


def _source_dir(name):
    for d in (_PKG / name, _PKG.parent / name):
        if d.is_dir() and any(d.glob("*.cu")):
            return d
    raise FileNotFoundError(f"tecupy: no {name}/*.cu next to {_PKG} (checkout) or inside it "
                            "(install); the package is incomplete")


def cuda_dir():
    return _source_dir("cuda")


def templates_dir():
    return _source_dir("cutlass_templates")


def source_path(file):
    """cuda/<file>, else cutlass_templates/<file>."""
    for d in (cuda_dir(), templates_dir()):
        if (d / file).exists():
            return d / file
    raise FileNotFoundError(f"tecupy: {file} is in neither {cuda_dir()} nor {templates_dir()}")


def toolkits():
    """CUDA toolkit roots that may exist: CUDA_PATH, CUDA_HOME, /usr/local/cuda."""
    roots = [pathlib.Path(os.environ[v]) for v in ("CUDA_PATH", "CUDA_HOME")
             if os.environ.get(v)]
    return roots + [pathlib.Path("/usr/local/cuda")]


def include_dirs():
    """The cuda/ folder, pip CUDA headers (nvidia-cuda-runtime, -cccl, -crt), CUTLASS from
    nvidia-cutlass, and a CUDA toolkit's include/ and include/cccl (CUDA_PATH / CUDA_HOME /
    /usr/local/cuda)."""
    dirs = [cuda_dir()]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        root = pathlib.Path(root)
        dirs += [root / "cu13" / "include", root / "cu13" / "include" / "cccl"]
        dirs += sorted(root.glob("cuda_*/include"))
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.origin:
        src = pathlib.Path(spec.origin).parent / "source"
        dirs += [src / "include", src / "tools" / "util" / "include"]
    for root in toolkits():  # CUDA 13 toolkits keep CCCL (cuda/std, cub, thrust) in cccl/
        dirs += [root / "include", root / "include" / "cccl"]
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def arch_of_device():
    """sm_90a on Hopper (wgmma, TMA), else sm_<cc> of the current device."""
    import cupy
    cc = cupy.cuda.Device().compute_capability
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def declare(file, name_expressions, archs=None, options=()):
    """Record the template instantiations a kernel module needs from `file`, the archs the
    file is for (None: every arch) and extra NVRTC options it needs."""
    _declared[file] = sorted(set(_declared.get(file, ())) | set(name_expressions))
    _file_meta[file] = (None if archs is None else tuple(archs), tuple(options))


def declared(arch=None):
    """file -> name expressions, only files built for `arch` when one is given."""
    return {f: n for f, n in _declared.items()
            if arch is None or _file_meta[f][0] is None or arch in _file_meta[f][0]}


def cache_dir():
    d = pathlib.Path(os.environ.get("TECUPY_CACHE_DIR", pathlib.Path.home() / ".cache" /
                                    "tecupy"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(file, arch, names, options):
    from cupy.cuda import nvrtc
    h = hashlib.sha256(repr((file, arch, names, options, nvrtc.getVersion())).encode())
    path = source_path(file)
    h.update(path.read_bytes())
    h.update(_sources_digest(path.parent))
    if path.parent != cuda_dir():  # cuda/ is on every file's include path (the GEMM
        h.update(_sources_digest(cuda_dir()))  # includes act_math.cuh): its headers key it
    h.update(header_stamp(include_dirs()))
    return h.hexdigest()[:20]


# Files whose bytes change with the version of a header root: a toolkit's or the pip
# wheels' CUDA headers, CCCL, CUTLASS/CuTe ("../version.json": a toolkit's full version).
_VERSION_FILES = ("cuda.h", "cuda_runtime_api.h", "cuda/std/__cccl/version.h",
                  "cutlass/version.h", "../version.json")
# pip packages that ship headers: a patch release may leave the version headers alone.
_HEADER_PACKAGES = ("nvidia-cutlass", "nvidia-cuda-cccl", "nvidia-cuda-runtime",
                    "nvidia-cuda-crt", "nvidia-cuda-nvrtc")
_stamps = {}  # tuple of include dirs -> digest (once per process: ~10 ms of hashing)


def header_stamp(dirs):
    """Digest of the versions of the header roots `dirs`: the bytes of each root's version
    files and the versions of the header packages, so upgrading nvidia-cutlass or a
    toolkit rebuilds the kernels (the roots' own paths are left out: two environments
    with the same headers share entries)."""
    key = tuple(dirs)
    if key not in _stamps:
        h = hashlib.sha256()
        for d in dirs:
            for name in _VERSION_FILES:
                if (d / name).is_file():
                    h.update(name.encode() + (d / name).read_bytes())
        h.update(repr(_package_versions()).encode())
        _stamps[key] = h.digest()
    return _stamps[key]


def _package_versions():
    out = []
    for name in _HEADER_PACKAGES:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, None))
    return out


_digest = {}


def _sources_digest(folder):
    """Digest of the headers (*.cuh) of a source's folder: a shared header's change rebuilds
    the folder's kernels, an edit of one .cu file only that file's (no .cu includes another);
    recomputed when a header's mtime changes."""
    files = sorted(folder.glob("*.cuh"))
    stamp = tuple((f.name, f.stat().st_mtime_ns) for f in files)
    if _digest.get(folder, (None,))[0] != stamp:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + f.read_bytes())
        _digest[folder] = (stamp, h.digest())
    return _digest[folder][1]


def nvrtc_options(file, arch, options=()):
    """The NVRTC options of a kernel of `file` for `arch` (without the include paths)."""
    return BASE_OPTIONS + _file_meta.get(file, (None, ()))[1] + tuple(options) + \
        (f"-arch={arch}",)


def compile_uncached(file, name, arch, options=()):
    """(cubin bytes, lowered name) straight from NVRTC, past the cache: proof that NVRTC
    and the headers work here (python -m tecupy --check)."""
    binary, lowered = _nvrtc(file, (name,), nvrtc_options(file, arch, options))
    return binary, lowered[name]


def compile_together(file, names, arch):
    """(cubin bytes, {name: lowered}) of many instantiations of `file` in ONE program, past
    the cache: the headers are parsed once, so checking that every kernel of a file compiles
    costs about a quarter of a program per kernel (python -m tecupy.build --check-only)."""
    return _nvrtc(file, tuple(names), nvrtc_options(file, arch))


def compile_kernel(file, name, arch, options=()):
    """Compile one declared instantiation `name` of cuda/<file> for `arch` (each kernel is
    its own small program, so a first call compiles only what it runs); returns
    (cubin path, lowered name). Cached on disk; a bad entry is rebuilt with a warning."""
    options = nvrtc_options(file, arch, options)
    base = cache_dir() / f"{pathlib.Path(file).stem}-{arch}-{_key(file, arch, name, options)}"
    hit = _cached(base, name)
    if hit is None:
        with _entry_lock(base):
            hit = _cached(base, name, warn=True)  # built by another while we waited?
            if hit is None:
                binary, lowered = _nvrtc(file, (name,), options)
                hit = _store(base, name, binary, lowered[name])
    return hit


def _cached(base, name, warn=False):
    """(cubin path, lowered name) of a whole entry at `base`, else None; a present but bad
    entry also warns, naming the file, when `warn` (the caller then rebuilds it)."""
    cubin = base.with_suffix(".cubin")
    lowered, why = _check_entry(cubin, base.with_suffix(".json"), name)
    if lowered is not None:
        return cubin, lowered
    if why and warn:
        warnings.warn(f"tecupy: cache entry {why}; rebuilding it", RuntimeWarning,
                      stacklevel=3)
    return None


def _check_entry(cubin, meta, name):
    """(lowered name, None) when `meta` parses, names `name` and gives the size and sha256
    of `cubin`; else (None, why), why "" when neither file exists (a plain miss)."""
    if not meta.exists():
        return None, (f"{cubin} has no metadata {meta.name}" if cubin.exists() else "")
    if not cubin.exists():
        return None, f"{meta} has no cubin {cubin.name}"
    try:
        info = json.loads(meta.read_text())
        lowered, size, sha, named = info["lowered"], info["size"], info["sha256"], info["name"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # truncated, garbage, old
        return None, f"{meta} is not valid metadata ({type(err).__name__}: {err})"
    if named != name or not isinstance(lowered, str):
        return None, f"{meta} is for {named!r}, not {name!r}"
    try:
        data = cubin.read_bytes()
    except OSError as err:
        return None, f"{cubin} cannot be read ({err})"
    if len(data) != size:
        return None, f"{cubin} has {len(data)} bytes, its metadata says {size}"
    if hashlib.sha256(data).hexdigest() != sha:
        return None, f"{cubin} does not match the sha256 in its metadata"
    return lowered, None


@contextlib.contextmanager
def _entry_lock(base):
    """An exclusive flock on <entry>.lock across processes; also across threads, as each
    open() is a lock of its own. The .lock file stays: deleting it would let a waiter and
    a newcomer lock two different files."""
    if fcntl is None:
        yield
        return
    with open(base.with_suffix(".lock"), "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _store(base, name, binary, lowered):
    """Write the cubin, then its metadata (a crash between leaves a cubin with no metadata:
    a miss, never a hit)."""
    cubin = base.with_suffix(".cubin")
    _write_atomic(cubin, binary)
    info = {"name": name, "lowered": lowered, "size": len(binary),
            "sha256": hashlib.sha256(binary).hexdigest()}
    _write_atomic(base.with_suffix(".json"), json.dumps(info).encode())
    return cubin, lowered


def _write_atomic(path, data):
    """A temp file in the same folder, unique per process and thread (mkstemp), moved into
    place with os.replace: a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp's 0600 would hide a shared cache from others
            os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def compile_file(file, arch, options=()):
    """Compile every declared instantiation of cuda/<file> (what the build command does)."""
    return [compile_kernel(file, n, arch, options) for n in _declared.get(file, ())]


def _nvrtc(file, names, options):
    from cupy.cuda import nvrtc
    path = source_path(file)
    opts = list(options) + [f"-I{d}" for d in include_dirs()]
    prog = nvrtc.createProgram(path.read_text(), str(path), [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            _compile_program(nvrtc, prog, opts)
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed to compile {path}\noptions: {' '.join(opts)}\n"
                               f"{err}\n{log}") from None
        return (whole_elf(nvrtc.getCUBIN(prog)),
                {n: nvrtc.getLoweredName(prog, n) for n in names})
    finally:
        nvrtc.destroyProgram(prog)


def whole_elf(binary):
    """The cubin padded to the extent its ELF headers give. CuPy 14's nvrtc.getCUBIN returns
    one byte less than nvrtcGetCUBINSize (read as a string): the last byte of the program
    header table, the high byte of a small p_align, so zero. The driver loads either, but
    nvdisasm rejects the short one ("invalid ELF")."""
    import struct
    if binary[:4] != b"\x7fELF" or binary[4] != 2:  # not a 64-bit ELF: leave it
        return binary
    phoff, shoff = struct.unpack_from("<QQ", binary, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", binary, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        kind, _, _, off, size = struct.unpack_from("<IQQQQ", binary, shoff + i * shentsize + 4)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            end = max(end, off + size)
    return binary + b"\0" * max(0, end - len(binary))


_pinned = []  # the NVRTC builtins library, held open for the life of the process


def _compile_program(nvrtc, prog, opts):
    """nvrtcCompileProgram. NVRTC opens and closes its builtins library around each compile;
    two threads doing so at once sometimes fail with "failed to open libnvrtc-builtins"
    (about 1 compile in 60 with 4 threads here). Holding the library open avoids it."""
    if not _pinned:
        _pinned.append(_open_builtins(nvrtc))
    nvrtc.compileProgram(prog, opts)


def _open_builtins(nvrtc):
    import ctypes
    major = nvrtc.getVersion()[0]
    spec = importlib.util.find_spec("nvidia")
    roots = [pathlib.Path(r) / sub for r in (spec.submodule_search_locations if spec else [])
             for sub in (f"cu{major}/lib", "cuda_nvrtc/lib")]
    roots += [t / "lib64" for t in toolkits()]
    for root in roots:
        for lib in sorted(root.glob(f"libnvrtc-builtins.so.{major}*")):
            try:
                return ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
    return None  # not found: NVRTC still works, parallel builds may need a retry


def function(file, name, options=()):
    """The kernel `name` (a declared name expression, e.g. "cast_to_fp8<float, __nv_fp8_e4m3>")
    of cuda/<file>, compiled for the current device and loaded."""
    import cupy
    key = (file, name, tuple(options), cupy.cuda.runtime.getDevice())
    if key not in _functions:  # the hot path is this one dictionary lookup
        arch = arch_of_device()
        if name not in _declared.get(file, ()):
            raise KeyError(f"{name!r} is not declared for {file}; declared: "
                           f"{_declared.get(file, [])}")
        cubin, lowered = compile_kernel(file, name, arch, options)
        module = cupy.RawModule(path=str(cubin))
        _functions[key] = (module, module.get_function(lowered))
    return _functions[key][1]
