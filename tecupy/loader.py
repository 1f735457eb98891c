"""The one module that owns NVRTC: kernel sources, include paths, options, the cubin cache
and error messages.

Sources are `cuda/*.cu` and `cutlass_templates/*.cu` (from a checkout: <repo>/cuda; from an
install: tecupy/cuda). Each kernel module in tecupy/kernels declares its file, the template
instantiations it needs, and optionally the archs it is for and extra NVRTC options
(`declare`); `function` compiles them once per (file, arch, options) with NVRTC into a cubin
kept on disk (TECUPY_CACHE_DIR, default ~/.cache/tecupy) and loads it with CuPy.
Compiling needs no GPU, so `python -m tecupy.build --arch sm_90a` fills the cache ahead of
time on any machine.
"""
import hashlib
import importlib.util
import json
import os
import pathlib

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


def include_dirs():
    """The cuda/ folder, pip CUDA headers (nvidia-cuda-runtime, -cccl, -crt), CUTLASS from
    nvidia-cutlass, and a CUDA toolkit (CUDA_PATH / CUDA_HOME / /usr/local/cuda)."""
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
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            dirs.append(pathlib.Path(os.environ[var]) / "include")
    dirs.append(pathlib.Path("/usr/local/cuda/include"))
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
    h.update(_sources_digest(source_path(file).parent))
    return h.hexdigest()[:20]


_digest = {}


def _sources_digest(folder):
    """Digest of every *.cu* in the source's folder (a shared header change rebuilds the
    folder's kernels), recomputed when a file's mtime changes."""
    files = sorted(folder.glob("*.cu*"))
    stamp = tuple((f.name, f.stat().st_mtime_ns) for f in files)
    if _digest.get(folder, (None,))[0] != stamp:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + f.read_bytes())
        _digest[folder] = (stamp, h.digest())
    return _digest[folder][1]


def compile_kernel(file, name, arch, options=()):
    """Compile one declared instantiation `name` of cuda/<file> for `arch` (each kernel is
    its own small program, so a first call compiles only what it runs); returns
    (cubin path, lowered name). Cached on disk."""
    options = BASE_OPTIONS + _file_meta.get(file, (None, ()))[1] + tuple(options) + \
        (f"-arch={arch}",)
    base = cache_dir() / f"{pathlib.Path(file).stem}-{arch}-{_key(file, arch, name, options)}"
    cubin, meta = base.with_suffix(".cubin"), base.with_suffix(".json")
    if cubin.exists() and meta.exists():
        return cubin, json.loads(meta.read_text())[name]
    binary, lowered = _nvrtc(file, (name,), options)
    tmp = base.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(binary)
    meta.write_text(json.dumps(lowered))
    tmp.replace(cubin)  # atomic: a concurrent reader sees all or nothing
    return cubin, lowered[name]


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
    roots += [pathlib.Path(os.environ[v]) / "lib64" for v in ("CUDA_PATH", "CUDA_HOME")
              if os.environ.get(v)] + [pathlib.Path("/usr/local/cuda/lib64")]
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
